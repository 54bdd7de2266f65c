"""Slurm: the ``DMLC_*`` variables from ``SLURM_PROCID``, the task count and the compressed node list."""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvstore.errors import ConfigError
from kvstore.launch.managers.common import (
    DEFAULT_ROOT_PORT,
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    Adapter,
    Derivation,
    Job,
    has,
    place_rank,
    rank_and_size,
    read_int,
    read_text,
    root_port,
)

_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_GROUP = re.compile(r"\[([^\]]*)\]")


def expand_hostlist(spec: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a Slurm compressed host list: ``n[01-04,7]`` -> n01 n02 n03 n04 n7.

    Groups are separated by commas outside brackets (``a[1-2],b3,c[08-10]``);
    inside a bracket, comma-separated numbers and ``lo-hi`` ranges keep the
    width of ``lo`` (zero padding).  Names may hold dashes and dots
    (``gpu-node[1-2].cluster``) and several bracket groups
    (``rack[1-2]-n[1-2]``), which expand as Slurm does: the last group fastest,
    then the others from right to left, so for two groups the first is slowest
    (rack1-n1, rack1-n2, rack2-n1, rack2-n2).  ``name`` names the variable in
    errors.  Raises ConfigError for unbalanced or nested brackets, an empty
    group, a range that is not numeric or runs backwards, or an empty list.
    """
    hosts: list[str] = []
    for token in _split_top_level(spec, name):
        hosts.extend(_expand_token(token, spec, name))
    if not hosts:
        raise ConfigError(f"{name}={spec!r} names no host")
    return hosts


def _split_top_level(spec: str, name: str) -> list[str]:
    """The non-empty groups of ``spec``, split at commas and blanks outside brackets.  Raises
    ConfigError for nested or unbalanced brackets."""
    tokens, current, depth = [], "", 0
    for char in spec:
        if char == "[":
            if depth:
                raise ConfigError(f"{name}={spec!r}: nested '[' is not a Slurm host list")
            depth = 1
        elif char == "]":
            if not depth:
                raise ConfigError(f"{name}={spec!r}: ']' without a matching '['")
            depth = 0
        if char in ", \t\n" and not depth:
            tokens.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ConfigError(f"{name}={spec!r}: '[' without a matching ']'")
    tokens.append(current)
    return [t for t in tokens if t]


def _numbers(group: str, spec: str, name: str) -> list[str]:
    """The numbers a bracket's contents ``group`` stands for, zero padding kept.  Raises ConfigError
    for a part that is not a number or ``lo-hi`` range, or a range that runs backwards."""
    out = []
    for part in group.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ConfigError(f"{name}={spec!r}: [{group}] must hold numbers and lo-hi ranges")
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ConfigError(f"{name}={spec!r}: the range {lo}-{hi} runs backwards")
        out.extend(f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1))
    return out


def _expand_token(token: str, spec: str, name: str) -> list[str]:
    """The hosts of one group (``rack[1-2]-n[1-2]``), in Slurm's order.  Raises ConfigError as
    :func:`_numbers` does."""
    groups = list(_GROUP.finditer(token))
    if not groups:
        return [token]
    values = [_numbers(m.group(1), spec, name) for m in groups]
    texts = [token[: groups[0].start()]]
    texts += [token[a.end(): b.start()] for a, b in zip(groups, groups[1:])]
    suffix = token[groups[-1].end():]

    def expand(chosen: dict[int, str], pending: list[int]) -> list[str]:
        """The hosts with the groups in ``chosen`` fixed and those in ``pending`` still to vary."""
        # Slurm's _push_range_list: the last group of the prefix (the one nearest the final group)
        # is the outer loop, recursing into the groups left of it; the final group is innermost.
        if not pending:
            head = "".join(texts[i] + chosen[i] for i in range(len(groups) - 1)) + texts[-1]
            return [head + v + suffix for v in values[-1]]
        index, rest = pending[-1], pending[:-1]
        return [host for v in values[index] for host in expand({**chosen, index: v}, rest)]

    return expand({}, list(range(len(groups) - 1)))


def _explain_slurm(env: Mapping[str, str]) -> Derivation:
    """Derive a Slurm task's variables, as :func:`slurm` says.  Raises ConfigError."""
    size_var = "SLURM_STEP_NUM_TASKS" if read_text(env, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    job = Job("slurm", "task", "tasks", size_var, "srun -n {n}")
    rank, size = rank_and_size(env, "SLURM_PROCID", size_var, job)
    host = read_text(env, "DMLC_PS_ROOT_URI")
    if host is None:
        var = next((v for v in _SLURM_NODELISTS if read_text(env, v)), None)
        if var is None:
            raise ConfigError("none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST is set, so kvstore.node "
                              "cannot tell where task 0 (the scheduler) runs; start the job with srun, "
                              "or set DMLC_PS_ROOT_URI")
        host = expand_hostlist(read_text(env, var) or "", var)[0]  # task 0 runs on the step's first node
    port = root_port(env)
    if port is None:
        job_id = read_int(env, "SLURM_JOB_ID")
        port = DEFAULT_ROOT_PORT if job_id is None else SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return place_rank(env, job, rank, size, host, port)


def slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a task's variables from ``SLURM_PROCID``, ``SLURM_NTASKS`` and the node list.

    The scheduler (task 0) runs on the first host of ``SLURM_STEP_NODELIST``
    (else ``SLURM_JOB_NODELIST``); its port is ``DMLC_PS_ROOT_PORT``, else
    10000 + ``SLURM_JOB_ID`` % 20000, else 9091.  Raises ConfigError for a bad
    node list, a ``DMLC_PS_ROOT_PORT`` not in [1, 65535] or a plan that does not
    fit the task count.
    """
    return _explain_slurm(environ).env


ADAPTER = Adapter("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                            "SLURM_JOB_ID"), has("SLURM_PROCID"), _explain_slurm)
"""Slurm: ``SLURM_PROCID`` is set."""

"""Cluster-manager adapters: the ``DMLC_*`` contract from a cluster manager's own variables.

``python -m kvstore.node CMD`` started without ``DMLC_ROLE`` asks :func:`detect`
which cluster manager started it and derives every role's variables from that
manager's environment plus the **role plan**: the processes of a job, in the
manager's rank order, are

- rank 0: the scheduler,
- ranks 1..S: the servers (``KVSTORE_SERVER_ID`` 0..S-1),
- ranks S+1..S+W: the workers (``DMLC_WORKER_ID`` 0..W-1).

S is ``DMLC_NUM_SERVER`` (or the manager's own list of parameter servers, for
``TF_CONFIG``); W is ``DMLC_NUM_WORKER``, or else the world size - 1 - S.
``KVSTORE_RANK_OFFSET`` is added to the manager's rank so that several jobs can
share one rank order (a scheduler job at offset 0, a servers job at offset 1, a
workers job at offset 1 + S); a job with an offset is one part of the plan, so
``DMLC_NUM_WORKER`` must then be set.

Managers are tried in this order, the first whose variables are present wins
(a launcher started inside another manager's allocation is the inner, more
specific one: ``mpirun`` or ``torchrun`` inside a Slurm job inherits
``SLURM_PROCID=0`` for every process, a ``torchrun`` in a Kubernetes indexed
Job sees ``JOB_COMPLETION_INDEX`` of its pod, not of its process):

1. ``TF_CONFIG`` (TensorFlow's cluster spec, set per task),
2. torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` all set,
3. MPI: ``OMPI_COMM_WORLD_RANK`` (Open MPI), ``PMI_RANK`` (MPICH / Hydra, Intel MPI),
   or ``PMIX_RANK`` with ``OMPI_COMM_WORLD_SIZE`` or ``PMI_SIZE``,
4. Slurm: ``SLURM_PROCID``,
5. Kubernetes indexed Jobs: ``JOB_COMPLETION_INDEX``.

Everything here is pure: each function takes an ``environ`` mapping (a value
that is empty or only whitespace counts as unset, as in :mod:`kvstore.config`)
and returns a new ``dict`` of variables to add to it.  A variable the user set
already wins over a derived one: the returned dict carries the user's value.
Nothing here opens a socket or imports mpi4py or torch; ``kvstore/node.py`` does
the impure parts (mpi4py's broadcast of rank 0's address, the scheduler's port
through torchrun's store, the route to the scheduler, starting the scheduler
beside a ``TF_CONFIG`` chief).
See ``docs/cluster-managers.md``.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.net.address import parse_host_port

DEFAULT_ROOT_PORT = 9091  # the first port MXNet's dmlc tracker tries
# Slurm without DMLC_PS_ROOT_PORT: 10000 + SLURM_JOB_ID % 20000, i.e. 10000..29999 (below Linux's
# ephemeral ports, 32768 and up), so two jobs sharing a node get different ports unless their ids
# differ by a multiple of 20000.  MPI uses the same range, from a CRC-32 of its job id.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000
# The MPI launchers' job ids, in the order tried: Open MPI <= 4 (ORTE), then any PMIx launcher (Open MPI
# 4 and 5, Slurm's srun --mpi=pmix).  MPICH's and Intel MPI's Hydra set neither.
MPI_JOB_IDS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
# torchrun (torch >= 2.4) tells its processes that its agent's TCPStore, at MASTER_ADDR:MASTER_PORT, is
# shared with them by TORCHELASTIC_USE_AGENT_STORE=True; rank 0 publishes the scheduler's port there.
TORCH_STORE_FLAG = "TORCHELASTIC_USE_AGENT_STORE"
# The key names one rendezvous round as far as torchrun tells its processes (it exports no round number):
# TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, GROUP_WORLD_SIZE (nodes) and WORLD_SIZE; see torch_store.
TORCH_PORT_KEY = "kvstore/scheduler_port/{run}/restart{restart}/nodes{nodes}/world{world}"

NO_MANAGER = (
    "DMLC_ROLE is not set, and no cluster manager was detected (kvstore.node looks for TF_CONFIG; "
    "torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; Open MPI's OMPI_COMM_WORLD_RANK; "
    "MPICH's PMI_RANK; Slurm's SLURM_PROCID; a Kubernetes indexed Job's JOB_COMPLETION_INDEX). "
    "Set DMLC_ROLE to scheduler, server or worker, start the job with launch.py, or start it "
    "under one of those managers (see docs/cluster-managers.md)")


@dataclass(frozen=True)
class Derivation:
    """What an adapter derived for one process.

    ``env`` holds the variables to add (the user's own values kept where set);
    ``runs_scheduler`` is true for the one ``TF_CONFIG`` task that must also run
    the scheduler (the chief, or worker 0 without a chief, when the cluster has
    no ``scheduler`` job).
    """

    manager: str
    where: str
    env: dict[str, str]
    runs_scheduler: bool = False

    @property
    def role(self) -> str:
        """``scheduler``, ``server`` or ``worker``."""
        return self.env["DMLC_ROLE"]

    def summary(self) -> str:
        """One line for the log, e.g. ``slurm task 3 of 5 -> worker 0, scheduler n01:10042`` (S=2).

        It names no secret: only the role, its id and the scheduler's address.
        """
        role = self.role
        if role == "server":
            role = f"server {self.env['KVSTORE_SERVER_ID']}"
        elif role == "worker":
            role = f"worker {self.env['DMLC_WORKER_ID']}"
            if self.runs_scheduler:
                role += " and the scheduler"
        host = self.env["DMLC_PS_ROOT_URI"]
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return f"{self.manager} {self.where} -> {role}, scheduler {host}:{self.env['DMLC_PS_ROOT_PORT']}"


@dataclass(frozen=True)
class Adapter:
    """One cluster manager: how to recognise its environment and what to derive from it."""

    name: str
    variables: tuple[str, ...]
    matches: Callable[[Mapping[str, str]], bool]
    explain: Callable[[Mapping[str, str]], Derivation]

    def derive(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The variables to add for this process (see :func:`derive`).  Raises ConfigError."""
        return self.explain(environ).env


# -- reading values ---------------------------------------------------------------------------------

def _value(env: Mapping[str, str], name: str) -> str | None:
    return kvconfig.env_text(env, name)


def _integer(env: Mapping[str, str], name: str, minimum: int = 0, maximum: int | None = None) -> int | None:
    return kvconfig.env_int(env, name, minimum=minimum, maximum=maximum)


def _required(env: Mapping[str, str], name: str, why: str, minimum: int = 0,
              maximum: int | None = None) -> int:
    value = _integer(env, name, minimum, maximum)
    if value is None:
        raise ConfigError(f"{name} is not set: {why}")
    return value


def _root_port(env: Mapping[str, str]) -> int | None:
    """The user's ``DMLC_PS_ROOT_PORT``, or None when unset.

    Under a cluster manager every role must know the scheduler's port before it
    starts, so the port is fixed: 0 (any free port, reported in ``KVSTORE_PORT_FILE``)
    needs a launcher that reads that file.  Raises ConfigError naming the variable
    for a value that is not an int in [1, 65535].
    """
    if _value(env, "DMLC_PS_ROOT_PORT") == "0":
        raise ConfigError("DMLC_PS_ROOT_PORT=0 must be in [1, 65535]: under a cluster manager every "
                          "role must know the scheduler's port before it starts (0, any free port, needs a "
                          "launcher that reads the scheduler's KVSTORE_PORT_FILE)")
    return _integer(env, "DMLC_PS_ROOT_PORT", 1, 65535)


def _job_port(job_id: str) -> int:
    """The scheduler's port from a launcher's job id (any text): 10000 + its CRC-32 % 20000."""
    return SLURM_PORT_BASE + zlib.crc32(job_id.encode()) % SLURM_PORT_SPAN


def _user_wins(env: Mapping[str, str], derived: dict[str, str]) -> dict[str, str]:
    """``derived`` with every variable the user already set replaced by the user's value."""
    return {name: _value(env, name) or value for name, value in derived.items()}


# -- the role plan ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Job:
    """How a manager counts its processes, for the plan's messages."""

    manager: str  # "slurm"
    unit: str  # how the manager calls one position: "task", "rank", "index"
    things: str  # how to count what it starts: "tasks", "processes", "pods"
    size_var: str | None  # "SLURM_NTASKS" (None: the manager does not say; Kubernetes)
    start: str  # "srun -n {n}": how to start n processes


def _plan(env: Mapping[str, str], job: _Job, rank: int, size: int | None) -> tuple[dict[str, str], str]:
    """Place ``rank`` (the manager's) in the plan; return its role variables and a ``where`` text.

    Raises ConfigError when the counts do not add up, saying what to change.
    """
    offset_set = _value(env, "KVSTORE_RANK_OFFSET") is not None
    offset = _integer(env, "KVSTORE_RANK_OFFSET") or 0
    size_text = f"{job.size_var}={size}" if job.size_var else f"{size}"
    servers = _required(env, "DMLC_NUM_SERVER", f"kvstore.node needs the number of servers to split the "
                        f"{job.manager} job's processes into 1 scheduler (rank 0), DMLC_NUM_SERVER servers "
                        "and the workers; set it the same for every process, e.g. "
                        f"{_example(job, 'DMLC_NUM_SERVER=2')}", minimum=1)
    workers = _integer(env, "DMLC_NUM_WORKER", minimum=1)
    if workers is None:
        if offset_set or size is None:
            why = (f"with KVSTORE_RANK_OFFSET={offset} this job is one part of a larger plan"
                   if offset_set else f"{job.manager} does not tell how many processes the job has")
            raise ConfigError(f"DMLC_NUM_WORKER is not set: {why}, so set DMLC_NUM_WORKER (and "
                              "DMLC_NUM_SERVER) to the whole plan's counts, the same in every process")
        workers = size - 1 - servers
        if workers < 1:
            raise ConfigError(
                f"{size_text} leaves no worker after 1 scheduler and DMLC_NUM_SERVER={servers} servers: "
                f"start at least {servers + 2} {job.things} ({job.start.format(n=servers + 2)}) or lower "
                "DMLC_NUM_SERVER")
    total = 1 + servers + workers
    counts = f"DMLC_NUM_SERVER={servers} + DMLC_NUM_WORKER={workers} + 1 scheduler = {total} {job.things}"
    if size is not None and not offset_set and size != total:
        raise ConfigError(
            f"{size_text} but {counts}; start {total} {job.things} ({job.start.format(n=total)}), or set "
            f"DMLC_NUM_SERVER/DMLC_NUM_WORKER to add up to {size} (unset DMLC_NUM_WORKER to get "
            f"{job.size_var or 'the job size'} - 1 - DMLC_NUM_SERVER workers)")
    if size is not None and offset + size > total:
        raise ConfigError(
            f"KVSTORE_RANK_OFFSET={offset} + {size_text} = {offset + size} ranks, but {counts} (ranks "
            f"0..{total - 1}); lower the job's size or offset, or raise DMLC_NUM_SERVER/DMLC_NUM_WORKER")
    global_rank = rank + offset
    if global_rank >= total:
        raise ConfigError(
            f"{job.manager} {job.unit} {rank}" + (f" + KVSTORE_RANK_OFFSET={offset}" if offset else "")
            + f" = rank {global_rank}, but {counts} (ranks 0..{total - 1}); check the job's size and "
            "KVSTORE_RANK_OFFSET")
    env_out = {"DMLC_NUM_SERVER": str(servers), "DMLC_NUM_WORKER": str(workers)}
    env_out.update(role_for_rank(global_rank, servers))
    where = f"{job.unit} {rank}" + (f" of {size}" if size is not None else "")
    if offset_set:
        where += f" (rank {global_rank} with KVSTORE_RANK_OFFSET={offset})"
    return env_out, where


def _example(job: _Job, assignment: str) -> str:
    return {"mpi": f"mpirun -x {assignment} ...", "slurm": f"srun --export=ALL,{assignment} ...",
            "torchrun": f"{assignment} torchrun ...", "kubernetes": f"{assignment} in the pod's env"
            }.get(job.manager, f"export {assignment}")


def role_for_rank(rank: int, num_servers: int) -> dict[str, str]:
    """The role variables of plan rank ``rank``: ``DMLC_ROLE``, ``KVSTORE_SERVER_ID`` or ``DMLC_WORKER_ID``.

    Rank 0 is the scheduler, ranks 1..S the servers, the rest the workers.
    Raises ConfigError for a negative rank.
    """
    if rank < 0:
        raise ConfigError(f"rank {rank} is negative")
    if rank == 0:
        return {"DMLC_ROLE": "scheduler"}
    if rank <= num_servers:
        return {"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": str(rank - 1)}
    return {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(rank - 1 - num_servers)}


def _finish(env: Mapping[str, str], job: _Job, rank: int, size: int | None, host: str,
            port: int | str) -> Derivation:
    roles, where = _plan(env, job, rank, size)
    derived = {"DMLC_PS_ROOT_URI": host, "DMLC_PS_ROOT_PORT": str(port), **roles}
    return Derivation(job.manager, where, _user_wins(env, derived))


def _rank_and_size(env: Mapping[str, str], rank_var: str, size_var: str, job: _Job) -> tuple[int, int]:
    rank = _required(env, rank_var, f"{job.manager} sets it for every process it starts")
    size = _required(env, size_var, f"{job.manager} sets it with {rank_var}; start the job with "
                     f"{job.start.format(n='N')}", minimum=1)
    if rank >= size:
        raise ConfigError(f"{rank_var}={rank} is not below {size_var}={size}")
    return rank, size


# -- MPI --------------------------------------------------------------------------------------------

def _mpi_vars(env: Mapping[str, str]) -> tuple[str, str] | None:
    if _value(env, "OMPI_COMM_WORLD_RANK") is not None:
        return "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
    if _value(env, "PMI_RANK") is not None:
        return "PMI_RANK", "PMI_SIZE"
    if _value(env, "PMIX_RANK") is not None:
        for size_var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
            if _value(env, size_var) is not None:
                return "PMIX_RANK", size_var
    return None


def _explain_mpi(env: Mapping[str, str]) -> Derivation:
    names = _mpi_vars(env)
    if names is None:
        raise ConfigError("no MPI rank: neither OMPI_COMM_WORLD_RANK, PMI_RANK nor PMIX_RANK (with "
                          "OMPI_COMM_WORLD_SIZE or PMI_SIZE) is set; start the job with mpirun")
    job = _Job("mpi", "rank", "processes", names[1], "mpirun -n {n}")
    rank, size = _rank_and_size(env, *names, job)
    host = _value(env, "DMLC_PS_ROOT_URI")
    if host is None:
        raise ConfigError(
            f"MPI rank {rank} of {size}: kvstore.node cannot tell where rank 0 (the scheduler) runs. "
            "Set DMLC_PS_ROOT_URI to the address of rank 0's host for every rank (mpirun -x "
            "DMLC_PS_ROOT_URI=HOST ...), or install mpi4py in this Python, with which rank 0 "
            "broadcasts its address to the others")
    port = _root_port(env)
    if port is None:
        job_id = next((value for value in (_value(env, name) for name in MPI_JOB_IDS) if value), None)
        port = DEFAULT_ROOT_PORT if job_id is None else _job_port(job_id)
    return _finish(env, job, rank, size, host, port)


def mpi(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a process's variables from Open MPI's or MPICH's rank and size.

    The root is ``DMLC_PS_ROOT_URI`` (node.py can fill it in with mpi4py); its
    port is ``DMLC_PS_ROOT_PORT``, else 10000 + CRC-32(job id) % 20000 from the
    launcher's job id (``OMPI_MCA_ess_base_jobid``, else ``PMIX_NAMESPACE``), else
    9091 (MPICH's and Intel MPI's Hydra give no job id).  Raises ConfigError when
    the root is unknown, ``DMLC_PS_ROOT_PORT`` is not in [1, 65535], or the plan
    does not fit the world size.
    """
    return _explain_mpi(environ).env


# -- Slurm ------------------------------------------------------------------------------------------

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


_GROUP = re.compile(r"\[([^\]]*)\]")


def _numbers(group: str, spec: str, name: str) -> list[str]:
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
    groups = list(_GROUP.finditer(token))
    if not groups:
        return [token]
    values = [_numbers(m.group(1), spec, name) for m in groups]
    texts = [token[: groups[0].start()]]
    texts += [token[a.end(): b.start()] for a, b in zip(groups, groups[1:])]
    suffix = token[groups[-1].end():]

    def expand(chosen: dict[int, str], pending: list[int]) -> list[str]:
        # Slurm's _push_range_list: the last group of the prefix (the one nearest the final group)
        # is the outer loop, recursing into the groups left of it; the final group is innermost.
        if not pending:
            head = "".join(texts[i] + chosen[i] for i in range(len(groups) - 1)) + texts[-1]
            return [head + v + suffix for v in values[-1]]
        index, rest = pending[-1], pending[:-1]
        return [host for v in values[index] for host in expand({**chosen, index: v}, rest)]

    return expand({}, list(range(len(groups) - 1)))


_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _explain_slurm(env: Mapping[str, str]) -> Derivation:
    size_var = "SLURM_STEP_NUM_TASKS" if _value(env, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    job = _Job("slurm", "task", "tasks", size_var, "srun -n {n}")
    rank, size = _rank_and_size(env, "SLURM_PROCID", size_var, job)
    host = _value(env, "DMLC_PS_ROOT_URI")
    if host is None:
        var = next((v for v in _SLURM_NODELISTS if _value(env, v)), None)
        if var is None:
            raise ConfigError("none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST is set, so kvstore.node "
                              "cannot tell where task 0 (the scheduler) runs; start the job with srun, "
                              "or set DMLC_PS_ROOT_URI")
        host = expand_hostlist(_value(env, var) or "", var)[0]  # task 0 runs on the step's first node
    port = _root_port(env)
    if port is None:
        job_id = _integer(env, "SLURM_JOB_ID")
        port = DEFAULT_ROOT_PORT if job_id is None else SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return _finish(env, job, rank, size, host, port)


def slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a task's variables from ``SLURM_PROCID``, ``SLURM_NTASKS`` and the node list.

    The scheduler (task 0) runs on the first host of ``SLURM_STEP_NODELIST``
    (else ``SLURM_JOB_NODELIST``); its port is ``DMLC_PS_ROOT_PORT``, else
    10000 + ``SLURM_JOB_ID`` % 20000, else 9091.  Raises ConfigError for a bad
    node list, a ``DMLC_PS_ROOT_PORT`` not in [1, 65535] or a plan that does not
    fit the task count.
    """
    return _explain_slurm(environ).env


# -- torchrun ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TorchStore:
    """torchrun's agent store, through which rank 0 tells the other ranks the scheduler's port."""

    host: str  # MASTER_ADDR
    port: int  # MASTER_PORT
    key: str  # TORCH_PORT_KEY, filled in from this process's environment
    publishes: bool  # this process is rank 0, the scheduler: it publishes the port; the others read it


def torch_store(environ: Mapping[str, str]) -> TorchStore | None:
    """Where this torchrun process publishes (rank 0) or reads (every other rank) the scheduler's port.

    None, and the port is ``MASTER_PORT`` + 1, unless torchrun is the manager
    :func:`detect` picks, its agent shares its store with its processes
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torch >= 2.4 unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), ``DMLC_PS_ROOT_PORT`` is unset and
    no ``KVSTORE_RANK_OFFSET`` is set (so rank 0, the scheduler, is in this job).
    The agent's store outlives the worker group, and torchrun tells its processes
    no rendezvous round, so the key (:data:`TORCH_PORT_KEY`) carries what does tell
    rounds apart: ``TORCHELASTIC_RUN_ID`` (jobs sharing one rendezvous endpoint),
    ``TORCHELASTIC_RESTART_COUNT`` (raised by a restart after a failure, not by one
    for a node that joins), ``GROUP_WORLD_SIZE`` and ``WORLD_SIZE`` (a node that
    joins a healthy job adds itself to the next round: more nodes and processes).
    The key is then new unless a restart without a failure gives a round of as
    many nodes and processes as the last (a node left while another joined): a
    rank may then read the previous scheduler's port, which torchrun stopped, and
    fails at its ``KVSTORE_CONNECT_TIMEOUT`` (docs/cluster-managers.md).  Raises ConfigError for a
    bad ``RANK``, ``MASTER_PORT``, restart count or world size.
    """
    adapter = detect(environ)
    if (adapter is None or adapter.name != "torchrun" or _value(environ, TORCH_STORE_FLAG) != "True"
            or _value(environ, "DMLC_PS_ROOT_PORT") is not None
            or _value(environ, "KVSTORE_RANK_OFFSET") is not None):
        return None
    rank = _required(environ, "RANK", "torchrun sets it")
    port = _required(environ, "MASTER_PORT", "torchrun sets it", minimum=1, maximum=65535)
    key = TORCH_PORT_KEY.format(run=_value(environ, "TORCHELASTIC_RUN_ID") or "none",
                                restart=_integer(environ, "TORCHELASTIC_RESTART_COUNT") or 0,
                                nodes=_integer(environ, "GROUP_WORLD_SIZE") or 1,
                                world=_required(environ, "WORLD_SIZE", "torchrun sets it"))
    return TorchStore(_value(environ, "MASTER_ADDR") or "", port, key, rank == 0)


def _explain_torchrun(env: Mapping[str, str]) -> Derivation:
    job = _Job("torchrun", "rank", "processes", "WORLD_SIZE",
               "torchrun --nproc-per-node={n} on one node, or --nnodes x --nproc-per-node = {n}")
    rank, size = _rank_and_size(env, "RANK", "WORLD_SIZE", job)
    host = _value(env, "MASTER_ADDR") or ""
    port = _root_port(env)
    store = torch_store(env) if port is None else None
    if store is not None:
        if not store.publishes:
            raise ConfigError(
                f"torchrun rank {rank}: rank 0 publishes the scheduler's port in torchrun's store at "
                f"{host}:{store.port} (key {store.key}), which kvstore.node reads; or set "
                "DMLC_PS_ROOT_PORT to one port for every rank")
        port = 0  # the scheduler binds any free port; rank 0's kvstore.node publishes it
    elif port is None:
        master = _required(env, "MASTER_PORT", "torchrun sets it", minimum=1, maximum=65535)
        if master == 65535:
            raise ConfigError("MASTER_PORT=65535 leaves no port above it for the scheduler; "
                              "set DMLC_PS_ROOT_PORT")
        port = master + 1  # torchrun's agent (its TCPStore) already listens on MASTER_PORT
    return _finish(env, job, rank, size, host, port)


def torchrun(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a process's variables from torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and port.

    The scheduler (rank 0) is at ``MASTER_ADDR``.  Its port is ``DMLC_PS_ROOT_PORT``;
    else, when torchrun shares its store (:func:`torch_store`), 0 for rank 0 (any
    free port, which kvstore.node publishes in the store) while every other rank
    needs the published port as ``DMLC_PS_ROOT_PORT`` (kvstore.node reads it, a
    ConfigError here); else ``MASTER_PORT + 1``.  Raises ConfigError when the plan
    does not fit ``WORLD_SIZE`` or ``DMLC_PS_ROOT_PORT`` is not in [1, 65535].
    """
    return _explain_torchrun(environ).env


# -- Kubernetes indexed Jobs ------------------------------------------------------------------------

def _explain_kubernetes(env: Mapping[str, str]) -> Derivation:
    job = _Job("kubernetes", "index", "pods", None, "{n} completions over the Jobs")
    index = _required(env, "JOB_COMPLETION_INDEX", "Kubernetes sets it in the pods of an Indexed Job")
    missing = [n for n in ("DMLC_NUM_SERVER", "DMLC_NUM_WORKER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT")
               if _value(env, n) is None]
    if missing:
        raise ConfigError(
            f"a Kubernetes indexed Job (JOB_COMPLETION_INDEX={index}) needs {', '.join(missing)}: set "
            "DMLC_NUM_SERVER and DMLC_NUM_WORKER to the whole plan's counts and DMLC_PS_ROOT_URI / "
            "DMLC_PS_ROOT_PORT to the scheduler Service's name and port, in every pod's env "
            "(see docs/kubernetes/kvstore-job.yaml)")
    port = _root_port(env) or 0  # set: checked above
    return _finish(env, job, index, None, _value(env, "DMLC_PS_ROOT_URI") or "", port)


def kubernetes(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a pod's variables from ``JOB_COMPLETION_INDEX`` + ``KVSTORE_RANK_OFFSET``.

    ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``, ``DMLC_PS_ROOT_URI`` and
    ``DMLC_PS_ROOT_PORT`` (the scheduler Service) must be set.  Raises
    ConfigError when one is missing, the port is not in [1, 65535] or the rank
    falls outside the plan.
    """
    return _explain_kubernetes(environ).env


# -- TF_CONFIG --------------------------------------------------------------------------------------

def _address(job: str, index: int, address: object) -> tuple[str, int]:
    if not isinstance(address, str):
        raise ConfigError(f"TF_CONFIG: cluster.{job}[{index}] = {address!r} is not a 'host:port' string")
    try:
        return parse_host_port(address)
    except ValueError:
        raise ConfigError(f"TF_CONFIG: cluster.{job}[{index}] = {address!r} is not 'host:port'") from None


def _tf_cluster(env: Mapping[str, str]) -> tuple[dict[str, list], str, int]:
    raw = _value(env, "TF_CONFIG") or ""
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON ({exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict):
        raise ConfigError("TF_CONFIG has no 'cluster' object: it must look like {\"cluster\": "
                          "{\"chief\": [...], \"worker\": [...], \"ps\": [...]}, \"task\": {\"type\": "
                          "\"worker\", \"index\": 0}}")
    task = spec.get("task")
    if not isinstance(task, dict) or not isinstance(task.get("type"), str):
        raise ConfigError("TF_CONFIG has no 'task' with a 'type': each process needs its own "
                          "{\"task\": {\"type\": ..., \"index\": ...}}")
    index = task.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(f"TF_CONFIG: task.index = {index!r} is not an integer >= 0")
    cluster = spec["cluster"]
    for job, addresses in cluster.items():
        if not isinstance(addresses, list):
            raise ConfigError(f"TF_CONFIG: cluster.{job} is not a list of 'host:port' addresses")
    return cluster, task["type"], index


def _explain_tf_config(env: Mapping[str, str]) -> Derivation:
    cluster, kind, index = _tf_cluster(env)
    if "chief" in cluster and "master" in cluster:
        raise ConfigError("TF_CONFIG: the cluster has both a 'chief' and a 'master' job; 'master' is "
                          "TensorFlow 1's name of the chief, so list one of them")
    chief_name = "master" if "master" in cluster else "chief"  # how this TF_CONFIG spells the chief's job
    given = kind
    kind = "chief" if kind == "master" else kind
    chief, workers, ps = cluster.get(chief_name, []), cluster.get("worker", []), cluster.get("ps", [])
    scheduler = cluster.get("scheduler")
    if kind == "evaluator":
        raise ConfigError("TF_CONFIG: an 'evaluator' task is not part of the cluster (it is not in "
                          "cluster and takes no part in training); run it without kvstore.node")
    known = ("chief", "master", "worker", "ps") + (("scheduler",) if scheduler is not None else ())
    if kind not in known:
        raise ConfigError(f"TF_CONFIG: task type {given!r} is not one of {', '.join(known)}"
                          + ("" if scheduler is not None else " (or 'scheduler', with a scheduler job)"))
    jobs = {"chief": chief, "worker": workers, "ps": ps, "scheduler": scheduler or []}
    names = {"chief": chief_name}  # the job's name in TF_CONFIG, for the messages
    if index >= len(jobs[kind]):
        raise ConfigError(f"TF_CONFIG: task {given}:{index} is out of range: cluster.{names.get(kind, kind)} "
                          f"has {len(jobs[kind])} address{'es' if len(jobs[kind]) != 1 else ''}")
    if len(chief) > 1:
        raise ConfigError(f"TF_CONFIG: cluster.{chief_name} has {len(chief)} addresses; there is one "
                          f"{chief_name}")
    if scheduler is not None and len(scheduler) != 1:
        raise ConfigError(f"TF_CONFIG: cluster.scheduler has {len(scheduler)} addresses; give it one")
    if not ps:
        raise ConfigError("TF_CONFIG: the cluster has no 'ps' job; kvstore's servers run as ps tasks, "
                          "so list at least one")
    if not chief and not workers:
        raise ConfigError("TF_CONFIG: the cluster has neither a 'chief' nor a 'worker' job; list at "
                          "least one worker")
    counts = {"DMLC_NUM_SERVER": len(ps), "DMLC_NUM_WORKER": len(chief) + len(workers)}
    for name, count in counts.items():
        set_to = _integer(env, name, minimum=1)
        if set_to is not None and set_to != count:
            job = "ps" if name == "DMLC_NUM_SERVER" else f"{chief_name} + worker"
            raise ConfigError(f"{name}={set_to} but TF_CONFIG lists {count} {job} task"
                              f"{'s' if count != 1 else ''}; unset {name} (TF_CONFIG tells it) or make "
                              "them agree")
    _root_port(env)  # a DMLC_PS_ROOT_PORT of the user's wins below: check it
    if scheduler is not None:
        root, root_job = _address("scheduler", 0, scheduler[0]), "scheduler"
    else:
        root_job = "chief" if chief else "worker"
        root = _address(names.get(root_job, root_job), 0, jobs[root_job][0])
    host, port = _address(names.get(kind, kind), index, jobs[kind][index])
    derived = {"DMLC_PS_ROOT_URI": root[0], "DMLC_PS_ROOT_PORT": str(root[1]),
               **{name: str(count) for name, count in counts.items()}}
    if kind == "scheduler":
        derived["DMLC_ROLE"] = "scheduler"
    elif kind == "ps":
        derived.update({"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": str(index),
                        "KVSTORE_NODE_PORT": str(port)})
        derived.update(_node_host(env, host))
    else:
        worker_id = index + (len(chief) if kind == "worker" else 0)
        derived.update({"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(worker_id)})
        derived.update(_node_host(env, host))
    runs_scheduler = scheduler is None and kind == root_job and index == 0
    return Derivation("tf_config", f"task {given}:{index}", _user_wins(env, derived), runs_scheduler)


def _node_host(env: Mapping[str, str], host: str) -> dict[str, str]:
    """``{"DMLC_NODE_HOST": host}``, or nothing when ``env`` names a ``DMLC_INTERFACE``: the rule of
    :func:`kvstore.roles.with_node_host` (the role then binds that interface's address)."""
    return {} if kvconfig.env_text(env, "DMLC_INTERFACE") else {"DMLC_NODE_HOST": host}


def tf_config(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a task's variables from ``TF_CONFIG``.

    ps tasks are the servers (``KVSTORE_SERVER_ID`` = index, binding their own
    address: ``DMLC_NODE_HOST`` and ``KVSTORE_NODE_PORT``); the chief is worker 0
    and worker i is worker i + 1 (worker i without a chief).  TensorFlow 1's
    ``master`` job and task type are the chief's other name.  A ps, chief or
    worker task gets ``DMLC_NODE_HOST`` = its host unless ``DMLC_INTERFACE`` is
    set (then the role binds that interface's address).  The scheduler is the
    ``scheduler`` job's one task, or else runs at the chief's address (worker 0's
    without a chief), started by that task's kvstore.node (see
    :attr:`Derivation.runs_scheduler`).  Raises ConfigError naming TF_CONFIG for
    invalid JSON, an unknown task type, an evaluator, an index out of range or
    both a chief and a master job, and for a ``DMLC_PS_ROOT_PORT`` not in [1, 65535].
    """
    return _explain_tf_config(environ).env


# -- detection --------------------------------------------------------------------------------------

def _has(*names: str) -> Callable[[Mapping[str, str]], bool]:
    return lambda env: all(_value(env, n) is not None for n in names)


ADAPTERS: tuple[Adapter, ...] = (
    Adapter("tf_config", ("TF_CONFIG",), _has("TF_CONFIG"), _explain_tf_config),
    Adapter("torchrun", ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", TORCH_STORE_FLAG,
                         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE"),
            _has("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), _explain_torchrun),
    Adapter("mpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
                    *MPI_JOB_IDS),
            lambda env: _mpi_vars(env) is not None, _explain_mpi),
    Adapter("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                      "SLURM_JOB_ID"), _has("SLURM_PROCID"), _explain_slurm),
    Adapter("kubernetes", ("JOB_COMPLETION_INDEX",), _has("JOB_COMPLETION_INDEX"), _explain_kubernetes),
)
"""The adapters in detection order (see the module's docstring for why this order)."""


def detect(environ: Mapping[str, str]) -> Adapter | None:
    """Return the first adapter, in :data:`ADAPTERS` order, whose variables ``environ`` has; else None."""
    return next((adapter for adapter in ADAPTERS if adapter.matches(environ)), None)


def explain(environ: Mapping[str, str]) -> Derivation:
    """Detect the manager and derive this process's variables, with a summary for the log.

    Raises ConfigError when no manager is detected (naming the ones looked
    for) or when the manager's environment does not fit the plan.
    """
    adapter = detect(environ)
    if adapter is None:
        raise ConfigError(NO_MANAGER)
    return adapter.explain(environ)


def derive(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``DMLC_*`` / ``KVSTORE_*`` variables to add to ``environ`` for this process.

    Always sets ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
    ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER`` and ``KVSTORE_SERVER_ID`` or
    ``DMLC_WORKER_ID`` (for a scheduler, neither); a variable the user set keeps
    the user's value.  Raises ConfigError as :func:`explain` does.
    """
    return explain(environ).env

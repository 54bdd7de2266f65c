"""What every cluster manager's adapter shares: the :class:`Adapter` and :class:`Derivation` types, the
helpers that read the environment, and the role plan (rank 0 the scheduler, ranks 1..S the servers,
the rest the workers) that places a manager's rank.  Pure: nothing here touches the machine.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvstore import config as kvconfig
from kvstore.errors import ConfigError

DEFAULT_ROOT_PORT = 9091  # the first port MXNet's dmlc tracker tries
# Slurm without DMLC_PS_ROOT_PORT: 10000 + SLURM_JOB_ID % 20000, i.e. 10000..29999 (below Linux's
# ephemeral ports, 32768 and up), so two jobs sharing a node get different ports unless their ids
# differ by a multiple of 20000.  MPI uses the same range, from a CRC-32 of its job id.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000


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
        """The variables to add for this process (see ``kvstore.launch.managers.derive``).  Raises
        ConfigError."""
        return self.explain(environ).env


# -- reading values ---------------------------------------------------------------------------------

def read_text(env: Mapping[str, str], name: str) -> str | None:
    """``env[name]`` stripped, or None when unset, empty or only whitespace.  Raises nothing."""
    return kvconfig.env_text(env, name)


def read_int(env: Mapping[str, str], name: str, minimum: int = 0, maximum: int | None = None) -> int | None:
    """``env[name]`` as an int in [minimum, maximum], or None when unset.  Raises ConfigError naming
    the variable for a value that is not such an int."""
    return kvconfig.env_int(env, name, minimum=minimum, maximum=maximum)


def require_int(env: Mapping[str, str], name: str, why: str, minimum: int = 0,
                maximum: int | None = None) -> int:
    """``env[name]`` as an int in [minimum, maximum].  Raises ConfigError, saying ``why`` it is needed
    when it is unset, or as :func:`read_int` does."""
    value = read_int(env, name, minimum, maximum)
    if value is None:
        raise ConfigError(f"{name} is not set: {why}")
    return value


def has(*names: str) -> Callable[[Mapping[str, str]], bool]:
    """A test of an environment: whether every one of ``names`` is set (not blank).  Raises nothing."""
    return lambda env: all(read_text(env, n) is not None for n in names)


def root_port(env: Mapping[str, str]) -> int | None:
    """The user's ``DMLC_PS_ROOT_PORT``, or None when unset.

    Under a cluster manager every role must know the scheduler's port before it
    starts, so the port is fixed: 0 (any free port, reported in ``KVSTORE_PORT_FILE``)
    needs a launcher that reads that file.  Raises ConfigError naming the variable
    for a value that is not an int in [1, 65535].
    """
    if read_text(env, "DMLC_PS_ROOT_PORT") == "0":
        raise ConfigError("DMLC_PS_ROOT_PORT=0 must be in [1, 65535]: under a cluster manager every "
                          "role must know the scheduler's port before it starts (0, any free port, needs a "
                          "launcher that reads the scheduler's KVSTORE_PORT_FILE)")
    return read_int(env, "DMLC_PS_ROOT_PORT", 1, 65535)


def job_port(job_id: str) -> int:
    """The scheduler's port from a launcher's job id (any text): 10000 + its CRC-32 % 20000.  Raises
    nothing."""
    return SLURM_PORT_BASE + zlib.crc32(job_id.encode()) % SLURM_PORT_SPAN


def user_wins(env: Mapping[str, str], derived: dict[str, str]) -> dict[str, str]:
    """``derived`` with every variable the user already set replaced by the user's value.  Raises
    nothing."""
    return {name: read_text(env, name) or value for name, value in derived.items()}


# -- the role plan ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Job:
    """How a manager counts its processes, for the plan's messages."""

    manager: str  # "slurm"
    unit: str  # how the manager calls one position: "task", "rank", "index"
    things: str  # how to count what it starts: "tasks", "processes", "pods"
    size_var: str | None  # "SLURM_NTASKS" (None: the manager does not say; Kubernetes)
    start: str  # "srun -n {n}": how to start n processes


def role_plan(env: Mapping[str, str], job: Job, rank: int, size: int | None) -> tuple[dict[str, str], str]:
    """Place ``rank`` (the manager's) in the role plan; return its role variables and a ``where`` text.

    Raises ConfigError when the counts do not add up, saying what to change.
    """
    offset_set = read_text(env, "KVSTORE_RANK_OFFSET") is not None
    offset = read_int(env, "KVSTORE_RANK_OFFSET") or 0
    size_text = f"{job.size_var}={size}" if job.size_var else f"{size}"
    servers = require_int(env, "DMLC_NUM_SERVER", f"kvstore.node needs the number of servers to split the "
                          f"{job.manager} job's processes into 1 scheduler (rank 0), DMLC_NUM_SERVER servers "
                          "and the workers; set it the same for every process, e.g. "
                          f"{_example(job, 'DMLC_NUM_SERVER=2')}", minimum=1)
    workers = read_int(env, "DMLC_NUM_WORKER", minimum=1)
    if workers is None:
        workers = _rest_are_workers(job, size, servers, offset if offset_set else None, size_text)
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


def _rest_are_workers(job: Job, size: int | None, servers: int, offset: int | None, size_text: str) -> int:
    """The worker count when ``DMLC_NUM_WORKER`` is unset: the job's size - 1 - S.  Raises ConfigError
    when the job is one part of a plan (``offset`` set), its size is unknown, or no worker is left."""
    if offset is not None or size is None:
        why = (f"with KVSTORE_RANK_OFFSET={offset} this job is one part of a larger plan"
               if offset is not None else f"{job.manager} does not tell how many processes the job has")
        raise ConfigError(f"DMLC_NUM_WORKER is not set: {why}, so set DMLC_NUM_WORKER (and "
                          "DMLC_NUM_SERVER) to the whole plan's counts, the same in every process")
    workers = size - 1 - servers
    if workers < 1:
        raise ConfigError(
            f"{size_text} leaves no worker after 1 scheduler and DMLC_NUM_SERVER={servers} servers: "
            f"start at least {servers + 2} {job.things} ({job.start.format(n=servers + 2)}) or lower "
            "DMLC_NUM_SERVER")
    return workers


def _example(job: Job, assignment: str) -> str:
    """How to pass ``assignment`` (``NAME=value``) to every process of ``job``'s manager.  Raises nothing."""
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


def place_rank(env: Mapping[str, str], job: Job, rank: int, size: int | None, host: str,
               port: int | str) -> Derivation:
    """The derivation of manager rank ``rank`` in the role plan, the scheduler at ``host:port`` (a
    variable the user set wins).  Raises ConfigError as :func:`role_plan` does."""
    roles, where = role_plan(env, job, rank, size)
    derived = {"DMLC_PS_ROOT_URI": host, "DMLC_PS_ROOT_PORT": str(port), **roles}
    return Derivation(job.manager, where, user_wins(env, derived))


def rank_and_size(env: Mapping[str, str], rank_var: str, size_var: str, job: Job) -> tuple[int, int]:
    """The manager's rank and job size from ``rank_var`` and ``size_var``.  Raises ConfigError when
    either is unset or not an integer, or the rank is not below the size."""
    rank = require_int(env, rank_var, f"{job.manager} sets it for every process it starts")
    size = require_int(env, size_var, f"{job.manager} sets it with {rank_var}; start the job with "
                       f"{job.start.format(n='N')}", minimum=1)
    if rank >= size:
        raise ConfigError(f"{rank_var}={rank} is not below {size_var}={size}")
    return rank, size

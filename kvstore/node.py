"""``python -m kvstore.node CMD...``: one command line for every role.

The scheduler and servers are started by module name (``python -m scheduler``,
``python -m kvstore.server``) per ``DMLC_ROLE``; a worker runs ``CMD`` (a first
word ending in ``.py`` runs with this Python).  The process is replaced with
``exec``, so signals from a cluster manager reach the role directly.

Without ``DMLC_ROLE`` the node asks :mod:`kvstore.adapters` which cluster manager
started it (TF_CONFIG, torchrun, MPI, Slurm, a Kubernetes indexed Job) and
derives the ``DMLC_*`` variables from that manager's environment and the role
plan (docs/cluster-managers.md).  The impure parts live here:

- MPI without ``DMLC_PS_ROOT_URI``: when mpi4py is importable, rank 0 tells every
  rank its address (an MPI broadcast of bytes; nothing is pickled), and MPI is
  finalized before the ``exec``;
- a non-loopback scheduler and neither ``DMLC_NODE_HOST`` nor ``DMLC_INTERFACE``:
  a server or worker advertises its address on the route to the scheduler;
- the ``TF_CONFIG`` task that hosts the scheduler (the chief, when the cluster has
  no ``scheduler`` job) runs the scheduler and its worker as children instead of
  exec'ing, and exits once both have ended (see :func:`run_with_scheduler`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from . import adapters, roles
from . import config as kvconfig
from .errors import ConfigError

MPI_NAME_BYTES = 256  # MPI_MAX_PROCESSOR_NAME is 256 in Open MPI, 128 in MPICH
_PR_SET_PDEATHSIG = 1


def role_command(role: str | None, command: list[str]) -> list[str]:
    """Return the argv that runs ``role`` (``command`` is the worker's).  Raises ConfigError."""
    if role == "scheduler":
        return [sys.executable, "-m", "scheduler"]
    if role == "server":
        return [sys.executable, "-m", "kvstore.server"]
    if role == "worker":
        if not command:
            raise ConfigError("DMLC_ROLE=worker needs a command: python -m kvstore.node train.py ...")
        return python_if_script(command)
    raise ConfigError("DMLC_ROLE is not set; set it to scheduler, server or worker "
                      "(or start the job with launch.py)")


def python_if_script(command: list[str]) -> list[str]:
    """Prefix ``command`` with this Python when its first word is a ``.py`` file."""
    return [sys.executable, *command] if command[0].endswith(".py") else list(command)


def main(argv: list[str] | None = None) -> int:
    """Become this node's role; returns only on a configuration error (2), or for a ``TF_CONFIG``
    task that hosts the scheduler, with its worker's exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        env = kvconfig.child_environ({})  # a copy of this process's environment
        role = kvconfig.load(env).role
        if role is not None:
            cmd = role_command(role, argv)
            os.execvp(cmd[0], cmd)
        return _run_derived(argv, env)
    except ConfigError as exc:
        print(f"kvstore.node: {exc}", file=sys.stderr)
        return 2


def _run_derived(argv: list[str], env: dict[str, str]) -> int:
    """Derive the role from the cluster manager's environment, then exec it (or run it beside the
    scheduler).  Raises ConfigError."""
    adapter = adapters.detect(env)
    if adapter is None:
        raise ConfigError(adapters.NO_MANAGER)
    finalize: Callable[[], None] | None = None
    if adapter.name == "mpi" and not env.get("DMLC_PS_ROOT_URI", "").strip() and _have_mpi4py():
        root, finalize = _mpi_root_uri()
        env = {**env, "DMLC_PS_ROOT_URI": root}
    derivation = adapter.explain(env)
    merged = {**env, **derivation.env}
    merged.update(node_host_env(merged))
    kvconfig.load(merged)  # every value checked once more, as the role will read them
    if derivation.role == "worker" and not argv:
        raise ConfigError(f"{derivation.summary()}: a worker needs a command, e.g. "
                          "python -m kvstore.node train.py ...")
    cmd = role_command(derivation.role, argv)
    print(f"kvstore.node: {derivation.summary()}", file=sys.stderr, flush=True)
    if finalize is not None:
        finalize()  # Open MPI counts a process that called MPI_Init and exits without finalizing as failed
    if derivation.runs_scheduler:
        return run_with_scheduler(cmd, merged)
    os.execvpe(cmd[0], cmd, merged)
    return 0  # not reached


def node_host_env(env: Mapping[str, str]) -> dict[str, str]:
    """``{"DMLC_NODE_HOST": ...}`` when a server or worker of ``env`` would otherwise not know its address.

    That is when the scheduler (``DMLC_PS_ROOT_URI``) is not on a loopback address
    and neither ``DMLC_NODE_HOST`` nor ``DMLC_INTERFACE`` is set: the address is this
    machine's on the route to the scheduler (:func:`kvstore.config.route_address`).
    A worker whose route cannot be found keeps config's fallback (its host name);
    a server's raises ConfigError.
    """
    cfg = kvconfig.load(env)
    if cfg.role not in ("server", "worker") or cfg.node_host or cfg.interface or cfg.root_uri is None:
        return {}
    try:
        kvconfig.node_host(cfg)  # a loopback root: config's own rule (127.0.0.1) applies
        return {}
    except ConfigError:
        pass
    try:
        return {"DMLC_NODE_HOST": kvconfig.route_address(cfg.root_uri)}
    except ConfigError:
        if cfg.role == "worker":
            return {}  # a worker binds nothing; it advertises its host name instead
        raise


# -- MPI --------------------------------------------------------------------------------------------

def _have_mpi4py() -> bool:
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def rank0_address(names: Sequence[str]) -> str:
    """The address rank 0 gives the others, from every rank's processor (host) name, rank 0's first.

    127.0.0.1 when every rank runs on rank 0's host; else rank 0's address on the
    route to the first other host.  Raises ConfigError when that host cannot be reached.
    """
    others = [name for name in names[1:] if name != names[0]]
    return "127.0.0.1" if not others else kvconfig.route_address(others[0])


def _mpi_root_uri() -> tuple[str, Callable[[], None]]:
    """Every rank: learn rank 0's address through MPI (collective); return it and ``MPI.Finalize``.

    Raises ConfigError when rank 0 could not tell its address (every rank does, so none waits forever).
    """
    import numpy as np
    from mpi4py import MPI  # MPI_Init happens here

    comm = MPI.COMM_WORLD
    mine = np.zeros(MPI_NAME_BYTES, np.uint8)
    name = MPI.Get_processor_name().encode()[:MPI_NAME_BYTES]
    mine[: len(name)] = np.frombuffer(name, np.uint8)
    everyone = np.zeros((comm.Get_size(), MPI_NAME_BYTES), np.uint8)
    comm.Allgather(mine, everyone)
    answer = np.zeros(MPI_NAME_BYTES, np.uint8)
    failure = None
    if comm.Get_rank() == 0:
        names = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in everyone]
        try:
            address = rank0_address(names).encode()[:MPI_NAME_BYTES]
            answer[: len(address)] = np.frombuffer(address, np.uint8)
        except ConfigError as exc:
            failure = exc  # broadcast an empty answer, so the other ranks fail too instead of hanging
    comm.Bcast(answer, root=0)
    root = bytes(answer).rstrip(b"\0").decode()
    if failure is not None:
        raise failure
    if not root:
        raise ConfigError("MPI rank 0 could not tell its address (see its error); set DMLC_PS_ROOT_URI "
                          "to the address of rank 0's host for every rank")
    return root, MPI.Finalize


# -- TF_CONFIG: the scheduler beside the chief's worker -------------------------------------------------

def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child when this process dies (else None)."""
    if not sys.platform.startswith("linux"):
        return None

    def preexec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def run_with_scheduler(worker_cmd: list[str], env: dict[str, str]) -> int:
    """Run the scheduler and ``worker_cmd`` as children of this process; return the exit code.

    For the ``TF_CONFIG`` task that hosts the scheduler.  Each child runs in a
    session of its own (so a terminal's Ctrl-C reaches it once, through this
    process) and gets SIGTERM if this process dies (Linux's parent-death
    signal); SIGTERM, SIGINT and SIGHUP sent to this process are passed on to
    both children's process groups.  After the worker
    exits, the node waits for the scheduler, which ends by itself once every
    worker of the cluster has left or been declared lost (or at
    ``KVSTORE_CONNECT_TIMEOUT`` if the rendezvous never completes): stopping it
    at once would cut off the other workers.  Returns the worker's code when it
    is non-zero (128 + the signal number for a signal), else the scheduler's;
    127 when the worker command cannot be started.
    """
    scheduler_env = {name: value for name, value in env.items() if name != "DMLC_WORKER_ID"}
    scheduler_env["DMLC_ROLE"] = "scheduler"
    preexec = _die_with_parent(os.getpid())
    scheduler = subprocess.Popen(role_command("scheduler", []), env=scheduler_env, preexec_fn=preexec,
                                 start_new_session=True)
    children = [scheduler]

    def forward(signum: int, frame: object) -> None:
        for child in children:
            if child.poll() is None:
                try:
                    os.killpg(child.pid, signum)  # the child's whole group: what it started goes too
                except ProcessLookupError:
                    pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        worker = subprocess.Popen(worker_cmd, env=env, preexec_fn=preexec, start_new_session=True)
    except OSError as exc:
        print(f"kvstore.node: cannot start {worker_cmd[0]}: {exc.strerror}; stopping the scheduler",
              file=sys.stderr, flush=True)
        scheduler.terminate()
        scheduler.wait()
        return 127
    children.append(worker)
    code = roles.exit_code(worker.wait())
    scheduler_code = roles.exit_code(scheduler.wait())
    if scheduler_code:
        print(f"kvstore.node: the scheduler exited with code {scheduler_code}", file=sys.stderr, flush=True)
    return code or scheduler_code


if __name__ == "__main__":
    sys.exit(main())

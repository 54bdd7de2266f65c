"""``python -m kvstore.node CMD...``: one command line for every role.

The scheduler and servers are started by module name (``python -m kvstore.scheduler``,
``python -m kvstore.server``) per ``DMLC_ROLE``; a worker runs ``CMD`` (a first
word ending in ``.py`` runs with this Python).  The process is replaced with
``exec``, so signals from a cluster manager reach the role directly.

Without ``DMLC_ROLE`` the node asks :mod:`kvstore.launch.managers` which cluster manager
started it (TF_CONFIG, torchrun, MPI, Slurm, a Kubernetes indexed Job) and
derives the ``DMLC_*`` variables from that manager's environment and the role
plan (docs/cluster-managers.md).  The impure parts live here:

- MPI without ``DMLC_PS_ROOT_URI``: when mpi4py is importable, rank 0 tells every
  rank its address (an MPI broadcast of bytes; nothing is pickled), and MPI is
  finalized before the ``exec`` or the exit, on every path;
- torchrun whose agent shares its store (``TORCHELASTIC_USE_AGENT_STORE=True``) and
  no ``DMLC_PS_ROOT_PORT``: the scheduler (rank 0) binds any free port, which a
  helper publishes in that store, and every other rank reads it from there
  (:func:`publish_port`, :func:`read_store_port`);
- a non-loopback scheduler and neither ``DMLC_NODE_HOST`` nor ``DMLC_INTERFACE``:
  a server or worker advertises its address on the route to the scheduler, or
  this machine's outward address when that route is loopback (:func:`node_host_env`);
- the ``TF_CONFIG`` task that hosts the scheduler (the chief, when the cluster has
  no ``scheduler`` job) runs the scheduler and its worker as children instead of
  exec'ing, and exits once both have ended (see :func:`run_with_scheduler`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

from kvstore import config as kvconfig
from kvstore.errors import ConfigError, DeadlineExceededError
from kvstore.launch.managers import NO_MANAGER, detect
from kvstore.launch.managers.common import Adapter, Derivation
from kvstore.launch.managers.torchrun import TorchStore, torch_store
from kvstore.launch.node_gpus import node_gpu_env
from kvstore.launch.roleprocess import RoleProcess, RoleSpec, read_port
from kvstore.net import address

MPI_NAME_BYTES = 256  # MPI_MAX_PROCESSOR_NAME is 256 in Open MPI, 128 in MPICH
_PR_SET_PDEATHSIG = 1


def role_command(role: str | None, command: list[str]) -> list[str]:
    """Return the argv that runs ``role`` (``command`` is the worker's).  Raises ConfigError."""
    if role == "scheduler":
        return [sys.executable, "-m", "kvstore.scheduler"]
    if role == "server":
        return [sys.executable, "-m", "kvstore.server"]
    if role == "worker":
        if not command:
            raise ConfigError("DMLC_ROLE=worker needs a command: python -m kvstore.node train.py ...")
        return python_if_script(command)
    raise ConfigError("DMLC_ROLE is not set; set it to scheduler, server or worker "
                      "(or start the job with launch.py)")


def python_if_script(command: list[str], python: str | None = None) -> list[str]:
    """Prefix ``command`` with ``python`` (default: this Python) when its first word is a ``.py`` file."""
    return [python or sys.executable, *command] if command[0].endswith(".py") else list(command)


def main(argv: list[str] | None = None, gpus_per_worker: int | None = None) -> int:
    """Become this node's role (``exec``), with ``--gpus-per-worker``'s variables when given
    (:mod:`kvstore.launch.node_gpus`).  Returns only when that fails: 2 on a configuration error (too
    few GPUs too), 1 when the scheduler's port never came through torchrun's store or a system call
    fails (an OSError, e.g. a fork), 127 when the command cannot be started; or, for a ``TF_CONFIG`` task
    that hosts the scheduler, its worker's exit code.  Each failure prints one ``kvstore.node: ...``
    line, never a traceback."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        env = kvconfig.child_environ({})  # a copy of this process's environment
        role = kvconfig.load(env).role
        if role is not None:
            env.update(node_gpu_env(env, gpus_per_worker))
            return exec_role(role_command(role, argv), env)
        return _run_derived(argv, env, gpus_per_worker)
    except ConfigError as exc:
        print(f"kvstore.node: {exc}", file=sys.stderr)
        return 2
    except (DeadlineExceededError, OSError) as exc:  # OSError: no fork (no memory, too many processes)
        print(f"kvstore.node: {exc}", file=sys.stderr)
        return 1


def exec_role(cmd: list[str], env: Mapping[str, str]) -> int:
    """Replace this process with ``cmd``, ``env`` its environment.  Returns 127 only when ``cmd``
    cannot be started (not found, not executable), after printing ``kvstore.node: cannot start CMD:
    why``, as the tether and the launcher do; raises nothing."""
    try:
        os.execvpe(cmd[0], cmd, dict(env))
    except OSError as exc:
        print(f"kvstore.node: cannot start {cmd[0]}: {exc.strerror or exc}", file=sys.stderr, flush=True)
    return 127


def _run_derived(argv: list[str], env: dict[str, str], gpus_per_worker: int | None = None) -> int:
    """Derive the role from the cluster manager's environment, then exec it (or run it beside the
    scheduler); returns as :func:`main` says.  Raises ConfigError, DeadlineExceededError when the
    scheduler's port does not come through torchrun's store in time, or OSError when a fork fails."""
    adapter = detect(env)
    if adapter is None:
        raise ConfigError(NO_MANAGER)
    finalize: Callable[[], None] | None = None
    if adapter.name == "mpi" and not env.get("DMLC_PS_ROOT_URI", "").strip() and _have_mpi4py():
        root, finalize = _mpi_root_uri()  # MPI_Init: from here on every path finalizes
        env = {**env, "DMLC_PS_ROOT_URI": root}
    try:
        derivation, merged, cmd, publish = _prepare(adapter, argv, env)
    finally:
        if finalize is not None:
            finalize()  # Open MPI counts a process that called MPI_Init and exits unfinalized as failed
    merged.update(node_gpu_env(merged, gpus_per_worker))
    line = derivation.summary()
    if publish is not None:
        line += (f" (any free port, published in torchrun's store at {publish.host}:{publish.port} as "
                 f"{publish.key})")
    sys.stderr.write(f"kvstore.node: {line}\n")  # one write: the manager may interleave the ranks' output
    sys.stderr.flush()
    if derivation.runs_scheduler:
        return run_with_scheduler(cmd, merged)
    if publish is not None:  # the scheduler binds any free port (0) and reports it in a file of ours
        timeout = kvconfig.load(merged).connect_timeout
        port_file = os.path.join(tempfile.mkdtemp(prefix="kvstore-node-"), "scheduler.port")
        merged["KVSTORE_PORT_FILE"] = port_file
        publish_port(publish, port_file, timeout)
    return exec_role(cmd, merged)


def _prepare(adapter: Adapter, argv: list[str], env: dict[str, str]
             ) -> tuple[Derivation, dict[str, str], list[str], TorchStore | None]:
    """The derivation, the role's environment and argv, and the torchrun store this process (rank 0)
    publishes the scheduler's port in (else None).  The plan and the worker's command are checked
    before any wait for the port.  Raises ConfigError or DeadlineExceededError."""
    store = torch_store(env)
    reader = store if store is not None and not store.publishes else None
    # A rank that reads the port derives once with the store's own port in its place, so that a plan
    # that does not fit fails at once instead of after the wait for a port rank 0 never publishes.
    derivation = adapter.explain(env if reader is None else {**env, "DMLC_PS_ROOT_PORT": str(reader.port)})
    if derivation.role == "worker" and not argv:
        raise ConfigError(f"{derivation.summary()}: a worker needs a command, e.g. "
                          "python -m kvstore.node train.py ...")
    if reader is not None:
        port = read_store_port(reader, kvconfig.load(env).connect_timeout)
        env = {**env, "DMLC_PS_ROOT_PORT": str(port)}
        derivation = adapter.explain(env)
    merged = {**env, **derivation.env}
    merged.update(node_host_env(merged))
    cfg = kvconfig.load(merged)  # every value checked once more, as the role will read them
    publish = store if store is not None and store.publishes else None
    if publish is not None:
        check_store(publish, cfg.connect_timeout)
    return derivation, merged, role_command(derivation.role, argv), publish


def node_host_env(env: Mapping[str, str]) -> dict[str, str]:
    """``{"DMLC_NODE_HOST": ...}`` when a server or worker of ``env`` would otherwise not know its address.

    That is when the scheduler (``DMLC_PS_ROOT_URI``) is not a loopback address or
    ``localhost`` and neither ``DMLC_NODE_HOST`` nor ``DMLC_INTERFACE`` is set: the
    address is this machine's on the route to the scheduler
    (:func:`kvstore.net.address.route_address`).  When that route is a loopback address
    (the scheduler is named by this machine's own host name, which Debian's
    /etc/hosts maps to 127.0.1.1, as Slurm's first host or torchrun's MASTER_ADDR
    are on the scheduler's node), the others could not reach it: the address is
    then this machine's outward one (:func:`kvstore.net.address.outward_address`), or the loopback one
    when the machine has no default route (then every role runs on it).  A worker
    whose route cannot be found keeps config's fallback (its host name); a
    server's raises ConfigError.
    """
    cfg = kvconfig.load(env)
    if cfg.role not in ("server", "worker") or cfg.node_host or cfg.interface or cfg.root_uri is None:
        return {}
    try:
        address.node_host(cfg)  # a loopback root: the 127.0.0.1 rule applies
        return {}
    except ConfigError:
        pass
    try:
        route = address.route_address(cfg.root_uri)
    except ConfigError:
        if cfg.role == "worker":
            return {}  # a worker binds nothing; it advertises its host name instead
        raise
    if address.is_loopback(route):
        route = address.outward_address() or route
    return {"DMLC_NODE_HOST": route}


# -- torchrun: the scheduler's port through the agent's store ---------------------------------------

def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message without its final period (its type's name if empty)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")


def check_store(store: TorchStore, timeout: float) -> None:
    """Connect to torchrun's store at ``store.host:store.port`` and hang up, waiting at most ``timeout`` s.

    torchrun starts its processes only once its agent's store listens, so a
    refusal is final.  Raises ConfigError, saying to set ``DMLC_PS_ROOT_PORT``,
    when nothing there accepts the connection.
    """
    try:
        with socket.create_connection((store.host, store.port), timeout=timeout):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot reach torchrun's store at {store.host}:{store.port} "
                          f"({exc.strerror or exc}); set DMLC_PS_ROOT_PORT to one port for every rank to do "
                          "without it") from None


def read_store_port(store: TorchStore, timeout: float) -> int:
    """Wait up to ``timeout`` seconds (from when torch is imported) for rank 0 to publish the scheduler's
    port in torchrun's store.

    Connects to the agent's store (``MASTER_ADDR:MASTER_PORT``) as a client and
    reads ``store.key``; returns the port.  Raises ConfigError when torch cannot be
    imported, the store cannot be reached (:func:`check_store`) or holds no port
    in [1, 65535]; DeadlineExceededError, naming the store and key, when no port
    is published by the deadline.
    """
    where = f"torchrun's store at {store.host}:{store.port} (key {store.key})"
    fix = "set DMLC_PS_ROOT_PORT to one port for every rank to do without it"
    check_store(store, timeout)  # fails at once where torch's client would retry until the deadline
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise ConfigError(f"cannot import torch.distributed to read the scheduler's port from {where} "
                          f"({exc}); {fix}") from None
    deadline = time.monotonic() + timeout  # from here on: importing torch is no wait for rank 0
    try:
        client = dist.TCPStore(store.host, store.port, is_master=False,
                               timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
        raise ConfigError(f"cannot reach {where} within {timeout:g} s (KVSTORE_CONNECT_TIMEOUT): "
                          f"{_first_line(exc)}; {fix}") from None
    client.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    try:
        raw = client.get(store.key)
    except RuntimeError as exc:
        if isinstance(exc, getattr(dist, "DistStoreError", ())):  # torch's timeout of a get
            raise DeadlineExceededError(
                f"rank 0 did not publish the scheduler's port in {where} within {timeout:g} s "
                f"(KVSTORE_CONNECT_TIMEOUT); see rank 0's output, or {fix}") from None
        raise ConfigError(f"lost {where} while waiting for the scheduler's port: {_first_line(exc)}; "
                          f"{fix}") from None
    text = bytes(raw).decode(errors="replace").strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ConfigError(f"{where} holds {text!r}, not a port; {fix}")
    return int(text)


def publish_port(store: TorchStore, port_file: str, timeout: float) -> None:
    """Start a helper that publishes the scheduler's port in torchrun's store; return at once.

    Rank 0 calls it just before it ``exec``s the scheduler, which binds any free
    port (``DMLC_PS_ROOT_PORT=0``) and writes it to ``port_file``
    (``KVSTORE_PORT_FILE``).  The helper, a grandchild (so that init, not the
    scheduler, reaps it), waits up to ``timeout`` seconds for that file, then sets
    ``store.key`` to the port in the store at ``store.host:store.port``.  It gives
    up, printing why, at the deadline or when the store cannot be reached, and
    quietly when the scheduler exits first (it holds the only write end of a pipe
    the helper watches: its end of file).  It removes ``port_file``'s directory
    (made for it) when done.  The helper's failure shows as the other ranks'
    :class:`DeadlineExceededError`.  Raises OSError, saying so, when either fork fails.
    """
    read_end, write_end = os.pipe()
    try:
        first = os.fork()
    except OSError as exc:
        failed = exc.errno or 1
    else:
        if first == 0:  # the first child: fork the helper and exit at once, 0 or fork's errno
            failed = 0
            try:
                if os.fork() == 0:
                    code = 1
                    try:
                        os.close(write_end)
                        code = _publish(store, port_file, timeout, read_end)
                    finally:
                        os._exit(code)
            except OSError as exc:
                failed = exc.errno or 1
            finally:
                os._exit(failed)
        failed = os.waitstatus_to_exitcode(os.waitpid(first, 0)[1])  # it exits at once
    os.close(read_end)
    if failed:
        os.close(write_end)
        shutil.rmtree(os.path.dirname(port_file), ignore_errors=True)
        why = os.strerror(failed) if failed > 0 else f"the forking child died of signal {-failed}"
        raise OSError(f"cannot fork the helper that publishes the scheduler's port in torchrun's store "
                      f"({why}); set DMLC_PS_ROOT_PORT to one port for every rank to do without it")
    os.set_inheritable(write_end, True)  # kept open by the scheduler's exec until it exits


def _publish(store: TorchStore, port_file: str, timeout: float, scheduler_alive: int) -> int:
    """The helper of :func:`publish_port`: 0 once the port is in the store, else 1.  Raises nothing."""
    deadline = time.monotonic() + timeout
    where = f"torchrun's store at {store.host}:{store.port}"
    try:
        from torch.distributed import TCPStore  # now, while the scheduler starts: the readers' clocks run

        exited: list[bool] = []  # end of file on scheduler_alive: the scheduler exited before binding

        def gone(seconds: float) -> bool:
            """Wait up to ``seconds`` for the scheduler's end; say whether it has ended."""
            if select.select([scheduler_alive], [], [], seconds)[0]:
                exited.append(True)
            return bool(exited)

        port = read_port(port_file, max(0.0, deadline - time.monotonic()), gone)
        if port is None and exited:
            return 1  # the scheduler said why itself
        if port is None:
            print(f"kvstore.node: the scheduler did not report its port within {timeout:g} s "
                  f"(KVSTORE_CONNECT_TIMEOUT); nothing published in {where}", file=sys.stderr, flush=True)
            return 1
        remaining = max(deadline - time.monotonic(), 1.0)
        TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=remaining)).set(
            store.key, str(port))
        return 0
    except Exception as exc:  # the helper's last word: anything else would be a traceback nobody reads
        print(f"kvstore.node: cannot publish the scheduler's port in {where} ({_first_line(exc)}); set "
              "DMLC_PS_ROOT_PORT to one port for every rank to do without it", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(os.path.dirname(port_file), ignore_errors=True)


# -- MPI --------------------------------------------------------------------------------------------

def _have_mpi4py() -> bool:
    """Whether mpi4py can be found (without importing it, which would initialise MPI).  Raises nothing."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def rank0_address(names: Sequence[str]) -> str:
    """The address rank 0 gives the others, from every rank's processor (host) name, rank 0's first.

    127.0.0.1 when every rank runs on rank 0's host; else rank 0's address on the
    route to the first other host.  Raises ConfigError when that host cannot be reached.
    """
    others = [name for name in names[1:] if name != names[0]]
    return "127.0.0.1" if not others else address.route_address(others[0])


def _mpi_root_uri() -> tuple[str, Callable[[], None]]:
    """Every rank: learn rank 0's address through MPI (collective); return it and ``MPI.Finalize``.

    Raises ConfigError when mpi4py cannot be imported (e.g. its libmpi is missing),
    or, after finalizing MPI, when rank 0 could not tell its address (every rank
    does, so none waits forever).
    """
    try:
        from mpi4py import MPI  # MPI_Init happens here
    except (ImportError, OSError) as exc:
        raise ConfigError(f"mpi4py is installed but cannot be imported ({_first_line(exc)}); set "
                          "DMLC_PS_ROOT_URI to the address of rank 0's host for every rank (mpirun -x "
                          "DMLC_PS_ROOT_URI=HOST ...), then mpi4py is not used") from None
    try:
        return _exchange_root(MPI), MPI.Finalize
    except BaseException:
        MPI.Finalize()
        raise


def _exchange_root(MPI) -> str:  # noqa: N803 -- the mpi4py module, by its own name
    """The collective of :func:`_mpi_root_uri`; returns rank 0's address.  Raises ConfigError."""
    import numpy as np

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
            chosen = rank0_address(names).encode()[:MPI_NAME_BYTES]
            answer[: len(chosen)] = np.frombuffer(chosen, np.uint8)
        except ConfigError as exc:
            failure = exc  # broadcast an empty answer, so the other ranks fail too instead of hanging
    comm.Bcast(answer, root=0)
    root = bytes(answer).rstrip(b"\0").decode()
    if failure is not None:
        raise failure
    if not root:
        raise ConfigError("MPI rank 0 could not tell its address (see its error); set DMLC_PS_ROOT_URI "
                          "to the address of rank 0's host for every rank")
    return root


# -- TF_CONFIG: the scheduler beside the chief's worker -------------------------------------------------

def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child when this process dies (else None)."""
    if not sys.platform.startswith("linux"):
        return None

    def preexec() -> None:
        """In the child: ask for SIGTERM at the parent's death; kill itself if the parent is gone."""
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _start_beside(spec: RoleSpec, preexec: Callable[[], None] | None) -> subprocess.Popen:
    """Start ``spec`` as this node's child, in a session of its own, its output where the node's goes,
    ``preexec`` run in the child first.  Raises OSError."""
    return subprocess.Popen(spec.argv, env=spec.env, preexec_fn=preexec, start_new_session=True)


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
    start = functools.partial(_start_beside, preexec=_die_with_parent(os.getpid()))
    scheduler = RoleProcess(RoleSpec("scheduler", None, role_command("scheduler", []), scheduler_env),
                            start).start()
    children = [scheduler]

    def forward(signum: int, frame: object) -> None:
        """Pass ``signum`` on to every running child's process group."""
        for child in children:
            if child.exit_code is None:
                child.signal(signum)  # the child's whole group: what it started goes too

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    worker = RoleProcess(RoleSpec("worker", None, worker_cmd, env), start)
    try:
        worker.start()
    except OSError as exc:
        print(f"kvstore.node: cannot start {worker_cmd[0]}: {exc.strerror}; stopping the scheduler",
              file=sys.stderr, flush=True)
        scheduler.signal(signal.SIGTERM)
        scheduler.wait()
        scheduler.reap()
        return 127
    children.append(worker)
    code = worker.wait()
    scheduler_code = scheduler.wait()
    for child in children:
        child.reap()
    if scheduler_code:
        print(f"kvstore.node: the scheduler exited with code {scheduler_code}", file=sys.stderr, flush=True)
    return code or scheduler_code


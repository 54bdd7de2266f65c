"""Run a kvstore cluster on Ray: ``launch.py --launcher ray`` and :func:`run`.

One placement group (strategy ``SPREAD``) holds a bundle per role: the
scheduler, S servers and W workers, each asking for a fraction of a CPU by
default.  Every role is a Ray actor.  The scheduler's and servers' actors (and
a command worker's) run their role as a subprocess under :mod:`kvstore.launch.tether`,
so a role never outlives its actor; a function worker calls the user's function
in the actor's own process, with the role's environment set there while it runs
(the variables travel as an argument of the actor's method, never in its
``runtime_env``, which Ray logs), so ``kvstore.create('dist_sync')`` inside it
joins the cluster.  One supervision loop on the driver long-polls every actor for new
output lines and its exit code, prints the lines with the launcher's prefixes
(``[scheduler]``, ``[server 0]``, ``[worker 1]``), and stops everything when any
role fails or its actor dies.

Ray serialises the user's function, its arguments and its return value with its
own (cloud)pickle: that is Ray's transport between the driver and the actors,
not kvstore's wire, which stays msgpack between the roles.

Importing this module imports ray (the ``[ray]`` extra); ``import kvstore`` never does.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvstore import config as kvconfig
from kvstore.errors import DeadlineExceededError, KVStoreError
from kvstore.launch import envrules as roles
from kvstore.launch import tether
from kvstore.launch.cli import LaunchConfig
from kvstore.launch.node import python_if_script

log = logging.getLogger("kvstore.launcher")

DEFAULT_SCHEDULER_CPUS = 0.05
DEFAULT_SERVER_CPUS = 0.1
DEFAULT_WORKER_CPUS = 0.1
DEFAULT_PLACEMENT_TIMEOUT = 60.0
_POLL = 0.5  # seconds a drain() waits in the actor for news before answering "nothing yet"
_EOF_GRACE = 1.0  # seconds a role's exit waits for its last output (a grandchild may hold the pipe)
# Variables of a function worker's environment that are also set when its actor's process starts (through
# the actor's runtime_env, which Ray writes to its logs): never secret, and read once by a library when it
# is imported, which may be while Ray unpickles the function's arguments (numpy for an array), before the
# function runs.  The rest, the secret included, are set only while the function runs.
_PROCESS_START_VARS = ("OMP_NUM_THREADS",)
_Call = tuple[Callable[..., Any], tuple, dict[str, Any]]  # a function worker's (function, args, kwargs)


class PlacementError(KVStoreError):
    """The Ray cluster could not place the job's roles within the placement timeout."""


class RoleFailed(KVStoreError):
    """A role exited non-zero, its function raised, or its Ray actor died.

    ``role`` is ``'scheduler'``, ``'server'`` or ``'worker'``; ``rank`` is None
    for the scheduler; ``exit_code`` is the role's exit code (128 + signal when a
    signal ended it, 1 for a function that raised), or None when its actor died.
    """

    def __init__(self, message: str, role: str, rank: int | None, exit_code: int | None) -> None:
        super().__init__(message)
        self.role, self.rank, self.exit_code = role, rank, exit_code


# -- the plan: pure logic, no Ray ---------------------------------------------------------------------

@dataclass(frozen=True)
class RoleSpec:
    """One role of the job and what its placement-group bundle asks for."""

    role: str
    rank: int | None
    cpus: float
    gpus: float = 0.0

    @property
    def name(self) -> str:
        """``scheduler``, ``server 0``, ``worker 1``: the prefix of its output lines."""
        return self.role if self.rank is None else f"{self.role} {self.rank}"

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of this role."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}


def plan_roles(num_workers: int, num_servers: int, *, scheduler_cpus: float = DEFAULT_SCHEDULER_CPUS,
               server_cpus: float = DEFAULT_SERVER_CPUS, worker_cpus: float = DEFAULT_WORKER_CPUS,
               worker_gpus: float = 0.0) -> list[RoleSpec]:
    """Return the job's roles in bundle order: the scheduler, servers 0..S-1, workers 0..W-1.

    Raises ValueError for a count below 1, a CPU amount that is not > 0 or a
    negative GPU amount.
    """
    if num_workers < 1 or num_servers < 1:
        raise ValueError(f"num_workers and num_servers must be at least 1, not {num_workers} and "
                         f"{num_servers}")
    for what, cpus in (("scheduler_cpus", scheduler_cpus), ("server_cpus", server_cpus),
                       ("worker_cpus", worker_cpus)):
        if not cpus > 0:
            raise ValueError(f"{what}={cpus!r} must be > 0 (a fraction of a CPU is fine)")
    if worker_gpus < 0:
        raise ValueError(f"worker_gpus={worker_gpus!r} must be >= 0")
    return ([RoleSpec("scheduler", None, scheduler_cpus)]
            + [RoleSpec("server", rank, server_cpus) for rank in range(num_servers)]
            + [RoleSpec("worker", rank, worker_cpus, worker_gpus) for rank in range(num_workers)])


def _amount(value: float) -> str:
    return f"{value:g}"


def describe_request(roles: Sequence[RoleSpec]) -> str:
    """Say what ``roles`` ask for, e.g. ``1 scheduler x 0.05 CPU, 2 workers x 64 CPU (128.05 CPU in all)``."""
    groups: dict[tuple[str, float, float], int] = {}
    for spec in roles:
        key = (spec.role, spec.cpus, spec.gpus)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (role, cpus, gpus), count in groups.items():
        plural = role + ("s" if count > 1 and role != "scheduler" else "")
        gpu = f" + {_amount(gpus)} GPU" if gpus else ""
        parts.append(f"{count} {plural} x {_amount(cpus)} CPU{gpu}")
    total_cpu = sum(spec.cpus for spec in roles)
    total_gpu = sum(spec.gpus for spec in roles)
    total = f"{total_cpu:.4g} CPU" + (f" and {total_gpu:.4g} GPU" if total_gpu else "")
    return f"{', '.join(parts)} ({total} in all)"


def describe_cluster(total: Mapping[str, float], available: Mapping[str, float],
                     node_cpus: Iterable[float] = ()) -> str:
    """Say what a Ray cluster has: ``2 CPU in all, 1.5 available, on 1 node of at most 2 CPU``."""
    text = f"{_amount(total.get('CPU', 0.0))} CPU in all, {_amount(available.get('CPU', 0.0))} available"
    if total.get("GPU"):
        text += f"; {_amount(total['GPU'])} GPU in all, {_amount(available.get('GPU', 0.0))} available"
    sizes = list(node_cpus)
    if sizes:
        text += f", on {len(sizes)} node{'s' if len(sizes) != 1 else ''} of at most {_amount(max(sizes))} CPU"
    return text


def role_environ(spec: RoleSpec, *, num_workers: int, num_servers: int, secret: str, root_uri: str,
                 root_port: int, node_ip: str, forwarded: Mapping[str, str] | None = None,
                 extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a role's process gets on top of its actor's environment, lowest precedence first:
    ``OMP_NUM_THREADS=1`` (workers), the caller's ``forwarded`` variables, ``PYTHONUNBUFFERED=1`` and
    ``KVSTORE_SECRET``, the caller's ``extra`` (``--env``), and then the ones set per role: ``DMLC_ROLE``,
    ``DMLC_NUM_*``, ``DMLC_PS_ROOT_URI/PORT``, ``DMLC_NODE_HOST`` (left out when ``DMLC_INTERFACE`` is
    given, so the interface's address is used), ``KVSTORE_SERVER_ID`` / ``DMLC_WORKER_ID``."""
    forwarded = {k: v for k, v in (forwarded or {}).items() if k not in roles.PER_ROLE}
    extra = dict(extra or {})
    env: dict[str, str] = {"OMP_NUM_THREADS": "1"} if spec.role == "worker" else {}
    env.update(forwarded)
    env.update({"PYTHONUNBUFFERED": "1", "KVSTORE_SECRET": secret})
    env.update(extra)
    env.update({"DMLC_ROLE": spec.role, "DMLC_NUM_WORKER": str(num_workers),
                "DMLC_NUM_SERVER": str(num_servers), "DMLC_PS_ROOT_URI": root_uri,
                "DMLC_PS_ROOT_PORT": str(root_port)})
    env = roles.with_node_host(env, node_ip)
    if spec.role == "server":
        env["KVSTORE_SERVER_ID"] = str(spec.rank)
    elif spec.role == "worker":
        env["DMLC_WORKER_ID"] = str(spec.rank)
    return env


def _system_exit_code(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _death_reason(exc: BaseException) -> str:
    """The sentence of a RayActorError that says why the actor died (Ray's text varies by version)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("The actor is dead because"):
            return line[len("The actor is dead because"):].strip()
    return lines[0] if lines else type(exc).__name__


# -- the actor ----------------------------------------------------------------------------------------

class _RoleActor:
    """One role in a Ray actor: a tethered subprocess, or the user's function in this process.

    Runs threaded (``max_concurrency``), so a drain() can wait while the role runs.  A function
    worker's ``call`` (the function, its args and kwargs) comes with the actor's creation, so Ray
    has unpickled it by the time the actor is ready (see RayJob._started).
    """

    def __init__(self, name: str, call: _Call | None = None) -> None:
        self.name = name
        self._call_spec = call
        self._cond = threading.Condition()
        self._lines: list[str] = []
        self._code: int | None = None
        self._exited_at = 0.0
        self._eof = False
        self._proc: subprocess.Popen | None = None
        self._tmpdir: str | None = None
        self._port_file: str | None = None
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: str | None = None
        atexit.register(self._remove_tmpdir)  # a graceful exit of the actor; ray.kill skips it

    def _remove_tmpdir(self) -> None:
        """Remove the scheduler's port-file directory, if there is one (idempotent)."""
        tmpdir, self._tmpdir = self._tmpdir, None
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)

    # output and exit, shared by both kinds
    def _pump(self, stream: Any) -> None:
        for raw in iter(stream.readline, b""):
            with self._cond:
                self._lines.append(raw.decode(errors="replace").rstrip("\r\n"))
                self._cond.notify_all()
        stream.close()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _exited(self, code: int) -> None:
        self._remove_tmpdir()
        with self._cond:
            self._code, self._exited_at = code, time.monotonic()
            self._cond.notify_all()

    def _exit_visible(self) -> bool:
        """The exit is reported once its output is read to the end, or a moment after it."""
        return self._code is not None and (self._eof or time.monotonic() - self._exited_at > _EOF_GRACE)

    def drain(self, timeout: float) -> tuple[list[str], int | None]:
        """Wait up to ``timeout`` for output or the exit; return the new lines and the exit code (or None)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._lines and not self._exit_visible():
                left = deadline - time.monotonic()
                if self._code is not None:
                    left = min(left, self._exited_at + _EOF_GRACE - time.monotonic() + 0.01)
                if left <= 0:
                    break
                self._cond.wait(left)
            lines, self._lines = self._lines, []
            return lines, self._code if self._exit_visible() else None

    # a tethered subprocess
    def start_command(self, argv: list[str], env: dict[str, str], cwd: str | None, grace: float,
                      python: bool = False, port_file: bool = False) -> None:
        """Start ``argv`` under a tether: after this actor's Python with ``python``; else a ``.py``
        first word runs with this Python.  ``port_file`` sets ``KVSTORE_PORT_FILE`` to a file in a new
        ``kvstore-ray-*`` temporary directory (see wait_port; the directory is removed once the port
        is read, the role ends, it is released or the actor exits gracefully).

        The tether is started by a ``/bin/sh`` keeper: when Ray kills an actor it SIGKILLs the
        actor's direct children, which would orphan the role if the tether were one; the tether, a
        grandchild, sees its stdin close instead and stops the role (SIGTERM, ``grace``, SIGKILL).
        The keeper and the tether run with the role's ``KVSTORE_*`` variables in their environment
        (not on a command line) but no ``KVSTORE_SECRET`` (which reaches the role only on the
        tether's stdin), so they can be told apart as the role's.
        Raises OSError when the keeper cannot be started.
        """
        env = dict(env)
        if port_file:
            self._tmpdir = tempfile.mkdtemp(prefix="kvstore-ray-")
            self._port_file = env["KVSTORE_PORT_FILE"] = os.path.join(self._tmpdir, "scheduler.port")
        settings = {name: value for name, value in env.items()
                    if name.startswith("KVSTORE_") and "SECRET" not in name}
        settings["KVSTORE_SHUTDOWN_TIMEOUT"] = f"{grace:g}"
        keeper_env = {name: value for name, value in kvconfig.child_environ(settings).items()
                      if name != "KVSTORE_SECRET"}  # nor this actor's own, should its node set one
        keeper = ["/bin/sh", "-c", f"{shlex.quote(sys.executable)} -m kvstore.launch.tether; exit $?"]
        argv = [sys.executable, *argv] if python else python_if_script(argv)
        try:
            self._proc = subprocess.Popen(keeper, env=keeper_env, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except BaseException:
            self._remove_tmpdir()
            raise
        try:
            self._proc.stdin.write(tether.request(argv, env, cwd if cwd and os.path.isdir(cwd) else None))
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # the keeper or the tether exited already: its exit code tells why
        threading.Thread(target=self._pump, args=(self._proc.stdout,), daemon=True).start()
        proc = self._proc
        threading.Thread(target=lambda: self._exited(roles.exit_code(proc.wait())), daemon=True).start()

    def wait_port(self, timeout: float) -> tuple[int | None, int | None]:
        """Wait up to ``timeout`` for the scheduler's port file; return (port, None), or (None, exit
        code) when the scheduler exited first, or (None, None) at the deadline.  The port file's
        directory is removed once the port is read (the scheduler writes it once, atomically)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self._read_port()
            if port is not None:
                self._remove_tmpdir()
                return port, None
            with self._cond:
                if self._code is not None:
                    return None, self._code
                self._cond.wait(0.05)
        return None, None

    def _read_port(self) -> int | None:
        """The port in the port file; None while there is none: not written yet, or removed with its
        directory by the exit of a scheduler that wrote it and exited at once (its code then tells)."""
        return None if self._port_file is None else roles.read_port_file(self._port_file)

    def release(self) -> None:
        """Close the tether's stdin: it stops the role (nothing for a function worker); remove the
        port file's directory."""
        if self._proc is not None:
            tether.release(self._proc)
        self._remove_tmpdir()

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for a tethered role to exit; return its code (None while it runs).
        A function worker is not waited for: its code, or None at once."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
            self._remove_tmpdir()
        with self._cond:
            return self._code

    # the user's function in this process
    def start_function(self, env: dict[str, str]) -> None:
        """Call the actor's ``call``, ``fn(*args, **kwargs)``, in a thread, with ``env`` set in this
        process's environment until it returns (this actor's process is the role's alone); its stdout
        and stderr (file descriptors 1 and 2) become this role's output while it runs."""
        if self._call_spec is None:
            raise ValueError(f"{self.name}'s actor was created without a function to call")
        fn, args, kwargs = self._call_spec
        self._thread = threading.Thread(target=self._call_in, args=(env, fn, args, kwargs), daemon=True)
        self._thread.start()

    def _call_in(self, env: dict[str, str], fn: Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any]) -> None:
        with kvconfig.process_environ(env):
            self._call(fn, args, kwargs)

    def _call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
        read_fd, write_fd = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        pump = threading.Thread(target=self._pump, args=(os.fdopen(read_fd, "rb"),), daemon=True)
        pump.start()
        code, failure = 0, None
        try:
            self._result = fn(*args, **kwargs)
        except SystemExit as exc:
            code = _system_exit_code(exc.code)
            failure = f"its function called sys.exit({exc.code!r})" if code else None
        except BaseException as exc:  # noqa: BLE001 -- reported as this role's failure
            traceback.print_exc()
            code, self._error = 1, traceback.format_exc()
            failure = f"its function raised {type(exc).__name__}: {exc}"
        try:
            _leave_cluster(failure)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = code or 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            self._exited(code)

    def result(self) -> Any:
        """The function's return value (serialised by Ray)."""
        return self._result

    def error(self) -> str | None:
        """The traceback of the function's exception, if it raised."""
        return self._error


def _leave_cluster(failure: str | None) -> None:
    """Close this process's dist store, if the function made one: the worker leaves the cluster (or,
    with ``failure``, is reported failed), as the exit hook of a worker process would."""
    from kvstore.client import store as dist

    dist.release_process_store(failure)


_Remote = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(_RoleActor)


# -- the driver ---------------------------------------------------------------------------------------

@dataclass
class _Handle:
    spec: RoleSpec
    actor: Any
    node_ip: str
    exit_code: int | None = None
    dead: bool = False
    created: bool = False  # its actor answered once: a role it may hold is worth releasing


class RayJob:
    """A kvstore cluster running on Ray: made by :func:`start`, supervised by :meth:`wait`.

    ``actor(role, rank)`` is the Ray actor of a role (``ray.kill`` it to see the
    job fail).  Use it as a context manager, or call :meth:`stop`, so it is
    always torn down.
    """

    def __init__(self, target: Sequence[str] | Callable[..., Any], num_workers: int, num_servers: int, *,
                 args: tuple = (), kwargs: Mapping[str, Any] | None = None, address: str | None = None,
                 env: Mapping[str, str] | None = None, settings: kvconfig.Config | None = None,
                 scheduler_cpus: float = DEFAULT_SCHEDULER_CPUS, server_cpus: float = DEFAULT_SERVER_CPUS,
                 worker_cpus: float = DEFAULT_WORKER_CPUS, worker_gpus: float = 0.0,
                 placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT, cwd: str | None = None,
                 stdout: TextIO | None = None) -> None:
        self.function = target if callable(target) else None
        self.command = None if callable(target) else (shlex.split(target) if isinstance(target, str)
                                                       else list(target))
        if self.command is not None and not self.command:
            raise ValueError("the worker command is empty")
        self.args, self.kwargs = tuple(args), dict(kwargs or {})
        self.roles = plan_roles(num_workers, num_servers, scheduler_cpus=scheduler_cpus,
                                server_cpus=server_cpus, worker_cpus=worker_cpus, worker_gpus=worker_gpus)
        self.num_workers, self.num_servers = num_workers, num_servers
        self.extra = dict(env or {})
        caller = kvconfig.child_environ({})  # a copy of this process's environment
        self.settings = settings or kvconfig.load({**caller, **self.extra})
        self.forwarded = roles.forwarded(caller)
        self.secret = self.settings.secret or secrets.token_hex(32)
        self.address, self.placement_timeout = address, placement_timeout
        self.cwd = cwd or os.getcwd()
        self._out = stdout
        self._handles: list[_Handle] = []
        self._pg: Any = None
        self._started_ray = False
        self._stopped = False
        self._results: dict[int, Any] = {}
        self._timeout: float | None = None
        self._pending: dict[Any, _Handle] = {}  # an outstanding drain() per running role

    # start -----------------------------------------------------------------------------------------
    def start(self) -> RayJob:
        """Connect to Ray, place the job, create every role's actor, start the scheduler, then the
        servers and workers.

        Raises PlacementError when the roles cannot be placed within the placement timeout,
        RoleFailed when the scheduler fails to start or an actor dies, DeadlineExceededError when an
        actor is not created within the placement timeout, or does not start its role, or the
        scheduler reports no port, within ``KVSTORE_CONNECT_TIMEOUT``.  On any error everything
        started is torn down.
        """
        try:
            self._connect()
            node_ips = self._place()
            root_uri = node_ips[0]
            for index, spec in enumerate(self.roles):
                if spec.role == "worker" and self.function is not None:
                    # the secret goes as start_function's argument, never in the runtime_env: Ray logs that
                    env = self._env(spec, root_uri, 0, node_ips[index])
                    self._spawn(index, node_ips[index], {name: env[name] for name in _PROCESS_START_VARS
                                                         if name in env},
                                call=(self.function, self.args, self.kwargs))
                else:
                    self._spawn(index, node_ips[index])
            self._created()
            scheduler = self._handles[0]
            env = self._env(scheduler.spec, root_uri, 0, scheduler.node_ip)
            self._started([(scheduler, scheduler.actor.start_command.remote(
                ["-m", "kvstore.scheduler"], env, self.cwd, self.settings.shutdown_timeout, python=True,
                port_file=True))])
            port = self._wait_port(scheduler)
            log.info("scheduler on %s:%d; starting %d servers and %d workers", root_uri, port,
                     self.num_servers, self.num_workers)
            starts = []
            for handle in self._handles[1:]:
                env = self._env(handle.spec, root_uri, port, handle.node_ip)
                if handle.spec.role == "worker" and self.function is not None:
                    ref = handle.actor.start_function.remote(env)
                elif handle.spec.role == "worker":
                    ref = handle.actor.start_command.remote(self.command, env, self.cwd,
                                                            self.settings.shutdown_timeout)
                else:
                    ref = handle.actor.start_command.remote(["-m", "kvstore.server"], env, self.cwd,
                                                            self.settings.shutdown_timeout, python=True)
                starts.append((handle, ref))
            self._started(starts)
        except BaseException:
            self.stop()
            raise
        return self

    def _created(self) -> None:
        """Wait for every role's actor to be created (its process started, its runtime_env set up, a
        function worker's function and arguments unpickled), all within one placement timeout, before
        any role starts: the roles' own KVSTORE_CONNECT_TIMEOUT (the scheduler's for the rendezvous
        among them) then counts from actors that are all there.

        Raises RoleFailed for an actor that died (e.g. could not be created), DeadlineExceededError
        naming the first role whose actor is not created in time and the placement timeout."""
        timeout = self.placement_timeout
        self._wait_calls([(handle, handle.actor.__ray_ready__.remote()) for handle in self._handles], timeout,
                         f"was not created within {timeout:g} s (the placement timeout): its process did not "
                         "start, or is stuck in its runtime_env or unpickling its function and arguments",
                         created=True)

    def _started(self, starts: list[tuple[_Handle, Any]]) -> None:
        """Wait for the (created) actors' start calls, all within one ``KVSTORE_CONNECT_TIMEOUT``.

        Raises RoleFailed for an actor that died or whose start call raised, DeadlineExceededError
        naming the first role whose actor has not started it in time and KVSTORE_CONNECT_TIMEOUT."""
        timeout = self.settings.connect_timeout
        self._wait_calls(starts, timeout, f"did not start its role within {timeout:g} s of being created "
                         "(KVSTORE_CONNECT_TIMEOUT): its start call is stuck")

    def _wait_calls(self, calls: list[tuple[_Handle, Any]], timeout: float, late: str,
                    created: bool = False) -> None:
        """Wait for every actor call of ``calls``, all within one ``timeout``; see _created, _started.
        With ``created``, each actor that answered is marked created."""
        deadline = time.monotonic() + timeout
        for handle, ref in calls:
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                handle.created = handle.created or created
            except ray.exceptions.GetTimeoutError:
                raise DeadlineExceededError(f"{handle.spec.name}'s Ray actor {late}") from None
            except ray.exceptions.RayActorError as exc:
                handle.dead = True
                raise self._died(handle, exc) from None
            except ray.exceptions.RayTaskError as exc:
                raise RoleFailed(f"{handle.spec.name} could not be started: {exc}", handle.spec.role,
                                 handle.spec.rank, None) from None

    def _connect(self) -> None:
        if ray.is_initialized():
            return  # this process is connected already: use that cluster and leave it be
        if self.address is None and "RAY_USAGE_STATS_ENABLED" not in kvconfig.child_environ({}):
            _disable_usage_stats()
        # "local": a new Ray for this job, even where RAY_ADDRESS or a `ray start` cluster on this
        # machine would make ray.init(address=None) join that cluster instead
        ray.init(address=self.address or "local", include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
        self._started_ray = True

    def _place(self) -> list[str]:
        """Create the placement group and wait for it; return each bundle's node IP."""
        self._pg = placement_group([spec.bundle() for spec in self.roles], strategy="SPREAD")
        ready, _ = ray.wait([self._pg.ready()], timeout=self.placement_timeout)
        if not ready:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            have = describe_cluster(ray.cluster_resources(), ray.available_resources(),
                                    [n.get("Resources", {}).get("CPU", 0.0) for n in nodes])
            remove_placement_group(self._pg)
            self._pg = None
            raise PlacementError(
                f"Ray could not place the job within {self.placement_timeout:g} s: it asks for "
                f"{describe_request(self.roles)}, one bundle per role (each must fit on one node), and "
                f"the cluster has {have}. Ask for less (scheduler_cpus, server_cpus, worker_cpus, "
                "worker_gpus) or add nodes.")
        table = placement_group_table(self._pg)
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        bundle_nodes = table.get("bundles_to_node_id", {})
        try:
            return [addresses[bundle_nodes[index]] for index in range(len(self.roles))]
        except KeyError as exc:
            raise PlacementError(f"Ray placed the job but did not say where bundle {exc} is") from None

    def _env(self, spec: RoleSpec, root_uri: str, port: int, node_ip: str) -> dict[str, str]:
        return role_environ(spec, num_workers=self.num_workers, num_servers=self.num_servers,
                            secret=self.secret, root_uri=root_uri, root_port=port, node_ip=node_ip,
                            forwarded=self.forwarded, extra=self.extra)

    def _spawn(self, index: int, node_ip: str, env_vars: Mapping[str, str] | None = None,
               call: _Call | None = None) -> _Handle:
        """Create the actor of role ``index`` in its bundle; ``env_vars`` (never a secret: Ray writes a
        runtime_env to its logs) are set in the actor's process when it starts; ``call`` is a function
        worker's (function, args, kwargs)."""
        spec = self.roles[index]
        options: dict[str, Any] = {
            "num_cpus": spec.cpus, "num_gpus": spec.gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=index)}
        if env_vars:
            options["runtime_env"] = {"env_vars": dict(env_vars)}
        handle = _Handle(spec, _Remote.options(**options).remote(spec.name, call), node_ip)
        self._handles.append(handle)
        return handle

    def _wait_port(self, scheduler: _Handle) -> int:
        timeout = self.settings.connect_timeout
        try:
            port, code = ray.get(scheduler.actor.wait_port.remote(timeout), timeout=timeout + 30)
        except ray.exceptions.RayActorError as exc:
            scheduler.dead = True
            raise self._died(scheduler, exc) from None
        except ray.exceptions.GetTimeoutError:
            port, code = None, None
        if port is not None:
            return port
        if code is not None:
            scheduler.exit_code = code
            grace = self.settings.shutdown_timeout
            note = ""
            try:
                self._print(scheduler, ray.get(scheduler.actor.drain.remote(0), timeout=grace)[0])
            except ray.exceptions.GetTimeoutError:
                note = f" (its last output did not arrive within {grace:g} s, KVSTORE_SHUTDOWN_TIMEOUT)"
            except ray.exceptions.RayError as exc:
                note = f" (its last output is lost: {_death_reason(exc)})"
            raise RoleFailed(f"scheduler exited with code {code} before reporting its port{note}",
                             "scheduler", None, code)
        raise DeadlineExceededError(f"the scheduler did not report its port within {timeout:g} s "
                                    "(KVSTORE_CONNECT_TIMEOUT)")

    # supervise -------------------------------------------------------------------------------------
    def actor(self, role: str, rank: int | None = None) -> Any:
        """The Ray actor handle of ``role`` ``rank`` (e.g. ``job.actor('worker', 1)``)."""
        for handle in self._handles:
            if handle.spec.role == role and handle.spec.rank == rank:
                return handle.actor
        raise KeyError(f"no {role} {rank} in this job" if rank is not None else f"no {role} in this job")

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Supervise the job to its end and tear it down; return the workers' results by rank (the
        function's return values, or every command worker's exit code, 0).

        Raises RoleFailed when a role fails or its actor dies, DeadlineExceededError past
        ``timeout`` seconds; every role is stopped either way.
        """
        try:
            return self.supervise(timeout)
        finally:
            self.stop()

    def supervise(self, timeout: float | None = None) -> list[Any]:
        """:meth:`wait` without the teardown (call :meth:`stop` after it)."""
        self._timeout = timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pending = {h.actor.drain.remote(_POLL): h for h in self._handles
                         if not h.dead and h.exit_code is None}
        workers_left = {h.spec.rank for h in self._handles if h.spec.role == "worker"}
        while workers_left:
            self._poll(deadline, workers_left)
        # The scheduler and servers exit 0 by themselves once every worker has left; as with the
        # local launcher, how they exit after the last worker is not checked.
        grace_end = time.monotonic() + self.settings.shutdown_timeout
        while self._pending and time.monotonic() < grace_end:
            self._poll(grace_end, workers_left, final=True)
        for handle in self._pending.values():
            log.warning("%s did not exit within %g s of the workers; stopping it", handle.spec.name,
                        self.settings.shutdown_timeout)
        return [self._results[rank] for rank in range(self.num_workers)]

    def _poll(self, deadline: float | None, workers_left: set[int], final: bool = False) -> None:
        """Wait up to a second for one actor's drain(); print its lines and act on its exit."""
        wait_for = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=wait_for)
        if not ready:
            if deadline is not None and time.monotonic() >= deadline and not final:
                raise DeadlineExceededError(f"the job did not finish within {self._timeout:g} s "
                                            "(the timeout of wait/run)")
            return
        ref = ready[0]
        handle = self._pending.pop(ref)
        try:
            lines, code = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            handle.dead = True
            if final:
                log.warning("%s", self._died(handle, exc))
                return
            raise self._died(handle, exc) from None
        self._print(handle, lines)
        if code is None:
            self._pending[handle.actor.drain.remote(_POLL)] = handle
            return
        handle.exit_code = code
        if final:
            return
        if code != 0:
            raise self._failed(handle, code)
        if handle.spec.role == "worker":
            self._results[handle.spec.rank] = self._result_of(handle)
            workers_left.discard(handle.spec.rank)

    def _result_of(self, handle: _Handle) -> Any:
        """A finished worker's result: 0 for a command, else its function's return value.

        Raises DeadlineExceededError when the value does not arrive within ``KVSTORE_REQUEST_TIMEOUT``,
        RoleFailed when the actor died or the value could not be sent back."""
        if self.function is None:
            return 0
        timeout = self.settings.request_timeout
        try:
            return ray.get(handle.actor.result.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise DeadlineExceededError(f"{handle.spec.name}'s return value did not arrive within "
                                        f"{timeout:g} s (KVSTORE_REQUEST_TIMEOUT)") from None
        except ray.exceptions.RayActorError as exc:
            handle.dead = True
            raise self._died(handle, exc) from None
        except ray.exceptions.RayError as exc:
            raise RoleFailed(f"{handle.spec.name}'s return value could not be sent back: {exc}",
                             handle.spec.role, handle.spec.rank, None) from None

    def _failed(self, handle: _Handle, code: int) -> RoleFailed:
        spec = handle.spec
        message = f"{spec.name} exited with code {code}"
        if spec.role == "worker" and self.function is not None:
            try:
                error = ray.get(handle.actor.error.remote(), timeout=10)
            except ray.exceptions.RayError:
                error = None
            if error:
                message = f"{spec.name}'s function raised (exit code {code}):\n{error.rstrip()}"
        return RoleFailed(message, spec.role, spec.rank, code)

    def _died(self, handle: _Handle, exc: BaseException) -> RoleFailed:
        spec = handle.spec
        reason = _death_reason(exc)
        return RoleFailed(f"{spec.name} died (its Ray actor on {handle.node_ip} is gone: {reason})",
                          spec.role, spec.rank, None)

    def _print(self, handle: _Handle, lines: list[str]) -> None:
        if not lines:
            return
        out = self._out or sys.stdout
        prefix = f"[{handle.spec.name}] "
        out.write("".join(f"{prefix}{line}\n" for line in lines))
        out.flush()

    # teardown --------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Tear the job down (idempotent): release every tether, give the roles
        ``KVSTORE_SHUTDOWN_TIMEOUT`` to exit (one shared deadline; each tether then SIGKILLs its
        role), print what they wrote last, kill every actor, remove the placement group, and shut
        down the Ray instance this job started."""
        if self._stopped:
            return
        self._stopped = True
        alive = [h for h in self._handles if not h.dead and h.created]  # the others hold no role
        try:
            if alive:
                self._release(alive)
        finally:
            for handle in self._handles:
                try:
                    ray.kill(handle.actor)
                except Exception:  # noqa: BLE001 -- already gone
                    pass
            if self._pg is not None:
                try:
                    remove_placement_group(self._pg)
                except Exception:  # noqa: BLE001
                    pass
                self._pg = None
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False

    def _release(self, alive: list[_Handle]) -> None:
        grace = self.settings.shutdown_timeout
        ray.wait([h.actor.release.remote() for h in alive], num_returns=len(alive), timeout=5)
        waits = {h.actor.wait.remote(grace + 1): h for h in alive}
        ready = set(ray.wait(list(waits), num_returns=len(waits), timeout=grace + 5)[0])
        # what the supervision loop had asked for, then whatever is left
        self._print_drains(self._pending, _POLL + 5)
        self._pending = {}
        self._print_drains({h.actor.drain.remote(0): h for h in alive}, 5)
        still = []
        for ref, handle in waits.items():
            if handle.spec.role == "worker" and self.function is not None:
                continue  # a function worker is not waited for: killing its actor stops it
            try:
                code = ray.get(ref) if ref in ready else None
            except ray.exceptions.RayError:
                continue
            if code is None:
                still.append(handle.spec.name)
        if still:
            log.error("still running %g s after the stop, killed with their actors: %s", grace,
                      ", ".join(still))

    def _print_drains(self, drains: Mapping[Any, _Handle], timeout: float) -> None:
        if not drains:
            return
        done, _ = ray.wait(list(drains), num_returns=len(drains), timeout=timeout)
        for ref in done:
            try:
                self._print(drains[ref], ray.get(ref)[0])
            except ray.exceptions.RayError:
                pass

    def __enter__(self) -> RayJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _disable_usage_stats() -> None:
    """Turn off Ray's usage-stats reporting for the Ray instance this process starts."""
    for module in ("ray._common.usage.usage_lib", "ray._private.usage.usage_lib"):
        try:
            lib = __import__(module, fromlist=["set_usage_stats_enabled_via_env_var"])
            lib.set_usage_stats_enabled_via_env_var(False)
            return
        except (ImportError, AttributeError):
            continue


def start(target: Sequence[str] | str | Callable[..., Any], num_workers: int, num_servers: int | None = None,
          **options: Any) -> RayJob:
    """Start a cluster on Ray and return its :class:`RayJob` once every role is started (see
    :func:`run` for the arguments and errors)."""
    return RayJob(target, num_workers, num_workers if num_servers is None else num_servers,
                  **options).start()


def run(target: Sequence[str] | str | Callable[..., Any], num_workers: int, num_servers: int | None = None,
        *, args: tuple = (), kwargs: Mapping[str, Any] | None = None, address: str | None = None,
        env: Mapping[str, str] | None = None, scheduler_cpus: float = DEFAULT_SCHEDULER_CPUS,
        server_cpus: float = DEFAULT_SERVER_CPUS, worker_cpus: float = DEFAULT_WORKER_CPUS,
        worker_gpus: float = 0.0, placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT,
        cwd: str | None = None, timeout: float | None = None, stdout: TextIO | None = None) -> list[Any]:
    """Run a kvstore cluster on Ray to its end: 1 scheduler, ``num_servers`` servers (default:
    ``num_workers``) and ``num_workers`` workers, each a Ray actor.

    ``target`` is the workers' command (an argv list, or a string split like a shell does; a first
    word ending in ``.py`` runs with the actor's Python) or a function, called as
    ``target(*args, **kwargs)`` in each worker's actor with the ``DMLC_*`` environment set, so
    ``kvstore.create('dist_sync')`` inside it joins the cluster.  Returns the workers' results in
    rank order: the function's return values, or the command workers' exit codes (all 0).

    ``address`` joins a running Ray cluster (as ``ray.init(address=...)``; ``"auto"`` finds one
    through ``RAY_ADDRESS`` or ``ray start`` on this machine) and leaves it running; None starts a
    new local Ray instance for this job (``ray.init(address="local")``, whatever ``RAY_ADDRESS``
    says) and shuts it down at the end.  If this process is connected to Ray already, that
    connection is used and kept.  ``env`` adds variables to every role (and the caller's
    ``KVSTORE_*``/``DMLC_*`` and ``OMP_NUM_THREADS`` are passed on).  ``*_cpus`` / ``worker_gpus``
    size each role's bundle; ``placement_timeout`` bounds the wait for them; ``cwd`` is the command
    roles' directory where it exists (default: this one); ``timeout`` bounds the whole run;
    role output lines go to ``stdout`` (default ``sys.stdout``) prefixed ``[worker 1] `` etc.

    Raises PlacementError, RoleFailed (with ``role``, ``rank``, ``exit_code``),
    DeadlineExceededError, or ValueError for bad counts or sizes; every role, actor and the
    placement group are gone when it returns or raises.
    """
    job = RayJob(target, num_workers, num_workers if num_servers is None else num_servers, args=args,
                 kwargs=kwargs, address=address, env=env, scheduler_cpus=scheduler_cpus,
                 server_cpus=server_cpus, worker_cpus=worker_cpus, worker_gpus=worker_gpus,
                 placement_timeout=placement_timeout, cwd=cwd, stdout=stdout)
    job.start()
    return job.wait(timeout)


def launch(cfg: LaunchConfig, settings: kvconfig.Config) -> int:
    """Run ``launch.py --launcher ray``: start ``cfg`` on Ray, supervise it, tear it down; return the
    launcher's exit code (0; the failed role's code, 1 when its actor died or the job could not be
    placed or started; 130 on Ctrl-C; 143 on SIGTERM)."""
    job: RayJob | None = None
    previous = signal.getsignal(signal.SIGTERM)
    code = 0
    try:
        job = RayJob(cfg.command, cfg.num_workers, cfg.num_servers, address=cfg.ray_address, env=cfg.env,
                     settings=settings, **cfg.ray_options)
        job._connect()
        signal.signal(signal.SIGTERM, roles.raise_interrupt)  # after ray.init, which sets its own
        job.start()
        job.supervise()
    except RoleFailed as exc:
        code = exc.exit_code or 1
        log.error("%s; stopping the other processes", exc)
    except KeyboardInterrupt as exc:
        code = 128 + int(exc.args[0] if exc.args else signal.SIGINT)
        log.error("interrupted; stopping every process")
    except (PlacementError, DeadlineExceededError, ValueError) as exc:
        code = 1
        log.error("%s", exc)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
        code = 1
        log.error("Ray: %s", exc)
    finally:
        if job is not None:
            job.stop()
        signal.signal(signal.SIGTERM, previous)
    return code

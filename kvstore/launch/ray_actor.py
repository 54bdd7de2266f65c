"""One role of a job on Ray, in its actor: a tethered subprocess (the scheduler, a server, a command
worker), or the user's function called in the actor's own process (a function worker).

:class:`RoleActor` is plain Python; :mod:`kvstore.launch.ray_job` makes it a Ray actor class.  The
driver long-polls :meth:`RoleActor.drain` for the role's output lines and exit code.  A tethered
role is a :class:`~kvstore.launch.roleprocess.RoleProcess` started by a ``/bin/sh`` keeper (this
module's placement); a function worker's output comes through the same output pump.
"""

from __future__ import annotations

import atexit
import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from kvstore import config as kvconfig
from kvstore.launch import tether
from kvstore.launch.node import python_if_script
from kvstore.launch.roleprocess import RoleProcess, RoleSpec, read_port, start_pump

EOF_GRACE = 1.0  # seconds a role's exit waits for its last output (a grandchild may hold the pipe)
Call = tuple[Callable[..., Any], tuple, dict[str, Any]]  # a function worker's (function, args, kwargs)


class RoleActor:
    """One role in a Ray actor: a tethered subprocess, or the user's function in this process.

    Runs threaded (``max_concurrency``), so a drain() can wait while the role runs.  A function
    worker's ``call`` (the function, its args and kwargs) comes with the actor's creation, so Ray
    has unpickled it by the time the actor is ready (see RayJob._started).
    """

    def __init__(self, name: str, call: Call | None = None) -> None:
        self.name = name
        self._call_spec = call
        self._cond = threading.Condition()
        self._lines: list[str] = []
        self._code: int | None = None
        self._exited_at = 0.0
        self._eof = False
        self._role: RoleProcess | None = None
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

    @property
    def _proc(self) -> subprocess.Popen | None:
        """The keeper's process of a tethered role, if one was started."""
        return None if self._role is None else self._role.proc

    # output and exit, shared by both kinds
    def _collect(self, raw: bytes) -> None:
        """Keep one output line of the role for drain()."""
        with self._cond:
            self._lines.append(raw.decode(errors="replace").rstrip("\r\n"))
            self._cond.notify_all()

    def _output_end(self) -> None:
        """Note the end of the role's output and wake drain()."""
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _exited(self, code: int) -> None:
        """Record the role's exit ``code`` (the port file's directory is removed first) and wake drain()."""
        self._remove_tmpdir()
        with self._cond:
            self._code, self._exited_at = code, time.monotonic()
            self._cond.notify_all()

    def _exit_visible(self) -> bool:
        """The exit is reported once its output is read to the end, or a moment after it."""
        return self._code is not None and (self._eof or time.monotonic() - self._exited_at > EOF_GRACE)

    def drain(self, timeout: float) -> tuple[list[str], int | None]:
        """Wait up to ``timeout`` for output or the exit; return the new lines and the exit code (or None)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._lines and not self._exit_visible():
                left = deadline - time.monotonic()
                if self._code is not None:
                    left = min(left, self._exited_at + EOF_GRACE - time.monotonic() + 0.01)
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
        with self._cond:  # a restart (--max-restarts): the role that ran here before has exited
            self._code, self._eof = None, False
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
        start = functools.partial(_start_keeper, keeper=keeper, keeper_env=keeper_env,
                                  cwd=cwd if cwd and os.path.isdir(cwd) else None)
        self._role = RoleProcess(_spec(self.name, argv, env), start, output=self._collect,
                                 on_output_end=self._output_end, tethered=True)
        self._role.on_exit(lambda role: self._exited(role.exit_code))
        try:
            self._role.start()
        except BaseException:
            self._remove_tmpdir()
            raise

    def wait_port(self, timeout: float) -> tuple[int | None, int | None]:
        """Wait up to ``timeout`` for the scheduler's port file; return (port, None), or (None, exit
        code) when the scheduler exited first, or (None, None) at the deadline (at once without a port
        file).  The port file's directory is removed once the port is read (the scheduler writes it
        once, atomically).  A port file an exit removed with its directory reads as none (the exit code
        then tells).  Raises nothing."""
        port = None
        if self._port_file is not None:
            port = read_port(self._port_file, timeout, self._exited_within)
        if port is not None:
            self._remove_tmpdir()
            return port, None
        with self._cond:
            return None, self._code

    def _exited_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` (less when output comes) for the role's exit; say whether it exited."""
        with self._cond:
            if self._code is None:
                self._cond.wait(seconds)
            return self._code is not None

    def release(self) -> None:
        """Close the tether's stdin: it stops the role (nothing for a function worker); remove the
        port file's directory."""
        if self._role is not None:
            self._role.request_stop()
        self._remove_tmpdir()

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for a tethered role to exit; return its code (None while it runs).
        A function worker is not waited for: its code, or None at once."""
        if self._role is not None:
            code = self._role.wait(time.monotonic() + timeout)
            if code is not None:
                self._remove_tmpdir()
            return code
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
        """:meth:`_call` with ``env`` set in this process's environment while it runs."""
        with kvconfig.process_environ(env):
            self._call(fn, args, kwargs)

    def _call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
        """Call ``fn(*args, **kwargs)`` with file descriptors 1 and 2 piped into this role's output; keep
        its result or traceback, leave the cluster, then record the exit code.  Raises nothing."""
        read_fd, write_fd = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        start_pump(os.fdopen(read_fd, "rb"), self._collect, self._output_end)
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


def _spec(name: str, argv: list[str], env: dict[str, str]) -> RoleSpec:
    """The RoleSpec of the role named ``name`` (``scheduler``, ``server 0``, ``worker 1``)."""
    role, _, rank = name.partition(" ")
    return RoleSpec(role, int(rank) if rank else None, argv, env)


def _start_keeper(spec: RoleSpec, keeper: list[str], keeper_env: dict[str, str],
                  cwd: str | None) -> subprocess.Popen:
    """Start the ``/bin/sh`` ``keeper`` that runs a tether (see RoleActor.start_command) with the
    environment ``keeper_env``, and write ``spec``'s request, to run in ``cwd``, to its stdin.
    Raises OSError when the keeper cannot be started."""
    proc = subprocess.Popen(keeper, env=keeper_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        proc.stdin.write(tether.request(spec.argv, spec.env, cwd))
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # the keeper or the tether exited already: its exit code tells why
    return proc


def _leave_cluster(failure: str | None) -> None:
    """Close this process's dist store, if the function made one: the worker leaves the cluster (or,
    with ``failure``, is reported failed), as the exit hook of a worker process would."""
    from kvstore.client.instance import release_process_store

    release_process_store(failure)


def _system_exit_code(code: object) -> int:
    """The exit code ``sys.exit(code)`` gives a process: 0 for None, an int as it is, 1 for the rest."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


"""``python -m kvstore.launch.tether``: run one process for a parent that may vanish.

A role started over ssh, inside a Ray actor or from a Spark task must not
outlive whoever started it: an ssh connection can drop, an actor can be killed,
a task can be cancelled.  The tether ties its child's life to a pipe.

Its stdin carries one JSON line, ``{"argv": [...], "env": {...}, "cwd": ...}``
(the environment travels on stdin, not on a command line, so a secret in it is
never shown by ``ps`` on the remote machine); with ``"announce": true`` the
tether first writes :data:`STARTED` to its stdout (the ssh launcher counts a
connection as past its login then).  The tether starts ``argv`` in a
new process group, with ``env`` added to its own environment and stdin from
``/dev/null``; the output goes where the tether's goes.  Then it reads stdin
until end of file.  End of file (the parent closed the pipe, exited or was
killed, or the ssh connection dropped), SIGTERM, SIGINT or SIGHUP stops the
child: SIGTERM to its group; once ``KVSTORE_SHUTDOWN_TIMEOUT`` seconds (the child's
value) have passed with the child or anything else of its group still there,
SIGKILL to the group.  When the child exits by itself, whatever it left in its
group gets SIGTERM, and SIGKILL after :data:`LEFTOVER_GRACE` seconds (or the
shutdown timeout, if shorter).  The SIGKILL is sent before anything is reported,
and a report to a closed stderr (the reader is gone) is dropped, so a vanished
reader never keeps the tether from killing.
The tether exits with the child's code (128 + the signal number when a signal
ended it), or 2 for a bad request, or 127 when ``argv`` cannot be started.
The child is a :class:`~kvstore.launch.roleprocess.RoleProcess`, stopped by that
type's :meth:`~kvstore.launch.roleprocess.RoleProcess.stop`, as every launcher's roles are.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.launch.roleprocess import Killed, RoleProcess, RoleSpec, release

__all__ = ["STARTED", "LEFTOVER_GRACE", "Request", "request", "parse_request", "spawn", "release", "run",
           "main"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STARTED = b"kvstore.tether: started\n"  # on stdout, when the request asks for it, before the child starts
LEFTOVER_GRACE = 2.0  # seconds between SIGTERM and SIGKILL for what a child that exited left in its group


class Request(NamedTuple):
    """What a tether is asked to run (see :func:`request`)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    announce: bool


def request(argv: list[str], env: Mapping[str, str], cwd: str | None = None, announce: bool = False) -> bytes:
    """Return the line a tether reads from stdin to run ``argv`` with ``env`` added, in ``cwd``; with
    ``announce`` the tether writes :data:`STARTED` to its stdout before it starts ``argv``."""
    spec: dict[str, Any] = {"argv": list(argv), "env": dict(env), "cwd": cwd}
    if announce:
        spec["announce"] = True
    return json.dumps(spec).encode() + b"\n"


def parse_request(line: bytes) -> Request:
    """Parse a :func:`request` line; raises ConfigError naming what is wrong."""
    try:
        spec = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"stdin's first line is not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise ConfigError("the request must be a JSON object with 'argv' and 'env'")
    argv, env, cwd = spec.get("argv"), spec.get("env", {}), spec.get("cwd")
    announce = spec.get("announce", False)
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ConfigError("'argv' must be a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ConfigError("'env' must map strings to strings")
    if cwd is not None and not isinstance(cwd, str):
        raise ConfigError("'cwd' must be a string or null")
    if not isinstance(announce, bool):
        raise ConfigError("'announce' must be true or false")
    return Request(argv, env, cwd, announce)


def spawn(argv: list[str], env: Mapping[str, str], *, via: list[str] | None = None,
          cwd: str | None = None, announce: bool = False, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` under a tether and return the tether's process, its stdin still open.

    ``via`` is the command that runs the tether (default: this Python's
    ``-m kvstore.launch.tether``; an ssh command line for a remote one).  Closing the
    returned process's stdin (:func:`release`) stops the child gracefully; so
    does this process's death.  With ``announce`` the tether's stdout starts with
    :data:`STARTED` (possibly after output of whatever ``via`` runs first).
    ``popen`` goes to :class:`subprocess.Popen` (e.g. ``stdout``).  Raises OSError
    when ``via`` cannot be started.
    """
    command = via if via is not None else [sys.executable, "-m", "kvstore.launch.tether"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, **popen)
    try:
        proc.stdin.write(request(argv, env, cwd, announce))
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # it exited already; its exit code tells why
    return proc


def _report(message: str) -> None:
    """Write ``kvstore.tether: message`` to stderr, unbuffered; an error (a closed pipe) is ignored."""
    try:
        os.write(2, f"kvstore.tether: {message}\n".encode(errors="replace"))
    except OSError:
        pass


def _read_line(fd: int) -> bytes:
    """Read up to the first newline from ``fd`` unbuffered (what follows it is not needed)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


def _announce() -> None:
    """Write :data:`STARTED` to stdout, before the child starts so that none of its output comes first.
    Raises nothing: when the reader is gone, end of file on stdin follows and stops the child."""
    try:
        os.write(1, STARTED)
    except OSError:
        pass


def _start_child(spec: RoleSpec, cwd: str | None) -> subprocess.Popen:
    """Start the requested child in ``cwd``, in a session and process group of its own, stdin from
    ``/dev/null``, its output where the tether's goes.  Raises OSError."""
    return subprocess.Popen(spec.argv, env=spec.env, cwd=cwd, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _stop_when_parent_ends(fd: int, stop: threading.Event) -> None:
    """Start a daemon thread that sets ``stop`` at end of file on ``fd`` (the parent is gone).
    Returns at once; raises RuntimeError if the thread cannot start."""

    def watch_parent() -> None:
        """Read ``fd`` to end of file, then set ``stop``."""
        while os.read(fd, 4096):
            pass
        stop.set()

    threading.Thread(target=watch_parent, daemon=True).start()


def run(fd: int) -> int:
    """Serve one request read from file descriptor ``fd`` (see the module docstring); return the
    exit code.  Reads are unbuffered, so the thread left blocked on ``fd`` holds no lock at exit."""
    try:
        argv, env, cwd, announce = parse_request(_read_line(fd))
        child_env = kvconfig.child_environ(env)
        grace = kvconfig.load(child_env).shutdown_timeout
    except ConfigError as exc:
        _report(str(exc))
        return 2
    if announce:
        _announce()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    child = RoleProcess(RoleSpec("tethered", None, argv, child_env), functools.partial(_start_child, cwd=cwd))
    try:
        child.start()
    except OSError as exc:
        _report(f"cannot start {argv[0]}: {exc}")
        return 127
    exited_by_itself = False
    killed: Killed | None = None
    try:
        child.on_exit(lambda _: stop.set())
        _stop_when_parent_ends(fd, stop)
        stop.wait()
        exited_by_itself = child.exit_code is not None
    finally:  # whatever happened above, the child and its group are stopped, SIGKILL if need be
        wait = min(grace, LEFTOVER_GRACE) if exited_by_itself else grace
        killed = child.stop(wait)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if killed is Killed.PROCESS:
        _report(f"{argv[0]} did not stop within {grace:g} s of SIGTERM; killed it (SIGKILL to its group)")
    elif killed is Killed.GROUP:
        _report(f"what {argv[0]} left in its process group did not stop within {wait:g} s of SIGTERM; "
                "killed it")
    return child.exit_code


def main() -> int:
    """Entry point of ``python -m kvstore.launch.tether``."""
    # Python ignores SIGPIPE already (a write to a closed pipe raises instead); said here because the
    # stop path relies on it.  The child gets the default back (subprocess's restore_signals).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    return run(sys.stdin.fileno())


if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvstore.tether``: run one process for a parent that may vanish.

A role started over ssh, inside a Ray actor or from a Spark task must not
outlive whoever started it: an ssh connection can drop, an actor can be killed,
a task can be cancelled.  The tether ties its child's life to a pipe.

Its stdin carries one JSON line, ``{"argv": [...], "env": {...}, "cwd": ...}``
(the environment travels on stdin, not on a command line, so a secret in it is
never shown by ``ps`` on the remote machine).  The tether starts ``argv`` in a
new process group, with ``env`` added to its own environment and stdin from
``/dev/null``; the output goes where the tether's goes.  Then it reads stdin
until end of file.  End of file (the parent closed the pipe, exited or was
killed, or the ssh connection dropped), SIGTERM, SIGINT or SIGHUP stops the
child: SIGTERM to its group, ``KVSTORE_SHUTDOWN_TIMEOUT`` seconds (the child's value), then
SIGKILL.
When the child exits by itself, whatever it left in its group gets SIGTERM.
The tether exits with the child's code (128 + the signal number when a signal
ended it), or 2 for a bad request, or 127 when ``argv`` cannot be started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from . import config as kvconfig
from . import roles
from .errors import ConfigError

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def request(argv: list[str], env: Mapping[str, str], cwd: str | None = None) -> bytes:
    """Return the line a tether reads from stdin to run ``argv`` with ``env`` added, in ``cwd``."""
    return json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode() + b"\n"


def parse_request(line: bytes) -> tuple[list[str], dict[str, str], str | None]:
    """Parse a :func:`request` line; raises ConfigError naming what is wrong."""
    try:
        spec = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"stdin's first line is not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise ConfigError("the request must be a JSON object with 'argv' and 'env'")
    argv, env, cwd = spec.get("argv"), spec.get("env", {}), spec.get("cwd")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ConfigError("'argv' must be a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ConfigError("'env' must map strings to strings")
    if cwd is not None and not isinstance(cwd, str):
        raise ConfigError("'cwd' must be a string or null")
    return argv, env, cwd


def spawn(argv: list[str], env: Mapping[str, str], *, via: list[str] | None = None,
          cwd: str | None = None, **popen: Any) -> subprocess.Popen:
    """Start ``argv`` under a tether and return the tether's process, its stdin still open.

    ``via`` is the command that runs the tether (default: this Python's
    ``-m kvstore.tether``; an ssh command line for a remote one).  Closing the
    returned process's stdin (:func:`release`) stops the child gracefully; so
    does this process's death.  ``popen`` goes to :class:`subprocess.Popen`
    (e.g. ``stdout``).  Raises OSError when ``via`` cannot be started.
    """
    command = via if via is not None else [sys.executable, "-m", "kvstore.tether"]
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, **popen)
    try:
        proc.stdin.write(request(argv, env, cwd))
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # it exited already; its exit code tells why
    return proc


def release(proc: subprocess.Popen) -> None:
    """Close a tether's stdin: its child is stopped (SIGTERM, then SIGKILL after the timeout)."""
    try:
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
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


def run(fd: int) -> int:
    """Serve one request read from file descriptor ``fd`` (see the module docstring); return the
    exit code.  Reads are unbuffered, so the thread left blocked on ``fd`` holds no lock at exit."""
    try:
        argv, env, cwd = parse_request(_read_line(fd))
        child_env = kvconfig.child_environ(env)
        grace = kvconfig.load(child_env).shutdown_timeout
    except ConfigError as exc:
        print(f"kvstore.tether: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    try:
        child = subprocess.Popen(argv, env=child_env, cwd=cwd, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    except OSError as exc:
        print(f"kvstore.tether: cannot start {argv[0]}: {exc}", file=sys.stderr, flush=True)
        return 127

    def watch_parent() -> None:
        while os.read(fd, 4096):
            pass
        stop.set()

    def watch_child() -> None:
        child.wait()
        stop.set()

    threading.Thread(target=watch_parent, daemon=True).start()
    threading.Thread(target=watch_child, daemon=True).start()
    stop.wait()
    if child.poll() is None:
        _signal_group(child.pid, signal.SIGTERM)
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            print(f"kvstore.tether: {argv[0]} did not stop within {grace:g} s; killing it",
                  file=sys.stderr, flush=True)
            _signal_group(child.pid, signal.SIGKILL)
            child.wait()
    else:
        _signal_group(child.pid, signal.SIGTERM)  # whatever it left behind in its group
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    return roles.exit_code(child.returncode)


def main() -> int:
    """Entry point of ``python -m kvstore.tether``."""
    return run(sys.stdin.fileno())


if __name__ == "__main__":
    sys.exit(main())

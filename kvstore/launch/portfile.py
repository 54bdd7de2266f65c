"""The scheduler's port file (``KVSTORE_PORT_FILE``): how a scheduler started on port 0 tells its
launcher the port it bound.

The scheduler writes it once, atomically (:func:`write`); the launchers (local and ssh, Ray, Spark,
``kvstore.node``) read it (:func:`read`), most of them through :func:`wait`, until the port is
there, the scheduler has exited, or their deadline has passed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

POLL_INTERVAL = 0.05  # seconds between two reads of a port file not written yet
DIGEST_SUFFIX = ".session"  # a restartable scheduler's session digest: the port file's path and this


def write_digest(path: str, digest: str) -> None:
    """Write a scheduler's session ``digest`` next to the port file ``path`` (atomically, owner-only),
    as it sends its cluster map: the launcher restarts a lost scheduler only once there is one
    (kvstore/scheduler/recovery.py checks re-registrations against it).  Raises OSError."""
    target = path + DIGEST_SUFFIX
    tmp = f"{target}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(digest + "\n")
    os.replace(tmp, target)


def read_digest(path: str) -> str | None:
    """The session digest written next to the port file ``path``; None when there is none."""
    try:
        with open(path + DIGEST_SUFFIX) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return text or None


def write(path: str, port: int) -> None:
    """Write ``port`` to ``path`` atomically (a temporary name, then a rename).  Raises OSError."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(f"{port}\n")
    os.replace(tmp, path)


def read(path: str) -> int | None:
    """The port a scheduler wrote to its ``KVSTORE_PORT_FILE`` at ``path``, or None while there is none
    (the file is written once, atomically: a read finds no file or the whole port).  Raises nothing."""
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def wait(path: str, timeout: float, exited: Callable[[float], bool],
         interval: float = POLL_INTERVAL) -> int | None:
    """Read ``path`` until it holds a port (returned), or ``timeout`` seconds have passed, or the writer
    is gone: ``exited(seconds)`` waits up to ``seconds`` for the scheduler's exit and says whether it
    has exited.  Returns None in those two cases (the caller tells which); raises what ``exited`` raises."""
    deadline = time.monotonic() + timeout
    while True:
        port = read(path)
        if port is not None:
            return port
        remaining = deadline - time.monotonic()
        if remaining <= 0 or exited(min(remaining, interval)):
            return None

"""A role's timeline recorder and files (``KVSTORE_TIMELINE=path.json``, docs/observability.md).

Here because the clocks are aligned between nodes: each heartbeat reply carries the scheduler's
time, and :data:`CLOCK` keeps the offset measured by the beat with the shortest round trip among
the recent ones.  A :class:`Recorder` holds a role's :class:`~kvstore.core.timeline.EventRing`
and writes it as its part, ``path.json.d/<role>-<rank>.json``, every :data:`WRITE_EVERY` seconds
from a thread and at exit, always atomically (a temporary file, then ``os.replace``), so each part
is valid JSON even when the process is killed.  :func:`merge_parts` joins the parts into
``path.json`` (the launcher does, after the job).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kvstore import config as kvconfig
from kvstore.core import timeline as core

log = logging.getLogger("kvstore.timeline")
VARIABLE = "KVSTORE_TIMELINE"
WRITE_EVERY = 2.0  # seconds between two writes of a role's part (when it has new events)


class Clock:
    """This node's estimate of the scheduler's clock minus its own, in seconds (0 until measured)."""

    def __init__(self, window: int = 32) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (round trip, offset)
        self._lock = threading.Lock()
        self.offset = 0.0

    def observe(self, sent: float, received: float, remote: float) -> None:
        """One round trip: sent at ``sent``, answered at ``received`` (this clock), the scheduler's
        clock reading ``remote`` in between."""
        if received < sent:
            return
        with self._lock:
            self._samples.append((received - sent, remote - (sent + received) / 2))
            self.offset = min(self._samples)[1]


CLOCK = Clock()


def parts_dir(path: str) -> str:
    """The folder of the roles' parts of the trace ``path``."""
    return f"{path}.d"


def write_json(path: str, document: Any) -> None:
    """Write ``document`` as JSON to ``path`` atomically (a temporary file beside it, then
    ``os.replace``).  Raises OSError."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        json.dump(document, out, separators=(",", ":"), allow_nan=False, default=str)
    os.replace(tmp, path)


class Recorder:
    """The timeline of one role: ``span`` adds an event; the part is written periodically and at exit."""

    def __init__(self, path: str, role: str, rank: Callable[[], int], capacity: int = core.CAPACITY,
                 clock: Clock | None = None) -> None:
        self.path, self.role, self.rank = path, role, rank
        self.clock = CLOCK if clock is None else clock
        self.ring = core.EventRing(capacity, threading.Lock())
        self._written = -1
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-timeline-{role}", daemon=True)
        self._thread.start()
        atexit.register(self.write)

    def span(self, name: str, category: str, start: float, end: float,
             args: dict[str, Any] | None = None) -> None:
        """Add an event from ``start`` to ``end`` (unix seconds, this node's clock)."""
        self.ring.span(name, category, start, end, args)

    def write(self) -> bool:
        """Write the part now if there is something new and the rank is known; True if written.
        Never raises: a failed write is logged."""
        with self._write_lock:
            rank, added = self.rank(), self.ring.added
            if rank < 0 or added == self._written:
                return False
            events = self.ring.events()
            offset = 0.0 if self.role == "scheduler" else self.clock.offset
            doc = core.part(self.role, rank, events, offset, dropped=added - len(events))
            target = os.path.join(parts_dir(self.path), f"{self.role}-{rank}.json")
            try:
                os.makedirs(parts_dir(self.path), exist_ok=True)
                write_json(target, doc)
            except (OSError, ValueError) as exc:
                log.warning("cannot write the timeline part %s: %s", target, exc)
                return False
            self._written = added
            return True

    def _loop(self) -> None:
        while not self._stop.wait(WRITE_EVERY):
            self.write()

    def close(self) -> None:
        """Stop the writing thread and write what is new."""
        self._stop.set()
        self.write()


def timeline_path(environ: Mapping[str, str] | None = None) -> str | None:
    """The trace's path from ``KVSTORE_TIMELINE`` (of ``environ``, default this process's), or None."""
    env = kvconfig.child_environ({}) if environ is None else environ
    return kvconfig.env_text(env, VARIABLE)


_RECORDERS: dict[tuple[str, str], Recorder] = {}  # (path, role) -> this process's recorder
_RECORDERS_LOCK = threading.Lock()


def recorder(role: str, rank: Callable[[], int], environ: Mapping[str, str] | None = None
             ) -> Recorder | None:
    """The process's started :class:`Recorder` for ``role`` (one per role and path: a later store of
    the same process reuses it, with its ``rank``) when ``KVSTORE_TIMELINE`` is set, else None."""
    path = timeline_path(environ)
    if path is None:
        return None
    key = (os.path.abspath(path), role)
    with _RECORDERS_LOCK:
        found = _RECORDERS.get(key)
        if found is None:
            found = _RECORDERS[key] = Recorder(key[0], role, rank)
        found.rank = rank
        return found


def merge_parts(path: str) -> int:
    """Merge the parts in ``path.d/`` into the trace ``path`` (atomically); return the number of
    parts merged (0: nothing written).  Unreadable parts are skipped with a warning.  Raises OSError
    when ``path`` cannot be written."""
    folder = parts_dir(path)
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except FileNotFoundError:
        return 0
    docs = []
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as src:
                docs.append(json.load(src))
        except (OSError, ValueError) as exc:
            log.warning("skipping the timeline part %s: %s", name, exc)
    if not docs:
        return 0
    write_json(path, core.merge(docs))
    return len(docs)


def now() -> float:
    """This node's unix time (the timeline's clock before the offset)."""
    return time.time()

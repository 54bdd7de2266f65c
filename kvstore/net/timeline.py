"""A role's timeline recorder and files (``KVSTORE_TIMELINE=path.json``, docs/observability.md).

Here because the clocks are aligned between nodes: each heartbeat reply carries the scheduler's
time, and :data:`CLOCK` keeps the offset measured by the beat with the shortest round trip among
the recent ones.  A :class:`Recorder` holds a role's :class:`~kvstore.core.timeline.EventRing`
and appends its new events to its part, ``path.json.d/<role>-<rank>.json`` (a :class:`PartFile`),
every :data:`WRITE_EVERY` seconds from a thread and at exit: the work of a write is in proportion
to the events that are new, and the part is valid JSON after each.  A part holds at most
``capacity`` events; the next write moves it to ``<role>-<rank>.prev.json`` (the one before is
dropped) and starts a new one, so a role's files hold between ``capacity`` and twice that.
:func:`merge_parts` joins the parts into ``path.json`` (the launcher does, after the job), a role's
two files into its most recent ``capacity`` events.
"""

from __future__ import annotations

import atexit
import contextlib
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
PREVIOUS = ".prev.json"  # the suffix of a role's previous generation (instead of ".json")


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


class PartFile:
    """One role's part on disk, written by appending: each write's events a line, then a last line that
    closes the trace and says what it holds, rewritten with each append (no write reads the file
    or writes an earlier event again).  Generations of ``capacity`` events, two kept."""

    def __init__(self, path: str, role: str, rank: int, capacity: int) -> None:
        self.path, self.previous = path, path[: -len(".json")] + PREVIOUS
        self.role, self.rank, self.capacity = role, rank, capacity
        self._end = -1  # where the last line starts in the file (-1: no file started yet)
        self._events = 0  # events in the file
        self._generation = 0

    def append(self, events: list[core.Event], offset_s: float, added: int) -> None:
        """Append ``events`` (at most ``capacity``), times plus ``offset_s``; ``added``: the events
        the role ever added.  Raises OSError."""
        events = events[-self.capacity:] if self.capacity > 0 else []
        if self._end < 0:
            self._start(rotate=False)
        while events:
            if self._events >= self.capacity:
                self._start(rotate=True)
            room = self.capacity - self._events
            self._append(events[:room], offset_s, added - len(events[room:]))
            events = events[room:]

    def _start(self, rotate: bool) -> None:
        """A new generation in ``path``: the last one becomes ``previous``; the first of this
        process replaces what an earlier one left."""
        if rotate:
            os.replace(self.path, self.previous)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.previous)
        self._generation += 1
        head = core.part_head(self.role, self.rank).encode()
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as out:
            out.write(head + self._tail(0.0, 0).encode())
        os.replace(tmp, self.path)
        self._end, self._events = len(head), 0

    def _append(self, events: list[core.Event], offset_s: float, added: int) -> None:
        lines = core.event_lines(self.role, self.rank, events, offset_s).encode()
        with open(self.path, "r+b") as out:
            out.seek(self._end)
            out.write(lines + self._tail(offset_s, added, len(events)).encode())
            out.truncate()
        self._end += len(lines)
        self._events += len(events)

    def _tail(self, offset_s: float, added: int, new: int = 0) -> str:
        return core.part_tail(self.role, self.rank, offset_s, self._events + new, added, self._generation,
                              self.capacity)


class Recorder:
    """The timeline of one role: ``span`` adds an event; the new ones are appended to the part
    periodically and at exit."""

    def __init__(self, path: str, role: str, rank: Callable[[], int], capacity: int = core.CAPACITY,
                 clock: Clock | None = None) -> None:
        self.path, self.role, self.rank = path, role, rank
        self.clock = CLOCK if clock is None else clock
        self.ring = core.EventRing(capacity, threading.Lock())
        self.capacity = capacity
        self._written = -1  # events added when the part was last written (-1: never written)
        self._file: PartFile | None = None
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
        """Append the new events to the part if there are any and the rank is known; True if
        written.  Never raises: a failed write is logged (and its events left out)."""
        with self._write_lock:
            rank = self.rank()
            if rank < 0 or self.ring.added == self._written:
                return False
            events, added = self.ring.since(max(0, self._written))
            offset = 0.0 if self.role == "scheduler" else self.clock.offset
            target = os.path.join(parts_dir(self.path), f"{self.role}-{rank}.json")
            try:
                if self._file is None or self._file.path != target:
                    os.makedirs(parts_dir(self.path), exist_ok=True)
                    self._file = PartFile(target, self.role, rank, self.capacity)
                self._file.append(events, offset, added)
            except (OSError, ValueError) as exc:
                log.warning("cannot write the timeline part %s: %s", target, exc)
                self._file = None  # the next write starts the part again
                return False
            finally:
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
    roles merged (0: nothing written).  Unreadable parts are skipped with a warning; the whole
    lines of a part cut short are kept.  Raises OSError when ``path`` cannot be written."""
    folder = parts_dir(path)
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except FileNotFoundError:
        return 0
    docs = []
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as src:
                doc = core.read_part(src.read())
        except (OSError, ValueError) as exc:
            log.warning("skipping the timeline part %s: %s", name, exc)
            continue
        if doc is None:
            log.warning("skipping the timeline part %s: not a trace", name)
        else:
            docs.append(doc)
    if not docs:
        return 0
    merged = core.merge(docs)
    write_json(path, merged)
    return len(merged["otherData"]["parts"])


def now() -> float:
    """This node's unix time (the timeline's clock before the offset)."""
    return time.time()

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

``path`` may be a storage URL (``s3://bucket/trace.json``, :mod:`kvstore.core.storage`, which does all
the file access here).  An object store cannot append, so there a part's current generation is kept
in memory and written whole at most every :data:`REMOTE_EVERY` seconds and at exit
(:class:`PartFile` with ``remote``).
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
from kvstore.core import storage
from kvstore.core import timeline as core

log = logging.getLogger("kvstore.timeline")
VARIABLE = "KVSTORE_TIMELINE"
WRITE_EVERY = 2.0  # seconds between two writes of a role's part (when it has new events)
PREVIOUS = ".prev.json"  # the suffix of a role's previous generation (instead of ".json")
REMOTE_EVERY = 30.0  # seconds between two writes of a part to an object store (and at exit)


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
    """Write ``document`` as JSON to ``path`` (a path or a storage URL) atomically.  Raises OSError."""
    text = json.dumps(document, separators=(",", ":"), allow_nan=False, default=str).encode()
    storage.atomic_write(path, lambda out: out.write(text))


class PartFile:
    """One role's part, written by appending: each write's events a line, then a last line that closes
    the trace and says what it holds, rewritten with each append (no write reads the file or writes an
    earlier event again).  Generations of ``capacity`` events, two kept.  On an object store
    (``remote``) the generation is kept in memory and written whole when :meth:`append` is ``final``
    or ``REMOTE_EVERY`` seconds have passed since the last write."""

    def __init__(self, path: str, role: str, rank: int, capacity: int) -> None:
        self.path, self.previous = path, path[: -len(".json")] + PREVIOUS
        self.role, self.rank, self.capacity = role, rank, capacity
        self.remote = not storage.is_local(path)
        self._end = -1  # where the last line starts in the file (-1: no file started yet)
        self._events = 0  # events in the file
        self._generation = 0
        self._body = bytearray()  # remote: the generation's head and lines, without its last line
        self._tail_now = b""  # remote: its last line
        self._stored_at = -float("inf")
        self._unstored = False

    def append(self, events: list[core.Event], offset_s: float, added: int, final: bool = False) -> None:
        """Append ``events`` (at most ``capacity``), times plus ``offset_s``; ``added``: the events
        the role ever added; ``final``: the role's last write (a remote part is written now).
        Raises OSError."""
        events = events[-self.capacity:] if self.capacity > 0 else []
        if self._end < 0:
            self._start(rotate=False)
        while events:
            if self._events >= self.capacity:
                self._start(rotate=True)
            room = self.capacity - self._events
            self._append(events[:room], offset_s, added - len(events[room:]))
            events = events[room:]
        if self.remote and self._unstored and (final or time.monotonic() - self._stored_at >= REMOTE_EVERY):
            self._store()

    def _start(self, rotate: bool) -> None:
        """A new generation in ``path``: the last one becomes ``previous``; the first of this
        process replaces what an earlier one left."""
        if rotate:
            if self.remote:
                self._store()  # whole, before it moves
            storage.move(self.path, self.previous)
        else:
            with contextlib.suppress(FileNotFoundError):
                storage.remove(self.previous)
        self._generation += 1
        head = core.part_head(self.role, self.rank).encode()
        tail = self._tail(0.0, 0).encode()
        if self.remote:
            self._body, self._tail_now = bytearray(head), tail
            self._store()
        else:
            storage.atomic_write(self.path, lambda out: out.write(head + tail))
        self._end, self._events = len(head), 0

    def _append(self, events: list[core.Event], offset_s: float, added: int) -> None:
        lines = core.event_lines(self.role, self.rank, events, offset_s).encode()
        tail = self._tail(offset_s, added, len(events)).encode()
        if self.remote:
            self._body += lines
            self._tail_now, self._unstored = tail, True
        else:
            storage.rewrite_from(self.path, self._end, lines + tail)
        self._end += len(lines)
        self._events += len(events)

    def _store(self) -> None:
        whole = bytes(self._body) + self._tail_now
        storage.atomic_write(self.path, lambda out: out.write(whole))
        self._stored_at, self._unstored = time.monotonic(), False

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
        if not storage.is_local(path):  # the store's client now: at exit its imports and threads can't start
            try:
                storage.makedirs(parts_dir(path))
            except Exception as exc:  # noqa: BLE001 - a store that fails here fails each write, logged there
                log.warning("cannot reach the timeline's store at %s: %s", parts_dir(path), exc)
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-timeline-{role}", daemon=True)
        self._thread.start()
        atexit.register(self.write, True)

    def span(self, name: str, category: str, start: float, end: float,
             args: dict[str, Any] | None = None) -> None:
        """Add an event from ``start`` to ``end`` (unix seconds, this node's clock)."""
        self.ring.span(name, category, start, end, args)

    def write(self, final: bool = False) -> bool:
        """Append the new events to the part if there are any and the rank is known; True if
        written (``final``: the last write, which a remote part stores at once).  Never raises: a
        failed write is logged (and its events left out)."""
        with self._write_lock:
            rank = self.rank()
            if rank < 0 or (self.ring.added == self._written and not final):
                return False
            events, added = self.ring.since(max(0, self._written))
            offset = 0.0 if self.role == "scheduler" else self.clock.offset
            target = storage.join(parts_dir(self.path), f"{self.role}-{rank}.json")
            try:
                if self._file is None or self._file.path != target:
                    if not events:
                        return False
                    storage.makedirs(parts_dir(self.path))
                    self._file = PartFile(target, self.role, rank, self.capacity)
                self._file.append(events, offset, added, final)
            except Exception as exc:  # noqa: BLE001 - a store's client may fail in any way (at exit too)
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
        self.write(final=True)


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
    key = (os.path.abspath(path) if storage.is_local(path) else path, role)
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
        names = sorted(n for n in storage.listdir(folder) if n.endswith(".json"))
    except FileNotFoundError:
        return 0
    docs = []
    for name in names:
        try:
            doc = core.read_part(storage.read_text(storage.join(folder, name)))
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

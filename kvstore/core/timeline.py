"""The cluster timeline as a Chrome trace (``KVSTORE_TIMELINE``, docs/observability.md): pure parts.

Each role keeps its events in a :class:`EventRing` (bounded: the most recent ``capacity``) and
writes them as a part: a complete Chrome trace (``{"traceEvents": [...]}``) of its own, its
timestamps moved to the scheduler's clock by the offset its heartbeats measured, one process
(``pid``) per role and rank named by metadata events.  :func:`merge` joins parts into the job's
trace.  No files, threads or clock here: callers pass unix times.
"""

from __future__ import annotations

import contextlib
from collections import deque
from contextlib import AbstractContextManager as ContextManager
from typing import Any

CAPACITY = 100_000  # events a role keeps (the most recent)
PART_FORMAT = "kvstore-timeline-part"  # otherData.format of a role's part
_ORDER = {"scheduler": 0, "server": 1, "worker": 2}


def pid_of(role: str, rank: int) -> int:
    """The trace's process id of a role and rank: the scheduler first, then servers, then workers."""
    return 1 + _ORDER.get(role, 3) * 100_000 + max(rank, 0)


class EventRing:
    """The most recent ``capacity`` complete events of one role: (name, category, start, duration,
    args), times in unix seconds."""

    def __init__(self, capacity: int = CAPACITY, lock: ContextManager[Any] | None = None) -> None:
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._events: deque[tuple[str, str, float, float, dict[str, Any] | None]] = deque(maxlen=capacity)
        self.added = 0  # events ever added (a writer compares it to know whether to write)

    def span(self, name: str, category: str, start: float, end: float,
             args: dict[str, Any] | None = None) -> None:
        """Add an event from ``start`` to ``end`` (unix seconds)."""
        with self._lock:
            self._events.append((name, category, start, max(0.0, end - start), args))
            self.added += 1

    def events(self) -> list[tuple[str, str, float, float, dict[str, Any] | None]]:
        """A copy of the events kept, oldest first."""
        with self._lock:
            return list(self._events)


def part(role: str, rank: int, events: list[tuple[str, str, float, float, dict[str, Any] | None]],
         offset_s: float, dropped: int = 0) -> dict[str, Any]:
    """A role's part: a Chrome trace of ``events`` on its own process track, each time plus
    ``offset_s`` (the scheduler's clock minus this node's), in microseconds.  Raises nothing."""
    pid = pid_of(role, rank)
    label = "scheduler" if role == "scheduler" else f"{role} {rank}"
    trace: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": label}},
    ]
    for name, category, start, duration, args in events:
        event = {"ph": "X", "name": name, "cat": category, "pid": pid, "tid": 0,
                 "ts": round((start + offset_s) * 1e6, 1), "dur": round(duration * 1e6, 1)}
        if args:
            event["args"] = args
        trace.append(event)
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"format": PART_FORMAT, "role": role, "rank": rank, "clock_offset_s": offset_s,
                          "events": len(events), "dropped": dropped}}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One trace of every part (the parts' events, in order; parts that are not traces are left
    out).  Raises nothing."""
    events: list[Any] = []
    roles = []
    for doc in parts:
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            continue
        events.extend(doc["traceEvents"])
        other = doc.get("otherData") if isinstance(doc.get("otherData"), dict) else {}
        roles.append({key: other.get(key) for key in ("role", "rank", "clock_offset_s", "events", "dropped")})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format": "kvstore-timeline", "parts": roles}}

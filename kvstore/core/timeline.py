"""The cluster timeline as a Chrome trace (``KVSTORE_TIMELINE``, docs/observability.md): pure parts.

Each role keeps its events in a :class:`EventRing` (bounded: the most recent ``capacity``) and
writes them as a part: a complete Chrome trace (``{"traceEvents": [...]}``) of its own, its
timestamps moved to the scheduler's clock by the offset its heartbeats measured, one process
(``pid``) per role and rank named by metadata events.  A part is laid out in lines (the head, a
line a write, the last line), so a writer appends only its new events (:func:`event_lines`) and
rewrites only the last line; a role's events may span two parts, generations of ``capacity``
events each (``otherData.generation``).  :func:`merge` joins parts into the job's trace, a role's generations
into its most recent ``capacity`` events.  No files, threads or clock here: callers pass unix times.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections import deque
from contextlib import AbstractContextManager as ContextManager
from typing import Any

CAPACITY = 100_000  # events a role keeps (the most recent)
PART_FORMAT = "kvstore-timeline-part"  # otherData.format of a role's part
_ORDER = {"scheduler": 0, "server": 1, "worker": 2}
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=str).encode
HEAD = '{"traceEvents":[\n'  # a part's first line; each event then starts a line, the last one closes
Event = tuple[str, str, float, float, "dict[str, Any] | None"]  # name, category, start, duration, args


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

    def since(self, count: int) -> tuple[list[Event], int]:
        """The events added after the first ``count`` that are still kept, oldest first, and the
        number of all events added (work in proportion to the events returned)."""
        with self._lock:
            added = self.added
            new = min(max(0, added - count), len(self._events))
            recent = list(itertools.islice(reversed(self._events), new))
        recent.reverse()
        return recent, added


def part(role: str, rank: int, events: list[tuple[str, str, float, float, dict[str, Any] | None]],
         offset_s: float, dropped: int = 0) -> dict[str, Any]:
    """A role's part: a Chrome trace of ``events`` on its own process track, each time plus
    ``offset_s`` (the scheduler's clock minus this node's), in microseconds.  Raises nothing."""
    pid = pid_of(role, rank)
    trace = meta_events(role, rank) + [_event(pid, *event, offset_s) for event in events]
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"format": PART_FORMAT, "role": role, "rank": rank, "clock_offset_s": offset_s,
                          "events": len(events), "dropped": dropped}}


def meta_events(role: str, rank: int) -> list[dict[str, Any]]:
    """The metadata events that name and order the track of ``role`` and ``rank``."""
    pid = pid_of(role, rank)
    label = "scheduler" if role == "scheduler" else f"{role} {rank}"
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": label}},
    ]


def _event(pid: int, name: str, category: str, start: float, duration: float,
           args: dict[str, Any] | None, offset_s: float) -> dict[str, Any]:
    event = {"ph": "X", "name": name, "cat": category, "pid": pid, "tid": 0,
             "ts": round((start + offset_s) * 1e6, 1), "dur": round(duration * 1e6, 1)}
    if args:
        event["args"] = args
    return event


def event_lines(role: str, rank: int, events: list[Event], offset_s: float) -> str:
    """``events`` as a line to append to a part (``\\n,{...},{...}``: one write's events, JSON), times
    plus ``offset_s``; "" for none.  Formatted, not encoded a dict at a time (each name and category
    encoded once a write): what a write costs is most of what the timeline costs.  An event whose
    args cannot be JSON (a NaN) keeps them as text.  Raises nothing."""
    if not events:
        return ""
    pid = pid_of(role, rank)
    heads: dict[tuple[str, str], str] = {}
    lines = []
    for name, category, start, duration, args in events:
        head = heads.get((name, category))
        if head is None:
            head = heads[(name, category)] = (f'{{"ph":"X","name":{_ENCODE(name)},"cat":{_ENCODE(category)},'
                                              f'"pid":{pid},"tid":0,"ts":')
        times = f'{head}{(start + offset_s) * 1e6:.1f},"dur":{duration * 1e6:.1f}'
        if args:
            try:
                lines.append(f'{times},"args":{_ENCODE(args)}}}')
            except ValueError:
                lines.append(f'{times},"args":{_ENCODE({"text": str(args)[:200]})}}}')
        else:
            lines.append(times + "}")
    return "\n," + ",".join(lines)


def part_head(role: str, rank: int) -> str:
    """The start of a part, up to its metadata events (events are appended after it)."""
    return HEAD + "\n,".join(_ENCODE(event) for event in meta_events(role, rank))


def part_tail(role: str, rank: int, offset_s: float, events: int, added: int, generation: int,
              capacity: int) -> str:
    """The last line of a part: it closes the events and says what the part holds (``events`` in
    this file, ``added`` by the role in all, which ``generation`` of at most ``capacity``)."""
    other = {"format": PART_FORMAT, "role": role, "rank": rank, "clock_offset_s": offset_s,
             "events": events, "dropped": max(0, added - events), "added": added,
             "generation": generation, "capacity": capacity}
    return '\n],"displayTimeUnit":"ms","otherData":' + _ENCODE(other) + "}\n"


def read_part(text: str) -> dict[str, Any] | None:
    """A part's trace from its text: JSON, or, when a write was cut short, the events of every whole
    line of it (and its last line when that one is whole).  None when it is not a part.  Raises
    nothing."""
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, dict) else None
    except ValueError:
        pass
    if not text.startswith(HEAD):
        return None
    events: list[Any] = []
    doc: dict[str, Any] = {}
    for line in text[len(HEAD):].split("\n"):
        try:
            if line.startswith("]"):
                doc = json.loads('{"traceEvents":[' + line)
                break
            written = json.loads("[" + (line[1:] if line.startswith(",") else line) + "]")
        except ValueError:
            continue
        events.extend(event for event in written if isinstance(event, dict))
    doc = doc if isinstance(doc, dict) else {}
    doc["traceEvents"] = events
    return doc


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One trace of every part (the parts' events, in order; parts that are not traces are left
    out).  The generations of a role's part (``otherData.generation``) become one part of its most
    recent ``capacity`` events.  Raises nothing."""
    roles: dict[Any, list[dict[str, Any]]] = {}
    for doc in parts:
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            continue
        other = doc.get("otherData") if isinstance(doc.get("otherData"), dict) else {}
        key = (other.get("role"), other.get("rank")) if "generation" in other else id(doc)
        roles.setdefault(key, []).append(doc)
    events: list[Any] = []
    summary = []
    for docs in roles.values():
        kept, other = _join_generations(docs)
        events.extend(kept)
        summary.append({key: other.get(key) for key in _SUMMARY})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"format": "kvstore-timeline", "parts": summary}}


_SUMMARY = ("role", "rank", "clock_offset_s", "events", "dropped")


def _is_meta(event: Any) -> bool:
    return isinstance(event, dict) and event.get("ph") == "M"


def _generation(doc: dict[str, Any]) -> int:
    other = doc.get("otherData")
    value = other.get("generation") if isinstance(other, dict) else None
    return value if type(value) is int else 0


def _join_generations(docs: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any]]:
    """The events of one role's parts (its generations, oldest first): the metadata once, the most
    recent ``capacity`` spans; and its otherData, counting them."""
    if len(docs) == 1:
        doc = docs[0]
        return doc["traceEvents"], doc.get("otherData") if isinstance(doc.get("otherData"), dict) else {}
    docs = sorted(docs, key=_generation)
    newest = dict(docs[-1].get("otherData") or {})
    capacity = newest.get("capacity")
    meta = [e for e in docs[-1]["traceEvents"] if _is_meta(e)]
    spans = [e for doc in docs for e in doc["traceEvents"] if not _is_meta(e)]
    if type(capacity) is int and capacity > 0:
        spans = spans[-capacity:]
    added = newest.get("added")
    newest["events"] = len(spans)
    newest["dropped"] = max(0, added - len(spans)) if type(added) is int else newest.get("dropped")
    return meta + spans, newest

"""Counters every role keeps, and the node snapshot they travel in (docs/observability.md).

Pure: no sockets, no threads, no clock of its own (callers pass ``now``).  A snapshot is a plain
dict of str keys, ints, floats, strs, bools, None, lists and dicts, so it crosses the wire (msgpack)
and prints as JSON.  ``SCHEMA_VERSION`` is in every snapshot; a field's meaning never changes
without a new version.

:class:`Counters` and :class:`Histogram` take the lock they use (``threading.Lock()`` where several
threads add; this layer creates none).  An ``add`` or ``observe`` costs a few hundred nanoseconds
(``benchmarks/stats_cost.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any

SCHEMA_VERSION = 1
ROLES = ("scheduler", "server", "worker")
# Upper bounds of the latency buckets in ms: four per decade, 0.1 ms .. 100 s, then one overflow bucket
# (its upper bound is written as None).
BUCKETS_MS: tuple[float, ...] = tuple(round(10 ** (e / 4 - 1), 4) for e in range(25))
BOUNDS_S = tuple(ms / 1000 for ms in BUCKETS_MS)  # the same bounds in seconds (bisect_left finds a bucket)
MAX_SNAPSHOT_BYTES = 64 * 1024  # a node's snapshot over this (estimated, msgpack) size is refused
MAX_DEPTH = 6  # nesting of dicts and lists in a snapshot
MAX_TEXT = 1024  # characters of any str in a snapshot
COMMON_FIELDS = ("schema", "role", "rank", "host", "pid", "time", "uptime_s", "last_op", "last_op_at")


class Counters:
    """Named counters (int or float) and labelled ones (``refused`` by reason, ``ops`` by op).

    ``lock``: what guards an update; pass ``threading.Lock()`` when several threads add.
    """

    def __init__(self, lock: ContextManager[Any] | None = None) -> None:
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._flat: dict[str, float] = {}
        self._labelled: dict[str, dict[str, float]] = {}

    def add(self, name: str, n: float = 1) -> None:
        """Add ``n`` to counter ``name`` (created at 0)."""
        with self._lock:
            self._flat[name] = self._flat.get(name, 0) + n

    def set(self, name: str, value: float) -> None:
        """Set gauge ``name`` to ``value`` (open rounds, held bytes)."""
        with self._lock:
            self._flat[name] = value

    def add_label(self, name: str, label: str, n: float = 1) -> None:
        """Add ``n`` to ``name[label]`` (e.g. ``add_label("refused", "window")``)."""
        with self._lock:
            group = self._labelled.setdefault(name, {})
            group[label] = group.get(label, 0) + n

    def get(self, name: str, label: str | None = None) -> float:
        """The value of ``name`` (or of ``name[label]``); 0 when never added to."""
        with self._lock:
            if label is None:
                return self._flat.get(name, 0)
            return self._labelled.get(name, {}).get(label, 0)

    def snapshot(self) -> dict[str, Any]:
        """Every counter: ``{name: value}`` and ``{name: {label: value}}``, copied."""
        with self._lock:
            out: dict[str, Any] = dict(self._flat)
            out.update({name: dict(group) for name, group in self._labelled.items()})
        return out


class Histogram:
    """Counts of durations in fixed log-spaced buckets (:data:`BUCKETS_MS`), their number and sum."""

    def __init__(self, lock: ContextManager[Any] | None = None) -> None:
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._counts = [0] * (len(BUCKETS_MS) + 1)
        self.count = 0
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration of ``seconds``."""
        i = bisect.bisect_left(BOUNDS_S, seconds)
        with self._lock:
            self._counts[i] += 1
            self.count += 1
            self.sum_s += seconds

    def snapshot(self) -> dict[str, Any]:
        """``{"count", "sum_s", "buckets": [[upper_ms, count], ...]}``: the non-empty buckets, in order,
        each counting the durations above the previous bound up to ``upper_ms`` (None: above 100 s)."""
        with self._lock:
            counts, total = list(self._counts), self.sum_s
        return histogram_snapshot(counts, total)


def histogram_snapshot(counts: list[int], sum_s: float) -> dict[str, Any]:
    """The snapshot of a histogram whose bucket counts (one per :data:`BUCKETS_MS` bound, then the
    overflow) are ``counts`` and whose durations sum to ``sum_s``."""
    return {"count": sum(counts), "sum_s": sum_s,
            "buckets": [[_upper(i), n] for i, n in enumerate(counts) if n]}


def _upper(i: int) -> float | None:
    return BUCKETS_MS[i] if i < len(BUCKETS_MS) else None


def empty_histogram() -> dict[str, Any]:
    """The snapshot of a histogram that has counted nothing."""
    return {"count": 0, "sum_s": 0.0, "buckets": []}


def quantile(hist: dict[str, Any], q: float) -> float | None:
    """The upper bound in ms of the bucket holding quantile ``q`` (0..1) of a histogram snapshot;
    None when it is empty, ``math.inf`` in the overflow bucket."""
    count = hist.get("count") or 0
    if not count:
        return None
    seen, rank = 0, q * count
    for upper, n in hist.get("buckets", []):
        seen += n
        if seen >= rank:
            return math.inf if upper is None else upper
    return math.inf


def node_snapshot(role: str, rank: int, host: str, pid: int, started: float, now: float,
                  last_op: str | None = None, last_op_at: float | None = None) -> dict[str, Any]:
    """The fields every node's snapshot starts with (``started``, ``now``, ``last_op_at``: unix s)."""
    return {"schema": SCHEMA_VERSION, "role": role, "rank": rank, "host": host, "pid": pid,
            "time": now, "uptime_s": max(0.0, now - started), "last_op": last_op,
            "last_op_at": last_op_at}


def snapshot_size(value: Any, limit: int = MAX_SNAPSHOT_BYTES) -> int:
    """The (over-)estimated msgpack size of ``value``, counted up to just past ``limit``.

    Raises ValueError for anything a snapshot may not hold (a non-str key, a type other than
    None/bool/int/float/str/list/dict, nesting past ``MAX_DEPTH``, a str over ``MAX_TEXT``).
    """
    total = 0
    for size in _sizes(value, 0):
        total += size
        if total > limit:
            break
    return total


def _sizes(value: Any, depth: int) -> Iterator[int]:
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is None or kind is bool:
        yield 1
    elif kind is int:
        yield 9
    elif kind is float:
        yield 9
    elif kind is str:
        if len(value) > MAX_TEXT:
            raise ValueError(f"a str of {len(value)} characters (at most {MAX_TEXT})")
        yield 5 + 4 * len(value)
    elif kind is list:
        yield 5
        for item in value:
            yield from _sizes(item, depth + 1)
    elif kind is dict:
        yield 5
        for key, item in value.items():
            if type(key) is not str:
                raise ValueError(f"a key of type {type(key).__name__} (keys are str)")
            yield from _sizes(key, depth + 1)
            yield from _sizes(item, depth + 1)
    else:
        raise ValueError(f"a value of type {kind.__name__}")


def check_snapshot(value: Any, role: str, rank: int, limit: int = MAX_SNAPSHOT_BYTES) -> int:
    """Check a node's snapshot (from the wire) is one ``role`` ``rank`` may send; return its size.

    Raises ValueError naming what is wrong: not a map, another schema, role or rank, a field of the
    wrong kind (:func:`snapshot_size`), or an estimated size over ``limit``.
    """
    if type(value) is not dict:
        raise ValueError(f"a snapshot must be a map, not {type(value).__name__}")
    if value.get("schema") != SCHEMA_VERSION or type(value.get("schema")) is not int:
        raise ValueError(f"schema {str(value.get('schema'))[:20]} is not {SCHEMA_VERSION}")
    if value.get("role") != role or value.get("rank") != rank or type(value.get("rank")) is not int:
        raise ValueError(f"a snapshot of {role} {rank} names another node")
    size = snapshot_size(value, limit)
    if size > limit:
        raise ValueError(f"a snapshot over {limit} bytes")
    return size

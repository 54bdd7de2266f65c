"""Scalars for TensorBoard: a node snapshot's counters as flat tags, the user's scalars, and rates.

Pure: no sockets, threads or clock of its own.  A worker keeps the user's
``kvstore.log_scalar(name, value, step)`` calls in a :class:`ScalarLog` (bounded; each entry with a
sequence number), which travels in its heartbeat snapshot as ``scalars``; the writer on the
launcher's host reads the snapshots from STATUS, turns each node's counters into tags with
:func:`node_scalars` and keeps the user's entries it has not seen yet (:func:`new_scalars`).
docs/observability.md describes the tags.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from contextlib import AbstractContextManager as ContextManager
from typing import Any

from kvstore.core.stats import quantile

SCALAR_CAPACITY = 128  # user scalars a worker's snapshot carries at most (the most recent ones)
MAX_NAME = 200  # characters of a user scalar's name
SCALAR_BYTES = 24 * 1024  # estimated snapshot bytes the carried scalars take at most (of the 64 KiB)
# snapshot fields that are not counters (identity, clocks, structure): never written as scalars
SKIPPED = frozenset({"schema", "role", "rank", "host", "pid", "time", "last_op", "last_op_at", "nodes",
                     "scalars", "last_round", "trainer", "histograms", "waiting_in_barrier"})


class ScalarLog:
    """The most recent ``capacity`` user scalars of a process, each with a sequence number."""

    def __init__(self, capacity: int = SCALAR_CAPACITY, lock: ContextManager[Any] | None = None) -> None:
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._entries: deque[list[Any]] = deque(maxlen=capacity)
        self._steps: dict[str, int] = {}
        self.seq = 0

    def add(self, name: str, value: float, step: int | None, wall: float) -> int:
        """Keep ``name = value`` at ``step`` (None: one past this name's last step); return its sequence
        number.  Raises TypeError for a name that is not a str or a value that is not a real number,
        ValueError for an empty or too long name, or a negative step."""
        if not isinstance(name, str):
            raise TypeError(f"a scalar's name must be a str, not {type(name).__name__}")
        if not name or len(name) > MAX_NAME:
            raise ValueError(f"a scalar's name must have 1 to {MAX_NAME} characters")
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise TypeError(f"a scalar's value must be a real number, not {type(value).__name__}")
        if step is not None and (isinstance(step, bool) or int(step) != step or step < 0):
            raise ValueError(f"a scalar's step must be an int >= 0, not {step!r}")
        with self._lock:
            step = self._steps.get(name, -1) + 1 if step is None else int(step)
            self._steps[name] = step
            self.seq += 1
            self._entries.append([self.seq, name, float(value), step, wall])
            return self.seq

    def snapshot(self) -> dict[str, Any]:
        """``{"seq": the last sequence number, "recent": [[seq, name, value, step, wall], ...]}``, oldest
        first: the most recent entries whose estimated size fits :data:`SCALAR_BYTES`."""
        with self._lock:
            entries, last = list(self._entries), self.seq
        kept, used = [], 0
        for entry in reversed(entries):
            used += 46 + 4 * len(entry[1])  # msgpack estimate, as kvstore.core.stats.snapshot_size counts
            if used > SCALAR_BYTES:
                break
            kept.append(list(entry))
        kept.reverse()
        return {"seq": last, "recent": kept}


def new_scalars(snapshot: dict[str, Any], seen: int) -> tuple[list[tuple[str, float, int, float]], int]:
    """The user scalars of a node ``snapshot`` past sequence number ``seen``, as (name, value, step,
    wall), and the new last sequence number.  A sequence number below ``seen`` (a restarted process)
    starts over.  Malformed entries are skipped; raises nothing."""
    carried = snapshot.get("scalars")
    if not isinstance(carried, dict) or not isinstance(carried.get("recent"), list):
        return [], seen
    last = carried.get("seq")
    if isinstance(last, int) and last < seen:
        seen = 0
    out = []
    for entry in carried["recent"]:
        if (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[0], int)
                and isinstance(entry[1], str) and _number(entry[2]) and isinstance(entry[3], int)
                and _number(entry[4]) and entry[0] > seen):
            out.append((entry[1], float(entry[2]), entry[3], float(entry[4])))
            seen = entry[0]
    return out, seen


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_histogram(value: Any) -> bool:
    return isinstance(value, dict) and "buckets" in value and "count" in value


def node_scalars(snapshot: dict[str, Any]) -> dict[str, float]:
    """A node snapshot's counters as ``{tag: value}``: numbers by their path (``ops/push``,
    ``bytes_out``, ``blocked_s/pull``), each histogram as its median and 99th percentile in ms
    (``latency/push/p50_ms``); identity and clock fields are left out.  Raises nothing."""
    out: dict[str, float] = {}
    _flatten(snapshot, "", out, 0)
    return out


def _flatten(value: Any, prefix: str, out: dict[str, float], depth: int) -> None:
    if depth > 4:
        return
    if _number(value):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif _is_histogram(value):
        for q, label in ((0.5, "p50_ms"), (0.99, "p99_ms")):
            ms = quantile(value, q)
            if ms is not None and math.isfinite(ms):
                out[f"{prefix}/{label}"] = float(ms)
    elif isinstance(value, dict):
        for key, item in value.items():
            if depth == 0 and key in SKIPPED:
                continue
            _flatten(item, f"{prefix}/{key}" if prefix else str(key), out, depth + 1)


def trainer_rates(previous: dict[str, Any] | None, current: dict[str, Any],
                  seconds: float) -> dict[str, float]:
    """``trainer/step_time_s`` (mean over the interval) and ``trainer/samples_per_s`` from two
    successive ``trainer`` fields of a worker's snapshots ``seconds`` apart (``{"steps", "samples",
    "step_s"}``); empty when there is nothing new.  Raises nothing."""
    if not isinstance(current, dict) or not isinstance(previous, dict):
        return {}
    try:
        steps = current["steps"] - previous["steps"]
        spent = current["step_s"] - previous["step_s"]
        samples = current["samples"] - previous["samples"]
    except (KeyError, TypeError):
        return {}
    if steps <= 0 or seconds <= 0:
        return {}
    out = {"trainer/step_time_s": spent / steps, "trainer/steps_per_s": steps / seconds}
    if samples > 0:
        out["trainer/samples_per_s"] = samples / seconds
    return out


def run_name(role: str, rank: int) -> str:
    """The run subdirectory of a node: ``scheduler``, ``server-0``, ``worker-1``."""
    return "scheduler" if role == "scheduler" else f"{role}-{rank}"

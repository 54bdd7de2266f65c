"""A worker's counters (issue 21; the schema is docs/observability.md): calls per op and their
latency, bytes each way, and the time spent blocked in pulls, barriers and the push window.

Updated by the threads that make calls, read by the heartbeat thread (which carries the snapshot to
the scheduler) and by ``kv.stats()``: one lock guards them all.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvstore.core.stats import Counters, Histogram, node_snapshot

OPS = ("push", "pull", "pushpull", "init", "barrier")
BLOCKED = ("pull", "barrier")  # measured here; "push_window" comes from the window itself


class WorkerMeter:
    """The counters of one worker's store."""

    def __init__(self, rank: int, host: str) -> None:
        self.rank, self.host = rank, host
        self._lock = threading.Lock()
        self.counters = Counters(self._lock)
        self.latency = {op: Histogram(self._lock) for op in OPS}
        self.started = time.time()
        self.last_op: str | None = None
        self.last_op_at: float | None = None

    @contextmanager
    def op(self, name: str) -> Iterator[None]:
        """Count one call of ``name`` (one of :data:`OPS`) and observe its latency."""
        started = time.perf_counter()
        self.last_op, self.last_op_at = name, time.time()
        try:
            yield
        finally:
            self.latency[name].observe(time.perf_counter() - started)
            self.counters.add_label("ops", name)

    @contextmanager
    def blocked(self, kind: str) -> Iterator[None]:
        """Add the time spent in the block to ``blocked_s[kind]`` (``pull`` or ``barrier``)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.counters.add_label("blocked_s", kind, time.perf_counter() - started)

    def sent(self, nbytes: int) -> None:
        """Count ``nbytes`` of arrays sent."""
        self.counters.add("bytes_out", nbytes)

    def received(self, nbytes: int) -> None:
        """Count ``nbytes`` of arrays received."""
        self.counters.add("bytes_in", nbytes)

    def snapshot(self, window_blocked_s: float) -> dict[str, Any]:
        """This worker's node snapshot (schema 1), ``window_blocked_s`` being the push window's total."""
        counts = self.counters.snapshot()
        ops, blocked = counts.get("ops", {}), counts.get("blocked_s", {})
        snap = node_snapshot("worker", self.rank, self.host, os.getpid(), self.started, time.time(),
                             self.last_op, self.last_op_at)
        snap.update({
            "ops": {op: int(ops.get(op, 0)) for op in OPS},
            "bytes_out": int(counts.get("bytes_out", 0)), "bytes_in": int(counts.get("bytes_in", 0)),
            "latency": {op: hist.snapshot() for op, hist in self.latency.items()},
            "blocked_s": {**{kind: float(blocked.get(kind, 0.0)) for kind in BLOCKED},
                          "push_window": float(window_blocked_s)},
        })
        return snap

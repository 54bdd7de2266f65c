"""A worker's counters (issue 21; the schema is docs/observability.md): calls per op and their
latency, bytes each way, and the time spent blocked in pulls, barriers and the push window.

Updated by the threads that make calls, read by the heartbeat thread (which carries the snapshot to
the scheduler) and by ``kv.stats()``: one lock guards them, taken once per event.  Kept lean (plain
lists, no context managers): a pushpull's counting costs about a microsecond
(``benchmarks/stats_overhead.py``).
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from typing import Any

from kvstore.core.stats import BOUNDS_S, histogram_snapshot, node_snapshot

OPS = ("push", "pull", "pushpull", "init", "barrier")
BLOCKED = ("pull", "barrier")  # measured here; "push_window" comes from the window itself
_BUCKETS = len(BOUNDS_S) + 1


class WorkerMeter:
    """The counters of one worker's store."""

    def __init__(self, rank: int, host: str) -> None:
        self.rank, self.host = rank, host
        self._lock = threading.Lock()
        self.started = time.time()
        self.last_op: str | None = None
        self.last_op_at: float | None = None
        self._ops = dict.fromkeys(OPS, 0)
        self._hist = {op: [0] * _BUCKETS for op in OPS}
        self._hist_sum = dict.fromkeys(OPS, 0.0)
        self._blocked = dict.fromkeys(BLOCKED, 0.0)
        self._bytes = [0, 0]  # out, in

    def begin(self, name: str) -> float:
        """Note the start of a call of ``name`` (one of :data:`OPS`); pass the result to :meth:`end`."""
        self.last_op, self.last_op_at = name, time.time()
        return time.perf_counter()

    def end(self, name: str, started: float, blocked: str | None = None) -> None:
        """Count the call of ``name`` begun at ``started``; with ``blocked``, also add its duration to
        ``blocked_s[blocked]``."""
        elapsed = time.perf_counter() - started
        bucket = bisect_left(BOUNDS_S, elapsed)
        with self._lock:
            self._ops[name] += 1
            self._hist[name][bucket] += 1
            self._hist_sum[name] += elapsed
            if blocked is not None:
                self._blocked[blocked] += elapsed

    def blocked_for(self, kind: str, seconds: float) -> None:
        """Add ``seconds`` to ``blocked_s[kind]``."""
        with self._lock:
            self._blocked[kind] += seconds

    def sent(self, nbytes: int) -> None:
        """Count ``nbytes`` of arrays sent."""
        with self._lock:
            self._bytes[0] += nbytes

    def received(self, nbytes: int) -> None:
        """Count ``nbytes`` of arrays received."""
        with self._lock:
            self._bytes[1] += nbytes

    def snapshot(self, window_blocked_s: float) -> dict[str, Any]:
        """This worker's node snapshot (schema 1), ``window_blocked_s`` being the push window's total."""
        with self._lock:
            ops, blocked, (out, received) = dict(self._ops), dict(self._blocked), self._bytes
            hists = {op: histogram_snapshot(list(self._hist[op]), self._hist_sum[op]) for op in OPS}
        snap = node_snapshot("worker", self.rank, self.host, os.getpid(), self.started, time.time(),
                             self.last_op, self.last_op_at)
        snap.update({"ops": ops, "bytes_out": out, "bytes_in": received, "latency": hists,
                     "blocked_s": {**blocked, "push_window": float(window_blocked_s)}})
        return snap

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

from kvstore.core.scalars import ScalarLog
from kvstore.core.stats import BOUNDS_S, histogram_snapshot, node_snapshot
from kvstore.net import timeline

OPS = ("push", "pull", "pushpull", "init", "barrier")
BLOCKED = ("pull", "barrier")  # measured here; "push_window" comes from the window itself
_BUCKETS = len(BOUNDS_S) + 1
# process-wide, so log_scalar and the Trainer work before (and across) stores: every snapshot carries them
SCALARS = ScalarLog(lock=threading.Lock())


class StepStats:
    """The Trainer's steps in this process: how many, the samples they took, and the time from one
    step's end to the next's (the iteration: forward, backward and step), summed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps, self.samples, self.step_s = 0, 0, 0.0
        self._last_end: float | None = None  # perf_counter at the end of the previous step

    def step(self, began: float, ended: float, samples: int) -> None:
        """Count one step called at ``began`` and done at ``ended`` (perf_counter) over ``samples``."""
        with self._lock:
            since = self._last_end if self._last_end is not None else began
            self._last_end = ended
            self.steps += 1
            self.samples += max(0, int(samples))
            self.step_s += max(0.0, ended - since)

    def snapshot(self) -> dict[str, Any]:
        """``{"steps", "samples", "step_s"}``."""
        with self._lock:
            return {"steps": self.steps, "samples": self.samples, "step_s": self.step_s}


STEPS = StepStats()


def log_scalar(name: str, value: float, step: int | None = None) -> None:
    """Record the user's scalar ``name = value`` at ``step`` (None: this name's last step plus one) for
    TensorBoard: it reaches the scheduler in this worker's heartbeats, and the launcher's writer
    (``--tensorboard``) writes it under the worker's run.  The most recent 128 are carried.  Raises
    TypeError or ValueError for a bad name, value or step."""
    SCALARS.add(name, value, step, time.time())


def trainer_step(began: float, samples: float) -> None:
    """Count one Trainer step begun at ``began`` (perf_counter) over ``samples`` samples; put it on the
    timeline, if one is kept."""
    ended = time.perf_counter()
    STEPS.step(began, ended, int(samples))
    meter = WorkerMeter.active
    if meter is not None and meter.timeline is not None:
        end = time.time()
        meter.timeline.span("step", "trainer", end - (ended - began), end, {"samples": int(samples)})


class WorkerMeter:
    """The counters of one worker's store (and its timeline, under ``KVSTORE_TIMELINE``)."""

    active: WorkerMeter | None = None  # the latest one (the process's store)

    def __init__(self, rank: int, host: str) -> None:
        self.rank, self.host = rank, host
        self.timeline = timeline.recorder("worker", lambda: self.rank)
        WorkerMeter.active = self
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
        if self.timeline is not None:
            now = time.time()
            self.timeline.span(name, "worker", now - elapsed, now)

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
                     "blocked_s": {**blocked, "push_window": float(window_blocked_s)},
                     "scalars": SCALARS.snapshot(), "trainer": STEPS.snapshot()})
        return snap

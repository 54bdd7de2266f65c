"""A worker's counters (issue 21; the schema is docs/observability.md): calls per op and their
latency, bytes each way, and the time spent blocked in pulls, barriers and the push window.

Updated by the threads that make calls, read by the heartbeat thread (which carries the snapshot to
the scheduler) and by ``kv.stats()``: one lock guards them, taken once per event.  Kept lean (plain
lists, no context managers): a pushpull's counting costs about a microsecond
(``benchmarks/stats_overhead.py``).

Under ``KVSTORE_HISTOGRAM_EVERY=N`` the Trainer and DistributedOptimizer also keep, every N steps, a
30-bucket histogram of each parameter's weight and gradient (:class:`HistogramRecorder`); the snapshot
carries the latest set as ``histograms`` and the launcher's TensorBoard writer draws them.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from kvstore import config as kvconfig
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

HISTOGRAM_BUCKETS = 30  # equal-width buckets between a tensor's min and max
HISTOGRAM_PARAMS = 32  # parameters a record covers at most (the first ones): 64 histograms, ~16 KiB
HISTOGRAM_BYTES = 20 * 1024  # estimated snapshot bytes the carried histograms take at most (of the 64 KiB)


def histogram_of(tensor: Any, buckets: int = HISTOGRAM_BUCKETS) -> list[Any]:
    """``[min, max, count, sum, sum_of_squares, counts]`` of a torch tensor's finite values, ``counts``
    being ``buckets`` equal-width bucket counts from min to max (one bucket when min == max; all zeros
    and no values when none is finite).  Raises nothing for a float or integer tensor."""
    import torch

    flat = tensor.detach().reshape(-1).to(torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    total = flat.sum()
    if not bool(torch.isfinite(total)):  # rare: filter, rather than pay for the mask every time
        flat = flat[torch.isfinite(flat)]
        total = flat.sum()
    if flat.numel() == 0:
        return [0.0, 0.0, 0, 0.0, 0.0, [0] * buckets]
    low, high = torch.aminmax(flat)
    lo, hi = float(low), float(high)
    if lo == hi:
        counts = [flat.numel()] + [0] * (buckets - 1)
    else:
        counts = [int(c) for c in torch.histc(flat, bins=buckets, min=lo, max=hi).tolist()]
    return [lo, hi, flat.numel(), float(total), float(torch.dot(flat, flat)), counts]


class HistogramLog:
    """The latest histogram of each tag (``weights/<name>``, ``grads/<name>``) of this process, with the
    step it was taken at and a sequence number per record."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, list[Any]] = {}  # tag -> [seq, step, wall, *histogram_of]
        self.seq = 0

    def add(self, histograms: dict[str, list[Any]], step: int, wall: float) -> None:
        """Keep ``histograms`` (tag -> :func:`histogram_of`) as taken at ``step``, replacing older ones."""
        with self._lock:
            self.seq += 1
            for tag, hist in histograms.items():
                self._latest[tag] = [self.seq, step, wall, *hist]

    def snapshot(self) -> dict[str, list[Any]]:
        """``{tag: [seq, step, wall, min, max, count, sum, sum_of_squares, counts]}`` (copies), as many
        as fit :data:`HISTOGRAM_BYTES` (estimated as msgpack)."""
        out, used = {}, 0
        with self._lock:
            for tag, entry in self._latest.items():
                used += 4 * len(tag) + 80 + 5 * len(entry[-1])
                if used > HISTOGRAM_BYTES:
                    break
                out[tag] = [*entry[:-1], list(entry[-1])]
        return out


HISTOGRAMS = HistogramLog()


class HistogramRecorder:
    """Every ``every`` calls of :meth:`step` (0: never), records the weight and gradient histograms of
    the named parameters (the first :data:`HISTOGRAM_PARAMS`) into ``log`` (default :data:`HISTOGRAMS`,
    which the heartbeats carry)."""

    def __init__(self, names: Sequence[str], params: Sequence[Any], every: int,
                 log: HistogramLog | None = None) -> None:
        self.every, self.steps = every, 0
        self._log = HISTOGRAMS if log is None else log
        self._named = list(zip(names, params))[:HISTOGRAM_PARAMS]

    @classmethod
    def from_env(cls, names: Sequence[str], params: Sequence[Any]) -> HistogramRecorder:
        """A recorder every ``KVSTORE_HISTOGRAM_EVERY`` steps.  Raises ConfigError for a bad value."""
        return cls(names, params, kvconfig.load().histogram_every)

    def step(self) -> None:
        """Count one step; at every ``every``-th, record the histograms."""
        self.steps += 1
        if self.every <= 0 or self.steps % self.every:
            return
        out: dict[str, list[Any]] = {}
        for name, p in self._named:
            out[f"weights/{name}"] = histogram_of(p)
            if p.grad is not None and not p.grad.is_sparse:
                out[f"grads/{name}"] = histogram_of(p.grad)
        self._log.add(out, self.steps, time.time())


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

    def pushes(self) -> int:
        """The push and pushpull calls counted so far."""
        with self._lock:
            return self._ops["push"] + self._ops["pushpull"]

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
        histograms = HISTOGRAMS.snapshot()
        if histograms:
            snap["histograms"] = histograms
        return snap

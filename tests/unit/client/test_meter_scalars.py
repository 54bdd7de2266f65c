"""The worker meter carries the user's scalars and the Trainer's steps in its snapshot."""

from __future__ import annotations

import time

import kvstore
from kvstore.client import meter
from kvstore.core.stats import check_snapshot


def test_log_scalar_and_trainer_steps_travel_in_the_snapshot() -> None:
    """kvstore.log_scalar lands in the worker's snapshot; Trainer steps are counted; it checks."""
    before = meter.STEPS.snapshot()
    kvstore.log_scalar("unit/loss", 0.5, 3)
    began = time.perf_counter()
    meter.trainer_step(began, 32)
    snap = meter.WorkerMeter(0, "127.0.0.1").snapshot(0.0)
    assert snap["scalars"]["recent"][-1][1:4] == ["unit/loss", 0.5, 3]
    assert snap["trainer"]["steps"] == before["steps"] + 1
    assert snap["trainer"]["samples"] == before["samples"] + 32
    check_snapshot(snap, "worker", 0)

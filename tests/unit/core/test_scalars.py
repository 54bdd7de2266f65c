"""kvstore.core.scalars: the user's scalar log, the snapshot flattened into tags, the Trainer's rates."""

from __future__ import annotations

import math

import pytest

from kvstore.core import scalars
from kvstore.core.stats import Histogram


def test_scalar_log_is_bounded_and_numbered() -> None:
    """Only the most recent entries are kept, each with a rising sequence number; a missing step
    counts on from the name's last one."""
    log = scalars.ScalarLog(capacity=3)
    for i in range(5):
        log.add("loss", 1.0 / (i + 1), i, 100.0 + i)
    log.add("loss", 0.1, None, 200.0)
    snap = log.snapshot()
    assert snap["seq"] == 6
    assert [entry[0] for entry in snap["recent"]] == [4, 5, 6]
    assert snap["recent"][-1][1:4] == ["loss", 0.1, 5]


@pytest.mark.parametrize("name,value,step,error", [(3, 1.0, 0, TypeError), ("", 1.0, 0, ValueError),
                                                   ("x" * 201, 1.0, 0, ValueError),
                                                   ("loss", "high", 0, TypeError),
                                                   ("loss", 1.0, -1, ValueError),
                                                   ("loss", 1.0, 1.5, ValueError)])
def test_scalar_log_refuses_bad_entries(name, value, step, error) -> None:
    """A bad name, value or step raises and is not kept."""
    log = scalars.ScalarLog()
    with pytest.raises(error):
        log.add(name, value, step, 0.0)
    assert log.snapshot() == {"seq": 0, "recent": []}


def test_new_scalars_skips_what_was_seen_and_restarts_after_a_reset() -> None:
    """Entries up to ``seen`` are left out; a lower last number (a new process) starts over."""
    log = scalars.ScalarLog()
    for i in range(4):
        log.add("acc", i / 4, i, float(i))
    new, seen = scalars.new_scalars({"scalars": log.snapshot()}, 2)
    assert [(name, step) for name, _, step, _ in new] == [("acc", 2), ("acc", 3)] and seen == 4
    assert scalars.new_scalars({"scalars": log.snapshot()}, 4) == ([], 4)
    fresh = scalars.ScalarLog()
    fresh.add("acc", 0.5, 0, 1.0)
    assert scalars.new_scalars({"scalars": fresh.snapshot()}, 4)[1] == 1
    assert scalars.new_scalars({"scalars": {"recent": [["bad"]], "seq": 1}}, 0) == ([], 0)
    assert scalars.new_scalars({}, 7) == ([], 7)


def test_node_scalars_flattens_counters_and_histograms() -> None:
    """Numbers by path, histograms as p50/p99 in ms; identity and clock fields are left out."""
    hist = Histogram()
    for _ in range(10):
        hist.observe(0.002)
    snap = {"schema": 1, "role": "worker", "rank": 1, "pid": 9, "time": 5.0, "uptime_s": 2.0,
            "ops": {"push": 3, "pull": 0}, "bytes_out": 10, "blocked_s": {"pull": 0.5},
            "latency": {"push": hist.snapshot(), "pull": {"count": 0, "sum_s": 0.0, "buckets": []}},
            "last_op": "push", "scalars": {"seq": 1, "recent": []}, "bad": math.nan, "flag": True}
    tags = scalars.node_scalars(snap)
    assert tags["ops/push"] == 3 and tags["bytes_out"] == 10 and tags["blocked_s/pull"] == 0.5
    assert tags["latency/push/p50_ms"] == pytest.approx(3.1623)
    assert "latency/pull/p50_ms" not in tags
    assert not {"schema", "rank", "pid", "time", "bad", "last_op"} & set(tags)


def test_trainer_rates_from_two_snapshots() -> None:
    """Mean step time and samples/s over the interval; nothing without a new step."""
    before = {"steps": 10, "samples": 320, "step_s": 1.0}
    after = {"steps": 20, "samples": 640, "step_s": 3.0}
    rates = scalars.trainer_rates(before, after, 2.0)
    assert rates["trainer/step_time_s"] == pytest.approx(0.2)
    assert rates["trainer/samples_per_s"] == pytest.approx(160.0)
    assert scalars.trainer_rates(after, after, 1.0) == {}
    assert scalars.trainer_rates(None, after, 1.0) == {}


def test_run_names() -> None:
    """One run per role and rank."""
    assert [scalars.run_name(r, k) for r, k in (("scheduler", 0), ("server", 0), ("worker", 3))] == [
        "scheduler", "server-0", "worker-3"]


def test_carried_scalars_fit_the_snapshot_budget() -> None:
    """Long names: only the most recent entries that fit SCALAR_BYTES are carried."""
    from kvstore.core.stats import snapshot_size

    log = scalars.ScalarLog()
    for i in range(scalars.SCALAR_CAPACITY):
        log.add("n" * scalars.MAX_NAME + "", float(i), i, 0.0)
    snap = log.snapshot()
    assert 0 < len(snap["recent"]) < scalars.SCALAR_CAPACITY
    assert snap["recent"][-1][0] == snap["seq"]
    assert snapshot_size(snap) <= scalars.SCALAR_BYTES + 64

"""Weight and gradient histograms (KVSTORE_HISTOGRAM_EVERY): computed, recorded every N steps, carried
in a snapshot that still fits, and turned into TensorBoard's HistogramProto."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from kvstore import config as kvconfig  # noqa: E402
from kvstore.client import meter  # noqa: E402
from kvstore.core.stats import check_snapshot  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402


def test_histogram_of_has_the_tensors_moments_and_counts() -> None:
    """min, max, count, sum, sum of squares and 30 bucket counts adding up to the count."""
    t = torch.arange(-50, 50, dtype=torch.float32).reshape(10, 10) / 10
    low, high, count, total, squares, counts = meter.histogram_of(t)
    assert (low, count) == (-5.0, 100) and math.isclose(high, 4.9, rel_tol=1e-6)
    assert math.isclose(total, float(t.sum()), abs_tol=1e-4)
    assert math.isclose(squares, float((t * t).sum()), rel_tol=1e-5)
    assert len(counts) == meter.HISTOGRAM_BUCKETS and sum(counts) == 100
    assert counts[0] >= 1 and counts[-1] >= 1


def test_histogram_of_skips_non_finite_values_and_puts_a_constant_in_one_bucket() -> None:
    """NaN and inf are left out; a constant tensor is one full bucket; an empty one is all zeros."""
    mixed = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    low, high, count, total, _, counts = meter.histogram_of(mixed)
    assert (low, high, count, total, sum(counts)) == (1.0, 3.0, 2, 4.0, 2)
    assert meter.histogram_of(torch.full((7,), 2.0), 4) == [2.0, 2.0, 7, 14.0, 28.0, [7, 0, 0, 0]]
    assert meter.histogram_of(torch.tensor([float("nan")]), 3)[2:] == [0, 0.0, 0.0, [0, 0, 0]]


def test_recorder_records_weights_and_grads_every_n_steps_only() -> None:
    """every=2: the 2nd and 4th steps record weights/<name> and grads/<name> at their step; 0 never."""
    log = meter.HistogramLog()
    w, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.zeros(3))
    w.grad = torch.ones(5, 3)  # b has no gradient: no grads/ tag for it
    recorder = meter.HistogramRecorder(["w", "b"], [w, b], every=2, log=log)
    recorder.step()
    assert log.snapshot() == {}
    recorder.step()
    recorder.step()
    recorder.step()
    got = log.snapshot()
    assert sorted(got) == ["grads/w", "weights/b", "weights/w"]
    assert all(entry[0] == 2 and entry[1] == 4 for entry in got.values())  # the second record, at step 4
    assert got["grads/w"][3:6] == [1.0, 1.0, 15]
    never = meter.HistogramLog()
    off = meter.HistogramRecorder(["w"], [w], every=0, log=never)
    for _ in range(5):
        off.step()
    assert never.snapshot() == {}


def test_a_full_set_of_histograms_keeps_the_snapshot_within_its_limit() -> None:
    """The most parameters a record covers, with long names, still make a snapshot the scheduler takes."""
    log = meter.HistogramLog()
    params = [torch.nn.Parameter(torch.randn(100)) for _ in range(meter.HISTOGRAM_PARAMS + 8)]
    for p in params:
        p.grad = torch.randn(100) * 1e6
    names = [f"encoder.layers.{i}.self_attention.in_projection.weight.{'x' * 60}" for i in range(len(params))]
    meter.HistogramRecorder(names, params, every=1, log=log).step()
    carried = log.snapshot()
    assert 0 < len(carried) <= 2 * meter.HISTOGRAM_PARAMS
    snap = meter.WorkerMeter(0, "127.0.0.1").snapshot(0.0)
    snap["histograms"] = carried
    check_snapshot(snap, "worker", 0)


def test_the_setting_is_read_and_checked() -> None:
    """KVSTORE_HISTOGRAM_EVERY is an int >= 0, 0 (off) by default."""
    assert kvconfig.load({}).histogram_every == 0
    assert kvconfig.load({"KVSTORE_HISTOGRAM_EVERY": "100"}).histogram_every == 100
    with pytest.raises(ConfigError, match="KVSTORE_HISTOGRAM_EVERY"):
        kvconfig.load({"KVSTORE_HISTOGRAM_EVERY": "-1"})


def test_a_carried_histogram_becomes_a_histogram_proto() -> None:
    """The writer's event: equal-width bucket limits ending at max, the moments, the step; junk: None."""
    pytest.importorskip("tensorboard")
    from kvstore.launch.tensorboard import histogram_event

    entry = [3, 40, 1700000000.0, -1.0, 2.0, 6, 1.5, 4.0, [1, 2, 3]]
    event = histogram_event("weights/w", entry)
    value = event.summary.value[0]
    assert (value.tag, event.step, event.wall_time) == ("weights/w", 40, 1700000000.0)
    histo = value.histo
    assert (histo.min, histo.max, histo.num, histo.sum, histo.sum_squares) == (-1.0, 2.0, 6, 1.5, 4.0)
    assert list(histo.bucket_limit) == [0.0, 1.0, 2.0] and list(histo.bucket) == [1, 2, 3]
    constant = histogram_event("w", [1, 1, 1.0, 2.0, 2.0, 4, 8.0, 16.0, [4, 0, 0]]).summary.value[0].histo
    assert (list(constant.bucket_limit), list(constant.bucket)) == ([2.0], [4])
    for junk in ([1, 2], "x", [1, 1, 1.0, 0.0, 1.0, 1, 0.0, 0.0, []], [1, 1, 1.0, 0.0, 1.0, True, 0, 0, [1]]):
        assert histogram_event("w", junk) is None
    assert histogram_event(7, entry) is None

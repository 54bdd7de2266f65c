"""kvstore.core.stats: counters, latency histograms, the common snapshot fields and the snapshot check."""

from __future__ import annotations

import math
import threading

import pytest

from kvstore.core import stats
from kvstore.core.stats import BUCKETS_MS, Counters, Histogram, check_snapshot, node_snapshot, quantile


def test_counters_add_set_and_labels():
    """Flat counters add and set; labelled ones nest by label; snapshot copies both."""
    c = Counters(threading.Lock())
    c.add("bytes_in", 10)
    c.add("bytes_in", 5)
    c.add("blocked_s", 0.25)
    c.set("open_rounds", 3)
    c.add_label("refused", "window")
    c.add_label("refused", "window", 2)
    c.add_label("refused", "too-big")
    snap = c.snapshot()
    assert snap == {"bytes_in": 15, "blocked_s": 0.25, "open_rounds": 3,
                    "refused": {"window": 3, "too-big": 1}}
    snap["refused"]["window"] = 99
    assert c.get("refused", "window") == 3 and c.get("never") == 0 and c.get("refused", "x") == 0


def test_counters_are_exact_under_threads():
    """With a lock, adds from several threads all count."""
    c = Counters(threading.Lock())

    def work() -> None:
        for _ in range(5000):
            c.add("n")
            c.add_label("ops", "push")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get("n") == 20000 and c.get("ops", "push") == 20000


def test_buckets_are_log_spaced_from_a_tenth_of_a_ms_to_100_s():
    """Four bounds per decade, 0.1 ms .. 100 s, increasing."""
    assert BUCKETS_MS[0] == 0.1 and BUCKETS_MS[-1] == 100000.0 and len(BUCKETS_MS) == 25
    assert all(a < b for a, b in zip(BUCKETS_MS, BUCKETS_MS[1:]))


def test_histogram_buckets_count_and_sum():
    """Each duration lands in the first bucket whose bound holds it; the overflow bound is None."""
    h = Histogram()
    for seconds in (0.00005, 0.0001, 0.0009, 0.0009, 2.0, 500.0):
        h.observe(seconds)
    snap = h.snapshot()
    assert snap["count"] == 6 and snap["sum_s"] == pytest.approx(502.00195)
    assert snap["buckets"] == [[0.1, 2], [1.0, 2], [3162.2777, 1], [None, 1]]
    assert stats.empty_histogram() == Histogram().snapshot()


def test_quantile_reads_bucket_bounds():
    """quantile gives the bound of the bucket holding the rank; inf past 100 s; None when empty."""
    h = Histogram()
    for _ in range(9):
        h.observe(0.0005)
    h.observe(1000.0)
    snap = h.snapshot()
    assert quantile(snap, 0.5) == 0.5623
    assert quantile(snap, 1.0) == math.inf
    assert quantile(stats.empty_histogram(), 0.5) is None


def test_node_snapshot_has_the_common_fields():
    """The common fields, in schema 1, uptime from the start time."""
    snap = node_snapshot("worker", 2, "h", 123, started=100.0, now=112.5, last_op="push", last_op_at=112.0)
    assert tuple(snap) == stats.COMMON_FIELDS
    assert snap["schema"] == 1 == stats.SCHEMA_VERSION and snap["uptime_s"] == 12.5


def good(**extra) -> dict:
    """A valid worker 1 snapshot."""
    return dict(node_snapshot("worker", 1, "h", 1, 0.0, 1.0), **extra)


def test_check_snapshot_accepts_a_valid_one_and_sizes_it():
    """A snapshot of plain values passes, with an estimated size."""
    size = check_snapshot(good(ops={"push": 3}, latency={"push": Histogram().snapshot()}), "worker", 1)
    assert 0 < size < stats.MAX_SNAPSHOT_BYTES


@pytest.mark.parametrize("bad, why", [
    ([1, 2], "map"),
    (dict(good(), schema=2), "schema"),
    (dict(good(), schema=True), "schema"),
    (dict(good(), role="server"), "another node"),
    (dict(good(), rank=0), "another node"),
    (dict(good(), rank=True), "another node"),
    (good(ops={1: 2}), "key of type int"),
    (good(blob=b"x"), "type bytes"),
    (good(text="x" * 5000), "characters"),
    (good(deep=[[[[[[[[1]]]]]]]]), "nested"),
    (good(many=list(range(20000))), "bytes"),
], ids=["list", "schema", "bool-schema", "role", "rank", "bool-rank", "int-key", "bytes", "long-str",
        "deep", "too-big"])
def test_check_snapshot_refuses(bad, why):
    """A snapshot that is not a map of plain values from this node, or is too big, is refused."""
    with pytest.raises(ValueError, match=why):
        check_snapshot(bad, "worker", 1)


def test_snapshot_size_stops_counting_past_the_limit():
    """snapshot_size stops once past the limit (a huge list is not walked to its end)."""
    assert stats.MAX_SNAPSHOT_BYTES < stats.snapshot_size(list(range(10**6))) < stats.MAX_SNAPSHOT_BYTES + 100


# -- kvstore.core.status_view: the status tool's screen ---------------------------------------------

def status_reply(rounds: int, arrivals: dict, waiting: list | None = None) -> dict:
    """A STATUS reply of a 2-worker, 1-server cluster whose server has applied ``rounds`` rounds."""
    server = dict(node_snapshot("server", 0, "10.0.0.2", 9, 0.0, 100.0, "push", 99.0),
                  bytes_in=rounds * 1024, bytes_out=rounds * 2048, rounds_applied=rounds, keys=3,
                  last_arrivals=arrivals, round_wait=stats.empty_histogram(), open_rounds=1,
                  held_bytes=4096, refused={},
                  last_round={"key": "w", "waited_s": 0.25, "last_worker": 1})
    worker = dict(node_snapshot("worker", 0, "10.0.0.3", 10, 0.0, 100.0, "pull", 98.0),
                  ops={"push": rounds}, bytes_in=0, bytes_out=0, latency={}, blocked_s={})
    rows = [{"role": r, "rank": k, "host": "h", "heartbeat_age_s": 0.4, "left": False, "lost": False}
            for r, k in (("server", 0), ("worker", 0), ("worker", 1))]
    sched = dict(node_snapshot("scheduler", 0, "h", 1, 0.0, 100.0), nodes=rows, joins=3, losses=0,
                 barriers=0, barrier_wait_s={}, waiting_in_barrier=waiting or [],
                 barrier_open_s=3.5 if waiting else None)
    return {"schema": 1, "cluster": {"mode": "dist_sync", "num_workers": 2, "num_servers": 1,
                                     "complete": True}, "nodes": [server, worker], "scheduler": sched}


def test_status_view_shows_rates_and_the_straggler():
    """Rates come from two replies; the straggler is the worker most often last since the previous one."""
    from kvstore.core.status_view import render, straggler

    before, now = status_reply(10, {"0": 5, "1": 5}), status_reply(30, {"0": 6, "1": 24})
    text = render(now, before, 2.0, "10.0.0.1:9091")
    assert "kvstore cluster at 10.0.0.1:9091: dist_sync, 2 workers, 1 servers, complete" in text
    assert "10.0 rounds/s in 10.0K/s out 20.0K/s" in text and "10.0 ops/s" in text
    assert "worker       1" in text and "(no snapshot yet)" in text
    assert straggler(now, before) == "worker 1, last to arrive in 95% of rounds; its last such round " \
                                     "waited 0.250 s for it"
    assert "rounds 30" in render(now, None, 0.0, "a:1")  # no rates from one reply: totals


def test_status_view_straggler_is_who_an_open_barrier_waits_for():
    """With workers in an open barrier, the straggler is whoever is not in it."""
    from kvstore.core.status_view import straggler

    assert straggler(status_reply(1, {}, waiting=[0])) == "a barrier open for 3.5 s waits for worker 1"
    assert straggler(status_reply(1, {})) is None

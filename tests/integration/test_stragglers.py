"""Stragglers (issue 25) on real processes: dist_sync with a quorum of backup workers
(KVSTORE_SYNC_QUORUM) and dist_async with bounded staleness (KVSTORE_STALENESS).  One worker is held
back by the test (it simply does not push until told); progress is read from the servers' counters
in ``stats(cluster=True)``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.helpers import poll_for, run_parallel

from .conftest import unique_key

pytestmark = pytest.mark.timeout(60)


def server_stats(kv, ready) -> dict:
    """The first server snapshot (from the scheduler's STATUS) for which ``ready(snapshot)`` holds."""
    def found() -> dict | None:
        nodes = kv.stats(cluster=True)["nodes"]
        server = next((n for n in nodes if n["role"] == "server"), None)
        return server if server is not None and ready(server) else None
    return poll_for(found, 15, "the server's snapshot")


def test_quorum_rounds_go_at_the_pace_of_the_others_and_late_pushes_are_dropped(make_cluster):
    """W=3, quorum 2: workers 0 and 1 run 10 pushpull steps on a small key and a chunked one while
    worker 2 pushes nothing; then worker 2's push is late: dropped, acked at once (its window is
    free), counted per worker; its pull returns the new value; then it trains with the others."""
    steps, big = 10, 20_000  # 80 kB in 4 kB chunks: 20 chunks per push
    cluster = make_cluster("dist_sync", num_workers=3, num_servers=1, bound=1000,
                           KVSTORE_SYNC_QUORUM=2, KVSTORE_CHUNK_BYTES=4096)
    kv0, kv1, kv2 = cluster.workers
    keys = [unique_key(), unique_key()]
    cluster.run(lambda kv: kv.init(keys, [np.zeros(4, np.float32), np.zeros(big, np.float32)]))
    started = time.monotonic()

    def train(kv, count: int, close: bool = False) -> None:
        outs = [np.empty(4, np.float32), np.empty(big, np.float32)]
        for _ in range(count):
            kv.pushpull(keys, [np.ones(4, np.float32), np.ones(big, np.float32)], out=outs)
            assert np.all(outs[0] == 3) and np.all(outs[1] == 3)  # 2 (or 3) ones, scaled by 3/2 (3/3)
        if close:
            kv.close()  # the others' last rounds do not wait for it

    run_parallel([lambda: train(kv0, steps), lambda: train(kv1, steps)], timeout=30)  # not worker 2
    took = time.monotonic() - started
    server = server_stats(kv0, lambda s: s["rounds_applied"] >= 2 * steps)
    assert server["rounds_applied"] == 2 * steps and took < 20 and server["late_pushes"] == {}
    kv2.push(keys, [np.full(4, 100, np.float32), np.full(big, 100, np.float32)])  # its round 0: late
    assert np.all(kv2.pull(keys[0]) == 3) and np.all(kv2.pull(keys[1]) == 3)  # nothing of it applied
    assert not kv2._window.outstanding()  # acked, not withheld
    server = server_stats(kv0, lambda s: s["late_pushes"].get("2", 0) >= 2)
    assert server["late_pushes"] == {"2": 2}  # one per key and push, not per chunk
    assert server["rounds_applied"] == 2 * steps
    assert "dropped a late push" in cluster.procs.output()
    # worker 2 now joins the rounds still open: everyone trains on
    run_parallel([lambda kv=kv: train(kv, 3, close=True) for kv in cluster.workers], timeout=30)


def test_with_a_quorum_workers_that_leave_do_not_hang_the_others(make_cluster):
    cluster = make_cluster("dist_sync", num_workers=3, num_servers=1, KVSTORE_SYNC_QUORUM=2)
    kv0, kv1, kv2 = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(4, np.float32)))
    kv2.close()  # ran out of data
    out = np.empty(4, np.float32)
    kv1.push(key, np.ones(4, np.float32))
    kv0.pushpull(key, np.ones(4, np.float32), out=out)
    assert np.all(out == 3)
    kv1.close()
    kv0.pushpull(key, np.full(4, 2, np.float32), out=out)  # alone: fewer live workers than the quorum
    assert np.all(out == 6)


def test_staleness_keeps_every_worker_within_s_rounds_of_the_slowest(make_cluster):
    """dist_async, W=3, s=2: workers 0 and 1 push 8 times as fast as they can, worker 2 pushes only
    when the test says; the fast ones never get more than 2 pushes past worker 2 and the server's
    ``max_lead`` stays at most 2."""
    steps = 8
    cluster = make_cluster("dist_async", num_workers=3, num_servers=1, KVSTORE_STALENESS=2)
    kv0, kv1, kv2 = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(4, np.float32)))
    sent = [0, 0]

    def run(rank: int) -> None:
        for _ in range(steps):
            cluster.workers[rank].push(key, np.ones(4, np.float32))
            sent[rank] += 1

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for slow in range(steps + 1):
        expect = min(steps, slow + 2)
        poll_for(lambda e=expect: sent == [e, e] and (e == steps or (kv0._window.waiting
                                                                      and kv1._window.waiting)),
                 15, f"workers 0 and 1 to stop at {expect} pushes")
        assert sent == [expect, expect]  # held: no further push got out
        if slow < steps:
            kv2.push(key, np.ones(4, np.float32))
    for thread in threads:
        thread.join(15)
    cluster.run(lambda kv: kv.barrier())
    server = server_stats(kv0, lambda s: s["max_lead"] >= 2)
    assert server["max_lead"] == 2


def test_the_workers_create_quorum_decides_the_clusters(make_cluster):
    """No KVSTORE_SYNC_QUORUM anywhere: the workers' own quorum (what create(..., quorum=2) asks for
    at registration) is the cluster's, so rounds close with 2 of 3 workers."""
    cluster = make_cluster("dist_sync", num_workers=3, num_servers=1, connect=False)
    cluster.connect(sync_quorum=2)
    kv0, kv1, _ = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(4, np.float32)))
    outs = run_parallel([lambda kv=kv: kv.pushpull(key, np.ones(4, np.float32)) for kv in (kv0, kv1)])
    assert all(np.all(out == 3) for out in outs)  # 2 ones, scaled by 3/2; worker 2 never pushed


def test_a_quorum_round_of_compressed_pushes(make_cluster):
    """Quorum 2 of 3 with 2bit compression: the two pushes are dequantised (+t each, t=0.5), summed
    and scaled by 3/2; the third worker never pushes."""
    cluster = make_cluster("dist_sync", num_workers=3, num_servers=1, KVSTORE_SYNC_QUORUM=2)
    kv0, kv1, _ = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(8, np.float32)))
    cluster.run(lambda kv: kv.set_gradient_compression({"type": "2bit", "threshold": 0.5}))
    outs = run_parallel([lambda kv=kv: kv.pushpull(key, np.ones(8, np.float32)) for kv in (kv0, kv1)])
    assert all(np.all(out == 1.5) for out in outs), outs  # (0.5 + 0.5) * 3 / 2

"""What a newcomer sees (issue #18): a peer's death ends a surviving worker's script with a short
traceback; a worker that leaves early is announced once by a warning on each remaining worker."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tests.helpers import poll_for, python, run_parallel

from .conftest import Cluster, unique_key

SCRIPTS = Path(__file__).parent / "scripts"
LEFT = "worker 1 has left: dist_sync sums from now on exclude its pushes"


def test_a_peers_death_gives_the_survivor_a_short_traceback(make_cluster) -> None:
    """The survivor's traceback shows its call and the NodeLostError naming the dead worker and its
    exception: no concurrent.futures or kvstore/client/mux.py frames, no chained exceptions."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1, connect=False, KVSTORE_HEARTBEAT_TIMEOUT="60")
    env = {**cluster.env, "DMLC_ROLE": "worker"}
    survivor = cluster.procs.start("survivor", [python(), str(SCRIPTS / "survivor_worker.py")], env)
    cluster.procs.start("dying worker", [python(), str(SCRIPTS / "lone_worker.py"), "raise"], env)
    assert survivor.wait(60) == 1
    text = poll_for(lambda: next((log.read_text() for name, _, log in cluster.procs.procs
                                  if name == "survivor"), None), 10, "the survivor's log")
    assert "Traceback (most recent call last)" in text, text
    assert "kv.barrier()" in text, text
    assert "kvstore.errors.NodeLostError: " in text and "died of RuntimeError" in text, text
    for internal in ("concurrent/futures", "kvstore/client/mux.py", "kvstore/client/store.py",
                     "During handling of the above exception", "direct cause"):
        assert internal not in text, text
    assert text.count("Traceback (most recent call last)") == 1, text


def test_each_remaining_worker_warns_once_when_a_worker_leaves(make_cluster, caplog) -> None:
    """Worker 1 closes early: once workers 0 and 2 push again (their sums now lack its pushes), each
    logs one warning that the dist_sync sums exclude it from now on, and never again."""
    cluster: Cluster = make_cluster("dist_sync", 3, 1, KVSTORE_HEARTBEAT_INTERVAL=0.2,
                                    KVSTORE_HEARTBEAT_TIMEOUT=5)
    w0, w1, w2 = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(2, np.float32)))

    def left_warnings() -> list:
        return [r for r in caplog.records if r.name == "kvstore.dist" and r.levelno == logging.WARNING
                and r.getMessage() == LEFT]

    with caplog.at_level(logging.INFO, logger="kvstore.dist"):
        w1.close()
        for _ in range(2):
            run_parallel([w0.barrier, w2.barrier])
        assert left_warnings() == []  # known, but nothing pushed since: a job ending together warns nobody
        results = run_parallel([lambda kv=kv: kv.pushpull(key, np.ones(2, np.float32)) for kv in (w0, w2)])
        poll_for(lambda: len(left_warnings()) >= 2, 10, "both other workers' warnings after their push")
        run_parallel([w0.barrier, w2.barrier])
        results += run_parallel([lambda kv=kv: kv.pushpull(key, np.ones(2, np.float32)) for kv in (w0, w2)])
    assert len(left_warnings()) == 2, [r.getMessage() for r in caplog.records]
    assert [r.tolist() for r in results] == [[2.0, 2.0]] * 4


def test_a_worker_that_never_calls_a_barrier_learns_of_a_leaver_within_a_heartbeat(make_cluster, caplog):
    """The scheduler's heartbeat replies name the workers that have left: workers 0 and 2, pushing on
    without a barrier, each warn once within a heartbeat of their push."""
    cluster: Cluster = make_cluster("dist_sync", 3, 1, KVSTORE_HEARTBEAT_INTERVAL=0.2,
                                    KVSTORE_HEARTBEAT_TIMEOUT=5)
    w0, w1, w2 = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(2, np.float32)))

    def left_warnings() -> list:
        return [r for r in caplog.records if r.name == "kvstore.dist" and r.levelno == logging.WARNING
                and r.getMessage() == LEFT]

    with caplog.at_level(logging.INFO, logger="kvstore.dist"):
        w1.close()

        def pushed_and_warned() -> bool:  # a training loop: each poll is one more step on both
            run_parallel([lambda kv=kv: kv.pushpull(key, np.ones(2, np.float32)) for kv in (w0, w2)])
            return len(left_warnings()) >= 2

        poll_for(pushed_and_warned, 10, "both other workers' warnings")
    assert len(left_warnings()) == 2

"""A dist_sync pushpull that one worker calls with another shape or dtype fails on every worker within
seconds, not by KVSTORE_REQUEST_TIMEOUT (issue 40): its round is aborted on the servers, the error
names the key and the rank, and the next correct pushpull gives the right sum everywhere
(3 workers, 2 servers; a small key, a key split over both servers, and a batch of keys)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvstore

from .conftest import Cluster

DEADLINE = 10.0  # well below the cluster's KVSTORE_REQUEST_TIMEOUT of 60 s
BIG = 3000  # elements: over the cluster's bound (1000), so split over both servers
MANY = [f"many{i}" for i in range(20)]  # small keys that travel in one batch per server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """One 3-worker, 2-server dist_sync cluster whose requests would wait 60 s."""
    c = Cluster(tmp_path_factory.mktemp("abort"), "dist_sync", 3, 2, KVSTORE_REQUEST_TIMEOUT="60")
    c.connect()
    c.run(lambda kv: kv.init(["small", "big", *MANY], [np.zeros(3, np.float32), np.zeros(BIG, np.float32)]
                             + [np.zeros(2, np.float32)] * len(MANY)))
    yield c
    c.close()


def _timed(fn: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, float]]:
    """``fn(kv)`` run on a worker: (its error or result, seconds it took)."""
    def run(kv):
        start = time.monotonic()
        try:
            return fn(kv), time.monotonic() - start
        except kvstore.KVStoreError as exc:
            return exc, time.monotonic() - start
    return run


def _every_rank_raises(cluster: Cluster, fn: Callable[[Any], Any], key: str) -> list[Exception]:
    """Run ``fn`` on every worker; each must raise within DEADLINE, worker 1 a ShapeMismatchError,
    worker 2 a DTypeMismatchError, and the others a CollectiveMismatchError naming ``key`` and worker
    1 or 2."""
    results = cluster.run(_timed(fn))
    for rank, (exc, took) in enumerate(results):
        assert isinstance(exc, Exception), f"worker {rank} returned {exc!r}"
        assert took < DEADLINE, f"worker {rank} raised after {took:.1f} s: {exc}"
    errors = [exc for exc, _ in results]
    assert isinstance(errors[1], kvstore.ShapeMismatchError), errors[1]
    assert isinstance(errors[2], kvstore.DTypeMismatchError), errors[2]
    text = str(errors[0])
    assert isinstance(errors[0], kvstore.CollectiveMismatchError), errors[0]
    assert f"'{key}'" in text and ("worker 1" in text or "worker 2" in text), text
    return errors


def _right_sums(cluster: Cluster, key: Any, shape: tuple, times: int = 2) -> None:
    """``times`` correct pushpulls of ``key`` (one or a list) give every worker the sum 0 + 1 + 2."""
    def work(kv):
        keys = key if isinstance(key, list) else [key]
        for _ in range(times):
            values = [np.full(shape, kv.rank, np.float32) for _ in keys]
            kv.pushpull(keys, values)
            assert all(np.all(v == 3) for v in values), values
        return True
    assert cluster.run(work) == [True] * 3


def _wrong(kv, shape: tuple) -> np.ndarray:
    """Rank 1: a value of another shape; rank 2: of another dtype; rank 0: a right one."""
    if kv.rank == 1:
        return np.ones((shape[0] + 1,), np.float32)
    return np.ones(shape, np.float64 if kv.rank == 2 else np.float32)


@pytest.mark.parametrize("key, shape", [("small", (3,)), ("big", (BIG,))])
def test_a_mismatched_pushpull_fails_every_rank_and_the_key_stays_usable(cluster: Cluster, key: str,
                                                                         shape: tuple) -> None:
    """Worker 1 pushpulls a wrong shape, worker 2 a wrong dtype: every rank raises within seconds (the
    correct one a CollectiveMismatchError naming the key and a rank), twice; the key then sums right."""
    for _ in range(2):
        _every_rank_raises(cluster, lambda kv: kv.pushpull(key, _wrong(kv, shape)), key)
    _right_sums(cluster, key, shape)


def test_a_mismatch_in_a_batch_of_keys_fails_the_whole_call_on_every_rank(cluster: Cluster) -> None:
    """One wrong key in a pushpull of 20 small keys (one batch per server): every rank raises, the
    batch stays usable."""
    _right_sums(cluster, MANY, (2,), times=1)  # the keys' batches are known (fast path, key groups)

    def call(kv):
        values = [np.ones(2, np.float32) for _ in MANY]
        values[7] = _wrong(kv, (2,))
        kv.pushpull(MANY, values)
    _every_rank_raises(cluster, call, MANY[7])
    _right_sums(cluster, MANY, (2,))


def test_a_void_push_waiting_in_the_round_fails_at_the_next_call(cluster: Cluster) -> None:
    """Worker 0 pushes then pulls while workers 1 and 2 pushpull wrong values: worker 0's pull raises
    the abort (its push failed), within seconds; the key then sums right."""
    def call(kv):
        if kv.rank == 0:
            kv.push("small", np.ones(3, np.float32))
            return kv.pull("small")
        return kv.pushpull("small", _wrong(kv, (3,)))
    _every_rank_raises(cluster, call, "small")
    _right_sums(cluster, "small", (3,))


def test_a_late_refusal_under_a_quorum_fails_nobody_else(make_cluster) -> None:
    """KVSTORE_SYNC_QUORUM=2 of 3: worker 0 refuses its pushpull after round 0 closed without it; it
    alone raises, and the next step succeeds on every worker (the refusal counts as its late push)."""
    c = make_cluster("dist_sync", 3, 1, KVSTORE_SYNC_QUORUM="2", KVSTORE_REQUEST_TIMEOUT="20")

    def work(kv):
        kv.init("q", np.zeros(4, np.float32))
        log = []
        if kv.rank != 0:
            kv.pushpull("q", np.ones(4, np.float32))  # round 0 closes by quorum, without worker 0
        kv.barrier()  # worker 0 refuses only once round 0 has closed
        if kv.rank == 0:
            with pytest.raises(kvstore.ShapeMismatchError):
                kv.pushpull("q", np.ones(5, np.float32))
        kv.barrier()  # the next step starts after the abort (its OK came back): every worker joins round 1
        start, out = time.monotonic(), np.ones(4, np.float32)
        kv.pushpull("q", out)
        log.append((out.tolist(), time.monotonic() - start < DEADLINE))
        return log
    assert c.run(work) == [[([3.0] * 4, True)]] * 3




def test_an_aborted_round_leaves_every_worker_s_push_count_as_before_it(make_cluster) -> None:
    """Worker 0's refused pushpull aborts worker 1's, twice (the second time on the fast path): no
    worker counts those rounds (the round a push carries, and ALIGN's after a server restart, agree),
    and the pushpulls between them sum right."""
    c = make_cluster("dist_sync", 2, 1)

    def work(kv):
        kv.init("a", np.zeros(4, np.float32))
        found = []
        for _ in range(2):
            with pytest.raises((kvstore.ShapeMismatchError, kvstore.CollectiveMismatchError)):
                kv.pushpull(["a"], [np.ones(5 if kv.rank == 0 else 4, np.float32)],
                            out=[np.zeros(4, np.float32)])
            counts = [kv._path._pushes.get("a", 0)]
            out = np.zeros(4, np.float32)
            kv.pushpull(["a"], [np.full(4, kv.rank + 1.0, np.float32)], out=[out])
            found.append((counts, [kv._path._pushes.get("a", 0)], out.tolist()))
        return found
    assert c.run(work) == [[([0], [1], [3.0] * 4), ([1], [2], [3.0] * 4)]] * 2

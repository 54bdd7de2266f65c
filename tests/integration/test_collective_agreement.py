"""Collectives whose arguments differ between workers fail fast on every worker (issue 40): a typed
CollectiveMismatchError naming the ranks and what differs, within a deadline, the store usable after
(2 workers in threads, 1 server)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402

DEADLINE = 20.0  # generous: the wanted bound is 5 s or a heartbeat deadline, not a speed


def _every_rank_raises(cluster, fn: Callable[[Any], None], *words: str) -> list[Any]:
    """Run ``fn(kv)`` on every worker; assert each raised CollectiveMismatchError within DEADLINE
    naming ``words`` and return the errors by rank."""
    def run(kv):
        start = time.monotonic()
        try:
            fn(kv)
        except kvstore.CollectiveMismatchError as exc:
            return exc, time.monotonic() - start
        return None, time.monotonic() - start

    results = cluster.run(run)
    for rank, (exc, took) in enumerate(results):
        assert exc is not None, f"worker {rank} returned normally"
        assert took < DEADLINE, f"worker {rank} raised after {took:.1f} s"
        for word in words:
            assert word in str(exc), (rank, word, str(exc))
        assert exc.ranks == [1], str(exc)
    return [exc for exc, _ in results]


def _broadcast_works(cluster) -> None:
    """A following correct broadcast gives every worker rank 0's tensor."""
    def work(kv):
        t = torch.full((2,), float(kv.rank))
        kvstore.broadcast_parameters({"ok": t}, root_rank=0, kv=kv)
        return t.tolist()
    assert cluster.run(work) == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.timeout(90)
def test_broadcast_parameters_that_differ_raise_on_every_rank(make_cluster) -> None:
    """Shape, dtype, root_rank, key set and key order that differ: every rank raises, nothing converted."""
    cluster = make_cluster("dist_sync", 2, 1)

    def shapes(kv):
        kvstore.broadcast_parameters({"w": torch.zeros(3 if kv.rank == 0 else 4)}, kv=kv)
    _every_rank_raises(cluster, shapes, "worker 1", "'w'", "(4,)", "(3,)")

    received = []

    def dtypes(kv):  # a float64 2.75 must not arrive in an int64 tensor as 2
        t = torch.tensor([2.75], dtype=torch.float64) if kv.rank == 0 else torch.tensor([7])
        received.append(t)
        kvstore.broadcast_parameters({"v": t}, kv=kv)
    _every_rank_raises(cluster, dtypes, "float64", "int64")
    assert sorted(t.item() for t in received) == [2.75, 7]

    def roots(kv):
        kvstore.broadcast_parameters({"w": torch.zeros(2)}, root_rank=kv.rank, kv=kv)
    _every_rank_raises(cluster, roots, "root_rank 1")

    def key_sets(kv):
        names = ["a", "b"] if kv.rank == 0 else ["a", "c"]
        kvstore.broadcast_parameters({n: torch.zeros(2) for n in names}, kv=kv)
    _every_rank_raises(cluster, key_sets, "'c'", "'b'")

    def key_order(kv):
        names = ["a", "b"] if kv.rank == 0 else ["b", "a"]
        kvstore.broadcast_parameters({n: torch.zeros(2) for n in names}, kv=kv)
    _every_rank_raises(cluster, key_order, "order")
    _broadcast_works(cluster)


@pytest.mark.timeout(90)
def test_broadcast_optimizer_state_that_differs_raises_on_every_rank(make_cluster) -> None:
    """Parameter shapes, parameter count, root_rank that differ: every rank raises; the store works after."""
    cluster = make_cluster("dist_sync", 2, 1)

    def opt(*shapes):
        return torch.optim.Adam([torch.nn.Parameter(torch.zeros(s)) for s in shapes], lr=0.1)

    _every_rank_raises(cluster, lambda kv: kvstore.broadcast_optimizer_state(
        opt(3) if kv.rank == 0 else opt(5), kv=kv), "(5,)", "(3,)")
    _every_rank_raises(cluster, lambda kv: kvstore.broadcast_optimizer_state(
        opt(3) if kv.rank == 0 else opt(3, 2), kv=kv), "param_groups[0][1]")
    _every_rank_raises(cluster, lambda kv: kvstore.broadcast_optimizer_state(
        opt(3), root_rank=kv.rank, kv=kv), "root_rank")

    def works(kv):
        o = opt(3)
        o.param_groups[0]["lr"] = 0.5 if kv.rank == 0 else 0.1
        kvstore.broadcast_optimizer_state(o, kv=kv)
        return o.param_groups[0]["lr"]
    assert cluster.run(works) == [0.5, 0.5]


@pytest.mark.timeout(90)
def test_init_and_optimizer_that_differ_raise_on_every_rank(make_cluster) -> None:
    """init of a key with other shapes, a DistributedOptimizer over other parameters: every rank raises."""
    cluster = make_cluster("dist_sync", 2, 1)
    _every_rank_raises(cluster, lambda kv: kv.init("k", np.zeros(3 if kv.rank == 0 else 4, np.float32)),
                       "'k'", "(4,)", "(3,)")

    def pushpull(kv):  # the key was not initialised by the failed init: it can be now, and used
        kv.init("k", np.zeros(3, np.float32))
        out = np.zeros(3, np.float32)
        kv.pushpull("k", np.full(3, kv.rank + 1, np.float32), out=out)
        return out.tolist()
    assert cluster.run(pushpull) == [[3.0] * 3] * 2

    def step(kv, sizes):
        params = [torch.nn.Parameter(torch.ones(s)) for s in sizes]
        opt = kvstore.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), kv=kv, key_prefix="opt")
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        return [p.tolist() for p in params]
    _every_rank_raises(cluster, lambda kv: step(kv, [3] if kv.rank == 0 else [3, 2]), "opt/grad/0.1")
    _every_rank_raises(cluster, lambda kv: step(kv, [3] if kv.rank == 0 else [4]), "opt/grad/0.0")
    assert cluster.run(lambda kv: step(kv, [2])) == [[[0.0, 0.0]]] * 2

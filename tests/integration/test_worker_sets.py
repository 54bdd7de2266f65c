"""Worker sets on real processes (docs/worker-sets.md): a set's round completes with its members'
pushes only, non-members are refused by the worker and by the servers, members that disagree at init
fail alike, the servers' optimizer and compression work on set keys, DistributedOptimizer(process_set=)
reduces over its members, and a member restarted under --max-restarts goes on with the set."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvstore
from kvstore.core import optimizer as kvopt
from kvstore.errors import CollectiveMismatchError, NotAMemberError
from tests import compression_ref as ref

from .conftest import Cluster, _shared_cluster, unique_key
from .test_restarts import SCRIPT as _RESTART_SCRIPT
from .test_restarts import _weights, launches  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)
SCRIPT = _RESTART_SCRIPT.parent / "worker_sets_train.py"
N = 300  # over the bound of 100: sliced over both servers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """4 workers, 2 servers, dist_sync, values over 100 elements sliced over both servers, requests
    given up after 5 s."""
    made = _shared_cluster(tmp_path_factory, "dist_sync", 4, 2, KVSTORE_BIGARRAY_BOUND="100",
                           KVSTORE_REQUEST_TIMEOUT="5")
    yield made
    made.close()


def by_rank(cluster: Cluster, work: dict) -> list:
    """Run ``work[rank](kv)`` on each worker that has one, in parallel; results by rank (None: idle)."""
    return cluster.run(lambda kv: work[kv.rank](kv) if kv.rank in work else None)


def test_a_round_of_a_set_of_two_out_of_four_completes_without_the_other_two(cluster: Cluster) -> None:
    """{0, 2} push and pull 3 rounds of their key while 1 and 3 only use a key of their own: exact sums,
    and each member's bytes_out grows by its pushes alone."""
    key, other = unique_key("set"), unique_key("other")

    def member(kv):
        kv.init(key, np.zeros(N, np.float32), workers=[0, 2])
        before = kv.stats()["bytes_out"]
        got = []
        for step in range(3):
            kv.push(key, np.full(N, (kv.rank + 1) * (step + 1), np.float32))
            got.append(kv.pull(key))
        return got, kv.stats()["bytes_out"] - before

    def outsider(kv):
        kv.init(other, np.zeros(4, np.float32), workers=kvstore.WorkerSet((1, 3)))
        return kv.pushpull(other, np.ones(4, np.float32)), 0

    results = by_rank(cluster, {0: member, 2: member, 1: outsider, 3: outsider})
    for rank in (0, 2):
        got, sent = results[rank]
        for step, value in enumerate(got):
            np.testing.assert_array_equal(value, np.full(N, 4.0 * (step + 1), np.float32))
        assert sent == 3 * N * 4  # its own pushes' bytes, nothing for the other set
    for rank in (1, 3):
        np.testing.assert_array_equal(results[rank][0], np.full(4, 2.0, np.float32))


def test_a_non_member_is_refused_by_its_worker_and_by_the_servers(cluster: Cluster) -> None:
    """Worker 1's init, push and pull of a {0, 2} key raise NotAMemberError at once; forced past its own
    check, its pull and pushpull are refused by the servers; the members' next round is exact."""
    key = unique_key("set")
    by_rank(cluster, {r: lambda kv: kv.init(key, np.zeros(N, np.float32), workers=[0, 2]) for r in (0, 2)})
    kv1 = cluster.workers[1]
    with pytest.raises(NotAMemberError, match=r"worker 1 is not in worker set \{0, 2\}"):
        kv1.init(key, np.zeros(N, np.float32), workers=[0, 2])
    for call in (lambda: kv1.push(key, np.ones(N, np.float32)), lambda: kv1.pull(key)):
        with pytest.raises(NotAMemberError, match=repr(key)):
            call()
    kv1._meta[key] = cluster.workers[0]._meta[key]  # as if its own check were skipped
    try:
        with pytest.raises(NotAMemberError, match=r"worker 1 is not in worker set \[0, 2\]"):
            kv1.pull(key)
        with pytest.raises(NotAMemberError):
            kv1.pushpull(key, np.ones(N, np.float32))
    finally:
        del kv1._meta[key]
    got = by_rank(cluster, {r: lambda kv: kv.pushpull(key, np.full(N, 2.0, np.float32)) for r in (0, 2)})
    for rank in (0, 2):
        np.testing.assert_array_equal(got[rank], np.full(N, 4.0, np.float32))


def test_members_that_disagree_at_init_fail_alike(cluster: Cluster) -> None:
    """Member 2 inits another shape: both members raise CollectiveMismatchError; the key is not made."""
    key = unique_key("set")

    def init(kv):
        try:
            kv.init(key, np.zeros(N + kv.rank, np.float32), workers=[0, 2])
        except CollectiveMismatchError as exc:
            return exc
        return None

    errors = by_rank(cluster, {0: init, 2: init})
    assert all(isinstance(errors[r], CollectiveMismatchError) for r in (0, 2)), errors
    assert "worker 2" in str(errors[0]) or "2" in str(errors[0])


def test_a_corrected_init_after_a_disagreement_on_one_server_succeeds(cluster: Cluster) -> None:
    """Members agree on a key of one server and disagree on a key of the other: the call fails on both
    and makes neither key (every server compares the whole call), so the corrected init succeeds and
    its rounds sum."""
    keys: dict[int, str] = {}
    while len(keys) < 2:  # small keys: one on each server
        name = unique_key("retry")
        keys.setdefault(cluster.workers[0]._path.pieces(name, 4)[0].server, name)  # noqa: SLF001
    a, b = keys[0], keys[1]

    def run(kv):
        wrong = np.zeros(5 if kv.rank == 2 else 4, np.float32)
        with pytest.raises(CollectiveMismatchError):
            kv.init([a, b], [np.zeros(4, np.float32), wrong], workers=[0, 2])
        kv.init([a, b], [np.zeros(4, np.float32), np.zeros(4, np.float32)], workers=[0, 2])
        return kv.pushpull([a, b], [np.ones(4, np.float32)] * 2)

    got = by_rank(cluster, {0: run, 2: run})
    for rank in (0, 2):
        for value in got[rank]:
            np.testing.assert_array_equal(value, np.full(4, 2, np.float32))


def test_an_init_a_member_never_joins_fails_naming_it(cluster: Cluster) -> None:
    """Worker 0 inits a {0, 2} key alone: within KVSTORE_REQUEST_TIMEOUT it raises
    DeadlineExceededError naming member 2, and the key was not made (worker 2 may init it afresh)."""
    key = unique_key("set")
    with pytest.raises(kvstore.DeadlineExceededError, match=r"member\(s\) \[2\] did not call it"):
        cluster.workers[0].init(key, np.zeros(N, np.float32), workers=[0, 2])
    made = {r: lambda kv: kv.init(key, np.zeros(4, np.float32), workers=[1, 2]) for r in (1, 2)}
    got = by_rank(cluster, made)
    assert got == [None, None, None, None]


def test_distributed_optimizer_reduces_over_its_process_set(cluster: Cluster) -> None:
    """DistributedOptimizer(process_set=[0, 2]): members' gradients are averaged over 2; worker 1 is
    refused at construction."""
    import torch

    def member(kv):
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():  # the same weights on both members (the threads share torch's RNG)
            model.weight.copy_(torch.arange(6.0).reshape(2, 3) / 10)
            model.bias.zero_()
        opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           model.named_parameters(), kv=kv, key_prefix="pset",
                                           process_set=[0, 2])
        before = model.weight.detach().clone()
        model(torch.full((1, 3), float(kv.rank + 1))).sum().backward()
        opt.step()
        return before, model.weight.detach().clone()

    def outsider(kv):
        with pytest.raises(NotAMemberError, match="process set"):
            kvstore.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=1.0), kv=kv,
                                         process_set=[0, 2])

    results = by_rank(cluster, {0: member, 2: member, 1: outsider})
    before, after = results[0]
    np.testing.assert_allclose(after.numpy(), before.numpy() - 2.0, rtol=0, atol=1e-6)  # mean of 1 and 3
    np.testing.assert_array_equal(results[2][1].numpy(), after.numpy())


@pytest.mark.parametrize("kind", ["2bit"])
def test_server_optimizer_and_compression_on_a_set_key(make_cluster, kind: str) -> None:
    """sgd with momentum on the servers and 2bit compression: a {0, 2} key of 4 workers follows the
    numpy reference (MXNet's kernel) of the members' dequantised pushes, element for element."""
    cluster: Cluster = make_cluster("dist_sync", 4, 1)
    params = {"learning_rate": 0.1, "momentum": 0.9}
    cluster.run(lambda kv: kv.set_optimizer(kvopt.create("sgd", **params)))
    cluster.run(lambda kv: kv.set_gradient_compression({"type": kind, "threshold": 0.5}))
    key, n = unique_key("set"), 8
    rng = np.random.default_rng(3)
    grads = [{r: rng.choice([-0.5, 0.5, 0.0], n).astype(np.float32) for r in (0, 2)} for _ in range(3)]

    def member(kv):
        kv.init(key, np.ones(n, np.float32), workers=[0, 2])
        return [kv.pushpull(key, grads[step][kv.rank].copy()) for step in range(3)]  # written in place

    results = by_rank(cluster, {0: member, 2: member})
    weight, mom = np.ones(n, np.float32), np.zeros(n, np.float32)
    residual = {r: np.zeros(n, np.float32) for r in (0, 2)}
    for step in range(3):
        g = sum(ref.roundtrip(kind, grads[step][r], residual[r], 0.5) for r in (0, 2)).astype(np.float32)
        mom = np.float32(0.9) * mom - np.float32(0.1) * g
        weight = weight + mom
        for rank in (0, 2):
            np.testing.assert_allclose(results[rank][step], weight, rtol=0, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_set_survives_a_members_restart(launches, tmp_path) -> None:  # noqa: F811
    """Member 2 of {0, 2} is SIGKILLed after round 4 under --max-restarts 1: it rejoins and pushes the
    set's key again, the set's rounds go on (each read checked exact by the script: a round without it
    is scaled as a quorum of the rest), every worker ends with the last step's sum."""
    steps = 40  # of 100 ms each: the restarted worker finds the others training
    run = launches(["-n", "4", "-s", "2", "--max-restarts", "1", str(SCRIPT), str(steps), str(tmp_path / "w"),
                    "100"], {"KVSTORE_TEST_DIE_AT_ROUND": "2:4"})
    assert run.finish(90) == 0, run.output
    assert "restarting it as incarnation 1" in run.output, run.output
    found = re.search(r"\[worker 2\] rank 2 done steps (\d+)\.\.", run.output)
    assert found and int(found.group(1)) < steps, run.output  # it pushed the set's key again
    for rank in range(4):
        np.testing.assert_array_equal(_weights(tmp_path / f"w.{rank}")["value"],
                                      np.full(N, 2.0 * steps, np.float32))

"""Unit tests of the Server's request handling over a fake transport (tests/unit/server/fake.py):
real authentication, handler table and shard, no processes and no sockets."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore.net.protocol import Message, Op

from .fake import FakeCluster

pytestmark = pytest.mark.timeout(30)

# arrival: batches of keys at rest take the key-group path (server/fastpath.py); rank: the per-key path
SUM_ORDERS = ["arrival", "rank"]


def _push(cluster: FakeCluster, worker: int, key: str, value: np.ndarray, op: Op = Op.PUSH) -> int:
    return cluster.send(worker, op, {"keys": [key], "sizes": [value.size]}, [value])


def _pull(cluster: FakeCluster, worker: int, key: str, size: int) -> int:
    return cluster.send(worker, Op.PULL, {"keys": [key], "sizes": [size]})


def _only(replies: list[Message], seq: int) -> Message:
    """The one reply, checked to answer request ``seq``."""
    assert len(replies) == 1 and replies[0].seq == seq, replies
    return replies[0]


def test_an_init_is_stored_and_acknowledged() -> None:
    """INIT stores the key's value (a copy) and answers OK with the request's seq."""
    cluster = FakeCluster()
    value = np.arange(4, dtype=np.float32)
    reply = cluster.init("w", value)
    assert reply.op is Op.OK and reply.seq == 1 and reply.sender == 0
    value[:] = -1  # the server keeps its own copy
    np.testing.assert_array_equal(cluster.server.state.value("w"), np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("order", SUM_ORDERS)
def test_dist_sync_a_pull_waits_for_the_round_of_both_workers(order: str) -> None:
    """dist_sync, 2 workers: a worker's pull after its push is answered only once the other worker's
    push closes the round, with the sum; both pushes are acked then, not before."""
    cluster = FakeCluster("dist_sync", 2, KVSTORE_SUM_ORDER=order)
    cluster.init("w", np.zeros(4, np.float32))
    first = _push(cluster, 0, "w", np.ones(4, np.float32))
    pull = _pull(cluster, 0, "w", 4)
    assert cluster.replies(0) == []  # the round waits for worker 1: no ack, no value yet
    second = _push(cluster, 1, "w", np.full(4, 2.0, np.float32))
    acks = cluster.replies(0)
    assert [(m.op, m.seq) for m in acks] == [(Op.OK, first), (Op.OK, pull)]
    assert acks[0].arrays == []
    np.testing.assert_array_equal(acks[1].arrays[0], np.full(4, 3.0, np.float32))
    assert _only(cluster.replies(1), second).op is Op.OK


@pytest.mark.parametrize("order", SUM_ORDERS)
def test_a_pushpull_is_answered_with_the_rounds_sum(order: str) -> None:
    """PUSHPULL of both workers: each gets the round's sum as its only reply once the round closes."""
    cluster = FakeCluster("dist_sync", 2, KVSTORE_SUM_ORDER=order)
    cluster.init("w", np.zeros(3, np.float32))
    seq0 = _push(cluster, 0, "w", np.ones(3, np.float32), Op.PUSHPULL)
    assert cluster.replies(0) == []
    seq1 = _push(cluster, 1, "w", np.ones(3, np.float32), Op.PUSHPULL)
    for worker, seq in ((0, seq0), (1, seq1)):
        reply = _only(cluster.replies(worker), seq)
        np.testing.assert_array_equal(reply.arrays[0], np.full(3, 2.0, np.float32))


@pytest.mark.parametrize("body, arrays", [
    ({"keys": ["w"], "sizes": [4]}, [np.ones(3, np.float32)]),   # the array is not the sizes' sum
    ({"keys": ["w"], "sizes": [4]}, []),                          # no array
    ({"keys": ["w", "w"], "sizes": [2, 2]}, [np.ones(4, np.float32)]),  # a key twice
    ({"keys": ["w"], "sizes": [4], "rounds": [-1]}, [np.ones(4, np.float32)]),  # a bad round
    ({"keys": ["w"], "sizes": [4]}, [np.ones(4, np.int32)]),     # another dtype
])
def test_a_malformed_push_gets_an_error_reply_and_changes_nothing(body: dict, arrays: list) -> None:
    """A malformed PUSH is answered with one ERROR carrying its seq; the server keeps serving and its
    shard is as before: no round opened, the value unchanged, a later round sums as if it never came."""
    cluster = FakeCluster("dist_sync", 2)
    cluster.init("w", np.zeros(4, np.float32))
    seq = cluster.send(0, Op.PUSH, body, arrays)
    error = _only(cluster.replies(0), seq)
    assert error.op is Op.ERROR and error.body["code"] in ("ProtocolError", "DTypeMismatchError")
    assert cluster.server.state.open_rounds() == 0
    np.testing.assert_array_equal(cluster.server.state.value("w"), np.zeros(4, np.float32))
    _push(cluster, 0, "w", np.ones(4, np.float32))
    _push(cluster, 1, "w", np.ones(4, np.float32))
    np.testing.assert_array_equal(cluster.server.state.value("w"), np.full(4, 2.0, np.float32))


def test_a_request_without_a_worker_rank_is_refused() -> None:
    """A PULL whose sender is no worker rank of the cluster gets a ProtocolError reply."""
    cluster = FakeCluster("dist_sync", 2)
    cluster.init("w", np.zeros(2, np.float32))
    seq = cluster.send(0, Op.PULL, {"keys": ["w"], "sizes": [2]}, rank=7)
    error = _only(cluster.replies(0), seq)
    assert error.op is Op.ERROR and "worker rank" in error.body["message"]
    seq = cluster.send(0, Op.PULL, {"keys": ["w"], "sizes": [2]})  # and the server keeps serving
    assert _only(cluster.replies(0), seq).op is Op.OK


@pytest.mark.parametrize("order", SUM_ORDERS)
def test_an_optimizer_set_is_applied_to_the_next_rounds_sum(order: str) -> None:
    """OPTIMIZER_SET installs the optimizer (OPTIMIZER_INFO reports it); the next round's sum is its
    gradient: sgd with learning rate 0.1 steps the weight by -0.1 x the sum."""
    cluster = FakeCluster("dist_sync", 2, KVSTORE_SUM_ORDER=order)
    cluster.init("w", np.ones(4, np.float32))
    spec = kvstore.optimizer.create("sgd", learning_rate=0.1).spec()
    seq = cluster.send(0, Op.OPTIMIZER_SET, {"spec": spec, "num_update": 0})
    assert _only(cluster.replies(0), seq).op is Op.OK
    seq = cluster.send(1, Op.OPTIMIZER_INFO, {})
    assert _only(cluster.replies(1), seq).body["spec"]["name"] == "sgd"
    _push(cluster, 0, "w", np.ones(4, np.float32))
    _push(cluster, 1, "w", np.ones(4, np.float32))
    cluster.replies(0), cluster.replies(1)
    seq = _pull(cluster, 1, "w", 4)
    weight = _only(cluster.replies(1), seq).arrays[0]
    np.testing.assert_allclose(weight, np.full(4, 0.8, np.float32), rtol=1e-6)


def test_an_integer_key_is_refused_a_push_once_an_optimizer_is_set() -> None:
    """With an optimizer set, a push to an integer key is a DTypeMismatchError reply; nothing changes."""
    cluster = FakeCluster("dist_async", 1)
    cluster.init("n", np.zeros(2, np.int32))
    spec = kvstore.optimizer.create("sgd", learning_rate=0.1).spec()
    cluster.send(0, Op.OPTIMIZER_SET, {"spec": spec})
    cluster.replies(0)
    seq = _push(cluster, 0, "n", np.ones(2, np.int32))
    error = _only(cluster.replies(0), seq)
    assert error.op is Op.ERROR and error.body["code"] == "DTypeMismatchError"
    np.testing.assert_array_equal(cluster.server.state.value("n"), np.zeros(2, np.int32))


def test_dist_async_applies_each_push_at_once() -> None:
    """dist_async: each push is applied and acked on arrival; a pull reads every push applied so far."""
    cluster = FakeCluster("dist_async", 2)
    cluster.init("w", np.zeros(2, np.float32))
    seq = _push(cluster, 1, "w", np.ones(2, np.float32))
    assert _only(cluster.replies(1), seq).op is Op.OK
    seq = _pull(cluster, 0, "w", 2)
    np.testing.assert_array_equal(_only(cluster.replies(0), seq).arrays[0], np.ones(2, np.float32))


def test_a_leave_closes_the_rounds_that_waited_for_the_worker() -> None:
    """LEAVE of worker 1 is acked, and the round that waited for it closes: worker 0's push is acked."""
    cluster = FakeCluster("dist_sync", 2)
    cluster.init("w", np.zeros(2, np.float32))
    pushed = _push(cluster, 0, "w", np.ones(2, np.float32))
    assert cluster.replies(0) == []
    seq = cluster.send(1, Op.LEAVE, {})
    assert _only(cluster.replies(1), seq).op is Op.OK
    assert _only(cluster.replies(0), pushed).op is Op.OK
    np.testing.assert_array_equal(cluster.server.state.value("w"), np.ones(2, np.float32))


def test_a_leave_with_another_workers_rank_is_refused() -> None:
    """A LEAVE naming worker 1 from another connection than worker 1's pushes is refused (typed);
    worker 1 still counts: its next push closes the round."""
    cluster = FakeCluster("dist_sync", 2)
    cluster.init("w", np.zeros(2, np.float32))
    for worker in (0, 1):
        _push(cluster, worker, "w", np.ones(2, np.float32))
    cluster.replies(0), cluster.replies(1)
    seq = cluster.send(0, Op.LEAVE, {}, rank=1)
    reply = _only(cluster.replies(0), seq)
    assert reply.op is Op.ERROR and reply.body["code"] == "ProtocolError", reply.body
    first = _push(cluster, 0, "w", np.ones(2, np.float32))
    second = _push(cluster, 1, "w", np.ones(2, np.float32))
    assert _only(cluster.replies(1), second).op is Op.OK
    assert _only(cluster.replies(0), first).op is Op.OK


def test_a_push_after_its_leave_is_a_typed_error_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A worker that has left gets a ProtocolError for each push, and the server logs one line, no
    traceback."""
    cluster = FakeCluster("dist_sync", 2)
    cluster.init("w", np.zeros(2, np.float32))
    seq = cluster.send(1, Op.LEAVE, {})
    assert _only(cluster.replies(1), seq).op is Op.OK
    for _ in range(3):
        seq = _push(cluster, 1, "w", np.ones(2, np.float32))
        reply = _only(cluster.replies(1), seq)
        assert reply.op is Op.ERROR and reply.body["code"] == "ProtocolError", reply.body
    records = [r for r in caplog.records if "has left" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info]


def test_a_compressed_push_over_its_keys_size_is_refused_before_it_is_dequantised() -> None:
    """A 1bit push declaring 8M elements of a 4-element key is a ShapeMismatchError, refused before
    the 32 MB it would dequantise to are allocated (the server's Python heap grows < 4 MB)."""
    import tracemalloc

    from kvstore.core import compression

    cluster = FakeCluster("dist_sync", 2)
    cluster.init("w", np.zeros(4, np.float32))
    n = 1 << 23
    packed = np.zeros(compression.packed_size("1bit", n), np.float32)
    tracemalloc.start()
    try:
        seq = cluster.send(0, Op.PUSH, {"keys": ["w"], "sizes": [n], "compression": ["1bit", 0.5]}, [packed])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    reply = _only(cluster.replies(0), seq)
    assert reply.op is Op.ERROR and reply.body["code"] == "ShapeMismatchError", reply.body
    assert peak < 4 << 20, peak


@pytest.mark.parametrize("order", SUM_ORDERS)
def test_a_round_abort_fails_the_waiting_pushpulls_of_a_batch_once(order: str) -> None:
    """ROUND_ABORT from worker 1 (its pushpull was refused before sending): worker 0's waiting batch
    PUSHPULL gets one ERROR naming the key and worker 1; the keys are unchanged, the next round sums."""
    cluster = FakeCluster("dist_sync", 2, KVSTORE_SUM_ORDER=order)
    cluster.init("a", np.zeros(2, np.float32))
    cluster.init("b", np.zeros(2, np.float32))
    body = {"keys": ["a", "b"], "sizes": [2, 2]}
    seq = cluster.send(0, Op.PUSHPULL, body, [np.ones(4, np.float32)])
    assert cluster.replies(0) == []
    why = "pushed value of key 'b' has shape (3,), but the key was initialised with shape (2,)"
    done = cluster.send(1, Op.ROUND_ABORT, {"keys": ["a", "b"], "reason": why})
    assert _only(cluster.replies(1), done).op is Op.OK
    error = _only(cluster.replies(0), seq)
    assert error.op is Op.ERROR and error.body["code"] == "CollectiveMismatchError"
    assert "worker 1" in error.body["message"] and "'b'" in error.body["message"]
    assert cluster.server.state.open_rounds() == 0
    seqs = [cluster.send(w, Op.PUSHPULL, body, [np.ones(4, np.float32)]) for w in (0, 1)]
    for worker, seq in zip((0, 1), seqs):
        np.testing.assert_array_equal(_only(cluster.replies(worker), seq).arrays[0], np.full(4, 2.0))


def test_a_pushpull_the_server_refuses_for_its_dtype_aborts_the_round() -> None:
    """A PUSHPULL of another dtype is refused (DTypeMismatchError to its sender) and aborts its round:
    the other worker's waiting pushpull fails, and its own later one of that round is refused too."""
    cluster = FakeCluster("dist_sync", 3)
    cluster.init("w", np.zeros(2, np.float32))
    first = _push(cluster, 0, "w", np.ones(2, np.float32), Op.PUSHPULL)
    bad = _push(cluster, 1, "w", np.ones(2, np.float64), Op.PUSHPULL)
    assert _only(cluster.replies(1), bad).body["code"] == "DTypeMismatchError"
    assert _only(cluster.replies(0), first).body["code"] == "CollectiveMismatchError"
    late = _push(cluster, 2, "w", np.ones(2, np.float32), Op.PUSHPULL)
    assert "float64" in _only(cluster.replies(2), late).body["message"]
    seqs = [_push(cluster, w, "w", np.ones(2, np.float32), Op.PUSHPULL) for w in (0, 1, 2)]
    for worker, seq in zip((0, 1, 2), seqs):
        np.testing.assert_array_equal(_only(cluster.replies(worker), seq).arrays[0], np.full(2, 3.0))


@pytest.mark.parametrize("body", [{}, {"keys": "w", "reason": "x"}, {"keys": ["w"]},
                                  {"keys": [1.5], "reason": "x"}, {"keys": [], "reason": "x"},
                                  {"keys": ["w", "elsewhere"], "reason": "x"}])
def test_a_malformed_round_abort_is_refused_and_changes_nothing(body: dict) -> None:
    """A ROUND_ABORT without keys or a reason, or with a bad key or one not held here, gets an ERROR;
    nothing is aborted."""
    cluster = FakeCluster("dist_sync", 2)
    cluster.init("w", np.zeros(2, np.float32))
    first = _push(cluster, 0, "w", np.ones(2, np.float32), Op.PUSHPULL)
    seq = cluster.send(1, Op.ROUND_ABORT, body)
    assert _only(cluster.replies(1), seq).op is Op.ERROR
    assert cluster.replies(0) == [] and cluster.server.state.open_rounds() == 1
    _push(cluster, 1, "w", np.ones(2, np.float32), Op.PUSHPULL)
    np.testing.assert_array_equal(_only(cluster.replies(0), first).arrays[0], np.full(2, 2.0))


def test_a_loads_dense_state_sets_are_settled_only_once_a_shard_holds_them(tmp_path) -> None:
    """With shards, a load's STATE_SETs (stamped with its call) are acknowledged at once but its settle
    request only once a shard holding them is written: a restart from that shard has the loaded
    state (not the state before), and one missing a set answers the settle with NodeLostError."""
    from kvstore.server.shards import read_latest
    from tests.helpers import poll_for

    cluster = FakeCluster("dist_sync", 1, KVSTORE_SNAPSHOT_EVERY="1000", KVSTORE_SNAPSHOT_DIR=str(tmp_path))
    cluster.init("w", np.ones(4, np.float32))
    spec = kvstore.optimizer.create("sgd", learning_rate=0.1, momentum=0.9).spec()
    cluster.send(0, Op.OPTIMIZER_SET, {"spec": spec, "num_update": 0})
    poll_for(lambda: cluster.server._between() or cluster.replies(0), 10, "the optimizer's shard")
    mom = np.full(4, 0.5, np.float32)
    body = {"key": "w", "count": 3, "names": ["mom"], "call": 5, "part": 0}
    seq = cluster.send(0, Op.STATE_SET, body, [mom])
    assert _only(cluster.replies(0), seq).op is Op.OK
    settle = cluster.send(0, Op.SPARSE_SET, {"settle": 5, "parts": 1})
    assert cluster.replies(0) == []  # not before a shard holds the set
    reply = poll_for(lambda: cluster.server._between() or cluster.replies(0), 10, "the settle's answer")
    assert _only(reply, settle).op is Op.OK
    image = read_latest(str(tmp_path), 0)
    assert image is not None and np.array_equal(image.keys["w"].states["mom"], mom)
    lost = cluster.send(0, Op.SPARSE_SET, {"settle": 6, "parts": 1})  # a set a restart lost
    error = _only(cluster.replies(0), lost)
    assert error.op is Op.ERROR and error.body["code"] == "NodeLostError"


@pytest.mark.parametrize("order", ["arrival", "rank"])  # a key group's batch path, the per-key path
def test_a_dist_async_push_is_recorded_in_the_shard_by_the_workers_number(order: str) -> None:
    """A dist_async server restored at a count of 3 takes a batch PUSH numbered 6 (its ``rounds``):
    the shard records 7, the worker's numbering (retries after a later restart are screened by it),
    on the key-group path as on the per-key one (review: the group path recorded 4)."""
    from tests.unit.server.fake import FakeCluster

    cluster = FakeCluster("dist_async", 1, KVSTORE_SUM_ORDER=order)
    cluster.server.state.restore("w", np.zeros(2, np.float32), 0, {0: 3})
    seq = cluster.send(0, Op.PUSH, {"keys": ["w"], "sizes": [2], "rounds": [6]}, [np.ones(2, np.float32)])
    assert [m.seq for m in cluster.replies(0)] == [seq]
    (_, _, _, applied), = cluster.server.state.applied_state()
    assert applied == {0: 7}, applied

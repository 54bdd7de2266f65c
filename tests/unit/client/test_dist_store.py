"""DistKVStore's request handling, unit-tested over the fake transport (no processes, no sockets)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.client.mux import SCHEDULER
from kvstore.client.store import DistKVStore, Joined
from kvstore.errors import (
    DeadlineExceededError,
    KeyNotInitializedError,
    NodeLostError,
    ShapeMismatchError,
    StoreClosedError,
)
from kvstore.net.protocol import Message, Op
from tests.unit.client.fake_transport import SERVERS, FakeMux, fake_config, fake_store


@pytest.fixture
def store():
    """A store over the fake transport, closed after the test."""
    kv, mux = fake_store()
    yield kv, mux
    kv.close()


def data(mux: FakeMux, op: Op) -> list[tuple[int, dict]]:
    """The (server, body) of every ``op`` message sent."""
    return [(target, msg.body) for target, msg in mux.sent if msg.op is op]


def test_the_store_takes_its_place_from_the_cluster_map(store) -> None:
    """Rank, worker and server counts come from the map it joined with; nothing is sent before a call."""
    kv, mux = store
    assert (kv.rank, kv.num_workers, kv.num_servers) == (0, 1, 2)
    assert mux.sent == []


def test_init_is_collective_and_sends_the_value_to_its_servers(store) -> None:
    """init joins two barriers around rank 0's INIT; a small key goes whole to one server, a big one
    in a slice to each server, and a pull then returns what was sent."""
    kv, mux = store
    kv.init(["w", "big"], [np.arange(4, dtype=np.float32), np.arange(3000, dtype=np.float32)])
    assert mux.ops(-1) == [Op.BARRIER, Op.BARRIER]
    inits = data(mux, Op.INIT)
    assert sorted(s for s, body in inits if "big" in body["keys"]) == [0, 1]
    assert sum(body["sizes"][body["keys"].index("big")] for _, body in inits if "big" in body["keys"]) == 3000
    np.testing.assert_array_equal(kv.pull("big"), np.arange(3000, dtype=np.float32))
    np.testing.assert_array_equal(kv.pull("w"), np.arange(4, dtype=np.float32))


def test_push_counts_each_keys_rounds_and_a_pull_reads_the_pushed_sum(store) -> None:
    """Each PUSH names the key's round (its pushes so far); repeated values are summed before sending."""
    kv, mux = store
    kv.init("w", np.zeros(4, np.float32))
    kv.push("w", np.ones(4, np.float32))
    kv.push("w", [np.ones(4, np.float32), np.full(4, 2.0, np.float32)])
    pushes = data(mux, Op.PUSH)
    assert [body["rounds"] for _, body in pushes] == [[0], [1]]
    assert [body["keys"] for _, body in pushes] == [["w"], ["w"]]
    np.testing.assert_array_equal(kv.pull("w"), np.full(4, 3.0, np.float32))


def test_a_key_split_over_two_servers_is_pushed_and_pulled_in_slices(store) -> None:
    """A big key's push sends one slice to each server, and its pull joins both replies back in order."""
    kv, mux = store
    kv.init("big", np.zeros(3000, np.float32))
    value = np.arange(3000, dtype=np.float32)
    kv.push("big", value)
    assert sorted(server for server, _ in data(mux, Op.PUSH)) == [0, 1]
    out = np.empty(3000, np.float32)
    assert kv.pull("big", out=out) is out
    np.testing.assert_array_equal(out, value)


def test_pushpull_writes_the_result_back_into_the_value(store) -> None:
    """pushpull without out sends one PUSHPULL and writes the reply into the pushed arrays in place."""
    kv, mux = store
    kv.init(["a", "b"], [np.zeros(2, np.float32), np.zeros(3, np.float32)])
    values = [np.full(2, 5.0, np.float32), np.full(3, 6.0, np.float32)]
    assert kv.pushpull(["a", "b"], values) is values
    assert Op.PUSHPULL in mux.ops() and Op.PUSH not in mux.ops()
    np.testing.assert_array_equal(values[0], np.full(2, 5.0, np.float32))
    np.testing.assert_array_equal(values[1], np.full(3, 6.0, np.float32))


def test_a_known_list_of_small_keys_takes_the_fast_path(store) -> None:
    """The second push of a list of small keys goes through its remembered plan: the same messages."""
    kv, mux = store
    kv.init(["a", "b"], [np.zeros(2, np.float32), np.zeros(2, np.float32)])
    for step in range(3):
        kv.push(["a", "b"], [np.full(2, step, np.float32)] * 2)
    assert kv._fast._lists[("a", "b")] is not None
    last = {k: r for _, body in data(mux, Op.PUSH) for k, r in zip(body["keys"], body["rounds"])}
    assert last == {"a": 2, "b": 2}
    out = [np.empty(2, np.float32), np.empty(2, np.float32)]
    kv.pull(["a", "b"], out=out)
    np.testing.assert_array_equal(out[1], np.full(2, 2.0, np.float32))


def test_a_servers_error_reply_to_a_push_is_raised_typed_by_the_next_pull(store) -> None:
    """A push the server refuses (an ERROR reply) is raised, as its own error type naming the push, by
    the key's next pull, once; the pull after that reads the value again."""
    kv, mux = store
    kv.init("w", np.zeros(4, np.float32))
    mux.refuse[Op.PUSH] = ShapeMismatchError("key 'w' holds 4 elements")
    kv.push("w", np.ones(4, np.float32))  # returns: a push does not wait
    del mux.refuse[Op.PUSH]
    with pytest.raises(ShapeMismatchError, match=r"push of key 'w' to server \d \(tcp://.*\) failed"):
        kv.pull("w")
    np.testing.assert_array_equal(kv.pull("w"), np.zeros(4, np.float32))


def test_an_error_reply_to_a_pull_is_raised_by_that_pull(store) -> None:
    """A server's error reply to a pull is raised by the pull itself, as the error type it names."""
    kv, mux = store
    kv.init("w", np.zeros(4, np.float32))
    mux.refuse[Op.PULL] = KeyNotInitializedError("no such key")
    with pytest.raises(KeyNotInitializedError, match="pull of key 'w'"):
        kv.pull("w")


def test_a_pull_whose_reply_never_comes_raises_a_deadline_naming_it() -> None:
    """With no reply, a pull raises DeadlineExceededError after KVSTORE_REQUEST_TIMEOUT, naming the key,
    the server and the knob (and, in dist_sync, why a pull may wait)."""
    kv, mux = fake_store(request_timeout=0.2)
    try:
        kv.init("w", np.zeros(4, np.float32))
        mux.silent.add(Op.PULL)
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as caught:
            kv.pull("w")
        assert time.monotonic() - started < 5.0
        text = str(caught.value)
        assert "pull of key 'w' to server" in text and "after 0.2 s (KVSTORE_REQUEST_TIMEOUT)" in text
        assert any(address in text for address in SERVERS) and "every worker has pushed" in text
    finally:
        mux.silent.clear()
        kv.close()


def test_a_lost_peer_fails_every_later_call() -> None:
    """Once the transport reports a lost node, every call raises NodeLostError naming it; close still
    tells the scheduler this worker leaves."""
    kv, mux = fake_store()
    kv.init("w", np.zeros(4, np.float32))
    mux.fail(NodeLostError("server 1 was lost", role="server", rank=1, host="10.0.0.2"))
    with pytest.raises(NodeLostError, match="server 1 was lost") as caught:
        kv.push("w", np.ones(4, np.float32))
    assert (caught.value.role, caught.value.rank) == ("server", 1)
    kv.close()
    assert mux.ops()[-1] is Op.LEAVE and mux.sent[-1][0] == -1  # to the scheduler, not the servers


def test_close_leaves_every_server_then_the_scheduler_and_refuses_later_calls() -> None:
    """close() sends LEAVE to each server after the pushes, then to the scheduler; a later call raises
    StoreClosedError, and a second close does nothing."""
    kv, mux = fake_store()
    kv.init("w", np.zeros(4, np.float32))
    kv.push("w", np.ones(4, np.float32))
    kv.close()
    leaves = [target for target, msg in mux.sent if msg.op is Op.LEAVE]
    assert leaves == [0, 1, -1]
    assert mux.ops().index(Op.PUSH) < mux.ops().index(Op.LEAVE)
    with pytest.raises(StoreClosedError):
        kv.push("w", np.ones(4, np.float32))
    kv.close()
    assert [msg.op for _, msg in mux.sent].count(Op.LEAVE) == 3


def test_the_schedulers_leave_carries_the_workers_final_counters() -> None:
    """close()'s LEAVE to the scheduler carries this worker's final snapshot (its pushes counted), so
    the scheduler holds the last interval's figures whether or not the last heartbeat is read first."""
    kv, mux = fake_store()
    kv.init("w", np.zeros(4, np.float32))
    for _ in range(3):
        kv.push("w", np.ones(4, np.float32))
    kv.close()
    (body,) = [msg.body for target, msg in mux.sent if msg.op is Op.LEAVE and target == -1]
    assert body["stats"]["role"] == "worker" and body["stats"]["ops"]["push"] == 3
    assert "failure" not in body


def test_membership_is_a_tagged_barrier_whose_reply_is_the_view(store) -> None:
    """membership(tag) joins one barrier carrying the tag; the view it returns is the reply's (the held
    slots, the barriers passed) and stays as kv.view; num_present counts it."""
    kv, mux = store
    assert kv.view.ranks == (0,) and kv.num_present == 1
    view = kv.membership((3, 120))
    assert [(t, m.body.get("tag")) for t, m in mux.sent if m.op is Op.BARRIER] == [(-1, [3, 120])]
    assert view.ranks == (0,) and view.number == 1 and view.slots == 1 and kv.view == view
    with pytest.raises(TypeError):
        kv.membership("epoch")


def test_a_joined_worker_starts_from_the_map_s_last_tagged_view() -> None:
    """A worker whose map carries the job's last view (a join, a restart) reads it, tag included, as
    kv.view before any barrier; a first worker reads the slots the map does not name absent."""
    from kvstore.client.store import joined_view

    view = joined_view({"view": {"view": 4, "left": [1], "tag": [2, 30]}, "absent": [3]}, 4)
    assert (view.number, view.ranks, view.tag) == (4, (0, 2, 3), (2, 30))
    assert joined_view({"absent": [2, 3], "barriers": 0}, 4).ranks == (0, 1)


def test_a_barrier_failed_below_min_workers_counts_as_passed(store) -> None:
    """A barrier the scheduler released with TooFewWorkersError is counted as passed: the next barrier
    says one more was passed, so the scheduler does not answer it as a repeat of the failed one."""
    from kvstore.errors import TooFewWorkersError

    kv, mux = store
    mux.refuse[Op.BARRIER] = TooFewWorkersError("the job has 1 worker(s) present")
    with pytest.raises(TooFewWorkersError):
        kv.membership()
    del mux.refuse[Op.BARRIER]
    kv.barrier()
    assert [m.body["after"] for t, m in mux.sent if m.op is Op.BARRIER] == [0, 1]


def test_a_barrier_failed_for_paired_calls_counts_as_passed(store) -> None:
    """A barrier the scheduler released with CollectiveMismatchError (a membership view paired with a
    plain barrier) is counted as passed, as every other worker it released counts it."""
    from kvstore.errors import CollectiveMismatchError

    kv, mux = store
    mux.refuse[Op.BARRIER] = CollectiveMismatchError("barrier 1 paired different calls")
    with pytest.raises(CollectiveMismatchError):
        kv.barrier()
    del mux.refuse[Op.BARRIER]
    kv.membership((1, 4))
    assert [m.body["after"] for t, m in mux.sent if m.op is Op.BARRIER] == [0, 1]


class _JoiningMux(FakeMux):
    """A FakeMux whose servers answer a REJOIN with round 0 (no round opened yet) and whose scheduler
    answers barriers with ``replies`` in turn (then the plain default)."""

    def __init__(self, replies: list[dict]) -> None:
        super().__init__(len(SERVERS))
        self.replies = replies

    def _answer(self, target: int, msg: Message) -> Message:
        if msg.op is Op.REJOIN:
            return Message(Op.OK, {"round": 0})
        if target == SCHEDULER and msg.op is Op.BARRIER and self.replies and not msg.body.get("cancel"):
            return Message(Op.OK, self.replies.pop(0))
        return super()._answer(target, msg)


def joiner(replies: list[dict]) -> tuple[DistKVStore, _JoiningMux]:
    """Worker 1 of 2 slots, joined (KVSTORE_JOIN) before the job agreed any tagged view."""
    mux = _JoiningMux(replies)
    body = {"rank": 1, "num_workers": 2, "seed": 7, "session": b"fake", "push_window": 2, "chunk_bytes": 0,
            "servers": [["10.0.0.1", 9001], ["10.0.0.2", 9002]], "rejoin": True, "join": True,
            "incarnation": 1, "barriers": 0}
    return DistKVStore("dist_sync", fake_config(join=True), joined=Joined(body, SERVERS, mux,
                                                                          heartbeat=False)), mux


def test_a_worker_joined_before_the_first_view_follows_barriers_until_one_agrees_it() -> None:
    """await_view follows the others' barriers (each marked follow, counted as passed) until a reply
    carries a tagged view, returns it (kv.view from then on) and marks the worker in at the job's
    start; called again, it returns at once."""
    plain = {"failures": [], "left": []}
    kv, mux = joiner([plain, dict(plain, digests=[[[0], "d"]]), dict(plain, view=3, tag=[0, 0])])
    try:
        assert kv.rejoined_at == 0 and not kv.view.tag and not kv.joined_at_start
        view = kv.await_view()
        sent = [m.body for t, m in mux.sent if m.op is Op.BARRIER]
        assert sent == [{"follow": True, "after": n} for n in range(3)]
        assert (view.tag, view.ranks, view.number) == ((0, 0), (0, 1), 3) and kv.view == view
        assert kv.joined_at_start
        assert kv.await_view() == view and mux.ops().count(Op.BARRIER) == 3
    finally:
        kv.close()


def test_a_first_view_that_never_comes_fails_the_wait_with_a_named_deadline() -> None:
    """While the others agree no tagged view, await_view follows their barriers until its timeout, then
    raises DeadlineExceededError naming KVSTORE_CONNECT_TIMEOUT and what it waited for."""
    kv, _ = joiner([])
    try:
        with pytest.raises(DeadlineExceededError, match="first tagged .*KVSTORE_CONNECT_TIMEOUT"):
            kv.await_view(0.2)
        assert not kv.joined_at_start
    finally:
        kv.close()

"""kvstore.client.joining: a restarted worker's rejoin progress (which servers its realigner tells
``rejoining``) and the round and step a rejoin or join takes from the servers' REJOIN replies."""

from __future__ import annotations

import pytest

from kvstore.client.joining import Rejoin
from kvstore.client.mux import Request
from kvstore.errors import ProtocolError
from kvstore.net.protocol import Op


def test_a_server_is_pending_until_it_answers_the_second_step() -> None:
    """A restart is pending with every server until that server's second REJOIN is answered; a worker
    that never restarted is pending nowhere."""
    assert not Rejoin(False).pending(0)
    progress = Rejoin(True)
    assert progress.pending(0) and progress.pending(1)  # nothing sent yet
    progress.second = {0: Request("rejoin 0"), 1: Request("rejoin 1")}
    progress.second[0].future.set_result(None)
    assert not progress.pending(0) and progress.pending(1)


def test_a_restarted_workers_tables_are_not_created_again_and_count_from_its_rejoin_round() -> None:
    """A worker restarted at round 5 (REJOIN answered 5): its init of a row-sparse table sends nothing
    (the servers hold it), its first push of the table is round 5 and its pull waits for round 6."""
    import numpy as np

    from kvstore import RowSparse
    from kvstore.client.store import DistKVStore, Joined
    from kvstore.net.protocol import Message, Op
    from tests.unit.client.fake_transport import SERVERS, FakeMux, fake_config

    class Rejoined(FakeMux):
        """Servers that answer a REJOIN with round 5 and a pull with zero rows."""

        def _answer(self, target: int, msg: Message) -> Message:
            if msg.op is Op.REJOIN:
                return Message(Op.OK, {} if "at" in msg.body else {"round": 5})
            if msg.op is Op.SPARSE_PULL:
                return Message(Op.OK, {}, [np.zeros((msg.arrays[0].size, 2), np.float32)])
            return super()._answer(target, msg)

    mux = Rejoined(len(SERVERS))
    body = {"rank": 1, "num_workers": 2, "seed": 7, "session": b"fake", "push_window": 2, "chunk_bytes": 0,
            "servers": [["10.0.0.1", 9001], ["10.0.0.2", 9002]], "rejoin": True, "incarnation": 1}
    kv = DistKVStore("dist_sync", fake_config(), joined=Joined(body, SERVERS, mux, heartbeat=False))
    try:
        assert kv.rejoined_at == 5
        kv.init("t", shape=(8, 2), dtype="float32", stype="row_sparse")
        kv.init("d", width=2, dtype="float32", dynamic=True)
        assert not {Op.SPARSE_INIT, Op.SPARSE_SET, Op.BARRIER} & set(mux.ops())
        kv.push("t", RowSparse(np.array([1, 6]), np.ones((2, 2), np.float32), shape=(8, 2)))
        kv.row_sparse_pull("t", row_ids=np.array([1]))
        kv.row_sparse_pull("d", row_ids=np.array([3]))
        pushes = [m.body["round"] for _, m in mux.sent if m.op is Op.SPARSE_PUSH]
        pulls = {m.body["key"]: m.body["after"] for _, m in mux.sent if m.op is Op.SPARSE_PULL}
        assert pushes == [5, 5] and pulls == {"t": 6, "d": 5}  # one message to each server's range
    finally:
        kv.close()


def _joined_store(replies: list[dict]):
    """A dist_async store whose map says it joined an elastic job, over servers that answer the first
    REJOIN with ``replies`` (one per server); returns (store, mux)."""
    from kvstore.client.store import DistKVStore, Joined
    from kvstore.net.protocol import Message
    from tests.unit.client.fake_transport import SERVERS, FakeMux, fake_config

    class Joining(FakeMux):
        """Servers that answer a join's first REJOIN with their round and step."""

        def _answer(self, target: int, msg: Message) -> Message:
            if msg.op is Op.REJOIN:
                return Message(Op.OK, {} if "at" in msg.body else replies[target])
            return super()._answer(target, msg)

    mux = Joining(len(SERVERS))
    body = {"rank": 2, "num_workers": 3, "seed": 7, "session": b"fake", "push_window": 2, "chunk_bytes": 0,
            "servers": [["10.0.0.1", 9001], ["10.0.0.2", 9002]], "rejoin": True, "join": True,
            "incarnation": 1}
    return DistKVStore("dist_async", fake_config(), joined=Joined(body, SERVERS, mux, heartbeat=False)), mux


def test_a_dist_async_joiner_learns_the_highest_step_and_rejoins_at_the_highest_round() -> None:
    """A join's step (``kv.rejoined_at``, the job's update count in dist_async) is the highest any
    server answered, apart from its round: the second REJOIN carries the highest round."""
    kv, mux = _joined_store([{"round": 3, "step": 40}, {"round": 2, "step": 41}])
    try:
        assert kv.rejoined_at == 41
        seconds = [m.body for _, m in mux.sent if m.op is Op.REJOIN and "at" in m.body]
        assert [b["at"] for b in seconds] == [3, 3] and all(b["join"] for b in seconds)
    finally:
        kv.close()


def test_a_rejoin_reply_with_a_bad_step_is_a_protocol_error() -> None:
    """A first REJOIN reply whose step is not an int >= 0 fails the join with ProtocolError."""
    with pytest.raises(ProtocolError, match="step"):
        _joined_store([{"round": 0, "step": -1}, {"round": 0, "step": 5}])

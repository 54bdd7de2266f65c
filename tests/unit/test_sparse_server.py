"""Unit tests of kvstore.server.sparse.SparseServer's handlers, over requests whose replies are recorded."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvstore
from kvstore.core.groups import GroupedShardState
from kvstore.core.optimizer import Optimizer
from kvstore.errors import ConfigError, ProtocolError
from kvstore.net.protocol import Message, Op
from kvstore.server import sparse as S
from kvstore.server.meter import ServerMeter
from kvstore.server.requests import Requests

pytestmark = pytest.mark.timeout(30)


class _Replies:
    """The replies a handler sent, in order (the service's only method handlers use)."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def reply(self, identity: bytes, msg: Message) -> None:
        self.sent.append(msg)


def _sparse(optimizer: Optimizer | None = None) -> tuple[S.SparseServer, _Replies]:
    """A SparseServer of a 1-worker dist_sync server with ``optimizer`` set, and its recorded replies."""
    replies = _Replies()
    requests = Requests(replies, GroupedShardState(1, sync=True), ServerMeter("", 10.0, None))
    if optimizer is not None:
        requests.set_optimizer(optimizer)
    return S.SparseServer(requests), replies


def _init(key: str, rows: int) -> Message:
    return Message(Op.SPARSE_INIT, {"key": key, "shape": [rows, 1], "dtype": "float32", "lo": 0, "hi": rows,
                                    "init": "zeros"}, seq=1, sender=0)


def test_a_table_range_is_refused_when_it_and_the_tables_held_pass_the_memory(monkeypatch) -> None:
    """SPARSE_INIT counts the row ranges a server already holds: two ranges that each fit its memory
    but not together are refused at the second (nothing allocated), not taken until the node dies."""
    monkeypatch.setattr(S, "_physical_memory", lambda: 1000)
    server, replies = _sparse()
    server.configure(1, True, 2)
    server._on_init(b"w", _init("a", 200))  # 800 bytes
    with pytest.raises(ConfigError, match="less the 800 bytes"):
        server._on_init(b"w", _init("b", 200))
    assert "b" not in server and server.nbytes() == 800
    assert [m.op for m in replies.sent] == [Op.OK]
    np.testing.assert_array_equal(server.tables.table("a").weight, 0.0)


@pytest.mark.parametrize("lo, shown", [(-1, "not -1 (int)"), (True, "not True (bool)"), (None, "not None")])
def test_a_bad_int_field_is_named_with_its_value(lo, shown) -> None:
    """A SPARSE_INIT whose 'lo' is negative, a bool or missing is refused with an error that shows
    the value sent (a negative int used to read 'must be an int >= 0, not int')."""
    server, replies = _sparse()
    server.configure(1, True, 2)
    msg = _init("a", 4)
    msg.body["lo"] = lo
    with pytest.raises(ProtocolError, match=re.escape(f"field 'lo' must be an int in [0, 2**63), {shown}")):
        server._on_init(b"w", msg)
    assert "a" not in server and replies.sent == []


@pytest.mark.parametrize("state, count", [(["mean"], 1), ({"n": 1}, 1), ("mean", 2**64 - 1), ("mean", 2**63)])
def test_a_state_set_with_a_bad_name_or_count_is_refused_and_changes_nothing(state, count) -> None:
    """SPARSE_SET of a state whose name is not a str, or whose count does not fit int64 (it would
    become num_update and break every later reply that carries it), is a ProtocolError; the
    optimizer keeps no state, count or num_update from it."""
    opt = kvstore.optimizer.create("adam", learning_rate=0.1)
    server, _ = _sparse(opt)
    server.configure(1, True, 2)
    server._on_init(b"w", _init("a", 4))
    ids, rows = np.array([1, 2], np.int64), np.ones((2, 1), np.float32)
    msg = Message(Op.SPARSE_SET, {"key": "a", "state": state, "count": count}, [ids, rows], seq=2, sender=0)
    with pytest.raises(ProtocolError, match="'state' must be a state's name|'count' must be an int"):
        server._on_set(b"w", msg)
    assert opt.states == {} and opt.counts == {} and opt.num_update == 0


def _dynamic_init(key: str, **spec) -> Message:
    return Message(Op.SPARSE_INIT, {"key": key, "shape": [2], "dtype": "float32", "init": "zeros",
                                    "dynamic": spec}, seq=1, sender=0)


def test_a_dynamic_table_is_made_on_first_touch_and_held_at_its_capacity() -> None:
    """SPARSE_INIT with ``dynamic`` holds no rows; pushes make rows (any int64 id) up to the capacity,
    a pull of ids never pushed answers zeros without storing them unless it says admit."""
    server, replies = _sparse()
    server.configure(1, True, 4)
    server._on_init(b"w", _dynamic_init("d", capacity=2))
    assert server.dynamic_stats()["d"]["rows"] == 0
    for rnd, ids in enumerate(([-9, 5], [2**62])):
        ids = np.array(ids, np.int64)
        server._on_push(b"w", Message(Op.SPARSE_PUSH, {"key": "d", "round": rnd, "last": True},
                                      [ids, np.ones((ids.size, 2), np.float32)], seq=2, sender=0))
    stats = server.dynamic_stats()["d"]
    assert stats["rows"] == 2 and stats["evictions"] == 1
    pull = Message(Op.SPARSE_PULL, {"key": "d", "after": 2}, [np.array([3, 2**62], np.int64)], seq=3,
                   sender=0)
    server._on_pull(b"w", pull)
    np.testing.assert_array_equal(replies.sent[-1].arrays[0], [[0, 0], [1, 1]])
    assert server.dynamic_stats()["d"]["rows"] == 2 and server.dynamic_stats()["d"]["pull_hits"] == 1
    with pytest.raises(ProtocolError, match="sorted and distinct"):
        server._on_pull(b"w", Message(Op.SPARSE_PULL, {"key": "d", "after": 2}, [np.array([4, 3], np.int64)],
                                      seq=4, sender=0))
    with pytest.raises(ProtocolError, match="dynamic"):
        server._on_init(b"w", _dynamic_init("e", capacity=-1))


def test_a_dynamic_tables_capacity_beyond_the_memory_is_refused(monkeypatch) -> None:
    """SPARSE_INIT of a dynamic table whose capacity could not fit this server's memory is refused
    (ConfigError), nothing held; one without a capacity is taken."""
    monkeypatch.setattr(S, "_physical_memory", lambda: 10_000)
    server, _ = _sparse()
    server.configure(1, True, 2)
    with pytest.raises(ConfigError, match="lower its capacity"):
        server._on_init(b"w", _dynamic_init("big", capacity=1000))
    assert "big" not in server
    server._on_init(b"w", _dynamic_init("open"))
    assert "open" in server


def test_a_servers_dynamic_counters_reach_its_snapshot_and_tensorboard_tags() -> None:
    """The meter copies the tables' counters at its tick into the snapshot's dynamic_tables, which
    node_scalars flattens into dynamic_tables/<key>/<counter> tags; a server without them has none."""
    from kvstore.core.scalars import node_scalars

    meter = ServerMeter("", 10.0, None)
    state = GroupedShardState(1, sync=True)
    assert "dynamic_tables" not in meter.snapshot()
    meter.extra_tables = lambda: {"emb": {"rows": 3, "evictions": 2, "hit_rate": 0.5}}
    meter.tick(state, lambda key, error: None, {})
    snap = meter.snapshot()
    assert snap["dynamic_tables"] == {"emb": {"rows": 3, "evictions": 2, "hit_rate": 0.5}}
    tags = node_scalars(snap)
    assert tags["dynamic_tables/emb/rows"] == 3 and tags["dynamic_tables/emb/hit_rate"] == 0.5

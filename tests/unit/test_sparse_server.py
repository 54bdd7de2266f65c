"""Unit tests of kvstore.server.sparse.SparseServer's handlers, over requests whose replies are recorded."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvstore
from kvstore.core.groups import GroupedShardState
from kvstore.core.optimizer import Optimizer
from kvstore.errors import ConfigError, NodeLostError, ProtocolError
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


def test_a_server_row_made_by_an_admitting_pull_starts_with_fresh_momentum() -> None:
    """SPARSE_PULL admit=True reusing an evicted row's slot, then SPARSE_PUSH of a zero gradient: the
    new row starts with fresh momentum and stays at its initial value."""
    server, replies = _sparse(kvstore.optimizer.create("sgd", learning_rate=1.0, momentum=0.9))
    server.configure(1, True, 8)
    server._on_init(b"w", _dynamic_init("d", capacity=1))

    def push(rnd: int, id_: int, value: float) -> None:
        server._on_push(b"w", Message(Op.SPARSE_PUSH, {"key": "d", "round": rnd, "last": True},
                                      [np.array([id_], np.int64), np.full((1, 2), value, np.float32)],
                                      seq=10 + rnd, sender=0))

    for rnd in range(3):
        push(rnd, 1, 1.0)
    server._on_pull(b"w", Message(Op.SPARSE_PULL, {"key": "d", "after": 3, "admit": True},
                                  [np.array([2], np.int64)], seq=20, sender=0))
    push(3, 2, 0.0)
    server._on_pull(b"w", Message(Op.SPARSE_PULL, {"key": "d", "after": 4}, [np.array([2], np.int64)],
                                  seq=21, sender=0))
    np.testing.assert_array_equal(replies.sent[-1].arrays[0], 0.0)


def test_a_dynamic_capacity_the_server_accepts_fits_its_memory_when_full(monkeypatch) -> None:
    """The SPARSE_INIT memory check counts a full table's rows, slot counters, id map and optimizer
    state (adam's two moments): a capacity over the memory is refused, and one accepted at the exact
    memory, filled, holds no more than it."""
    from kvstore.core import dynamic as D
    from kvstore.core import rowsparse as R

    def init(memory: int) -> S.SparseServer:
        monkeypatch.setattr(S, "_physical_memory", lambda: memory)
        server, _ = _sparse(kvstore.optimizer.create("adam", learning_rate=0.1))
        server.configure(1, True, 4)
        server._on_init(b"w", Message(Op.SPARSE_INIT, {"key": "d", "shape": [16], "dtype": "float32",
                                                        "init": "zeros", "dynamic": {"capacity": 2000}},
                                      seq=1, sender=0))
        return server

    with pytest.raises(ConfigError, match="lower its capacity"):
        init(200_000)  # the rows alone (128,000 bytes) fit; with adam's state they do not
    need = D.full_bytes(R.DynamicSpec(capacity=2000), 16, np.dtype(np.float32), 2 * 16 * 4)
    server = init(need)
    ids = np.arange(2000, dtype=np.int64)
    server._on_push(b"w", Message(Op.SPARSE_PUSH, {"key": "d", "round": 0, "last": True},
                                  [ids, np.ones((2000, 16), np.float32)], seq=2, sender=0))
    assert server.dynamic_stats()["d"]["rows"] == 2000
    assert server.nbytes() <= need, (server.nbytes(), need)


def test_a_dynamic_tables_admission_counts_count_at_init(monkeypatch) -> None:
    """With admit_after > 1 the memory check also counts the admission counts at their bound."""
    from kvstore.core import dynamic as D
    from kvstore.core.rowsparse import DynamicSpec

    rows = D.full_bytes(DynamicSpec(capacity=10), 2, np.dtype(np.float32))
    counted = D.full_bytes(DynamicSpec(capacity=10, admit_after=2), 2, np.dtype(np.float32))
    assert counted == rows + D.PENDING_MIN * D.PENDING_BYTES
    monkeypatch.setattr(S, "_physical_memory", lambda: counted - 1)
    server, _ = _sparse()
    server.configure(1, True, 2)
    with pytest.raises(ConfigError, match="lower its capacity"):
        server._on_init(b"w", _dynamic_init("b", capacity=10, admit_after=2))
    server._on_init(b"w", _dynamic_init("a", capacity=10))
    assert "a" in server and "b" not in server


def _checked_snapshot(tables: dict) -> dict:
    """The snapshot of a meter whose server holds dynamic tables of these counters, as the scheduler
    checks it (ValueError if it would refuse it)."""
    from kvstore.core.stats import check_snapshot

    meter = ServerMeter("", 10.0, None)
    meter.extra_tables = lambda: tables
    meter.tick(GroupedShardState(1, sync=True), lambda key, error: None, {})
    snap = meter.snapshot()
    check_snapshot(snap, "server", meter.rank)
    return snap


def test_a_long_dynamic_key_does_not_cost_the_server_its_whole_snapshot() -> None:
    """A dynamic table named by a str over 1,024 characters (MAX_TEXT) is reported under a cut name
    with a hash, and the snapshot passes the scheduler's check; two long names stay apart."""
    snap = _checked_snapshot({"k" * 2000: {"rows": 1}, "k" * 1999: {"rows": 2}})
    names = list(snap["dynamic_tables"])
    assert len(names) == 2 and all(len(n) <= 64 and n.startswith("kkk") for n in names)
    assert sorted(t["rows"] for t in snap["dynamic_tables"].values()) == [1, 2]


def test_thirty_two_dynamic_tables_with_long_keys_fit_the_snapshot() -> None:
    """32 tables (MAX_TABLES) of 500-character keys with every counter fit the 64 KiB snapshot."""
    from kvstore.core import rowsparse as R
    from kvstore.core.dynamic import DynamicRows

    full = DynamicRows(2, np.dtype(np.float32), R.parse_init("d", "zeros"), R.DynamicSpec()).stats()
    snap = _checked_snapshot({f"{i:03d}" + "k" * 497: dict(full) for i in range(32)})
    assert len(snap["dynamic_tables"]) == 32


def test_an_int_key_and_its_str_keep_their_own_counters() -> None:
    """Dynamic tables 3 and '3' are two tables with two labels ('int:3' and '3') in the counters."""
    server, _ = _sparse()
    server.configure(1, True, 4)
    for key in (3, "3"):
        server._on_init(b"w", _dynamic_init(key, capacity=2 if key == 3 else 5))
    stats = server.dynamic_stats()
    assert stats["int:3"]["capacity"] == 2 and stats["3"]["capacity"] == 5


def test_a_quantised_row_push_is_dequantised_and_a_bad_one_refused_with_nothing_applied() -> None:
    """A SPARSE_PUSH whose rows are 2bit words (``quantised``) stores the rows they stand for; a bad
    field, a wrong word count or a wire dtype other than float32 is a ProtocolError and applies nothing."""
    from kvstore.core import compression as C

    server, _ = _sparse()
    server.configure(1, True, 4)
    server._on_init(b"w", _dynamic_init("d"))
    ids = np.array([4, 9], np.int64)
    residual = np.zeros(4, np.float32)
    packed = C.quantise("2bit", np.array([0.7, -0.6, 0.2, 1.0], np.float32), residual, 0.5)
    body = {"key": "d", "round": 0, "last": True, "quantised": ["2bit", 0.5]}
    for bad_body, words in [({**body, "quantised": ["2bit", 0.0]}, packed),
                            ({**body, "quantised": ["fp16", 0.5]}, packed),
                            ({**body, "quantised": "2bit"}, packed),
                            (body, np.concatenate([packed, packed])),
                            (body, packed.view(np.int32))]:
        with pytest.raises(ProtocolError):
            server._on_push(b"w", Message(Op.SPARSE_PUSH, bad_body, [ids, words], seq=2, sender=0))
    assert server.dynamic_stats()["d"]["rows"] == 0
    server._on_push(b"w", Message(Op.SPARSE_PUSH, body, [ids, packed], seq=2, sender=0))
    server._on_pull(b"w", Message(Op.SPARSE_PULL, {"key": "d", "after": 1}, [ids], seq=3, sender=0))


def test_a_round_of_raw_and_quantised_chunks_with_disjoint_ids_applies_once_with_both() -> None:
    """A worker's round may carry rows its 2bit residuals had no room for as a plain float32 chunk
    (``last`` False) beside a quantised chunk (``last`` True) of other, interleaved ids: nothing is
    applied before the last chunk, then both chunks' rows are, exactly (the raw ones as sent)."""
    from kvstore.core import compression as C

    server, replies = _sparse()
    server.configure(1, True, 4)
    server._on_init(b"w", _dynamic_init("d"))
    replies.sent.clear()
    raw_ids, raw = np.array([4, 9], np.int64), np.array([[0.3, -0.1], [0.25, 2.0]], np.float32)
    q_ids = np.array([5, 7], np.int64)
    packed = C.quantise("2bit", np.array([0.7, -0.6, 0.2, 1.0], np.float32), np.zeros(4, np.float32), 0.5)
    server._on_push(b"w", Message(Op.SPARSE_PUSH, {"key": "d", "round": 0, "last": False},
                                  [raw_ids, raw], seq=2, sender=0))
    assert server.dynamic_stats()["d"]["rows"] == 0 and replies.sent == []
    body = {"key": "d", "round": 0, "last": True, "quantised": ["2bit", 0.5]}
    server._on_push(b"w", Message(Op.SPARSE_PUSH, body, [q_ids, packed], seq=3, sender=0))
    assert [m.op for m in replies.sent] == [Op.OK, Op.OK]
    ids = np.array([4, 5, 7, 9], np.int64)
    server._on_pull(b"w", Message(Op.SPARSE_PULL, {"key": "d", "after": 1}, [ids], seq=4, sender=0))
    np.testing.assert_array_equal(replies.sent[-1].arrays[0],
                                  np.array([[0.3, -0.1], [0.5, -0.5], [0, 0.5], [0.25, 2.0]], np.float32))


def test_the_server_takes_an_empty_quantised_push_and_applies_the_round() -> None:
    """An empty 2bit SPARSE_PUSH (0 ids, 0 words: a server given none of a push's ids) closes its round."""
    server, replies = _sparse()
    server.configure(1, True, 4)
    server._on_init(b"w", _dynamic_init("d"))
    body = {"key": "d", "round": 0, "last": True, "quantised": ["2bit", 0.5]}
    server._on_push(b"w", Message(Op.SPARSE_PUSH, body, [np.zeros(0, np.int64), np.zeros(0, np.float32)],
                                  seq=2, sender=0))
    assert replies.sent[-1].op == Op.OK
    server._on_pull(b"w", Message(Op.SPARSE_PULL, {"key": "d", "after": 1}, [np.array([3], np.int64)],
                                  seq=3, sender=0))
    np.testing.assert_array_equal(replies.sent[-1].arrays[0], [[0, 0]])


def _set(key: str, rows: list[int], value: float, call: int, part: int, seq: int) -> Message:
    ids = np.array(rows, np.int64)
    return Message(Op.SPARSE_SET, {"key": key, "call": call, "part": part},
                   [ids, np.full((ids.size, 1), value, np.float32)], seq=seq, sender=0)


def test_a_settle_is_answered_through_the_settle_hook_once_every_set_of_its_call_was_taken() -> None:
    """The sets of an init count for their call; its settle goes to the server's settle hook (which
    answers it once a shard holds them) with the sets taken so far, and is a NodeLostError when a part
    is missing (a restart lost it), forgetting the call either way."""
    server, replies = _sparse()
    server.configure(1, True, 2)
    server._on_init(b"w", _init("a", 4))
    settled = []
    server.settle = lambda identity, seq, sets, call: settled.append((seq, sets, call))
    server._on_set(b"w", _set("a", [0, 1], 2.0, call=7, part=0, seq=2))
    server._on_set(b"w", _set("a", [2, 3], 3.0, call=7, part=1, seq=3))
    assert server.tables.sets == 2 and server.tables.calls == {(0, 7): {0, 1}}
    server._on_set(b"w", Message(Op.SPARSE_SET, {"settle": 7, "parts": 2}, seq=4, sender=0))
    assert settled == [(4, 2, (0, 7))]
    server._on_set(b"w", _set("a", [0], 5.0, call=8, part=1, seq=5))  # part 0 of call 8 lost
    with pytest.raises(NodeLostError, match="lost in its restart"):
        server._on_set(b"w", Message(Op.SPARSE_SET, {"settle": 8, "parts": 2}, seq=6, sender=0))
    assert (0, 8) not in server.tables.calls and len(settled) == 1
    np.testing.assert_array_equal(server.tables.table("a").weight[:, 0], [5.0, 2.0, 3.0, 3.0])
    assert [m.seq for m in replies.sent] == [1, 2, 3, 5]  # the settle is the hook's to answer

"""Unit tests of kvstore.server.restore's pure parts: an ALIGN body's checks, a restart's shard choice."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kvstore import config
from kvstore.core.groups import GroupedShardState
from kvstore.core.rejoin import Rejoins
from kvstore.core.shard_image import KeyImage, ShardImage
from kvstore.errors import ConfigError, ProtocolError
from kvstore.net.protocol import Message, Op
from kvstore.server.meter import ServerMeter
from kvstore.server.requests import Requests
from kvstore.server.restore import Restored, _align_body, read_image


def test_a_well_formed_align_is_read() -> None:
    """incarnation, origin, keys and one round per key."""
    body = {"incarnation": 1, "origin": 4, "keys": ["a", 3], "rounds": [2, 0]}
    assert _align_body(body) == (1, 4, ["a", 3], [2, 0])


@pytest.mark.parametrize("body", [
    {}, {"incarnation": -1, "origin": 0, "keys": [], "rounds": []},
    {"incarnation": 0, "origin": True, "keys": [], "rounds": []},
    {"incarnation": 0, "origin": 0, "keys": ["a"], "rounds": []},
    {"incarnation": 0, "origin": 0, "keys": ["a"], "rounds": [-1]},
    {"incarnation": 0, "origin": 0, "keys": ["a"], "rounds": [1.5]},
    {"incarnation": 0, "origin": 0, "keys": [[1]], "rounds": [1]},
    {"incarnation": 0, "origin": 0, "keys": "ab", "rounds": [1, 2]},
])
def test_a_malformed_align_is_a_protocol_error(body: dict) -> None:
    """Anything else is refused with ProtocolError (the server answers it and changes nothing)."""
    with pytest.raises(ProtocolError):
        _align_body(body)


def test_a_first_start_reads_no_shard_and_a_restart_needs_one(tmp_path) -> None:
    """Incarnation 0: None; a restart without a rank, a folder or a shard: ConfigError naming it."""
    base = {"DMLC_ROLE": "server", "KVSTORE_SNAPSHOT_DIR": str(tmp_path), "KVSTORE_SERVER_ID": "1"}
    assert read_image(config.load(base)) is None
    with pytest.raises(ConfigError, match="no shard"):
        read_image(config.load({**base, "KVSTORE_INCARNATION": "1"}))
    with pytest.raises(ConfigError, match="KVSTORE_SERVER_ID"):
        read_image(config.load({"DMLC_ROLE": "server", "KVSTORE_INCARNATION": "1"}))


class _Service:
    """Records the replies a Restored sends."""

    def __init__(self) -> None:
        self.replies: list[Message] = []

    def reply(self, identity: bytes, msg: Message) -> None:
        self.replies.append(msg)


def _requests(state: GroupedShardState, service: _Service | None = None) -> Requests:
    """The requests object of a server over ``state`` whose replies ``service`` records."""
    return Requests(service or _Service(), state, ServerMeter("", 10.0, None))


def _restored(cmap: dict, service: _Service | None = None) -> Restored:
    """A dist_sync server of 2 workers restarted from a shard holding key 'k' at round 3."""
    state = GroupedShardState(2, sync=True)
    image = ShardImage(rank=0, number=1, mode="dist_sync", num_workers=2, optimizer=None, num_update=0,
                       keys={"k": KeyImage(np.zeros(2, np.float32), 3, {0: 3, 1: 3})}, session="s")
    return Restored(_requests(state, service), Rejoins(state), image, cmap, "s")


@pytest.mark.parametrize("cmap", [{"left": [0], "away": [1]}, {"away": [0, 1]}])
def test_a_restart_no_worker_must_align_with_is_aligned_at_once(cmap: dict) -> None:
    """With every worker left or away when the server restarts, nobody will send ALIGN: it is aligned
    at once (from the shard's rounds), so a restarted worker's REJOIN is not refused forever."""
    restored = _restored(cmap)
    assert restored.done and restored.floors == {"k": 3}


def test_a_restart_is_aligned_once_the_last_worker_it_waits_for_goes() -> None:
    """The one worker it waited for goes away before sending ALIGN: the restart is aligned then."""
    restored = _restored({"left": [0]})
    assert not restored.done
    restored.forget(1)
    assert restored.done and restored.floors == {"k": 3}


def test_a_restart_keeps_no_second_copy_of_the_shards_values() -> None:
    """The shard's arrays are copied into the server's state: the restart then lets them go (its memory
    stays one copy of its keys), keeping only the rounds and counts it screens retried pushes with."""
    value = np.zeros(1 << 16, np.float32)
    gone = weakref.ref(value)
    state = GroupedShardState(2, sync=False)
    image = ShardImage(rank=0, number=1, mode="dist_async", num_workers=2, optimizer=None, num_update=0,
                       keys={"k": KeyImage(value, 0, {0: 3})}, session="s")
    del value
    restored = Restored(_requests(state), Rejoins(state), image, {}, "s")
    gc.collect()
    assert gone() is None
    assert restored.image.keys["k"].applied == {0: 3} and state.value("k").size == 1 << 16


def test_an_align_after_the_alignment_is_answered_and_changes_nothing() -> None:
    """Once aligned, another ALIGN (a duplicate, or another origin) is answered with what was lost and
    leaves the worker's origin (which screens its pushes) and counted incarnation as they were."""
    service = _Service()
    restored = _restored({"left": [0]}, service)
    align = Message(Op.ALIGN, {"incarnation": 0, "origin": 0, "keys": ["k"], "rounds": [3]}, seq=1)
    align.sender = 1
    restored.on_align(b"w1", align)
    assert restored.done and restored.origins == {1: 0}
    again = Message(Op.ALIGN, {"incarnation": 5, "origin": 9, "keys": ["k"], "rounds": [0]}, seq=2)
    again.sender = 1
    restored.on_align(b"w1", again)
    assert restored.origins == {1: 0} and restored.rejoins.current.get(1, 0) == 0
    assert [m.body["lost"] for m in service.replies] == [0, 0]


def test_the_server_die_hook_is_installed_only_when_its_variable_is_set(tmp_path) -> None:
    """KVSTORE_TEST_SERVER_DIE_AT_ROUND: no hook at all unless set for this rank's first incarnation
    with shards; an installed hook does nothing before a shard is written and its round is reached."""
    from kvstore.server.restore import die_hook
    from kvstore.server.shards import ShardWriter

    state = GroupedShardState(1, sync=True)
    shards = ShardWriter(str(tmp_path), 0, rounds=1)
    base = {"DMLC_ROLE": "server"}
    assert die_hook(config.load(base), 0, state, shards) is None
    armed = {**base, "KVSTORE_TEST_SERVER_DIE_AT_ROUND": "0:3"}
    assert die_hook(config.load({**armed, "KVSTORE_INCARNATION": "1"}), 0, state, shards) is None
    assert die_hook(config.load(armed), 1, state, shards) is None  # another server's rank
    assert die_hook(config.load(armed), 0, state, None) is None    # no shards: nothing to restart from
    hook = die_hook(config.load(armed), 0, state, shards)
    assert hook is not None
    hook()  # no shard written, no round closed: it returns


def test_a_rejoining_workers_align_leaves_it_away_until_its_rejoin() -> None:
    """A restarted worker that aligns before its REJOIN reached this server (``rejoining``): the alignment
    does not wait for it, it is not counted (its REJOIN, sent after, is not refused as a repeat), and
    its REJOIN's second step alone counts it from ``at``."""
    service = _Service()
    restored = _restored({}, service)
    align = Message(Op.ALIGN, {"incarnation": 1, "origin": 0, "keys": [], "rounds": [], "rejoining": True},
                    seq=1)
    align.sender = 1
    restored.on_align(b"w1", align)
    state = restored.requests.state
    assert not restored.done and restored.expected == {0}  # still waits for worker 0
    assert 1 not in state.active and restored.rejoins.current.get(1, 0) == 0
    other = Message(Op.ALIGN, {"incarnation": 0, "origin": 0, "keys": ["k"], "rounds": [3]}, seq=2)
    other.sender = 0
    restored.on_align(b"w0", other)
    assert restored.done and len(service.replies) == 2
    assert restored.rejoins.join_at(1, 1, 3) == [] and 1 in state.active


def test_an_align_whose_rejoining_is_not_a_bool_is_refused() -> None:
    """``rejoining`` other than a bool: ProtocolError, nothing recorded."""
    restored = _restored({})
    body = {"incarnation": 1, "origin": 0, "keys": [], "rounds": [], "rejoining": 1}
    align = Message(Op.ALIGN, body, seq=1)
    align.sender = 1
    with pytest.raises(ProtocolError, match="rejoining"):
        restored.on_align(b"w1", align)
    assert restored.waiting == [] and restored.expected == {0, 1}


def test_a_restarted_servers_tables_go_on_from_the_workers_oldest_unanswered_round(caplog) -> None:
    """A shard's row-sparse table (at round 3) is installed into the server's tables; once both workers
    have aligned (their oldest unanswered pushes of it at rounds 5 and 4), it goes on from round 5,
    its loss (rounds 3 to 4) is logged by name, and a retried push of round 4 is acked, not applied."""
    from kvstore.core.sparse_shard import RowTables
    from kvstore.core.table_image import TableImage

    state = GroupedShardState(2, sync=True)
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    image = ShardImage(rank=0, number=2, mode="dist_sync", num_workers=2, optimizer=None, num_update=0,
                       keys={}, session="s",
                       tables={"t": TableImage((8, 2), rows.copy(), 3, {}, None, {}, 4, 8)})
    tables = RowTables(2, True, window=4)
    service = _Service()
    restored = Restored(_requests(state, service), Rejoins(state), image, {}, "s", tables)
    assert np.array_equal(tables.table("t").weight, rows) and tables.table("t").applied == 3
    for worker, low in ((0, 5), (1, 4)):
        align = Message(Op.ALIGN, {"incarnation": 0, "origin": 0, "keys": ["t"], "rounds": [low]}, seq=worker)
        align.sender = worker
        with caplog.at_level("WARNING", logger="kvstore.server"):
            restored.on_align(b"w", align)
    assert restored.done and tables.table("t").applied == 5
    assert [m.body["lost"] for m in service.replies] == [2, 2]
    assert "row_sparse key 't' restored at round 3 from shard 2: lost 2 rounds of updates (rounds 3 to 4)" \
        in caplog.text
    done = tables.push(1, "t", 4, True, np.array([4], np.int64), np.ones((1, 2), np.float32), "retry")
    assert [c.token for c in done] == ["retry"] and np.array_equal(tables.table("t").weight, rows)


def test_a_new_member_of_a_left_slot_is_not_screened_as_its_predecessors_retries() -> None:
    """dist_async, restarted from a shard in which slot 1's earlier member (left since) had 3 pushes
    applied: a new member that joins slot 1 numbers its pushes on from the slot's count (the round its
    REJOIN answered), so its first push is applied, not dropped as a retry of the old member's."""
    state = GroupedShardState(2, sync=False)
    image = ShardImage(rank=0, number=1, mode="dist_async", num_workers=2, optimizer=None, num_update=0,
                       keys={"k": KeyImage(np.zeros(2, np.float32), 0, {0: 5, 1: 3})}, session="s")
    restored = Restored(_requests(state), Rejoins(state), image, {"left": [1]}, "s")
    first, _ = restored.rejoins.begin(1, 1, joining=True)
    assert (first, restored.rejoins.step(first, joining=True)) == (3, 8)
    restored.rejoins.join_at(1, 1, first, joining=True)
    restored.rejoined(1, first)
    push = Message(Op.PUSH, {"keys": ["k"], "rounds": [0]})
    push.sender = 1
    assert restored.screen(push) == set()  # its push number 0 is the slot's 4th push: new
    restored.rejoined(1, 0)  # had it numbered from 0, the old member's count would drop it
    assert restored.screen(push) == {0}

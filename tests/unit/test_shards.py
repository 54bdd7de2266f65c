"""Unit tests of kvstore.server.shards and its settings: when a shard is due, what is kept on disk,
how a damaged newest shard is skipped, and KVSTORE_SNAPSHOT_EVERY's forms."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore import config
from kvstore.core.shard import ShardState
from kvstore.errors import ConfigError, FormatError
from kvstore.server.shards import ShardWriter, read_latest, shard_files, shard_writer


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def closed(shard: ShardState, rounds: int) -> None:
    """Close ``rounds`` more rounds of key 'w' of a one-worker dist_sync shard."""
    for _ in range(rounds):
        shard.push(None, 0, "w", np.ones(2))


def written(writer: ShardWriter) -> None:
    """Wait (bounded) for the write in flight."""
    writer.close(10)
    assert not writer.thread.is_alive()


def first_shard(writer: ShardWriter, shard: ShardState) -> None:
    """A fresh server's first shard, due at its first tick whatever its keys and rounds."""
    assert writer.tick(shard, None, set())
    written(writer)


def test_a_shard_is_due_every_n_rounds_and_only_two_are_kept(tmp_path) -> None:
    """Every 3 rounds after the first shard: nothing before round 3, then shards 2..5 of which 4 and 5
    stay on disk."""
    clock, shard = Clock(), ShardState(1, sync=True)
    shard.init("w", np.zeros(2))
    writer = ShardWriter(str(tmp_path), 0, rounds=3, clock=clock)
    first_shard(writer, shard)
    closed(shard, 2)
    clock.now += 1
    assert not writer.tick(shard, None, set())
    for _ in range(4):
        closed(shard, 3)
        clock.now += 1
        assert writer.tick(shard, None, set())
        written(writer)
    assert [n for n, _ in shard_files(str(tmp_path), 0)] == [4, 5] and writer.written == 5
    image = read_latest(str(tmp_path), 0)
    assert image.keys["w"].round == 14 and image.number == 5
    np.testing.assert_array_equal(image.keys["w"].value, [1, 1])  # no optimizer: the last round's sum


def test_a_shard_is_due_every_n_seconds(tmp_path) -> None:
    """Every 2 s after the first shard: not 1 s later, 2 s later, and a restarted writer numbers on from
    the files it finds."""
    clock, shard = Clock(), ShardState(1, sync=False)
    shard.init("w", np.zeros(2))
    writer = ShardWriter(str(tmp_path), 5, seconds=2.0, clock=clock)
    first_shard(writer, shard)
    clock.now = 1.0
    assert not writer.tick(shard, None, set())
    clock.now = 2.0
    assert writer.tick(shard, None, set())
    written(writer)
    assert ShardWriter(str(tmp_path), 5, seconds=2.0, clock=clock).number == 2


def test_a_fresh_servers_first_shard_is_due_at_once_even_with_no_key(tmp_path) -> None:
    """A server that holds no key writes shard 1 (empty) at its first tick, so it can be restarted;
    a fresh server with keys writes them at once too (no waiting for rounds)."""
    clock = Clock()
    empty = ShardWriter(str(tmp_path), 0, rounds=50, clock=clock)
    first_shard(empty, ShardState(1, sync=True))
    assert read_latest(str(tmp_path), 0).keys == {}
    clock.now += 1
    assert not empty.tick(ShardState(1, sync=True), None, set())  # no rounds, no keys since
    held = ShardState(1, sync=True)
    held.init("w", np.full(2, 3.0))
    first_shard(ShardWriter(str(tmp_path), 1, rounds=50, clock=clock), held)
    np.testing.assert_array_equal(read_latest(str(tmp_path), 1).keys["w"].value, [3, 3])


def test_a_damaged_newest_shard_is_skipped_for_the_one_before(tmp_path) -> None:
    """The newest shard (3) cut short: read_latest gives shard 2; with that damaged too, FormatError."""
    clock, shard = Clock(), ShardState(1, sync=True)
    shard.init("w", np.zeros(2))
    writer = ShardWriter(str(tmp_path), 0, rounds=1, clock=clock)
    first_shard(writer, shard)
    for _ in range(2):
        closed(shard, 1)
        clock.now += 1
        writer.tick(shard, None, set())
        written(writer)
    (_, first), (_, second) = shard_files(str(tmp_path), 0)
    os.truncate(second, 100)
    assert read_latest(str(tmp_path), 0).number == 2
    os.truncate(first, 100)
    with pytest.raises(FormatError, match="no readable shard of server 0"):
        read_latest(str(tmp_path), 0)
    assert read_latest(str(tmp_path), 1) is None


@pytest.mark.parametrize("raw, rounds, seconds", [("5", 5, 0.0), ("2.5s", 0, 2.5)])
def test_snapshot_every_takes_rounds_or_seconds(raw: str, rounds: int, seconds: float) -> None:
    """KVSTORE_SNAPSHOT_EVERY=N is rounds, Ns seconds; both need KVSTORE_SNAPSHOT_DIR."""
    cfg = config.load({"KVSTORE_SNAPSHOT_EVERY": raw, "KVSTORE_SNAPSHOT_DIR": "/x"})
    assert (cfg.snapshot_rounds, cfg.snapshot_seconds, cfg.snapshot_dir) == (rounds, seconds, "/x")


@pytest.mark.parametrize("env", [{"KVSTORE_SNAPSHOT_EVERY": "0", "KVSTORE_SNAPSHOT_DIR": "/x"},
                                 {"KVSTORE_SNAPSHOT_EVERY": "often", "KVSTORE_SNAPSHOT_DIR": "/x"},
                                 {"KVSTORE_SNAPSHOT_EVERY": "5"}])
def test_a_bad_snapshot_period_or_a_missing_folder_is_a_config_error(env: dict) -> None:
    """Zero, words, or a period without a folder: ConfigError naming the variable."""
    with pytest.raises(ConfigError, match="KVSTORE_SNAPSHOT"):
        config.load(env)


def test_a_shard_folder_that_cannot_be_made_is_a_config_error(tmp_path) -> None:
    """KVSTORE_SNAPSHOT_DIR under a file: ConfigError naming the variable, not a bare OSError."""
    (tmp_path / "file").write_text("x")
    cfg = config.load({"KVSTORE_SNAPSHOT_EVERY": "3", "KVSTORE_SNAPSHOT_DIR": str(tmp_path / "file")})
    with pytest.raises(ConfigError, match="KVSTORE_SNAPSHOT_DIR"):
        shard_writer(cfg, 0)
    assert shard_writer(config.load({}), 0) is None


def test_a_shard_records_its_cluster_session(tmp_path) -> None:
    """The writer's session is in every shard it writes and read back (a restart checks it)."""
    clock, shard = Clock(), ShardState(1, sync=True)
    shard.init("w", np.zeros(2))
    writer = ShardWriter(str(tmp_path), 0, rounds=1, clock=clock, session="ab12")
    first_shard(writer, shard)
    closed(shard, 1)
    clock.now += 1
    assert writer.tick(shard, None, set())
    written(writer)
    assert read_latest(str(tmp_path), 0).session == "ab12"


def test_keys_initialised_after_a_shard_make_the_next_one_due(tmp_path) -> None:
    """After a shard, a new key makes a shard due at once (no more rounds), and it holds the key;
    without new keys the rounds decide."""
    clock, shard = Clock(), ShardState(1, sync=True)
    shard.init("w", np.zeros(2))
    writer = ShardWriter(str(tmp_path), 0, rounds=3, clock=clock)
    first_shard(writer, shard)
    clock.now += 1
    assert not writer.tick(shard, None, set())
    closed(shard, 3)
    clock.now += 1
    assert writer.tick(shard, None, set())
    written(writer)
    shard.init("late", np.full(3, 7.0))
    clock.now += 1
    assert writer.tick(shard, None, set())
    written(writer)
    image = read_latest(str(tmp_path), 0)
    assert image.number == 3 and set(image.keys) == {"w", "late"}
    np.testing.assert_array_equal(image.keys["late"].value, [7, 7, 7])
    clock.now += 1
    assert not writer.tick(shard, None, set())  # nothing new since: the rounds decide again


def test_an_optimizer_set_or_its_parameters_changed_make_the_next_shard_due(tmp_path) -> None:
    """After a shard, a new optimizer or a set_params on it (a learning rate, rescale_grad) makes a shard
    due at once: a restart from the shard before would apply none, or the old learning rate."""
    from kvstore.core.optimizer import create

    clock, shard = Clock(), ShardState(1, sync=True)
    shard.init("w", np.zeros(2))
    writer = ShardWriter(str(tmp_path), 0, rounds=50, clock=clock)
    first_shard(writer, shard)
    sgd = create("sgd", learning_rate=1.0)
    assert writer.tick(shard, sgd, set())
    written(writer)
    clock.now += 1
    assert not writer.tick(shard, sgd, set())  # nothing new
    sgd.set_params(learning_rate=0.0)
    assert writer.tick(shard, sgd, set())
    written(writer)
    assert read_latest(str(tmp_path), 0).optimizer["params"]["learning_rate"] == 0.0


def test_a_shard_write_that_raises_any_error_settles_the_optimizer(tmp_path, monkeypatch) -> None:
    """A write failing with an error no storage rule names (a backend's own, MemoryError) is counted as
    failed and settles the optimizer it held, as an OSError does: else a set_optimizer waiting for it
    (server.py) would be answered only by a later shard, which a blocked collective never brings."""
    from kvstore.core import checkpoint
    from kvstore.core.optimizer import create

    shard = ShardState(1, sync=True)
    shard.init("w", np.zeros(2))
    writer = ShardWriter(str(tmp_path), 0, rounds=1000)
    assert writer.tick(shard, None, set())
    writer.close(10)
    opt = create("sgd", learning_rate=0.1)

    def broken(*args, **kwargs):
        raise RuntimeError("the storage backend's own error")

    monkeypatch.setattr(checkpoint, "write", broken)
    assert writer.tick(shard, opt, set())  # due: an optimizer was set
    writer.close(10)
    assert writer.failed == 1 and writer.settled(opt) and not writer.holds_optimizer(opt)


def _tables_shard(tmp_path, clock: Clock):
    """A writer over a fresh server holding fixed table 'emb' of 8 zero rows, its shards written."""
    from kvstore.core import rowsparse as R
    from kvstore.core.sparse_shard import RowTables

    writer = ShardWriter(str(tmp_path), 0, rounds=100, clock=clock, session="s")
    state, tables = ShardState(1, sync=True), RowTables(1, True)
    assert writer.tick(state, None, set(), tables)  # a fresh server's first shard
    written(writer)
    tables.init("emb", (8, 2), np.dtype(np.float32), 0, 8, R.parse_init("emb", "zeros"))  # SPARSE_INIT
    clock.now += 1
    assert writer.tick(state, None, set(), tables)  # a key more: due at once
    written(writer)
    return writer, state, tables


def test_a_tables_rows_set_after_its_init_reach_a_shard_once_the_sets_pause(tmp_path) -> None:
    """A fixed table's SPARSE_SET rows (an init from a value, a --resume) make a shard due once no set
    came for SETS_QUIET: a restart before the next rounds-due shard does not bring back the init
    spec's rows; sets coming one after another (a load) wait for their end."""
    from kvstore.server.shards import SETS_QUIET

    clock = Clock()
    writer, state, tables = _tables_shard(tmp_path, clock)
    value = np.arange(16, dtype=np.float32).reshape(8, 2)
    for row in range(8):  # the SPARSE_SETs of the init's value, closer together than SETS_QUIET
        tables.set_rows("emb", np.array([row], np.int64), value[row:row + 1])
        clock.now += SETS_QUIET / 4
        assert not writer.tick(state, None, set(), tables)
    clock.now += SETS_QUIET
    assert writer.tick(state, None, set(), tables)  # the server loop's ticks go on, no round closed
    written(writer)
    assert not writer.tick(state, None, set(), tables)  # nothing more to hold
    image = read_latest(str(tmp_path), 0)  # what a restart now comes back with
    assert image is not None and np.array_equal(image.tables["emb"].rows, value)
    assert writer.sets_settled(8) and not writer.sets_settled(9)


def test_a_settle_makes_the_shard_of_its_sets_due_at_once_and_a_restart_knows_its_parts(tmp_path) -> None:
    """A settle request (want_sets) makes a shard holding its sets due at the next tick, however
    recent the last set; that shard records the call's parts taken, which a restarted server reads."""
    clock = Clock()
    writer, state, tables = _tables_shard(tmp_path, clock)
    tables.set_rows("emb", np.arange(4, dtype=np.int64), np.ones((4, 2), np.float32), (0, 9, 0))
    tables.set_rows("emb", np.arange(4, 8, dtype=np.int64), np.ones((4, 2), np.float32), (0, 9, 1))
    assert not writer.tick(state, None, set(), tables) and not writer.sets_settled(tables.sets)
    writer.want_sets(tables.sets)
    assert writer.tick(state, None, set(), tables)
    written(writer)
    assert writer.sets_settled(tables.sets)
    image = read_latest(str(tmp_path), 0)
    assert image is not None and image.calls == {(0, 9): [0, 1]}
    assert np.array_equal(image.tables["emb"].rows, np.ones((8, 2), np.float32))

"""Unit tests of kvstore.core.table_image (and the server shard's ``tables``): a server's row-sparse
tables survive a shard's write and read with their rows, optimizer state, counters and rounds, and
a restored table goes on exactly as the one it was taken from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.core import checkpoint, table_image
from kvstore.core import rowsparse as R
from kvstore.core.dynamic import DynamicRows, apply_dynamic
from kvstore.core.optimizer import create, from_spec
from kvstore.core.shard import ShardState
from kvstore.core.shard_image import capture, from_file, to_file
from kvstore.core.sparse_shard import RowTables, Table
from kvstore.core.sparse_update import apply_rows
from kvstore.errors import FormatError


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def server(optimizer, sync: bool = True, clock: Clock | None = None) -> RowTables:
    """A one-worker server's tables applying ``optimizer``."""
    tables = RowTables(1, sync, window=4, clock=clock or Clock())
    tables.updater = lambda key, weight, ids, rows: apply_rows(optimizer, key, weight, ids, rows)
    tables.dynamic_updater = lambda key, table, ids, rows: apply_dynamic(optimizer, key, table, ids, rows)
    return tables


def make(tables: RowTables, clock: Clock) -> None:
    """A fixed table 'f' (rows [2, 6) of (8, 3)) and a dynamic one 'd' (capacity 4, lfu, admitted at
    the 2nd push, a ttl) on ``tables``."""
    tables.init("f", (8, 3), np.dtype(np.float32), 2, 6, R.parse_init("f", "normal"))
    spec = R.DynamicSpec(capacity=4, policy="lfu", admit_after=2, ttl=50.0)
    rows = DynamicRows(3, np.dtype(np.float32), R.parse_init("d", "uniform"), spec, clock)
    tables.init_dynamic("d", (R.DYNAMIC_ROWS, 3), rows)


def push(tables: RowTables, rnd: int, key: str, ids: list[int], value: float):
    """One round ``rnd`` of worker 0's push of ``ids`` (each row ``value``); what it answers."""
    ids_ = np.array(ids, np.int64)
    return tables.push(0, key, rnd, True, ids_, np.full((ids_.size, 3), value, np.float32), ("t", rnd))


def train(tables: RowTables, clock: Clock, first: int, last: int) -> None:
    """Rounds ``[first, last)`` of pushes to both tables (ids varying by round: evictions, admissions)."""
    for rnd in range(first, last):
        clock.now += 1
        push(tables, rnd, "f", [2 + rnd % 4, 5], 0.5 + rnd)
        push(tables, rnd, "d", sorted({-7, 3 * rnd % 11, 2**40 + rnd % 3}), 1.0 + rnd)


def roundtrip(tables: RowTables, optimizer, tmp_path: Path, clock: Clock) -> tuple[RowTables, object]:
    """Shard ``tables`` (through a file), restore it into fresh tables and optimizer; both."""
    image = capture(ShardState(1, sync=tables.sync), optimizer, set(), 0, 1, tables=tables)
    path = str(tmp_path / "shard.kvs")
    checkpoint.write(path, *to_file(image))
    read = from_file(*checkpoint.read(path), path)
    restored_opt = None if read.optimizer is None else from_spec(read.optimizer)
    if restored_opt is not None:
        restored_opt.num_update = read.num_update
    restored = server(restored_opt, tables.sync, clock)
    table_image.install(restored, restored_opt, read.tables)
    return restored, restored_opt


def held(tables: RowTables) -> dict[int, np.ndarray]:
    """Dynamic table 'd''s rows by id."""
    rows = tables.table("d").dynamic
    return {int(i): rows.weight[rows.slot(int(i))].copy() for i in rows.held()}


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_restored_tables_go_on_exactly_as_the_originals(tmp_path: Path, name: str) -> None:
    """After a shard's write and read, both tables hold the same rows, state, counts and counters, and
    the same later pushes leave them equal (momentum / moments, evictions, admissions and all)."""
    clock = Clock()
    params = {"momentum": 0.9} if name == "sgd" else {}
    optimizer = create(name, learning_rate=0.1, **params)
    tables = server(optimizer, clock=clock)
    make(tables, clock)
    train(tables, clock, 0, 9)
    restored, restored_opt = roundtrip(tables, optimizer, tmp_path, clock)
    assert restored.table("f").applied == tables.table("f").applied == 9
    assert np.array_equal(restored.table("f").weight, tables.table("f").weight)
    assert held(restored).keys() == held(tables).keys() and len(held(tables)) == 4
    assert restored.table("d").dynamic.stats() == tables.table("d").dynamic.stats()
    assert restored.table("d").dynamic.pending == tables.table("d").dynamic.pending
    assert restored_opt.counts == optimizer.counts and restored_opt.num_update == optimizer.num_update
    train(tables, clock, 9, 20)
    train(restored, clock, 9, 20)
    assert np.array_equal(restored.table("f").weight, tables.table("f").weight)
    mine, theirs = held(restored), held(tables)
    assert mine.keys() == theirs.keys()
    for i in mine:
        assert np.array_equal(mine[i], theirs[i]), i
    assert restored.table("d").dynamic.stats() == tables.table("d").dynamic.stats()


def test_a_table_without_its_optimizer_state_would_differ(tmp_path: Path) -> None:
    """The check above can fail: a table restored with its rows but fresh momentum ends elsewhere."""
    clock = Clock()
    optimizer = create("sgd", learning_rate=0.1, momentum=0.9)
    tables = server(optimizer, clock=clock)
    make(tables, clock)
    train(tables, clock, 0, 5)
    restored, restored_opt = roundtrip(tables, optimizer, tmp_path, clock)
    restored_opt.states.pop("f")
    train(tables, clock, 5, 8)
    train(restored, clock, 5, 8)
    assert not np.array_equal(restored.table("f").weight, tables.table("f").weight)


def test_ttl_goes_on_from_the_idle_time_of_the_shard(tmp_path: Path) -> None:
    """A row's idle time is restored (the time since the shard not counted): it expires ttl after its
    last use as the original would, not sooner."""
    clock = Clock()
    tables = server(None, clock=clock)
    make(tables, clock)
    push(tables, 0, "d", [5], 1.0)
    push(tables, 1, "d", [5], 2.0)  # admitted at its 2nd push
    clock.now += 30
    later = Clock()
    later.now = clock.now + 1000  # the restarted server's clock: the time it was down is not counted
    restored, _ = roundtrip(tables, None, tmp_path, later)
    rows = restored.table("d").dynamic
    assert rows.expire() == 0 and 5 in held(restored)
    later.now += 21  # 51 s idle in all
    assert rows.expire() == 1 and len(rows) == 0


def test_rounds_below_the_floor_are_acked_and_dropped() -> None:
    """dist_sync: after realign, a retried push of a round below the floor is acked and not applied; the
    next round applies. dist_async: a retry of a push the shard counts is dropped."""
    tables = server(None)
    make(tables, Clock())
    tables.realign("f", 3)
    before = tables.table("f").weight.copy()
    assert [c.token for c in push(tables, 1, "f", [2], 9.0)] == [("t", 1)]
    assert np.array_equal(tables.table("f").weight, before)
    push(tables, 3, "f", [2], 9.0)
    assert tables.table("f").applied == 4 and tables.table("f").weight[0, 0] == 9.0
    async_tables = server(None, sync=False)
    rows = np.zeros((4, 3), np.float32)
    async_tables.restore("f", Table((4, 3), 0, 4, rows.copy()), 0, {0: 2})
    assert push(async_tables, 1, "f", [1], 5.0) and np.array_equal(async_tables.table("f").weight, rows)
    push(async_tables, 2, "f", [1], 5.0)
    assert async_tables.table("f").weight[1, 0] == 5.0 and async_tables.table("f").pushed == {0: 3}


def test_a_shard_of_version_1_reads_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    """A shard without 'shard_version' (dense keys only) reads with no tables; a newer version is
    refused with FormatError naming it."""
    image = capture(ShardState(1, sync=True), None, set(), 0, 1)
    manifest, arrays = to_file(image)
    old = {k: v for k, v in manifest.items() if k not in ("shard_version", "tables")}
    assert from_file(old, arrays, "old").tables == {}
    with pytest.raises(FormatError, match="version 3"):
        from_file({**manifest, "shard_version": 3}, arrays, "new")


def test_a_damaged_table_entry_is_refused(tmp_path: Path) -> None:
    """A table entry missing an array, or with rows of another width, raises FormatError naming it."""
    clock = Clock()
    tables = server(None, clock=clock)
    make(tables, clock)
    train(tables, clock, 0, 3)
    manifest, arrays = to_file(capture(ShardState(1, sync=True), None, set(), 0, 1, tables=tables))
    dynamic = next(i for i, t in enumerate(manifest["tables"]) if "dynamic" in t)
    missing = {k: v for k, v in arrays.items() if not k.endswith("/freq")}
    with pytest.raises(FormatError, match="'freq'"):
        from_file(manifest, missing, "shard")
    narrow = dict(arrays, **{manifest["tables"][dynamic]["rows"]: np.zeros((3, 2), np.float32)})
    with pytest.raises(FormatError, match="rows of 3"):
        from_file(manifest, narrow, "shard")


def test_a_fixed_tables_copy_reuses_the_arrays_of_an_image_nobody_reads() -> None:
    """capture(spare=...) copies a fixed table's rows and state into the earlier image's arrays (no
    new allocation) and the copies are the table's as of now, not the earlier image's."""
    clock = Clock()
    optimizer = create("sgd", learning_rate=0.1, momentum=0.9)
    tables = server(optimizer, clock=clock)
    make(tables, clock)
    train(tables, clock, 0, 3)
    first = table_image.capture(tables, optimizer)
    rows, mom = first["f"].rows, first["f"].states["mom"]
    train(tables, clock, 3, 5)
    second = table_image.capture(tables, optimizer, first)
    assert second["f"].rows is rows and second["f"].states["mom"] is mom
    assert np.array_equal(rows, tables.table("f").weight)
    assert np.array_equal(mom, optimizer.states["f"]["mom"])


def _capacity_shard() -> tuple[dict, dict]:
    """A shard of a dynamic table of capacity 8 holding 8 rows, its spec rewritten to capacity 2."""
    clock = Clock()
    tables = RowTables(1, True, clock=clock)
    spec = R.DynamicSpec(capacity=8, policy="lru")
    tables.init_dynamic("d", (R.DYNAMIC_ROWS, 2), DynamicRows(2, np.dtype(np.float32),
                                                              R.parse_init("d", "zeros"), spec, clock))
    for rnd in range(2):
        ids = np.arange(rnd * 4, rnd * 4 + 4, dtype=np.int64)
        tables.push(0, "d", rnd, True, ids, np.ones((4, 2), np.float32), rnd)
    manifest, arrays = to_file(capture(ShardState(1, sync=True), None, set(), 0, 1, tables=tables))
    manifest["tables"][0]["dynamic"]["spec"] = R.DynamicSpec(capacity=2, policy="lru").wire()
    return manifest, arrays


def test_a_dynamic_table_holding_more_rows_than_its_capacity_is_refused() -> None:
    """A damaged shard whose dynamic table holds more rows than its capacity is refused when read
    (FormatError), not installed as a table over its capacity."""
    manifest, arrays = _capacity_shard()
    with pytest.raises(FormatError, match="capacity"):
        from_file(manifest, arrays, "shard")


def _momentum_shard() -> tuple[dict, dict]:
    """A shard of a fixed table stepped once by sgd with momentum (state 'mom')."""
    optimizer = create("sgd", learning_rate=0.1, momentum=0.9)
    tables = RowTables(1, True)
    tables.updater = lambda key, weight, ids, rows: apply_rows(optimizer, key, weight, ids, rows)
    tables.init("f", (4, 2), np.dtype(np.float32), 0, 4, R.parse_init("f", "zeros"))
    tables.push(0, "f", 0, True, np.array([1], np.int64), np.ones((1, 2), np.float32), 0)
    return to_file(capture(ShardState(1, sync=True), optimizer, set(), 0, 1, tables=tables))


def test_a_fixed_tables_state_of_a_name_its_optimizer_does_not_keep_is_refused() -> None:
    """A damaged shard whose fixed table holds a state its optimizer does not keep ('bogus' for sgd
    momentum's 'mom') is refused when read (FormatError: read_latest falls back to the shard before),
    not installed to go on without its momentum silently."""
    manifest, arrays = _momentum_shard()
    from_file(manifest, arrays, "shard")  # the shard as written reads
    states = manifest["tables"][0]["states"]
    states["bogus"] = states.pop("mom")
    with pytest.raises(FormatError, match="keeps"):
        from_file(manifest, arrays, "shard")


def test_a_tables_state_of_another_dtype_or_without_an_optimizer_is_refused() -> None:
    """A table's state array of a dtype its optimizer does not keep it in, or a table state in a shard
    with no optimizer, is refused when read (FormatError)."""
    manifest, arrays = _momentum_shard()
    name = manifest["tables"][0]["states"]["mom"]
    wrong = dict(arrays, **{name: arrays[name].astype(np.float64)})
    with pytest.raises(FormatError, match="dtype"):
        from_file(manifest, wrong, "shard")
    with pytest.raises(FormatError, match="no optimizer"):
        from_file(dict(manifest, optimizer=None), arrays, "shard")


def test_a_dist_async_retry_in_the_shard_is_not_applied_twice_after_a_lossy_restart() -> None:
    """dist_async: once a restart lost pushes (the server's count behind the worker's numbering), a
    retry of a push the next shard holds is still dropped (else it is applied twice)."""
    def add(key, weight, ids, rows):  # rows added
        np.add.at(weight, ids, rows)

    def restarted(image) -> RowTables:
        tables = RowTables(1, sync=False)
        tables.updater = add
        table_image.install(tables, None, image)
        return tables

    tables = RowTables(1, sync=False)
    tables.updater = add
    tables.init("f", (4, 1), np.dtype(np.float32), 0, 4, R.parse_init("f", "zeros"))
    one, ids = np.ones((1, 1), np.float32), np.array([0], np.int64)
    for rnd in range(3):  # pushes 0..2 applied, then the shard
        tables.push(0, "f", rnd, True, ids, one, rnd)
    image = table_image.capture(tables, None)
    for rnd in range(3, 6):  # pushes 3..5 applied and acked after it: lost at the first restart
        tables.push(0, "f", rnd, True, ids, one, rnd)
    first = restarted(image)  # restart 1, from the shard of 3 pushes
    first.push(0, "f", 6, True, ids, one, 6)  # the worker goes on with its push 6 (applied: 4.0)
    assert first.table("f").pushed == {0: 4}  # the staleness gate still counts what was applied
    second = restarted(table_image.capture(first, None))  # restart 2 from a shard holding push 6
    assert second.push(0, "f", 6, True, ids, one, "retry")  # the worker's retry of push 6: acked...
    assert second.table("f").weight[0, 0] == 4.0, "push 6 applied twice"  # ...and dropped
    second.push(0, "f", 7, True, ids, one, 7)  # the next push is applied
    assert second.table("f").weight[0, 0] == 5.0

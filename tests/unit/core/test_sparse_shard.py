"""Unit tests of kvstore.core.sparse_shard.RowTables: a server's row ranges, rounds and pulls."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.sparse_shard import WAITING_RANGES, RowTables
from kvstore.errors import DuplicateInitError, KeyNotInitializedError, ProtocolError, ShapeMismatchError

ZEROS = {"type": "zeros", "seed": 0}


def _tables(sync: bool = True, workers: int = 2, window: int = 2) -> RowTables:
    tables = RowTables(workers, sync, window)
    tables.init("e", (20, 2), np.dtype(np.float32), 10, 20, ZEROS)
    return tables


def _rows(ids: list[int], value: float) -> tuple[np.ndarray, np.ndarray]:
    return np.array(ids, np.int64), np.full((len(ids), 2), value, np.float32)


def test_a_sync_round_closes_with_every_workers_last_chunk_and_sums_them() -> None:
    """Rows of a round are applied once every live worker's last chunk is in, repeated ids summed;
    the acks are withheld until then."""
    t = _tables()
    assert t.push(0, "e", 0, False, *_rows([12], 1.0), "a") == []
    assert t.push(0, "e", 0, True, *_rows([12, 15], 2.0), "b") == []
    done = t.push(1, "e", 0, True, *_rows([], 0.0), "c")
    assert sorted(c.token for c in done) == ["a", "b", "c"]
    assert t.tables["e"].weight[2, 0] == 3.0 and t.tables["e"].weight[5, 0] == 2.0


def test_a_pull_waits_for_its_workers_rounds() -> None:
    """A pull after this worker's push is answered once that round is applied (read-your-writes)."""
    t = _tables()
    t.push(0, "e", 0, True, *_rows([11], 1.0), "push")
    assert t.pull(0, "e", 1, np.array([11], np.int64), "pull") == []
    assert t.pull(1, "e", 0, np.array([11], np.int64), "other")[0].value[0, 0] == 0.0  # nothing pushed
    done = t.push(1, "e", 0, True, *_rows([], 0.0), "push1")
    pulled = [c for c in done if c.token == "pull"]
    assert pulled and pulled[0].value[0, 0] == 1.0


def test_rounds_beyond_the_window_and_twice_pushed_rounds_are_refused() -> None:
    """A round more than the window ahead, a round pushed twice, rows outside the range, a bad width
    and a second init raise before anything changes."""
    t = _tables(window=2)
    t.push(0, "e", 0, True, *_rows([11], 1.0), "a")
    with pytest.raises(ProtocolError, match="twice"):
        t.push(0, "e", 0, True, *_rows([11], 1.0), "b")
    with pytest.raises(ProtocolError, match="KVSTORE_PUSH_WINDOW"):
        t.push(0, "e", 2, True, *_rows([11], 1.0), "c")
    with pytest.raises(ShapeMismatchError, match="outside"):
        t.push(1, "e", 0, True, *_rows([9], 1.0), "d")
    with pytest.raises(ShapeMismatchError, match="must be"):
        t.push(1, "e", 0, True, np.array([11], np.int64), np.zeros((1, 3), np.float32), "e")
    with pytest.raises(DuplicateInitError):
        t.init("e", (20, 2), np.dtype(np.float32), 10, 20, ZEROS)
    with pytest.raises(KeyNotInitializedError):
        t.pull(0, "nope", 0, np.array([1], np.int64), "f")
    assert not t.tables["e"].weight.any() and t.tables["e"].applied == 0


def test_a_leaving_worker_no_longer_holds_rounds_back() -> None:
    """When a worker leaves, a round that waited only for it closes."""
    t = _tables()
    t.push(0, "e", 0, True, *_rows([13], 4.0), "a")
    done = t.leave(1)
    assert [c.token for c in done] == ["a"] and t.tables["e"].weight[3, 0] == 4.0
    with pytest.raises(ProtocolError, match="left"):
        t.push(1, "e", 1, True, *_rows([13], 4.0), "b")


def test_async_chunks_apply_at_the_last_one() -> None:
    """dist_async: a worker's chunks are gathered and applied (and acked) with its last one."""
    calls = []
    t = _tables(sync=False)
    t.updater = lambda key, weight, ids, rows: calls.append((list(ids), rows[:, 0].tolist()))
    assert t.push(1, "e", 0, False, *_rows([14, 11], 1.0), "a") == []
    done = t.push(1, "e", 0, True, *_rows([14], 2.0), "b")
    assert [c.token for c in done] == ["a", "b"]
    assert calls == [([1, 4], [1.0, 3.0])]


def test_a_push_of_more_rows_than_the_range_is_refused() -> None:
    """A worker's chunks of one push may carry at most the range's row count (memory stays bounded)."""
    for sync in (True, False):
        t = _tables(sync=sync)
        t.push(0, "e", 0, False, *_rows(list(range(10, 20)), 1.0), "a")
        with pytest.raises(ProtocolError, match="rows in one push"):
            t.push(0, "e", 0, False, *_rows([11], 1.0), "b")


def test_a_refused_push_opens_no_round_and_the_last_leave_closes_cleanly() -> None:
    """A push refused for carrying more rows than the range leaves no (empty) round or gathering
    behind, so the last worker's leave closes nothing and raises nothing."""
    for sync in (True, False):
        t = _tables(sync=sync, workers=1)
        with pytest.raises(ProtocolError, match="rows in one push"):
            t.push(0, "e", 0, True, *_rows(list(range(10, 20)) + [10], 1.0), "bad")
        assert t.tables["e"].rounds == {} and t.tables["e"].pending == {}
        assert t.leave(0) == []
        np.testing.assert_array_equal(t.tables["e"].weight, 0.0)


def test_waiting_pulls_are_bounded_per_worker_and_dropped_when_it_leaves() -> None:
    """A worker's pulls waiting for a round may ask for at most WAITING_RANGES times the range's rows
    in all; more is a ProtocolError that keeps nothing.  Its waiting pulls go when it leaves."""
    t = _tables()
    t.push(0, "e", 0, True, *_rows([11], 1.0), "push")
    for n in range(WAITING_RANGES):  # as many threads of worker 0, each waiting for the whole range
        assert t.pull(0, "e", 1, np.arange(10, 20, dtype=np.int64), n) == []
    with pytest.raises(ProtocolError, match=f"{10 * WAITING_RANGES + 1} rows of key 'e' waiting"):
        t.pull(0, "e", 1, np.array([10], np.int64), "more")
    assert t.pull(1, "e", 1, np.array([12], np.int64), "other") == []
    assert [w[1] for w in t.tables["e"].waiting] == [*range(WAITING_RANGES), "other"]
    t.leave(0)
    assert [w[1] for w in t.tables["e"].waiting] == ["other"]


def _dynamic_tables(capacity: int, width: int = 64) -> RowTables:
    from kvstore.core import rowsparse as R
    from kvstore.core.dynamic import DynamicRows

    tables = RowTables(2, True, 4)
    tables.init_dynamic("d", (R.DYNAMIC_ROWS, width),
                        DynamicRows(width, np.dtype(np.float32), R.parse_init("d", "zeros"),
                                    R.DynamicSpec(capacity=capacity)))
    return tables


def test_a_pending_round_of_a_dynamic_table_is_bounded_by_a_multiple_of_its_capacity() -> None:
    """A worker's unfinished push round of a dynamic table of capacity 8 may not buffer 200,000 rows:
    a push carries at most max(DYNAMIC_ROUND_MIN, 4 x capacity) rows; nothing is kept of a refused one."""
    from kvstore.core import sparse_shard as S

    tables = _dynamic_tables(8)
    assert tables.table("d").limit == S.DYNAMIC_ROUND_MIN
    ids = np.arange(200_000, dtype=np.int64)
    with pytest.raises(ProtocolError, match="in one push"):
        tables.push(0, "d", 0, False, ids, np.zeros((ids.size, 64), np.float32), ("w", 1))
    assert tables.table("d").rounds == {}
    assert _dynamic_tables(10**6).table("d").limit == S.DYNAMIC_ROUND_CAPACITIES * 10**6


def test_a_pending_round_of_a_wide_dynamic_table_is_bounded_by_bytes() -> None:
    """Without a capacity a dynamic table's push carries at most DYNAMIC_ROUND_BYTES of rows."""
    from kvstore.core import sparse_shard as S

    assert _dynamic_tables(0, width=1 << 12).table("d").limit == S.DYNAMIC_ROUND_BYTES // (4 << 12)
    assert _dynamic_tables(0, width=2).table("d").limit == S.DYNAMIC_ROUND_ROWS


def test_a_staleness_gate_withholds_acks_of_a_worker_too_far_ahead_on_a_row_sparse_key() -> None:
    """dist_async with a gate (s=1, window 1: threshold 0): worker 0's second push is applied but
    its ack waits until worker 1 pushes (or leaves); worker 1, the slowest, is always answered."""
    from kvstore.core.staleness import StalenessGate

    tables = RowTables(2, sync=False, window=1)
    tables.gate = StalenessGate(1, 1)
    tables.init("k", (4, 2), np.dtype(np.float32), 0, 4, {"type": "zeros"})
    ids, rows = np.array([1], np.int64), np.ones((1, 2), np.float32)
    first = tables.push(0, "k", 0, True, ids, rows, "a")
    assert first == []  # 1 ahead of worker 1's 0: held
    assert [c.token for c in tables.push(1, "k", 0, True, ids, rows, "b")] == ["b", "a"]
    assert tables.push(0, "k", 1, True, ids, rows, "c") == []
    assert [c.token for c in tables.leave(1)] == ["c"]  # the slowest left: released
    np.testing.assert_array_equal(tables.tables["k"].weight[1], [1, 1])  # applied on arrival (assigned)


def test_stalled_names_a_row_sparse_round_open_too_long_and_the_workers_it_waits_for() -> None:
    """dist_sync: a round open longer than the bound is reported with its wait and the live workers
    that have not pushed; drop_waiting hands back the pulls waiting on it."""
    now = [100.0]
    tables = RowTables(3, sync=True, window=4, clock=lambda: now[0])
    tables.init("k", (4, 2), np.dtype(np.float32), 0, 4, {"type": "zeros"})
    ids, rows = np.array([1], np.int64), np.ones((1, 2), np.float32)
    tables.push(0, "k", 0, True, ids, rows, "p0")
    assert tables.pull(0, "k", 1, ids, "wait") == []
    now[0] = 102.5
    assert tables.stalled(5.0) == []
    assert tables.stalled(2.0) == [("k", 2.5, [1, 2])]
    assert tables.drop_waiting("k") == ["wait"]
    assert tables.tables["k"].waiting == []


def test_a_quorum_closes_a_row_sparse_round_scaled_and_drops_the_late_push() -> None:
    """Quorum 2 of 3: a round closes with 2 pushes, their sum scaled by 3/2; the third worker's push
    of that round is acked, dropped and counted, and its next push joins the oldest open round."""
    tables = RowTables(3, sync=True, window=4)
    tables.quorum = 2
    late = []
    tables.on_late = lambda key, worker, rnd: late.append((key, worker, rnd))
    tables.init("k", (4, 1), np.dtype(np.float32), 0, 4, {"type": "zeros"})
    ids = np.array([1], np.int64)

    def push(worker: int, rnd: int, value: float) -> list:
        return [c.token for c in tables.push(worker, "k", rnd, True, ids, np.full((1, 1), value, np.float32),
                                             f"{worker}:{rnd}")]

    assert push(0, 0, 1.0) == []
    assert push(1, 0, 1.0) == ["0:0", "1:0"]
    assert tables.tables["k"].weight[1, 0] == 3.0  # (1 + 1) * 3/2, assigned (no optimizer)
    assert push(2, 0, 100.0) == ["2:0"]  # late: acked, never applied
    assert tables.tables["k"].weight[1, 0] == 3.0 and late == [("k", 2, 0)] and tables.late == {2: 1}
    assert push(2, 1, 2.0) == []  # its next push joins round 1, the oldest open one
    assert push(0, 1, 2.0) == ["2:1", "0:1"]
    assert tables.tables["k"].weight[1, 0] == 6.0
    assert [c.token for c in tables.pull(2, "k", 2, ids, "p")] == ["p"]  # its pushes are applied


@pytest.mark.parametrize("ordered", [True, False])
def test_sum_order_rank_adds_a_rounds_rows_in_rank_order_whatever_came_first(ordered: bool) -> None:
    """KVSTORE_SUM_ORDER=rank on row-sparse rounds: a row pushed by workers 0, 1, 2 with 1e8, -1e8, 1
    (float32) sums to ((1e8 - 1e8) + 1) = 1 in every arrival order; in arrival order it depends on it."""
    values = {0: 1e8, 1: -1e8, 2: 1.0}
    got = set()
    for arrival in ((2, 0, 1), (0, 1, 2), (1, 2, 0)):
        tables = RowTables(3, True, 2, ordered=ordered)
        tables.init("e", (20, 2), np.dtype(np.float32), 10, 20, ZEROS)
        for worker in arrival:
            tables.push(worker, "e", 0, True, *_rows([12], values[worker]), worker)
        got.add(float(tables.tables["e"].weight[2, 0]))
    assert got == ({1.0} if ordered else {0.0, 1.0})


def _adding(key: str, weight: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """An updater that adds a round's rows to the table's (the default one stores them)."""
    weight[ids] += rows


def test_a_round_waiting_for_an_away_worker_closes_every_row_scaled_by_workers_over_pushes() -> None:
    """Workers 0 and 1 of 3 pushed, 2 goes away: the round closes, every row of it (one pushed by
    worker 0 alone too) scaled by 3/2, as a dense round's sum is; later rounds need 0 and 1 only."""
    t = RowTables(3, True, 4)
    t.init("e", (20, 2), np.dtype(np.float32), 10, 20, ZEROS)
    t.push(0, "e", 0, True, *_rows([11, 12], 2.0), "a")
    t.push(1, "e", 0, True, *_rows([12], 2.0), "b")
    assert sorted(c.token for c in t.mark_away(2)) == ["a", "b"]
    weight = t.tables["e"].weight
    assert weight[1, 0] == 3.0 and weight[2, 0] == 6.0  # 2 * 3/2 and (2 + 2) * 3/2
    t.push(0, "e", 1, True, *_rows([13], 1.0), "c")
    assert [c.token for c in t.push(1, "e", 1, True, *_rows([], 0.0), "d")] == ["c", "d"]
    assert weight[3, 0] == 1.5
    with pytest.raises(ProtocolError, match="has left"):  # the lost incarnation's late push
        t.push(2, "e", 1, True, *_rows([13], 1.0), "late")


def test_a_readmitted_worker_counts_from_the_first_round_no_table_opened() -> None:
    """readmit answers the first round no table has opened (the furthest table's); rounds before it
    close without the worker; its pull after that round waits for them; its push of that round joins
    it, and a round every worker pushed is not scaled."""
    t = RowTables(2, True, 4)
    t.init("e", (20, 2), np.dtype(np.float32), 10, 20, ZEROS)
    t.init("g", (4, 2), np.dtype(np.float32), 0, 4, ZEROS)
    t.updater = _adding
    t.mark_away(1)
    t.push(0, "e", 0, True, *_rows([11], 1.0), "e0")  # closed at once, scaled by 2
    t.push(0, "g", 0, True, np.array([1], np.int64), np.ones((1, 2), np.float32), "g0")
    t.push(0, "e", 1, True, *_rows([11], 1.0), "e1")
    assert t.first_round(1) == 2  # table e has applied rounds 0 and 1, g round 0
    assert t.readmit(1) == 2 and t.rejoin_at(1, 2) == []
    assert t.tables["e"].weight[1, 0] == 4.0 and t.tables["g"].weight[1, 0] == 2.0  # each round x 2
    ids = np.array([1], np.int64)
    assert t.pull(1, "g", 2, ids, "pull") == []  # table g has not closed round 1 yet
    done = t.push(0, "g", 1, True, np.array([1], np.int64), np.ones((1, 2), np.float32), "g1")
    assert [c.token for c in done] == ["g1", "pull"] and done[1].value[0, 0] == 4.0  # round 1 alone
    assert t.push(0, "g", 2, True, np.array([2], np.int64), np.ones((1, 2), np.float32), "a") == []
    done = t.push(1, "g", 2, True, np.array([2], np.int64), np.ones((1, 2), np.float32), "b")
    assert sorted(c.token for c in done) == ["a", "b"]
    assert t.tables["g"].weight[2, 0] == 2.0  # both pushed: 1 + 1, unscaled


def test_rejoin_at_a_later_round_closes_the_rounds_before_it() -> None:
    """A worker readmitted at round r (so round r waits for it) and told to count from r + 1: round
    r closes without it, scaled; a push of a round below its own is refused by the window."""
    t = _tables(workers=2, window=4)
    t.mark_away(1)
    assert t.readmit(1) == 0
    assert t.push(0, "e", 0, True, *_rows([11], 1.0), "a") == []  # waits for the readmitted worker
    assert [c.token for c in t.rejoin_at(1, 1)] == ["a"]
    assert t.tables["e"].weight[1, 0] == 2.0
    with pytest.raises(ProtocolError, match="KVSTORE_PUSH_WINDOW"):
        t.push(1, "e", 0, True, *_rows([11], 1.0), "old")


def test_in_dist_async_readmit_answers_the_workers_own_pushes_applied() -> None:
    """dist_async: the round a restarted worker goes on from is the most pushes of one table its
    earlier incarnations had applied; its pushes are applied at once meanwhile as before."""
    t = _tables(sync=False)
    for rnd in range(3):
        t.push(1, "e", rnd, True, *_rows([11], 1.0), rnd)
    t.mark_away(1)
    assert t.first_round(1) == 3 and t.readmit(1) == 3 and t.rejoin_at(1, 3) == []
    assert [c.token for c in t.push(1, "e", 3, True, *_rows([11], 1.0), "x")] == ["x"]

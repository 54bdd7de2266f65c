"""kvstore.core.dynamic: a dynamic table's rows made on first touch, placement, eviction (LRU, LFU),
admission, time-to-live with an injected clock, and the optimizer's lazy per-row state."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import dynamic as D
from kvstore.core import optimizer as O
from kvstore.core import rowsparse as R

INIT = R.parse_init("t", {"type": "normal", "sigma": 1.0, "seed": 5})
W = 3


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(clock: Clock | None = None, **spec) -> D.DynamicRows:
    return D.DynamicRows(W, np.dtype(np.float32), INIT, R.parse_spec("t", spec or True),
                         clock or Clock())


def _ids(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _push(table: D.DynamicRows, ids: np.ndarray, value: float = 1.0) -> None:
    D.apply_dynamic(None, "t", table, ids, np.full((ids.size, W), value, np.float32))


def test_initial_rows_are_the_fixed_tables_rows_and_any_64_bit_id_has_one() -> None:
    """A row's first value is row ``id`` of a fixed table of the same seed; huge and negative ids
    (uint64 bit patterns) get rows too, the same ones every time."""
    table = _table()
    fixed = R.generate(INIT, 0, 10, W, np.dtype(np.float32))
    np.testing.assert_array_equal(table.initial(np.arange(10)), fixed)
    big = _ids(-1, 2**62, -(2**63))
    first = table.read(big)
    np.testing.assert_array_equal(first, table.initial(big))
    assert np.isfinite(first).all() and len({r.tobytes() for r in first}) == 3


def test_a_pull_never_seen_answers_initial_rows_without_storing_unless_admitted() -> None:
    """read() of unknown ids gives their initial rows and stores nothing; with admit it stores them."""
    table = _table()
    table.read(_ids(4, 9))
    assert len(table) == 0 and table.stats()["pull_hits"] == 0
    table.read(_ids(4), admit=True)
    assert len(table) == 1
    table.read(_ids(4, 9))
    stats = table.stats()
    assert stats["pull_rows"] == 5 and stats["pull_hits"] == 1 and stats["hit_rate"] == pytest.approx(0.2)


def test_a_push_without_optimizer_replaces_rows_and_makes_them() -> None:
    """Without an optimizer a push's rows replace the stored rows (made on first touch)."""
    table = _table()
    _push(table, _ids(3, 7), 2.0)
    np.testing.assert_array_equal(table.read(_ids(3, 7, 8))[:2], np.full((2, W), 2.0, np.float32))
    assert len(table) == 2 and table.stats()["admissions"] == 2


def test_placement_is_a_seeded_hash_spreading_ids_over_every_server() -> None:
    """servers_of is deterministic, in range, and gives every server a share of many ids."""
    ids = np.arange(-5000, 5000, dtype=np.int64) * 7919
    where = D.servers_of(ids, 3)
    np.testing.assert_array_equal(where, D.servers_of(ids.copy(), 3))
    counts = np.bincount(where, minlength=3)
    assert where.min() >= 0 and where.max() < 3 and counts.min() > 3000


def test_lru_evicts_the_least_recently_used_row_and_it_comes_back_initial() -> None:
    """At capacity a new row evicts the least recently used one, which reads as its initial row."""
    table = _table(capacity=3, policy="lru")
    _push(table, _ids(1, 2, 3), 5.0)
    table.read(_ids(1))  # 1 is used again: 2 is now the least recent
    _push(table, _ids(4), 5.0)
    assert list(table.held()) == [1, 3, 4] and table.stats()["evictions"] == 1
    np.testing.assert_array_equal(table.read(_ids(2)), table.initial(_ids(2)))


def test_lfu_evicts_the_least_frequently_used_row_ties_by_recency() -> None:
    """LFU evicts the row used least often; among equals the least recent."""
    table = _table(capacity=3, policy="lfu")
    _push(table, _ids(1, 2, 3))
    _push(table, _ids(1, 3))
    _push(table, _ids(1))  # uses: 1 three times, 3 twice, 2 once
    _push(table, _ids(4))
    assert list(table.held()) == [1, 3, 4]
    _push(table, _ids(5))  # 4 (once) goes, not 3 (twice)
    assert list(table.held()) == [1, 3, 5]


def test_a_push_never_evicts_its_own_rows_and_drops_what_does_not_fit() -> None:
    """A push of more new ids than the capacity stores as many as fit; the rest are dropped (counted)."""
    table = _table(capacity=2)
    _push(table, _ids(1, 2, 3, 4), 1.0)
    stats = table.stats()
    assert len(table) == 2 and stats["dropped_updates"] == 2 and stats["evictions"] == 0
    _push(table, _ids(1, 9))  # 2 is evicted, never 1 (pushed now)
    assert list(table.held()) == [1, 9]


def test_admission_stores_a_row_only_at_its_kth_push() -> None:
    """admit_after=3: the first two pushes of an id are counted and dropped; the third makes the row
    from its initial value and applies that push."""
    table = _table(admit_after=3)
    _push(table, _ids(7), 1.0)
    _push(table, _ids(7), 1.0)
    assert len(table) == 0 and table.stats()["dropped_updates"] == 2
    _push(table, _ids(7), 4.0)
    np.testing.assert_array_equal(table.read(_ids(7)), np.full((1, W), 4.0, np.float32))
    assert table.stats()["admissions"] == 1


def test_the_admission_counts_stay_bounded() -> None:
    """Ids counted but not admitted are forgotten oldest first beyond the pending limit."""
    table = _table(capacity=4, admit_after=2)
    table.pending_limit = 10
    for start in range(0, 100, 5):
        _push(table, np.arange(start, start + 5, dtype=np.int64))
    assert len(table.pending) <= 10 and len(table) == 0


def test_ttl_drops_rows_untouched_for_longer_with_an_injected_clock() -> None:
    """A row untouched longer than ttl reads as its initial value and is counted as expired; a
    touched one stays."""
    clock = Clock()
    table = _table(clock, ttl=10.0)
    _push(table, _ids(1, 2), 3.0)
    clock.now = 6.0
    table.read(_ids(1))
    clock.now = 12.0
    rows = table.read(_ids(1, 2))
    np.testing.assert_array_equal(rows[0], np.full(W, 3.0, np.float32))
    np.testing.assert_array_equal(rows[1], table.initial(_ids(2))[0])
    assert list(table.held()) == [1] and table.stats()["expirations"] == 1
    clock.now = 30.0
    assert table.expire() == 1 and len(table) == 0


def test_slots_freed_by_expiry_are_reused_before_anything_is_evicted() -> None:
    """At capacity, rows made after an expiry take the expired rows' slots: nothing is evicted and
    the pool does not grow."""
    clock = Clock()
    table = _table(clock, capacity=3, ttl=5.0)
    _push(table, _ids(1, 2, 3))
    clock.now = 10.0
    _push(table, _ids(4, 5), 2.0)
    stats = table.stats()
    assert list(table.held()) == [4, 5] and stats["evictions"] == 0 and stats["expirations"] == 3
    assert table.weight.shape[0] == 3
    np.testing.assert_array_equal(table.read(_ids(4, 5)), np.full((2, W), 2.0, np.float32))


def test_memory_stays_bounded_however_many_distinct_ids_arrive() -> None:
    """100k distinct ids through a table capped at 500 rows: 500 rows held, the pool never grows
    past the capacity, every extra row evicted."""
    table = _table(capacity=500)
    for start in range(0, 100_000, 1000):
        _push(table, np.arange(start, start + 1000, dtype=np.int64) * 31)
        assert len(table) <= 500 and table.weight.shape[0] <= 500
    stats = table.stats()
    assert stats["rows"] == 500 and stats["evictions"] == 100_000 - 500 - stats["dropped_updates"]


def test_the_id_map_agrees_with_a_dict_through_puts_deletes_growth_and_reuse() -> None:
    """IdMap (open addressing over numpy) answers as a dict does over random batches of puts and
    deletes of any int64 ids, through growth and tombstone rebuilds, staying at most half full."""
    rng = np.random.default_rng(3)
    idmap, ref = D.IdMap(size=8), {}
    pool = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64), np.arange(-50, 50)])
    for _ in range(200):
        absent = np.array([i for i in rng.choice(pool, 40, replace=False) if int(i) not in ref], np.int64)
        slots = rng.integers(0, 10**9, absent.size)
        idmap.put(absent, slots)
        ref.update(zip(absent.tolist(), slots.tolist()))
        gone = rng.choice(np.array(list(ref), np.int64), min(len(ref), 25), replace=False)
        idmap.delete(gone)
        for i in gone.tolist():
            del ref[i]
        asked = rng.choice(pool, 200)
        np.testing.assert_array_equal(idmap.get(asked), [ref.get(int(i), -1) for i in asked])
        assert len(idmap) == len(ref) and 2 * len(idmap) <= idmap.keys.size


@pytest.mark.parametrize("name, params, names", [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9}, ["mom"]),
    ("adagrad", {"learning_rate": 0.1}, ["history"]),
    ("adam", {"learning_rate": 0.1}, ["mean", "var"]),
])
def test_optimizer_state_is_per_row_lazy_and_reset_with_the_row(name, params, names) -> None:
    """Each row steps as a fixed table's row would (state made with it, kept through pool growth),
    rows not pushed keep weight and state, and an evicted row comes back with fresh state."""
    opt = O.create(name, **params)
    ref = O.create(name, **params)
    table = _table(capacity=2000)
    grads = [(_ids(5, 9), 1.0), (np.arange(100, 1600, dtype=np.int64), 0.5), (_ids(5), 2.0)]
    fixed = R.generate(INIT, 0, 1600, W, np.dtype(np.float32))
    for ids, value in grads:
        rows = np.full((ids.size, W), value, np.float32)
        D.apply_dynamic(opt, "t", table, ids, rows)
        ref.update_rows("t", fixed, ids, rows)
    got = table.read(np.arange(1600, dtype=np.int64))
    np.testing.assert_allclose(got, fixed, rtol=1e-6, atol=1e-7)
    assert sorted(opt.states["t"]) == sorted(names) and opt.states["t"][names[0]].shape == table.weight.shape
    state = opt.states["t"][names[0]]
    assert np.any(state[table.slot(5)] != 0)
    small = _table(capacity=1)
    opt2 = O.create(name, **params)
    D.apply_dynamic(opt2, "t", small, _ids(1), np.ones((1, W), np.float32))
    D.apply_dynamic(opt2, "t", small, _ids(2), np.ones((1, W), np.float32))  # 1 evicted
    D.apply_dynamic(opt2, "t", small, _ids(1), np.ones((1, W), np.float32))  # 1 again: fresh state
    fresh = O.create(name, **params)
    fresh.counts["t"] = 2  # the key's third step (adam's bias correction counts the key's steps)
    expected = small.initial(_ids(1))
    fresh.update_rows("t", expected, np.zeros(1, np.int64), np.ones((1, W), np.float32))
    np.testing.assert_allclose(small.read(_ids(1)), expected, rtol=1e-6)


def test_parse_spec_refuses_bad_fields() -> None:
    """dynamic= takes True or a dict of capacity, policy, admit_after, ttl, each checked."""
    assert R.parse_spec("t", True) == R.DynamicSpec()
    assert R.parse_spec("t", {"capacity": 5, "policy": "lfu", "admit_after": 2, "ttl": 1}).ttl == 1.0
    for bad in ({"capacity": -1}, {"policy": "mru"}, {"admit_after": 0}, {"ttl": "x"}, {"size": 3}, 5):
        with pytest.raises(ValueError):
            R.parse_spec("t", bad)


def test_a_row_made_by_an_admitting_read_after_expiry_starts_with_fresh_momentum() -> None:
    """A slot freed by expiry and reused by read(admit=True) resets its optimizer state at the next
    update: the expired row's momentum does not move the new row on a zero gradient."""
    clock = Clock()
    opt = O.create("sgd", learning_rate=1.0, momentum=0.9)
    table = D.DynamicRows(W, np.dtype(np.float32), R.parse_init("t", "zeros"), R.DynamicSpec(ttl=1.0), clock)
    for _ in range(3):
        D.apply_dynamic(opt, "t", table, _ids(1), np.ones((1, W), np.float32))
    clock.now = 10.0
    table.read(_ids(2), admit=True)  # 1 expires, 2 reuses its slot
    assert table.slot(2) == 0
    D.apply_dynamic(opt, "t", table, _ids(2), np.zeros((1, W), np.float32))
    np.testing.assert_array_equal(table.read(_ids(2)), 0.0)


def test_admit_reports_a_slot_made_by_a_read_as_fresh_once() -> None:
    """admit() returns a slot made by read(admit=True) as fresh at its first update only."""
    table = _table(capacity=4)
    table.read(_ids(9), admit=True)
    assert table.admit(_ids(9))[2].tolist() == [table.slot(9)]
    assert table.admit(_ids(9))[2].size == 0


def test_admission_counting_at_its_bound_costs_what_it_costs_below_it() -> None:
    """Pushes of new ids once the admission counts are at their bound (65,536) cost about what they
    cost below it (forgetting the oldest count is O(1), not a scan of a dict's deleted entries)."""
    import time

    table = D.DynamicRows(16, np.dtype(np.float32), R.parse_init("d", "zeros"),
                          R.DynamicSpec(capacity=1000, admit_after=2))
    assert table.pending_limit == D.PENDING_MIN == 8 * 8192
    times = []
    for i in range(40):
        ids = np.arange(i * 8192, (i + 1) * 8192, dtype=np.int64)
        start = time.perf_counter()
        table.admit(ids)
        times.append(time.perf_counter() - start)
    assert len(table.pending) == table.pending_limit and len(table) == 0
    below, at = float(np.median(times[:8])), float(np.median(times[10:]))
    assert at < 5 * below + 0.05, (below, at)  # the dict took ~100x (0.05 s -> 5 s per push)


def test_admission_counts_are_bounded_whatever_the_capacity_and_counted_in_nbytes() -> None:
    """The ids counted for admission stay within [PENDING_MIN, PENDING_MAX] (none without
    admit_after), and nbytes() counts them."""
    spec = R.DynamicSpec(capacity=2**39, admit_after=2)
    assert D.pending_limit(spec) == D.PENDING_MAX
    assert D.pending_limit(R.DynamicSpec(capacity=10, admit_after=2)) == D.PENDING_MIN
    assert D.pending_limit(R.DynamicSpec(capacity=2**39)) == 0
    table = _table(admit_after=3)
    before = table.nbytes()
    table.admit(_ids(*range(100)))
    assert table.nbytes() == before + 100 * D.PENDING_BYTES


def test_the_id_map_is_not_rebuilt_on_every_push_at_a_power_of_two_capacity(monkeypatch) -> None:
    """At capacity 2**14 the tombstones of each evicting push no longer rebuild the whole map on every
    push (a rebuild leaves it at most 3/8 full of ids)."""
    rebuilds = [0]
    original = D.IdMap._rebuild

    def counted(self, size):
        rebuilds[0] += 1
        original(self, size)

    monkeypatch.setattr(D.IdMap, "_rebuild", counted)
    cap = 2**14
    table = D.DynamicRows(4, np.dtype(np.float32), R.parse_init("d", "zeros"), R.DynamicSpec(capacity=cap))
    table.admit(np.arange(cap, dtype=np.int64))
    rebuilds[0] = 0
    for step in range(1, 11):
        table.admit(np.arange(step * 1024, dtype=np.int64)[-1024:] + 10**12)
    assert rebuilds[0] <= 3, rebuilds[0]
    assert len(table) == cap and table.map.keys.size <= D.MAP_ENTRIES * cap


def test_idmap_matches_a_dict_under_puts_deletes_and_edge_ids() -> None:
    """IdMap against a dict over random puts and deletes, edge ids (0, -1, int64's ends) included."""
    rng = np.random.default_rng(0)
    m, ref = D.IdMap(4), {}
    edge = [0, -1, 1, np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    for step in range(400):
        pool = np.concatenate([rng.integers(-50, 50, 20), rng.integers(-2**63, 2**63 - 1, 5), edge])
        cand = np.unique(pool).astype(np.int64)
        new = np.array([i for i in cand.tolist() if i not in ref], np.int64)
        if step % 3 != 2:
            take = new[rng.random(new.size) < 0.5]
            slots = rng.integers(0, 1 << 40, take.size)
            m.put(take, slots)
            ref.update(zip(take.tolist(), slots.tolist()))
        else:
            gone = cand[rng.random(cand.size) < 0.5]
            m.delete(gone)
            for i in gone.tolist():
                ref.pop(i, None)
        got = m.get(cand)
        np.testing.assert_array_equal(got, np.array([ref.get(i, -1) for i in cand.tolist()]))
        assert len(m) == len(ref)


def test_table_labels_tell_int_and_str_keys_apart() -> None:
    """table_label: a str key as itself, an int key as int:<key>, one label per key."""
    keys = [3, "3", "int:3", "str:int:3", "emb", -1, "-1"]
    labels = [D.table_label(k) for k in keys]
    assert labels[:2] == ["int:3", "3"] and D.table_label("emb") == "emb"
    assert len(set(labels)) == len(keys)


@pytest.mark.parametrize("failing_call", range(1, 8))
def test_a_pool_growth_that_runs_out_of_memory_leaves_the_table_usable(monkeypatch, failing_call) -> None:
    """A MemoryError at any of the pool's allocations while it grows leaves every pool array as long
    as before (no row made, none lost); once memory is back, pushes of new ids work."""
    table = D.DynamicRows(2, np.dtype(np.float32), R.parse_init("d", "zeros"), R.DynamicSpec())
    table.admit(np.arange(1024, dtype=np.int64))  # the first block, full
    real, calls = np.zeros, [0]

    def failing(*args, **kwargs):
        if isinstance(args[0], tuple) and args[0][0] > 1024:  # one of the grown pool's 7 arrays
            calls[0] += 1
            if calls[0] == failing_call:
                raise MemoryError("simulated")
        return real(*args, **kwargs)

    monkeypatch.setattr(D.np, "zeros", failing)
    with pytest.raises(MemoryError):
        table.admit(_ids(5000))
    monkeypatch.setattr(D.np, "zeros", real)
    assert len(table) == 1024 and table.slot(5000) == -1
    assert {a.shape[0] for a in (table.weight, table.ids, table.live, table.last, table.seen,
                                 table.freq, table.unset)} == {1024}
    table.admit(_ids(6000))  # memory is back: this works
    assert table.slot(6000) == 1024 and len(table) == 1025


def test_ids_that_differ_only_in_their_top_bits_start_from_different_rows() -> None:
    """Feature ids laid out as (field << 60) | value start from different rows at width 16 (id * 16
    would wrap modulo 2**64 onto value's row): ids from 2**64 // width on are hashed first."""
    table = D.DynamicRows(16, np.dtype(np.float32), R.parse_init("d", {"type": "normal", "seed": 3}),
                          R.DynamicSpec())
    ids = np.array([(f << 60) | 12345 for f in range(4)], np.uint64).view(np.int64)
    rows = table.read(ids)
    assert len({r.tobytes() for r in rows}) == 4


def test_ids_below_the_wrap_bound_keep_the_fixed_tables_rows() -> None:
    """Ids in [0, 2**64 // width) are rows of a fixed table of the same seed, the last one included;
    the first id past it is hashed (not the row it would wrap onto)."""
    spec = R.parse_init("d", {"type": "uniform", "seed": 4})
    width = 3
    last = 2**64 // width - 1
    ids = np.array([0, 5, last, last + 1], np.uint64).view(np.int64)
    rows = R.generate_ids(spec, ids, width, np.dtype(np.float64))
    np.testing.assert_array_equal(rows[:2], R.generate(spec, 0, 6, width, np.dtype(np.float64))[[0, 5]])
    counters = (np.uint64(last) * np.uint64(width) + np.arange(width, dtype=np.uint64))
    direct = np.zeros(width)
    R._fill(spec, direct, counters)
    np.testing.assert_array_equal(rows[2], direct)
    with np.errstate(over="ignore"):  # (last + 1) * 3 + c: 2**64 - 1, then wrapped 0 and 1
        unhashed = np.uint64(last + 1) * np.uint64(width) + np.arange(width, dtype=np.uint64)
    assert unhashed[1] == 0
    wrapped = np.zeros(width)
    R._fill(spec, wrapped, unhashed)
    assert not np.array_equal(rows[3], wrapped)
    assert R.generate_ids(spec, ids[:1], 1, np.dtype(np.float64)).shape == (1, 1)


def test_a_small_full_table_holds_no_more_than_full_bytes() -> None:
    """full_bytes counts a new id map's minimum size: a table of capacity 10, filled, holds no more."""
    spec = R.DynamicSpec(capacity=10)
    table = D.DynamicRows(W, np.dtype(np.float32), INIT, spec)
    table.admit(np.arange(10, dtype=np.int64))
    assert len(table) == 10 and table.nbytes() <= D.full_bytes(spec, W, np.dtype(np.float32))


def _adam_stepped(ids: np.ndarray) -> tuple[O.Optimizer, D.DynamicRows]:
    opt = O.create("adam", learning_rate=0.1)
    table = _table(capacity=4)
    D.apply_dynamic(opt, "t", table, ids, np.ones((ids.size, W), np.float32))
    return opt, table


def test_live_slots_walk_the_pool_in_steps_and_put_makes_rows_without_counting_them() -> None:
    """live_slots gives held slots in [start, start+limit) and where to go on (-1 at the end); put makes
    absent ids from their initial rows, counts no admission, and gives -1 past the capacity."""
    table = _table(capacity=3)
    _push(table, _ids(10, 20, 30))
    table.expire()  # no ttl: nothing dropped
    first, after = table.live_slots(0, 2)
    rest, end = table.live_slots(after, 2)
    assert first.size == 2 and after == 2 and rest.size == 1 and end == -1
    slots, fresh = D.DynamicRows(W, np.dtype(np.float32), INIT, R.parse_spec("t", {"capacity": 2}),
                                 Clock()).put(_ids(5, 6, 7))
    assert list(slots[:2]) == [0, 1] and slots[2] == -1 and list(fresh) == [0, 1]
    before = dict(table.counts)
    slots, fresh = table.put(_ids(10, 99))
    assert slots[0] >= 0 and slots[1] >= 0 and fresh.size == 1  # 99 evicted one to fit
    assert table.counts["admissions"] == before["admissions"]
    np.testing.assert_array_equal(table.weight[slots[1]], table.initial(_ids(99))[0])


def test_state_entry_and_load_state_round_trip_adam_rows_by_id() -> None:
    """state_entry saves each held row's adam state sorted by id with its ids; load_state into a fresh
    table makes those rows and installs their state and the key's count."""
    opt, table = _adam_stepped(_ids(30, -5, 7))
    entry = D.state_entry(opt, "t", table, (W,))
    assert entry is not None and list(entry.ids) == [-5, 7, 30] and entry.shape == (3, W)
    assert entry.count == 1 and set(entry.arrays) == {"mean", "var"}
    fresh_opt, fresh = O.create("adam", learning_rate=0.1), _table(capacity=4)
    assert D.load_state(fresh_opt, "t", fresh, entry.ids, entry.arrays, entry.count) == 0
    again = D.state_entry(fresh_opt, "t", fresh, (W,))
    assert again is not None and list(again.ids) == [-5, 7, 30] and again.count == 1
    for name in entry.arrays:
        np.testing.assert_array_equal(again.arrays[name], entry.arrays[name])
    assert D.state_entry(O.create("adam"), "t", _table(), (W,)) is None  # never updated: nothing


def test_load_state_refuses_other_names_shapes_and_repeated_ids_before_changing_anything() -> None:
    """A state name the optimizer does not keep, rows of another width or repeated ids raise
    OptimizerError and leave the table and the optimizer as they were."""
    from kvstore.errors import OptimizerError

    opt, table = _adam_stepped(_ids(1, 2))
    rows = np.zeros((2, W), np.float32)
    held = len(table)
    for ids, arrays in [(_ids(3, 4), {"mom": rows}), (_ids(3, 4), {"mean": rows, "var": rows[:, :1]}),
                        (_ids(3, 3), {"mean": rows, "var": rows}), (_ids(3, 4), {"mean": rows})]:
        with pytest.raises(OptimizerError):
            D.load_state(opt, "t", table, ids, arrays, 5)
    assert len(table) == held and opt.counts["t"] == 1


def test_eviction_looks_at_a_window_of_slots_not_the_whole_pool(monkeypatch) -> None:
    """An evicting push of n new ids into a full table of 50,000 rows ranks at most
    max(EVICT_WINDOW * n, EVICT_MIN_WINDOW) slots (its cost follows the rows evicted, not the
    capacity); capacity and counters stay exact."""
    cap, n = 50_000, 100
    table = _table(capacity=cap)
    table.admit(np.arange(cap, dtype=np.int64))
    ranked = []
    real = np.argpartition

    def counted(a, kth, *args, **kwargs):
        ranked.append(len(a))
        return real(a, kth, *args, **kwargs)

    monkeypatch.setattr(D.np, "argpartition", counted)
    for step in range(20):
        table.admit(np.arange(n, dtype=np.int64) + 10**9 + step * n)
    assert ranked and max(ranked) <= max(D.EVICT_WINDOW * n, D.EVICT_MIN_WINDOW) < cap
    stats = table.stats()
    assert len(table) == cap == stats["rows"] and stats["evictions"] == 20 * n
    assert stats["admissions"] == cap + 20 * n and table.weight.shape[0] == cap


@pytest.mark.parametrize("cap", [4096, 20_000])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_rows_used_every_step_survive_a_stream_of_single_new_ids(policy, cap) -> None:
    """64 hot rows in neighbouring slots, read before every one-new-id push, are never evicted while
    the full table holds thousands of colder rows (the window is at least EVICT_MIN_WINDOW slots, not
    8n = 8; at 20,000 rows it is a window of the pool, not the whole of it)."""
    hot = np.arange(64, dtype=np.int64) * 7 + 5
    table = _table(capacity=cap, policy=policy)
    table.admit(hot)  # slots 0..63
    table.admit(np.arange(cap - hot.size, dtype=np.int64) + 10**12)  # full: cold rows in the rest
    evicted = []
    for step in range(1200):
        table.read(hot)
        table.admit(np.array([10**9 + step], np.int64))
        evicted.append(int(np.count_nonzero(table.map.get(hot) < 0)))  # no use counted
    assert table.stats()["evictions"] == 1200 and len(table) == cap
    assert max(evicted) == 0, f"{max(evicted)} of 64 hot rows evicted while >= 3000 cold rows were held"
    assert np.isin(hot, table.held()).all()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_an_evicting_push_never_evicts_its_own_rows_even_the_least_recently_used(policy) -> None:
    """A push that carries the table's least recently used rows and as many new ids keeps every row it
    carries (they are the ones an exact LRU would pick), evicting others; the capacity holds."""
    cap = 4096
    table = _table(capacity=cap, policy=policy)
    table.admit(np.arange(cap, dtype=np.int64))
    table.read(np.arange(1000, cap, dtype=np.int64))  # rows 0..999 are now the least recently used
    old, new = np.arange(1000, dtype=np.int64), np.arange(1000, dtype=np.int64) + 10**6
    keep, slots, _ = table.admit(np.concatenate([old, new]))
    assert keep.size == 2000 and (slots >= 0).all()
    held = set(table.held().tolist())
    assert set(old.tolist()) <= held and set(new.tolist()) <= held
    assert len(table) == cap and table.stats()["evictions"] == 1000


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_rows_used_between_pushes_survive_a_stream_of_new_ids(policy) -> None:
    """Rows pulled between pushes stay held while 50x the capacity of new ids streams through a table
    whose eviction ranks a window of the pool (approximate LRU / LFU keeps what is used)."""
    cap, hot = 2048, np.arange(64, dtype=np.int64) * 7 + 5
    table = _table(capacity=cap, policy=policy)
    table.admit(hot)
    for step in range(800):
        table.read(hot)
        table.admit(np.arange(128, dtype=np.int64) + 10**9 + step * 128)
    stats = table.stats()
    assert np.isin(hot, table.held()).all()
    assert len(table) == cap and stats["evictions"] == 64 + 800 * 128 - cap


def test_a_table_filled_to_its_capacity_is_not_rebuilt_by_its_first_evictions(monkeypatch) -> None:
    """The id map of a table with a capacity is sized for it once half full: evicting a tenth of the
    capacity right after the table fills rebuilds nothing (tombstones have room)."""
    cap = 60_000  # filled, a map grown for its ids alone would be 2**17 entries: 5,536 tombstones to go
    table = _table(capacity=cap)
    for start in range(0, cap, 4096):
        table.admit(np.arange(start, min(cap, start + 4096), dtype=np.int64))
    rebuilds = [0]
    original = D.IdMap._rebuild

    def counted(self, size):
        rebuilds[0] += 1
        original(self, size)

    monkeypatch.setattr(D.IdMap, "_rebuild", counted)
    for step in range(6):
        table.admit(np.arange(1000, dtype=np.int64) + 10**9 + step * 1000)
    assert rebuilds[0] == 0 and len(table) == cap
    assert table.map.keys.size <= D.MAP_ENTRIES * cap


def test_a_growing_pool_holds_at_most_a_quarter_more_slots_than_rows() -> None:
    """Without a capacity the pool grows by a quarter (at least GROW_BLOCK rows): after every push of
    new ids its slots are at most 1.25x the rows held (plus one block), and its bytes per row with
    adam's state stay within issue 46's bound 1.5 x (row + state) + 64."""
    opt = O.create("adam", learning_rate=0.1)
    table = _table()
    rng = np.random.default_rng(1)
    for _ in range(40):
        ids = np.unique(rng.integers(-(2**62), 2**62, 3000))
        D.apply_dynamic(opt, "t", table, ids, np.ones((ids.size, W), np.float32))
        assert table.weight.shape[0] <= 1.25 * len(table) + D.GROW_BLOCK
    held = table.nbytes() + sum(a.nbytes for a in opt.states["t"].values())
    assert held / len(table) <= 1.5 * (W * 4 * 3) + 64

"""Key groups (kvstore.core.groups) answer exactly as the per-key ShardState does."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.core.groups import GroupedShardState
from kvstore.core.shard import ShardState
from kvstore.errors import KVStoreError

pytestmark = pytest.mark.timeout(60)
KEYS = ["a", "b", 7, "d"]
SIZE = 3
SIZES = [SIZE] * len(KEYS)


def make(cls, workers: int, sync: bool, window: int = 0):
    split = {"split": lambda t, i: (t[0], i)} if cls is GroupedShardState else {}  # as the server's
    state = cls(workers, sync=sync, ordered=False, window=window, **split)
    for i, key in enumerate(KEYS):
        state.init(key, np.full(SIZE, float(i)))
    return state


def expand(done) -> dict:
    """Completions by per-key token: a group's whole answer (token (t, -1)) becomes one per key."""
    out = {}
    for c in done:
        t, i = c.token
        if i >= 0:
            out[(t, i)] = None if c.value is None else c.value.copy()
            continue
        for j in range(len(KEYS)):
            out[(t, j)] = None if c.value is None else c.value[j * SIZE:(j + 1) * SIZE].copy()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] is None and b[k] is None) or
                                        (a[k] is not None and b[k] is not None and np.array_equal(a[k], b[k]))
                                        for k in a)


def current(state: GroupedShardState, key) -> np.ndarray:
    group = state._grouped.get(key)
    if group is None:
        return state._keys[key].value
    i = group.keys.index(key)
    return group.value[group.offsets[i]:group.offsets[i + 1]]


def run_op(state, op, t: int, grouped: bool):
    """Apply one operation; return the expanded completions, or the type of the error raised."""
    kind, w, arg, values = op
    try:
        if kind in ("gpush", "gpushpull", "gpull"):
            array = None if kind == "gpull" else np.concatenate(values)
            create = kind != "gpull"
            group = state.group_of(list(KEYS), list(SIZES), array, create=create) if grouped else None
            if group is not None:
                if kind == "gpull":
                    return expand(state.pull_group(group, w, (t, -1)))
                return expand(state.push_group(group, w, (t, -1), array, pull=kind == "gpushpull"))
            if kind == "gpull":
                entries = [((t, i), k, 0, SIZE) for i, k in enumerate(KEYS)]
                return expand(state.pull_many(w, entries, whole=True))
            entries = [((t, i), k, array[i * SIZE:(i + 1) * SIZE], 0) for i, k in enumerate(KEYS)]
            return expand(state.push_many(w, entries, pull=kind == "gpushpull"))
        if kind == "kpush":
            return expand(state.push((t, arg), w, KEYS[arg], values[0]))
        if kind == "kpull":
            return expand(state.pull((t, arg), w, KEYS[arg]))
        return expand(state.leave(w))
    except (KVStoreError, ValueError) as exc:
        return type(exc)


def random_ops(rng: random.Random, workers: int, count: int) -> list:
    ops, left = [], set()
    for _ in range(count):
        kind = rng.choice(["gpush"] * 4 + ["gpull"] * 3 + ["gpushpull", "kpush", "kpull"])
        if rng.random() < 0.01:
            kind = "leave"
        w = rng.randrange(workers)
        if kind == "leave":
            left.add(w)
        values = [np.array([float(rng.randrange(10)) for _ in range(SIZE)]) for _ in KEYS]
        ops.append((kind, w, rng.randrange(len(KEYS)), values))
        if len(left) == workers:
            break
    return ops


@pytest.mark.parametrize("workers,sync,window", [(1, True, 0), (2, True, 0), (3, True, 2), (3, False, 0),
                                                 (2, True, 1)])
def test_groups_answer_every_sequence_as_the_per_key_state_does(workers, sync, window):
    """Random pushes, pulls and pushpulls of the group and of single keys (which dissolve it), and
    leaves: every answer, error and stored value matches ShardState's, with groups really used."""
    used = 0
    for seed in range(40):
        rng = random.Random(seed)
        ref, grouped = make(ShardState, workers, sync, window), make(GroupedShardState, workers, sync, window)
        for t, op in enumerate(random_ops(rng, workers, 60)):
            want, got = run_op(ref, op, t, False), run_op(grouped, op, t, True)
            assert (got == want) if isinstance(want, type) else same(got, want), (seed, t, op[:3])
            for key in KEYS:
                assert np.array_equal(current(grouped, key), ref._keys[key].value), (seed, t, key)
            used += bool(grouped._groups)
            assert grouped.open_rounds() == ref.open_rounds()
    assert used > 100  # the group path was taken, not only the per-key one


def test_a_reply_is_never_written_by_later_rounds():
    """Copy-on-write: the array a group pull answered with keeps its values after more rounds."""
    state = make(GroupedShardState, 2, True)
    for w in (0, 1):
        group = state.group_of(list(KEYS), list(SIZES), np.ones(12), create=True)
        state.push_group(group, w, (w, -1), np.ones(12))
    (reply,) = state.pull_group(group, 0, ("p", -1))
    kept = reply.value.copy()
    for _ in range(3):
        for w in (0, 1):
            state.push_group(group, w, (w, -1), np.full(12, 5.0))
    assert np.array_equal(reply.value, kept) and np.all(state.pull_group(group, 0, ("q", -1))[0].value == 10)


def test_no_groups_where_the_per_key_rounds_sum_differently():
    """Rank-order sums and quorum rounds are never grouped."""
    for kw in ({"ordered": True}, {"ordered": False, "quorum": 1}):
        state = GroupedShardState(2, sync=True, **kw)
        for key in KEYS:
            state.init(key, np.zeros(SIZE))
        assert state.group_of(list(KEYS), list(SIZES), np.ones(12), create=True) is None


def test_a_list_that_only_compares_equal_is_not_the_group():
    """1 == True == 1.0: a list with a bool or a float where the group has an int takes the per-key path."""
    state = GroupedShardState(1, sync=True, ordered=False)
    for key in (1, 2):
        state.init(key, np.zeros(SIZE))
    assert state.group_of([1, 2], [SIZE, SIZE], np.ones(6), create=True) is not None
    assert state.group_of([True, 2], [SIZE, SIZE], np.ones(6), create=True) is None
    assert state.group_of([1.0, 2], [SIZE, SIZE], None, create=False) is None
    assert state.group_of([1, 2], [SIZE, SIZE], np.ones(6, np.float32), create=True) is None  # dtype


@pytest.mark.parametrize("workers,sync", [(2, True), (1, False)])
def test_a_lone_key_group_answers_as_the_per_key_state_does(workers, sync, monkeypatch):
    """A group of one key (a single-key PUSH/PULL, MIN_KEYS = 1) matches ShardState as a batch does."""
    module = globals()
    monkeypatch.setitem(module, "KEYS", ["solo"])
    monkeypatch.setitem(module, "SIZES", [SIZE])
    used = 0
    for seed in range(20):
        rng = random.Random(seed)
        ref, grouped = make(ShardState, workers, sync), make(GroupedShardState, workers, sync)
        for t, op in enumerate(random_ops(rng, workers, 40)):
            want, got = run_op(ref, op, t, False), run_op(grouped, op, t, True)
            assert (got == want) if isinstance(want, type) else same(got, want), (seed, t, op[:3])
            assert np.array_equal(current(grouped, "solo"), ref._keys["solo"].value), (seed, t)
            used += bool(grouped._groups)
    assert used > 50  # the group path was taken


def test_a_shard_image_and_its_progress_see_the_groups_rounds():
    """ShardState.progress counts a group's closed rounds, and an image (core/shard_image) holds the
    values the group's rounds made (its keys' own state is made current first)."""
    from kvstore.core.shard_image import capture

    state = make(GroupedShardState, 2, True)
    for _ in range(3):
        for w in (0, 1):
            group = state.group_of(list(KEYS), list(SIZES), np.ones(12), create=True)
            state.push_group(group, w, (w, -1), np.ones(12))
    assert state._groups and state.progress() == 3
    image = capture(state, None, set(), rank=0, number=1)
    for key in KEYS:
        assert image.keys[key].round == 3
        np.testing.assert_array_equal(image.keys[key].value, np.full(SIZE, 2.0))


def test_a_rejoined_worker_keeps_the_key_groups_off_until_it_is_forgotten():
    """A restarted worker's rejoin serves every key per key (no group is made) until retire_joins()
    forgets it once every key reached its round; then, the keys at rest, a batch makes its group again."""
    from kvstore.core.rejoin import Rejoins
    state = make(GroupedShardState, 2, sync=True)
    rejoins = Rejoins(state)
    rejoins.away(1, 0)
    first, _ = rejoins.begin(1, 1)
    rejoins.join_at(1, 1, first + 1)
    assert state.group_of(list(KEYS), list(SIZES), np.ones(12), create=True) is None
    assert state.retire_joins() == []  # round 0 of every key is still to close
    for key, size in zip(KEYS, SIZES):
        state.push("t", 0, key, np.ones(size))  # round 0 closes without the rejoiner
    assert state.retire_joins() == [1]
    for worker in (0, 1):  # round 1: the rejoiner's first, per key
        for key, size in zip(KEYS, SIZES):
            state.push("t", worker, key, np.ones(size))
    assert state.group_of(list(KEYS), list(SIZES), np.ones(12), create=True) is not None

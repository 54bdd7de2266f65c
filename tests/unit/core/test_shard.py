"""Unit tests of kvstore.core.shard.ShardState: sync rounds, async apply, read-your-writes, no I/O."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest

from kvstore.core.shard import Completion, ShardState
from kvstore.errors import (
    DTypeMismatchError,
    DuplicateInitError,
    KeyNotInitializedError,
    ProtocolError,
    ShapeMismatchError,
)


def ro(values, dtype=np.float64) -> np.ndarray:
    """A read-only array, like one decoded from a received frame."""
    array = np.array(values, dtype=dtype)
    array.setflags(write=False)
    return array


def tokens(done: list[Completion]) -> list:
    """The tokens of ``done``, in order."""
    return [c.token for c in done]


def by_token(done: list[Completion]) -> dict:
    """Map token -> value of ``done``, checking no token is answered twice."""
    assert len({c.token for c in done}) == len(done), tokens(done)
    return {c.token: c.value for c in done}


def make(num_workers: int = 2, sync: bool = True, updater=None, init=(0.0, 0.0)) -> ShardState:
    """A ShardState holding key 'k' initialised to ``init``."""
    state = ShardState(num_workers, sync=sync, updater=updater)
    state.init("k", np.array(init, dtype=np.float64))
    return state


# -- dist_sync rounds -------------------------------------------------------------------------------

def test_sync_round_closes_only_when_every_worker_pushed():
    """With 3 workers, pushes from 2 are held; the 3rd closes the round and acks all three."""
    state = make(3)
    assert state.push("a", 0, "k", ro([1, 2])) == []
    assert state.push("b", 2, "k", ro([10, 20])) == []
    np.testing.assert_array_equal(state.value("k"), [0, 0])
    done = state.push("c", 1, "k", ro([100, 200]))
    assert sorted(tokens(done)) == ["a", "b", "c"]
    assert all(c.value is None for c in done)
    np.testing.assert_array_equal(state.value("k"), [111, 222])


def test_sync_stored_value_is_the_round_sum_not_cumulative():
    """Each round assigns that round's sum; neither the init value nor earlier rounds are added."""
    state = make(2, init=(1000.0, 1000.0))
    state.push("a1", 0, "k", ro([1, 1]))
    state.push("b1", 1, "k", ro([2, 2]))
    np.testing.assert_array_equal(state.value("k"), [3, 3])
    state.push("a2", 0, "k", ro([5, 0]))
    state.push("b2", 1, "k", ro([0, 7]))
    np.testing.assert_array_equal(state.value("k"), [5, 7])


def test_sync_single_worker_round_closes_on_each_push():
    """With one worker every push is a complete round: acked at once and stored."""
    state = make(1)
    assert state.push("a", 0, "k", ro([4, 5])) == [Completion("a")]
    np.testing.assert_array_equal(state.value("k"), [4, 5])
    assert state.push("b", 0, "k", ro([6, 7])) == [Completion("b")]
    np.testing.assert_array_equal(state.value("k"), [6, 7])


def test_sync_second_push_from_same_worker_waits_for_next_round():
    """A worker's second push is not counted in the current round and its ack is withheld."""
    state = make(2)
    assert state.push("a1", 0, "k", ro([1, 0])) == []
    assert state.push("a2", 0, "k", ro([10, 0])) == []
    done = state.push("b1", 1, "k", ro([0, 1]))
    assert sorted(tokens(done)) == ["a1", "b1"]
    np.testing.assert_array_equal(state.value("k"), [1, 1])
    done = state.push("b2", 1, "k", ro([0, 10]))
    assert sorted(tokens(done)) == ["a2", "b2"]
    np.testing.assert_array_equal(state.value("k"), [10, 10])


def test_sync_backlog_of_several_pushes_fills_successive_rounds():
    """Three early pushes from one worker land in rounds 1, 2 and 3, in order."""
    state = make(2)
    for i in range(3):
        assert state.push(f"a{i}", 0, "k", ro([10.0 ** i, 0])) == []
    for i in range(3):
        done = state.push(f"b{i}", 1, "k", ro([0, i]))
        assert sorted(tokens(done)) == [f"a{i}", f"b{i}"]
        np.testing.assert_array_equal(state.value("k"), [10.0 ** i, i])


def test_sync_backlog_closes_a_round_when_it_completes_one():
    """When a round closes and the backlog already holds every worker's next push, that round closes too."""
    state = make(2)
    state.push("a1", 0, "k", ro([1, 0]))
    state.push("a2", 0, "k", ro([2, 0]))
    state.push("b1", 1, "k", ro([0, 0]))  # round 1 closes; a2 now waits in round 2
    state.push("b2", 1, "k", ro([0, 2]))  # round 2 closes
    np.testing.assert_array_equal(state.value("k"), [2, 2])
    assert state.push("a3", 0, "k", ro([3, 0])) == []  # round 3 is fresh


# -- pulls (read-your-writes) -----------------------------------------------------------------------

def test_pull_without_earlier_push_is_answered_immediately():
    """A worker that pushed nothing gets the current value at once."""
    state = make(2, init=(3.0, 4.0))
    [done] = state.pull("p", 1, "k")
    assert done.token == "p"
    np.testing.assert_array_equal(done.value, [3, 4])


def test_pull_waits_for_the_pullers_own_pending_push():
    """A pull after the worker's own push waits for that push's round, then returns the new value."""
    state = make(2)
    state.push("a", 0, "k", ro([1, 1]))
    assert state.pull("p0", 0, "k") == []
    [other] = state.pull("p1", 1, "k")  # worker 1 has no pending push: answered with the old value
    np.testing.assert_array_equal(other.value, [0, 0])
    done = by_token(state.push("b", 1, "k", ro([2, 2])))
    assert set(done) == {"a", "b", "p0"}
    np.testing.assert_array_equal(done["p0"], [3, 3])


def test_pull_waits_for_every_earlier_push_including_deferred_ones():
    """A pull after two pushes waits for the second round, not just the first."""
    state = make(2)
    state.push("a1", 0, "k", ro([1, 0]))
    state.push("a2", 0, "k", ro([2, 0]))
    assert state.pull("p", 0, "k") == []
    assert "p" not in tokens(state.push("b1", 1, "k", ro([0, 1])))
    done = by_token(state.push("b2", 1, "k", ro([0, 2])))
    np.testing.assert_array_equal(done["p"], [2, 2])


def test_pull_on_one_key_does_not_wait_for_pushes_to_another():
    """Read-your-writes is per key: a pending push on 'k' does not hold a pull of 'other'."""
    state = make(2)
    state.init("other", np.array([9.0]))
    state.push("a", 0, "k", ro([1, 1]))
    [done] = state.pull("p", 0, "other")
    np.testing.assert_array_equal(done.value, [9])


def test_pushpull_is_answered_with_the_value_after_its_round():
    """pushpull replies only once its round closes, with the round's sum; each token exactly once."""
    state = make(2)
    assert state.pushpull("x", 0, "k", ro([1, 2])) == []
    done = by_token(state.pushpull("y", 1, "k", ro([3, 4])))
    assert set(done) == {"x", "y"}
    np.testing.assert_array_equal(done["x"], [4, 6])
    np.testing.assert_array_equal(done["y"], [4, 6])


def test_push_closing_a_pushpull_round_answers_only_real_tokens():
    """A plain push that closes a round holding another worker's pushpull answers exactly both callers."""
    state = make(2)
    assert state.pushpull("x", 0, "k", ro([1, 2])) == []
    done = by_token(state.push("y", 1, "k", ro([3, 4])))
    assert set(done) == {"x", "y"}
    assert done["y"] is None
    np.testing.assert_array_equal(done["x"], [4, 6])


def test_deferred_pushpull_is_answered_once_its_round_closes():
    """A pushpull deferred to the next round gets the next round's value and no stray completions appear."""
    state = make(2)
    state.push("a", 0, "k", ro([1, 0]))
    assert state.pushpull("x", 0, "k", ro([5, 0])) == []
    assert set(tokens(state.push("b", 1, "k", ro([0, 1])))) == {"a", "b"}
    done = by_token(state.push("c", 1, "k", ro([0, 5])))
    assert set(done) == {"x", "c"}
    np.testing.assert_array_equal(done["x"], [5, 5])


def test_round_of_pushpulls_only_releases_its_pulls_while_a_later_round_stays_open():
    """A round whose pushes are all pushpulls (no bare acks) still releases their pulls on closing,
    also when a later round is open behind it."""
    state = make(2)
    assert state.pushpull("x1", 0, "k", ro([1, 0])) == []
    assert state.pushpull("x2", 0, "k", ro([2, 0])) == []
    done = by_token(state.pushpull("y1", 1, "k", ro([0, 1])))
    assert set(done) == {"x1", "y1"}
    np.testing.assert_array_equal(done["x1"], [1, 1])


# -- dist_async -------------------------------------------------------------------------------------

def test_async_push_is_applied_and_acked_at_once():
    """In async mode each push is acked immediately and becomes the stored value."""
    state = make(3, sync=False)
    assert state.push("a", 2, "k", ro([1, 2])) == [Completion("a")]
    np.testing.assert_array_equal(state.value("k"), [1, 2])


def test_async_shard_counts_record_the_workers_numbering_after_a_lossy_restart():
    """dist_async: a shard records each worker's highest push number applied + 1 (the push's
    ``rounds``), so after a restart that lost pushes a retry of one the next shard holds is screened
    as a retry; pulls still wait for nothing (applied and submitted restored alike)."""
    def add(key, value, stored):
        return stored + value

    def pushed(state: ShardState, token, rnd: int) -> list:
        return state.push_many(0, [(token, "k", ro([1.0]), 0)], rounds=[rnd])

    state = make(1, sync=False, updater=add, init=(0.0,))
    for rnd in range(3):  # pushes 0..2, then the shard
        pushed(state, rnd, rnd)
    (_, value, rounds, applied), = state.applied_state()
    assert applied == {0: 3}
    for rnd in range(3, 6):  # applied and acked after the shard: lost at the restart
        pushed(state, rnd, rnd)
    first = ShardState(1, sync=False, updater=add)
    first.restore("k", value, rounds, applied)
    assert pushed(first, "p6", 6) == [Completion("p6")]  # the worker goes on with its push 6
    (_, value, rounds, applied), = first.applied_state()
    assert applied == {0: 7}, "the shard records the server's count (4), not the push's number (7)"
    np.testing.assert_array_equal(value, [4.0])
    second = ShardState(1, sync=False, updater=add)
    second.restore("k", value, rounds, applied)
    assert second.pull("q", 0, "k")[0].token == "q"  # answered at once
    pushed(second, "p7", 7)
    assert second.applied_state()[0][3] == {0: 8}


def test_async_latest_push_wins():
    """Without an updater, async assigns: the latest push replaces the value (no summing)."""
    state = make(2, sync=False)
    state.push("a", 0, "k", ro([1, 1]))
    state.push("b", 1, "k", ro([5, 6]))
    state.push("c", 0, "k", ro([7, 8]))
    np.testing.assert_array_equal(state.value("k"), [7, 8])


def test_async_pull_after_push_sees_it_immediately():
    """An async pull right after the worker's push is answered at once with that push."""
    state = make(2, sync=False)
    state.push("a", 0, "k", ro([3, 3]))
    [done] = state.pull("p", 0, "k")
    np.testing.assert_array_equal(done.value, [3, 3])


def test_async_pushpull_returns_the_applied_value_only():
    """An async pushpull yields one completion: its own token with the value after its push."""
    state = make(2, sync=False)
    done = state.pushpull("x", 1, "k", ro([2, 9]))
    assert tokens(done) == ["x"]
    np.testing.assert_array_equal(done[0].value, [2, 9])


# -- updater ----------------------------------------------------------------------------------------

def test_sync_updater_gets_key_round_sum_and_stored_and_its_result_is_stored():
    """At round close the updater is called once with (key, sum, stored) and its return is stored."""
    calls = []

    def updater(key, total, stored):
        calls.append((key, total.copy(), stored.copy()))
        return stored - 0.5 * total

    state = make(2, updater=updater, init=(10.0, 20.0))
    state.push("a", 0, "k", ro([1, 2]))
    assert calls == []
    state.push("b", 1, "k", ro([3, 4]))
    assert len(calls) == 1
    key, total, stored = calls[0]
    assert key == "k"
    np.testing.assert_array_equal(total, [4, 6])
    np.testing.assert_array_equal(stored, [10, 20])
    np.testing.assert_array_equal(state.value("k"), [8, 17])


def test_async_updater_runs_on_every_push():
    """In async mode the updater runs per push with that push's value and the current stored value."""
    seen = []

    def updater(key, grad, stored):
        seen.append((grad.copy(), stored.copy()))
        return stored + grad

    state = make(2, sync=False, updater=updater, init=(1.0, 1.0))
    state.push("a", 0, "k", ro([1, 2]))
    state.push("b", 1, "k", ro([10, 20]))
    assert len(seen) == 2
    np.testing.assert_array_equal(seen[1][1], [2, 3])
    np.testing.assert_array_equal(state.value("k"), [12, 23])


# -- errors leave the state unchanged ---------------------------------------------------------------

def assert_normal_round_works(state: ShardState, expected_before) -> None:
    """The value is still ``expected_before`` and a clean 2-worker round stores its sum."""
    np.testing.assert_array_equal(state.value("k"), expected_before)
    for w in range(state.num_workers):
        assert state.pull(f"check-pull{w}", w, "k") != []  # no phantom pending push
    state.push("ok0", 0, "k", ro([1, 2]))
    done = state.push("ok1", 1, "k", ro([3, 4]))
    assert sorted(tokens(done)) == ["ok0", "ok1"]
    np.testing.assert_array_equal(state.value("k"), [4, 6])


def test_missing_key_raises_key_not_initialized_and_changes_nothing():
    """push/pull/pushpull/value of an unknown key raise KeyNotInitializedError; no key is created."""
    state = make(2)
    for call in (lambda: state.push("t", 0, "nope", ro([1, 2])), lambda: state.pull("t", 0, "nope"),
                 lambda: state.pushpull("t", 0, "nope", ro([1, 2])), lambda: state.value("nope")):
        with pytest.raises(KeyNotInitializedError):
            call()
    assert "nope" not in state and len(state) == 1
    assert_normal_round_works(state, [0, 0])


@pytest.mark.parametrize("method", ["push", "pushpull"])
def test_shape_mismatch_raises_and_changes_nothing(method):
    """A push of the wrong shape raises ShapeMismatchError and is not counted in the round."""
    state = make(2)
    with pytest.raises(ShapeMismatchError):
        getattr(state, method)("bad", 0, "k", ro([1, 2, 3]))
    assert_normal_round_works(state, [0, 0])


@pytest.mark.parametrize("method", ["push", "pushpull"])
def test_dtype_mismatch_raises_and_changes_nothing(method):
    """A push of the wrong dtype raises DTypeMismatchError and is not counted in the round."""
    state = make(2)
    with pytest.raises(DTypeMismatchError):
        getattr(state, method)("bad", 1, "k", ro([1, 2], dtype=np.float32))
    assert_normal_round_works(state, [0, 0])


def test_bad_push_mid_round_keeps_the_open_round_intact():
    """A rejected push in the middle of a round neither closes nor spoils it."""
    state = make(2)
    state.push("a", 0, "k", ro([1, 1]))
    with pytest.raises(ShapeMismatchError):
        state.push("bad", 1, "k", ro([[1, 1]]))
    done = state.push("b", 1, "k", ro([2, 2]))
    assert sorted(tokens(done)) == ["a", "b"]
    np.testing.assert_array_equal(state.value("k"), [3, 3])


def test_duplicate_init_raises_and_keeps_the_first_value():
    """init of an existing key raises DuplicateInitError and the first value stays."""
    state = make(2, init=(5.0, 6.0))
    with pytest.raises(DuplicateInitError):
        state.init("k", np.array([7.0, 8.0]))
    assert_normal_round_works(state, [5, 6])


@pytest.mark.parametrize("worker", [-1, 2, 100, "0", None, 1.0], ids=repr)
@pytest.mark.parametrize("method", ["push", "pull", "pushpull"])
def test_bad_worker_rank_raises_and_changes_nothing(method, worker):
    """A worker rank outside [0, num_workers) or not an int raises ValueError and changes nothing."""
    state = make(2)
    args = ("bad", worker, "k") if method == "pull" else ("bad", worker, "k", ro([1, 2]))
    with pytest.raises(ValueError, match="worker rank"):
        getattr(state, method)(*args)
    assert_normal_round_works(state, [0, 0])


def test_int_and_str_keys_are_separate():
    """Key 3 and key "3" hold separate values."""
    state = ShardState(1, sync=True)
    state.init(3, np.array([1.0]))
    state.init("3", np.array([2.0]))
    state.push("t", 0, 3, ro([5.0]))
    np.testing.assert_array_equal(state.value(3), [5])
    np.testing.assert_array_equal(state.value("3"), [2])
    assert len(state) == 2


# -- ownership of arrays ----------------------------------------------------------------------------

def test_init_copies_the_given_value():
    """Changing the array given to init afterwards does not change the stored value."""
    state = ShardState(1, sync=True)
    value = np.array([1.0, 2.0])
    state.init("k", value)
    value[:] = 99
    np.testing.assert_array_equal(state.value("k"), [1, 2])


@pytest.mark.parametrize("num_workers,sync", [(1, True), (2, True), (3, True), (2, False)])
def test_pulled_arrays_are_never_modified_by_later_rounds(num_workers, sync):
    """An array returned by pull keeps its values through later rounds (replies need no copy)."""
    state = make(num_workers, sync=sync, init=(1.0, 1.0))
    handed_out = []
    for round_no in range(4):
        for w in range(num_workers):
            state.push((round_no, w), w, "k", np.array([round_no + 1.0, w + 1.0]))
        [done] = state.pull(("pull", round_no), 0, "k")
        handed_out.append((done.value, done.value.copy()))
    for array, snapshot in handed_out:
        np.testing.assert_array_equal(array, snapshot)


def test_pulled_arrays_survive_rounds_with_an_updater():
    """With an updater that returns a new array, earlier pulled arrays keep their values."""
    state = make(2, updater=lambda key, total, stored: stored - total, init=(10.0, 10.0))
    [first] = state.pull("p", 0, "k")
    for r in range(3):
        state.push(("a", r), 0, "k", ro([1, 1]))
        state.push(("b", r), 1, "k", ro([1, 1]))
    np.testing.assert_array_equal(first.value, [10, 10])
    np.testing.assert_array_equal(state.value("k"), [4, 4])


@pytest.mark.parametrize("num_workers,sync", [(1, True), (2, True), (4, True), (3, False)])
def test_pushed_arrays_are_never_written(num_workers, sync):
    """Read-only pushed arrays (received frames) are accepted and keep their values through many rounds."""
    state = make(num_workers, sync=sync)
    pushed = []
    for round_no in range(3):
        for w in range(num_workers):
            value = ro([round_no + 1.0, 10.0 * (w + 1)])
            pushed.append((value, value.copy()))
            state.push(("push", round_no, w), w, "k", value)
    for w in range(num_workers):  # pushpull and backlog paths too
        value = ro([7.0, 7.0])
        pushed.append((value, value.copy()))
        state.pushpull(("pp", w), w, "k", value)
    for value, snapshot in pushed:
        np.testing.assert_array_equal(value, snapshot)
    expected = [7.0, 7.0] if not sync else [7.0 * num_workers] * 2
    np.testing.assert_array_equal(state.value("k"), expected)


def test_writable_pushed_arrays_are_never_written():
    """Writable pushed arrays are not used as accumulators either (values unchanged after the round)."""
    state = make(3)
    values = [np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([5.0, 6.0])]
    for w, value in enumerate(values):
        state.push(w, w, "k", value)
    np.testing.assert_array_equal(values, [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(state.value("k"), [9, 12])


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_sync_round_sum_is_taken_in_rank_order_whatever_the_arrival(order):
    """Float sums depend on order; the round sums in worker-rank order, so every arrival order agrees."""
    values = {0: np.float32([1e8]), 1: np.float32([1.0]), 2: np.float32([-1e8])}
    s = ShardState(3, sync=True)
    s.init("k", np.zeros(1, np.float32))
    for worker in order:
        s.push(("t", worker), worker, "k", values[worker])
    expected = (values[0] + values[1]) + values[2]
    assert s.value("k").tobytes() == expected.tobytes()
    assert expected[0] != (values[0] + values[2] + values[1])[0]  # the order does matter here


def test_leave_closes_rounds_that_waited_only_for_the_leaver():
    """A sync round missing only a worker that leaves closes at once, summing the pushes it has."""
    state = ShardState(3, sync=True)
    state.init("k", np.zeros(2))
    assert state.push("t0", 0, "k", ro([1.0, 1.0])) == []
    assert state.push("t1", 1, "k", ro([2.0, 2.0])) == []
    assert sorted(tokens(state.leave(2))) == ["t0", "t1"]
    np.testing.assert_array_equal(state.value("k"), [3.0, 3.0])
    assert tokens(state.push("t2", 0, "k", ro([1.0, 1.0]))) == []  # now rounds need 0 and 1 only
    assert tokens(state.push("t3", 1, "k", ro([5.0, 5.0]))) == ["t2", "t3"]
    np.testing.assert_array_equal(state.value("k"), [6.0, 6.0])


def test_leave_moves_backlogged_pushes_into_rounds_that_then_close():
    """A worker's backlog of pushes drains round by round once the only other worker left."""
    state = ShardState(2, sync=True)
    state.init("k", np.zeros(1))
    state.push("a", 0, "k", ro([1.0]))
    state.push("b", 0, "k", ro([2.0]))  # waits for the next round
    pull = state.pull("p", 0, "k")
    assert pull == []
    done = state.leave(1)
    assert tokens(done) == ["a", "b", "p"]
    np.testing.assert_array_equal(by_token(done)["p"], [2.0])


def test_a_left_worker_cannot_push_and_nothing_changes():
    """Pushes and pushpulls from a worker that left are refused before anything changes."""
    state = ShardState(2, sync=True)
    state.init("k", np.zeros(1))
    state.leave(1)
    for call in (lambda: state.push("t", 1, "k", ro([1.0])), lambda: state.pushpull("t", 1, "k", ro([1.0]))):
        with pytest.raises(ValueError, match="left"):
            call()
    np.testing.assert_array_equal(state.value("k"), [0.0])
    assert tokens(state.pull("p", 1, "k")) == ["p"]  # it may still read


def test_leave_of_an_unknown_worker_is_refused():
    """leave() takes ranks in [0, num_workers) only."""
    with pytest.raises(ValueError):
        ShardState(2, sync=True).leave(2)


def test_a_leavers_pending_push_still_counts_but_is_not_acknowledged():
    """A worker that leaves with a push in an open round: the push is summed, its ack is not sent,
    its waiting pull is dropped, and leaving again changes nothing."""
    state = ShardState(2, sync=True)
    state.init("k", np.zeros(1))
    assert state.push("t1", 1, "k", ro([2.0])) == []
    assert state.pull("p1", 1, "k") == []  # waits for its own push
    assert state.leave(1) == [] and state.leave(1) == []
    assert tokens(state.push("t0", 0, "k", ro([1.0]))) == ["t0"]
    np.testing.assert_array_equal(state.value("k"), [3.0])


# -- chunked contributions --------------------------------------------------------------------------

def make_flat(num_workers: int, size: int = 10, sync: bool = True, dtype=np.float32,
              updater=None) -> ShardState:
    """A ShardState holding key 'k': ``size`` zeros of ``dtype``."""
    state = ShardState(num_workers, sync=sync, updater=updater)
    state.init("k", np.zeros(size, dtype))
    return state


def split(value: np.ndarray, bounds) -> list[tuple[int, np.ndarray]]:
    """``(lo, chunk)`` for each ``[bounds[i], bounds[i + 1])`` of ``value``, chunks read-only views."""
    frozen = value.copy()
    frozen.setflags(write=False)
    return [(lo, frozen[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def wild_float32(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random float32 values over many magnitudes, so that the order of a sum changes its bits."""
    return (rng.standard_normal(size) * 10.0 ** rng.uniform(-3, 7, size)).astype(np.float32)


def interleavings(queues: list[list]):
    """Every merge of ``queues`` that keeps each queue's own order."""
    if not any(queues):
        yield []
        return
    for i, queue in enumerate(queues):
        if queue:
            rest = queues[:i] + [queue[1:]] + queues[i + 1:]
            for tail in interleavings(rest):
                yield [queue[0]] + tail


def send(state: ShardState, messages, method: str = "push") -> list[Completion]:
    """Push ``(token, worker, lo, chunk)`` messages in order; return every completion."""
    done = []
    for token, worker, lo, chunk in messages:
        done += getattr(state, method)(token, worker, "k", chunk, lo=lo)
    return done


def test_interleavings_helper_counts_multiset_permutations():
    """The interleavings of 3 queues of 3 are the 9!/(3!3!3!) orders itertools.permutations yields."""
    got = {tuple(order) for order in interleavings([["a"] * 3, ["b"] * 3, ["c"] * 3])}
    assert got == set(itertools.permutations("aaabbbccc")) and len(got) == 1680


@pytest.mark.parametrize("bounds", [(0, 10), (0, 4, 10), (0, 3, 7, 10)], ids=str)
def test_chunked_sync_sum_is_rank_order_sum_in_every_interleaving(bounds):
    """3 workers' chunks, in every arrival order that keeps each worker's own order, give the
    bit-identical ((v0 + v1) + v2); only the last message closes the round and acks every chunk."""
    rng = np.random.default_rng(7)
    values = [wild_float32(rng, 10) for _ in range(3)]
    expected = ((values[0] + values[1]) + values[2]).tobytes()
    assert expected != ((values[2] + values[1]) + values[0]).tobytes()  # the order does matter here
    queues = [[((w, lo), w, lo, chunk) for lo, chunk in split(values[w], bounds)] for w in range(3)]
    count = 0
    for order in interleavings(queues):
        state = make_flat(3)
        for token, worker, lo, chunk in order[:-1]:
            assert state.push(token, worker, "k", chunk, lo=lo) == []
        token, worker, lo, chunk = order[-1]
        done = state.push(token, worker, "k", chunk, lo=lo)
        assert sorted(tokens(done)) == sorted(m[0] for m in order)
        assert state.value("k").tobytes() == expected
        assert state.held_bytes() == 0
        count += 1
    assert count == {2: 6, 3: 90, 4: 1680}[len(bounds)]


def test_chunked_sync_over_many_rounds_with_a_random_sample_of_orders():
    """A seeded random sample of arrival orders for 4 workers and 3 rounds (workers run ahead):
    every round stores its rank-order sum and holds nothing once closed."""
    rng = np.random.default_rng(3)
    shuffle = random.Random(5)
    bounds = (0, 2, 5, 9, 12)
    rounds = [[wild_float32(rng, 12) for _ in range(4)] for _ in range(3)]
    sums = [(((r[0] + r[1]) + r[2]) + r[3]).tobytes() for r in rounds]
    for _ in range(100):
        queues = [[((n, w, lo), w, lo, chunk) for n in range(3) for lo, chunk in split(rounds[n][w], bounds)]
                  for w in range(4)]
        order = []
        while any(queues):
            queue = shuffle.choice([q for q in queues if q])
            order.append(queue.pop(0))
        state, seen = make_flat(4, 12), []
        for message in order:
            done = send(state, [message])
            if done:
                seen.append(state.value("k").tobytes())
                n = len(seen) - 1
                assert sorted(tokens(done)) == sorted((n, w, lo) for w in range(4) for lo in bounds[:-1])
        assert seen == sums
        assert state.held_bytes() == 0


def test_held_bytes_counts_the_accumulator_and_held_chunks_and_returns_to_zero():
    """held_bytes: 0 before a round, the accumulator (and chunks waiting for lower ranks) during it,
    0 again once it closes, round after round."""
    state = make_flat(2, size=8)
    chunk = np.ones(4, np.float32)
    for _ in range(3):
        assert state.held_bytes() == 0
        state.push("b0", 1, "k", chunk, lo=0)        # rank 1 first: held until rank 0 comes
        assert state.held_bytes() == chunk.nbytes
        state.push("a0", 0, "k", chunk, lo=0)        # both added into an 8-element accumulator
        assert state.held_bytes() == 8 * 4
        state.push("a1", 0, "k", chunk, lo=4)
        assert state.held_bytes() == 8 * 4
        assert len(state.push("b1", 1, "k", chunk, lo=4)) == 4
        np.testing.assert_array_equal(state.value("k"), np.full(8, 2.0))
    assert state.held_bytes() == 0


def test_a_worker_running_ahead_holds_at_most_its_own_chunks():
    """While rank 0 has sent nothing, ranks 1 and 2 sending their whole contribution (rank 2 two of
    them) hold exactly their chunks, no accumulator; rank 0's chunks then fold everything in."""
    size, bounds = 1000, (0, 250, 500, 750, 1000)
    rng = np.random.default_rng(11)
    state = make_flat(3, size)
    values = {(n, w): wild_float32(rng, size) for n in range(2) for w in range(3)}
    send(state, [((0, 2, lo), 2, lo, c) for lo, c in split(values[0, 2], bounds)])
    assert state.held_bytes() == size * 4          # its 4 chunks of 1 kB
    send(state, [((1, 2, lo), 2, lo, c) for lo, c in split(values[1, 2], bounds)])
    assert state.held_bytes() == 2 * size * 4      # and its next contribution's
    send(state, [((0, 1, lo), 1, lo, c) for lo, c in split(values[0, 1], bounds)])
    assert state.held_bytes() == 3 * size * 4
    chunks0 = split(values[0, 0], bounds)
    send(state, [((0, 0, 0), 0, *chunks0[0])])     # part [0, 250) of all three folds: 1 accumulator
    assert state.held_bytes() == size * 4 + (2 * 3 + 4) * 250 * 4
    done = send(state, [((0, 0, lo), 0, lo, c) for lo, c in chunks0[1:]])
    assert len(done) == 12
    assert state.value("k").tobytes() == ((values[0, 0] + values[0, 1]) + values[0, 2]).tobytes()
    assert state.held_bytes() == size * 4          # round 2 holds rank 2's chunks only


def test_in_rank_order_arrival_holds_only_the_accumulator():
    """Chunks that arrive with lower ranks already in are added at once: nothing but the accumulator
    is held, whatever the number of workers."""
    state = make_flat(5, size=100)
    for w in range(5):
        for lo, chunk in split(np.full(100, w, np.float32), (0, 50, 100)):
            state.push((w, lo), w, "k", chunk, lo=lo)
            assert state.held_bytes() == (0 if w == 4 and lo == 50 else 100 * 4)
    np.testing.assert_array_equal(state.value("k"), np.full(100, 10.0))


def test_chunks_and_whole_pushes_of_a_round_use_one_accumulator_not_the_pushed_arrays():
    """Chunked rounds sum into an owned buffer: the pushed chunks are neither written nor kept."""
    state = make_flat(2, size=6)
    pushed = [split(np.arange(6, dtype=np.float32) * (w + 1), (0, 3, 6)) for w in range(2)]
    snapshots = [[c.copy() for _, c in chunks] for chunks in pushed]
    send(state, [(("t", w, lo), w, lo, c) for w in range(2) for lo, c in pushed[w]])
    np.testing.assert_array_equal(state.value("k"), np.arange(6) * 3.0)
    for chunks, snapshot in zip(pushed, snapshots):
        for (_, chunk), copy in zip(chunks, snapshot):
            np.testing.assert_array_equal(chunk, copy)
            assert not np.shares_memory(chunk, state.value("k"))


def test_one_worker_whole_push_stores_the_pushed_array_itself():
    """With one worker a whole push is applied without a copy: the stored value is that array."""
    state = make_flat(1, size=4)
    pushed = ro([1, 2, 3, 4], dtype=np.float32)
    assert state.push("t", 0, "k", pushed) == [Completion("t")]
    assert state.value("k") is pushed and np.shares_memory(state.value("k"), pushed)
    assert state.held_bytes() == 0


def test_first_whole_push_is_the_accumulator_until_a_second_one_comes():
    """The round's first whole push is held by reference (counted in held_bytes), and the sum of two
    is a new array sharing memory with neither."""
    state = make_flat(2, size=4)
    a, b = ro([1, 2, 3, 4], dtype=np.float32), ro([10, 20, 30, 40], dtype=np.float32)
    state.push("a", 0, "k", a)
    assert state.held_bytes() == a.nbytes
    state.push("b", 1, "k", b)
    value = state.value("k")
    assert not np.shares_memory(value, a) and not np.shares_memory(value, b)
    np.testing.assert_array_equal(value, [11, 22, 33, 44])


def test_one_worker_chunked_round_closes_on_its_last_chunk():
    """With one worker, each chunk is added at once and the last one closes the round."""
    state = make_flat(1, size=5)
    assert state.push("a", 0, "k", ro([1, 2], dtype=np.float32), lo=0) == []
    assert state.held_bytes() == 5 * 4
    assert tokens(state.push("b", 0, "k", ro([3, 4, 5], dtype=np.float32), lo=2)) == ["a", "b"]
    np.testing.assert_array_equal(state.value("k"), [1, 2, 3, 4, 5])


# -- chunk errors leave the state unchanged ---------------------------------------------------------

def chunk_error_cases():
    """(name, expected error, call on a 2-worker state where worker 0 has pushed chunk [0, 4) of 10)."""
    f32 = np.float32
    return {
        "out of order: skips ahead": (ProtocolError, lambda s: s.push("x", 0, "k", np.ones(2, f32), lo=6)),
        "out of order: restarts": (ProtocolError, lambda s: s.push("x", 0, "k", np.ones(4, f32), lo=0)),
        "out of order: first chunk not at 0": (ProtocolError,
                                               lambda s: s.push("x", 1, "k", np.ones(6, f32), lo=4)),
        "boundary: other end, same start": (ProtocolError,
                                            lambda s: s.push("x", 1, "k", np.ones(3, f32), lo=0)),
        "boundary: whole push over chunks": (ProtocolError,
                                             lambda s: s.push("x", 1, "k", np.ones(10, f32))),
        "past the end": (ShapeMismatchError, lambda s: s.push("x", 0, "k", np.ones(7, f32), lo=4)),
        "negative offset": (ShapeMismatchError, lambda s: s.push("x", 1, "k", np.ones(2, f32), lo=-2)),
        "empty chunk": (ProtocolError, lambda s: s.push("x", 0, "k", np.ones(0, f32), lo=4)),
        "wrong dtype": (DTypeMismatchError, lambda s: s.push("x", 0, "k", np.ones(6, np.float64), lo=4)),
        "2-D chunk": (ShapeMismatchError, lambda s: s.push("x", 0, "k", np.ones((2, 3), f32), lo=4)),
        "offset not an int": (TypeError, lambda s: s.push("x", 0, "k", np.ones(6, f32), lo=4.0)),
        "pushpull out of order": (ProtocolError, lambda s: s.pushpull("x", 0, "k", np.ones(3, f32), lo=7)),
        "pushpull past the end": (ShapeMismatchError,
                                  lambda s: s.pushpull("x", 1, "k", np.ones(11, f32), lo=0)),
    }


@pytest.mark.parametrize("case", list(chunk_error_cases()))
def test_bad_chunk_raises_and_leaves_the_round_as_it_was(case):
    """Each bad chunk raises its error; the value, held bytes and open round are unchanged, and the
    round then completes normally with the right sum and acks."""
    error, call = chunk_error_cases()[case]
    state = make_flat(2)
    state.push("a0", 0, "k", np.arange(4, dtype=np.float32), lo=0)
    before = (state.value("k").copy(), state.held_bytes())
    with pytest.raises(error):
        call(state)
    assert state.value("k").tobytes() == before[0].tobytes() and state.held_bytes() == before[1]
    assert state.pull("p1", 1, "k") != []  # no phantom contribution of worker 1
    done = state.push("a1", 0, "k", np.arange(4, 10, dtype=np.float32), lo=4)
    done += state.push("b0", 1, "k", np.ones(4, np.float32), lo=0)
    done += state.push("b1", 1, "k", np.ones(6, np.float32), lo=4)
    assert sorted(tokens(done)) == ["a0", "a1", "b0", "b1"]
    np.testing.assert_array_equal(state.value("k"), np.arange(10) + 1.0)
    assert state.held_bytes() == 0


@pytest.mark.parametrize("case", list(chunk_error_cases()))
def test_a_bad_entry_of_push_many_changes_nothing(case):
    """push_many raises the error the bad entry's push would raise, and its good entry (another
    key, first in the message) is not pushed either."""
    error, call = chunk_error_cases()[case]
    state = make_flat(2)
    state.init("j", np.zeros(3, np.float32))
    state.push("a0", 0, "k", np.arange(4, dtype=np.float32), lo=0)

    def many(token, worker, key, value, lo=0):
        good = ("g", "j", np.ones(3, np.float32), 0)
        return state.push_many(worker, [good, (token, key, value, lo)])

    with pytest.raises(error):
        call(SimpleNamespace(push=many, pushpull=many))  # the case's push, inside one message
    assert state.held_bytes() == 10 * 4 and state.pull("p1", 1, "k") != []
    np.testing.assert_array_equal(state.value("j"), np.zeros(3, np.float32))
    assert state.pull("pj", 0, "j")[0].value is state.value("j")  # no push of j is pending
    done = state.push("a1", 0, "k", np.ones(6, np.float32), lo=4)
    done += state.push("b0", 1, "k", np.ones(4, np.float32), lo=0)
    done += state.push("b1", 1, "k", np.ones(6, np.float32), lo=4)
    assert sorted(tokens(done)) == ["a0", "a1", "b0", "b1"]


def test_other_offsets_than_the_rounds_are_refused_with_a_message_naming_them():
    """A chunk with the start of another worker's chunk but another end is a ProtocolError naming the
    key, the worker and both ranges; the same offsets from worker 1 then complete the round."""
    state = make_flat(2)
    state.push("a0", 0, "k", np.ones(4, np.float32), lo=0)
    state.push("a1", 0, "k", np.ones(6, np.float32), lo=4)
    with pytest.raises(ProtocolError, match=r"'k': worker 1's chunk \[0, 2\) .* \[0, 4\)"):
        state.push("b0", 1, "k", np.ones(2, np.float32), lo=0)
    state.push("b0", 1, "k", np.ones(4, np.float32), lo=0)
    with pytest.raises(ProtocolError, match=r"\[4, 6\) .* \[4, 10\)"):
        state.push("b1", 1, "k", np.ones(6, np.float32)[:2], lo=4)
    assert len(state.push("b1", 1, "k", np.ones(6, np.float32), lo=4)) == 4
    np.testing.assert_array_equal(state.value("k"), np.full(10, 2.0))


def test_out_of_order_chunk_message_names_key_worker_and_offsets():
    """The out-of-order ProtocolError says which key and worker, the offset sent and the one due."""
    state = make_flat(2)
    state.push("a0", 0, "k", np.ones(4, np.float32), lo=0)
    with pytest.raises(ProtocolError, match=r"'k': worker 0 pushed a chunk at offset 6.*\[0, 4\)"):
        state.push("x", 0, "k", np.ones(2, np.float32), lo=6)


def test_chunks_of_a_value_that_is_not_1d_are_refused():
    """Chunks need a 1-D value: a part of a 2-D key raises ShapeMismatchError; whole pushes work."""
    state = ShardState(1, sync=True)
    state.init("k", np.zeros((2, 3)))
    with pytest.raises(ShapeMismatchError):
        state.push("x", 0, "k", np.ones(3), lo=0)
    with pytest.raises(ShapeMismatchError):
        state.push("x", 0, "k", np.ones(6), lo=0)
    with pytest.raises(ShapeMismatchError):
        state.pull("x", 0, "k", lo=0, hi=3)
    state.push("t", 0, "k", np.ones((2, 3)))
    [done] = state.pull("p", 0, "k")
    assert done.value.shape == (2, 3)


def test_bad_chunk_in_async_assembly_changes_nothing():
    """In async mode too, an out-of-order or past-the-end chunk raises and the assembly goes on."""
    state = make_flat(2, sync=False)
    state.push("a0", 0, "k", np.ones(4, np.float32), lo=0)
    for bad in (lambda: state.push("x", 0, "k", np.ones(2, np.float32), lo=6),
                lambda: state.push("x", 0, "k", np.ones(7, np.float32), lo=4),
                lambda: state.push("x", 0, "k", np.ones(10, np.float32))):
        with pytest.raises((ProtocolError, ShapeMismatchError)):
            bad()
    assert state.held_bytes() == 10 * 4
    np.testing.assert_array_equal(state.value("k"), np.zeros(10))
    assert tokens(state.push("a1", 0, "k", np.full(6, 2, np.float32), lo=4)) == ["a0", "a1"]
    np.testing.assert_array_equal(state.value("k"), [1] * 4 + [2] * 6)


# -- pull and pushpull of chunk ranges --------------------------------------------------------------

def test_pull_of_a_range_is_a_view_of_the_stored_value():
    """pull(lo, hi) answers stored[lo:hi] as a view; hi defaults to the end."""
    state = make_flat(1, size=6)
    state.push("t", 0, "k", np.arange(6, dtype=np.float32))
    [mid] = state.pull("p", 0, "k", lo=2, hi=5)
    np.testing.assert_array_equal(mid.value, [2, 3, 4])
    assert np.shares_memory(mid.value, state.value("k"))
    [tail] = state.pull("q", 0, "k", lo=4)
    np.testing.assert_array_equal(tail.value, [4, 5])
    [whole] = state.pull("r", 0, "k")
    assert whole.value is state.value("k")


@pytest.mark.parametrize("lo,hi", [(-1, 3), (2, 7), (4, 3), (0, 7)])
def test_pull_of_a_range_outside_the_value_is_refused(lo, hi):
    """A pull range not inside [0, size) raises ShapeMismatchError and waits for nothing."""
    state = make_flat(2, size=6)
    state.push("a", 0, "k", np.ones(6, np.float32))
    with pytest.raises(ShapeMismatchError):
        state.pull("p", 0, "k", lo=lo, hi=hi)
    assert tokens(state.push("b", 1, "k", np.ones(6, np.float32))) == ["a", "b"]  # no stray pull


def test_pull_waits_for_a_contribution_its_worker_has_only_started():
    """Read-your-writes: after the first chunk of a contribution, the worker's pull waits for the
    whole contribution's round; another worker's pull does not."""
    state = make_flat(2, size=4)
    state.push("a0", 0, "k", ro([1, 1], dtype=np.float32), lo=0)
    assert state.pull("p0", 0, "k", lo=2, hi=4) == []
    assert tokens(state.pull("p1", 1, "k")) == ["p1"]
    state.push("a1", 0, "k", ro([2, 2], dtype=np.float32), lo=2)
    state.push("b0", 1, "k", ro([1, 1], dtype=np.float32), lo=0)
    done = by_token(state.push("b1", 1, "k", ro([1, 1], dtype=np.float32), lo=2))
    assert set(done) == {"a0", "a1", "b0", "b1", "p0"}
    np.testing.assert_array_equal(done["p0"], [3, 3])


def test_chunked_pushpull_answers_each_chunk_with_its_range_of_the_new_value():
    """Each pushpull chunk is answered, once the round closes, with its own range of the sum."""
    state = make_flat(2, size=5)
    a = np.arange(5, dtype=np.float32)
    b = np.full(5, 10, np.float32)
    done = send(state, [("x0", 0, 0, a[:2]), ("x1", 0, 2, a[2:]), ("y0", 1, 0, b[:2])], "pushpull")
    assert done == []
    done = by_token(state.pushpull("y1", 1, "k", b[2:], lo=2))
    assert set(done) == {"x0", "x1", "y0", "y1"}
    np.testing.assert_array_equal(done["x0"], [10, 11])
    np.testing.assert_array_equal(done["y1"], [12, 13, 14])
    assert np.shares_memory(done["x1"], state.value("k"))


def test_async_chunked_pushpull_is_answered_when_its_contribution_is_applied():
    """Async pushpull chunks wait for the contribution's last chunk, then get their ranges."""
    state = make_flat(2, size=4, sync=False)
    assert state.pushpull("x0", 1, "k", ro([1, 2], dtype=np.float32), lo=0) == []
    done = by_token(state.pushpull("x1", 1, "k", ro([3, 4], dtype=np.float32), lo=2))
    assert set(done) == {"x0", "x1"}
    np.testing.assert_array_equal(done["x0"], [1, 2])
    np.testing.assert_array_equal(done["x1"], [3, 4])


# -- async chunk assembly ---------------------------------------------------------------------------

def test_async_chunks_are_assembled_and_applied_when_the_last_arrives():
    """Async chunks go into an owned buffer; the contribution is applied (and all its chunks acked)
    when the last one arrives; whole pushes of other workers are applied meanwhile."""
    state = make_flat(2, size=6, sync=False)
    first = ro([1, 1, 1], dtype=np.float32)
    assert state.push("a0", 0, "k", first, lo=0) == []
    assert state.held_bytes() == 6 * 4
    np.testing.assert_array_equal(state.value("k"), np.zeros(6))
    assert state.push("b", 1, "k", ro([5] * 6, dtype=np.float32)) == [Completion("b")]
    np.testing.assert_array_equal(state.value("k"), [5] * 6)
    assert tokens(state.push("a1", 0, "k", ro([2, 2, 2], dtype=np.float32), lo=3)) == ["a0", "a1"]
    np.testing.assert_array_equal(state.value("k"), [1, 1, 1, 2, 2, 2])
    assert not np.shares_memory(state.value("k"), first)
    assert state.held_bytes() == 0


def test_async_updater_runs_once_per_chunked_contribution():
    """The updater sees the assembled contribution once, with the stored value, after its last chunk."""
    seen = []

    def updater(key, grad, stored):
        seen.append(grad.copy())
        return stored + grad

    state = make_flat(1, size=4, sync=False, updater=updater)
    for _ in range(2):
        state.push("a", 0, "k", ro([1, 2], dtype=np.float32), lo=0)
        state.push("b", 0, "k", ro([3, 4], dtype=np.float32), lo=2)
    assert len(seen) == 2
    np.testing.assert_array_equal(seen[0], [1, 2, 3, 4])
    np.testing.assert_array_equal(state.value("k"), [2, 4, 6, 8])


# -- later rounds (backlog) with chunks -------------------------------------------------------------

def test_chunks_of_a_worker_ahead_go_to_later_rounds_in_order():
    """Worker 0 sends two whole contributions in chunks and starts a third before worker 1 sends
    anything; each round closes as worker 1 completes its contribution, acking exactly its chunks."""
    state = make_flat(2, size=4)
    a = [np.full(4, 10.0 ** n, np.float32) for n in range(3)]
    msgs = [((n, lo), 0, lo, c) for n in range(3) for lo, c in split(a[n], (0, 1, 4))]
    assert send(state, msgs[:5]) == []
    for n in range(2):
        b = np.full(4, n + 1.0, np.float32)
        assert state.push(("b", n, 0), 1, "k", b[:1], lo=0) == []
        done = state.push(("b", n, 1), 1, "k", b[1:], lo=1)
        assert sorted(tokens(done), key=str) == sorted([(n, 0), (n, 1), ("b", n, 0), ("b", n, 1)], key=str)
        np.testing.assert_array_equal(state.value("k"), a[n] + b)
    # round 3: worker 0 has sent [0, 1) only; worker 1 comes with other offsets than worker 0's
    with pytest.raises(ProtocolError):
        state.push("bad", 1, "k", np.ones(2, np.float32), lo=0)
    state.push(("b", 2), 1, "k", np.ones(4, np.float32)[:1], lo=0)
    state.push(("b", 3), 1, "k", np.ones(3, np.float32), lo=1)
    assert tokens(send(state, msgs[5:])) != []
    np.testing.assert_array_equal(state.value("k"), a[2] + 1)
    assert state.held_bytes() == 0


def test_later_rounds_already_complete_close_with_the_one_before():
    """Workers 0 and 1 send two chunked contributions each while worker 2 sends nothing; when
    worker 2 leaves, both rounds close at once, in order, and a waiting pull sees the second."""
    state = make_flat(3, size=2)
    for n in range(2):
        for w in range(2):
            send(state, [((n, w, lo), w, lo, ro([10.0 ** n * (w + 1)], dtype=np.float32))
                         for lo in (0, 1)])
    assert state.pull("p", 0, "k") == []
    done = state.leave(2)
    assert tokens(done)[-1] == "p" and len(done) == 9
    assert sorted(tokens(done)[:4]) == sorted((0, w, lo) for w in range(2) for lo in (0, 1))
    np.testing.assert_array_equal(by_token(done)["p"], [30, 30])
    assert state.held_bytes() == 0


# -- leave with chunks ------------------------------------------------------------------------------

def test_leave_of_the_lowest_rank_releases_chunks_held_for_it():
    """Ranks 1 and 2 hold chunks waiting for rank 0; rank 0 leaving lets them fold, in rank order,
    and the round closes when rank 1 completes: (v1 + v2), bit for bit."""
    rng = np.random.default_rng(1)
    v1, v2 = wild_float32(rng, 8), wild_float32(rng, 8)
    state = make_flat(3, size=8)
    send(state, [((2, lo), 2, lo, c) for lo, c in split(v2, (0, 4, 8))])
    send(state, [((1, 0), 1, *split(v1, (0, 4, 8))[0])])
    assert state.held_bytes() == 8 * 4 + 4 * 4  # rank 1's chunk [0, 4) only
    assert state.leave(0) == []
    assert state.held_bytes() == 8 * 4 + 4 * 4  # [0, 4) folded (1 then 2); rank 2's [4, 8) waits
    done = state.push((1, 4), 1, "k", split(v1, (0, 4, 8))[1][1], lo=4)
    assert sorted(tokens(done)) == [(1, 0), (1, 4), (2, 0), (2, 4)]
    assert state.value("k").tobytes() == (v1 + v2).tobytes()
    assert state.held_bytes() == 0


def test_a_worker_leaving_part_way_counts_for_the_chunks_it_sent():
    """Rank 1 sends chunk [0, 4) then leaves: that range sums (v0 + v1) + v2, the rest v0 + v2, and
    rank 1's chunk is not acked."""
    rng = np.random.default_rng(2)
    v = [wild_float32(rng, 8) for _ in range(3)]
    state = make_flat(3, size=8)
    send(state, [((2, lo), 2, lo, c) for lo, c in split(v[2], (0, 4, 8))])
    send(state, [((1, 0), 1, *split(v[1], (0, 4, 8))[0])])
    assert state.leave(1) == []
    done = send(state, [((0, lo), 0, lo, c) for lo, c in split(v[0], (0, 4, 8))])
    assert sorted(tokens(done)) == [(0, 0), (0, 4), (2, 0), (2, 4)]
    expected = np.concatenate([((v[0] + v[1]) + v[2])[:4], (v[0] + v[2])[4:]])
    assert state.value("k").tobytes() == expected.tobytes()
    assert state.held_bytes() == 0
    assert tokens(state.pull("p", 1, "k")) == ["p"]  # its contribution is applied: it may read


def test_when_every_worker_left_a_part_way_round_closes_with_zeros_where_none_pushed():
    """If the only contribution of a round is unfinished and everyone left, the round still closes:
    the range it sent is its sum, the rest 0."""
    state = make_flat(2, size=4)
    state.push("t", 1, "k", ro([3, 3], dtype=np.float32), lo=0)
    assert state.leave(1) == []
    assert state.leave(0) == []
    np.testing.assert_array_equal(state.value("k"), [3, 3, 0, 0])
    assert state.held_bytes() == 0


def test_leave_in_async_drops_an_unfinished_contribution():
    """Async: a worker leaving with an unfinished contribution: it is dropped, never applied."""
    state = make_flat(2, size=4, sync=False)
    state.push("t", 1, "k", ro([3, 3], dtype=np.float32), lo=0)
    assert state.pull("p", 1, "k") == []
    assert state.leave(1) == []
    assert state.held_bytes() == 0
    np.testing.assert_array_equal(state.value("k"), np.zeros(4))
    assert tokens(state.pull("q", 1, "k")) == ["q"]


def test_leave_mid_round_with_later_rounds_held():
    """Rank 2 leaves while rank 1 runs two rounds ahead and rank 0 is in round 1: both rounds close
    as rank 0 completes them, each summed in rank order without rank 2."""
    state = make_flat(3, size=4)
    one = np.ones(4, np.float32)
    send(state, [((n, 1, lo), 1, lo, c) for n in range(2) for lo, c in split(one * (n + 1), (0, 2, 4))])
    send(state, [((0, 0, 0), 0, 0, one[:2])])
    assert state.leave(2) == []
    assert sorted(tokens(state.push((0, 0, 2), 0, "k", one[2:], lo=2))) == sorted(
        [(0, 0, 0), (0, 0, 2), (0, 1, 0), (0, 1, 2)])
    np.testing.assert_array_equal(state.value("k"), [2] * 4)
    assert len(send(state, [((1, 0, lo), 0, lo, c) for lo, c in split(one * 5, (0, 2, 4))])) == 4
    np.testing.assert_array_equal(state.value("k"), [7] * 4)
    assert state.held_bytes() == 0


# -- arrival order (KVSTORE_SUM_ORDER=arrival) --------------------------------------------------

def test_arrival_order_adds_each_chunk_at_once_and_holds_nothing():
    """With ordered=False a later rank's early chunks are added on arrival: nothing is held, and the
    round's sum is the arrival-order sum."""
    rng = np.random.default_rng(7)
    values = [rng.standard_normal(8).astype(np.float32) for _ in range(3)]
    state = ShardState(3, sync=True, ordered=False)
    state.init("k", np.zeros(8, np.float32))
    for worker in (2, 0):
        for lo in (0, 4):
            state.push((worker, lo), worker, "k", values[worker][lo:lo + 4], lo)
            assert state.held_bytes() == 8 * 4  # the accumulator only
    done = []
    for lo in (0, 4):
        done += state.push((1, lo), 1, "k", values[1][lo:lo + 4], lo)
    assert sorted(c.token for c in done) == sorted((w, lo) for w in range(3) for lo in (0, 4))
    expected = (values[2] + values[0]) + values[1]
    np.testing.assert_array_equal(state.value("k"), expected)
    assert state.held_bytes() == 0


def test_arrival_order_whole_push_of_one_worker_is_still_not_copied():
    """The zero-copy case holds in arrival order too."""
    state = ShardState(1, sync=True, ordered=False)
    state.init("k", np.zeros(3))
    pushed = ro([1, 2, 3])
    state.push("a", 0, "k", pushed)
    assert state.value("k") is pushed


def test_pull_many_checks_every_entry_before_answering_any():
    """pull_many refuses a message with one bad entry (unknown key, or a partial range where whole
    values are asked for) before registering any pull."""
    state = make(1)
    state.init("j", np.zeros(4))
    with pytest.raises(KeyNotInitializedError):
        state.pull_many(0, [("a", "k", 0, 2), ("b", "nope", 0, 1)])
    with pytest.raises(ShapeMismatchError, match="asks for 3 elements"):
        state.pull_many(0, [("a", "k", 0, 2), ("b", "j", 0, 3)], whole=True)
    done = state.pull_many(0, [("a", "k", 0, 2), ("b", "j", 1, 3)])
    assert [c.token for c in done] == ["a", "b"] and done[1].value.size == 2


# -- chunked INIT and STATE_SET (a first value or a state too big for one message) ------------------

def _snapshot(state: ShardState) -> tuple:
    """What a refused chunk must leave unchanged: the keys held and everything being gathered."""
    tables = {"init": state._staged_inits, "state": state._staged_states}
    staged = {name: {k: (s.worker, s.covered, s.info, [b.tobytes() for b in s.bufs]) for k, s in t.items()}
              for name, t in tables.items()}
    return len(state), state.held_bytes(), staged


def test_init_chunks_store_the_key_only_with_the_last_one():
    """A chunked INIT is gathered aside: until its last chunk the key is not initialised (pulls and
    pushes are refused, ``in`` is False); then it holds exactly the chunks' elements."""
    state = ShardState(2, sync=True)
    value = np.arange(10, dtype=np.float32)
    assert not state.init_chunk(0, "k", ro(value[:4], np.float32), 0, 10)
    assert not state.init_chunk(0, "k", ro(value[4:8], np.float32), 4, 10)
    assert "k" not in state and len(state) == 0
    assert state.held_bytes() == 40  # the buffer being filled
    with pytest.raises(KeyNotInitializedError):
        state.pull("t", 1, "k")
    with pytest.raises(KeyNotInitializedError):
        state.push("t", 1, "k", np.zeros(10, np.float32))
    assert state.init_chunk(0, "k", ro(value[8:], np.float32), 8, 10)
    assert "k" in state and state.held_bytes() == 0
    np.testing.assert_array_equal(state.value("k"), value)
    assert state.value("k").dtype == np.float32
    assert tokens(state.pull("t", 1, "k")) == ["t"]


def _half_staged() -> ShardState:
    """A 2-worker state where worker 0 has sent elements [0, 4) of key 'k' (10 float32 elements)."""
    state = ShardState(2, sync=True)
    state.init_chunk(0, "k", ro(np.ones(4), np.float32), 0, 10)
    return state


@pytest.mark.parametrize("worker,chunk,lo,total,match", [
    (0, ro(np.ones(3), np.float32), 5, 10, r"chunks so far cover \[0, 4\)"),      # a gap
    (0, ro(np.ones(3), np.float32), 2, 10, r"chunks so far cover \[0, 4\)"),      # an overlap
    (1, ro(np.ones(3), np.float32), 4, 10, "worker 0 is sending"),               # another worker
    (0, ro(np.ones(3), np.float32), 4, 12, "first chunk gave 10 elements in all"),
    (0, ro(np.ones(3), np.float64), 4, 10, r"dtypes \['float64'\] differ"),
    (0, ro(np.ones(7), np.float32), 4, 10, r"chunk \[4, 11\) is not inside \[0, 10\)"),
    (0, ro(np.ones(0), np.float32), 4, 10, "non-empty 1-D"),
    (0, ro(np.ones((2, 2)), np.float32), 4, 10, "non-empty 1-D"),
    (0, ro(np.ones(3), np.float32), 4, True, r"not inside \[0, True\)"),
])
def test_a_bad_init_chunk_is_refused_and_changes_nothing(worker, chunk, lo, total, match):
    """A chunk out of order, from another worker, of another total or dtype, outside the value, empty or
    not 1-D is a ProtocolError naming the key; what was gathered is untouched and can be finished."""
    state = _half_staged()
    before = _snapshot(state)
    with pytest.raises(ProtocolError, match=match) as info:
        state.init_chunk(worker, "k", chunk, lo, total)
    assert "INIT of key 'k'" in str(info.value)
    assert before == _snapshot(state) and "k" not in state
    assert state.init_chunk(0, "k", ro(np.full(6, 2.0), np.float32), 4, 10)
    np.testing.assert_array_equal(state.value("k"), [1] * 4 + [2] * 6)


def test_an_init_chunk_that_starts_nowhere_is_refused():
    """A chunk past offset 0 of a key nobody started is refused (nothing to continue)."""
    state = ShardState(1, sync=False)
    with pytest.raises(ProtocolError, match="no chunk at offset 0 came first"):
        state.init_chunk(0, "k", ro([1.0]), 3, 10)
    assert state.held_bytes() == 0 and "k" not in state


def test_init_chunks_of_a_stored_key_or_a_bad_rank_are_refused():
    """A chunk of a key already stored is a DuplicateInitError; a rank out of range a ValueError."""
    state = make()
    with pytest.raises(DuplicateInitError, match="'k' is already initialised"):
        state.init_chunk(0, "k", ro([1.0]), 0, 2)
    with pytest.raises(ValueError, match="worker rank 5"):
        state.init_chunk(5, "new", ro([1.0]), 0, 2)
    assert state.held_bytes() == 0


def test_a_chunk_at_offset_zero_restarts_an_init_and_a_whole_init_replaces_it():
    """A retried init starts again at offset 0, dropping the partial value; a whole INIT of the key
    drops it too, so a later chunk of the old one is a DuplicateInitError."""
    state = _half_staged()
    assert not state.init_chunk(0, "k", ro(np.full(5, 3.0), np.float32), 0, 10)
    assert state.held_bytes() == 40
    assert state.init_chunk(0, "k", ro(np.full(5, 4.0), np.float32), 5, 10)
    np.testing.assert_array_equal(state.value("k"), [3] * 5 + [4] * 5)
    other = _half_staged()
    other.init("k", np.zeros(10, np.float32))
    assert other.held_bytes() == 0
    with pytest.raises(DuplicateInitError):
        other.init_chunk(0, "k", ro(np.ones(6), np.float32), 4, 10)


def test_a_leaving_worker_drops_what_it_was_gathering():
    """An INIT or a state whose sender leaves is dropped (nobody will finish it); others' stay."""
    state = ShardState(3, sync=True)
    state.init_chunk(0, "a", ro(np.ones(2)), 0, 4)
    state.init_chunk(1, "b", ro(np.ones(2)), 0, 4)
    state.init("w", np.zeros(4))
    state.state_chunk(0, "w", [ro(np.ones(2))], 0, (1, ("mom",)))
    state.leave(0)
    assert set(state._staged_inits) == {"b"} and not state._staged_states
    assert state.init_chunk(1, "b", ro(np.ones(2)), 2, 4) and "b" in state


def test_state_chunks_are_returned_whole_with_the_last_one():
    """STATE_SET chunks of every state array are gathered (one array per state, same offsets) and
    handed back whole, in the dtypes sent, once they cover the key's slice here."""
    state = ShardState(2, sync=True)
    state.init("w", np.zeros(6, np.float16))
    mean, master = np.arange(6, dtype=np.float16), np.arange(6, dtype=np.float32) * 10
    info = (3, ("mean", "weight32"))
    assert state.state_chunk(1, "w", [ro(mean[:4], np.float16), ro(master[:4], np.float32)], 0, info) is None
    assert state.held_bytes() == 6 * 2 + 6 * 4
    got = state.state_chunk(1, "w", [ro(mean[4:], np.float16), ro(master[4:], np.float32)], 4, info)
    np.testing.assert_array_equal(got[0], mean)
    np.testing.assert_array_equal(got[1], master)
    assert [a.dtype for a in got] == [np.float16, np.float32]
    assert state.held_bytes() == 0


@pytest.mark.parametrize("arrays,lo,info,match", [
    ([ro(np.ones(2))], 2, (4, ("mom",)), r"\(4, \('mom',\)\) differs from the first chunk's"),
    ([ro(np.ones(2)), ro(np.ones(2))], 2, (3, ("mom",)), "dtypes .* differ"),
    ([ro(np.ones(2)), ro(np.ones(3))], 2, (3, ("mom",)), "all of one length"),
    ([], 2, (3, ()), "non-empty"),
    ([ro(np.ones(2))], 1, (3, ("mom",)), r"cover \[0, 2\)"),
    ([ro(np.ones(3))], 2, (3, ("mom",)), r"\[2, 5\) is not inside \[0, 4\)"),
])
def test_a_bad_state_chunk_is_refused_and_changes_nothing(arrays, lo, info, match):
    """A state chunk with another count or names, another number of arrays, uneven arrays, out of
    order or past the slice is a ProtocolError; the state gathered so far is untouched."""
    state = ShardState(1, sync=True)
    state.init("w", np.zeros(4))
    state.state_chunk(0, "w", [ro(np.ones(2))], 0, (3, ("mom",)))
    before = _snapshot(state)
    with pytest.raises(ProtocolError, match=match):
        state.state_chunk(0, "w", arrays, lo, info)
    assert before == _snapshot(state)
    assert len(state.state_chunk(0, "w", [ro(np.ones(2))], 2, (3, ("mom",)))) == 1


def test_state_chunks_need_a_stored_key_and_a_new_optimizer_drops_them():
    """A state chunk of an unknown key is a KeyNotInitializedError; drop_staged_states forgets every
    state being gathered (a new optimizer drops all state), so a later chunk starts nowhere."""
    state = ShardState(1, sync=True)
    with pytest.raises(KeyNotInitializedError):
        state.state_chunk(0, "w", [ro(np.ones(2))], 0, (1, ("mom",)))
    state.init("w", np.zeros(4))
    state.state_chunk(0, "w", [ro(np.ones(2))], 0, (1, ("mom",)))
    state.drop_staged_states()
    assert state.held_bytes() == 0
    with pytest.raises(ProtocolError, match="no chunk at offset 0"):
        state.state_chunk(0, "w", [ro(np.ones(2))], 2, (1, ("mom",)))

"""Unit tests of kvstore.state.ShardState: sync rounds, async apply, read-your-writes, no I/O."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import DTypeMismatchError, DuplicateInitError, KeyNotInitializedError, ShapeMismatchError
from kvstore.state import Completion, ShardState


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


# -- dist_async -------------------------------------------------------------------------------------

def test_async_push_is_applied_and_acked_at_once():
    """In async mode each push is acked immediately and becomes the stored value."""
    state = make(3, sync=False)
    assert state.push("a", 2, "k", ro([1, 2])) == [Completion("a")]
    np.testing.assert_array_equal(state.value("k"), [1, 2])


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

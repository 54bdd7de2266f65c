"""Unit tests of ShardState.abort: a pushpull refused for its values fails the round on every worker
(those in it at once, those that arrive later by their debt), leaving the key as before it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.core.groups import GroupedShardState
from kvstore.core.shard import Completion, ShardState
from kvstore.errors import CollectiveMismatchError, KVStoreError

WHY = "pushed value of key 'k' has shape (3,), but the key was initialised with shape (2,)"


def make(num_workers: int = 2, sync: bool = True, size: int = 2) -> ShardState:
    """A ShardState holding key 'k' (``size`` zeros)."""
    state = ShardState(num_workers, sync=sync)
    state.init("k", np.zeros(size))
    return state


def errors(done: list[Completion]) -> dict:
    """token -> error of each completion in ``done`` (each must carry one)."""
    assert all(c.error is not None and c.value is None for c in done), done
    return {c.token: c.error for c in done}


def full_round(state: ShardState, workers: list[int], key: str = "k") -> dict:
    """Every worker in ``workers`` pushpulls ones; return token -> value answered."""
    done = []
    for w in workers:
        done += state.pushpull(("pp", w), w, key, np.ones(state.value(key).shape))
    return {c.token: c.value for c in done}


def test_an_open_round_is_aborted_for_everyone_in_it_and_the_key_is_unchanged():
    """Worker 0's pushpull waits in the round; worker 1's refused pushpull aborts it: worker 0 gets a
    CollectiveMismatchError naming the key and worker 1; value and rounds are as before."""
    state = make(2)
    assert state.pushpull("a", 0, "k", np.full(2, 5.0)) == []
    found = errors(state.abort(1, ["k"], WHY))
    assert list(found) == ["a"]
    error = found["a"]
    assert isinstance(error, CollectiveMismatchError) and error.ranks == [1]
    assert "worker 1" in str(error) and "'k'" in str(error) and "shape (3,)" in str(error)
    np.testing.assert_array_equal(state.value("k"), [0, 0])
    assert state.open_rounds() == 0 and state.progress() == 0
    got = full_round(state, [1, 0])  # the next correct round: the right sum on both
    assert set(got) == {("pp", 0), ("pp", 1)} and all(np.all(v == 2) for v in got.values())
    assert state.progress() == 1


def test_a_push_arriving_after_the_abort_is_refused_and_changes_nothing():
    """No round open when worker 1's pushpull is refused: worker 0's push of that round, arriving
    later, is refused with the same error (its debt), then the next round sums as usual."""
    state = make(2)
    assert state.abort(1, ["k"], WHY) == []
    with pytest.raises(CollectiveMismatchError, match="worker 1"):
        state.pushpull("late", 0, "k", np.full(2, 7.0))
    np.testing.assert_array_equal(state.value("k"), [0, 0])
    assert state.open_rounds() == 0
    got = full_round(state, [0, 1])
    assert all(np.all(v == 2) for v in got.values()) and len(got) == 2


def test_two_refused_workers_abort_one_round_once():
    """3 workers, 1 pushes a wrong shape and 2 a wrong dtype: worker 2's refusal pays what it owes
    the round worker 1 aborted (no second abort), worker 0 is refused once, the next round closes."""
    state = make(3)
    assert state.pushpull("w0", 0, "k", np.ones(2)) == []
    assert list(errors(state.abort(1, ["k"], WHY))) == ["w0"]
    assert state.abort(2, ["k"], "dtype float32, the key's is float64") == []
    got = full_round(state, [2, 0, 1])
    assert len(got) == 3 and all(np.all(v == 3) for v in got.values())


def test_chunks_of_an_aborted_contribution_are_refused_until_it_is_whole():
    """Worker 0 sent half of its chunked contribution when the round is aborted: that chunk's ack
    is an error, and its second half, arriving later, is refused (not a ProtocolError)."""
    state = make(2, size=6)
    assert state.push("c0", 0, "k", np.ones(3), lo=0) == []
    assert list(errors(state.abort(1, ["k"], WHY))) == ["c0"]
    with pytest.raises(CollectiveMismatchError):
        state.push("c1", 0, "k", np.ones(3), lo=3)
    done = state.push("n0", 0, "k", np.ones(3), lo=0) + state.push("n1", 0, "k", np.ones(3), lo=3)
    done += state.push("m0", 1, "k", np.ones(3), lo=0) + state.push("m1", 1, "k", np.ones(3), lo=3)
    assert sorted(c.token for c in done) == ["m0", "m1", "n0", "n1"]
    assert all(c.error is None for c in done)
    np.testing.assert_array_equal(state.value("k"), np.full(6, 2.0))


def test_pulls_and_rounds_ahead_fail_with_the_round():
    """Worker 0 pushed two rounds ahead and pulls: both pushes fail and then the pull is answered with
    the value as before them (its client raises the pushes' error, as for any refused push); its next
    push joins the aborted round's number afresh."""
    state = make(2)
    assert state.push("p1", 0, "k", np.ones(2)) + state.push("p2", 0, "k", np.ones(2)) == []
    assert state.pull("pull", 0, "k") == []
    done = state.abort(1, ["k"], WHY)
    assert [c.token for c in done] == ["p1", "p2", "pull"]
    assert sorted(errors(done[:2])) == ["p1", "p2"] and done[2].error is None
    np.testing.assert_array_equal(done[2].value, [0, 0])
    got = full_round(state, [0, 1])
    assert all(np.all(v == 2) for v in got.values()) and state.progress() == 1


def test_a_worker_behind_finishes_its_earlier_round_then_owes_the_aborted_one():
    """Worker 1 closed nothing yet (round 0 waits for worker 0) and is refused in round 1: round 0
    still closes with worker 0's push, worker 0's round-1 push is refused, round 1 then closes (a
    store without an optimizer assigns each round's sum)."""
    state = make(2)
    assert state.push("r0", 1, "k", np.ones(2)) == []
    assert state.abort(1, ["k"], WHY) == []  # round 1: open nowhere
    done = state.push("s0", 0, "k", np.ones(2))
    assert sorted(c.token for c in done) == ["r0", "s0"] and all(c.error is None for c in done)
    with pytest.raises(CollectiveMismatchError):
        state.push("s1", 0, "k", np.full(2, 9.0))
    got = full_round(state, [0, 1])
    assert all(np.all(v == 2) for v in got.values())


def test_a_key_group_is_dissolved_and_not_made_again_while_a_worker_owes_it():
    """Grouped keys: the group's round fails per key; a batch arriving while a debt is open takes the
    per-key path, is refused, and the group forms again once the debt is paid."""
    state = GroupedShardState(2, sync=True, ordered=False, split=lambda t, i: (t, i))
    for key in ("a", "b"):
        state.init(key, np.zeros(2))
    sizes = [2, 2]
    group = state.group_of(["a", "b"], sizes, np.ones(4), create=True)
    assert group is not None and state.push_group(group, 0, "g", np.ones(4), pull=True) == []
    assert sorted(errors(state.abort(1, ["a", "b"], WHY))) == [("g", 0), ("g", 1)]
    assert state.abort(1, ["a", "b"], WHY) == []  # refused again: now worker 0 owes the round
    assert state.group_of(["a", "b"], sizes, np.ones(4), create=True) is None
    with pytest.raises(CollectiveMismatchError):
        state.push_many(0, [("x", "a", np.ones(2), 0), ("y", "b", np.ones(2), 0)], pull=True)
    assert state.group_of(["a", "b"], sizes, np.ones(4), create=True) is not None
    done = []
    for w in (0, 1):
        group = state.group_of(["a", "b"], sizes, np.ones(4), create=True)
        done += state.push_group(group, w, w, np.ones(4), pull=True)
    assert len(done) == 2 and all(np.all(c.value == 2) for c in done)


def test_dist_async_and_unknown_keys_abort_nothing():
    """dist_async has no rounds to abort; keys not held here are skipped; a bad rank raises."""
    state = make(2, sync=False)
    assert state.abort(1, ["k", "elsewhere"], WHY) == []
    assert [c.token for c in state.push("a", 0, "k", np.ones(2))] == ["a"]
    assert make(2).abort(0, ["elsewhere"], WHY) == []
    with pytest.raises(ValueError):
        make(2).abort(5, ["k"], WHY)


def test_a_worker_that_leaves_owes_nothing():
    """A worker that owes an aborted round and leaves: its debt goes with it; the others' continue."""
    state = make(3)
    state.abort(1, ["k"], WHY)
    state.leave(2)
    with pytest.raises(CollectiveMismatchError):
        state.pushpull("owed", 0, "k", np.ones(2))
    got = full_round(state, [0, 1])
    assert len(got) == 2 and all(np.all(v == 2) for v in got.values())


def test_random_aborts_pushes_and_pulls_never_break_the_state():
    """Fuzz: random pushes, pulls, aborts and leaves raise only kvstore's typed errors, answer each
    request at most once, and then the live workers' repeated correct pushpulls keep closing rounds."""
    rng = random.Random(40)
    for trial in range(60):
        workers = rng.randint(2, 4)
        state = make(workers, size=4)
        live, answered, n = list(range(workers)), [], 0
        for _ in range(rng.randint(1, 25)):
            w, op, n = rng.choice(live), rng.random(), n + 1
            try:
                if op < 0.35:
                    answered += state.push(n, w, "k", np.ones(4))
                elif op < 0.55:
                    answered += state.pushpull(n, w, "k", np.ones(4))
                elif op < 0.65:
                    answered += state.pull(n, w, "k")
                elif op < 0.95:
                    answered += state.abort(w, rng.choice([["k"], ["k", "x"], []]), WHY)
                elif len(live) > 1:
                    answered += state.leave(w)
                    live.remove(w)
            except (KVStoreError, ValueError):
                pass
        tokens = [c.token for c in answered]
        assert len(tokens) == len(set(tokens)), (trial, tokens)
        got: dict = {}
        for attempt in range(40):  # the workers' next calls: each pays a debt or joins a round
            for w in live:
                try:
                    answered = state.pushpull(("final", attempt, w), w, "k", np.ones(4))
                except CollectiveMismatchError:
                    continue
                got.update((c.token, c.value) for c in answered if c.value is not None)
        for w in live:  # the rounds go on: no worker is stuck behind an aborted round
            assert sum(1 for t in got if type(t) is tuple and t[2] == w) >= 10, (trial, w, list(got))
        for value in got.values():
            assert np.all(value == value[0]), trial


def quorum(workers: int = 3, need: int = 2) -> ShardState:
    """A dist_sync ShardState of ``workers`` whose rounds close at ``need`` (KVSTORE_SYNC_QUORUM)."""
    state = ShardState(workers, sync=True, quorum=need)
    state.init("k", np.zeros(2))
    return state


def quorum_pushpull(state: ShardState, worker: int, rnd: int, value: float = 1.0) -> list[Completion]:
    """``worker``'s pushpull of ``value`` to 'k' carrying its round ``rnd`` (its own push count)."""
    return state.push_many(worker, [((worker, rnd), "k", np.full(2, value), 0)], pull=True, rounds=[rnd])


def test_a_late_refusal_under_a_quorum_leaves_the_closed_round_and_the_next_alone():
    """Quorum 2 of 3: round 0 closed without worker 0, worker 1 already waits in round 1; worker 0's
    refusal of its round 0 aborts nothing (counted late), and its next push joins round 1."""
    state = quorum()
    done = quorum_pushpull(state, 1, 0) + quorum_pushpull(state, 2, 0)
    assert [c.error for c in done] == [None, None]  # round 0 closed by quorum
    assert quorum_pushpull(state, 1, 1, 10.0) == []  # waits in round 1
    assert state.abort(0, ["k"], WHY, rounds=[0]) == []
    assert state.late == {0: 1} and state.open_rounds() == 1
    done = quorum_pushpull(state, 0, 0, 100.0)  # its client never counted the refused call
    assert {c.token: c.error for c in done} == {(1, 1): None, (0, 0): None}
    assert state.value("k")[0] == pytest.approx(110.0 * 3 / 2)
    assert [c.error for c in quorum_pushpull(state, 2, 1)] == [None]  # late, not refused
    assert state.open_rounds() == 0


def test_a_refusal_under_a_quorum_aborts_its_open_round_and_every_worker_retries_it():
    """Quorum 2 of 3: worker 0's refusal aborts round 0 that worker 1 waits in (it fails, worker 2
    owes it); with every worker's count rolled back, the next step's round 0 sums right."""
    state = quorum()
    assert quorum_pushpull(state, 1, 0) == []
    assert list(errors(state.abort(0, ["k"], WHY, rounds=[0]))) == [(1, 0)]
    with pytest.raises(CollectiveMismatchError):
        quorum_pushpull(state, 2, 0)
    done = quorum_pushpull(state, 1, 0, 10.0) + quorum_pushpull(state, 0, 0, 1.0)
    assert {c.token: c.error for c in done} == {(1, 0): None, (0, 0): None}
    assert state.value("k")[0] == pytest.approx(11.0 * 3 / 2)
    assert [c.error for c in quorum_pushpull(state, 2, 0, 100.0)] == [None]  # late
    assert state.open_rounds() == 0 and state.late == {2: 1}


def test_rounds_must_match_the_keys():
    """An abort naming rounds of another length than its keys raises, changing nothing."""
    state = quorum()
    with pytest.raises(ValueError):
        state.abort(0, ["k"], WHY, rounds=[0, 1])
    assert quorum_pushpull(state, 1, 0) == [] and state.open_rounds() == 1

"""Unit tests of elastic membership in kvstore.core.shard / rejoin: absent slots, joins and leaves."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.rejoin import Rejoins
from kvstore.core.shard import ShardState
from kvstore.errors import ProtocolError


def make(slots: int = 4, present: tuple[int, ...] = (0, 1)) -> tuple[ShardState, Rejoins]:
    """A dist_sync shard of ``slots`` worker slots, ``present`` of them present, holding 'w' = [0, 0]."""
    shard = ShardState(slots, sync=True, ordered=True, window=2, present=present)
    shard.init("w", np.zeros(2))
    return shard, Rejoins(shard)


def push(shard: ShardState, worker: int, value: float, token: str) -> list:
    """Push ``value`` (both elements) from ``worker``; return the tokens answered."""
    return [c.token for c in shard.push(token, worker, "w", np.full(2, value))]


def pulled(shard: ShardState, worker: int) -> list:
    """What a pull of 'w' by ``worker`` answers now (empty while it waits)."""
    return [c.value.tolist() for c in shard.pull("p", worker, "w")]


def test_absent_slots_are_not_waited_for_nor_scaled() -> None:
    """With 2 of 4 slots present, a round closes on their two pushes, summed unscaled."""
    shard, _ = make()
    assert push(shard, 0, 1.0, "a") == []
    assert sorted(push(shard, 1, 2.0, "b")) == ["a", "b"]
    np.testing.assert_array_equal(shard.value("w"), [3.0, 3.0])


def test_an_absent_slot_cannot_push() -> None:
    """A push from an absent slot is refused, as from a worker that left."""
    shard, _ = make()
    with pytest.raises(ValueError):
        push(shard, 2, 1.0, "x")


def test_a_join_counts_from_its_round_and_no_round_is_scaled() -> None:
    """A newcomer joins slot 2 at the first unopened round: the rounds before close with the others'
    sum unscaled, its pull waits for them, and from its round on the sum is over all three."""
    shard, rejoins = make()
    push(shard, 0, 1.0, "r0")  # round 0 opened without slot 2
    first, done = rejoins.begin(2, 1, joining=True)
    assert (first, done) == (1, [])
    assert rejoins.join_at(2, 1, 1, joining=True) == []
    assert pulled(shard, 2) == []  # round 0 is still open: its first pull waits
    push(shard, 1, 2.0, "r0b")  # round 0 closes: 1 + 2, not scaled by 3/2
    np.testing.assert_array_equal(shard.value("w"), [3.0, 3.0])
    for w, v in ((0, 10.0), (1, 20.0)):
        push(shard, w, v, f"r1-{w}")
    np.testing.assert_array_equal(shard.value("w"), [3.0, 3.0])  # round 1 waits for the newcomer
    push(shard, 2, 30.0, "r1-2")
    np.testing.assert_array_equal(shard.value("w"), [60.0, 60.0])


def test_a_leave_after_a_join_sums_the_present_unscaled() -> None:
    """After a join, a worker that leaves between steps shrinks the next rounds to the rest, unscaled."""
    shard, rejoins = make()
    rejoins.begin(2, 1, joining=True)
    rejoins.join_at(2, 1, 0, joining=True)
    shard.leave(1)
    push(shard, 0, 1.0, "a")
    push(shard, 2, 5.0, "b")
    np.testing.assert_array_equal(shard.value("w"), [6.0, 6.0])


def test_a_left_slot_can_be_joined_again_by_a_new_incarnation() -> None:
    """A slot whose member left is absent: a new member joins it with a higher incarnation."""
    shard, rejoins = make(present=(0, 1, 2))
    shard.leave(2)
    push(shard, 0, 1.0, "a")
    push(shard, 1, 1.0, "b")  # round 0 closed by 0 and 1
    first, _ = rejoins.begin(2, 1, joining=True)
    assert first == 1
    rejoins.join_at(2, 1, first, joining=True)
    for w in (0, 1, 2):
        push(shard, w, float(w + 1), f"r1-{w}")
    np.testing.assert_array_equal(shard.value("w"), [6.0, 6.0])  # 1 + 2 + 3 (no updater: the sum)


def test_a_join_of_a_present_slot_is_refused() -> None:
    """A join names an absent slot: one present (or an old incarnation) is refused, changing nothing."""
    shard, rejoins = make()
    with pytest.raises(ProtocolError):
        rejoins.begin(1, 1, joining=True)
    rejoins.begin(2, 1, joining=True)
    with pytest.raises(ProtocolError):
        rejoins.begin(2, 1, joining=True)
    assert shard.active == {0, 1, 2}


def test_a_restart_still_scales_beside_a_newcomer() -> None:
    """A restart's quorum scaling is unchanged by a newcomer: the away worker still counts."""
    shard, rejoins = make(present=(0, 1, 2))
    rejoins.begin(3, 1, joining=True)
    rejoins.join_at(3, 1, 0, joining=True)
    rejoins.away(2, 0)
    for w in (0, 1, 3):
        push(shard, w, 1.0, f"a{w}")
    np.testing.assert_array_equal(shard.value("w"), [4.0, 4.0])  # 3 pushes scaled by 4/3


def _restored(present: tuple[int, ...] = (0, 1, 2)) -> ShardState:
    """A 3-slot dist_sync shard as a server restarted from its shard finds it: 'w' restored at round 5
    (workers 0 and 1 applied 5 each), the slots ``present`` in its map."""
    shard = ShardState(3, sync=True, ordered=True, present=present)
    shard.restore("w", np.zeros(2), 5, {0: 5, 1: 5})
    return shard


def test_a_restarted_server_takes_a_joins_first_step_for_a_slot_present_in_its_map() -> None:
    """A server restarted after a join was admitted (slot 2 present in its map, never counted there)
    takes the join's first REJOIN as the slot's join: round 5, opened by 0 and 1 before, closes
    without the newcomer and unscaled (1 + 2, not x 3/2), and round 6 waits for it."""
    shard = _restored()
    rejoins = Rejoins(shard, restarted=True)
    push(shard, 0, 1.0, "a5")
    push(shard, 1, 2.0, "b5")
    first, done = rejoins.begin(2, 1, joining=True)
    assert (first, done) == (6, [])
    assert sorted(c.token for c in rejoins.join_at(2, 1, first, joining=True)) == ["a5", "b5"]
    np.testing.assert_array_equal(shard.value("w"), [3.0, 3.0])
    assert push(shard, 0, 1.0, "a6") == [] and push(shard, 1, 1.0, "b6") == []
    assert sorted(push(shard, 2, 1.0, "c6")) == ["a6", "b6", "c6"]


def test_a_server_never_restarted_still_refuses_a_join_of_a_present_slot() -> None:
    """Without a restart, a join's first step for a present slot is refused, changing nothing (its map
    saw every admission)."""
    shard = _restored()
    rejoins = Rejoins(shard)
    with pytest.raises(ProtocolError, match="not absent"):
        rejoins.begin(2, 1, joining=True)
    assert rejoins.current == {} and shard.newcomers == set()


def test_a_restarted_server_takes_a_joins_second_step_for_a_slot_its_align_made_away() -> None:
    """The joiner's ALIGN to the restarted server said it was rejoining, so slot 2 is away there; the
    join's second step alone (the first was lost with the old server) takes the slot as a join: it
    counts from ``at`` and the rounds from there are summed over all three, unscaled."""
    shard = _restored()
    rejoins = Rejoins(shard, restarted=True)
    rejoins.away(2, 0)
    assert rejoins.join_at(2, 1, 5, joining=True) == []
    assert 2 in shard.active and 2 not in shard.away and shard.newcomers == {2}
    for w, v in ((0, 1.0), (1, 2.0), (2, 3.0)):
        push(shard, w, v, f"r5-{w}")
    np.testing.assert_array_equal(shard.value("w"), [6.0, 6.0])


def test_a_join_of_a_slot_whose_incarnation_a_restarted_server_counts_is_refused() -> None:
    """A restarted server that counts incarnation 1 of slot 2 refuses a join of it: its slot is held."""
    shard = _restored()
    rejoins = Rejoins(shard, restarted=True)
    rejoins.away(2, 0)
    first, _ = rejoins.begin(2, 1)
    rejoins.join_at(2, 1, first)
    with pytest.raises(ProtocolError, match="not absent"):
        rejoins.begin(2, 2, joining=True)
    assert rejoins.current == {2: 1} and shard.newcomers == set()


def test_present_must_be_slots() -> None:
    """Present ranks outside the slots are refused."""
    with pytest.raises(ValueError):
        ShardState(2, sync=True, present=(0, 5))


# -- dist_async: a join learns the job's update count; under a staleness bound it starts level -------

def make_async(slots: int = 3, present: tuple[int, ...] = (0, 1),
               staleness: int | None = None) -> tuple[ShardState, Rejoins]:
    """A dist_async shard of ``slots`` slots, ``present`` of them present, holding 'w' = [0, 0] updated
    by sgd with lr 1 (each push lowers it by the value pushed)."""
    shard = ShardState(slots, sync=False, updater=lambda key, grad, weight: weight - grad,
                       staleness=staleness, present=present)
    shard.init("w", np.zeros(2))
    return shard, Rejoins(shard)


def pushes(shard: ShardState, worker: int, count: int, tag: str) -> list:
    """``count`` pushes of 1 from ``worker``; the tokens they answer."""
    return [t for i in range(count) for t in push(shard, worker, 1.0, f"{tag}{i}")]


def test_a_dist_async_join_learns_the_jobs_update_count_and_a_restart_its_own_steps() -> None:
    """dist_async: a new member's step is the key's update count (every worker's pushes applied), its
    round the slot's own count (0: never held); a restarted worker's step stays its own pushes."""
    shard, rejoins = make_async()
    pushes(shard, 0, 3, "a")
    pushes(shard, 1, 2, "b")
    first, _ = rejoins.begin(2, 1, joining=True)
    assert (first, rejoins.step(first, joining=True)) == (0, 5)
    assert rejoins.join_at(2, 1, 0, joining=True) == []
    assert pulled(shard, 2) == [[-5.0, -5.0]]  # the servers' latest value, at once
    assert push(shard, 2, 1.0, "c") == ["c"]  # applied on arrival, as any worker's
    first, _ = rejoins.begin(1, 1)  # a restart of worker 1: its own steps
    assert (first, rejoins.step(first)) == (2, 2)
    np.testing.assert_array_equal(shard.value("w"), [-6.0, -6.0])


def test_a_dist_async_left_slot_joined_again_numbers_on_from_the_slot_and_learns_the_job() -> None:
    """A slot left for good and joined by a new incarnation: its round (the origin of its push numbers)
    is the slot's count, so its pushes follow the old member's; its step the job's update count."""
    shard, rejoins = make_async(present=(0, 1))
    pushes(shard, 1, 3, "a")
    shard.leave(1)
    pushes(shard, 0, 4, "b")
    first, _ = rejoins.begin(1, 1, joining=True)
    assert (first, rejoins.step(first, joining=True)) == (3, 7)
    rejoins.join_at(1, 1, first, joining=True)
    assert pushes(shard, 1, 2, "c") == ["c0", "c1"]
    assert shard.applied_state()[0][3] == {0: 4, 1: 5}  # the slot's numbering goes on: 3 + 2
    np.testing.assert_array_equal(shard.value("w"), [-9.0, -9.0])  # every push applied once


def test_in_dist_sync_a_joins_step_is_its_round() -> None:
    """dist_sync: the step a joiner learns is the round it joins at."""
    shard, rejoins = make()
    push(shard, 0, 1.0, "a")
    push(shard, 1, 1.0, "b")
    first, _ = rejoins.begin(2, 1, joining=True)
    assert (first, rejoins.step(first, joining=True)) == (1, 1)


def test_under_staleness_a_newcomer_starts_level_with_the_slowest_and_holds_no_one() -> None:
    """KVSTORE_STALENESS=1: workers 0 and 1 have pushed 4 times each when worker 2 joins a never-held
    slot; it counts as level with them, so worker 0's next push (1 ahead) is acknowledged, as is the
    newcomer's own; counted from 0 it would have held worker 0's acks until it had pushed 4 times."""
    shard, rejoins = make_async(staleness=1)
    for i in range(4):
        assert push(shard, 0, 1.0, f"a{i}") == [f"a{i}"]
        assert push(shard, 1, 1.0, f"b{i}") == [f"b{i}"]
    rejoins.begin(2, 1, joining=True)
    rejoins.join_at(2, 1, 0, joining=True)
    assert push(shard, 0, 1.0, "a4") == ["a4"]
    assert push(shard, 2, 1.0, "c0") == ["c0"]
    assert push(shard, 0, 1.0, "a5") == []  # 2 ahead of worker 1 (and the newcomer): held
    assert sorted(push(shard, 1, 1.0, "b4")) == ["a5", "b4"]
    assert shard.gate.max_lead == 2


def test_under_staleness_a_left_slots_new_member_is_not_held_by_its_predecessors_count() -> None:
    """A slot whose old member pushed 6 times left; worker 0 has pushed 2: the new member of the slot
    counts level with worker 0, so its pushes are acknowledged (counted from 6, all would be held)."""
    shard, rejoins = make_async(present=(0, 1), staleness=1)
    for i in range(6):
        push(shard, 1, 1.0, f"b{i}")
        if i < 2:
            push(shard, 0, 1.0, f"a{i}")
    shard.leave(1)
    rejoins.begin(1, 1, joining=True)
    rejoins.join_at(1, 1, 6, joining=True)
    assert push(shard, 1, 1.0, "c0") == ["c0"]
    assert push(shard, 0, 1.0, "a2") == ["a2"]


def _restarted_and_joined(retire: bool) -> tuple[ShardState, list]:
    """Worker 1 of 3 restarted (rejoined at round 1) and slot 3 joined at round 1 by a newcomer; round 0
    closed, then three more rounds pushed by all four; ``retire`` calls retire_joins() after round 0.
    Returns the shard and what retire_joins() returned at each call (before and after round 0)."""
    shard = ShardState(4, sync=True, ordered=True, window=2, present=(0, 1, 2))
    shard.init("w", np.zeros(2))
    rejoins = Rejoins(shard)
    push(shard, 0, 1.0, "a0")
    push(shard, 2, 2.0, "c0")
    rejoins.away(1, 0)  # round 0 closes scaled as a quorum of the rest: (1 + 2) * 3 / 2
    for worker, incarnation, joining in ((1, 1, False), (3, 1, True)):
        first, _ = rejoins.begin(worker, incarnation, joining)
        rejoins.join_at(worker, incarnation, first, joining)
    seen = [shard.retire_joins()] if retire else []
    for step in range(1, 4):
        for worker in range(4):
            push(shard, worker, float(step * 10 + worker), f"{step}-{worker}")
        if retire and step == 1:
            seen.append(shard.retire_joins())
    return shard, seen


def test_rejoined_and_joined_workers_are_forgotten_once_every_key_is_past_their_round() -> None:
    """retire_joins() keeps a rejoin's first round while a round below it may be open, forgets it once
    every key has reached it, and the rounds after are summed exactly as without forgetting."""
    kept, _ = _restarted_and_joined(retire=False)
    shard, seen = _restarted_and_joined(retire=True)
    assert seen == [[1, 3], []]  # round 0 closed already: both first rounds (1) are reached at once
    assert shard.joins == {} and shard.newcomers == set()
    assert kept.joins == {1: 1, 3: 1}
    np.testing.assert_array_equal(shard.value("w"), kept.value("w"))


def test_a_rejoin_whose_round_is_ahead_is_kept_until_the_key_reaches_it() -> None:
    """A newcomer joined at round 2 of a key still at round 0 is kept until rounds 0 and 1 closed."""
    shard, rejoins = make()
    shard.init("v", np.zeros(2))
    rejoins.begin(2, 1, joining=True)
    rejoins.join_at(2, 1, 2, joining=True)
    assert not shard.retirable and shard.retire_joins() == []
    for step in range(2):
        for key in ("w", "v"):
            for worker in (0, 1):
                shard.push(f"{key}{step}{worker}", worker, key, np.ones(2))
            last = step == 1 and key == "v"
            assert shard.retirable == ({2} if last else set()), (step, key)  # followed as rounds close
    assert shard.retire_joins() == [2] and not shard.retirable
    assert shard.joins == {}
    push(shard, 0, 1.0, "a2")
    push(shard, 1, 1.0, "b2")
    assert shard.open_rounds() == 1  # round 2 waits for the newcomer, as before it was forgotten


def test_a_key_stored_after_a_rejoin_counts_the_joiner_from_its_round_0_and_holds_no_retirement() -> None:
    """A key stored after a join at round 1 counts the newcomer from its own round 0 (review 45: the
    join's round is of the keys held then): the worker is retirable once 'w' reaches round 1, and
    the new key's round 0 waits for the newcomer's push and sums it with the others'."""
    shard, rejoins = make()
    push(shard, 0, 1.0, "a0")
    rejoins.begin(2, 1, joining=True)
    rejoins.join_at(2, 1, 1, joining=True)
    shard.init("late", np.zeros(2))
    assert not shard.retirable
    push(shard, 1, 1.0, "b0")  # 'w' reaches round 1
    assert shard.retirable == {2}
    for worker in (0, 1):
        assert shard.push(f"late{worker}", worker, "late", np.ones(2)) == []  # waits for worker 2
    assert sorted(c.token for c in shard.push("late2", 2, "late", np.ones(2))) == ["late0", "late1", "late2"]
    np.testing.assert_array_equal(shard.value("late"), [3.0, 3.0])
    assert shard.retire_joins() == [2]


def test_a_rejoin_between_its_two_steps_is_not_forgotten() -> None:
    """A worker whose rejoin has begun but not joined at a round yet is kept, however far the keys are."""
    shard, rejoins = make()
    rejoins.begin(2, 1, joining=True)
    assert shard.retire_joins(rejoins.begun) == []
    assert shard.joins == {2: 0}

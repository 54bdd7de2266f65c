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

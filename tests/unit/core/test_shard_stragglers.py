"""ShardState against stragglers: dist_sync's quorum (backup workers, late pushes dropped and
counted) and dist_async's bounded staleness (acks withheld from workers too far ahead).  Pure."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.shard import Completion, ShardState


def ro(values, dtype=np.float32) -> np.ndarray:
    """A read-only array, like one decoded from a received frame."""
    array = np.array(values, dtype=dtype)
    array.setflags(write=False)
    return array


def tokens(done: list[Completion]) -> set:
    return {c.token for c in done}


def quorum_state(workers: int = 3, quorum: int = 2, size: int = 2, ordered: bool = False,
                 window: int = 2) -> ShardState:
    shard = ShardState(workers, sync=True, ordered=ordered, window=window, quorum=quorum)
    shard.init("w", np.zeros(size, np.float32))
    return shard


def push(shard: ShardState, token, worker: int, values, rnd: int, lo: int = 0, pull=False):
    return shard.push_many(worker, [(token, "w", ro(values), lo)], pull=pull, rounds=[rnd])


@pytest.mark.parametrize("ordered", [False, True])
def test_a_round_closes_at_quorum_and_the_sum_is_scaled_to_every_worker(ordered):
    shard = quorum_state(ordered=ordered)
    assert push(shard, "a", 2, [2, 4], 0) == []  # a higher rank first: held in rank order
    done = push(shard, "b", 1, [4, 8], 0)
    assert tokens(done) == {"a", "b"}
    np.testing.assert_allclose(shard.value("w"), [9, 18])  # (2 + 4) * 3 / 2
    assert shard.late == {}


def test_a_late_push_is_dropped_acked_counted_and_its_pull_gets_the_new_value():
    shard = quorum_state()
    reports = []
    shard.on_late = lambda key, worker, rnd: reports.append((key, worker, rnd))
    push(shard, "a", 0, [1, 1], 0)
    push(shard, "b", 1, [1, 1], 0)  # round 0 closes without worker 2
    before = shard.value("w").copy()
    assert tokens(push(shard, "late", 2, [100, 100], 0)) == {"late"}  # acked at once
    np.testing.assert_array_equal(shard.value("w"), before)  # never applied
    assert shard.late == {2: 1} and reports == [("w", 2, 0)]
    pulled = shard.pull("p", 2, "w")
    assert tokens(pulled) == {"p"}  # read-your-writes does not wait for a dropped push
    np.testing.assert_array_equal(pulled[0].value, before)
    # its next push is on time for round 1, and counts toward it
    assert push(shard, "c", 2, [3, 3], 1) == []
    assert tokens(push(shard, "d", 0, [3, 3], 1)) == {"c", "d"}
    np.testing.assert_allclose(shard.value("w"), [9, 9])


def test_a_worker_rounds_behind_is_resynced_to_the_oldest_open_round():
    shard = quorum_state()
    for rnd in range(3):
        push(shard, ("a", rnd), 0, [1, 1], rnd)
        push(shard, ("b", rnd), 1, [1, 1], rnd)  # rounds 0..2 close without worker 2
    assert tokens(push(shard, "late", 2, [5, 5], 0)) == {"late"}
    assert tokens(push(shard, "late2", 2, [5, 5], 0, lo=0)) == {"late2"}  # the same round: still late
    assert shard.late == {2: 2}
    assert push(shard, "c", 2, [2, 2], 1) == []  # its next push (its round 1) joins round 3
    assert tokens(push(shard, "d", 1, [2, 2], 3)) == {"c", "d"}
    np.testing.assert_allclose(shard.value("w"), [6, 6])
    assert tokens(push(shard, "e", 0, [9, 9], 3)) == {"e"}  # now worker 0 is the late one
    assert shard.late == {2: 2, 0: 1}


def test_a_late_pushpull_is_answered_with_the_current_value():
    shard = quorum_state()
    push(shard, "a", 0, [1, 1], 0)
    push(shard, "b", 1, [1, 3], 0)
    done = push(shard, "pp", 2, [7, 7], 0, pull=True)
    assert tokens(done) == {"pp"}
    np.testing.assert_allclose(done[0].value, [3, 6])


def test_chunks_of_a_round_closed_by_quorum_mid_contribution_are_dropped():
    shard = quorum_state(size=4)
    assert push(shard, "x1", 2, [10, 10], 0, lo=0) == []  # worker 2 sent half of round 0
    for worker in (0, 1):  # every worker splits a key at the same offsets
        push(shard, f"a{worker}", worker, [1, 1], 0, lo=0)
    push(shard, "b0", 0, [1, 1], 0, lo=2)
    done = push(shard, "b1", 1, [1, 1], 0, lo=2)
    assert tokens(done) == {"a0", "a1", "b0", "b1", "x1"}
    # the first half had 3 contributions (scaled 3/3), the second 2 (scaled 3/2)
    np.testing.assert_allclose(shard.value("w"), [12, 12, 3, 3])
    assert tokens(push(shard, "x2", 2, [10, 10], 0, lo=2)) == {"x2"}  # its round is gone: dropped
    assert shard.late == {2: 1}  # counted once per contribution
    np.testing.assert_allclose(shard.value("w"), [12, 12, 3, 3])
    assert push(shard, "y", 2, [1, 1], 1, lo=0) == []  # its next contribution starts afresh


def test_a_round_beyond_the_next_joins_the_next():
    """A worker whose push of round 0 was refused (damaged, over its window) sends round 1 next: the
    server never saw a round 0 from it, so the push joins the next round instead of leaving a gap."""
    shard = quorum_state()
    assert push(shard, "a", 0, [1, 1], 1) == []
    assert tokens(push(shard, "b", 1, [1, 1], 0)) == {"a", "b"}  # round 0: workers 0 and 1
    np.testing.assert_allclose(shard.value("w"), [3, 3])  # (1 + 1) * 3 / 2


def test_fewer_live_workers_than_the_quorum_still_close_rounds():
    shard = quorum_state(workers=3, quorum=2)
    shard.leave(1)
    shard.leave(2)
    assert tokens(push(shard, "a", 0, [1, 1], 0)) == {"a"}
    np.testing.assert_allclose(shard.value("w"), [3, 3])  # one push stands for three


def test_a_quorum_of_every_worker_is_plain_sync():
    shard = quorum_state(workers=2, quorum=2)
    assert shard.quorum is None
    push(shard, "a", 0, [1, 1], 0)
    push(shard, "b", 1, [1, 1], 0)
    np.testing.assert_array_equal(shard.value("w"), [2, 2])


def test_integer_sums_are_not_scaled():
    shard = ShardState(3, sync=True, quorum=2)
    shard.init("w", np.zeros(2, np.int32))
    shard.push_many(0, [("a", "w", ro([1, 1], np.int32), 0)], rounds=[0])
    shard.push_many(1, [("b", "w", ro([1, 1], np.int32), 0)], rounds=[0])
    np.testing.assert_array_equal(shard.value("w"), [2, 2])


def stale_state(staleness: int, window: int = 0, workers: int = 2) -> ShardState:
    shard = ShardState(workers, sync=False, window=window, staleness=staleness)
    shard.init("w", np.zeros(2, np.float32))
    return shard


def test_staleness_withholds_the_ack_past_the_bound_and_releases_it_when_the_slowest_moves():
    shard = stale_state(staleness=1)
    assert tokens(shard.push("a1", 0, "w", ro([1, 1]))) == {"a1"}  # 1 ahead: acked
    assert shard.push("a2", 0, "w", ro([2, 2])) == []  # 2 ahead: applied, ack withheld
    np.testing.assert_array_equal(shard.value("w"), [2, 2])
    assert shard.push("a3", 0, "w", ro([3, 3])) == []  # withheld acks stay in order
    assert tokens(shard.push("b1", 1, "w", ro([0, 0]))) == {"b1", "a2"}
    assert tokens(shard.push("b2", 1, "w", ro([0, 0]))) == {"b2", "a3"}
    assert shard.gate.max_lead == 3


def test_staleness_counts_the_window_so_no_applied_push_leads_by_more_than_s():
    shard = stale_state(staleness=2, window=2)  # acks released at lead <= 0
    assert tokens(shard.push("a1", 0, "w", ro([1, 1]))) == set()
    assert tokens(shard.push("b1", 1, "w", ro([1, 1]))) == {"b1", "a1"}


def test_a_withheld_pushpull_reply_comes_with_its_release():
    shard = stale_state(staleness=0)
    done = shard.pushpull("pp", 0, "w", ro([5, 5]))
    assert done == []
    done = shard.push("b", 1, "w", ro([1, 1]))
    assert tokens(done) == {"b", "pp"}
    np.testing.assert_array_equal({c.token: c.value for c in done}["pp"], [5, 5])


def test_a_worker_that_leaves_stops_counting_as_the_slowest():
    shard = stale_state(staleness=0, workers=3)
    shard.push("b1", 1, "w", ro([1, 1]))
    assert shard.push("a1", 0, "w", ro([1, 1])) == []  # worker 2 has not pushed
    assert tokens(shard.leave(2)) == {"a1", "b1"}


def test_staleness_off_is_plain_async_and_ignored_in_sync():
    shard = ShardState(2, sync=False)
    shard.init("w", np.zeros(2, np.float32))
    assert shard.gate is None
    for i in range(5):
        assert tokens(shard.push(i, 0, "w", ro([1, 1]))) == {i}
    assert ShardState(2, sync=True, staleness=1).gate is None

"""Unit tests of kvstore.core.rejoin: a server's side of a worker that is away and rejoins."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.rejoin import Rejoins
from kvstore.core.shard import ShardState
from kvstore.errors import ProtocolError


def make(workers: int = 3) -> tuple[ShardState, Rejoins]:
    """A dist_sync shard holding key 'w' = [0, 0], and its Rejoins."""
    shard = ShardState(workers, sync=True, ordered=True, window=2)
    shard.init("w", np.zeros(2))
    return shard, Rejoins(shard)


def push(shard: ShardState, worker: int, value: float, token: str) -> list:
    """Push ``value`` (both elements) from ``worker``; return the tokens answered."""
    return [c.token for c in shard.push(token, worker, "w", np.full(2, value))]


def test_a_round_waiting_for_an_away_worker_closes_scaled_as_a_quorum_of_the_rest() -> None:
    """Workers 0 and 1 pushed, 2 goes away: the round closes with their sum scaled by 3/2."""
    shard, rejoins = make()
    assert push(shard, 0, 1.0, "a") == [] and push(shard, 1, 2.0, "b") == []
    done = rejoins.away(2, 0)
    assert sorted(c.token for c in done) == ["a", "b"]
    np.testing.assert_array_equal(shard.value("w"), [4.5, 4.5])  # (1 + 2) * 3 / 2


def test_rejoin_counts_from_the_first_round_nobody_opened_and_not_before() -> None:
    """A rejoined worker is not waited for in rounds opened before its rejoin, is in every later one,
    and its pull waits until the rounds before its own are closed."""
    shard, rejoins = make()
    rejoins.away(2, 0)
    push(shard, 0, 1.0, "r0")  # round 0 opened without worker 2
    first, done = rejoins.begin(2, 1)
    assert (first, done) == (1, [])
    assert rejoins.join_at(2, 1, 1) == []
    assert shard.pull("p", 2, "w") == []  # round 0 still open: its value is not the rejoiner's start
    answered = [c.token for c in shard.push("r1", 1, "w", np.full(2, 1.0))]
    assert sorted(answered) == ["p", "r0", "r1"]  # round 0 closed by 0 and 1 alone
    push(shard, 0, 1.0, "s0")
    push(shard, 1, 1.0, "s1")
    assert shard.open_rounds() == 1  # round 1 waits for worker 2
    assert sorted(push(shard, 2, 1.0, "s2")) == ["s0", "s1", "s2"]


def test_join_at_a_later_round_releases_the_rounds_before_it() -> None:
    """begin() gives round r; join_at(r + 1) lets round r close without the rejoiner."""
    shard, rejoins = make(2)
    rejoins.away(1, 0)
    first, _ = rejoins.begin(1, 1)
    push(shard, 0, 1.0, "a")  # round 0 waits for worker 1 (begun at round 0)
    assert shard.open_rounds() == 1
    assert [c.token for c in rejoins.join_at(1, 1, first + 1)] == ["a"]
    np.testing.assert_array_equal(shard.value("w"), [2.0, 2.0])  # scaled as a quorum of the rest: 1 * 2 / 1


def test_a_rejoiners_push_before_the_retries_opened_the_rounds_below_its_own_joins_its_own_round() -> None:
    """Joined at round r + 1 on a server restarted from its shard, where worker 0's retried push of round
    r is still on its way (its ALIGN promised round r + 1: ShardState.promise): the rejoiner's first push
    belongs to round r + 1, not to round r, so the rounds it pushes are the rounds the others push."""
    shard, rejoins = make(2)
    rejoins.away(1, 0)
    first, _ = rejoins.begin(1, 1)
    shard.promise("w", first + 1)
    assert first == 0 and rejoins.join_at(1, 1, first + 1) == []
    assert push(shard, 1, 10.0, "w1") == []  # round 1: waits for worker 0's push of round 1
    assert push(shard, 0, 1.0, "r0") == ["r0"]  # round 0 closes with worker 0 alone, scaled 2 / 1
    np.testing.assert_array_equal(shard.value("w"), [2.0, 2.0])
    assert sorted(push(shard, 0, 1.0, "r1")) == ["r1", "w1"]  # round 1: both
    np.testing.assert_array_equal(shard.value("w"), [11.0, 11.0])  # no updater: the sum is stored
    assert shard.open_rounds() == 0


def test_a_key_with_fewer_rounds_than_the_rejoin_round_meets_the_others_in_its_own_next_round() -> None:
    """Key 'b' is pushed every other step (2 rounds while 'a' has 4): with no retries promised, the
    rejoiner's next push of 'b' joins the round worker 0 pushes next (b's round 2), not round 4, which
    worker 0 reaches two of its pushes later (found by review: a clamp to the join round broke this)."""
    shard = ShardState(2, sync=True, ordered=True, window=2)
    shard.init("a", np.zeros(2))
    shard.init("b", np.zeros(2))
    rejoins = Rejoins(shard)
    for step in range(4):
        for w in (0, 1):
            shard.push(f"a{step}.{w}", w, "a", np.ones(2))
            if step % 2 == 0:
                shard.push(f"b{step}.{w}", w, "b", np.ones(2))
    rejoins.away(1, 0)
    first, _ = rejoins.begin(1, 1)
    assert first == 4 and rejoins.join_at(1, 1, first) == []
    assert [c.token for c in shard.push("b4.1", 1, "b", np.full(2, 10.0))] == []
    assert sorted(c.token for c in shard.push("b4.0", 0, "b", np.ones(2))) == ["b4.0", "b4.1"]
    np.testing.assert_array_equal(shard.value("b"), [11.0, 11.0])  # no updater: the round's sum is stored


def test_begin_without_away_makes_the_old_incarnation_away_first() -> None:
    """A rejoin that overtakes the scheduler's AWAY still closes the round the old one was missing."""
    shard, rejoins = make(2)
    push(shard, 0, 1.0, "a")
    first, done = rejoins.begin(1, 1)
    assert [c.token for c in done] == ["a"] and first == 1


def test_stale_and_bad_rejoins_change_nothing() -> None:
    """An old incarnation, a second begin, an early join_at and a bad incarnation raise ProtocolError."""
    shard, rejoins = make(2)
    rejoins.begin(1, 1)
    with pytest.raises(ProtocolError):
        rejoins.begin(1, 1)
    with pytest.raises(ProtocolError):
        rejoins.join_at(1, 2, 0)
    with pytest.raises(ProtocolError):
        rejoins.join_at(1, 1, -1)
    with pytest.raises(ProtocolError):
        rejoins.away(1, "x")
    assert rejoins.away(1, 0) == []  # the incarnation before the one counted: ignored
    assert 1 in shard.active


def test_in_dist_async_the_rejoin_round_is_the_workers_own_step_and_pulls_never_wait() -> None:
    """dist_async: begin() answers the pushes of the worker's old incarnation that were applied, and
    the rejoined worker's pull is answered at once."""
    shard = ShardState(2, sync=False)
    shard.init("w", np.zeros(2))
    rejoins = Rejoins(shard)
    for i in range(3):
        shard.push(f"p{i}", 1, "w", np.ones(2))
    shard.push("q", 0, "w", np.ones(2))
    first, _ = rejoins.begin(1, 1)
    assert first == 3
    assert rejoins.join_at(1, 1, 3) == []
    assert [c.token for c in shard.pull("pull", 1, "w")] == ["pull"]


def test_a_server_that_never_saw_the_first_step_takes_both_at_once() -> None:
    """A server restarted between a rejoin's two steps gets only the second: it counts the worker from
    ``at`` as the two steps would have, when it has opened no round ``at`` yet."""
    shard, rejoins = make(2)
    rejoins.away(1, 0)
    assert push(shard, 0, 1.0, "a") == ["a"]  # round 0 closes without the away worker
    assert rejoins.join_at(1, 1, 1) == []
    assert rejoins.current == {1: 1} and 1 in shard.active
    assert push(shard, 0, 1.0, "b") == []  # round 1 waits for the rejoined worker
    assert sorted(push(shard, 1, 1.0, "c")) == ["b", "c"]


def test_a_second_step_below_a_round_the_server_opened_is_refused_and_changes_nothing() -> None:
    """Without the first step, an ``at`` below the next round this server opens is a ProtocolError
    naming that round, and the worker stays away."""
    shard, rejoins = make(2)
    rejoins.away(1, 0)
    push(shard, 0, 1.0, "a")
    push(shard, 0, 1.0, "b")  # rounds 0 and 1 closed without worker 1
    with pytest.raises(ProtocolError, match=">= 2, the round this server opens next"):
        rejoins.join_at(1, 1, 1)
    assert rejoins.current == {} and 1 not in shard.active
    assert rejoins.join_at(1, 1, 2) == []  # the same rejoin at a round not opened yet


class _Rows:
    """A RowRounds over RowTables that keeps what each step answered."""

    def __init__(self, tables) -> None:
        self.tables, self.answered = tables, []

    def mark_away(self, worker: int) -> None:
        self.answered += [c.token for c in self.tables.mark_away(worker)]

    def first_round(self, worker: int) -> int:
        return self.tables.first_round(worker)

    def readmit(self, worker: int) -> int:
        return self.tables.readmit(worker)

    def rejoin_at(self, worker: int, at: int) -> None:
        self.answered += [c.token for c in self.tables.rejoin_at(worker, at)]


def test_a_rejoin_counts_the_row_tables_rounds_and_takes_the_worker_back_in_them() -> None:
    """With row tables, AWAY closes their rounds too, begin answers the furthest round over keys and
    tables, and join_at counts the worker from that round of every table."""
    from kvstore.core.sparse_shard import RowTables

    shard = ShardState(2, sync=True, ordered=True, window=4)
    shard.init("w", np.zeros(2))
    tables = RowTables(2, True, 4)
    tables.init("e", (4, 1), np.dtype(np.float32), 0, 4, {"type": "zeros", "seed": 0})
    tables.updater = lambda key, weight, ids, got: weight.__setitem__(ids, weight[ids] + got)  # adds
    rows = _Rows(tables)
    rejoins = Rejoins(shard, rows)
    one = (np.array([0], np.int64), np.ones((1, 1), np.float32))
    tables.push(0, "e", 0, True, *one, "e0")
    assert rejoins.away(1, 0) == [] and rows.answered == ["e0"]
    tables.push(0, "e", 1, True, *one, "e1")  # the table is ahead of key 'w' (no round opened)
    first, _ = rejoins.begin(1, 1)
    assert first == 2 and shard.first_round(1) == 0
    push(shard, 0, 1.0, "w0")  # round 0 of 'w' waits for worker 1 until join_at
    assert [c.token for c in rejoins.join_at(1, 1, 2)] == ["w0"]
    assert tables.push(0, "e", 2, True, *one, "a") == []  # round 2 of the table waits for worker 1
    assert sorted(c.token for c in tables.push(1, "e", 2, True, *one, "b")) == ["a", "b"]
    assert tables.tables["e"].weight[0, 0] == 6.0  # 2 + 2 (rounds scaled by 2/1) + 2


def test_a_key_whose_round_count_jumps_past_the_rejoin_round_lets_retire_joins_forget_it() -> None:
    """Worker 1 rejoined at round 3 of 'w' (at round 0); a realignment moves 'w' on to round 5 at once
    (no round closes): retire_joins() finds the key past round 3 and forgets the rejoin."""
    shard, rejoins = make(2)
    rejoins.away(1, 0)
    first, _ = rejoins.begin(1, 1)
    rejoins.join_at(1, 1, first + 3)
    assert shard.retire_joins() == [] and shard.joins == {1: 3}
    shard.realign("w", {}, floor=5)
    assert shard.retirable == {1} and shard.retire_joins() == [1] and shard.joins == {}


def test_a_rejoiners_pull_of_a_key_stored_after_its_rejoin_is_answered_at_once() -> None:
    """Worker 1 rejoined at round 2 of 'w'; key 'k' stored afterwards is at round 0, which is the
    rejoiner's start there too: its pull of 'k' is answered at once, not held until 'k' reaches 2."""
    shard, rejoins = make(2)
    for r in range(2):
        push(shard, 0, 1.0, f"a{r}")
        push(shard, 1, 1.0, f"b{r}")
    rejoins.away(1, 0)
    first, _ = rejoins.begin(1, 1)
    rejoins.join_at(1, 1, first)
    assert first == 2
    shard.init("k", np.full(2, 7.0))
    assert [c.value.tolist() for c in shard.pull("p", 1, "k")] == [[7.0, 7.0]]

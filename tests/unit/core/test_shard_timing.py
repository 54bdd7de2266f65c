"""ShardState's round timing (issue 21): each closed round reports how long it waited from its first
to its last contribution and which worker came last; open rounds older than a threshold are found
with the workers they wait for; a stall can drop the pulls waiting on a round."""

from __future__ import annotations

import numpy as np

from kvstore.core.shard import ShardState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def shard(workers: int = 3) -> tuple[ShardState, Clock, list]:
    clock, closed = Clock(), []
    state = ShardState(workers, sync=True, clock=clock)
    state.on_close = lambda key, waited, last: closed.append((key, waited, last))
    state.init("w", np.zeros(2, np.float32))
    return state, clock, closed


def test_a_closed_round_reports_its_wait_and_its_last_worker():
    state, clock, closed = shard()
    state.push("a", 2, "w", np.ones(2, np.float32))
    clock.now += 1.5
    state.push("b", 0, "w", np.ones(2, np.float32))
    clock.now += 2.0
    assert closed == []
    state.push("c", 1, "w", np.ones(2, np.float32))
    assert closed == [("w", 3.5, 1)]


def test_stalled_names_the_workers_a_round_waits_for():
    state, clock, _ = shard()
    state.push("a", 0, "w", np.ones(2, np.float32))
    assert state.stalled(1.0) == []
    clock.now += 2.0
    assert state.stalled(1.0) == [("w", 2.0, [1, 2])]
    assert state.open_rounds() == 1
    state.push("b", 2, "w", np.ones(2, np.float32))
    assert state.stalled(1.0) == [("w", 2.0, [1])]


def test_a_worker_that_leaves_closes_the_round_with_the_last_one_that_came():
    state, clock, closed = shard(workers=2)
    state.push("a", 1, "w", np.ones(2, np.float32))
    clock.now += 1.0
    state.leave(0)
    assert closed == [("w", 1.0, 1)] and state.stalled(0.0) == []


def test_dropping_waiting_pulls_returns_their_tokens_and_keeps_the_round():
    state, clock, _ = shard(workers=2)
    state.push("a", 0, "w", np.ones(2, np.float32))
    assert state.pull("p", 0, "w") == []  # waits for the round (read-your-writes)
    assert state.drop_waiting_pulls("w") == ["p"]
    acks = state.push("b", 1, "w", np.ones(2, np.float32))
    assert {c.token for c in acks} == {"a", "b"}  # the pushes still close the round; no pull answered

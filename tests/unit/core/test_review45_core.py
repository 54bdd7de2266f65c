"""Review 45 reproducers (core): each pinned behaviour the newest elastic work got wrong (marked
xfail(strict) until fixed; all three are fixed now)."""

from __future__ import annotations

import numpy as np

from kvstore.core.rejoin import Rejoins
from kvstore.core.shard import ShardState


def _step(shard: ShardState, key: str, workers: tuple[int, ...], tag: str) -> list:
    """One round of ``key``: a push of 1 from each of ``workers``; the tokens answered."""
    return [c.token for w in workers for c in shard.push(f"{tag}-{w}", w, key, np.ones(2))]


def test_a_worker_set_key_outside_the_rejoined_worker_does_not_hold_its_retirement() -> None:
    """Worker 2 of 3 restarted and rejoined at round 2 of 'w'; 'g' is a key of the worker set {0, 1}
    (whose rounds never wait for worker 2) and has had one round: once 'w' is past round 2, nothing is
    left that counts worker 2 late, yet retire_joins() forgets it only once 'g' too reaches round 2."""
    shard = ShardState(3, sync=True)
    shard.init("w", np.zeros(2))
    shard.init("g", np.zeros(2), members=(0, 1))
    rejoins = Rejoins(shard)
    for r in range(2):
        _step(shard, "w", (0, 1, 2), f"w{r}")
    _step(shard, "g", (0, 1), "g0")
    rejoins.away(2, 0)
    first, _ = rejoins.begin(2, 1)
    rejoins.join_at(2, 1, first)
    assert first == 2
    for r in range(2, 5):
        assert len(_step(shard, "w", (0, 1, 2), f"w{r}")) == 3  # every round of 'w' counts worker 2
    assert shard.retire_joins(rejoins.begun) == [2]


def test_a_key_stored_after_a_rejoin_counts_the_rejoined_worker_from_its_first_round() -> None:
    """Worker 2 rejoined at round 3 of 'w'; then 'k' is stored (a key inited later) and all three push it
    once: worker 2's pull of 'k' is answered with that round's sum, as the others' are.  (It waits
    instead for 'k' to reach round 3, while the others' next round of 'w' waits for worker 2's push: a
    deadlock that ends at KVSTORE_REQUEST_TIMEOUT; and the rejoin is not retired meanwhile.)"""
    shard = ShardState(3, sync=True)
    shard.init("w", np.zeros(2))
    rejoins = Rejoins(shard)
    for r in range(3):
        _step(shard, "w", (0, 1, 2), f"w{r}")
    rejoins.away(2, 0)
    first, _ = rejoins.begin(2, 1)
    rejoins.join_at(2, 1, first)
    assert first == 3
    shard.init("k", np.zeros(2))
    assert len(_step(shard, "k", (2, 0, 1), "k0")) == 3
    assert [c.value.tolist() for c in shard.pull("p0", 0, "k")] == [[3.0, 3.0]]
    assert [c.value.tolist() for c in shard.pull("p2", 2, "k")] == [[3.0, 3.0]]


def test_a_server_restarted_between_a_joiners_two_rejoin_steps_takes_the_second() -> None:
    """Worker 2 joined (admitted by the scheduler, so a server restarted now has slot 2 present in its map)
    and had its first REJOIN answered by server 1's previous incarnation, which was then SIGKILLed; the
    restarted server (restored at round 5) gets the second step, with ``at`` 5: it counts worker 2 from
    round 5 (join_at's path for a server that lost the first step), and round 5 closes with all three."""
    shard = ShardState(3, sync=True, present=(0, 1, 2))  # the map of a server restarted after the admission
    shard.restore("w", np.zeros(2), 5, {0: 5, 1: 5})
    rejoins = Rejoins(shard)
    rejoins.join_at(2, 1, 5, joining=True)
    assert len(_step(shard, "w", (0, 1, 2), "w5")) == 3

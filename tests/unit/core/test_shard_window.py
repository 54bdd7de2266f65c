"""ShardState's push window: a worker's contribution beyond ``window`` unapplied ones is refused
before anything changes, in both modes; applying (a round closing) makes room again."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.shard import ShardState
from kvstore.errors import ProtocolError


def state(sync: bool, window: int = 2, workers: int = 2, size: int = 4) -> ShardState:
    shard = ShardState(workers, sync=sync, window=window)
    shard.init("w", np.zeros(size, np.float32))
    return shard


def test_sync_refuses_the_push_beyond_the_window_and_changes_nothing():
    shard = state(sync=True)
    assert shard.push("a", 0, "w", np.ones(4, np.float32)) == []
    assert shard.push("b", 0, "w", np.ones(4, np.float32)) == []
    held = shard.held_bytes()
    with pytest.raises(ProtocolError, match=r"window of 2 .*KVSTORE_PUSH_WINDOW"):
        shard.push("c", 0, "w", np.ones(4, np.float32))
    assert shard.held_bytes() == held
    acks = shard.push("d", 1, "w", np.full(4, 5, np.float32))  # round 1 closes: room again
    assert {c.token for c in acks} == {"a", "d"}
    shard.push("c", 0, "w", np.ones(4, np.float32))  # now accepted


def test_sync_window_counts_contributions_not_chunks():
    shard = state(sync=True, window=1, size=6)
    shard.push("a1", 0, "w", np.ones(3, np.float32), lo=0)
    shard.push("a2", 0, "w", np.ones(3, np.float32), lo=3)  # the same contribution: accepted
    with pytest.raises(ProtocolError, match="KVSTORE_PUSH_WINDOW"):
        shard.push("b", 0, "w", np.ones(3, np.float32), lo=0)


def test_the_window_is_per_worker_and_per_key():
    shard = state(sync=True, window=1)
    shard.init("v", np.zeros(4, np.float32))
    shard.push("a", 0, "w", np.ones(4, np.float32))
    shard.push("b", 0, "v", np.ones(4, np.float32))  # another key
    with pytest.raises(ProtocolError):
        shard.push("c", 0, "w", np.ones(4, np.float32))


def test_async_applies_at_once_so_whole_pushes_always_fit():
    shard = state(sync=False, window=1)
    for i in range(5):
        assert [c.token for c in shard.push(i, 0, "w", np.full(4, i, np.float32))] == [i]
    assert np.all(shard.value("w") == 4)


def test_async_refuses_a_new_contribution_while_one_is_being_assembled_beyond_the_window():
    shard = state(sync=False, window=1, size=6)
    shard.push("a1", 0, "w", np.ones(3, np.float32), lo=0)  # half of a contribution
    with pytest.raises(ProtocolError):  # a new contribution while the first is open
        shard.push("b", 0, "w", np.ones(3, np.float32), lo=0)


def test_window_zero_is_unbounded():
    shard = state(sync=True, window=0)
    for i in range(10):
        shard.push(i, 0, "w", np.ones(4, np.float32))
    assert len(shard._keys["w"].rounds) == 10

"""The worker's outbox order (``kvstore.client.sendqueue``) and which chunks a call paces (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.datapath import _paced
from kvstore.client.sendqueue import SendQueue
from kvstore.core.partition import Piece
from kvstore.core.plan import plan


def _drain(queue: SendQueue) -> list:
    out = []
    while queue:
        out.append(queue.pop())
    return out


def test_higher_priority_goes_first_and_ties_keep_call_order() -> None:
    """Distinct keys: highest priority first; equal priorities in the order they were put."""
    queue = SendQueue()
    for name, priority in [("a", 0), ("b", 5), ("c", 0), ("d", 10), ("e", 5), ("f", -3)]:
        queue.put(name, priority, [name])
    assert _drain(queue) == ["d", "b", "e", "a", "c", "f"]


def test_a_later_request_never_overtakes_an_earlier_one_of_its_key() -> None:
    """A request sharing a key with a queued one goes after it, whatever its priority; a batch caps
    every key it carries, so a third request of another of its keys stays behind too."""
    queue = SendQueue()
    queue.put("push k", 0, ["k"])
    queue.put("pull k", 10, ["k"])        # capped at 0: after the push
    queue.put("batch k+j", 10, ["k", "j"])  # capped at 0 by k
    queue.put("pull j", 10, ["j"])        # capped at 0 by the batch
    queue.put("other", 10, ["x"])         # free: first
    assert _drain(queue) == ["other", "push k", "pull k", "batch k+j", "pull j"]


def test_big_chunks_interleave_with_an_urgent_small_key() -> None:
    """A big value's chunks keep their order; a small key of higher priority put after them goes
    before every chunk still queued, and one of equal priority after them all."""
    queue = SendQueue()
    for i in range(4):
        queue.put(("big", i), 0, ["big"])
    queue.pop()  # chunk 0 left already
    queue.put(("small", 0), 10, ["small"])
    queue.put(("late", 0), 0, ["late"])
    assert _drain(queue) == [("small", 0), ("big", 1), ("big", 2), ("big", 3), ("late", 0)]


def test_control_messages_overtake_nothing_and_are_overtaken_by_nothing() -> None:
    """A message without keys goes after everything queued, and everything put after it goes after it."""
    queue = SendQueue()
    queue.put("low", -5, ["a"])
    queue.put("high", 5, ["b"])
    queue.put("optimizer", 0, None)
    queue.put("urgent", 100, ["c"])
    assert _drain(queue) == ["high", "low", "optimizer", "urgent"]


def test_caps_are_dropped_with_the_last_queued_request_of_a_key() -> None:
    """Once a key's queued requests have left, a new request of it takes its own priority again."""
    queue = SendQueue()
    queue.put("k0", 0, ["k"])
    queue.put("other", 0, ["x"])
    assert queue.pop() == "k0"
    assert queue.put("k10", 10, ["k"]) == 10
    assert _drain(queue) == ["k10", "other"]
    assert queue.put("after", 3, None) == 3 and len(queue) == 1
    queue.clear()
    assert not queue
    with pytest.raises(IndexError):
        queue.pop()


def test_a_call_paces_its_chunks_beyond_the_first_pace_bytes() -> None:
    """Chunks beyond the call's first ``pace`` bytes are paced; batches and whole pieces never are."""
    big = np.zeros(10 << 20, np.uint8)  # 10 MiB in 1 MiB chunks
    small = np.zeros(16, np.uint8)
    entries = [("big", big.dtype, [Piece(0, 0, big.size)]), ("small", small.dtype, [Piece(0, 0, small.size)])]
    sends = plan(entries, 1 << 20, 1 << 20)
    paced = _paced(sends, {"big": big, "small": small}, 3 << 20)
    kinds = [(s.lo is not None, p) for s, p in zip(sends, paced)]
    assert kinds[:3] == [(True, False)] * 3
    assert kinds[3:10] == [(True, True)] * 7
    assert kinds[10:] == [(False, False)]

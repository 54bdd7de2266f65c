"""Bounded staleness for ``dist_async`` (``KVSTORE_STALENESS``): pure, no I/O.

A worker's *round* on a key is the number of its pushes to that key applied so far.  Each push is
applied on arrival, as in plain dist_async; what the gate withholds is the push's acknowledgement
(and a pushpull's reply): it is released once the worker is close enough to the slowest live worker
on that key.  The worker's push window (``KVSTORE_PUSH_WINDOW``, ``w``) then makes its next push
wait, under the request deadline.  A worker may keep ``w`` pushes unacknowledged, so the ack of
round ``k`` is released when ``k - slowest <= max(0, s - w)``: the next push it lets through is
then at most ``s`` rounds ahead when it is applied (``max(s, w)`` when ``s < w``).  The slowest
worker's own pushes are always acknowledged, so the gate cannot deadlock.  A worker that leaves
no longer counts as the slowest, and its withheld acks are released.

A new member that joins an elastic job (docs/elastic.md) starts level with the slowest present worker
on each key (:meth:`StalenessGate.join`): it pulls the current weights, so it is behind no one, and its
slot's earlier count (none, or a previous member's) would otherwise hold every other worker until it
had pushed as often as they (or, a previous member's count above theirs, hold its own pushes).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvstore.core.partition import Key


class StalenessGate:
    """Withholds the replies to pushes of workers too many rounds ahead of the slowest, per key."""

    def __init__(self, staleness: int, window: int) -> None:
        self.staleness = staleness
        self.threshold = max(0, staleness - window) if window else staleness
        self._held: dict[Key, dict[int, deque[tuple[int, list[Any]]]]] = {}
        self._lift: dict[Key, dict[int, int]] = {}  # key -> joined worker -> rounds added to its count
        # (negative when its slot's earlier member had pushed more than the slowest worker)
        self.max_lead = 0  # the most rounds any worker's applied push has been ahead of the slowest

    def held(self) -> int:
        """The number of pushes whose replies are withheld now, over every key."""
        return sum(len(queue) for by_worker in self._held.values() for queue in by_worker.values())

    def join(self, key: Key, worker: int, counts: dict[int, int], active: set[int]) -> None:
        """``worker`` joins as a new member (not yet in ``active``; ``counts``: worker -> rounds applied
        on ``key``, its slot's from a previous member, or none): from now on it counts as level with
        the slowest of ``active`` on ``key``, above or below its slot's count (no other worker
        present: as it stands)."""
        lifts = self._lift.setdefault(key, {})
        lifts.pop(worker, None)  # a previous member of the slot's lift is not the newcomer's
        others = active - {worker}
        if others:
            lift = _slowest(counts, others, lifts) - counts.get(worker, 0)
            if lift:
                lifts[worker] = lift
        if not lifts:
            del self._lift[key]

    def applied(self, key: Key, worker: int, counts: dict[int, int], active: set[int],
                replies: list[Any]) -> list[Any]:
        """``worker``'s push of ``key`` was applied (``counts``: worker -> rounds applied on the key);
        return ``replies`` (its acks) if it may have them now, plus the replies this releases for
        others, else hold them."""
        lifts = self._lift.get(key)
        slowest = _slowest(counts, active, lifts)
        mine = counts.get(worker, 0) + (lifts.get(worker, 0) if lifts else 0)
        lead = mine - slowest
        self.max_lead = max(self.max_lead, lead)
        by_worker = self._held.setdefault(key, {})
        queue = by_worker.get(worker)
        if queue or lead > self.threshold:
            by_worker.setdefault(worker, deque()).append((mine, list(replies)))
            replies = []
        return list(replies) + self.release(key, counts, active)

    def attach(self, key: Key, worker: int, replies: list[Any]) -> list[Any]:
        """Hold ``replies`` (a pushpull's answer) with ``worker``'s last withheld push of ``key``, if
        there is one (return []); else return them."""
        queue = self._held.get(key, {}).get(worker)
        if not queue:
            return replies
        queue[-1][1].extend(replies)
        return []

    def release(self, key: Key, counts: dict[int, int], active: set[int]) -> list[Any]:
        """The withheld replies of ``key`` whose workers are now within the bound (or have left)."""
        by_worker = self._held.get(key)
        if not by_worker:
            return []
        slowest = _slowest(counts, active, self._lift.get(key))
        out: list[Any] = []
        for worker in list(by_worker):
            queue = by_worker[worker]
            while queue and (worker not in active or queue[0][0] - slowest <= self.threshold):
                out.extend(queue.popleft()[1])
            if not queue:
                del by_worker[worker]
        if not by_worker:
            del self._held[key]
        return out


def _slowest(counts: dict[int, int], active: set[int], lifts: dict[int, int] | None = None) -> int:
    """The fewest rounds applied by a live worker, a joined one's ``lifts`` added (a large number when
    none is left)."""
    if not lifts:
        return min((counts.get(w, 0) for w in active), default=1 << 62)
    return min((counts.get(w, 0) + lifts.get(w, 0) for w in active), default=1 << 62)

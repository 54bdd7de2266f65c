"""The worker's outbox: requests waiting to be sent, highest ``priority`` first (pure logic, no I/O).

MXNet's ``push``/``pull`` take a ``priority``; among the requests waiting to be sent, a higher one
goes first, and equal priorities keep call order.  Two rules bound the reordering:

* **Call order per key**: a request never overtakes an earlier queued one that shares a key with it,
  whatever its priority.  A request's *effective* priority is capped at the lowest effective priority
  of the queued requests sharing one of its keys, and ties go in call order, so it stays behind them.
  A big value's chunks are requests of one key: they go in order, but a request of another key with a
  higher priority may go between two of them (``kvstore.client.mux`` paces big chunks so that it can).
* **Control messages are barriers**: a request without keys (an optimizer, a barrier, a state
  transfer...) takes the lowest effective priority queued (so it overtakes nothing) and caps every
  later request at it (so nothing queued after it overtakes it).

The bookkeeping (a key's cap, the control floor) is dropped with the last queued request of that key
(of any control request); when the queue is empty, :meth:`put` costs one heap push.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable
from typing import Any


class SendQueue:
    """Items waiting to be sent: :meth:`put` with a priority and keys, :meth:`pop` the next one."""

    __slots__ = ("_heap", "_order", "_caps", "_floor", "_low")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Any, tuple | None]] = []  # (-effective, order, item, keys)
        self._order = itertools.count()
        self._caps: dict[Hashable, list[int]] = {}  # key -> [lowest effective queued, count queued]
        self._floor: list[int] | None = None  # control requests queued: [lowest effective, count]
        self._low: int | None = None  # the lowest effective priority queued (None: empty)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def put(self, item: Any, priority: int = 0, keys: Iterable[Hashable] | None = None) -> int:
        """Queue ``item`` at ``priority`` for ``keys`` (None: a control message, see the module
        docstring); return its effective priority."""
        heap = self._heap
        if not heap:  # nothing to overtake: no caps
            if self._caps:
                self._caps.clear()
            self._floor = self._low = None
            keys = None if keys is None else tuple(keys)
            if keys is None:
                self._floor = [priority, 1]
            else:
                caps = self._caps
                for key in keys:
                    caps[key] = [priority, caps[key][1] + 1] if key in caps else [priority, 1]
            self._low = priority
            heapq.heappush(heap, (-priority, next(self._order), item, keys))
            return priority
        effective = priority
        if keys is None:
            effective = min(priority, self._low)
            floor = self._floor
            self._floor = [effective, 1] if floor is None else [min(floor[0], effective), floor[1] + 1]
        else:
            keys = tuple(keys)
            caps = self._caps
            if self._floor is not None:
                effective = min(effective, self._floor[0])
            for key in keys:
                cap = caps.get(key)
                if cap is not None and cap[0] < effective:
                    effective = cap[0]
            for key in keys:
                cap = caps.get(key)
                if cap is None:
                    caps[key] = [effective, 1]
                else:
                    cap[0] = min(cap[0], effective)
                    cap[1] += 1
        if effective < self._low:
            self._low = effective
        heapq.heappush(heap, (-effective, next(self._order), item, keys))
        return effective

    def pop(self) -> Any:
        """The next item to send (the highest effective priority, then the earliest); raises
        IndexError when empty."""
        _, _, item, keys = heapq.heappop(self._heap)
        if keys is None:
            floor = self._floor
            if floor is not None:
                floor[1] -= 1
                if floor[1] <= 0:
                    self._floor = None
        else:
            caps = self._caps
            for key in keys:
                cap = caps.get(key)
                if cap is not None:
                    cap[1] -= 1
                    if cap[1] <= 0:
                        del caps[key]
        if not self._heap:
            self._low = None
        return item

    def clear(self) -> None:
        """Forget every queued item."""
        self._heap.clear()
        self._caps.clear()
        self._floor = self._low = None

"""Dynamic row-sparse tables, pure (docs/sparse.md, "Dynamic tables"): ids are any 64-bit value, a row
is made on first touch from the table's initialiser, and a table may forget (a capacity with an
eviction policy, an admission count, a time-to-live).  The local store and every server hold their
part of a dynamic table as one :class:`DynamicRows`, and update it with :func:`apply_dynamic`, so both
follow one set of rules.

Storage: an ``id -> slot`` map (:class:`IdMap`, open addressing over numpy arrays: no Python object
per id) over a pool of numpy arrays grown in blocks (the rows, and per slot its
id, its last use and its use count); the optimizer's state arrays are pool-sized too, their rows reset
when a slot is (re)used.  Ids travel and are kept as int64; a uint64 id is its int64 bit pattern.
A row's initial value is the fixed tables' rule with the id as the row number (element ``(id, c)``
from the hash of ``(seed, id * width + c)``) for ids in ``[0, 2**64 // width)``; other ids are hashed
before (:func:`kvstore.core.rowsparse.generate_ids`), whatever server makes it.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.core import rowsparse as R
from kvstore.core.checkpoint import StateEntry
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key
from kvstore.core.rowsparse import DynamicSpec
from kvstore.errors import OptimizerError

SLOT_BYTES = 8 + 1 + 8 + 8 + 8 + 1  # a slot's id, live flag, last tick, last time, use count, unset flag
GROW_BLOCK = 1024  # the pool grows by at least this many rows (and by GROW_FRACTION of itself)
GROW_FRACTION = 4  # ... by a quarter: at most 1.25 slots per row held (half: 1.5, past issue 46's bound)
PENDING_MIN = 1 << 16  # ids counted for admission: at least this many, else the capacity ...
PENDING_MAX = 1 << 20  # ... but never more than this many
PENDING_BYTES = 160  # a counted id's memory (an ordered dict's entry, its int key; measured: ~140)
PLACEMENT_SALT = 0x5DEECE66D  # the seed of the id -> server hash (every worker uses the same)
MAP_SALT = 0x2545F4914F6CDD1D  # the seed of the id map's hash (apart from placement's)
MAP_ENTRIES = 16 / 3  # the id map's entries per id at most (a rebuild fills it at most 3/8, a power of 2)
_RECENT = (1 << 40) - 1  # LFU ties are broken by recency: the tick's low 40 bits
INIT_BLOCK = 1 << 14  # initial rows are generated this many elements at a time (scratch stays in cache)
EVICT_WINDOW = 8  # eviction of n rows looks at this many times n slots (docs/sparse.md) ...
EVICT_MIN_WINDOW = 4096  # ... and at no fewer than this many: a push of few new ids spares hot rows


def table_label(key: Key) -> str:
    """The name of table ``key`` in counters (``stats()``, snapshots): a str key as itself, an int key
    as ``int:<key>``, so ``3`` and ``'3'`` keep their own; a str key starting ``int:`` or ``str:`` gets
    ``str:`` before it (one label per key)."""
    if isinstance(key, str):
        return "str:" + key if key.startswith(("int:", "str:")) else key
    return f"int:{key}"


def full_bytes(spec: DynamicSpec, width: int, dtype: np.dtype, state_bytes: int = 0) -> int:
    """The bytes a table of ``spec`` holds when full (0 when it has no capacity): per row its values,
    its slot's counters, its id map entries (``MAP_ENTRIES``) and ``state_bytes`` of optimizer state;
    and its admission counts (``PENDING_BYTES`` each)."""
    if not spec.capacity:
        return 0
    row = width * np.dtype(dtype).itemsize + SLOT_BYTES + state_bytes
    entry = IdMap.ENTRY_BYTES + (4 if spec.capacity > 2**31 - 1 else 0)  # int64 slots past 2**31 - 1
    id_map = max(IdMap.MIN_SIZE, math.ceil(MAP_ENTRIES * spec.capacity)) * entry
    return spec.capacity * row + id_map + pending_limit(spec) * PENDING_BYTES


def pending_limit(spec: DynamicSpec) -> int:
    """How many ids a table of ``spec`` counts for admission at most: ``capacity`` within
    ``[PENDING_MIN, PENDING_MAX]``, none when every id is admitted at its first push."""
    if spec.admit_after <= 1:
        return 0
    return min(max(PENDING_MIN, spec.capacity), PENDING_MAX)


def servers_of(ids: np.ndarray, num_servers: int) -> np.ndarray:
    """The server of each id (int64): a seeded 64-bit hash of the id, modulo ``num_servers``."""
    with np.errstate(over="ignore"):
        mixed = R.mix(ids.view(np.uint64) ^ np.uint64(PLACEMENT_SALT))
    return (mixed % np.uint64(num_servers)).astype(np.int64)


class IdMap:
    """int64 id -> slot, by open addressing with linear probing over two numpy arrays (keys, and slots
    whose negative values mark a place empty or deleted), at most half full (ids and tombstones), at
    most 3/8 full of ids after a rebuild (so the tombstones of evictions do not make every put rebuild
    it): 12 bytes per entry (int32 slots; 16 once a slot passes 2**31 - 1), up to ``MAP_ENTRIES``
    entries per id.  ``reserve`` (a table's capacity, 0: none): once the ids reach half of it, a growing
    map is sized for that many at once (no rebuild for tombstones right after the table fills).  Every
    call takes a batch of ids, probed together."""

    EMPTY, DELETED = -1, -2  # what ``slots`` holds at a place with no id
    ENTRY_BYTES = 8 + 4
    MIN_SIZE = 1024  # entries of a new map

    def __init__(self, size: int = MIN_SIZE, reserve: int = 0) -> None:
        self.slots = np.zeros(0, np.int32)
        self.reserve = reserve
        self._reset(size)

    def _reset(self, size: int) -> None:
        self.keys = np.zeros(size, np.int64)
        self.slots = np.full(size, self.EMPTY, self.slots.dtype)
        self.count = self.deleted = 0

    def __len__(self) -> int:
        return self.count

    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return self.keys.nbytes + self.slots.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            mixed = R.mix(ids.view(np.uint64) ^ np.uint64(MAP_SALT))
        return (mixed & np.uint64(self.keys.size - 1)).astype(np.int64)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's position in the arrays, -1 when absent."""
        where = np.full(ids.size, -1, np.int64)
        pos = self._home(ids)
        todo = np.arange(ids.size)
        mask = self.keys.size - 1
        while todo.size:
            p = pos[todo]
            state = self.slots[p]
            hit = (state >= 0) & (self.keys[p] == ids[todo])
            where[todo[hit]] = p[hit]
            todo = todo[~(hit | (state == self.EMPTY))]
            pos[todo] = (pos[todo] + 1) & mask
        return where

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The slots of int64 ``ids``, -1 for those absent."""
        where = self._find(ids)
        out = np.full(ids.size, -1, np.int64)
        found = where >= 0
        out[found] = self.slots[where[found]]
        return out

    def put(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Map distinct int64 ``ids``, none of them present, to ``slots`` (non-negative)."""
        if not ids.size:
            return
        if self.slots.dtype != np.int64 and int(slots.max()) > np.iinfo(self.slots.dtype).max:
            self.slots = self.slots.astype(np.int64)  # a pool past 2**31 - 1 slots
        size = self.keys.size
        need = self.count + ids.size
        if (need + self.deleted) * 2 > size:  # past half full: rebuilt, its entries
            if need * 2 >= self.reserve:
                need = max(need, self.reserve)
            while need * 8 > size * 3:  # filling at most 3/8 (room for tombstones)
                size *= 2
            self._rebuild(size)
        pos = self._home(ids)
        todo = np.arange(ids.size)
        mask = size - 1
        while todo.size:
            p = pos[todo]
            state = self.slots[p]
            free = state < 0
            at, claim = p[free], todo[free]
            self.slots[at] = claim  # ids probing one free place claim it: one of them is left there
            won = self.slots[at] == claim
            at, claim = at[won], claim[won]
            self.deleted -= int(np.count_nonzero(state[free][won] == self.DELETED))
            self.keys[at], self.slots[at] = ids[claim], slots[claim]
            placed = np.zeros(ids.size, bool)
            placed[claim] = True
            todo = todo[~placed[todo]]
            pos[todo] = (pos[todo] + 1) & mask
        self.count += ids.size

    def delete(self, ids: np.ndarray) -> None:
        """Unmap ``ids`` (those present)."""
        where = self._find(ids)
        where = where[where >= 0]
        self.slots[where] = self.DELETED
        self.count -= where.size
        self.deleted += where.size

    def _rebuild(self, size: int) -> None:
        full = self.slots >= 0
        keys, slots = self.keys[full], self.slots[full]
        self._reset(size)
        self.put(keys, slots)


@dataclass
class DynamicImage:
    """What a :class:`DynamicRows` holds, as of one instant (a server's shard, docs/failures.md): each
    row held, its id and its counters (its last use as a tick and as seconds idle, its use count,
    whether its optimizer state is still to be reset), the table's tick, its counters and the ids
    counted for admission (the longest uncounted first).  ``slots``: where the rows were (the
    optimizer's state rows are read from them); not stored."""

    ids: np.ndarray
    rows: np.ndarray
    last: np.ndarray
    idle: np.ndarray
    freq: np.ndarray
    unset: np.ndarray
    tick: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    pending_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pending_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class DynamicRows:
    """One server's (or the local store's) rows of a dynamic table, and its counters.

    ``clock`` gives seconds (``time.monotonic``; tests inject one).  Calls are not thread-safe: the
    owner (a server's request loop, the local store's lock) serialises them."""

    def __init__(self, width: int, dtype: np.dtype, init: dict[str, Any], spec: DynamicSpec,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.width, self.dtype, self.init, self.spec, self.clock = width, np.dtype(dtype), init, spec, clock
        self.map = IdMap(reserve=spec.capacity)  # id -> slot
        self.weight = np.zeros((0, width), self.dtype)  # the pool: slot -> row
        self.ids = np.zeros(0, np.int64)  # slot -> its id
        self.live = np.zeros(0, bool)  # slot -> holds a row
        self.last = np.zeros(0, np.int64)  # slot -> tick of its last use (LRU)
        self.seen = np.zeros(0, np.float64)  # slot -> clock of its last use (TTL)
        self.freq = np.zeros(0, np.int64)  # slot -> uses since made (LFU)
        self.unset = np.zeros(0, bool)  # slot -> made, its optimizer state not reset since (admit does)
        self.free = np.zeros(0, np.int64)  # slots freed by expiry, reused first
        self.used = 0  # slots ever handed out: [0, used) are live or free
        self.hand = 0  # where the next eviction's window of slots starts
        self.tick = 0
        self.pending: OrderedDict[int, int] = OrderedDict()  # ids not yet admitted -> pushes counted,
        # the longest uncounted first
        self.pending_limit = pending_limit(spec)
        self.swept = clock()
        self.counts = {"evictions": 0, "admissions": 0, "expirations": 0, "dropped_updates": 0,
                       "pull_rows": 0, "pull_hits": 0}

    # -- what it holds ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.map)

    def nbytes(self) -> int:
        """Bytes of the pool arrays, the id map and the admission counts (estimated: ``PENDING_BYTES``
        each); the optimizer's state is the optimizer's."""
        pool = (self.weight, self.ids, self.live, self.last, self.seen, self.freq, self.unset)
        return sum(a.nbytes for a in pool) + self.map.nbytes() + len(self.pending) * PENDING_BYTES

    def stats(self) -> dict[str, Any]:
        """``rows`` held, ``capacity``, ``evictions``, ``admissions``, ``expirations``,
        ``dropped_updates`` (rows of pushes not stored), ``pull_rows``/``pull_hits`` and ``hit_rate``."""
        out: dict[str, Any] = {"rows": len(self.map), "capacity": self.spec.capacity, **self.counts}
        asked = self.counts["pull_rows"]
        out["hit_rate"] = self.counts["pull_hits"] / asked if asked else 0.0
        return out

    def initial(self, ids: np.ndarray) -> np.ndarray:
        """The initial rows of ``ids`` (what a row is made with, and what a forgotten row reads as)."""
        step = max(1, INIT_BLOCK // self.width)
        if ids.size <= step:
            return R.generate_ids(self.init, ids, self.width, self.dtype)
        out = np.empty((ids.size, self.width), self.dtype)
        for first in range(0, ids.size, step):  # cache-sized blocks: the same values, 2-3x faster
            part = ids[first:first + step]
            out[first:first + step] = R.generate_ids(self.init, part, self.width, self.dtype)
        return out

    def held(self) -> np.ndarray:
        """The ids held, sorted (no use counted)."""
        return np.sort(self.ids[:self.used][self.live[:self.used]])

    def live_slots(self, start: int, limit: int) -> tuple[np.ndarray, int]:
        """The slots holding a row among ``[start, start + limit)`` of the pool, and where the next
        call starts (-1: the pool is done).  Reads no row and counts no use (a save walks the pool)."""
        stop = min(self.used, start + max(1, limit))
        slots = (start + np.flatnonzero(self.live[start:stop])).astype(np.int64)
        return slots, (stop if stop < self.used else -1)

    def put(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, fresh)`` of distinct int64 ``ids``: held ones keep their slot, the others are made
        (initial rows; a restore, so counted neither as admissions nor as uses) as room allows (-1
        where there was none); ``fresh``: the slots made now, whose optimizer state the caller resets
        or installs (:func:`fit_state`, :func:`load_state`): a later push does not reset it again."""
        slots = self._lookup(ids)
        miss = np.flatnonzero(slots < 0)
        fresh = np.zeros(0, np.int64)
        if miss.size:
            made = self._make(ids[miss], slots[slots >= 0])
            slots[miss] = made
            fresh = made[made >= 0]
            self.unset[fresh] = False
        return slots, fresh

    def snapshot(self) -> DynamicImage:
        """A copy of every row held and of its counters (:class:`DynamicImage`); counts no use."""
        slots, _ = self.live_slots(0, self.used)
        now = self.clock()
        n = len(self.pending)  # up to a million ids counted for admission: no list of them built
        pending_ids = np.fromiter(self.pending.keys(), np.int64, n)
        pending_counts = np.fromiter(self.pending.values(), np.int64, n)
        return DynamicImage(self.ids[slots], self.weight[slots], self.last[slots], now - self.seen[slots],
                            self.freq[slots], self.unset[slots], self.tick, dict(self.counts),
                            pending_ids, pending_counts, slots)

    def restore(self, image: DynamicImage) -> np.ndarray:
        """Hold ``image``'s rows and counters (a server restarted from its shard; the table holds no
        row yet): each row's idle time goes on from the image's (the time since is not counted).
        Returns the rows' slots (for the optimizer's state rows); ValueError when the table holds
        rows already or the image's rows are not this table's width and dtype."""
        n = image.ids.size
        if len(self) or image.rows.shape != (n, self.width) or image.rows.dtype != self.dtype:
            raise ValueError(f"a dynamic table's image of {image.rows.dtype}{image.rows.shape} restores "
                             f"into an empty table of {self.dtype} rows of {self.width} only")
        self._grow(n)
        slots = np.arange(n, dtype=np.int64)
        self.used = n
        self.weight[slots], self.ids[slots], self.live[slots] = image.rows, image.ids, True
        self.last[slots], self.seen[slots] = image.last, self.clock() - image.idle
        self.freq[slots], self.unset[slots] = image.freq, image.unset
        self.map.put(image.ids, slots)
        self.tick = max(self.tick, image.tick)
        self.counts.update({k: int(v) for k, v in image.counts.items() if k in self.counts})
        self.pending = OrderedDict(zip(image.pending_ids.tolist(), image.pending_counts.tolist()))
        while len(self.pending) > self.pending_limit:
            self.pending.popitem(last=False)
        return slots

    def slot(self, id_: int) -> int:
        """The slot of ``id_``, -1 when it is not held (no use counted)."""
        return int(self.map.get(np.array([id_], np.int64))[0])

    # -- reads and updates --------------------------------------------------------------------------
    def read(self, ids: np.ndarray, admit: bool = False) -> np.ndarray:
        """The rows of distinct int64 ``ids``: held ones (their use counted), the others their initial
        rows, made and held only with ``admit`` (as room allows)."""
        self._begin()
        slots = self._lookup(ids)
        hit = slots >= 0
        self.counts["pull_rows"] += int(ids.size)
        self.counts["pull_hits"] += int(hit.sum())
        if admit and not hit.all():
            made = self._make(ids[~hit], slots[hit])
            slots[np.flatnonzero(~hit)[made >= 0]] = made[made >= 0]
            self.counts["admissions"] += int(np.count_nonzero(made >= 0))
            hit = slots >= 0
        self._touch(slots[hit])
        out = np.empty((ids.size, self.width), self.dtype)
        out[hit] = self.weight[slots[hit]]
        if not hit.all():
            out[~hit] = self.initial(ids[~hit])
        return out

    def admit(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Take a push of distinct int64 ``ids``: ``(keep, slots, fresh)``: the positions in ``ids`` of
        the rows to update, their slots, and the slots whose rows were made since their last update
        (now, or by an admitting :meth:`read`): their optimizer state is to be reset.  An id not held is
        counted; it is made once counted ``admit_after`` times (room allowing), else its update is
        dropped."""
        self._begin()
        slots = self._lookup(ids)
        hit = slots >= 0
        if not hit.all():
            missing = np.flatnonzero(~hit)
            ready = self._count(ids[missing])
            if ready.any():
                made = self._make(ids[missing[ready]], slots[hit])
                slots[missing[ready]] = made
                self.counts["admissions"] += int(np.count_nonzero(made >= 0))
        keep = np.flatnonzero(slots >= 0)
        self.counts["dropped_updates"] += int(ids.size - keep.size)
        self._touch(slots[keep])
        kept = slots[keep]
        fresh = kept[self.unset[kept]]
        self.unset[fresh] = False  # the caller resets their state now (fit_state)
        return keep, kept, fresh

    def expire(self) -> int:
        """Drop every row untouched for longer than ``ttl``; how many were dropped."""
        if not self.spec.ttl:
            return 0
        now = self.clock()
        self.swept = now
        old = np.flatnonzero(self.live[:self.used] & (self.seen[:self.used] < now - self.spec.ttl))
        self._drop(old, "expirations")
        self.free = np.concatenate([self.free, old])
        return int(old.size)

    # -- the pool -----------------------------------------------------------------------------------
    def _begin(self) -> None:
        self.tick += 1
        if self.spec.ttl and self.clock() - self.swept > self.spec.ttl / 4:
            self.expire()

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot, -1 when not held (a row past its ttl is dropped here: never read stale)."""
        slots = self.map.get(ids)
        if self.spec.ttl and slots.size:
            found = slots[slots >= 0]
            old = found[self.seen[found] < self.clock() - self.spec.ttl]
            if old.size:
                self._drop(old, "expirations")
                self.free = np.concatenate([self.free, old])
                slots[np.isin(slots, old)] = -1
        return slots

    def _touch(self, slots: np.ndarray) -> None:
        self.last[slots] = self.tick
        self.seen[slots] = self.clock()
        self.freq[slots] += 1

    def _count(self, ids: np.ndarray) -> np.ndarray:
        """Count one push of each id not held; which ones reach ``admit_after`` (their count dropped)."""
        need = self.spec.admit_after
        if need <= 1:
            return np.ones(ids.size, bool)
        ready = np.zeros(ids.size, bool)
        pending = self.pending
        for i, id_ in enumerate(ids.tolist()):
            seen = pending.pop(id_, 0) + 1
            if seen >= need:
                ready[i] = True
            else:
                pending[id_] = seen  # re-inserted: the order is the order of last counting
        while len(pending) > self.pending_limit:  # bounded: the longest-uncounted ids forget their count
            pending.popitem(last=False)  # O(1) (deleting a plain dict's first key rescans its holes)
        return ready

    def _make(self, ids: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for new rows ``ids`` (initial values, fresh counters), evicting (never ``keep``) when
        at capacity; -1 for the ids there was no room for (more new ids than the capacity)."""
        slots = np.full(ids.size, -1, np.int64)
        n = ids.size
        from_free = min(n, self.free.size)
        cap = self.spec.capacity
        room = n - from_free if not cap else max(0, min(n - from_free, cap - self.used))
        self._grow(self.used + room)  # first: a MemoryError there leaves the table as it was
        parts = [self.free[self.free.size - from_free:]]
        self.free = self.free[:self.free.size - from_free]
        if room:
            parts.append(np.arange(self.used, self.used + room, dtype=np.int64))
            self.used += room
        short = n - from_free - room
        if short:
            parts.append(self._evict(short, keep))
        got = np.concatenate(parts)
        slots[:got.size] = got
        made = slots[:got.size]
        placed = ids[:got.size]
        self.weight[made] = self.initial(placed)
        self.ids[made] = placed
        self.live[made] = True
        self.last[made] = self.tick
        self.seen[made] = self.clock()
        self.freq[made] = 0
        self.unset[made] = True  # whatever state the slot's last row left is not this row's
        self.map.put(placed, made)
        return slots

    def _evict(self, n: int, keep: np.ndarray) -> np.ndarray:
        """Free up to ``n`` slots by the policy, never one of ``keep``; the slots freed.  The candidates
        are the next ``max(EVICT_WINDOW * n, EVICT_MIN_WINDOW)`` slots of the pool past a hand that
        goes round it: the ``n`` of them with the lowest score go, so a call costs O(n + floor) whatever
        the capacity.  The whole pool (``used`` slots) is looked at when it is no bigger than that
        window (exact LRU / LFU), or when the window holds fewer than ``n`` rows that may go (mostly
        this push's own rows)."""
        used = self.used
        window = max(EVICT_WINDOW * n, EVICT_MIN_WINDOW)
        if window >= used:
            return self._evict_from(0, used, n, keep)
        start = self.hand
        self.hand = (start + window) % used
        victims = self._evict_from(start, window, n, keep)
        if victims.size < n:  # too few candidates there: the rest from the whole pool (exact)
            victims = np.concatenate([victims, self._evict_from(0, used, n - victims.size, keep)])
        return victims

    def _evict_from(self, start: int, count: int, n: int, keep: np.ndarray) -> np.ndarray:
        """Drop the (up to) ``n`` live rows with the lowest score among the ``count`` slots from
        ``start`` on (going round the pool's end), never one of ``keep``; the slots freed."""
        used = self.used

        def ring(a: np.ndarray) -> np.ndarray:  # a copy of a[start:start + count], going round
            end = start + count
            return a[start:end].copy() if end <= used else np.concatenate([a[start:used], a[:end - used]])

        if self.spec.policy == "lru":
            score = ring(self.last)
        else:
            score = np.minimum(ring(self.freq), (1 << 22) - 1) << 40 | (ring(self.last) & _RECENT)
        high = np.iinfo(np.int64).max
        score[~ring(self.live)] = high
        if keep.size:
            offset = (keep - start) % used  # where each kept slot sits among these, if it does
            score[offset[offset < count]] = high
        n = min(n, int(np.count_nonzero(score < high)))
        if n <= 0:
            return np.zeros(0, np.int64)
        chosen = np.argpartition(score, n - 1)[:n] if n < count else np.arange(count)
        victims = (chosen + start) % used
        self._drop(victims, "evictions")
        return victims

    def _drop(self, slots: np.ndarray, why: str) -> None:
        self.map.delete(self.ids[slots])
        self.live[slots] = False
        self.counts[why] += int(slots.size)

    def _grow(self, need: int) -> None:
        size = self.weight.shape[0]
        if need <= size:
            return
        new = max(need, size + max(GROW_BLOCK, size // GROW_FRACTION))
        if self.spec.capacity:
            new = max(need, min(new, self.spec.capacity))

        def grown(a: np.ndarray) -> np.ndarray:
            out = np.zeros((new, *a.shape[1:]), a.dtype)
            out[:size] = a
            return out

        # every array allocated before any is replaced: a MemoryError leaves the pool as it was
        arrays = [grown(a) for a in (self.weight, self.ids, self.live, self.last, self.seen, self.freq,
                                     self.unset)]
        self.weight, self.ids, self.live, self.last, self.seen, self.freq, self.unset = arrays


def fit_state(optimizer: Optimizer, key: Key, weight: np.ndarray, fresh: np.ndarray) -> None:
    """Make ``key``'s optimizer state (if any) as long as the pool ``weight`` (fresh rows for the
    slots the pool grew by) and reset the rows of ``fresh`` slots (a row made now starts anew)."""
    state = optimizer.states.get(key)
    if state is None:
        return
    size = weight.shape[0]
    for name, array in list(state.items()):
        if array.shape[0] < size:
            tail = optimizer.create_state(key, weight[array.shape[0]:])
            state[name] = np.concatenate([array, tail[name]])
    if fresh.size:
        new = optimizer.create_state(key, weight[fresh])
        for name, array in state.items():
            array[fresh] = new[name]


def state_of(optimizer: Optimizer, key: Key, table: DynamicRows,
             slots: np.ndarray) -> dict[str, np.ndarray] | None:
    """The optimizer state rows of ``slots`` of ``key`` (copies, by state name); None when the key was
    never updated (nothing to save).  A key stepped with none of these slots' rows yet answers the
    fresh state its first update would make."""
    state = optimizer.states.get(key)
    if state is None:
        if key not in optimizer.counts:
            return None
        return optimizer.create_state(key, table.weight[slots])
    fit_state(optimizer, key, table.weight, np.zeros(0, np.int64))
    return {name: array[slots] for name, array in state.items()}


def check_state(optimizer: Optimizer, key: Key, table: DynamicRows, ids: np.ndarray,
                arrays: dict[str, np.ndarray], whole: bool = True) -> None:
    """Raise OptimizerError unless ``arrays`` are the states ``optimizer`` keeps for ``key`` (all of
    them with ``whole``, else some), each ``(ids.size, width)`` rows of its dtype, and ``ids`` distinct
    int64."""
    if ids.dtype != np.int64 or ids.ndim != 1 or np.unique(ids).size != ids.size:
        raise OptimizerError(f"key {key!r}: saved row ids must be distinct int64")
    probe = optimizer.create_state(key, table.weight[:0])
    if set(arrays) != set(probe) if whole else not set(arrays) <= set(probe):
        raise OptimizerError(f"key {key!r}: {optimizer.name} state needs arrays {sorted(probe)}, got "
                             f"{sorted(arrays)}")
    for name, rows in arrays.items():
        if rows.size != ids.size * table.width or rows.dtype != probe[name].dtype:
            raise OptimizerError(f"key {key!r}: state {name!r} rows must be {probe[name].dtype}"
                                 f"({ids.size}, {table.width}), got {rows.dtype}{rows.shape}")


def load_state(optimizer: Optimizer, key: Key, table: DynamicRows, ids: np.ndarray,
               arrays: dict[str, np.ndarray], count: int, whole: bool = True) -> int:
    """Install saved optimizer state rows ``arrays`` (name -> ``ids.size`` rows) of distinct int64
    ``ids`` of ``key``: rows not held are made first (their initial value), as room allows; the key's
    update count becomes ``count`` (``whole``: ``arrays`` holds every state array, else some of them).
    Returns how many ids found no room (their state is dropped).
    Raises OptimizerError as :func:`check_state` (before anything changes)."""
    check_state(optimizer, key, table, ids, arrays, whole)
    slots, fresh = table.put(ids)
    if key not in optimizer.states:
        optimizer.states[key] = optimizer.create_state(key, table.weight)
    fit_state(optimizer, key, table.weight, fresh)
    keep = slots >= 0
    state = optimizer.states[key]
    for name, rows in arrays.items():
        state[name][slots[keep]] = rows.reshape(ids.size, table.width)[keep]
    table.unset[slots[keep]] = False  # a row an admitting pull made: its loaded state is its own now
    optimizer.counts[key] = count
    optimizer.num_update = max(optimizer.num_update, count)
    return int(ids.size - np.count_nonzero(keep))


def state_entry(optimizer: Optimizer, key: Key, table: DynamicRows,
                row_shape: tuple[int, ...]) -> StateEntry | None:
    """Every held row's optimizer state of ``key`` as a file entry (rows sorted by id, ``ids`` set);
    None when the key was never updated."""
    slots, _ = table.live_slots(0, table.used)
    ids = table.ids[slots]
    order = np.argsort(ids, kind="stable")
    slots, ids = slots[order], ids[order]
    arrays = state_of(optimizer, key, table, slots)
    if arrays is None:
        return None
    n = slots.size
    return StateEntry(key, (n, *row_shape), table.dtype, int(optimizer.counts.get(key, 0)),
                      {name: a.reshape(n, *row_shape) for name, a in arrays.items()}, ids)


def apply_dynamic(optimizer: Optimizer | None, key: Key, table: DynamicRows, ids: np.ndarray,
                  rows: np.ndarray) -> None:
    """Apply one summed push (distinct int64 ``ids``, their rows) to ``table``: admission first, then
    the rows stored are assigned (no optimizer) or stepped lazily (only those rows, whatever the
    optimizer's ``lazy_update``; the key's count counts every push, as for fixed tables)."""
    keep, slots, fresh = table.admit(ids)
    if optimizer is None:
        table.weight[slots] = rows[keep]
        return
    fit_state(optimizer, key, table.weight, fresh)
    optimizer.update_rows(key, table.weight, slots, rows[keep] if keep.size != ids.size else rows)

"""One dist_sync round of one key: its accumulator, its parts and who contributed what.

Pure numpy, no I/O; :class:`kvstore.core.shard.ShardState` keeps a queue of these per key.

A round sums one contribution per worker.  Each chunk ``[lo, hi)`` of a contribution lands on the
round's :class:`ChunkRange` starting at ``lo`` (every worker splits a key at the same offsets within a
round).  In arrival order (``ordered=False``) a chunk is added into the accumulator at once; in rank
order (``ordered=True``) it is added once every lower rank the round expects has been added over
its range, and held until then, so the sum is ``((v0 + v1) + v2) + ...`` whatever the arrival order.
The ranks a round expects are the workers still in the cluster plus those that contributed to it
(one that left part-way through its contribution only over the chunks it sent).  When the round's
first addition is a whole push, the accumulator is that pushed array itself (no copy; it is never
written to); a second contribution makes an owned sum.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np

from kvstore.core.partition import Key
from kvstore.errors import ProtocolError


class ChunkRange:
    """One chunk range ``[lo, hi)`` of a sync round (``lo`` is its key in ``Round.parts``)."""

    __slots__ = ("hi", "last", "held")

    def __init__(self, hi: int) -> None:
        self.hi = hi
        self.last = -1  # highest rank added into the accumulator over this range (-1: none yet)
        self.held: dict[int, np.ndarray] = {}  # rank -> chunk waiting for lower ranks


class Round:
    """One dist_sync round of one key: its accumulator and who contributed what."""

    __slots__ = ("acc", "owned", "parts", "tokens", "covered", "complete", "nheld", "ranks", "opened",
                 "last")

    def __init__(self, ranks: list[int], opened: float = 0.0) -> None:
        self.acc: np.ndarray | None = None  # the running sum (over the parts added so far)
        self.owned = False                  # False: acc is a pushed array itself, never written to
        self.parts: dict[int, ChunkRange] = {}    # lo -> part
        self.tokens: dict[int, list] = {}   # worker -> tokens of its chunks (acked at close)
        self.covered: dict[int, int] = {}   # contributor -> end of its chunks so far
        self.complete: set[int] = set()     # contributors whose contribution covers [0, size)
        self.nheld = 0                      # chunks held over all parts
        self.ranks = ranks                  # sorted ranks expected: active workers + contributors
        self.opened = opened                # when its first chunk arrived (the shard's clock)
        self.last = -1                      # the worker whose contribution completed last (-1: none)

    def held_bytes(self) -> int:
        """Bytes this round holds: its accumulator (maybe a pushed array) and the chunks it holds."""
        total = 0 if self.acc is None else self.acc.nbytes
        if self.nheld:
            total += sum(v.nbytes for part in self.parts.values() for v in part.held.values())
        return total

    def check_part(self, key: Key, worker: int, lo: int, hi: int) -> None:
        """Raise :class:`ProtocolError` for a chunk that overlaps a part of this round with other bounds.

        Comparing with the part that starts at ``lo`` is enough: each contributor's chunks tile
        ``[0, covered)`` with parts that do not overlap, and ``lo`` is 0 or the end of one of the
        worker's own parts, so a part starting after ``lo`` would overlap that part (by induction,
        none does) and any other part overlapping ``[lo, hi)`` starts at ``lo``.
        """
        part = self.parts.get(lo)
        if part is not None and part.hi != hi:
            raise ProtocolError(f"key {key!r}: worker {worker}'s chunk [{lo}, {hi}) overlaps the chunk "
                                f"[{lo}, {part.hi}) of this round: every worker must split a key at "
                                f"the same offsets")

    def contribute(self, token: Any, worker: int, value: np.ndarray, lo: int, hi: int, size: int,
                   ordered: bool, active: set[int]) -> bool:
        """Take ``worker``'s checked chunk ``[lo, hi)`` of a ``size``-element key (added now, or held
        for lower ranks when ``ordered``); return whether it completes the worker's contribution."""
        tokens = self.tokens.get(worker)
        if tokens is None:
            self.tokens[worker] = [token]
        else:
            tokens.append(token)
        self.covered[worker] = hi
        complete = hi == size
        if complete:
            self.complete.add(worker)
            self.last = worker
        part = self.parts.get(lo)
        if part is None:
            part = self.parts[lo] = ChunkRange(hi)
        if not ordered or self.next_rank(part, active) == worker:
            self.add(part, worker, lo, value, size)
            if part.held:
                self.drain(part, lo, size, active)
        else:
            part.held[worker] = value  # may view a received frame: never written to
            self.nheld += 1
        return complete

    def leave(self, worker: int, active: set[int], size: int) -> None:
        """``worker`` left (``active`` no longer holds it): its tokens go unanswered, and the chunks
        that waited only for it are added."""
        if worker in self.tokens:
            self.tokens[worker] = []
        self.ranks = sorted(active.union(self.covered))
        if self.nheld:  # chunks that waited for the leaver may be added now
            for lo, part in self.parts.items():
                if part.held:
                    self.drain(part, lo, size, active)

    def next_rank(self, part: ChunkRange, active: set[int]) -> int:
        """The rank to add next over ``part``: the lowest expected rank above ``part.last`` (-1: none).

        Expected: active workers, and contributors whose chunks cover the part (a worker that
        left part-way through its contribution is not waited for over the rest).
        """
        ranks = self.ranks
        covered, hi = self.covered, part.hi
        for i in range(bisect_right(ranks, part.last), len(ranks)):
            rank = ranks[i]
            if rank in active or covered.get(rank, 0) >= hi:
                return rank
        return -1

    def add(self, part: ChunkRange, rank: int, lo: int, value: np.ndarray, size: int) -> None:
        """Add ``rank``'s chunk into the accumulator over ``part`` (the chunk is then dropped)."""
        hi = part.hi
        whole = hi - lo == size
        if part.last < 0:
            if whole:
                self.acc, self.owned = value, False  # no copy; never written to
            else:
                if self.acc is None:
                    self.acc, self.owned = np.empty(size, value.dtype), True
                self.acc[lo:hi] = value
        elif not self.owned:
            self.acc, self.owned = self.acc + value, True
        elif whole:
            self.acc += value
        else:
            self.acc[lo:hi] += value
        part.last = rank

    def drain(self, part: ChunkRange, lo: int, size: int, active: set[int]) -> None:
        """Add the held chunks of ``part`` whose turn has come, in rank order."""
        held = part.held
        while held:
            rank = self.next_rank(part, active)
            value = held.pop(rank, None)
            if value is None:
                return
            self.nheld -= 1
            self.add(part, rank, lo, value, size)

    def done(self, active: set[int]) -> bool:
        """Whether this round may close: every active worker's contribution is complete and added."""
        return not self.nheld and len(self.complete) >= len(active) and active <= self.complete

    def reached(self, quorum: int, size: int) -> bool:
        """Whether this round may close by quorum (``KVSTORE_SYNC_QUORUM``): ``quorum`` contributions
        are complete.  In rank order, the chunks held for workers that did not make it are then added
        (each over the parts its sender covered), since the round no longer waits for anyone."""
        if len(self.complete) < quorum:
            return False
        if self.nheld:
            self.ranks = sorted(self.covered)
            for lo, part in self.parts.items():
                if part.held:
                    self.drain(part, lo, size, set())
        return not self.nheld

    def scaled(self, total: np.ndarray, workers: int) -> np.ndarray:
        """``total`` (from :meth:`total`) with each part multiplied by ``workers`` / the number of
        contributions covering it, so a quorum round's sum stands for ``workers`` pushes (float keys
        only; integer sums are left as they are).  Returns ``total`` or a scaled copy."""
        if total.dtype.kind not in "fc":
            return total
        out = None
        for lo, part in self.parts.items():
            count = sum(1 for end in self.covered.values() if end >= part.hi)
            if count and count != workers:
                if out is None:
                    out = (total if self.owned else total.copy()).reshape(-1)
                out[lo:part.hi] *= workers / count
        return total if out is None else out.reshape(total.shape)

    def total(self, size: int) -> np.ndarray:
        """The round's sum, once :meth:`done`: elements that no contribution covered (only workers
        that left part-way contributed) are set to 0 first."""
        if not self.complete:
            pos = 0
            for lo in sorted(self.parts):
                if lo > pos:
                    self.acc[pos:lo] = 0
                pos = self.parts[lo].hi
            if pos < size:
                self.acc[pos:] = 0
        return self.acc

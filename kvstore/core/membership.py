"""The workers' agreed view of who is in the job, and an epoch's data split by it (pure logic).

A :class:`Membership` is what one barrier's release tells every worker it releases: the worker slots
held (``ranks``, present or away on a restart) among ``slots``, numbered by the barriers the job has
passed, so every worker released by one barrier holds the same view (docs/elastic.md).
:func:`view_of` builds one from a barrier's reply or a cluster map; :class:`EpochSplit` gives each
worker of a view its share of an epoch's samples, so every sample is seen once per epoch whatever
the view.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_TAG", "EpochSplit", "Membership", "check_tag", "view_of"]

MAX_TAG = 8  # ints a view's tag may hold (it rides on barriers and cluster maps)


@dataclass(frozen=True)
class Membership:
    """The workers of a job as one barrier agreed them: ``number``, the barriers the job had passed
    then (equal on every worker the barrier released); ``ranks``, the slots held, ascending (a worker
    restarting under ``--max-restarts`` is still held); ``slots``, the job's worker slots
    (``kv.num_workers``); ``tag``, the ints the workers passed with the barrier (``()`` if none)."""

    number: int
    ranks: tuple[int, ...]
    slots: int
    tag: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """The workers present."""
        return len(self.ranks)

    def index(self, rank: int) -> int:
        """``rank``'s place in the view (0 for its lowest rank); ValueError when it is not in it."""
        try:
            return self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"worker {rank} is not in membership view {self.number} "
                             f"(ranks {list(self.ranks)})") from None

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks


def check_tag(tag: Any) -> tuple[int, ...]:
    """``tag`` as a tuple of at most :data:`MAX_TAG` ints, each in ``[-2**63, 2**64)`` (what msgpack
    carries); TypeError for a tag that is not a sequence of ints, ValueError for too many or too big."""
    if isinstance(tag, (str, bytes)) or not hasattr(tag, "__iter__"):
        raise TypeError(f"a membership tag is a sequence of ints, not {type(tag).__name__}")
    ints = tuple(operator.index(t) for t in tag)
    if len(ints) > MAX_TAG:
        raise ValueError(f"a membership tag holds at most {MAX_TAG} ints, not {len(ints)}")
    for t in ints:
        if not -2 ** 63 <= t < 2 ** 64:
            raise ValueError(f"a membership tag's ints fit in 64 bits (msgpack's), not {t}")
    return ints


def view_of(body: dict[str, Any], slots: int, number: int) -> Membership:
    """The view a barrier's reply (or a cluster map) ``body`` gives: the slots not in its ``left``
    (a map's ``absent``), ``view`` as its number (else ``number``) and its ``tag``; values of the
    wrong type are ignored (a reply is the scheduler's, checked there)."""
    gone = body.get("left", body.get("absent", []))
    gone = {r for r in gone if type(r) is int} if isinstance(gone, list) else set()
    tag = body.get("tag", [])
    tag = tuple(t for t in tag if type(t) is int) if isinstance(tag, list) else ()
    seen = body.get("view")
    return Membership(seen if type(seen) is int else number,
                      tuple(r for r in range(slots) if r not in gone), slots, tag[:MAX_TAG])


@dataclass(frozen=True)
class EpochSplit:
    """One epoch of ``samples`` samples split over ``workers`` present workers in rank order, each
    part cut in batches of ``batch_size``, a last batch shorter than ``min_batch`` dropped.

    Part ``i`` (the ``i``-th rank of the view) holds positions ``[start, stop)`` of the epoch's order,
    its sizes differing by at most one (the first ``samples % workers`` parts one more): every
    sample is in one part.  The epoch has as many steps as the biggest part has batches; a worker
    whose part has fewer batches pushes zeros in the steps it lacks (dist_sync waits for every
    present worker in every round).  Raises ValueError for a count below 1 or a bad ``min_batch``.
    """

    samples: int
    workers: int
    batch_size: int
    min_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("samples", "workers", "batch_size", "min_batch"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.min_batch > self.batch_size:
            raise ValueError(f"min_batch {self.min_batch} is larger than batch_size {self.batch_size}")

    def bounds(self, part: int) -> tuple[int, int]:
        """``(start, stop)`` of part ``part`` in the epoch's order; ValueError outside the parts."""
        if not 0 <= part < self.workers:
            raise ValueError(f"part {part} is outside [0, {self.workers})")
        base, extra = divmod(self.samples, self.workers)
        start = part * base + min(part, extra)
        return start, start + base + (1 if part < extra else 0)

    def batches(self, part: int) -> int:
        """The batches of part ``part``: its full ones, and a last partial one of ``min_batch`` or more."""
        start, stop = self.bounds(part)
        full, rest = divmod(stop - start, self.batch_size)
        return full + (1 if rest >= self.min_batch else 0)

    @property
    def steps(self) -> int:
        """The epoch's steps: the batches of the biggest part (part 0)."""
        return self.batches(0)

    def rows(self, part: int, index: int) -> tuple[int, int]:
        """``(start, stop)`` in the epoch's order of batch ``index`` of part ``part`` (an empty range
        when that part has no such batch: a step it pushes zeros in)."""
        start, stop = self.bounds(part)
        if index >= self.batches(part):
            return stop, stop
        lo = start + index * self.batch_size
        return lo, min(lo + self.batch_size, stop)

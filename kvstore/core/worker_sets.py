"""Worker sets: the workers a key belongs to (``kv.init(key, value, workers=...)``, pure logic).

A :class:`WorkerSet` is a small frozen value naming worker ranks (Horovod calls these process sets;
``Group`` names other things here).  A key of a set is initialised, pushed and pulled by the set's
members only; its ``dist_sync`` round completes with the pushes of the members present when it opens
(docs/worker-sets.md).  :func:`worker_set` turns what a caller passes into one, checked.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerSet", "worker_set"]


@dataclass(frozen=True)
class WorkerSet:
    """Worker ranks a key belongs to: ``ranks``, sorted, distinct, each an int >= 0, at least one."""

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = tuple(sorted({operator.index(r) for r in self.ranks}))
        if not ranks:
            raise ValueError("a worker set holds at least one worker rank")
        if ranks[0] < 0:
            raise ValueError(f"worker ranks are >= 0, not {ranks[0]}")
        object.__setattr__(self, "ranks", ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks

    def __iter__(self) -> Any:
        return iter(self.ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __str__(self) -> str:
        return "{" + ", ".join(map(str, self.ranks)) + "}"


def worker_set(workers: WorkerSet | Iterable[int] | None, num_workers: int | None = None) -> WorkerSet | None:
    """``workers`` as a :class:`WorkerSet` (None stays None: every worker).  Raises ``TypeError`` for
    something that is not ranks, ``ValueError`` for an empty set or a rank outside
    ``[0, num_workers)`` (when given)."""
    if workers is None:
        return None
    if not isinstance(workers, WorkerSet):
        if isinstance(workers, (str, bytes)) or not hasattr(workers, "__iter__"):
            raise TypeError(f"workers is an iterable of worker ranks or a WorkerSet, not "
                            f"{type(workers).__name__}")
        workers = WorkerSet(tuple(workers))
    if num_workers is not None and workers.ranks[-1] >= num_workers:
        raise ValueError(f"worker set {workers} names rank {workers.ranks[-1]}, outside the job's "
                         f"[0, {num_workers})")
    return workers

"""Worker sets: the workers a key belongs to (``kv.init(key, value, workers=...)``, pure logic).

A :class:`WorkerSet` is a small frozen value naming worker ranks (Horovod calls these process sets;
``Group`` names other things here).  A key of a set is initialised, pushed and pulled by the set's
members only; its ``dist_sync`` round completes with the pushes of the members present when it opens
(docs/worker-sets.md).  :func:`worker_set` turns what a caller passes into one, checked;
:class:`InitRendezvous` is a server's side of the members' init.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvstore.core import agreement
from kvstore.core.partition import Key
from kvstore.core.replies import Completion
from kvstore.errors import CollectiveMismatchError, DeadlineExceededError, DuplicateInitError

__all__ = ["InitRendezvous", "WorkerSet", "worker_set"]


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


class _Meet:
    """One key's rendezvous: who of its ``members`` has come, each with its request's token, the
    digest of its arguments (key, shape, dtype) and the set it named; when the first came."""

    __slots__ = ("members", "came", "opened")

    def __init__(self, members: frozenset[int], opened: float) -> None:
        self.members = members
        self.came: dict[int, tuple[Any, str, frozenset[int]]] = {}
        self.opened = opened


class InitRendezvous:
    """The members' init rendezvous of one server's worker-set keys (pure; docs/worker-sets.md).

    Every member of a key's set sends a meet (:meth:`arrive`); the lowest present member also sends
    the value, which the shard stores (:meth:`expect`).  :meth:`complete` answers every member once
    the key is stored and every present member has come: with an ack, or with one
    :class:`CollectiveMismatchError` when their digests or sets differ (the caller then drops the
    key).  :meth:`expired` fails a rendezvous still open after a deadline, naming who is missing.
    ``clock`` stamps a rendezvous's first arrival."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._meets: dict[Key, _Meet] = {}

    def __bool__(self) -> bool:
        return bool(self._meets)

    def expect(self, key: Key, members: frozenset[int]) -> None:
        """``key``'s value is stored now (its set ``members``): its members' meets may come."""
        if key not in self._meets:
            self._meets[key] = _Meet(members, self.clock())

    def forget(self, key: Key) -> None:
        """``key`` needs no rendezvous (restored from a shard image: its members met long ago)."""
        self._meets.pop(key, None)

    def arrive(self, token: Any, worker: int, key: Key, members: frozenset[int], digest: str,
               stored: bool) -> None:
        """``worker`` (a member of ``members``, checked by the caller) came to ``key``'s rendezvous
        with ``digest``; ``stored``: the key is stored already.  Raises :class:`DuplicateInitError` for
        a stored key whose rendezvous is over (an init of a key that exists)."""
        meet = self._meets.get(key)
        if meet is None:
            if stored:
                raise DuplicateInitError(f"key {key!r} is already initialised on this server")
            meet = self._meets[key] = _Meet(members, self.clock())
        meet.came[worker] = (token, digest, members)

    def complete(self, key: Key, stored: frozenset[int] | None,
                 present: set[int]) -> tuple[list[Completion], bool]:
        """What ``key``'s rendezvous answers now, and whether it failed: nothing until the key is stored
        (``stored``: its set, None while it is not) and every member in ``present`` has come."""
        meet = self._meets.get(key)
        if meet is None or stored is None or not meet.came or not (present & stored) <= meet.came.keys():
            return [], False
        del self._meets[key]
        digests = {w: digest for w, (_, digest, _) in meet.came.items()}
        error = agreement.disagreement(f"init of key {key!r} (worker set {sorted(stored)})", digests)
        others = {w: named for w, (_, _, named) in meet.came.items() if named != stored}
        if error is None and others:
            error = CollectiveMismatchError(
                f"init of key {key!r}: worker(s) {sorted(others)} named worker set(s) "
                f"{sorted({tuple(sorted(n)) for n in others.values()})}, the others {sorted(stored)}",
                sorted(others))
        return [Completion(token, error=None if error is None else copy.copy(error))
                for token, _, _ in meet.came.values()], error is not None

    def pending(self) -> list[Key]:
        """The keys whose rendezvous is open."""
        return list(self._meets)

    def expired(self, older_than: float, present: set[int],
                stored: Callable[[Key], bool]) -> list[tuple[Key, list[Completion]]]:
        """Fail each rendezvous opened more than ``older_than`` seconds ago: every member that came is
        answered with :class:`DeadlineExceededError` naming the members still missing (of ``present``)
        or the value that never came (``stored(key)`` false); return ``(key, completions)`` of each."""
        now, failed = self.clock(), []
        for key, meet in list(self._meets.items()):
            if not meet.came or now - meet.opened <= older_than:
                continue
            del self._meets[key]
            missing = sorted((present & meet.members) - meet.came.keys())
            why = (f"member(s) {missing} did not call it" if missing else
                   "the value of its lowest present member never came" if not stored(key) else
                   "it was not answered")
            error = DeadlineExceededError(f"init of key {key!r} of worker set {sorted(meet.members)}: "
                                          f"{why} within {older_than:g} s (KVSTORE_REQUEST_TIMEOUT); "
                                          "nothing was made")
            failed.append((key, [Completion(token, error=copy.copy(error))
                                 for token, _, _ in meet.came.values()]))
        return failed

"""Workers that come back: a server's side of a worker's restart (``launch.py --max-restarts``).

Pure, no I/O: the server calls these on its :class:`~kvstore.core.shard.ShardState` when the
scheduler says a worker is **away** (lost, and to be restarted: AWAY) and when the restarted worker,
a new *incarnation* of the same rank, **rejoins** (REJOIN, in two steps, docs/failures.md):

1. :meth:`Rejoins.away`: the worker stops counting, as if it had left (its rounds close without it,
   each sum scaled as a quorum of the rest: ``workers`` / contributions), but it is expected back.
2. :meth:`Rejoins.begin` (the restarted worker's first REJOIN): it counts again, from the first
   round of any key that no worker has opened yet on this server, which is returned.  Rounds open
   before do not wait for it; rounds from there on do, so none can close without it meanwhile.
3. :meth:`Rejoins.join_at` (its second REJOIN, with ``at``, the highest such round over every
   server): it counts from round ``at`` of every key held then.  Its pulls wait until the rounds
   before ``at`` are closed (they do not need it), so it reads the value every other worker reads
   before its push of round ``at``, and its first push of each key joins round ``at``.  A key stored
   later counts it from its own round 0, as every other worker.  A server restarted
   from its shard between the two steps never saw the first: it takes both at once, as long as it
   has opened no round ``at`` yet (else the worker fails, and is restarted again if restarts remain).
   A new member's join (elastic) that such a server never saw admitted finds its slot present there
   (in the map it restarted with), or away (its ALIGN said it was rejoining): a server that counts
   no incarnation of that slot takes the join as the slot's, scaling nothing for it, when it lost
   the first step, or gets the first step after its restart (``restarted``).

The server's row-sparse tables (:class:`RowRounds`, over :class:`kvstore.core.sparse_shard.RowTables`)
take each step of a restart too: their rounds close without an away worker, the first round a REJOIN
answers is the highest over the keys and the tables, and the worker counts from round ``at`` of every
table.  A new member's join (elastic) does not reach them (docs/elastic.md: tables are not elastic).

So a restarted worker's first step is the job's step ``at`` and uses the same weights as the
others' step ``at``: the rounds it missed closed without it, and none is applied twice.  This
assumes every key is pushed once per step, as a Trainer does (round numbers are per key).
In ``dist_async``, where nothing waits for anyone, the round :meth:`Rejoins.begin` answers is the
worker's own: the most pushes of one key its earlier incarnations had applied here (its steps).  It
stays the origin of the worker's push numbers (a restarted server screens retried pushes by them,
kvstore/server/restore.py), also for a new member that joins an elastic job (docs/elastic.md), whose
slot may have been held before: its pushes number on from the slot's count, so none is taken for a
retry of the previous member's.  What a worker learns as its step (:meth:`Rejoins.step`,
``kv.rejoined_at``) is the round in ``dist_sync`` and after a ``dist_async`` restart (its own steps);
a ``dist_async`` join learns the job's update count instead: the most pushes applied to one key,
every worker's together (:meth:`ShardState.updates`).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.core.replies import Completion
from kvstore.core.shard import ShardState
from kvstore.errors import ProtocolError


class RowRounds(Protocol):
    """A server's row-sparse tables as a rejoin sees them (the server's row-sparse part answers what
    each step releases itself: its requests are not the shard's)."""

    def mark_away(self, worker: int) -> None:
        """``worker`` is lost: the tables' rounds close without it (scaled), their answers sent."""

    def first_round(self, worker: int) -> int:
        """The first round no table has opened (dist_async: ``worker``'s most pushes of one table)."""

    def readmit(self, worker: int) -> int:
        """``worker`` counts again from :meth:`first_round`, which is returned."""

    def rejoin_at(self, worker: int, at: int) -> None:
        """``worker`` counts from round ``at`` of every table; what closes is answered."""


def _incarnation(value: object, what: str) -> int:
    """``value`` as an incarnation (an int >= 0); raises ProtocolError otherwise."""
    if type(value) is not int or value < 0:
        raise ProtocolError(f"{what} needs an incarnation (an int >= 0), not {str(value)[:40]!r}")
    return value


class Rejoins:
    """Which incarnation of each worker a server counts, over its ``shard`` (see the module docstring)."""

    def __init__(self, shard: ShardState, rows: RowRounds | None = None, restarted: bool = False) -> None:
        self.shard = shard
        self.rows = rows  # the server's row-sparse tables (None: none)
        self.restarted = restarted  # restarted from its shard: a join may find its slot taken here
        self.current: dict[int, int] = {}  # worker -> incarnation counted now (absent: 0)
        self.begun: dict[int, int] = {}  # worker -> the round begin() answered (until join_at)

    def away(self, worker: int, incarnation: object) -> list[Completion]:
        """Incarnation ``incarnation`` of ``worker`` is lost and will be restarted: rounds stop waiting
        for it (as :meth:`ShardState.leave`); return what closing them answers.  Nothing for an
        incarnation older than the one counted now (its successor is back already), or for a worker
        away already.  Raises ValueError for a worker that is not a rank, ProtocolError for a bad
        incarnation, changing nothing."""
        incarnation = _incarnation(incarnation, "AWAY")
        if incarnation < self.current.get(worker, 0) or worker in self.shard.away:
            return []
        done = self.shard.mark_away(worker, incarnation)  # raises first for a worker that is not a rank
        if self.rows is not None:
            self.rows.mark_away(worker)
        return done

    def begin(self, worker: int, incarnation: object, joining: bool = False) -> tuple[int, list[Completion]]:
        """A restarted ``worker`` (a new ``incarnation``) counts again from the first round no key has
        opened here; return that round and what making the old incarnation away answered.  With
        ``joining``, a new member takes the absent slot ``worker`` (elastic: no round is scaled for
        it), or, on a server ``restarted`` that counts no incarnation of it, the slot present or away
        in its map (the module docstring).  Raises, changing nothing: ProtocolError for an incarnation
        not above the one counted now, or a join of a slot that is not absent (but as said);
        ValueError for a worker that is not a rank."""
        return self._begin(worker, incarnation, joining, self.restarted)

    def _begin(self, worker: int, incarnation: object, joining: bool,
               restarted: bool) -> tuple[int, list[Completion]]:
        """:meth:`begin`; ``restarted``: this server may never have seen the join admitted."""
        incarnation = _incarnation(incarnation, "REJOIN")
        if incarnation <= self.current.get(worker, 0):
            raise ProtocolError(f"worker {worker} rejoins as incarnation {incarnation}, but incarnation "
                                f"{self.current.get(worker, 0)} is counted already")
        taken = worker in self.shard.active or worker in self.shard.away
        unseen = joining and taken and restarted and self.current.get(worker, 0) == 0
        if joining and taken and not unseen:
            raise ProtocolError(f"worker {worker} joins as incarnation {incarnation}, but its slot is "
                                "not absent")
        done = self.away(worker, incarnation - 1) if worker in self.shard.active and not unseen else []
        first = self.shard.readmit(worker, joining, unseen)
        if self.rows is not None and not joining:  # an elastic job's tables are not elastic
            first = max(first, self.rows.readmit(worker))
        self.current[worker] = incarnation
        self.begun[worker] = first
        return first, done

    def step(self, first: int, joining: bool = False) -> int:
        """The step a worker that :meth:`begin` answered ``first`` learns from this server (its
        ``kv.rejoined_at`` is the highest over the servers): ``first``, but for a new member of a
        ``dist_async`` job (``joining``) the job's update count here (:meth:`ShardState.updates`)."""
        return self.shard.updates() if joining and not self.shard.sync else first

    def join_at(self, worker: int, incarnation: object, at: object,
                joining: bool = False) -> list[Completion]:
        """``worker`` (after :meth:`begin` as ``incarnation``, or with no begin at all as a newer
        incarnation: see the module docstring) counts from round ``at`` of every key: rounds before it
        close without it; return what closing them answers.  Raises ProtocolError, changing nothing, for
        another incarnation or an ``at`` below the round :meth:`begin` gave (or would give now)."""
        incarnation = _incarnation(incarnation, "REJOIN")
        first = self.begun.get(worker)
        unbegun = first is None and incarnation > self.current.get(worker, 0)
        if unbegun:  # this server was restarted between the two steps: it lost the first, so it does both
            first = self.shard.first_round(worker)
            if self.rows is not None and not joining:
                first = max(first, self.rows.first_round(worker))
        elif first is None or self.current.get(worker, 0) != incarnation:
            raise ProtocolError(f"worker {worker} incarnation {incarnation} has not begun to rejoin")
        if type(at) is not int or at < first:
            raise ProtocolError(f"REJOIN of worker {worker} at round {str(at)[:20]!r}: must be an int "
                                f">= {first}, the round this server "
                                f"{'opens next' if unbegun else 'answered'}")
        done: list[Completion] = []
        if unbegun:  # a join it never saw admitted may find its slot present or away (restarted)
            done = self._begin(worker, incarnation, joining, restarted=True)[1]
        del self.begun[worker]
        done += self.shard.rejoin_at(worker, at)
        if self.rows is not None and not joining:
            self.rows.rejoin_at(worker, at)
        return done

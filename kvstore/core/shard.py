"""ShardState: the values one server holds, and the rules that change them.

Pure numpy, no I/O: the server loop decodes a request, calls one method here
and sends whatever :class:`Completion` objects come back.  Requests are
identified by an opaque ``token`` the caller chooses.

A push carries either the whole value of a key (the stored shape, whatever its
ndim) or a *chunk*: a 1-D array holding elements ``[lo, lo + n)`` of the key's
flat value, which must then be 1-D.  One *contribution* of a worker is its
chunks in increasing order covering ``[0, size)`` exactly; a whole push is a
contribution of one chunk.  A worker's chunks of a key must arrive in that
order, each starting where its previous one ended.

Rules (docs/architecture.md, SEMANTICS.md):

* ``dist_sync``: a key's contributions are grouped in rounds, one contribution
  per worker per round.  A round closes when the contribution of **every**
  worker still in the cluster is complete; a worker's next contribution belongs
  to the next round (a worker may run rounds ahead; its chunks wait there).  A
  worker that has left (:meth:`ShardState.leave`) no longer counts, so the
  others' last rounds close without it (uneven ends).  The round's sum is then
  applied (assigned, or handed to the updater), and the replies to its pushes
  (every chunk of the round) are sent only then.
* With ``ordered=False`` (the server's default, ``KVSTORE_SUM_ORDER=arrival``)
  each chunk is added into the round's accumulator the moment it arrives, as
  MXNet does: nothing is held, but float sums of three or more workers may
  differ in the last bits from run to run.  With ``ordered=True``
  (``KVSTORE_SUM_ORDER=rank``) the sum is taken in worker-rank order, holding
  early chunks, so it is bit-identical whatever the arrival order.  Either way a
  round keeps one accumulator, not every pushed array, and every worker must
  split a key at the same offsets within a round (:mod:`kvstore.core.rounds`).
* Worker sets (docs/worker-sets.md): a key may belong to a set of workers (``members``, given at
  init).  Its rounds expect (active workers) ∩ (members): the same round code, only the expected
  ranks narrowed; a non-member's push or pull raises :class:`~kvstore.errors.NotAMemberError`,
  changing nothing.  Its members' init meets in :class:`~kvstore.core.worker_sets.InitRendezvous`
  (:meth:`ShardState.meet`).  A key without a set pays one ``None`` check.
* ``dist_async``: each contribution is applied (assigned, or updated) once it
  is complete: a whole push on arrival, chunks once the last one arrives (they
  are gathered in a buffer until then); every chunk of it is acked then.
* A pull is answered once every contribution its worker started earlier for
  that key has been applied (read-your-writes); a pushpull is a push plus such
  a pull of the range it pushed.
* A first value (INIT) or optimizer state (STATE_SET) sent in chunks (in order, by
  one worker) is gathered aside and takes effect only with its last chunk.
* With a ``window`` (the cluster's ``KVSTORE_PUSH_WINDOW``), a worker's new contribution to a key
  is refused while ``window`` earlier ones of it are not yet applied: the worker waits for acks
  before pushing more, so a server holds at most ``window`` open rounds (or assemblies) per key
  whatever the skew, and one that does not wait is refused, never buffered.
* With a ``quorum`` (``KVSTORE_SYNC_QUORUM``, dist_sync), a round also closes once ``quorum``
  contributions are complete, and each part of its sum is scaled by workers / contributions.  A push
  carries its worker's round for the key (``rounds``); one for a round already closed is *late*:
  dropped, acked, counted (:attr:`ShardState.late`, ``on_late``), never applied; a later pull of
  its worker does not wait for it, and its next push joins the oldest open round (resynced).
  See :mod:`kvstore.core.staleness` for ``staleness`` (dist_async).
* A bad request raises before anything changes.
* An aborted round (:meth:`ShardState.abort`, dist_sync): a worker's pushpull of a key was refused
  (a value of another shape or dtype), so the round it would have joined, and every later open one,
  is dropped: every push and pushpull waiting on them is answered with one
  :class:`~kvstore.errors.CollectiveMismatchError` naming the key, the worker and why (a pull
  waiting for such a void push is answered with the value as before it, as after a refused push:
  its client raises the push's error); the key's value and rounds are as before that round.  Each
  worker the round waited for that had not sent all of its contribution *owes* the rest: its chunks
  of that round that arrive later are refused with the same error, changing nothing, so its call
  fails too instead of waiting for a round that will never close.  Then every worker's next push
  of the key joins that round afresh.  Under a quorum the abort names the round (the round the
  refused push would have carried): one already closed without that worker is left alone, the
  refusal counted as its late push (its next push, not counted by its client, joins the oldest open
  round).

Arrays handed out by :meth:`ShardState.pull` are never written to afterwards:
every update stores a new array, so a reply may be sent without copying.
"""

from __future__ import annotations

import copy
import operator
import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.core.partition import Key
from kvstore.core.replies import _SILENT, Completion, _acks, _Assembly, _part_of
from kvstore.core.rounds import Round
from kvstore.core.staging import Staged, stage
from kvstore.core.staleness import StalenessGate
from kvstore.core.worker_sets import InitRendezvous
from kvstore.errors import (
    CollectiveMismatchError,
    ConfigError,
    DTypeMismatchError,
    DuplicateInitError,
    KeyNotInitializedError,
    NotAMemberError,
    ProtocolError,
    ShapeMismatchError,
)

Updater = Callable[[Key, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class _KeyState:
    value: np.ndarray
    submitted: dict[int, int] = field(default_factory=dict)   # worker -> contributions started
    applied: dict[int, int] = field(default_factory=dict)     # worker -> contributions applied
    numbered: dict[int, int] = field(default_factory=dict)  # async: worker -> its highest push number
    # applied + 1 (what a shard records: after a lossy restart ``applied`` falls behind the numbering)
    rounds: deque[Round] = field(default_factory=deque)       # open sync rounds, oldest first
    base: int = 0                                             # number of rounds[0] (rounds closed)
    next_round: dict[int, int] = field(default_factory=dict)  # worker -> round its next chunk joins
    assembling: dict[int, _Assembly] = field(default_factory=dict)  # async: worker -> partial one
    offset: dict[int, int] = field(default_factory=dict)  # quorum: worker -> rounds it was resynced by
    waiting_pulls: list[tuple[Any, int, int, int, int]] = field(default_factory=list)
    # ^ token, worker, target (contributions that must be applied first), lo, hi
    debts: dict[int, deque[_Debt]] = field(default_factory=dict)  # worker -> its owed aborted rounds
    promised: int = 0  # a restarted server: rounds the workers' retries will have opened (promise)
    members: frozenset[int] | None = None  # the key's worker set (None: every worker)
    joined: dict[int, int] = field(default_factory=dict)  # a rejoin in progress: worker -> its first
    # round of this key (rounds below it do not wait for it); gone once the key's rounds reach it

    def numbering(self) -> dict[int, int]:
        """Each worker's pushes as a shard records them: contributions applied, or (dist_async) its
        highest push number applied + 1 when that is more (a restart lost some; retries screen by it)."""
        counts = dict(self.applied)
        for worker, top in self.numbered.items():
            counts[worker] = max(counts.get(worker, 0), top)
        return counts


@dataclass
class _Debt:
    """What a worker still owes an aborted round: its chunks from ``covered`` on are refused."""

    round: int      # the aborted round's number (its push of that round is refused)
    covered: int    # elements of that contribution received so far: its next chunk starts here
    error: CollectiveMismatchError


class ShardState:
    """The keys (or key slices) held by one server, and their open rounds."""

    def __init__(self, num_workers: int, sync: bool, updater: Updater | None = None,
                 ordered: bool = True, window: int = 0,
                 clock: Callable[[], float] = time.monotonic, quorum: int | None = None,
                 staleness: int | None = None, present: Iterable[int] | None = None) -> None:
        self.num_workers = num_workers
        self.quorum = quorum if sync and quorum is not None and quorum < num_workers else None
        self.gate = StalenessGate(staleness, window) if not sync and staleness is not None else None
        self.late: dict[int, int] = {}  # worker -> late pushes dropped (quorum)
        self.on_late: Callable[[Key, int, int], None] | None = None  # (key, worker, its round)
        self.window = window  # unapplied contributions per worker and key (0: no limit)
        self.clock = clock    # stamps a round's opening (its wait is reported when it closes)
        self.on_close: Callable[[Key, float, int], None] | None = None  # (key, waited s, last worker)
        # workers that have not left; an elastic job's slots start absent beyond ``present``
        self.active = set(range(num_workers)) if present is None else set(present)
        self._check_present()
        self.away: dict[int, int] = {}  # lost workers to be restarted -> incarnation (core/rejoin.py)
        self.joins: dict[int, int] = {}  # rejoined worker -> its first round (of the keys held then)
        self.newcomers: set[int] = set()  # joined an absent slot (elastic): never a reason to scale
        self._lagging: dict[int, int] = {}  # worker in joins -> keys holding its first round (joined)
        self.retirable: set[int] = set()  # workers of joins every key may have reached: see retire_joins
        self._ranks = sorted(self.active)       # the same, sorted: what a new round expects
        self.sync = sync
        self.updater = updater
        self.ordered = ordered  # sum in rank order (holding early chunks), or in arrival order
        self._keys: dict[Key, _KeyState] = {}
        self._staged_inits: dict[Key, Staged] = {}   # chunked INITs of keys not stored yet
        self._staged_states: dict[Key, Staged] = {}  # chunked STATE_SETs not installed yet
        self.rendezvous = InitRendezvous(clock)  # worker-set keys whose members' init has not met yet

    def __contains__(self, key: Key) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def nbytes(self) -> int:
        """Bytes of the values held (not counting rounds in progress: see :meth:`held_bytes`)."""
        return sum(state.value.nbytes for state in self._keys.values())

    def held_bytes(self) -> int:
        """Bytes held for updates not applied yet: the accumulators of open sync rounds (a pushed
        array when that is the accumulator), chunks held for lower ranks, and async assembly buffers."""
        total = 0
        for state in self._keys.values():
            total += sum(rnd.held_bytes() for rnd in state.rounds)
            total += sum(asm.buf.nbytes for asm in state.assembling.values())
        for table in (self._staged_inits, self._staged_states):
            total += sum(buf.nbytes for staged in table.values() for buf in staged.bufs)
        return total

    def open_rounds(self) -> int:
        """The number of dist_sync rounds open over every key."""
        return sum(len(state.rounds) for state in self._keys.values())

    def stalled(self, older_than: float) -> list[tuple[Key, float, list[int]]]:
        """``(key, seconds open, workers it waits for)`` of each key whose oldest round has been open
        longer than ``older_than`` seconds."""
        now, found = self.clock(), []
        for key, state in self._keys.items():
            if state.rounds and now - state.rounds[0].opened > older_than:
                rnd = state.rounds[0]
                waits = self.active if state.members is None else self.active & state.members
                found.append((key, now - rnd.opened, sorted(waits - rnd.complete)))
        return found

    def drop_waiting_pulls(self, key: Key) -> list[Any]:
        """Forget the pulls of ``key`` waiting for a round (a stall aborts them); return their tokens."""
        state = self._get(key)
        tokens, state.waiting_pulls = [entry[0] for entry in state.waiting_pulls], []
        return tokens

    def value(self, key: Key) -> np.ndarray:
        """Return the stored value of ``key``; raise :class:`KeyNotInitializedError` if absent."""
        return self._get(key).value

    def init(self, key: Key, value: np.ndarray, members: Iterable[int] | None = None) -> None:
        """Store the first value of ``key``, of the worker set ``members`` (None: every worker); raise
        :class:`DuplicateInitError` if it exists, :class:`ConfigError` for a set this store cannot have
        (:meth:`check_members`)."""
        if key in self._keys:
            raise DuplicateInitError(f"key {key!r} is already initialised on this server")
        found = self.check_members(key, members)
        self._keys[key] = _KeyState(value=np.array(value, copy=True), members=found)
        self._staged_inits.pop(key, None)
        if found is not None:
            self.rendezvous.expect(key, found)

    def meet(self, token: Any, worker: int, key: Key, members: Iterable[int],
             digest: str) -> list[Completion]:
        """``worker`` called the init of ``key``, a key of the worker set ``members``, with arguments
        whose digest is ``digest`` (:mod:`kvstore.core.agreement`); answer every member's ``token``
        once the key is stored (from the lowest member's INIT) and every member present has met: with
        an ack, or, when their digests or sets differ, with one :class:`CollectiveMismatchError` (the
        key is then dropped: the init did not happen).  Returns what this answers.  Raises, changing
        nothing: ``ValueError`` for a worker that is not a rank or a bad set (as :meth:`init`),
        :class:`NotAMemberError` for a worker outside ``members``, :class:`DuplicateInitError` for a
        key stored and met already, :class:`ConfigError` as :meth:`check_members`."""
        self._check_worker(worker)
        found = self.check_members(key, members)
        if found is None:
            raise ProtocolError(f"an init rendezvous of key {key!r} names no worker set")
        if worker not in found:
            raise self._not_member(key, found, worker, "init")
        self.rendezvous.arrive(token, worker, key, found, digest, key in self._keys)
        return self.met(key)

    def met(self, key: Key) -> list[Completion]:
        """What storing ``key`` (an INIT of a worker-set key, after :meth:`init` or the last chunk of
        :meth:`init_chunk`) answers of its init rendezvous (:meth:`meet`); a failed one drops the key."""
        state = self._keys.get(key)
        done, failed = self.rendezvous.complete(key, None if state is None else state.members, self.active)
        if failed:
            del self._keys[key]  # not initialised: every member's init raises
        return done

    def expire_meets(self, older_than: float) -> list[Completion]:
        """Fail the init rendezvous open for more than ``older_than`` seconds (``DeadlineExceededError``
        naming the missing members, to every member that came); their keys are dropped."""
        if not self.rendezvous:
            return []
        done: list[Completion] = []
        for key, failed in self.rendezvous.expired(older_than, self.active, self._keys.__contains__):
            self._keys.pop(key, None)
            done += failed
        return done

    def members_of(self, key: Key) -> tuple[int, ...] | None:
        """``key``'s worker set, sorted (None: every worker).  Raises :class:`KeyNotInitializedError`."""
        found = self._get(key).members
        return None if found is None else tuple(sorted(found))

    def check_members(self, key: Key, members: Iterable[int] | None) -> frozenset[int] | None:
        """``members`` as a key's worker set (None: every worker).  Raises ``ValueError`` for a rank
        outside the job or an empty set, :class:`ConfigError` under a quorum or a staleness bound (their
        rounds count every worker: docs/worker-sets.md)."""
        if members is None:
            return None
        found = frozenset(members)
        if not found or not all(type(w) is int and 0 <= w < self.num_workers for w in found):
            raise ValueError(f"key {key!r}: worker set {sorted(found)!r} is not a non-empty set of ranks "
                             f"in [0, {self.num_workers})")
        if self.quorum is not None or self.gate is not None:
            knob = "KVSTORE_SYNC_QUORUM" if self.quorum is not None else "a staleness bound (dist_async)"
            raise ConfigError(f"key {key!r}: worker sets are refused under {knob}, whose rounds count "
                              "every worker of the job; init the key without workers=, or run without it")
        return found

    def init_chunk(self, worker: int, key: Key, value: np.ndarray, lo: int, total: int,
                   members: Iterable[int] | None = None) -> bool:
        """Take elements ``[lo, lo + value.size)`` of ``key``'s first value (1-D, ``total`` elements)
        from ``worker``; store it once its chunks cover it, in order, and return whether it is stored
        (until then the key is not initialised).  A chunk at offset 0 starts afresh (a retried init).
        Raises, changing nothing: :class:`DuplicateInitError` for a stored key; ``ValueError`` for a
        worker that is not a rank; :class:`ProtocolError` for a chunk that is empty, not 1-D, outside
        ``[0, total)``, or does not continue the value gathered so far (offset, total, dtype, worker,
        ``members``: the key's worker set); ``TypeError`` if ``lo`` is not an int; as :meth:`init` for
        ``members``."""
        self._check_worker(worker)
        if key in self._keys:
            raise DuplicateInitError(f"key {key!r} is already initialised on this server")
        found = self.check_members(key, members)
        if found is not None and worker not in found:
            raise self._not_member(key, found, worker, "init")
        bufs = stage(self._staged_inits, "INIT", worker, key, [value], lo, total,
                     None if found is None else sorted(found))
        if bufs is None:
            return False
        self._keys[key] = _KeyState(value=bufs[0], members=found)  # ours: no copy
        if found is not None:
            self.rendezvous.expect(key, found)
        return True

    def state_chunk(self, worker: int, key: Key, arrays: list[np.ndarray], lo: int,
                    info: Any) -> list[np.ndarray] | None:
        """Take elements ``[lo, lo + n)`` of each of ``key``'s optimizer state arrays (one 1-D array
        of ``n`` elements per state, of the key's slice here) from ``worker``; return the whole arrays
        once the chunks cover them, in order (the caller installs them), else None.  ``info`` (count,
        names) must be the same in every chunk; a chunk at offset 0 starts afresh.  Raises, changing
        nothing: :class:`KeyNotInitializedError` for an unknown key, else as :meth:`init_chunk`."""
        self._check_worker(worker)
        total = self._get(key).value.size
        return stage(self._staged_states, "STATE_SET", worker, key, arrays, lo, total, info)

    def drop_staged_states(self) -> None:
        """Forget every optimizer state still being gathered (a new optimizer drops all state)."""
        self._staged_states.clear()

    def push(self, token: Any, worker: int, key: Key, value: np.ndarray, lo: int = 0) -> list[Completion]:
        """Contribute ``value`` from ``worker``; return the requests this answers (maybe none yet).

        ``value`` is the whole value (``lo`` 0, the stored shape) or a 1-D chunk holding elements
        ``[lo, lo + value.size)`` of the key's 1-D value.  Its ack comes once its contribution is
        applied: when its round closes (dist_sync), when its last chunk arrives (dist_async).
        ``value`` is never written to and may be kept (until its round closes, or as the stored
        value).  Raises, changing nothing:
        :class:`KeyNotInitializedError` for an unknown key; :class:`ShapeMismatchError` if ``value``
        is neither the whole value nor a 1-D chunk inside ``[0, size)`` of a 1-D value;
        :class:`DTypeMismatchError` for another dtype; ``ValueError`` if ``worker`` is not a rank or
        has left; :class:`ProtocolError` if the chunk is empty, does not start where the worker's
        previous chunk of this contribution ended (0 for a new one), or (dist_sync) overlaps a chunk
        of its round that has other bounds, or starts a contribution while ``window`` earlier
        ones of ``worker`` to ``key`` are not applied; ``TypeError`` if ``lo`` is not an int.
        """
        return self.push_many(worker, [(token, key, value, lo)])

    def push_many(self, worker: int, entries: list[tuple[Any, Key, np.ndarray, int]],
                  pull: bool = False, rounds: list[int] | None = None) -> list[Completion]:
        """Push every ``(token, key, value, lo)`` of ``entries`` (distinct keys) from ``worker``, as
        :meth:`push` does (as :meth:`pushpull` with ``pull``); return the requests this answers.
        ``rounds`` (a quorum's pushes carry them) is the worker's round of each entry's key.

        All entries are checked first: any error is raised (as :meth:`push` raises it) before any
        entry changes anything.  A round beyond the next one (after a refused push) is taken as the next.
        An entry that ``worker`` owes an aborted round (:meth:`abort`) is refused with that round's
        :class:`CollectiveMismatchError`, the whole message with it: only the debt is paid.
        """
        self._check_active(worker)
        checked = [self._checked_push(key, worker, value, lo, None if rounds is None else rounds[i])
                   for i, (_, key, value, lo) in enumerate(entries)]
        owed = [(state, hi) for state, _, hi, number in checked if number is None]
        if owed:
            raise self._pay(worker, owed)
        done: list[Completion] = []
        for i, ((token, key, value, _), (state, lo, hi, number)) in enumerate(zip(entries, checked)):
            if number < 0:  # late: its round closed by quorum
                done += self._late(state, key, token, worker, (lo, hi), -1 - number, pull)
            elif pull:
                done += self._accept(state, key, _SILENT, worker, value, lo, hi, number,
                                     None if rounds is None else rounds[i])
                reply = self._add_pull(state, token, worker, lo, hi)
                done += reply if self.gate is None else self.gate.attach(key, worker, reply)
            else:
                done += self._accept(state, key, token, worker, value, lo, hi, number,
                                     None if rounds is None else rounds[i])
        return done

    def _late(self, state: _KeyState, key: Key, token: Any, worker: int, span: tuple[int, int],
              number: int, pull: bool) -> list[Completion]:
        """Drop a late push (its round ``number`` closed): ack it (a pushpull gets the current value),
        count it once per contribution (at its last chunk) and report it to ``on_late``.  The worker's
        next push joins the oldest open round (it will have pulled the value this one missed)."""
        lo, hi = span
        state.offset[worker] = state.offset.get(worker, 0) + state.base - number - 1
        if hi == state.value.size:
            self._count_late(key, worker, number)
        return self._add_pull(state, token, worker, lo, hi) if pull else [Completion(token)]

    def _count_late(self, key: Key, worker: int, number: int) -> None:
        """Count ``worker``'s late contribution to round ``number`` of ``key`` and report it."""
        self.late[worker] = self.late.get(worker, 0) + 1
        if self.on_late is not None:
            self.on_late(key, worker, number)

    def pull_many(self, worker: int, entries: list[tuple[Any, Key, int, int | None]],
                  whole: bool = False) -> list[Completion]:
        """:meth:`pull` of every ``(token, key, lo, hi)`` of ``entries``; all are checked (raising as
        :meth:`pull` does) before any is registered.  With ``whole``, each range must be the key's
        whole value (:class:`ShapeMismatchError` otherwise)."""
        self._check_worker(worker)
        checked = []
        for _, key, lo, hi in entries:
            state = self._get(key)
            if state.members is not None and worker not in state.members:
                raise self._not_member(key, state.members, worker, "pull")
            stored = state.value
            if whole and (lo != 0 or hi != stored.size):
                raise ShapeMismatchError(f"pull of key {key!r} asks for {hi - lo} elements; this server "
                                         f"holds {stored.size}")
            checked.append((state, *self._checked_range(key, stored, lo, hi)))
        done: list[Completion] = []
        for (token, *_), (state, lo, hi) in zip(entries, checked):
            done += self._add_pull(state, token, worker, lo, hi)
        return done

    def pull(self, token: Any, worker: int, key: Key, lo: int = 0, hi: int | None = None) -> list[Completion]:
        """Ask for elements ``[lo, hi)`` of ``key``'s value (all of it by default, in its shape).

        Answered now, or once every contribution ``worker`` started earlier for ``key`` is applied
        (a rejoined worker: once the rounds before its own are), with the stored value or a view of
        it, never written to afterwards.  Raises, changing nothing: :class:`KeyNotInitializedError`
        for an unknown key; ``ValueError`` if ``worker`` is not a rank; :class:`ShapeMismatchError` if
        ``[lo, hi)`` is not inside ``[0, size)`` or a part of a value that is not 1-D; ``TypeError``."""
        return self.pull_many(worker, [(token, key, lo, hi)])

    def pushpull(self, token: Any, worker: int, key: Key, value: np.ndarray,
                 lo: int = 0) -> list[Completion]:
        """Push ``value`` (as :meth:`push`, raising the same) and answer ``token``, once that
        contribution (and every earlier one of ``worker``) is applied, with elements
        ``[lo, lo + value.size)`` of the new value (all of it, in its shape, for a whole push);
        that reply is the push's only ack."""
        return self.push_many(worker, [(token, key, value, lo)], pull=True)

    def leave(self, worker: int) -> list[Completion]:
        """``worker`` left: rounds stop waiting for it; return the requests that closing them answers.

        Its chunks already received for a sync round (this one or a later one) still count, but are
        not acknowledged (nobody waits for them); from a contribution it left unfinished only the
        chunks it sent count, and rounds no longer wait for the rest (elements that no contribution
        of a round covers sum to 0).  In dist_async, a contribution it left unfinished is dropped.
        Its waiting pulls, and a first value or state it was sending in chunks, are dropped.  Raises
        ``ValueError`` if ``worker`` is not a rank; leaving twice changes nothing.
        """
        self._check_worker(worker)
        if worker not in self.active:
            return []
        self.active.discard(worker)
        self._ranks = sorted(self.active)
        for table in (self._staged_inits, self._staged_states):  # nobody will finish them
            for key in [k for k, staged in table.items() if staged.worker == worker]:
                del table[key]
        done: list[Completion] = []
        for key, state in self._keys.items():
            state.waiting_pulls = [p for p in state.waiting_pulls if p[1] != worker]
            state.debts.pop(worker, None)  # it will push no more
            if state.assembling.pop(worker, None) is not None:
                state.submitted[worker] -= 1  # never to be applied: its later pulls need not wait
            members = self.active if state.members is None else self.active & state.members
            for rnd in state.rounds:
                rnd.leave(worker, members, state.value.size)
            done += self._close_rounds(state, key)
            if self.gate is not None:  # it no longer counts as the slowest
                done += self.gate.release(key, state.applied, self.active)
        for key in self.rendezvous.pending():  # a member that left is not waited for at init
            done += self.met(key)
        return done

    # -- aborted rounds: a pushpull refused for its values fails every worker's call -----------

    def abort(self, worker: int, keys: Iterable[Key], reason: str,
              rounds: list[int] | None = None) -> list[Completion]:
        """``worker``'s pushpull of ``keys`` was refused (``reason``: a value of another shape or
        dtype, in words): in dist_sync, drop the round of each key held here that it would have
        joined and every later open one; return the error completions of the pushes and pushpulls
        waiting on them, and the pulls this releases (see the module docstring: the workers that had
        not sent that round owe it; one that owed it already pays its debt, aborting nothing more).
        ``rounds`` (one per key, as a quorum's push carries them) names that round: under a quorum, a
        round already closed without the worker is left alone, the refusal counted as its late push.
        Keys not held here, and keys of a worker set ``worker`` is not in, are skipped; nothing happens
        in dist_async.  Raises ``ValueError`` for a worker that is not a rank, or for ``rounds`` of
        another length than ``keys``."""
        self._check_worker(worker)
        keys = list(keys)
        sent: list[int | None] = [None] * len(keys) if rounds is None else list(rounds)
        if len(sent) != len(keys):
            raise ValueError(f"{len(sent)} rounds for {len(keys)} keys")
        held = [(key, r) for key, r in zip(keys, sent) if key in self._keys  # a non-member's refused
                and (self._keys[key].members is None or worker in self._keys[key].members)]  # one: none
        if not self.sync or not held:
            return []
        keys = [key for key, _ in held]
        shown = f"{keys[0]!r}" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
        error = CollectiveMismatchError(
            f"worker {worker}'s pushpull was refused ({reason}), so this round of key(s) {shown} was "
            "aborted on every worker: nothing was applied, the keys are as before it; call pushpull "
            "again with matching values on every worker", [worker])
        done: list[Completion] = []
        for key, r in held:
            done += self._abort_key(self._get(key), key, worker, r, error)
        return done

    def _abort_key(self, state: _KeyState, key: Key, worker: int, sent: int | None,
                   error: CollectiveMismatchError) -> list[Completion]:
        """:meth:`abort` of one key's rounds from the one ``worker`` would have joined (``sent``: the
        round it names, as its push would) on; a round closed by quorum is left alone (late)."""
        number = self._round_of(state, worker, sent)
        if number < state.base:  # closed without it (quorum): the refusal is its late push, which its
            state.offset[worker] = state.offset.get(worker, 0) + state.base - number  # client never counted
            self._count_late(key, worker, number)
            return []
        number = min(number, state.base + len(state.rounds))
        owed = state.debts.get(worker)
        if owed and owed[0].round == number and owed[0].covered == 0:
            self._pay(worker, [(state, state.value.size)])  # that round is aborted already
            return []
        size, first = state.value.size, number - state.base
        aborted = [state.rounds.pop() for _ in range(len(state.rounds) - first)][::-1]
        tail: dict[int, int] = dict.fromkeys(self._at(number, state) - {worker}, 0)  # -> covered
        silent: set[int] = set()  # workers with a pushpull in the aborted rounds (its pull answers it)
        done: list[Completion] = []
        for rnd in aborted:
            for w, tokens in rnd.tokens.items():
                done.extend(Completion(t, error=error) for t in tokens if t is not _SILENT)
                if _SILENT in tokens:
                    silent.add(w)
            for w, covered in rnd.covered.items():
                left = state.submitted.get(w, 0) - 1  # counted at its first chunk
                if left or w in state.applied:
                    state.submitted[w] = left
                else:
                    state.submitted.pop(w, None)  # as if never pushed (a key group compares these)
                tail[w] = covered  # its last contribution to the aborted rounds
        for w, covered in tail.items():
            if covered < size and w in self.active:
                state.debts.setdefault(w, deque()).append(_Debt(number, covered, copy.copy(error)))
        for w, upcoming in state.next_round.items():
            state.next_round[w] = min(upcoming, number)
        waiting = []
        for token, w, target, lo, hi in state.waiting_pulls:  # those waiting for an aborted contribution:
            if target <= state.submitted.get(w, 0):
                waiting.append((token, w, target, lo, hi))
            elif w in silent:  # a pushpull's pull: the error is its only answer
                done.append(Completion(token, error=error))
            else:  # a pull after a void push: answered as after a refused push (the client raises that)
                waiting.append((token, w, state.submitted.get(w, 0), lo, hi))
        state.waiting_pulls = waiting
        return done + self._release_pulls(state)

    def _pay(self, worker: int, owed: list[tuple[_KeyState, int]]) -> CollectiveMismatchError:
        """``worker`` sent elements up to ``hi`` of what it owes each ``(state, hi)``'s aborted round:
        record that (a debt paid in full is dropped); return the error to refuse them with."""
        error = owed[0][0].debts[worker][0].error
        for state, hi in owed:
            debts = state.debts[worker]
            debts[0].covered = hi
            if hi >= state.value.size:
                debts.popleft()
                if not debts:
                    del state.debts[worker]
        return copy.copy(error)

    # -- restarts: what a shard image records, and workers that come back --------------------

    def settle(self) -> None:
        """Make each key's own state current: nothing to do here (a GroupedShardState dissolves its
        key groups)."""

    def progress(self) -> int:
        """The furthest key's progress: rounds closed (dist_sync), or one worker's most contributions
        applied (dist_async); what a shard image taken now records as its step."""
        keys = self._keys.values()
        if self.sync:
            return max((k.base for k in keys), default=0)
        return max((max(k.applied.values(), default=0) for k in keys), default=0)

    def applied_state(self) -> list[tuple[Key, np.ndarray, int, dict[int, int]]]:
        """``(key, value, rounds closed, {worker: contributions applied})`` of every key as of now (a
        copy of the counts; the values are never written to): open rounds and partial contributions
        are not in it (:mod:`kvstore.core.shard_image`)."""
        self.settle()
        return [(key, s.value, s.base, s.numbering()) for key, s in self._keys.items()]

    def restore(self, key: Key, value: np.ndarray, rounds: int, applied: dict[int, int],
                members: Iterable[int] | None = None) -> None:
        """Store ``key`` as a shard image recorded it: a copy of ``value``, ``rounds`` closed, each
        worker's contributions ``applied`` (none pending) and its worker set ``members``.  Raises
        :class:`DuplicateInitError` if it is stored already, as :meth:`init` for ``members``."""
        self.init(key, value, members)
        self.rendezvous.forget(key)  # its members met before the image was taken
        state = self._keys[key]
        state.base = rounds
        self.retirable.update(self.joins)  # a round count that jumped: retire_joins looks again
        state.applied, state.submitted, state.numbered = dict(applied), dict(applied), dict(applied)

    def realign(self, key: Key, origins: dict[int, int], floor: int | None = None) -> None:
        """A restored ``key`` once the workers have aligned (:mod:`kvstore.server.restore`): worker
        ``w``'s quorum rounds count from ``origins[w]``, and with ``floor`` (dist_sync) the key goes
        on from round ``floor`` for every active worker.  Raises :class:`KeyNotInitializedError`."""
        state = self._get(key)
        state.offset.update(origins)
        if floor is not None:
            state.base = floor
            state.next_round = dict.fromkeys(self.active, floor)
            self.retirable.update(self.joins)  # a round count that jumped: retire_joins looks again

    def promise(self, key: Key, rounds: int) -> None:
        """A restored ``key`` (dist_sync): the workers' retried pushes will have opened its rounds up to
        ``rounds`` (each worker's next round after its retries, from its ALIGN).  A push numbered up
        to there joins its own round even before the retries of the rounds below it have come (a
        rejoined worker's first push, at its job step), the rounds between opened empty meanwhile.
        Raises :class:`KeyNotInitializedError`."""
        self._get(key).promised = rounds

    def mark_away(self, worker: int, incarnation: int) -> list[Completion]:
        """Incarnation ``incarnation`` of ``worker`` is lost and will be restarted: rounds close without
        it, each sum scaled as a quorum of the rest (as :meth:`leave`, :mod:`kvstore.core.rejoin`);
        return what closing them answers.  Raises ``ValueError`` for a worker that is not a rank."""
        self._check_worker(worker)
        self.away[worker] = incarnation  # first: the rounds leave() closes are scaled
        if self.joins.pop(worker, None) is not None:
            for state in self._keys.values():
                state.joined.pop(worker, None)
        self._lagging.pop(worker, None)
        self.retirable.discard(worker)
        self.newcomers.discard(worker)  # its restart rejoins as a restart
        return self.leave(worker)

    def readmit(self, worker: int, joining: bool = False, unseen: bool = False) -> int:
        """A restarted ``worker`` counts again, from the first round no key has opened yet (dist_sync:
        rounds open before do not wait for it, its pulls wait for them, each key held now keeping
        that origin until its rounds reach it); return that round, or in dist_async the most
        contributions of one key its earlier incarnations had applied.  Its lost incarnation's
        contributions in open rounds are applied when they close.  With ``joining``, a new member
        takes an absent slot (elastic, docs/elastic.md): the same, but no round is scaled for it, and
        under a staleness bound it starts level with the slowest present worker of each key
        (:meth:`StalenessGate.join`); with ``unseen`` too, the slot may be present or away here (a
        server restarted after the join was admitted: its map has the slot, which it never counted).
        Raises ``ValueError`` for a worker that is not a rank, or, joining, is not absent (but
        ``unseen``)."""
        self._check_worker(worker)
        if joining and not unseen and (worker in self.active or worker in self.away):
            raise ValueError(f"worker {worker} is present (or away); a new member joins an absent slot")
        self.settle()
        if joining:
            self.newcomers.add(worker)
            if self.gate is not None:
                for key, state in self._keys.items():
                    self.gate.join(key, worker, state.applied, self.active)
        else:
            self.newcomers.discard(worker)
        first = self.first_round(worker)
        self.away.pop(worker, None)
        self.active.add(worker)
        self._ranks = sorted(self.active)
        for state in self._keys.values():
            pending = sum(1 for rnd in state.rounds if worker in rnd.covered)
            state.submitted[worker] = state.applied.get(worker, 0) + pending
            state.next_round.pop(worker, None)
        if self.sync:
            self._join_keys(worker, first)
        return first

    def retire_joins(self, begun: Container[int] = ()) -> list[int]:
        """Forget each rejoined or joined worker that no key holds a first round for any more (each
        key held at its rejoin has reached it: every round below it closed), but those in ``begun``
        (their rejoin's second step is still to come): its entry in ``joins`` then changes nothing,
        since every open and later round counts it, so the plain round rules and the key groups serve
        again; return the workers forgotten.  O(keys): the server calls it between messages once
        :attr:`retirable` names a worker (each key's entries are dropped as its rounds reach them, so
        no call is needed before; a key never pushed again keeps its entry, and the worker)."""
        self.retirable.clear()
        if not self.joins:
            return []
        lagging: dict[int, int] = {}
        for state in self._keys.values():  # after a jump of the counts (a restore): followed again
            if state.joined:
                self._passed(state, recount=False)
                for worker in state.joined:
                    lagging[worker] = lagging.get(worker, 0) + 1
        self._lagging = lagging
        gone = [worker for worker in self.joins if worker not in lagging and worker not in begun]
        for worker in gone:
            del self.joins[worker]
            self.newcomers.discard(worker)  # counted in every round from here: no longer late anywhere
            if self.quorum is None:  # its quorum numbering's origin (rejoin_at) is read under a quorum only
                for state in self._keys.values():
                    state.offset.pop(worker, None)
        return gone

    def _join_keys(self, worker: int, at: int) -> None:
        """``worker`` counts from round ``at`` of each key held now whose worker set it is in: such a
        key below ``at`` keeps ``at`` as its first round (``joined``) until its rounds reach it; a key
        stored later counts it from round 0.  Counts the keys that hold it (none left makes it
        :attr:`retirable`).  O(keys), at a rejoin's steps only."""
        self.joins[worker] = at
        lagging = 0
        for state in self._keys.values():
            if state.base < at and (state.members is None or worker in state.members):
                state.joined[worker] = at
                lagging += 1
            else:
                state.joined.pop(worker, None)
        if lagging:
            self._lagging[worker] = lagging
            self.retirable.discard(worker)
        else:
            self._lagging.pop(worker, None)
            self.retirable.add(worker)

    def _passed(self, state: _KeyState, recount: bool = True) -> None:
        """Drop the first rounds of ``state`` (a key's) that its rounds have reached; with ``recount``,
        a worker no key holds one for any more becomes :attr:`retirable`."""
        base = state.base
        for worker in [w for w, at in state.joined.items() if at <= base]:
            del state.joined[worker]
            if not recount:
                continue
            left = self._lagging.get(worker, 0) - 1
            if left > 0:
                self._lagging[worker] = left
            else:
                self._lagging.pop(worker, None)
                self.retirable.add(worker)

    def first_round(self, worker: int) -> int:
        """What :meth:`readmit` of ``worker`` would answer now, changing nothing: dist_sync, the first
        round no key has opened; dist_async, the most contributions of one key ``worker`` had applied."""
        first = 0
        for state in self._keys.values():
            first = max(first, state.base + len(state.rounds) if self.sync else state.applied.get(worker, 0))
        return first

    def updates(self) -> int:
        """The most contributions applied to one key here, every worker's together (every incarnation
        of every slot): in dist_async the key's update count, the servers' optimizer's count for it."""
        self.settle()
        return max((sum(state.applied.values()) for state in self._keys.values()), default=0)

    def rejoin_at(self, worker: int, at: int) -> list[Completion]:
        """A readmitted ``worker`` counts from round ``at`` of every key held now (dist_sync; nothing
        changes in dist_async): its next push of each joins round ``at``, its quorum rounds count from
        there, rounds before it close without it; return what closing them answers.  A key stored
        later counts it from round 0 (:meth:`_join_keys`)."""
        if not self.sync:
            return []
        self.settle()
        self._join_keys(worker, at)
        done: list[Completion] = []
        for key, state in self._keys.items():
            state.next_round[worker] = at
            state.offset[worker] = at  # a quorum PUSH's rounds count from 0 in the new incarnation
            done += self._close_rounds(state, key)
        return done

    # -- internals ---------------------------------------------------------------------------

    def _get(self, key: Key) -> _KeyState:
        try:
            return self._keys[key]
        except KeyError:
            raise KeyNotInitializedError(f"key {key!r} has not been initialised (call init first)") from None

    @staticmethod
    def _not_member(key: Key, members: frozenset[int], worker: int, what: str) -> NotAMemberError:
        return NotAMemberError(f"worker {worker} is not in worker set {sorted(members)} of key {key!r}: "
                               f"only its members may {what} it (refused, nothing changed)")

    def _check_worker(self, worker: int) -> None:
        if not (isinstance(worker, int) and 0 <= worker < self.num_workers):
            raise ValueError(f"worker rank {worker!r} is not in [0, {self.num_workers})")

    def _check_active(self, worker: int) -> None:
        self._check_worker(worker)
        if worker not in self.active:
            raise ValueError(f"worker {worker} has left the cluster; it cannot push")

    def _checked_push(self, key: Key, worker: int, value: np.ndarray, lo: int,
                      sent: int | None = None) -> tuple[_KeyState, int, int, int | None]:
        """Validate a push or pushpull (``sent``: the round it carries); return the key's state, the
        chunk's ``[lo, hi)`` and the sync round it joins (``-1 - round`` when late, 0 in async, None
        when ``worker`` owes it to an aborted round: refused, see :meth:`abort`)."""
        state = self._get(key)
        if state.members is not None and worker not in state.members:
            raise self._not_member(key, state.members, worker, "push")
        stored = state.value
        if type(lo) is not int:
            lo = operator.index(lo)
        if lo == 0 and value.shape == stored.shape:
            hi = stored.size
        else:
            if stored.ndim != 1 or value.ndim != 1:
                raise ShapeMismatchError(f"key {key!r}: pushed shape {value.shape} differs from the "
                                         f"stored shape {stored.shape} (a chunk is 1-D, of a 1-D value)")
            hi = lo + value.size
            if lo < 0 or hi > stored.size:
                raise ShapeMismatchError(f"key {key!r}: pushed chunk [{lo}, {hi}) is not inside the "
                                         f"value's [0, {stored.size})")
            if hi == lo:
                raise ProtocolError(f"key {key!r}: worker {worker} pushed an empty chunk at offset {lo}")
        if value.dtype != stored.dtype:
            raise DTypeMismatchError(f"key {key!r}: pushed dtype {value.dtype} differs from the "
                                     f"stored dtype {stored.dtype}")
        number = 0
        if self.sync:
            number = self._round_of(state, worker, sent)
            if number < state.base:  # its round closed by quorum: dropped, whatever its offset
                return state, lo, hi, -1 - number
            # A round beyond the next one: an earlier push of it was refused (damaged, over the
            # window), so the worker counted a round the server never saw; it joins the next one,
            # or one the others' retries to a restarted server will open first (promise).
            number = min(number, max(state.base + len(state.rounds), state.promised))
            owed = state.debts.get(worker)
            if owed and owed[0].round == number and owed[0].covered == lo:
                return state, lo, hi, None  # the rest of its contribution to an aborted round
            i = number - state.base
            rnd = state.rounds[i] if i < len(state.rounds) else None
            expected = 0 if rnd is None else rnd.covered.get(worker, 0)
        else:
            rnd, asm = None, state.assembling.get(worker)
            expected = 0 if asm is None else asm.covered
        if lo != expected:
            raise ProtocolError(f"key {key!r}: worker {worker} pushed a chunk at offset {lo}, but its "
                                f"contribution so far covers [0, {expected}): chunks must come in order")
        if lo == 0 and self.window and (state.submitted.get(worker, 0) - state.applied.get(worker, 0)
                                        >= self.window):
            raise ProtocolError(f"key {key!r}: worker {worker} pushed beyond its window of {self.window} "
                                "unacknowledged pushes (KVSTORE_PUSH_WINDOW); refused, not buffered")
        if rnd is not None:
            rnd.check_part(key, worker, lo, hi)
        return state, lo, hi, number

    def _round_of(self, state: _KeyState, worker: int, sent: int | None) -> int:
        """The sync round of a key that ``worker``'s next contribution joins: under a quorum the one
        it names (``sent``, its own count, resynced by ``offset``), else its next unsent one.  Below
        ``state.base`` when that round has closed (late, quorum only)."""
        if sent is None or self.quorum is None:
            return max(state.next_round.get(worker, state.base), state.base)
        return sent + state.offset.get(worker, 0)

    @staticmethod
    def _checked_range(key: Key, stored: np.ndarray, lo: int, hi: int | None) -> tuple[int, int]:
        size = stored.size
        lo = operator.index(lo)
        hi = size if hi is None else operator.index(hi)
        if not (lo == 0 and hi == size) and (stored.ndim != 1 or not 0 <= lo <= hi <= size):
            raise ShapeMismatchError(f"key {key!r}: range [{lo}, {hi}) is not inside the value's "
                                     f"[0, {size})" + ("" if stored.ndim == 1 else
                                                       f" or not the whole of a {stored.ndim}-D value"))
        return lo, hi

    def _accept(self, state: _KeyState, key: Key, token: Any, worker: int, value: np.ndarray,
                lo: int, hi: int, number: int, sent: int | None = None) -> list[Completion]:
        if lo == 0:
            state.submitted[worker] = state.submitted.get(worker, 0) + 1
        size = state.value.size
        if not self.sync:
            return self._accept_async(state, key, token, worker, value, lo, hi, size, sent)
        i = number - state.base
        members = state.members
        while len(state.rounds) <= i:  # more than one only for a rejoiner's round (_checked_push)
            ranks = self._ranks if members is None else [w for w in self._ranks if w in members]
            state.rounds.append(Round(ranks, self.clock()))
        if state.rounds[i].contribute(token, worker, value, lo, hi, size, self.ordered,
                                      self._at(number, state)):
            state.next_round[worker] = number + 1
        return self._close_rounds(state, key) if i == 0 else []

    def _accept_async(self, state: _KeyState, key: Key, token: Any, worker: int, value: np.ndarray,
                      lo: int, hi: int, size: int, sent: int | None) -> list[Completion]:
        """Apply ``worker``'s contribution once its last chunk is in; ``sent``: the push's number (its
        round in the worker's count, from the push's ``rounds``), recorded for the shard's screen."""
        if hi - lo == size:
            self._apply(state, key, value, (worker,))
            self._number(state, worker, sent)
            return self._gated(state, key, worker, _acks((token,))) + self._release_pulls(state)
        asm = state.assembling.get(worker)
        if asm is None:
            asm = state.assembling[worker] = _Assembly(np.empty(size, state.value.dtype))
        asm.buf[lo:hi] = value
        asm.covered = hi
        asm.tokens.append(token)
        if hi < size:
            return []
        del state.assembling[worker]
        self._apply(state, key, asm.buf, (worker,))
        self._number(state, worker, sent)
        return self._gated(state, key, worker, _acks(asm.tokens)) + self._release_pulls(state)

    @staticmethod
    def _number(state: _KeyState, worker: int, sent: int | None) -> None:
        """dist_async: record ``worker``'s push numbered ``sent`` (counted from its ``offset``: a
        restarted server's alignment origin) as applied: its numbering is what a shard records, so a
        retry after a later restart is screened by the worker's own count, not the server's (which a
        lossy restart put behind it)."""
        top = state.applied.get(worker, 0)  # as many as applied, at least (a push without rounds)
        if sent is not None:
            top = max(top, sent + state.offset.get(worker, 0) + 1)
        state.numbered[worker] = max(state.numbered.get(worker, 0), top)

    def _gated(self, state: _KeyState, key: Key, worker: int, acks: list[Completion]) -> list[Completion]:
        """``acks`` of ``worker``'s applied push, unless the staleness gate withholds them, plus what
        it releases for others."""
        if self.gate is None:
            return acks
        return self.gate.applied(key, worker, state.applied, self.active, acks)

    def _close_rounds(self, state: _KeyState, key: Key) -> list[Completion]:
        """Close the oldest rounds while they are done; return their acks and the pulls released."""
        rounds, size = state.rounds, state.value.size
        if not rounds or not self._closes(rounds[0], size, state.base, state):
            return []  # nothing applied: no pull can be released
        done: list[Completion] = []
        while rounds and self._closes(rounds[0], size, state.base, state):
            rnd, number = rounds.popleft(), state.base
            state.base += 1
            total = rnd.total(size)  # scaled by quorum, or as a quorum of the rest while a worker is away
            unscaled = self.quorum is None and not self.away and self.joins.keys() <= self.newcomers
            self._apply(state, key, total if unscaled else rnd.scaled(total, self._members(number, state)),
                        rnd.covered)
            if state.joined:  # a rejoin in progress (rare): follow the key up to its first round
                self._passed(state)
            if self.on_close is not None:
                self.on_close(key, self.clock() - rnd.opened, rnd.last)
            for tokens in rnd.tokens.values():
                done.extend(_acks(tokens))
        return done + self._release_pulls(state)

    def _members(self, number: int, state: _KeyState) -> int:
        """The workers a quorum-scaled round ``number`` of a key (``state``) stands for: every worker
        under a quorum, else the active and away ones but newcomers that joined after it (a join is
        not an absence); of the key's worker set, only those in it."""
        if self.quorum is not None:
            return self.num_workers
        members = state.members
        late = sum(1 for w, at in state.joined.items() if at > number and w in self.newcomers
                   and w in self.active and (members is None or w in members))
        if members is None:
            return len(self.active) + len(self.away) - late
        return len(self.active & members) + len(members.intersection(self.away)) - late

    def _check_present(self) -> None:
        if not all(isinstance(w, int) and 0 <= w < self.num_workers for w in self.active):
            raise ValueError(f"present workers {sorted(self.active)!r} are not all in "
                             f"[0, {self.num_workers})")

    def _closes(self, rnd: Round, size: int, number: int, state: _KeyState) -> bool:
        """Whether round ``number`` of a key (``state``) may close: every live worker's contribution
        is in, or a quorum's."""
        return (rnd.done(self._at(number, state))
                or (self.quorum is not None and rnd.reached(self.quorum, size)))

    def _at(self, number: int, state: _KeyState) -> set[int]:
        """The workers round ``number`` of a key (``state``) waits for: the active ones (of the key's
        worker set, when it has one), but a rejoined worker only from its first round of the key
        (``joined``: the round it rejoined at, for a key held then; :mod:`kvstore.core.rejoin`)."""
        joined, members = state.joined, state.members
        at = self.active if not joined else {w for w in self.active if joined.get(w, 0) <= number}
        return at if members is None else at & members

    def _apply(self, state: _KeyState, key: Key, total: np.ndarray, workers: Iterable[int]) -> None:
        if self.updater is None:
            state.value = total
        else:
            state.value = self.updater(key, total, state.value)
        for worker in workers:
            state.applied[worker] = state.applied.get(worker, 0) + 1

    def _add_pull(self, state: _KeyState, token: Any, worker: int, lo: int, hi: int) -> list[Completion]:
        target = state.submitted.get(worker, 0)
        if state.applied.get(worker, 0) >= target and state.base >= state.joined.get(worker, 0):
            return [Completion(token, _part_of(state.value, lo, hi))]
        state.waiting_pulls.append((token, worker, target, lo, hi))
        return []

    def _release_pulls(self, state: _KeyState) -> list[Completion]:
        if not state.waiting_pulls:
            return []
        ready, waiting = [], []
        for entry in state.waiting_pulls:
            ok = state.applied.get(entry[1], 0) >= entry[2] and state.base >= state.joined.get(entry[1], 0)
            (ready if ok else waiting).append(entry)
        state.waiting_pulls = waiting
        value = state.value
        return [Completion(token, _part_of(value, lo, hi)) for token, _, _, lo, hi in ready]

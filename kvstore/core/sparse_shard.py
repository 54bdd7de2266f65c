"""A server's row-sparse tables, pure: each key's row range, its sync rounds, its waiting pulls.

A row-sparse key's rows ``[lo, hi)`` live on one server as one ``(hi - lo, width)`` array.  A worker's
push of a key to a server is one or more messages (chunks of rows) of one round, the last one marked;
every worker pushes every key it trains in every step, with no rows when it has none, so rounds
count one contribution per worker as dense keys do (MXNet's workers push every key every step too).

* ``dist_sync``: a round closes once every live worker's last chunk of it is in; its rows are merged
  (repeats summed) and applied once (``updater``), and its acks go out.  A worker *away* (lost, to be
  restarted: :meth:`RowTables.mark_away`) is not waited for, and a round closed without it has its
  rows scaled by workers / pushes (as a quorum's, and as the dense keys' rounds are); its restart is
  counted again from a round of every table (:meth:`RowTables.readmit`, :meth:`RowTables.rejoin_at`,
  :mod:`kvstore.core.rejoin`).  A pull carries how many
  rounds its worker has pushed (``after``) and is answered once that many are applied
  (read-your-writes).  Rounds more than ``window`` ahead of the applied ones are refused.
* ``dist_async``: a worker's chunks are gathered until its last one, then applied and acked; with a
  staleness ``gate`` (``KVSTORE_STALENESS``) the ack of a worker too many pushes of the key ahead of
  the slowest live worker is withheld, as for dense keys (:mod:`kvstore.core.staleness`).

A dynamic table (``init_dynamic``) has the same rounds over a :class:`kvstore.core.dynamic.DynamicRows`
instead of a row range: any int64 id is its own, pushes are applied by ``dynamic_updater`` and pulls
read (or, with ``admit``, store) through it.

Every check runs before anything changes; errors are the kvstore tree's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.core import rowsparse as R
from kvstore.core.dynamic import DynamicRows
from kvstore.core.partition import Key
from kvstore.core.replies import Completion
from kvstore.core.staleness import StalenessGate
from kvstore.errors import (
    DTypeMismatchError,
    DuplicateInitError,
    KeyNotInitializedError,
    ProtocolError,
    ShapeMismatchError,
)

# A worker's pulls of a key waiting for a round ask for at most this many times the range's rows (a
# pull asks each row once; this many threads of one worker may each wait for the whole range).
WAITING_RANGES = 8
Updater = Callable[[Key, np.ndarray, np.ndarray, np.ndarray], None]  # (key, weight, local ids, rows)
DynamicUpdater = Callable[[Key, DynamicRows, np.ndarray, np.ndarray], None]  # (key, table, ids, rows)
# A worker's rows in one push of a dynamic table (its range is unbounded): at most DYNAMIC_ROUND_ROWS and
# DYNAMIC_ROUND_BYTES of rows, and with a capacity at most DYNAMIC_ROUND_CAPACITIES times it (or
# DYNAMIC_ROUND_MIN rows, a batch's ids, for a small one): a server holds a bounded multiple of its table.
DYNAMIC_ROUND_ROWS = 1 << 24
DYNAMIC_ROUND_BYTES = 1 << 30
DYNAMIC_ROUND_CAPACITIES = 4
DYNAMIC_ROUND_MIN = 1 << 16


def dynamic_round_rows(rows: DynamicRows) -> int:
    """The most rows one worker's push of one round may carry to ``rows`` (see DYNAMIC_ROUND_ROWS)."""
    limit = min(DYNAMIC_ROUND_ROWS, max(1, DYNAMIC_ROUND_BYTES // (rows.width * rows.dtype.itemsize)))
    if rows.spec.capacity:
        limit = min(limit, max(DYNAMIC_ROUND_MIN, DYNAMIC_ROUND_CAPACITIES * rows.spec.capacity))
    return limit


@dataclass
class _Round:
    parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    senders: list[int] = field(default_factory=list)  # the worker of each part
    done: set[int] = field(default_factory=set)
    tokens: list[Any] = field(default_factory=list)
    sent: dict[int, int] = field(default_factory=dict)  # rows each worker has sent in this round
    opened: float = 0.0  # the clock when its first chunk came (the stall inspector's wait)

    def add(self, sender: int, local: np.ndarray, rows: np.ndarray, token: Any, limit: int) -> None:
        """Take a chunk; ProtocolError when ``sender``'s rows in this round would pass ``limit`` (a push
        carries each row at most once: what a server holds for a round stays bounded)."""
        count = self.sent.get(sender, 0) + local.size
        if count > limit:
            raise ProtocolError(f"worker {sender} sent {count} rows in one push to a range of {limit} rows "
                                "(a dynamic table's: at most that many per push)")
        self.sent[sender] = count
        self.parts.append((local, rows))
        self.senders.append(sender)
        self.tokens.append(token)


@dataclass
class Table:
    """One key's rows ``[lo, hi)`` of a ``shape`` table, and its rounds."""

    shape: tuple[int, ...]
    lo: int
    hi: int
    weight: np.ndarray
    applied: int = 0
    rounds: dict[int, _Round] = field(default_factory=dict)  # dist_sync: open rounds by number
    pending: dict[int, _Round] = field(default_factory=dict)  # dist_async: a worker's chunks so far
    waiting: list[tuple[int, Any, np.ndarray, int, bool]] = field(default_factory=list)  # after, token,
    # ids, sender, admit
    dynamic: DynamicRows | None = None  # a dynamic table's rows (lo, hi and weight unused)
    pushed: dict[int, int] = field(default_factory=dict)  # dist_async: worker -> its pushes applied
    offset: dict[int, int] = field(default_factory=dict)  # quorum: worker -> rounds it was shifted by
    floor: int = 0  # restored (dist_sync): pushes of rounds below it are retries, acked and dropped
    counted: dict[int, int] = field(default_factory=dict)  # restored (dist_async): worker -> pushes
    # the shard counts (its retries of them are acked and dropped)
    numbered: dict[int, int] = field(default_factory=dict)  # dist_async: worker -> its highest push
    # number applied + 1 (what a shard records: after a restart that lost pushes, the server's own count
    # in ``pushed`` falls behind the worker's numbering, which a retry carries)

    @property
    def width(self) -> int:
        """Elements per row."""
        return self.weight.shape[1] if self.dynamic is None else self.dynamic.width

    @property
    def dtype(self) -> np.dtype:
        """The rows' dtype."""
        return self.weight.dtype if self.dynamic is None else self.dynamic.dtype

    @property
    def limit(self) -> int:
        """The most rows one worker's push of one round may carry here."""
        return self.hi - self.lo if self.dynamic is None else dynamic_round_rows(self.dynamic)

    def read(self, local: np.ndarray, admit: bool = False) -> np.ndarray:
        """Rows ``local`` (positions in the range, or a dynamic table's ids) as they are now."""
        return self.weight[local] if self.dynamic is None else self.dynamic.read(local, admit)


def _apply_default(key: Key, weight: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    weight[ids] = rows


def _apply_dynamic_default(key: Key, table: DynamicRows, ids: np.ndarray, rows: np.ndarray) -> None:
    keep, slots, _ = table.admit(ids)
    table.weight[slots] = rows[keep]


class RowTables:
    """The row-sparse keys a server holds."""

    def __init__(self, num_workers: int = 1, sync: bool = True, window: int = 4,
                 clock: Callable[[], float] = time.monotonic, ordered: bool = False) -> None:
        self.num_workers, self.sync, self.window = num_workers, sync, max(1, window)
        self.ordered = ordered  # KVSTORE_SUM_ORDER=rank: a round's rows summed in rank order
        self.clock = clock
        self.live = set(range(num_workers))
        self.tables: dict[Key, Table] = {}
        self.updater: Updater = _apply_default
        self.dynamic_updater: DynamicUpdater = _apply_dynamic_default
        self.gate: StalenessGate | None = None  # dist_async's KVSTORE_STALENESS, as the dense keys'
        self.quorum: int | None = None  # dist_sync's KVSTORE_SYNC_QUORUM (None: every live worker)
        self.on_late: Callable[[Key, int, int], None] | None = None  # (key, worker, round) dropped late
        self.late: dict[int, int] = {}  # worker -> late pushes dropped (quorum)
        self.away: set[int] = set()  # lost workers to be restarted (kvstore.core.rejoin)
        self.joins: dict[int, int] = {}  # rejoined worker -> the first round of every table it counts in
        self.sets = 0  # SPARSE_SETs (rows or state) and dense STATE_SETs taken by this process: a shard
        # is due when it moves (kvstore.server.shards), and a settle request waits for a shard holding them
        self.calls: dict[tuple[int, int], set[int]] = {}  # (worker, call) -> parts of an init's or
        # load's sets taken (in the shard too: a restart from it knows which it holds)

    def __contains__(self, key: object) -> bool:
        return key in self.tables

    def __len__(self) -> int:
        return len(self.tables)

    def nbytes(self) -> int:
        """Bytes of the row ranges (and dynamic tables' pools) held."""
        return sum(t.weight.nbytes if t.dynamic is None else t.dynamic.nbytes() for t in self.tables.values())

    def table(self, key: Key) -> Table:
        """``key``'s table; KeyNotInitializedError when this server holds no rows of it."""
        try:
            return self.tables[key]
        except KeyError:
            raise KeyNotInitializedError(f"row_sparse key {key!r} has no rows on this server (not "
                                         "initialised with stype='row_sparse')") from None

    def init(self, key: Key, shape: tuple[int, ...], dtype: np.dtype, lo: int, hi: int,
             spec: dict[str, Any]) -> None:
        """Create rows ``[lo, hi)`` of ``key``'s table as ``spec`` initialises them."""
        if key in self.tables:
            raise DuplicateInitError(f"key {key!r} is already initialised on this server")
        width = int(np.prod(shape[1:], dtype=np.int64))
        weight = R.generate(spec, lo, hi, width, dtype)
        self.tables[key] = Table(tuple(shape), lo, hi, weight)

    def init_dynamic(self, key: Key, shape: tuple[int, ...], rows: DynamicRows) -> None:
        """Hold ``rows``, this server's part of dynamic table ``key`` of ``shape``."""
        if key in self.tables:
            raise DuplicateInitError(f"key {key!r} is already initialised on this server")
        self.tables[key] = Table(tuple(shape), 0, 0, np.zeros((0, rows.width), rows.dtype), dynamic=rows)

    def restore(self, key: Key, table: Table, rounds: int, applied: dict[int, int]) -> None:
        """Hold ``table`` (a fixed or dynamic table of a server's shard, its rows in it) with ``rounds``
        closed (dist_sync) and ``applied`` each worker's highest push number applied + 1 (dist_async);
        the workers' retries of pushes numbered below it are dropped (:meth:`realign` in dist_sync).
        DuplicateInitError when ``key`` is held."""
        if key in self.tables:
            raise DuplicateInitError(f"key {key!r} is already initialised on this server")
        table.applied = rounds
        table.pushed, table.counted, table.numbered = dict(applied), dict(applied), dict(applied)
        self.tables[key] = table

    def realign(self, key: Key, floor: int) -> None:
        """dist_sync, once the workers have aligned with a restarted server: ``key`` goes on from round
        ``floor`` (rounds up to it were in the shard or are lost); a push of a round below it (a retry)
        is acked and dropped.  KeyNotInitializedError when ``key`` is not held."""
        table = self.table(key)
        table.applied = table.floor = floor

    def progress(self) -> int:
        """The furthest table's progress (a shard's step): rounds closed (dist_sync), or one worker's
        most pushes applied (dist_async)."""
        if self.sync:
            return max((t.applied for t in self.tables.values()), default=0)
        return max((max(t.pushed.values(), default=0) for t in self.tables.values()), default=0)

    def mark_away(self, worker: int) -> list[Completion]:
        """``worker`` is lost and will be restarted: rounds close without it, each round's rows then
        scaled by workers / pushes (as :meth:`leave` otherwise); return what closing them answers."""
        self.away.add(worker)  # first: the rounds leave() closes are scaled
        self.joins.pop(worker, None)
        return self.leave(worker)

    def first_round(self, worker: int) -> int:
        """What :meth:`readmit` of ``worker`` would answer now, changing nothing: dist_sync, the first
        round no table has opened; dist_async, the most pushes of one table ``worker``'s earlier
        incarnations had applied (by its own numbering)."""
        first = 0
        for table in self.tables.values():
            if self.sync:
                first = max(first, table.applied, max(table.rounds, default=-1) + 1)
            else:
                first = max(first, table.pushed.get(worker, 0), table.numbered.get(worker, 0))
        return first

    def readmit(self, worker: int) -> int:
        """A restarted ``worker`` counts again, from the first round no table has opened (dist_sync:
        rounds open before do not wait for it); return that round (:meth:`first_round`)."""
        first = self.first_round(worker)
        self.away.discard(worker)
        self.live.add(worker)
        if self.sync:
            self.joins[worker] = first
        return first

    def rejoin_at(self, worker: int, at: int) -> list[Completion]:
        """A readmitted ``worker`` counts from round ``at`` of every table (dist_sync; nothing changes
        in dist_async): its pushes are numbered from ``at`` (its count restarts there, so no quorum
        shift is kept), rounds before it close without it; return what closing them answers."""
        if not self.sync:
            return []
        self.joins[worker] = at
        done: list[Completion] = []
        for key, table in self.tables.items():
            table.offset.pop(worker, None)
            done.extend(self._close(key, table))
        return done

    def _waits_for(self, number: int) -> set[int]:
        """The workers round ``number`` of a table waits for: the live ones, but a rejoined worker
        only from the round it rejoined at."""
        if not self.joins:
            return self.live
        return {w for w in self.live if self.joins.get(w, 0) <= number}

    def local_ids(self, key: Key, ids: np.ndarray) -> tuple[Table, np.ndarray]:
        """``key``'s table and ``ids`` (global row ids, int64, 1-d) as positions in its row range;
        ProtocolError / ShapeMismatchError when they are not ids of rows held here."""
        table = self.table(key)
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise ProtocolError(f"row ids of key {key!r} must be one flat int64 array")
        if table.dynamic is not None:
            if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
                raise ProtocolError(f"row ids of dynamic key {key!r} must be sorted and distinct")
            return table, ids
        if ids.size and (int(ids.min()) < table.lo or int(ids.max()) >= table.hi):
            raise ShapeMismatchError(f"row ids of key {key!r} outside this server's rows "
                                     f"[{table.lo}, {table.hi})")
        return table, ids - table.lo

    def _rows(self, key: Key, table: Table, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        if rows.dtype != table.dtype:
            raise DTypeMismatchError(f"rows of key {key!r} are {rows.dtype}; the table holds "
                                     f"{table.dtype}")
        if rows.ndim != 2 or rows.shape != (ids.size, table.width):
            raise ShapeMismatchError(f"rows of key {key!r} must be ({ids.size}, {table.width}), "
                                     f"got {rows.shape}")
        return rows

    def set_rows(self, key: Key, ids: np.ndarray, rows: np.ndarray,
                 call: tuple[int, int, int] | None = None) -> None:
        """Overwrite rows ``ids`` of ``key`` (an init from a value, a restore); ``call``: (worker, call,
        part) of the init's or load's sets this one is (:meth:`note_set`)."""
        table, local = self.local_ids(key, ids)
        if table.dynamic is not None:
            raise ProtocolError(f"SPARSE_SET of dynamic key {key!r}: its rows are made on first touch")
        table.weight[local] = self._rows(key, table, ids, rows)
        self.note_set(call)

    def note_set(self, call: tuple[int, int, int] | None = None) -> None:
        """Count a SPARSE_SET taken (rows or optimizer state, of any table): a restart from a shard
        taken before it would bring back what it overwrote; ``call``: (worker, call, part), recorded
        for the call's settle (:meth:`settles`)."""
        self.sets += 1
        if call is not None:
            self.calls.setdefault(call[:2], set()).add(call[2])

    def settles(self, worker: int, call: int, parts: int) -> bool:
        """Whether every one of the ``parts`` sets of ``worker``'s ``call`` was taken (here, or by the
        server whose shard this one restarted from): a restart in between lost the others."""
        return self.calls.get((worker, call), set()) == set(range(parts))

    def push(self, sender: int, key: Key, rnd: int, last: bool, ids: np.ndarray, rows: np.ndarray,
             token: Any) -> list[Completion]:
        """Take one chunk of ``sender``'s push of ``key`` in its round ``rnd``; return what is answered."""
        table, local = self.local_ids(key, ids)
        rows = self._rows(key, table, ids, rows)
        if sender not in self.live:
            raise ProtocolError(f"worker {sender} has left; its push of key {key!r} is refused")
        if rnd < (table.floor if self.sync else table.counted.get(sender, 0)):  # a retry to a restarted
            return [Completion(token)]  # server of a push its shard holds, or of a lost round
        if not self.sync:
            gathering = table.pending.get(sender) or _Round()
            gathering.add(sender, local, rows, token, table.limit)  # raises before it is kept
            table.pending[sender] = gathering
            if not last:
                return []
            del table.pending[sender]
            self._apply(key, table, gathering)
            table.pushed[sender] = table.pushed.get(sender, 0) + 1  # the staleness gate's count
            table.numbered[sender] = max(table.numbered.get(sender, 0), rnd + 1)  # the shard's screen
            acks = [Completion(t) for t in gathering.tokens]
            if self.gate is None:
                return acks
            return self.gate.applied(key, sender, table.pushed, self.live, acks)
        rnd += table.offset.get(sender, 0)  # a worker that was late joins the oldest open round
        if rnd < table.applied and self.quorum is not None:  # its round closed without it: late
            return self._late(key, table, sender, rnd, last, token)
        if not table.applied <= rnd < table.applied + self.window:
            raise ProtocolError(f"push of key {key!r} for round {rnd}: this server has applied "
                                f"{table.applied} rounds and takes {self.window} ahead (KVSTORE_PUSH_WINDOW)")
        current = table.rounds.get(rnd) or _Round(opened=self.clock())
        if sender in current.done:
            raise ProtocolError(f"worker {sender} pushed round {rnd} of key {key!r} twice")
        current.add(sender, local, rows, token, table.limit)  # a refused chunk opens no round
        table.rounds[rnd] = current
        if last:
            current.done.add(sender)
        return self._close(key, table)

    def _late(self, key: Key, table: Table, sender: int, rnd: int, last: bool,
              token: Any) -> list[Completion]:
        """Drop a chunk of a push whose round ``rnd`` closed by quorum: ack it; at its last chunk count
        it and shift the worker's rounds so its next push joins the oldest round still open."""
        if last:
            table.offset[sender] = table.offset.get(sender, 0) + table.applied - rnd - 1
            self.late[sender] = self.late.get(sender, 0) + 1
            if self.on_late is not None:
                self.on_late(key, sender, rnd)
        return [Completion(token)]

    def _closes(self, current: _Round, number: int) -> bool:
        """Whether round ``number`` is complete: every push it waits for is in, or (quorum) that many."""
        if self._waits_for(number) <= current.done:
            return True
        return self.quorum is not None and len(current.done & self.live) >= self.quorum

    def _apply(self, key: Key, table: Table, contribution: _Round) -> None:
        """Sum a round's rows (repeated ids added in the parts' order: by worker rank under
        ``ordered``, a worker's chunks in their order, else as they came) and update the table."""
        parts = contribution.parts
        if self.ordered and len(parts) > 1:  # a stable sort: each worker's own chunks keep their order
            parts = [parts[i] for i in sorted(range(len(parts)), key=contribution.senders.__getitem__)]
        if len(parts) == 1:  # one worker's one message: merged on the worker already
            ids, rows = parts[0]
        else:
            ids = np.concatenate([p[0] for p in parts])
            rows = np.concatenate([p[1] for p in parts])
        ids, rows = R.merge(ids, rows)
        if self.sync and (self.quorum is not None or self.away or self.joins):
            # as if every worker had pushed: under a quorum all of them, else the live and away ones
            # (a worker that left stands for none), as ShardState scales a dense round
            members = self.num_workers if self.quorum is not None else len(self.live) + len(self.away)
            pushed = len(contribution.done)
            if pushed and pushed != members:
                rows = rows * rows.dtype.type(members / pushed)
        if table.dynamic is not None:
            self.dynamic_updater(key, table.dynamic, ids, rows)
        else:
            self.updater(key, table.weight, ids, rows)

    def _close(self, key: Key, table: Table) -> list[Completion]:
        """Apply every complete round in order; the acks and pulls that are answered then."""
        done: list[Completion] = []
        while True:
            current = table.rounds.get(table.applied)
            if current is None or not self._closes(current, table.applied):
                break
            self._apply(key, table, current)  # an updater's error leaves the round open
            del table.rounds[table.applied]
            table.applied += 1
            done.extend(Completion(t) for t in current.tokens)
        if done and table.waiting:
            ready = [w for w in table.waiting if w[0] <= table.applied]
            table.waiting = [w for w in table.waiting if w[0] > table.applied]
            done.extend(Completion(token, table.read(local, admit)) for _, token, local, _, admit in ready)
        return done

    def pull(self, sender: int, key: Key, after: int, ids: np.ndarray, token: Any,
             admit: bool = False) -> list[Completion]:
        """Answer a pull of rows ``ids`` of ``key`` once ``after`` rounds are applied (dist_sync);
        ``admit``: a dynamic table stores the rows it did not hold."""
        table, local = self.local_ids(key, ids)
        if self.sync:
            after += table.offset.get(sender, 0)  # a late worker's pushes were shifted
        if self.sync and after > table.applied:
            if after > table.applied + self.window:
                raise ProtocolError(f"pull of key {key!r} after round {after}: only {table.applied} "
                                    "applied")
            held = local.size + sum(w[2].size for w in table.waiting if w[3] == sender)
            if held > WAITING_RANGES * table.limit:  # what waits stays bounded
                raise ProtocolError(f"worker {sender} has pulls of {held} rows of key {key!r} waiting, more "
                                    f"than {WAITING_RANGES} times the {table.limit} rows of a push here")
            table.waiting.append((after, token, local, sender, admit))
            return []
        return [Completion(token, table.read(local, admit))]

    def stalled(self, older_than: float) -> list[tuple[Key, float, list[int]]]:
        """``(key, seconds open, live workers it waits for)`` of each table whose next round (dist_sync)
        has been open longer than ``older_than`` seconds (the stall inspector, as ShardState's)."""
        now, found = self.clock(), []
        for key, table in self.tables.items():
            current = table.rounds.get(table.applied)
            if current is not None and now - current.opened > older_than:
                found.append((key, now - current.opened,
                              sorted(self._waits_for(table.applied) - current.done)))
        return found

    def drop_waiting(self, key: Key) -> list[Any]:
        """Forget the pulls of ``key`` waiting for a round (a stall aborts them); return their tokens."""
        table = self.table(key)
        tokens, table.waiting = [w[1] for w in table.waiting], []
        return tokens

    def leave(self, sender: int) -> list[Completion]:
        """``sender`` is done: rounds no longer wait for it, its unfinished async chunks and its waiting
        pulls are dropped."""
        self.live.discard(sender)
        for call in [c for c in self.calls if c[0] == sender]:  # its settles will not come
            del self.calls[call]
        done: list[Completion] = []
        for key, table in self.tables.items():
            table.waiting = [w for w in table.waiting if w[3] != sender]  # nobody reads their answers
            dropped = table.pending.pop(sender, None)
            if dropped is not None:
                done.extend(Completion(t) for t in dropped.tokens)
            if self.sync:
                done.extend(self._close(key, table))
            elif self.gate is not None:  # it no longer counts as the slowest
                done.extend(self.gate.release(key, table.pushed, self.live))
        return done

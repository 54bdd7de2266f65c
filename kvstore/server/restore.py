"""A server restarted from its own latest shard (``--max-restarts`` with ``KVSTORE_SNAPSHOT_EVERY``).

The launcher starts a dead server again with the same ``KVSTORE_SERVER_ID`` and the next
``KVSTORE_INCARNATION``.  The new process reads its newest shard (:func:`read_image`) before it
registers, registers late with the scheduler (which tells every worker the new address in its
heartbeat replies), installs the shard's values, counts and optimizer state (:func:`install`), and
answers only ALIGN, LEAVE and SHM_ATTACH until every worker still in the job has aligned
(:class:`Restored`):

* Each worker, told of the restart, holds its requests to this server, connects to the new address
  and sends ALIGN: for each key it has pushed, the round of its oldest push this server has not
  answered (or of its next push when none is unanswered), counted from its ``origin`` (0, or the
  round a restarted worker rejoined at).  The reply comes once every worker has aligned; then each
  worker sends its unanswered requests again, in order, sealed anew.  A restarted worker whose own rejoin
  (kvstore/core/rejoin.py) had not reached this server says so (``rejoining``): it is away here until
  its REJOIN, which follows the alignment, and nothing waits for it meanwhile.
* ``dist_sync``: each key goes on from round ``max(shard's round, every worker's oldest unanswered
  round)``.  Rounds from the shard's up to that one were closed by the dead server and acknowledged:
  their updates are lost, and the log says how many.  A retried push of a round below it is dropped
  and acknowledged (a pushpull gets the current value): it is in the shard, or it is lost with its
  round, never applied twice.
* ``dist_async``: a retried push is dropped when the shard already counts it (the shard records
  each worker's highest push number applied + 1 per key, in the worker's numbering: after a restart
  that lost pushes the server's own count would fall behind it); the others are applied once.
  Pushes the dead server applied after its shard and acknowledged are lost.

Row-sparse tables (fixed and dynamic) come back from the shard with their rows, optimizer state and
counters (:mod:`kvstore.core.table_image`) and follow the same rules, their rounds being each worker's
pushes of the table (the retries are screened by the tables themselves,
:meth:`RowTables.realign`); each table's lost rounds are logged by name.

Not covered (docs/failures.md): compression residuals, a quorum's late rounds and staleness
bookkeeping start afresh from the shard.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.config import Config
from kvstore.core import table_image
from kvstore.core.optimizer import Optimizer, from_spec
from kvstore.core.partition import Key, check_key
from kvstore.core.rejoin import Rejoins
from kvstore.core.replies import Completion
from kvstore.core.shard import ShardState
from kvstore.core.shard_image import ShardImage
from kvstore.core.sparse_shard import RowTables
from kvstore.errors import ConfigError, KeyTypeError, ProtocolError
from kvstore.net.protocol import Message, Op
from kvstore.net.router import Handler
from kvstore.server.requests import Batch, Requests
from kvstore.server.shards import ShardWriter, keys_of, progress_of, read_latest

log = logging.getLogger("kvstore.server")
_OPEN = (Op.ALIGN, Op.LEAVE, Op.SHM_ATTACH)  # answered while the workers align; others are refused


def read_image(cfg: Config) -> ShardImage | None:
    """The shard a restarted server (``cfg.incarnation`` > 0) starts from; None for a first start.
    Raises :class:`ConfigError` when a restarted server has no rank, no folder or no shard to read."""
    if not cfg.incarnation:
        return None
    if cfg.server_id is None or not cfg.snapshot_dir:
        raise ConfigError("a restarted server (KVSTORE_INCARNATION > 0) needs KVSTORE_SERVER_ID and "
                          "KVSTORE_SNAPSHOT_DIR to find its shard")
    image = read_latest(cfg.snapshot_dir, cfg.server_id)
    if image is None:
        raise ConfigError(f"server {cfg.server_id} was restarted but has no shard under "
                          f"{cfg.snapshot_dir!r} to start from")
    return image


def install(requests: Requests, image: ShardImage, session: str) -> None:
    """Put ``image``'s keys, counts, precision and optimizer (with its state) into a fresh server's
    shard.  Raises :class:`ConfigError` when the shard was written for another job (its cluster
    ``session``, hex) or another mode."""
    state = requests.state
    if image.session != session:
        raise ConfigError(f"server {image.rank}'s newest shard ({image.number}) under KVSTORE_SNAPSHOT_DIR "
                          "is of another job (another cluster session): give each job a folder of its own")
    if image.mode != ("dist_sync" if state.sync else "dist_async") or image.num_workers != state.num_workers:
        raise ConfigError(f"server {image.rank}'s shard {image.number} is of a {image.mode} job of "
                          f"{image.num_workers} workers; this cluster differs")
    optimizer = None
    if image.optimizer is not None:
        optimizer = from_spec(image.optimizer)
        optimizer.num_update = image.num_update
        requests.set_optimizer(optimizer)
    for key, held in image.keys.items():
        state.restore(key, held.value, held.round, held.applied, held.members)
        if held.bf16:
            requests.mark_precision([key], True)
        if held.count is not None and optimizer is not None:
            optimizer.set_state(key, held.value, held.count, held.states)


def _align_body(body: Any) -> tuple[int, int, list[Key], list[int]]:
    """An ALIGN's ``(incarnation, origin, keys, rounds)``, checked; raises ProtocolError otherwise."""
    fields = [body.get(name) for name in ("incarnation", "origin", "keys", "rounds")]
    inc, origin, keys, rounds = fields
    if not (type(inc) is int and inc >= 0 and type(origin) is int and origin >= 0
            and isinstance(keys, list) and isinstance(rounds, list) and len(keys) == len(rounds)
            and all(type(r) is int and r >= 0 for r in rounds)):
        raise ProtocolError("ALIGN needs an incarnation and an origin (ints >= 0) and one round >= 0 "
                            "per key")
    try:
        return inc, origin, [check_key(k) for k in keys], rounds
    except KeyTypeError as exc:
        raise ProtocolError(f"ALIGN: {exc}") from None


def _align_nexts(body: Any, rounds: list[int]) -> list[int]:
    """An ALIGN's ``next`` (each key's next round once its held pushes are sent again; its ``rounds``
    when absent), checked: one int >= its round per key; raises ProtocolError otherwise."""
    nexts = body.get("next", rounds)
    if not (isinstance(nexts, list) and len(nexts) == len(rounds)
            and all(type(n) is int and n >= r for n, r in zip(nexts, rounds))):
        raise ProtocolError("ALIGN's next needs one round per key, each at least the key's round")
    return nexts


class Restored:
    """A restarted server's side of the workers' alignment, then of their retried pushes."""

    def __init__(self, requests: Requests, rejoins: Rejoins, image: ShardImage, cluster: dict[str, Any],
                 session: str, tables: RowTables | None = None) -> None:
        """Install ``image`` (:func:`install`; its row-sparse tables into ``tables``, the server's) and
        wait for the workers of the cluster map ``cluster`` that have neither left nor gone away to
        align."""
        self.requests, self.rejoins, self.image = requests, rejoins, image
        self.tables = tables if tables is not None else RowTables(requests.state.num_workers,
                                                                  requests.state.sync)
        state = requests.state
        install(requests, image, session)
        table_image.install(self.tables, requests.optimizer, image.tables)
        self.tables.calls = {call: set(parts) for call, parts in image.calls.items()}  # settles' sets held
        for held in image.keys.values():  # copied into the state: only the rounds and counts stay here
            held.value, held.states = np.empty(0, held.value.dtype), {}
        for table in image.tables.values():  # held by the tables now: only the rounds stay here
            table.rows, table.states, table.dynamic = np.empty((0, 0)), {}, None
        for worker in cluster.get("left") or []:
            if type(worker) is int and 0 <= worker < state.num_workers:
                state.leave(worker)
                self.tables.leave(worker)
        for worker in cluster.get("away") or []:
            if type(worker) is int and 0 <= worker < state.num_workers:
                rejoins.away(worker, 0)
        self.expected = set(state.active)  # the workers that must align
        self.aligned: dict[int, dict[Key, int]] = {}  # worker -> key -> its oldest unanswered round
        self.aligned_tables: dict[int, dict[Key, int]] = {}  # the same for the row-sparse tables
        self.nexts: dict[int, dict[Key, int]] = {}  # worker -> key -> its next round after its retries
        self.origins: dict[int, int] = {}
        self.waiting: list[tuple[bytes, int]] = []  # ALIGN requests answered once all are in
        self.floors: dict[Key, int] = {}  # dist_sync: the round each key goes on from
        self.done = False
        self.lost = 0
        log.warning("restarted from shard %d (step %d, %d keys, %d row_sparse tables); waiting for workers "
                    "%s to align", image.number, image.step(), len(image.keys), len(image.tables),
                    sorted(self.expected))
        self.settle()  # every worker left or away: none will align (a REJOIN must not wait for one)

    def guard(self, handlers: dict[Op, Handler]) -> dict[Op, Handler]:
        """``handlers`` with ALIGN added and every other data op refused until the workers have aligned."""
        guarded: dict[Op, Handler] = {op: self._guarded(op, h) for op, h in handlers.items()}
        guarded[Op.ALIGN] = self.on_align
        return guarded

    def _guarded(self, op: Op, handler: Handler) -> Handler:
        if op in _OPEN:
            return handler

        def refuse_until_aligned(identity: bytes, msg: Message) -> None:
            if not self.done:
                raise ProtocolError(f"{op.name} refused: server {self.image.rank} restarted from its shard "
                                    f"and waits for workers {sorted(self.expected - set(self.aligned))} "
                                    "to send ALIGN")
            handler(identity, msg)
        return refuse_until_aligned

    def on_align(self, identity: bytes, msg: Message) -> None:
        """A worker's ALIGN: recorded; every ALIGN is answered once all expected workers have sent one."""
        worker = self.requests.sender(msg)
        incarnation, origin, keys, rounds = _align_body(msg.body)
        nexts = _align_nexts(msg.body, rounds)
        rejoining = msg.body.get("rejoining", False)
        if type(rejoining) is not bool:
            raise ProtocolError("ALIGN's rejoining must be a bool")
        state = self.requests.state
        if self.done:  # a worker that aligns again (nothing changes): answered at once
            self.requests.reply(identity, Message(Op.OK, {"lost": self.lost}, seq=msg.seq))
            return
        if rejoining and incarnation > self.rejoins.current.get(worker, 0):
            # a restarted worker whose REJOIN to this server is still to come (sent again after the
            # alignment): away here until then, so neither the alignment nor any round waits for it
            self.requests.reply_all(self.rejoins.away(worker, incarnation - 1))
            self.waiting.append((identity, msg.seq))
            self.forget(worker)
            return
        if incarnation > self.rejoins.current.get(worker, 0):
            self.rejoins.current[worker] = incarnation
        self.origins[worker] = origin
        self.aligned[worker] = {k: r + origin for k, r in zip(keys, rounds) if k in state}
        # a table's rounds carry no origin: a rejoined worker numbers its pushes of a table from the round
        # it rejoined at (kvstore/client/sparse.py, DistRows.rejoined)
        self.aligned_tables[worker] = {k: r for k, r in zip(keys, rounds) if k in self.tables}
        self.nexts[worker] = {k: n + origin for k, n in zip(keys, nexts) if k in state}
        self.waiting.append((identity, msg.seq))
        if worker in state.active:
            self.expected.add(worker)
        self.settle()

    def rejoined(self, worker: int, at: int) -> None:
        """``worker`` rejoined (or, a new member, joined) at round ``at``: its pushes number from there
        (its origin), so those of a new member of a slot held before are not screened as retries of
        the previous member's (core/rejoin.py)."""
        self.origins[worker] = at

    def forget(self, worker: int) -> None:
        """``worker`` left or went away: the alignment no longer waits for it."""
        self.expected.discard(worker)
        if not self.done:  # the last one it waited for: aligned now, even if no ALIGN came
            self.settle()

    def settle(self) -> None:
        """Once every expected worker has aligned: set each key's round, answer every ALIGN, log the loss."""
        if self.done or not self.expected <= set(self.aligned):
            return
        state = self.requests.state
        losses: list[int] = []  # dist_sync: each key's rounds lost
        for key, held in self.image.keys.items():
            if not state.sync:  # a quorum PUSH's rounds count from the worker's origin
                state.realign(key, self.origins)
                continue
            floor = max([held.round] + [lows[key] for lows in self.aligned.values() if key in lows])
            state.realign(key, self.origins, floor)
            state.promise(key, max([floor] + [n[key] for n in self.nexts.values() if key in n]))
            self.floors[key] = floor
            losses.append(floor - held.round)
        if state.sync:
            losses.extend(self._realign_tables())
        self.done = True
        self.lost = max(losses, default=0)
        for identity, seq in self.waiting:
            self.requests.reply(identity, Message(Op.OK, {"lost": self.lost}, seq=seq))
        self.waiting = []
        self._log_loss(losses)

    def _realign_tables(self) -> list[int]:
        """dist_sync: each row-sparse table goes on from round ``max(shard's round, every worker's oldest
        unanswered round)``, as a dense key; each table's loss is logged by name (rounds ``a`` to
        ``b - 1`` lost: the table's rows are as of round ``a``, and go on with round ``b``).  Returns
        the rounds each table lost."""
        losses = []
        for key, held in self.image.tables.items():
            floor = max([held.round] + [lows[key] for lows in self.aligned_tables.values() if key in lows])
            self.tables.realign(key, floor)
            losses.append(floor - held.round)
            which = f" (rounds {held.round} to {floor - 1})" if floor > held.round else ""
            log.warning("row_sparse key %r restored at round %d from shard %d: lost %d rounds of updates%s; "
                        "it goes on with round %d", key, held.round, self.image.number, floor - held.round,
                        which, floor)
        return losses

    def _log_loss(self, losses: list[int]) -> None:
        """One line: what the restart lost (dist_sync: the fewest and most rounds a key lost)."""
        image = self.image
        if not self.requests.state.sync:
            log.warning("workers aligned after the restart from shard %d: pushes this server applied "
                        "after that shard are lost (dist_async)", image.number)
            return
        fewest = min(losses, default=0)
        span = f"{fewest} to {self.lost}" if fewest != self.lost else str(self.lost)
        log.warning("workers aligned after the restart from shard %d (step %d): lost %s rounds of updates "
                    "(per key, %d keys, %d of them losing any): their values are as of the shard",
                    image.number, image.step(), span, len(losses), sum(1 for n in losses if n))

    def screen(self, msg: Message) -> set[int]:
        """The entries of a PUSH or PUSHPULL that are retries of pushes already counted (see the module
        docstring): the caller answers them without applying them."""
        rounds, keys = msg.body.get("rounds"), msg.body.get("keys")
        if rounds is None or not isinstance(keys, list):
            return set()
        origin = self.origins.get(msg.sender, 0)
        if self.requests.state.sync:
            floors = self.floors
            found = {i for i, (k, r) in enumerate(zip(keys, rounds))
                     if isinstance(k, (int, str)) and r + origin < floors.get(k, 0)}
        else:
            held = self.image.keys
            found = {i for i, (k, r) in enumerate(zip(keys, rounds)) if isinstance(k, (int, str))
                     and k in held and r + origin < held[k].applied.get(msg.sender, 0)}
        return found

    def drop(self, batch: Batch, dropped: set[int], entries: list[tuple], sizes: list[int],
             rounds: list[int] | None, pull: bool, worker: int) -> tuple[list[tuple], list[int] | None]:
        """Answer the ``dropped`` entries of ``batch`` (acks, or for a pushpull the current values);
        return the other entries and their ``rounds`` (None stays None)."""
        spans = {i: (entries[i][1], entries[i][3], entries[i][3] + sizes[i]) for i in dropped}
        if pull:
            done = self.requests.state.pull_many(worker, [((batch, i), *spans[i]) for i in sorted(dropped)])
        else:
            done = [Completion((batch, i), None) for i in sorted(dropped)]
        self.requests.reply_all(done)
        if rounds is not None:
            rounds = [r for i, r in enumerate(rounds) if i not in dropped]
        return [entry for i, entry in enumerate(entries) if i not in dropped], rounds


def die_hook(cfg: Config, rank: int, state: ShardState, shards: ShardWriter | None,
             optimizer: Callable[[], Optimizer | None] = lambda: None,
             tables: RowTables | None = None) -> Callable[[], None] | None:
    """The test hook ``KVSTORE_TEST_SERVER_DIE_AT_ROUND=N`` (or ``RANK:N``) for server ``rank``, or None
    when it is not set for this server's first incarnation with shards: a check, for the request
    loop to run after each shard tick, that SIGKILLs the server once some key has closed N rounds
    and a shard of every key it holds, of its row-sparse sets and of its optimizer has been written
    (from round N on, it makes the next tick look at the rounds and waits for a write in flight, so
    the kill comes near round N however fast the job; the first shards, taken at start, may hold no
    key or optimizer).
    ``tables``: the server's row-sparse tables, counted as keys.  Installed at start; nothing runs
    without it."""
    hook = cfg.test_server_die_at
    if hook is None or cfg.incarnation or hook[0] not in (None, rank) or shards is None:
        return None
    at = hook[1]

    def die_if_due() -> None:
        if progress_of(state, tables) < at:
            return
        held, sets = keys_of(state, tables), (0 if tables is None else tables.sets)
        if not shards.holds_all(held, optimizer(), sets):  # no shard of every key, set and the optimizer:
            shards.close(30.0)  # hurry one (a fast job would end first), the write in flight finishing
            if not shards.holds_all(held, optimizer(), sets):
                shards.look_now()
                return
        if shards.written >= 1:
            log.warning("KVSTORE_TEST_SERVER_DIE_AT_ROUND: killing server %d at step %d (SIGKILL)", rank,
                        progress_of(state, tables))
            os.kill(os.getpid(), signal.SIGKILL)
    return die_if_due

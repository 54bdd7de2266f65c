"""The server process: holds a shard of every key, serves init/push/pull, runs the optimizer.

Run it with ``python -m kvstore.server`` (``DMLC_ROLE=server`` and the other
``DMLC_*`` variables set).  It binds a port of its own (any free one), registers
with the scheduler, receives the cluster map, then serves workers until the
scheduler tells it to stop (:func:`main`).

A :class:`Server` opens nothing itself: it is built over a bound ROUTER's
:class:`~kvstore.net.router.RouterService` and the cluster map, so a unit test builds it over a
fake transport (a socket object that records what is sent) and drives its handler table.  Its
handlers hand :class:`~kvstore.server.requests.Requests`, never the server, to the key-group path,
a restart's alignment and the row-sparse handlers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Any

import numpy as np

from kvstore import config as kvconfig
from kvstore import heap, logs
from kvstore.core import precision
from kvstore.core.dtypes import BF16
from kvstore.core.groups import GroupedShardState
from kvstore.core.optimizer import Optimizer, from_spec
from kvstore.core.partition import Key, check_key
from kvstore.core.rejoin import Rejoins
from kvstore.core.shard_image import ShardImage
from kvstore.errors import (
    AuthenticationError,
    DTypeMismatchError,
    DuplicateInitError,
    KVStoreError,
    NotAMemberError,
    OptimizerError,
    ProtocolError,
    ShapeMismatchError,
    StallError,
)
from kvstore.net import address, shm, transport
from kvstore.net.auth import Channel, channel_for, new_label, server_name
from kvstore.net.handshake import register
from kvstore.net.heartbeat import Heartbeat
from kvstore.net.protocol import Message, Op
from kvstore.net.role import run_role
from kvstore.net.router import Handler, RouterService
from kvstore.net.unixlink import UnixLinks
from kvstore.server import decompress, fastpath, restore
from kvstore.server.meter import ServerMeter, record_arrivals
from kvstore.server.peakmem import PeakMemory
from kvstore.server.requests import Batch, Requests
from kvstore.server.shards import shard_writer
from kvstore.server.sparse import SparseServer

log = logging.getLogger("kvstore.server")
MB = 1 << 20
# Flow control: zmq queues at most this many messages from each worker before it stops reading that
# worker's connection, so what a server holds in messages it has not read stays about workers x
# INBOUND_MESSAGES x the largest message (a chunk, or a slice of up to 4 chunks; kvstore.core.plan).
INBOUND_MESSAGES = 8
BOUND_CONNECTIONS = 4  # connections a worker rank is bound to (its LEAVE must come from one of them)
MAX_SET = 1 << 16  # ranks an INIT's worker set may name
MEET_SHARE = 0.9  # of KVSTORE_REQUEST_TIMEOUT a worker-set init waits on a server for missing members
MEET_POLL = 0.1  # seconds between looks at that deadline while a worker-set init is open
MAX_REASON = 160  # characters of a refused pushpull's reason quoted in its round's abort error
SETTLE_POLL = 0.01  # seconds between looks at a shard write an optimizer change waits for


def _widened(msg: Message) -> tuple[Message, bool]:
    """``msg`` with a bfloat16 array widened to float32 (servers sum and update in float32), and
    whether it was bfloat16."""
    if len(msg.arrays) != 1 or msg.arrays[0].dtype != BF16:
        return msg, False
    return dataclasses.replace(msg, arrays=[precision.widen(msg.arrays[0])]), True


@dataclasses.dataclass
class SchedulerLink:
    """A server's line to the scheduler: its DEALER socket, the channel that seals for it, and the
    heartbeat thread (started)."""

    sock: Any  # a zmq DEALER (kvstore.net.transport)
    channel: Channel
    heartbeat: Heartbeat
    rebound: threading.Event = dataclasses.field(default_factory=threading.Event)  # see ServerRebind


class ServerRebind:
    """A server's side of a scheduler's restart (:class:`kvstore.net.heartbeat.Rebinder`): its identity
    for the re-registration; once a restarted scheduler took it back, ``rebound`` is set and the serving
    loop beats once on its own connection, so SHUTDOWN and AWAY reach it there."""

    def __init__(self, cfg: kvconfig.Config, rank: int, host: str, port: int, channel: Channel,
                 cmap: dict[str, Any], rebound: threading.Event) -> None:
        label = channel.label
        self._body = {"role": "server", "rank": rank, "incarnation": cfg.incarnation, "host": host,
                      "port": port, "label": label,
                      "map": {k: v for k, v in cmap.items() if k not in ("nonce", "rank", "role")}}
        self._rebound, self._channel = rebound, channel

    def identity(self) -> dict[str, Any]:
        """The server's re-registration (scheduler/recovery.py)."""
        return dict(self._body, counters=[[self._channel.label, self._channel.reserve()]])

    def paused(self) -> None:
        """Nothing to hold: workers' requests go on being served."""

    def resumed(self) -> None:
        """Make the serving loop introduce its connection to the restarted scheduler."""
        self._rebound.set()


class Server:
    """One server: the handler table over its :class:`GroupedShardState`, its optimizer and its
    row-sparse tables, served on a ROUTER's :class:`RouterService`."""

    def __init__(self, cfg: kvconfig.Config, service: RouterService, cluster: dict[str, Any],
                 image: ShardImage | None = None, meter: ServerMeter | None = None,
                 links: UnixLinks | None = None) -> None:
        """A server answering on ``service`` (over a bound ROUTER, or a fake transport's socket) in the
        cluster the scheduler's map ``cluster`` describes (its body: rank, session, mode, workers),
        restarted from ``image`` when given; ``links``: its listening Unix socket for same-host workers
        (``service``'s endpoint, kvstore.net.unixlink).  Opens nothing and starts nothing: :meth:`run` serves.
        Raises :class:`ConfigError` for an image of another job or mode."""
        rank, session = cluster["rank"], bytes(cluster["session"])
        self.cfg, self.service, self._links = cfg, service, links
        service.rank = rank
        service.channel.rename(server_name(rank, cfg.incarnation))  # workers' addressee
        service.channel.set_session(session)
        self.memory = PeakMemory()  # peak RSS, and the server's own: without its workers' segments
        self.meter = meter if meter is not None else ServerMeter("", cfg.stall_warn, cfg.stall_abort)
        self.meter.rank = rank
        self.state = GroupedShardState(cluster["num_workers"], sync=cluster["mode"] == "dist_sync",
                                       ordered=cfg.sum_order == "rank",
                                       window=cluster.get("push_window", cfg.push_window),
                                       quorum=cluster.get("sync_quorum"),
                                       staleness=cluster.get("staleness"), split=lambda t, i: (t[0], i),
                                       present=_present(cluster))
        self.state.on_close = self.meter.round_closed
        self.state.on_late = self.meter.late_push  # quorum: a push for a round already applied
        self._requests = Requests(service, self.state, self.meter)
        self._used: dict[int, list[bytes]] = {}  # worker rank -> connections of its data requests
        self._refused_left: set[int] = set()  # workers whose push after their LEAVE was logged
        self.sparse = SparseServer(self._requests)  # row-sparse keys (server/sparse.py)
        self.sparse.configure(self.state.num_workers, self.state.sync, self.state.window,
                              cluster.get("max_message_bytes", 0), cluster.get("staleness"),
                              cluster.get("sync_quorum"), ordered=cfg.sum_order == "rank")
        self.rejoins = Rejoins(self.state, self.sparse,  # restarted workers (launch.py --max-restarts)
                               restarted=image is not None)
        self.sparse.tables.on_late = self.meter.late_push  # quorum: a push for a round already applied
        self.meter.extra_held = self.sparse.nbytes
        self.meter.extra_tables = self.sparse.dynamic_stats
        self.meter.extra_stalled = lambda older_than: self.sparse.tables.stalled(older_than)
        self.shards = shard_writer(cfg, rank, session.hex())  # KVSTORE_SNAPSHOT_EVERY
        self._unsettled: list[tuple[bytes, int]] = []  # optimizer changes acknowledged once in a shard
        self._unsettled_sets: list[tuple[bytes, int, int, tuple[int, int]]] = []  # settle requests:
        # (identity, seq, sets they wait for, (worker, call))
        self.sparse.settle = self._ack_sets_when_settled
        handlers = {Op.INIT: self._on_init, Op.PUSH: self._on_push, Op.PULL: self._on_pull,
                    Op.PUSHPULL: self._on_pushpull, Op.OPTIMIZER_SET: self._on_optimizer_set,
                    Op.OPTIMIZER_PARAMS: self._on_optimizer_params,
                    Op.OPTIMIZER_INFO: self._on_optimizer_info, Op.STATE_GET: self._on_state_get,
                    Op.STATE_SET: self._on_state_set, Op.LEAVE: self._on_leave, Op.REJOIN: self._on_rejoin,
                    Op.SHM_ATTACH: self._on_shm_attach, Op.ROUND_ABORT: self._on_round_abort,
                    Op.LINK: self._on_link, **self.sparse.handlers()}
        if cfg.test_arrivals:  # tests only: the order data requests arrive in (KVSTORE_TEST_ARRIVALS)
            handlers = record_arrivals(cfg.test_arrivals, rank, handlers)
        service.handlers = {op: self._metered(op, h) for op, h in handlers.items()}
        if cfg.test_server_stall is not None:  # KVSTORE_TEST_SERVER_STALL: a busy server, tests only
            service.handlers[Op.PULL] = _stalling(service.handlers[Op.PULL], *cfg.test_server_stall)
        self.restored: restore.Restored | None = None  # a restart from its shard (server/restore.py)
        if image is not None:
            self.restored = restore.Restored(self._requests, self.rejoins, image, cluster, session.hex(),
                                             self.sparse.tables)
            service.handlers = self.restored.guard(service.handlers)
        self._between = self._housekeeping  # what the loop does between messages
        die = restore.die_hook(cfg, rank, self.state, self.shards,  # KVSTORE_TEST_SERVER_DIE_AT_ROUND
                               lambda: self._requests.optimizer, self.sparse.tables)
        if die is not None:
            def housekeeping_then_die() -> None:
                self._housekeeping()
                die()
            self._between = housekeeping_then_die

    def _metered(self, op: Op, handler: Handler) -> Handler:
        """``handler``, counting each request (bytes, its worker's last op) and each refusal."""
        name = op.name.lower()

        def counted(identity: bytes, msg: Message) -> None:
            sender = msg.sender if type(msg.sender) is int else None
            self.meter.request(sender, name, sum(a.nbytes for a in msg.arrays) if msg.arrays else 0)
            try:
                if msg.shm is not None and self.service.shm is not None:  # views of a worker's segment
                    self.service.shm.settle(identity, msg, self._segment_push_fits)
                handler(identity, msg)
            except Exception as exc:  # the service answers it; count it here
                self.meter.refused(type(exc).__name__)
                raise
        return counted

    def _abort_pulls(self, key: Key, error: StallError) -> None:
        """Answer the requests waiting on ``key``'s stalled round with ``error`` (KVSTORE_STALL_ABORT)."""
        if key in self.sparse:  # a row-sparse table's round: its waiting pulls
            for identity, seq in self.sparse.tables.drop_waiting(key):
                self.service.reply_error(identity, seq, error)
            return
        batches = {id(batch): batch for batch, _ in self.state.drop_waiting_pulls(key)}
        for batch in batches.values():
            batch.left = -1  # its other entries may complete: it is answered already
            self.service.reply_error(batch.identity, batch.seq, error)

    def _key_and_value(self, msg: Message, with_value: bool) -> tuple:
        key = check_key(msg.body.get("key"))
        self._requests.sender(msg)
        if with_value and len(msg.arrays) != 1:
            raise ProtocolError(f"{msg.op.name} of key {key!r} needs exactly one array")
        return key, (msg.arrays[0] if with_value else None)

    def _entries(self, msg: Message, with_values: bool) -> tuple[list, list, list[int], int | None]:
        """A data request's keys, values (views of its one array, or Nones), sizes and chunk offset."""
        body = msg.body
        keys, sizes, lo = body.get("keys"), body.get("sizes"), body.get("lo")
        if not (isinstance(keys, list) and keys and isinstance(sizes, list) and len(sizes) == len(keys)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)):
            raise ProtocolError(f"{msg.op.name} needs 'keys' and one size >= 0 per key")
        if lo is not None and not (isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0
                                   and len(keys) == 1):
            raise ProtocolError(f"{msg.op.name}: a chunk ('lo') carries one key and an offset >= 0")
        keys = [check_key(k) for k in keys]
        if len(keys) > 1 and len(set(keys)) != len(keys):
            raise ProtocolError(f"{msg.op.name} names a key twice")
        self._requests.sender(msg)
        if not with_values:
            if msg.arrays:
                raise ProtocolError(f"{msg.op.name} carries no arrays")
            return keys, [None] * len(keys), sizes, lo
        if len(msg.arrays) != 1 or msg.arrays[0].ndim != 1 or msg.arrays[0].size != sum(sizes):
            raise ProtocolError(f"{msg.op.name} of {len(keys)} key(s) needs one flat array of "
                                f"{sum(sizes)} elements")
        values, offset, array = [], 0, msg.arrays[0]
        for n in sizes:
            values.append(array[offset:offset + n])
            offset += n
        return keys, values, sizes, lo

    def _gradients(self, identity: bytes, msg: Message, pull: bool) -> None:
        """Push (and with ``pull`` answer with the new values) every key of a PUSH or PUSHPULL: a key
        group's batch on the group path, any other on the per-key path; a restarted server answers
        the retries of pushes its shard counts without applying them (server/restore.py)."""
        rounds = _rounds(msg)
        self._pusher(identity, msg)
        msg = decompress.expand(msg, self._held)  # a compressed push, dequantised (server/decompress.py)
        msg, bf16 = _widened(msg)
        dropped = self.restored.screen(msg) if self.restored is not None else None  # retried pushes
        try:
            if not dropped and fastpath.push(self._requests, identity, msg, pull, bf16, rounds):  # a group's
                return
            keys, values, sizes, lo = self._entries(msg, True)
            self._requests.check_precision(keys, bf16, msg.op.name)
            self._requests.check_updatable(keys[0], values[0].dtype)  # one array: one dtype
        except (ShapeMismatchError, DTypeMismatchError) as exc:
            if pull:  # a pushpull refused for its values: the round fails on every worker
                self._abort_round(msg.sender, msg.body.get("keys"), str(exc), rounds)
            raise
        batch = Batch(identity, msg.seq, len(keys), bf16)
        entries = [((batch, i), key, value, lo or 0) for i, (key, value) in enumerate(zip(keys, values))]
        if dropped:  # answered, not applied: in the restored shard already, or of a lost round
            entries, rounds = self.restored.drop(batch, dropped, entries, sizes, rounds, pull, msg.sender)
        try:
            done = self.state.push_many(msg.sender, entries, pull, rounds)
        except (ShapeMismatchError, DTypeMismatchError) as exc:
            if pull:
                self._abort_round(msg.sender, keys, str(exc), rounds)
            raise
        self._requests.reply_all(done)

    def _on_round_abort(self, identity: bytes, msg: Message) -> None:
        """A worker's pushpull of ``keys`` was refused before it was sent (a value of another shape
        or dtype, its ``reason``): abort that round of the keys (``ShardState.abort``; ``rounds``, when
        given, names it per key as a PUSH's do).  Raises, aborting nothing, :class:`ProtocolError` for a
        malformed body or a worker that has left, and :class:`KeyNotInitializedError` (or a key's type
        error) for a key not held here."""
        worker, keys, reason = self._requests.sender(msg), msg.body.get("keys"), msg.body.get("reason")
        if not (isinstance(keys, list) and keys and isinstance(reason, str)):
            raise ProtocolError("ROUND_ABORT needs 'keys' and a 'reason'")
        rounds = _rounds(msg)
        self._pusher(identity, msg)  # a worker that has left cannot abort
        for key in keys:  # each one held here (as a PUSH's), or nothing is aborted
            self.state.value(check_key(key))
        self.service.reply(identity, Message(Op.OK, seq=msg.seq))
        self._abort_round(worker, keys, reason, rounds)

    def _abort_round(self, worker: Any, keys: Any, reason: str, rounds: list[int] | None = None) -> None:
        """Abort ``worker``'s round of ``keys`` (those held here, dist_sync; ``rounds``: the round of
        each, or None) and answer the requests waiting on it with the error; a malformed worker or key
        list aborts nothing."""
        if not (type(worker) is int and worker in self.state.active and isinstance(keys, list)):
            return
        if rounds is not None and len(rounds) != len(keys):
            rounds = None
        try:
            checked = [check_key(k) for k in keys]
        except KVStoreError:
            return
        held = [i for i, k in enumerate(checked) if k in self.state]
        done = self.state.abort(worker, [checked[i] for i in held], reason[:MAX_REASON],
                                None if rounds is None else [rounds[i] for i in held])
        held = [checked[i] for i in held]
        if held and self.state.sync:
            log.warning("worker %d's pushpull of key %r%s was refused (%s): its round was aborted, %d "
                        "waiting request(s) failed", worker, held[0],
                        f" and {len(held) - 1} more" if len(held) > 1 else "", reason[:MAX_REASON], len(done))
        self._requests.reply_all(done)

    def _held(self, key: Key) -> int:
        """The elements this server holds of ``key``; raises KeyNotInitializedError."""
        return self.state.value(key).size

    def _pusher(self, identity: bytes, msg: Message) -> None:
        """Bind the push's worker rank to its connection (:meth:`_bind`); refuse (ProtocolError, one
        log line) a push of a worker that has left."""
        worker = msg.sender
        if not (type(worker) is int and 0 <= worker < self.state.num_workers):
            return  # refused as such by the checks that follow
        if worker not in self.state.active:
            if worker not in self._refused_left:
                self._refused_left.add(worker)
                log.warning("refused a %s of worker %d, which has left (logged once)", msg.op.name, worker)
            raise ProtocolError(f"worker {worker} has left the cluster (this server took its LEAVE); "
                                "it cannot push")
        self._bind(worker, identity)

    def _bind(self, worker: Any, identity: bytes) -> None:
        """Remember ``identity`` among the connections worker rank ``worker`` sent data requests on
        (its last ``BOUND_CONNECTIONS``): a LEAVE for it must come from one of them."""
        used = self._used.get(worker)
        if used is not None and used[-1] == identity:
            return  # the common case: the same connection as last time
        if not (type(worker) is int and 0 <= worker < self.state.num_workers):
            return
        used = [c for c in (used or []) if c != identity][-(BOUND_CONNECTIONS - 1):]
        used.append(identity)
        self._used[worker] = used

    def _need_optimizer(self, what: str) -> Optimizer:
        optimizer = self._requests.optimizer
        if optimizer is None:
            raise OptimizerError(f"{what}: no optimizer is set on this server (call set_optimizer)")
        return optimizer

    def _on_init(self, identity: bytes, msg: Message) -> None:
        """Store the first values of an INIT's keys (``workers``: of that worker set), or, with
        ``meet``, take a worker set's init rendezvous (answered once every member present has met:
        docs/worker-sets.md)."""
        self._bind(msg.sender, identity)
        members = _members(msg.body)
        if "meet" in msg.body:
            self._on_meet(identity, msg, members)
            return
        msg, bf16 = _widened(msg)  # a bfloat16 key is held as a float32 master copy
        keys, values, _, lo = self._entries(msg, True)
        if lo is not None:  # a chunk: the key is stored with its last chunk
            total = msg.body.get("total")
            if not (isinstance(total, int) and not isinstance(total, bool) and total > 0):
                raise ProtocolError("an INIT chunk ('lo') needs the slice's element count 'total' > 0")
            stored = self.state.init_chunk(msg.sender, keys[0], values[0], lo, total, members)
            if stored:
                self._requests.mark_precision(keys, bf16)
                log.debug("key %r initialised from its chunks", keys[0])
            self.service.reply(identity, Message(Op.OK, seq=msg.seq))
            if stored and members is not None:
                self._requests.reply_all(self.state.met(keys[0]))
            return
        if len(set(keys)) != len(keys):
            raise ProtocolError("INIT names a key twice")
        for key in keys:
            if key in self.state:
                raise DuplicateInitError(f"key {key!r} is already initialised on this server")
        if members is not None:
            self.state.check_members(keys[0], members)  # raises before anything is stored
            if msg.sender not in members:
                raise NotAMemberError(f"worker {msg.sender} is not in worker set {members} of key "
                                      f"{keys[0]!r}: only its members may init it (refused, nothing changed)")
        for key, value in zip(keys, values):
            self.state.init(key, value, members)
        self._requests.mark_precision(keys, bf16)
        self.service.reply(identity, Message(Op.OK, seq=msg.seq))
        if members is not None:
            for key in keys:
                self._requests.reply_all(self.state.met(key))

    def _on_meet(self, identity: bytes, msg: Message, members: list[int] | None) -> None:
        """A member's init rendezvous of a worker set's keys (``meet``: one digest per key); each key's
        entry is answered by :meth:`ShardState.meet` once the rendezvous completes."""
        keys, _, _, _ = self._entries(msg, False)
        digests = msg.body.get("meet")
        if members is None or not (isinstance(digests, list) and len(digests) == len(keys)
                                   and all(isinstance(d, str) for d in digests)):
            raise ProtocolError("an INIT rendezvous ('meet') carries 'workers' and one digest per key")
        batch = Batch(identity, msg.seq, len(keys))
        done = []
        for i, (key, digest) in enumerate(zip(keys, digests)):
            done += self.state.meet((batch, i), msg.sender, key, members, digest)
        self._requests.reply_all(done)

    def _on_shm_attach(self, identity: bytes, msg: Message) -> None:
        """Map the worker's offered segment (``kvstore.net.shm``); reply whether that worked, and why not."""
        peers = self.service.shm
        attached, why = (False, shm.unusable(self.cfg)) if peers is None else peers.attach(identity, msg.body)
        self.service.reply(identity, Message(Op.OK, {"attached": attached, "why": why}, seq=msg.seq))

    def _on_link(self, identity: bytes, msg: Message) -> None:
        """A same-host worker's Unix-socket link (kvstore.net.unixlink): over zmq, where to connect and
        the token; over the new link, the token, which binds it to the worker.  Raises ProtocolError
        for a token not offered, or one sent over zmq (nothing changed)."""
        links = self._links
        if "token" not in msg.body:
            body = links.offer(identity) if links is not None else \
                {"address": None, "why": "KVSTORE_UNIX_LINKS=0 or KVSTORE_ENCRYPT on this server"}
            self.service.reply(identity, Message(Op.OK, body, seq=msg.seq))
            return
        if links is None or not links.is_pseudo(identity) or not links.bind(identity, msg.body["token"]):
            raise ProtocolError("LINK: a token this server did not offer, or not over a new link")
        self.service.reply(identity, Message(Op.OK, {"bound": True}, seq=msg.seq))

    def _segment_push_fits(self, msg: Message) -> None:
        """Before the arrays a request has in a worker's segment are copied out: a PUSH or PUSHPULL
        must name keys held here and declare no more bytes than they hold (a push declaring 1 GiB for
        a 4 KiB key is refused before a page of it is read).  Raises what the push itself would
        (:class:`ProtocolError`, :class:`KeyNotInitializedError`, a key's type error)."""
        if msg.op is not Op.PUSH and msg.op is not Op.PUSHPULL:
            return  # other requests' arrays are bounded by the frame limit alone, as on TCP
        keys = msg.body.get("keys")
        if not (isinstance(keys, list) and keys):
            raise ProtocolError(f"{msg.op.name} needs 'keys'")
        held = sum(self.state.value(check_key(key)).nbytes for key in keys)
        declared = sum(array.nbytes for array, off in zip(msg.arrays, msg.shm or []) if off is not None)
        if declared > held:
            raise ProtocolError(f"{msg.op.name} declares {declared} bytes in shared memory for "
                                f"{len(keys)} key(s) holding {held} here")

    def _on_push(self, identity: bytes, msg: Message) -> None:
        self._gradients(identity, msg, pull=False)

    def _on_pull(self, identity: bytes, msg: Message) -> None:
        self._bind(msg.sender, identity)
        if fastpath.pull(self._requests, identity, msg):  # a batch of a key group
            return
        keys, _, sizes, lo = self._entries(msg, False)
        batch = Batch(identity, msg.seq, len(keys), keys[0] in self._requests.bf16_keys)  # one dtype
        start = lo or 0
        entries = [((batch, i), key, start, start + size) for i, (key, size) in enumerate(zip(keys, sizes))]
        # without a chunk offset each size must be the key's whole slice: the reply is cut by them
        self._requests.reply_all(self.state.pull_many(msg.sender, entries, whole=lo is None))

    def _on_pushpull(self, identity: bytes, msg: Message) -> None:
        self._gradients(identity, msg, pull=True)

    def _on_leave(self, identity: bytes, msg: Message) -> None:
        """A worker is done.  It sends this after its pushes, on the same connection, so every one of
        them has been taken in; sync rounds stop waiting for it from now on."""
        if not (isinstance(msg.sender, int) and 0 <= msg.sender < self.state.num_workers):
            raise ProtocolError(f"LEAVE carries no valid worker rank (got {msg.sender!r})")
        used = self._used.get(msg.sender)
        if used is not None and identity not in used:
            log.warning("refused a LEAVE for worker %d from a connection it sent no data on", msg.sender)
            raise ProtocolError(f"LEAVE for worker {msg.sender} refused: it comes from another "
                                "connection than that worker's data requests")
        done = self.state.leave(msg.sender)
        self.service.reply(identity, Message(Op.OK, seq=msg.seq))
        self._requests.reply_all(done)
        self.sparse.leave(msg.sender)
        if self.restored is not None:
            self.restored.forget(msg.sender)
        if self.service.shm is not None:
            self.service.shm.forget(identity)  # its shared-memory segment, if it had one
        log.info("worker %d left; sync rounds no longer wait for it", msg.sender)

    def _on_rejoin(self, identity: bytes, msg: Message) -> None:
        """A restarted worker (a new incarnation of its rank) counts again: first from the round no key
        has opened here (replied as ``round``, with the ``step`` it learns, core/rejoin.py), then, with
        ``at``, from that round of every key."""
        worker, body = self._requests.sender(msg), msg.body
        self._bind(worker, identity)  # its new incarnation's connection
        if "at" not in body:
            joining = bool(body.get("join"))
            first, done = self.rejoins.begin(worker, body.get("incarnation"), joining)
            reply = {"round": first, "step": self.rejoins.step(first, joining)}
            self.service.reply(identity, Message(Op.OK, reply, seq=msg.seq))
        else:
            done = self.rejoins.join_at(worker, body.get("incarnation"), body.get("at"),
                                        bool(body.get("join")))
            if self.restored is not None:  # its pushes count from round ``at`` now
                self.restored.rejoined(worker, body["at"])
            self.service.reply(identity, Message(Op.OK, seq=msg.seq))
            log.warning("worker %d %s (incarnation %s) at round %d", worker,
                        "joined" if body.get("join") else "rejoined", body["incarnation"], body["at"])
        self._requests.reply_all(done)

    def _on_away(self, body: dict) -> None:
        """The scheduler's AWAY: a lost worker will be restarted; rounds close without it meanwhile."""
        worker = body.get("worker")
        if not (type(worker) is int and 0 <= worker < self.state.num_workers):
            raise ProtocolError(f"AWAY names no worker rank (got {str(worker)[:20]!r})")
        self._requests.reply_all(self.rejoins.away(worker, body.get("incarnation")))
        if self.restored is not None:
            self.restored.forget(worker)
        log.warning("worker %d is away (to be restarted): sync rounds close without it, scaled as a "
                    "quorum of the rest, until it rejoins", worker)

    def _on_optimizer_set(self, identity: bytes, msg: Message) -> None:
        num_update = msg.body.get("num_update", 0)
        if not (isinstance(num_update, int) and num_update >= 0):
            raise ProtocolError("OPTIMIZER_SET's num_update must be an int >= 0")
        optimizer = from_spec(msg.body.get("spec"))  # raises before anything changes
        optimizer.num_update = max(optimizer.num_update, num_update)
        self._requests.set_optimizer(optimizer)
        self.state.drop_staged_states()  # chunks of states of the optimizer it replaces
        log.info("optimizer set: %s", optimizer.spec()["name"])
        self._ack_when_settled(identity, msg)

    def _on_optimizer_params(self, identity: bytes, msg: Message) -> None:
        params = msg.body.get("params")
        if not (isinstance(params, dict) and all(isinstance(name, str) for name in params)):
            raise ProtocolError("OPTIMIZER_PARAMS needs a map of parameter names to values")
        self._need_optimizer("changing optimizer parameters").set_params(**params)
        self.service.reply(identity, Message(Op.OK, seq=msg.seq))  # not waiting: a schedule sends one a step

    def _ack_when_settled(self, identity: bytes, msg: Message) -> None:
        """Acknowledge a new optimizer now, or, with shards, once a shard holding it is written: a
        restart from an earlier shard would apply the old one (or none) silently; unanswered, it is sent
        again after the restart (kvstore/server/restore.py) instead.  A change of hyper-parameters is
        answered at once (a learning-rate schedule sends one a step, a shard write would hold each)."""
        if self.shards is None:
            self.service.reply(identity, Message(Op.OK, seq=msg.seq))
        else:
            self._unsettled.append((identity, msg.seq))

    def _ack_sets_when_settled(self, identity: bytes, seq: int, sets: int, call: tuple[int, int]) -> None:
        """Answer a settle request (the end of an init's or load's SPARSE_SETs, server/sparse.py) now,
        or, with shards, once a shard holding the first ``sets`` sets is written (due at once): a
        restart from an earlier shard would bring back the rows or states they overwrote silently;
        unanswered, it is sent again after the restart, whose shard says which of its sets it holds."""
        if self.shards is None:
            self.sparse.tables.calls.pop(call, None)
            self.service.reply(identity, Message(Op.OK, seq=seq))
        else:
            self.shards.want_sets(sets)
            self._unsettled_sets.append((identity, seq, sets, call))

    def _on_optimizer_info(self, identity: bytes, msg: Message) -> None:
        opt = self._requests.optimizer
        body = {"spec": None, "num_update": 0} if opt is None else {"spec": opt.spec(),
                                                                    "num_update": opt.num_update}
        self.service.reply(identity, Message(Op.OK, body, seq=msg.seq))

    def _on_state_get(self, identity: bytes, msg: Message) -> None:
        key, _ = self._key_and_value(msg, False)
        self.state.value(key)  # the key must be held here
        found = self._need_optimizer(f"reading the optimizer state of key {key!r}").get_state(key)
        count, arrays = found if found is not None else (0, {})
        self.service.reply(identity, Message(Op.OK, {"count": count, "names": list(arrays)},
                                             arrays=list(arrays.values()), seq=msg.seq))

    def _on_state_set(self, identity: bytes, msg: Message) -> None:
        key, _ = self._key_and_value(msg, False)
        count, names = msg.body.get("count"), msg.body.get("names")
        if not (isinstance(count, int) and count >= 0 and isinstance(names, list)
                and len(names) == len(msg.arrays) and all(isinstance(n, str) for n in names)):
            raise ProtocolError(f"STATE_SET of key {key!r} needs a count >= 0 and one name per array")
        opt = self._need_optimizer(f"setting the optimizer state of key {key!r}")
        call = None
        if "call" in msg.body:  # one of a load's sets, settled at its end (server/sparse.py)
            call = (self._requests.sender(msg), _field(msg.body, "call"), _field(msg.body, "part"))
        arrays: list[np.ndarray] | None = list(msg.arrays)
        lo = msg.body.get("lo")
        if lo is not None:  # a chunk: the state is checked and installed with its last chunk
            if not (isinstance(lo, int) and not isinstance(lo, bool) and lo >= 0):
                raise ProtocolError(f"STATE_SET of key {key!r}: 'lo' must be an offset >= 0")
            arrays = self.state.state_chunk(msg.sender, key, arrays, lo, (count, tuple(names)))
        if arrays is not None:
            opt.set_state(key, self.state.value(key), count, dict(zip(names, arrays)))
        self.sparse.tables.note_set(call)  # a shard is due: a restart would bring back the state before
        self.service.reply(identity, Message(Op.OK, seq=msg.seq))

    def run(self, scheduler: SchedulerLink) -> int:
        """Serve until the scheduler says SHUTDOWN (0) or is lost (1); return the exit code.  Closes
        the ROUTER and ``scheduler``'s socket, and stops its heartbeat, on the way out."""
        poller = transport.Poller()
        poller.add(self.service.sock)
        poller.add(scheduler.sock)
        links = self._links
        if links is not None:
            links.poller = poller
            poller.add(links.listener)
        try:
            while True:
                lost = scheduler.heartbeat.lost
                if lost is not None:
                    log.error("exiting: %s", lost)
                    return 1
                if scheduler.rebound.is_set():  # a restarted scheduler: SHUTDOWN and AWAY come on this link
                    scheduler.rebound.clear()
                    rank = self.service.rank
                    beat = Message(Op.HEARTBEAT, {"role": "server", "rank": rank}, sender=rank)
                    transport.send(scheduler.sock, scheduler.channel.seal(beat, "scheduler"))
                unsettled = self._unsettled or self._unsettled_sets
                idle = min(self.cfg.heartbeat_interval, MEET_POLL) if self.state.rendezvous else \
                    self.cfg.heartbeat_interval  # a worker-set init's deadline is watched
                ready = poller.wait(0 if links is not None and links.pending else
                                    SETTLE_POLL if unsettled else idle)
                if links is not None:
                    for obj in ready:
                        links.ready(obj)  # accepts, reads, flushes replies; ignores the zmq sockets
                    links.tick()
                if self.service.sock in ready or (links is not None and links.pending):
                    self.service.drain(256)  # what is waiting, bounded: the scheduler is heard too
                if scheduler.sock in ready and self._from_scheduler(scheduler):
                    return 0
                self._between()
        finally:
            if self.shards is not None:
                self.shards.close(self.cfg.shutdown_timeout)
            scheduler.heartbeat.stop()
            if links is not None:
                links.close_links()
            transport.close(self.service.sock)
            transport.close(scheduler.sock, linger=1.0)

    def _housekeeping(self) -> None:
        """Between messages: the rounds' stall inspector, rejoined workers forgotten once every key is
        past their first round (ShardState.retire_joins), worker-set inits whose members did not all
        come in time failed, the segments of peers that are gone unmapped, and a shard when one is due."""
        self.meter.tick(self.state, self._abort_pulls, self.service.drops.totals)
        if self.state.retirable:  # empty but once every key is past a rejoined worker's first round
            for worker in self.state.retire_joins(self.rejoins.begun):
                log.info("worker %d's rejoin is complete on every key: the key groups serve again", worker)
        if self.state.rendezvous:  # answered before the members' own deadline (KVSTORE_REQUEST_TIMEOUT)
            self._requests.reply_all(self.state.expire_meets(self.cfg.request_timeout * MEET_SHARE))
        gone = self.service.shm.sweep() if self.service.shm is not None else 0
        if gone:
            log.info("unmapped the shared-memory segment(s) of %d peer process(es) that are gone", gone)
        if self.shards is not None:
            self.shards.tick(self.state, self._requests.optimizer, self._requests.bf16_keys,
                             self.sparse.tables)
            if self._unsettled and self.shards.settled(self._requests.optimizer):
                for identity, seq in self._unsettled:
                    self.service.reply(identity, Message(Op.OK, seq=seq))
                self._unsettled = []
            if self._unsettled_sets:
                waiting = []
                for identity, seq, sets, call in self._unsettled_sets:
                    if self.shards.sets_settled(sets):  # the call's record is in that shard: forgotten
                        self.sparse.tables.calls.pop(call, None)
                        self.service.reply(identity, Message(Op.OK, seq=seq))
                    else:
                        waiting.append((identity, seq, sets, call))
                self._unsettled_sets = waiting

    def _from_scheduler(self, scheduler: SchedulerLink) -> bool:
        """Handle one message from the scheduler; True when it is SHUTDOWN (after confirming it)."""
        try:
            msg = scheduler.channel.open(transport.recv(scheduler.sock))
        except (AuthenticationError, ProtocolError) as exc:
            log.warning("dropped a bad message from the scheduler: %s", exc)
            return False
        if msg.op is Op.SHUTDOWN:
            scheduler.heartbeat.stop()  # its last beat (this server's final counters) is read first,
            scheduler.heartbeat.join(self.cfg.shutdown_timeout)  # so STATUS has them when we confirm
            transport.send(scheduler.sock, scheduler.channel.seal(Message(Op.OK, seq=msg.seq), "scheduler"))
            total, own = self.memory.report()
            log.info("shut down by the scheduler: %d keys, %.1f MB held, peak RSS %.1f MB, own %.1f MB",
                     len(self.state) + len(self.sparse.tables),
                     (self.state.nbytes() + self.sparse.nbytes()) / MB, total / MB, own / MB)
            return True
        if msg.op is Op.AWAY:
            try:
                self._on_away(msg.body)
            except (ProtocolError, ValueError) as exc:
                log.warning("dropped a bad AWAY from the scheduler: %s", exc)
            return False
        if msg.op is not Op.OK:  # OK: the answer to the beat that introduced this link to a restart
            log.warning("ignored %s from the scheduler", msg.op.name)
        return False


def _stalling(handler: Handler, nth: int, seconds: float) -> Handler:
    """``handler``, blocking the request loop for ``seconds`` before the ``nth`` request it handles
    (``KVSTORE_TEST_SERVER_STALL``: a server busy in Python, e.g. in a long optimizer step)."""
    count = itertools.count(1)

    def stalled(identity: bytes, msg: Message) -> None:
        if next(count) == nth:
            log.warning("KVSTORE_TEST_SERVER_STALL: the request loop blocks for %g s", seconds)
            time.sleep(seconds)
        handler(identity, msg)
    return stalled


def _present(cluster: dict) -> list[int] | None:
    """The worker slots present in the map ``cluster`` (all but its ``absent``: an elastic job's,
    docs/elastic.md); None when every slot is."""
    absent = cluster.get("absent")
    if not absent:
        return None
    return [w for w in range(cluster["num_workers"]) if w not in set(absent)]


def _members(body: dict) -> list[int] | None:
    """An INIT's worker set (``workers``), or None: every worker.  Raises ProtocolError if malformed."""
    found = body.get("workers")
    if found is None:
        return None
    if not (isinstance(found, list) and found and len(found) <= MAX_SET
            and all(type(w) is int for w in found)):
        raise ProtocolError(f"an INIT's 'workers' is a list of 1 to {MAX_SET} worker ranks")
    return sorted(set(found))


def _field(body: dict, name: str) -> int:
    """Int field ``name`` of ``body`` in [0, 2**63); ProtocolError otherwise."""
    value = body.get(name)
    if type(value) is not int or not 0 <= value < 2**63:
        raise ProtocolError(f"field {name!r} must be an int in [0, 2**63), not {str(value)[:40]!r}")
    return value


def _rounds(msg: Message) -> list[int] | None:
    """A PUSH's or PUSHPULL's ``rounds`` (the worker's round of each key; a quorum's pushes carry
    them), or None.  Raises :class:`ProtocolError` for rounds that are not one int >= 0 per key."""
    rounds, keys = msg.body.get("rounds"), msg.body.get("keys")
    if rounds is not None and not (isinstance(rounds, list) and isinstance(keys, list)
                                   and len(rounds) == len(keys)
                                   and all(type(r) is int and r >= 0 for r in rounds)):
        raise ProtocolError(f"{msg.op.name}: 'rounds' must hold one round >= 0 per key")
    return rounds


def _serve(cfg: kvconfig.Config) -> int:
    """Bind, register with the scheduler, then serve as :class:`Server` until told to stop."""
    heap.tune(cfg.malloc_tune)
    cfg.require_cluster("a server")
    host = address.node_host(cfg)
    address.check_bind(cfg, host, "a server")
    sock, port = transport.bind_router(host, cfg.node_port, inbound=INBOUND_MESSAGES,
                                       max_frame_bytes=cfg.max_message_bytes, curve=transport.curve_keys(cfg))
    service = RouterService(sock, channel_for(cfg, "server"))  # renamed server{rank} by the Server
    to_scheduler = transport.connect_dealer(cfg.root_address, curve=transport.curve_keys(cfg))
    channel = channel_for(cfg, new_label("server"))
    image = restore.read_image(cfg)  # a restarted server's shard, read before it registers
    cmap = register(to_scheduler, channel, cfg, {"role": "server", "host": host, "port": port,
                                                 "rank": cfg.server_id, "incarnation": cfg.incarnation},
                    "server")
    kvconfig.check_node_limit(cfg.max_message_bytes, cmap.body.get("max_message_bytes", 0))
    rank = cmap.body["rank"]
    meter = ServerMeter(host, cfg.stall_warn, cfg.stall_abort)
    meter.rank = rank
    rebound = threading.Event()
    heartbeat = Heartbeat(cfg, "server", rank, cmap.body["session"], lambda error: None,
                          report_peers=False, stats=meter.snapshot,
                          rebinder=ServerRebind(cfg, rank, host, port, channel, cmap.body, rebound))
    heartbeat.start()  # beating while a restarted server installs its shard
    links = None
    if cfg.unix_links and not cfg.encrypt:  # same-host workers' links (kvstore.net.unixlink)
        try:
            links = UnixLinks(service.endpoint, cfg.max_message_bytes, inbound=INBOUND_MESSAGES)
            service.endpoint = links
        except OSError as exc:
            log.warning("no Unix-socket links for same-host workers: %s", exc)
    server = Server(cfg, service, cmap.body, image, meter, links)
    if not shm.unusable(cfg):  # workers on this host may offer segments
        service.shm = shm.ServerPeers(server.memory.checkpoint, cfg.max_message_bytes)
    logs.set_identity("server", rank)
    log.info("serving on %s:%d in %s mode", host, port, cmap.body["mode"])
    return server.run(SchedulerLink(to_scheduler, channel, heartbeat, rebound))


def main() -> int:
    """Entry point of ``python -m kvstore.server``."""
    return run_role("server", _serve, rank=lambda cfg: cfg.server_id)


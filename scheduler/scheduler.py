"""The scheduler process: rendezvous, barriers, liveness and orderly shutdown.

After the rendezvous every node heartbeats here from a thread of its own.  A node
silent for ``KVSTORE_HEARTBEAT_TIMEOUT`` is declared lost: every heartbeat reply
from then on names it (so every worker raises :class:`NodeLostError`), waiting
barriers are released with that error, and the scheduler exits 1 once the
workers are gone.  A worker that leaves (LEAVE) stops counting toward barriers
(it has told the servers itself, after its pushes, so sync rounds stop waiting).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import secrets
import time
from typing import Any

from kvstore import config as kvconfig
from kvstore.core import stats as kvstats
from kvstore.core.membership import MAX_TAG
from kvstore.errors import (
    AuthenticationError,
    ConfigError,
    DeadlineExceededError,
    KVStoreError,
    NodeLostError,
    ProtocolError,
    SchedulerRebuildingError,
    StallError,
    TooFewWorkersError,
)
from kvstore.launch.portfile import write as write_port_file
from kvstore.net import address, timeline, transport
from kvstore.net.auth import Channel, channel_for, sender_label
from kvstore.net.heartbeat import lost_error
from kvstore.net.protocol import Message, Op
from kvstore.net.role import run_role
from kvstore.net.router import OVER_RATE, Handler, LateHandler, RouterService, RouterSocket
from kvstore.net.status_client import poll_session

from .extension import SchedulerAPI
from .observe import PollGate, SchedulerStats, node_rows, scheduler_snapshot
from .pipes import PipesExtension
from .recovery import Rebound, Recovery, die_hook, own_counters, parse, read_digest, write_digest
from .restarts import RestartsExtension
from .state import Barrier, Challenges, Liveness, Node, Rendezvous, hello_nonce, mixed_calls

log = logging.getLogger("scheduler")
# zmq queues at most this many unread messages from each peer, then stops reading its connection and
# TCP holds the sender back: a flood costs the scheduler little memory (a node sends it a few
# messages at a time: registration, a barrier, its heartbeats).
INBOUND_MESSAGES = 64


def _quorum(value: object) -> int | None:
    """A REGISTER's ``quorum`` (None, or an int); raise :class:`ProtocolError` for anything else."""
    if value is None or (type(value) is int and value >= 1):
        return value  # type: ignore[return-value]
    raise ProtocolError(f"REGISTER's quorum must be an int >= 1 or absent, not {str(value)[:40]!r}")


STATUS_LINGER = 2.5  # seconds the scheduler waits at exit for a STATUS poller's last request
# ... and for a poller that follows the job (the TensorBoard writer, which asks every second and says
# "follow"), however long since its last request: a loaded driver's late poll still gets the last
# interval's figures; a follower that died costs the exit this much
FOLLOW_LINGER = 10.0



def map_settings(cfg: kvconfig.Config) -> dict[str, Any]:
    """The cluster map's fields set by the scheduler's own configuration (the same in a restarted
    scheduler, which takes them from here rather than from a member's map)."""
    return {"chunk_bytes": cfg.chunk_bytes,  # one chunk size for all: servers check boundaries
            "max_message_bytes": cfg.max_message_bytes,  # every frame a worker sends fits
            "push_window": cfg.push_window,  # one window for all: servers refuse beyond it
            "staleness": cfg.staleness}

class Scheduler:
    """Rendezvous of every node, worker barriers, and shutdown once every worker has left.

    Its features (:mod:`.restarts`, :mod:`.pipes`) are extensions: each is built with a
    :class:`SchedulerAPI` and registers its own handlers.  ``endpoint`` replaces the bound zmq ROUTER
    (a unit test's :class:`kvstore.net.inproc.InProcRouter`: no socket; ``port`` is then 0).
    """

    def __init__(self, cfg: kvconfig.Config, endpoint: RouterSocket | None = None) -> None:
        cfg.require_cluster("the scheduler")
        self.cfg = cfg
        # every worker cuts its messages by this map's chunk size, under this map's limit
        kvconfig.check_message_limits(cfg.max_message_bytes, cfg.chunk_bytes, cfg.batch_bytes)
        sock, self.port = None, 0
        if endpoint is None:
            host = address.bind_host(cfg.root_uri)
            address.check_bind(cfg, host, "the scheduler")
            sock, self.port = transport.bind_router(host, cfg.root_port, inbound=INBOUND_MESSAGES,
                                                    max_frame_bytes=cfg.max_message_bytes,
                                                    curve=transport.curve_keys(cfg))
        self.service = RouterService(sock, self._own_channel(), endpoint=endpoint)
        self.session = secrets.token_bytes(16)  # keys every message once the map is out
        self._recovery = self._recovery_of(cfg)  # a restarted scheduler's rebuild (scheduler/recovery.py)
        self._labels: dict[str, tuple[str, int]] = {}  # a node's request label -> (role, rank)
        self._deferred: list[tuple[bytes, Message]] = []  # barriers and leaves while rebuilding
        self.challenges = Challenges()  # HELLO's nonce and challenge per connection, until it registers
        present = _present(cfg)  # an elastic job's slots beyond it start absent (docs/elastic.md)
        self.rendezvous = Rendezvous(present, cfg.num_servers)
        self.barrier = Barrier(present)
        self.worker_ranks: dict[bytes, int] = {}
        self.left: set[int] = set(range(present, cfg.num_workers))  # absent slots count as left
        self._view: dict | None = None  # the last tagged membership view released (docs/elastic.md)
        self.servers: list[Node] = []
        self.service.handlers = {Op.HELLO: self._on_hello, Op.REGISTER: self._on_register,
                                 Op.BARRIER: self._on_barrier,
                                 Op.LEAVE: self._deferring(self._on_leave), Op.OK: self._on_server_stopped,
                                 Op.HEARTBEAT: self._on_heartbeat, Op.STATUS: self._on_status}
        # kvstore.status holds the secret, not the session: a STATUS sealed with the secret alone gets
        # the session (net/status_client.py), one sealed with its poll key the status, within a rate
        self.service.late_handlers = {Op.STATUS: lambda _, msg: self._session_offer()}
        self.service.polled = self._own_channel("polled")
        self.service.polled.set_session(poll_session(self.session))
        self.service.polled_handlers = {Op.STATUS: self._polled_status}
        self._pollers = PollGate()
        api = SchedulerAPI(
            cfg=cfg, challenges=self.challenges, handle=self._serve, handle_late=self._serve_late,
            reply=self.service.reply, worker_rank=self._worker_rank, mode=lambda: self.mode,
            lost=lambda: list(self.lost), live_servers=self._live_servers,
            declare_lost=lambda role, rank, why: self._declare_lost(role, rank, why, absorb=False),
            away=self._away, rejoin=self._admit)
        self._pipes = PipesExtension(api)  # pipeline sockets (docs/pipeline.md)
        self.restarts = RestartsExtension(api, self._pipes)  # KVSTORE_MAX_RESTARTS (scheduler/restarts.py)
        late_register = self.service.late_handlers.get(Op.REGISTER)
        if late_register is not None:  # a node re-registering after a scheduler's restart comes late too
            self.service.late_handlers[Op.REGISTER] = functools.partial(self._on_late_register, late_register)
        self.map_body: dict = {}  # the map every node got, but its own fields (a restart gets it too)
        self.status_asks = 0  # STATUS requests answered, and when the last came (monotonic)
        self.status_at = -math.inf
        self._followed = False  # a poller that follows the job asked (see _linger_for_status)
        self.stats = SchedulerStats(time.monotonic(), time.time())
        self.mode: str | None = None  # the cluster's, once the map is out
        self.map_at: float | None = None  # when the map went out (monotonic)
        self._refusals_logged: set[tuple[str, int]] = set()  # nodes whose bad snapshot was logged
        self.stalled: set[int] = set()  # workers whose barrier KVSTORE_STALL_ABORT failed (not released)
        self.liveness = Liveness(cfg.heartbeat_timeout)
        self.hosts: dict[tuple[str, int], str] = {}  # (role, rank) -> host
        self.lost: list[list] = []  # [role, rank, host, why] of every node declared lost
        self.stopped_servers: set[bytes] = set()
        self.map_sent = False
        self.failed: str | None = None
        self.timeline = timeline.recorder("scheduler", lambda: 0)  # KVSTORE_TIMELINE, else None
        self._started = time.monotonic()
        self._die = die_hook(cfg.test_scheduler_die_at, cfg.incarnation,  # KVSTORE_TEST_SCHEDULER_DIE_AT
                             lambda: self.barrier.generation + 1 if self.barrier.waiting else None)

    def _on_late_register(self, restart: LateHandler, identity: bytes, msg: Message) -> Message:
        """A REGISTER sealed without the session after the map: a live node taking its place back
        (:meth:`_reregister`), else a restarted node's (``restart``: the restarts extension's), which a
        restarted scheduler refuses while it rebuilds the cluster."""
        if "session" not in msg.body:
            if self._recovery is not None and not self.map_sent:
                raise SchedulerRebuildingError("the restarted scheduler is still rebuilding the cluster from "
                                               "its nodes' re-registrations; a new node cannot join yet")
            return restart(identity, msg)
        self.challenges.check(identity, msg.body.get("challenge"))
        cmap = self._reregister(identity, msg.body, sender_label(msg))
        return Message(Op.MAP, dict(cmap, nonce=self.challenges.take(identity)))

    def _own_channel(self, kind: str = "") -> Channel:
        """A channel addressed as ``scheduler`` that sends as ``scheduler`` (``scheduler.N`` in the N-th
        restart, and ``scheduler.N.KIND`` for its late and polled channels: their message numbers start
        afresh, and nodes have seen the old ones')."""
        channel = channel_for(self.cfg, "scheduler")
        if self.cfg.incarnation:
            channel.label = ".".join(filter(None, ("scheduler", str(self.cfg.incarnation), kind)))
        return channel

    @staticmethod
    def _recovery_of(cfg: kvconfig.Config) -> Recovery | None:
        """A restarted scheduler's :class:`Recovery` (None in a first incarnation).  Raises ConfigError
        without the first incarnation's session digest next to ``KVSTORE_PORT_FILE``."""
        if not cfg.incarnation:
            return None
        digest = read_digest(cfg.port_file) if cfg.port_file else None
        if digest is None:
            raise ConfigError("a restarted scheduler (KVSTORE_INCARNATION > 0) needs its first incarnation's "
                              "session digest next to KVSTORE_PORT_FILE: only launch.py restarts a scheduler")
        return Recovery(cfg.num_workers, cfg.num_servers, digest, cfg.recover_left, cfg.restarts_used,
                        settings=map_settings(cfg))

    def _deferring(self, handler: Handler) -> Handler:
        """``handler``, but held back while a restarted scheduler rebuilds the cluster (then run)."""
        def deferred(identity: bytes, msg: Message) -> None:
            if self._recovery is not None and not self.map_sent:
                self._deferred.append((identity, msg))
                return
            handler(identity, msg)
        return deferred

    def _serve(self, op: Op, handler: Handler) -> None:
        """Serve ``op`` from registered nodes with ``handler`` (an extension's)."""
        self.service.handlers[op] = handler

    def _serve_late(self, op: Op, handler: LateHandler) -> None:
        """Serve ``op`` to a holder of the secret without the session (an extension's)."""
        self.service.late_handlers[op] = handler

    def _on_hello(self, identity: bytes, msg: Message) -> None:
        nonce = hello_nonce(msg.body)
        if self.map_sent:
            raise ProtocolError("the cluster is already complete; late registrations are refused")
        challenge = self.challenges.issue(identity, nonce)
        self.service.reply(identity, Message(Op.CHALLENGE, {"nonce": nonce, "challenge": challenge},
                                             seq=msg.seq))

    def _on_register(self, identity: bytes, msg: Message) -> None:
        body = msg.body
        self.challenges.check(identity, body.get("challenge"))
        label = self.service.peers.get(identity, "")
        if "session" in body:  # a live node taking its place back after this scheduler's restart
            cmap = self._reregister(identity, body, label)
            self.service.reply(identity, Message(Op.MAP, dict(cmap, nonce=self.challenges.take(identity)),
                                                 seq=msg.seq))
            self._adopt_session()  # after the reply: it is sealed without the session, as the node expects
            return
        if self._recovery is not None:
            raise SchedulerRebuildingError("this scheduler was restarted and takes back the running "
                                           "cluster's nodes first; a new node cannot register yet")
        node = Node(identity=identity, role=str(body.get("role")), host=str(body.get("host")),
                    port=body.get("port"), wanted_rank=body.get("rank"), mode=body.get("mode"),
                    quorum=_quorum(body.get("quorum")), label=label)
        if self.map_sent:
            raise ProtocolError("the cluster is already complete; late registrations are refused")
        self.rendezvous.register(node)
        self.stats.joins += 1
        self.stats.did("register", time.time())
        log.info("%s registered from %s (%s)", node.role, node.host, self.rendezvous.progress())
        if self.rendezvous.complete:
            self._send_map()

    def _send_map(self) -> None:
        try:
            mode = self.rendezvous.mode()
            quorum = self.rendezvous.quorum(self.cfg.sync_quorum)
        except KVStoreError as exc:
            self._fail_all(exc)
            return
        ranked = self.rendezvous.ranked()
        if self._recovery is None and self.cfg.port_file and self.cfg.scheduler_restarts:
            # a restart checks re-registrations against it; none before the map (nothing to rebuild)
            write_digest(self.cfg.port_file, self.session)
        self.servers = ranked["server"]
        self.mode, self.map_at = mode, time.monotonic()
        body = {"num_workers": self.cfg.num_workers, "num_servers": self.cfg.num_servers,
                "servers": [[n.host, n.port] for n in self.servers], "mode": mode,
                "seed": secrets.randbits(63), "session": self.session,
                "sync_quorum": quorum,  # stragglers (issue 25): None is plain sync/async
                **map_settings(self.cfg)}
        if self.left:  # elastic: the slots nobody holds yet
            body["absent"] = sorted(self.left)
        self.map_body = body
        now = time.monotonic()
        for role, nodes in ranked.items():
            for rank, node in enumerate(nodes):
                if role == "worker":
                    self.worker_ranks[node.identity] = rank
                self._labels[node.label] = (role, rank)
                self.hosts[(role, rank)] = node.host
                self.liveness.watch(role, rank, now)
                nonce = self.challenges.take(node.identity)
                self.service.reply(node.identity, Message(Op.MAP, dict(body, rank=rank, role=role,
                                                                       nonce=nonce)))
        self.service.late = self._own_channel("late")  # still keyed without the session
        self.service.channel.set_session(self.session)
        self.challenges.clear()
        self.map_sent = True
        log.info("cluster complete: %d workers, %d servers, mode %s",
                 self.cfg.num_workers, self.cfg.num_servers, mode)

    def _fail_all(self, exc: KVStoreError) -> None:
        log.error("%s", exc)
        for group in self.rendezvous.nodes.values():
            for node in group:
                self.service.reply_error(node.identity, 0, exc)
        self.failed = str(exc)

    def _worker_rank(self, identity: bytes) -> int:
        if identity not in self.worker_ranks:
            bound = self._labels.get(self.service.peers.get(identity, ""))  # a re-registered worker's
            if bound is None or bound[0] != "worker":
                raise ProtocolError("only a registered worker may do this")
            self.worker_ranks[identity] = bound[1]
        return self.worker_ranks[identity]

    def _bind_server(self, identity: bytes) -> None:
        """A re-registered server's first message on its own connection: SHUTDOWN and AWAY go there."""
        bound = self._labels.get(self.service.peers.get(identity, ""))
        if bound is not None and bound[0] == "server" and bound[1] < len(self.servers) \
                and self.servers[bound[1]].identity != identity:
            self.servers[bound[1]] = dataclasses.replace(self.servers[bound[1]], identity=identity)
            self._rebuilt_if_complete()

    def _rebuilt_if_complete(self) -> None:
        """Resume once every node that was alive is back and every server's own connection is known
        (its first beat on it after its re-registration: AWAY and SHUTDOWN must reach it)."""
        if self._recovery is not None and not self.map_sent and self._recovery.complete \
                and all(server.identity for server in self.servers):
            self._rebuilt()

    def _reregister(self, identity: bytes, body: dict, label: str) -> dict:
        """A node that lost sight of the scheduler takes its place back (scheduler/recovery.py): checked
        against the old session (a restarted scheduler: its digest), its rank bound to its request label.
        A restarted scheduler refuses from now on the numbers its own labels' counters name (a replay of
        what its predecessor took); a live one has seen them, and floors nothing.  Returns the MAP body
        (but its nonce).  Raises AuthenticationError for another cluster's session, ProtocolError for a
        rank or label that is not its own, or on a live scheduler nodes never re-register with (no
        KVSTORE_SCHEDULER_RESTARTS).  Nothing changes when it raises."""
        if self._recovery is not None and not self.map_sent:
            first = self._recovery.map is None
            node = self._recovery.admit(body)  # its counters its own labels' only
            if first:
                self._adopt_map()
            elif node.role == "server":
                self.servers[node.rank] = Node(identity=b"", role="server", host=node.host, port=node.port,
                                               wanted_rank=node.rank, label=node.label)
            log.info("%s %d (incarnation %d) re-registered from %s; still missing: %s", node.role,
                     node.rank, node.incarnation, node.host, _names(self._recovery.missing()) or "nobody")
            for counter_label, number in node.counters:
                self.service.channel.floor(counter_label, number)
            self._rebind(node)
            self._rebuilt_if_complete()
            return {"session": self.session, "rebound": True}
        # a live scheduler: the node's heartbeats went unanswered for a while, or its reply was lost
        if not self.cfg.scheduler_restarts:
            raise ProtocolError("a re-registration is refused: this cluster's scheduler is not restarted "
                                "(KVSTORE_SCHEDULER_RESTARTS), so its nodes never re-register")
        if body.get("session") != self.session:
            raise AuthenticationError("this re-registration carries another cluster's session: refused")
        node = parse(body, self.cfg.num_workers, self.cfg.num_servers)
        if self._labels.get(node.label) != (node.role, node.rank) or self._is_lost(node.role, node.rank):
            if not self._back_after_rebuild(node):
                raise ProtocolError(f"{node.role} {node.rank} is not this node's to take back: refused")
            return {"session": self.session, "rebound": True}
        self._rebind(node)
        return {"session": self.session, "rebound": True}

    def _back_after_rebuild(self, node: Rebound) -> bool:
        """An elastic job's worker re-registering (with the session) after this restarted scheduler's
        rebuild took its slot for absent: its join came within a heartbeat of the death, so no other
        member had heard of it (docs/elastic.md).  It counts again, present, and True is returned;
        False (the caller refuses it) for anything else: not a restarted elastic scheduler's, a slot not
        absent, lost, or one the launcher saw exit 0, or a label another node holds."""
        rec, rank = self._recovery, node.rank
        if rec is None or self.cfg.elastic_workers is None or node.role != "worker" or rank not in self.left \
                or rec.gone_for_good(rank) or self._is_lost("worker", rank) or node.label in self._labels:
            return False
        self.left.discard(rank)
        self.map_body["absent"] = sorted(self.left)  # what a server restarted later starts with
        self.barrier.num_workers += 1
        self.restarts.book.admit(rank, node.incarnation)
        for counter_label, number in own_counters(node, set(self._labels)).counters:
            self.service.channel.floor(counter_label, number)
        self._rebind(node)
        self.liveness.watch("worker", rank, time.monotonic())
        log.warning("worker %d (incarnation %d) re-registered after the rebuild, which took its slot for "
                    "absent (a join no other member had heard of): counted again", rank, node.incarnation)
        return True

    def _rebind(self, node: Rebound) -> None:
        """Watch a re-registered node from now; its requests (by their label) are its rank's."""
        self._labels[node.label] = (node.role, node.rank)
        self.hosts[(node.role, node.rank)] = node.host
        if (node.role, node.rank) in self.liveness.last or not self.map_sent:
            self.liveness.watch(node.role, node.rank, time.monotonic())

    def _adopt_map(self) -> None:
        """The first re-registration's session and map become this restarted scheduler's."""
        rec = self._recovery
        assert rec is not None and rec.map is not None and rec.session
        servers = [Node(identity=b"", role="server", host=h, port=p, wanted_rank=r)  # (checked: check_map)
                   for r, (h, p) in enumerate(rec.map["servers"])]
        self.session, self.map_body, self.mode, self.servers = rec.session, rec.map, rec.map["mode"], servers

    def _adopt_session(self) -> None:
        """Key this scheduler to the adopted session (once): nodes' messages verify from now on, and a
        HELLO sealed with the secret alone goes to the late handlers."""
        if self._recovery is None or self.service.late is not None or self._recovery.session is None:
            return
        self.service.channel.set_session(self.session)
        self.service.polled.set_session(poll_session(self.session))
        self.service.late = self._own_channel("late")

    def _rebuilt(self) -> None:
        """Every node that was alive is back: resume (heartbeats, barriers, restarts) where it was."""
        rec, now = self._recovery, time.monotonic()
        assert rec is not None
        self.left = rec.left
        if self.cfg.elastic_workers is not None:  # a server restarted later starts with these absent
            self.map_body["absent"] = sorted(self.left)
        away = rec.away
        self.restarts.adopt(rec.used, {key: n.incarnation for key, n in rec.nodes.items()}, away, now,
                            self.map_body["servers"])
        self.barrier.num_workers = self.cfg.num_workers - len(self.left) - len(away)
        self.barrier.generation = rec.generation
        self._view = rec.last_view  # the epoch a worker that joins or restarts later comes into
        self.map_at, self.map_sent = now, True
        log.warning("cluster rebuilt %.2f s after this scheduler started: %d workers (left %s, away %s), "
                    "%d servers, %d barriers passed, %d of %d restarts used", now - self._started,
                    self.cfg.num_workers, sorted(self.left), sorted(away), self.cfg.num_servers,
                    rec.generation, self.restarts.book.used, self.restarts.book.budget)
        if self.cfg.port_file:
            write_port_file(self.cfg.port_file, self.port)  # the launcher: no longer rebuilding
        self._replay_deferred()

    def _replay_deferred(self) -> None:
        """Handle the barriers and leaves held back while rebuilding, in order."""
        deferred, self._deferred = self._deferred, []
        for identity, msg in deferred:
            try:
                self.service.handlers[msg.op](identity, msg)
            except KVStoreError as exc:
                self.service.reply_error(identity, msg.seq, exc)

    def _await_rebuild(self) -> None:
        """Serve re-registrations until every node that was alive is back, or KVSTORE_CONNECT_TIMEOUT has
        passed: then each missing one is lost (DeadlineExceededError's text names them)."""
        assert self._recovery is not None
        log.warning("restarted (incarnation %d) on port %d: waiting up to %g s (KVSTORE_CONNECT_TIMEOUT) "
                    "for the cluster's nodes to re-register", self.cfg.incarnation, self.port,
                    self.cfg.connect_timeout)
        deadline = self._started + self.cfg.connect_timeout
        while not self.map_sent:
            if time.monotonic() > deadline:  # (or back, but a server's own connection unknown)
                missing = self._recovery.missing() or [
                    ("server", rank) for rank, server in enumerate(self.servers) if not server.identity]
                exc = DeadlineExceededError(
                    f"the restarted scheduler's rebuild is incomplete: {_names(missing)} did not re-register "
                    f"within {self.cfg.connect_timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")
                log.error("%s", exc)
                if self._recovery.map is None:  # nobody came back: nothing to rebuild
                    self.failed = str(exc)
                    return
                self._rebuilt()
                for role, rank in missing:
                    self._declare_lost(role, rank, str(exc), absorb=False)
                return
            self.service.poll_once(0.1)

    def _on_barrier(self, identity: bytes, msg: Message) -> None:
        if self._recovery is not None and not self.map_sent:  # its sender may not be back yet
            self._deferred.append((identity, msg))
            return
        rank = self._worker_rank(identity)
        self.stats.did("barrier", time.time())
        if msg.body.get("cancel"):
            released = not self.barrier.cancel(rank) and rank not in self.stalled
            self.stalled.discard(rank)  # its withdrawal after a StallError: it did not pass
            self.stats.depart([rank], time.monotonic())
            self.service.reply(identity, Message(Op.OK, {"released": released}, seq=msg.seq))
            return
        if self.lost:
            raise self._lost_error()
        if rank in self.left:
            raise ProtocolError(f"worker {rank} has left; it cannot join a barrier")
        failure = msg.body.get("failure")
        if failure is not None and not (isinstance(failure, dict) and all(
                isinstance(failure.get(f), str) for f in ("code", "message"))):
            raise ProtocolError('a barrier\'s failure must be {"code": str, "message": str}')
        digest = msg.body.get("digest")
        if digest is not None and not isinstance(digest, str):
            raise ProtocolError("a barrier's digest must be a str")
        after = msg.body.get("after")  # the barriers this worker has passed
        if after is not None and not (type(after) is int and after >= 0):
            raise ProtocolError("a barrier's 'after' must be an int >= 0")
        tag = msg.body.get("tag")  # kv.membership(tag): kept as the last view's (docs/elastic.md)
        if tag is not None and not (isinstance(tag, list) and len(tag) <= MAX_TAG
                                    and all(type(t) is int for t in tag)):
            raise ProtocolError(f"a barrier's tag must be a list of at most {MAX_TAG} ints")
        follow = msg.body.get("follow", False)  # a joiner before the first view: pairs with any call
        if type(follow) is not bool:
            raise ProtocolError("a barrier's 'follow' must be a bool")
        if after is not None and after < self.barrier.generation:  # released before a scheduler's death:
            self.service.reply(identity, Message(Op.OK, self._replayed(after), seq=msg.seq))  # reply lost
            return
        self.stalled.discard(rank)
        self.stats.arrive(rank, time.monotonic())
        self._release(self.barrier.arrive(rank, identity, msg.seq, failure, digest, tag, follow))
        if self._die is not None:
            self._die("barrier")

    def _replayed(self, after: int) -> dict:
        """The answer to a barrier released before (its reply lost, maybe in a scheduler's death): the
        view it agreed when it was the last tagged one (its number is ``after + 1``), else no view."""
        view = self._view
        if view is not None and view["view"] == after + 1:
            return {"failures": [], "left": list(view["left"]), "view": view["view"],
                    "tag": list(view["tag"])}
        return {"failures": [], "left": sorted(self.left)}

    def _release(self, released: list[tuple[bytes, int]]) -> None:
        """Answer released barrier waiters: the failures reported at it and who has left (every worker
        it releases reads the same membership: the slots not left, numbered by the barriers passed); a
        tagged one's tag and number too, kept as the job's last view (a worker that joins or restarts
        later gets it with its map).  With fewer workers present than KVSTORE_MIN_WORKERS, each gets
        TooFewWorkersError instead; when a membership view was paired with a plain barrier or another
        tag, CollectiveMismatchError (no view is agreed or kept)."""
        if not released:
            return
        if self.timeline is not None and self.stats.opened_at is not None:
            wall, waited = time.time(), self.stats.open_for(time.monotonic()) or 0.0
            self.timeline.span("barrier", "scheduler", wall - waited, wall,
                               {"workers": sorted(self.stats.arrived)})
        self.stats.released(time.monotonic())
        present = self.cfg.num_workers - len(self.left)
        if self.cfg.min_workers is not None and present < self.cfg.min_workers:
            exc = TooFewWorkersError(
                f"the job has {present} worker(s) present (ranks {self._present_ranks()}), fewer than "
                f"--min-workers {self.cfg.min_workers} (KVSTORE_MIN_WORKERS): this barrier fails on every "
                "worker")
            self._fail_released(released, exc)
            return
        if self.barrier.released_mixed:  # a membership view paired with other calls: no view agreed
            self._fail_released(released, mixed_calls(self.barrier.generation, self.barrier.released_mixed))
            return
        body = {"failures": [[r, text] for r, text in sorted(self.barrier.released_failures.items())],
                "left": sorted(self.left)}
        if self.barrier.released_tag is not None:  # a membership view: its number is the barriers passed
            body["view"], body["tag"] = self.barrier.generation, self.barrier.released_tag
            self._view = {"view": self.barrier.generation, "left": sorted(self.left),
                          "tag": self.barrier.released_tag}
        if self.barrier.released_digests:  # each distinct text once, with its ranks: not workers x keys
            groups: dict[str, list[int]] = {}
            for r, d in sorted(self.barrier.released_digests.items()):
                groups.setdefault(d, []).append(r)
            body["digests"] = [[ranks, d] for d, ranks in groups.items()]
        for ident, seq in released:
            self.service.reply(ident, Message(Op.OK, dict(body), seq=seq))

    def _fail_released(self, released: list[tuple[bytes, int]], exc: KVStoreError) -> None:
        """Answer every waiter a barrier released with ``exc`` (logged once): it has passed, failed."""
        log.error("%s", exc)
        for ident, seq in released:
            self.service.reply_error(ident, seq, exc)

    def _present_ranks(self) -> list[int]:
        """The worker slots held (present, or away on a restart)."""
        return [r for r in range(self.cfg.num_workers) if r not in self.left]

    def _on_leave(self, identity: bytes, msg: Message) -> None:
        rank = self._worker_rank(identity)
        failure = msg.body.get("failure")
        if failure is not None and not isinstance(failure, str):
            raise ProtocolError("a LEAVE's failure must be a str")
        self.service.reply(identity, Message(Op.OK, seq=msg.seq))
        if rank in self.left or self._is_lost("worker", rank):
            return
        # its final snapshot, held from now on (a heartbeat comes on another connection: it may be read
        # after this LEAVE, or not at all under load, and STATUS must have the last interval's figures)
        self._keep_snapshot("worker", rank, msg.body.get("stats"), time.monotonic())
        if failure is not None:  # it is dying: the others must not carry on as if it had left
            self._declare_lost("worker", rank, failure)
            return
        self.left.add(rank)
        self.liveness.forget("worker", rank)
        self.stats.did("leave", time.time())
        log.info("worker %d left (%d/%d)", rank, len(self.left), self.cfg.num_workers)
        released = self.barrier.leave(rank)
        self.stats.depart([rank], time.monotonic())
        self._release(released)  # the others no longer wait for it

    def _on_heartbeat(self, identity: bytes, msg: Message) -> None:
        role, rank = msg.body.get("role"), msg.body.get("rank")
        if role not in ("worker", "server") or not isinstance(rank, int) or isinstance(rank, bool):
            raise ProtocolError('a heartbeat needs {"role": "worker" | "server", "rank": int}')
        if self._recovery is not None and not self.map_sent and (role, rank) not in self._recovery.nodes:
            raise ProtocolError("this scheduler was restarted: re-register first")  # its beats would pass
        now = time.monotonic()
        if role == "server":
            self._bind_server(identity)
        self.liveness.beat(role, rank, now)
        left = role == "worker" and rank in self.left  # its LEAVE carried a later snapshot than this beat's
        self._keep_snapshot(role, rank, None if left else msg.body.get("stats"), now)
        body = {"lost": self.lost}
        if role == "worker":  # so a worker learns within a beat who has left, not at its next barrier
            body["left"] = sorted(self.left)
            body.update(self.restarts.heartbeat_fields())  # away, being restarted; servers restarted; budget
        else:
            body.update(self.restarts.budget_fields())
        self.service.reply(identity, Message(Op.OK, body, seq=msg.seq))
        if self._die is not None:
            self._die("beat")

    def _keep_snapshot(self, role: str, rank: int, snapshot: Any, now: float) -> None:
        """Hold ``snapshot`` (None: none came) as the latest of ``role rank`` (a heartbeat's, a
        LEAVE's); a bad one is logged once per node and dropped."""
        known = (role, rank) in self.hosts
        refused = self.stats.heartbeat(role, rank, snapshot, known, now)
        if refused is not None and known and (role, rank) not in self._refusals_logged:
            self._refusals_logged.add((role, rank))  # once per node: a bad snapshot is not news twice
            log.warning("ignoring the stats in %s %d's heartbeats: %s", role, rank, refused[:300])

    def _on_status(self, identity: bytes, msg: Message) -> None:
        """STATUS from a node (sealed with the session, once the map is out), or sealed with the secret
        alone before the map: the session offer then (without a secret, a poller's second step names
        the session in its body)."""
        if not self.map_sent and msg.body.get("session") != self.session:
            offer = self._session_offer()
            offer.seq = msg.seq
            self.service.reply(identity, offer)
            return
        reply = self._polled_status(identity, msg)
        if reply is None:
            self.service.drops.count(OVER_RATE, "STATUS over its rate: not answered")
            return
        reply.seq = msg.seq
        self.service.reply(identity, reply)

    def _session_offer(self) -> Message:
        """The answer to a STATUS sealed without the session: the session to seal it with."""
        return Message(Op.OK, {"session": self.session})

    def _polled_status(self, identity: bytes, msg: Message) -> Message | None:
        """The STATUS reply to a poller (None: over its rate, :class:`PollGate`, not answered).  A
        worker's stats(cluster=True) is neither bounded nor a poller to linger for: it has left by
        the time we exit."""
        if identity in self.worker_ranks:
            return Message(Op.OK, self.status_body())
        if not self._pollers.allow(identity, time.monotonic()):
            return None
        if msg.body.get("follow") is True:
            self._followed = True
        return Message(Op.OK, self._status_asked())

    def _status_asked(self) -> dict:
        """The STATUS reply, counting the request (see :meth:`_linger_for_status`)."""
        self.status_asks += 1
        self.status_at = time.monotonic()
        return self.status_body()

    def _linger_for_status(self) -> None:
        """After shutdown, when something polls STATUS, answer one more request so it sees every
        node's last snapshot: wait for it up to FOLLOW_LINGER seconds when a poller follows the job
        (the TensorBoard writer), however long ago it last asked; else, when one asked within
        STATUS_LINGER seconds (kvstore.status), up to STATUS_LINGER."""
        if self._followed:
            wait = FOLLOW_LINGER
        elif time.monotonic() - self.status_at <= STATUS_LINGER:
            wait = STATUS_LINGER
        else:
            return
        asked, deadline = self.status_asks, time.monotonic() + wait
        while self.status_asks == asked and time.monotonic() < deadline:
            self.service.poll_once(0.1)

    def status_body(self) -> dict:
        """The STATUS reply: the cluster, every node's latest snapshot and the scheduler's own."""
        now = time.monotonic()
        registered = {role: len(group) for role, group in self.rendezvous.nodes.items()}
        cluster = {"mode": self.mode, "num_workers": self.cfg.num_workers,
                   "num_servers": self.cfg.num_servers, "complete": self.map_sent,
                   "registered": registered, "failed": self.failed,
                   "session_age_s": None if self.map_at is None else now - self.map_at}
        own = self.snapshot(now)
        budget = max(0, kvstats.MAX_SNAPSHOT_BYTES * 12 - 256 * len(own["nodes"]))
        return {"schema": kvstats.SCHEMA_VERSION, "cluster": cluster,
                "nodes": self.stats.node_snapshots(budget), "scheduler": own}

    def snapshot(self, now: float) -> dict:
        """The scheduler's own snapshot (docs/observability.md)."""
        wall = time.time()
        base = kvstats.node_snapshot("scheduler", 0, self.cfg.root_uri or "", os.getpid(),
                                     self.stats.started_wall, wall, self.stats.last_op,
                                     self.stats.last_op_at)
        if self.map_sent:
            nodes = [(role, rank, host) for (role, rank), host in sorted(self.hosts.items())]
        else:
            nodes = [(n.role, None, n.host) for group in self.rendezvous.nodes.values() for n in group]
        lost = {(role, rank) for role, rank, _, _ in self.lost}
        return scheduler_snapshot(self.stats, base, node_rows(nodes, self.stats, self.left, lost, now),
                                  now)

    def check_stall(self, now: float) -> None:
        """Log once when the open barrier has waited past KVSTORE_STALL_WARN, naming whom it waits for;
        past KVSTORE_STALL_ABORT, fail it for the waiting workers with :class:`StallError`."""
        open_s = self.stats.open_for(now)
        if open_s is None:
            return
        abort = self.cfg.stall_abort
        if abort is not None and open_s > abort:
            late = self._late_workers()
            exc = StallError(f"the barrier waited {open_s:.1f} s for {late} (KVSTORE_STALL_ABORT="
                             f"{abort:g}): failing it for the workers waiting in it")
            log.error("%s", exc)
            self.stalled.update(self.barrier.waiting)
            for ident, seq in self.barrier.drain():
                self.service.reply_error(ident, seq, exc)
            self.stats.depart(None, now)
        elif open_s > self.cfg.stall_warn and not self.stats.warned:
            self.stats.warned = True
            log.warning("a barrier has waited %.1f s for %s; workers %s are in it (KVSTORE_STALL_WARN=%g)",
                        open_s, self._late_workers(), sorted(self.stats.arrived), self.cfg.stall_warn)

    def _late_workers(self) -> str:
        """'worker 1 (last op push 3.2 s ago), ...': the workers the open barrier still waits for."""
        gone = self.left | {rank for role, rank, _, _ in self.lost if role == "worker"}
        late = [r for r in range(self.cfg.num_workers) if r not in self.barrier.waiting and r not in gone]
        wall = time.time()
        return ", ".join(f"worker {r} ({self.stats.describe_last('worker', r, wall)})"
                         for r in late) or "no worker"

    def _lost_error(self) -> NodeLostError:
        return lost_error(self.lost[0])

    def _live_servers(self) -> list[Node]:
        lost = {rank for role, rank, _, _ in self.lost if role == "server"}
        return [node for rank, node in enumerate(self.servers) if rank not in lost]

    def check_liveness(self, now: float) -> None:
        """Declare every node silent for too long lost; and every worker away for longer than
        KVSTORE_CONNECT_TIMEOUT (its restart did not come back)."""
        for role, rank in self.liveness.expired(now):
            self._declare_lost(role, rank, f"no heartbeat for {self.cfg.heartbeat_timeout:g} s "
                                           "(KVSTORE_HEARTBEAT_TIMEOUT)")
        for role, rank, why in self.restarts.overdue(now):
            self._declare_lost(role, rank, why, absorb=False)

    def _is_lost(self, role: str, rank: int) -> bool:
        return any(r == role and k == rank for r, k, _, _ in self.lost)

    def _declare_lost(self, role: str, rank: int, why: str, absorb: bool = True) -> None:
        """Record the loss (every heartbeat reply names it from now on); fail the waiting barrier.
        With ``absorb``, a node within the restart budget is only away (scheduler/restarts.py)."""
        if absorb:
            kept = self.restarts.absorb(role, rank, why)
            if kept is None:
                return
            why = kept
        host = self.hosts.get((role, rank), "?")
        self.liveness.forget(role, rank)
        self.lost.append([role, rank, host, why])
        self.stats.losses += 1
        log.error("%s %d on %s is lost: %s", role, rank, host, why)
        for ident, seq in self.barrier.drain():
            self.service.reply_error(ident, seq, self._lost_error())
        self.stats.depart(None, time.monotonic())

    def _away(self, role: str, rank: int) -> str | None:
        """Stop counting ``role rank`` while its restart is awaited: its heartbeats are no longer
        watched, and a worker no longer counts toward barriers (whoever waited only for it goes
        through).  Returns its host."""
        self.liveness.forget(role, rank)
        if role == "worker":
            self._release(self.barrier.leave(rank))
        return self.hosts.get((role, rank))

    def _rejoin(self, node: Node, rank: int, incarnation: int) -> dict:
        """Admit ``node``, the restart of ``role rank`` at ``incarnation``: a worker's connection takes
        its rank and counts toward barriers again; a server's new address replaces its old one in the
        map.  Both are watched from now.  Returns the MAP body it gets (but its nonce)."""
        now = time.monotonic()
        if node.role == "worker":
            for old in [ident for ident, r in self.worker_ranks.items() if r == rank]:
                del self.worker_ranks[old]
            self.worker_ranks[node.identity] = rank
            self.hosts[("worker", rank)] = node.host
            self.liveness.watch("worker", rank, now)
            self.barrier.num_workers += 1
            self._labels[node.label] = ("worker", rank)
            view = {} if self._view is None else {"view": self._view}  # the epoch it comes into
            return dict(self.map_body, rank=rank, role="worker", incarnation=incarnation, rejoin=True,
                        barriers=self.barrier.generation, **view)
        self.servers[rank] = node
        self.map_body["servers"][rank] = [node.host, node.port]  # a worker restarted later connects to it
        self.map_body.setdefault("server_incarnations", [0] * len(self.servers))[rank] = incarnation
        self.hosts[("server", rank)] = node.host
        self._labels[node.label] = ("server", rank)
        self.liveness.watch("server", rank, now)
        return dict(self.map_body, rank=rank, role="server", incarnation=incarnation, left=sorted(self.left))

    def _admit(self, node: Node, rank: int, incarnation: int, join: bool) -> dict:
        """The extensions' ``rejoin``: :meth:`_join` when ``join``, else :meth:`_rejoin`."""
        return self._join(node, rank, incarnation) if join else self._rejoin(node, rank, incarnation)

    def _join(self, node: Node, rank: int, incarnation: int) -> dict:
        """Admit ``node``, a new member of an elastic job, to worker slot ``rank`` (absent: never held,
        or left) as ``incarnation``: it counts toward barriers and is watched from now.  Returns the MAP
        body it gets (but its nonce).  Raises ProtocolError for a slot that is not absent."""
        if rank not in self.left or self._is_lost("worker", rank):
            raise ProtocolError(f"worker slot {rank} is not absent (docs/elastic.md): a new worker joins "
                                "only a slot nobody holds")
        self.left.discard(rank)
        self.map_body["absent"] = sorted(self.left)  # what a server restarted later starts with
        return dict(self._rejoin(node, rank, incarnation), join=True)

    def _workers_gone(self) -> int:
        return len(self.left | {rank for role, rank, _, _ in self.lost if role == "worker"})

    def _on_server_stopped(self, identity: bytes, msg: Message) -> None:
        self._bind_server(identity)
        if not any(node.identity == identity for node in self.servers):
            raise ProtocolError("only a server confirms a shutdown")
        self.stopped_servers.add(identity)

    def run(self) -> int:
        """Serve until every worker has left and the servers are stopped; return the exit code."""
        if self._recovery is not None:
            self._await_rebuild()
        elif self.cfg.port_file:
            write_port_file(self.cfg.port_file, self.port)
        if self._recovery is None:
            log.info("listening on port %d for %d workers and %d servers", self.port,
                     self.cfg.num_workers, self.cfg.num_servers)
        deadline = time.monotonic() + self.cfg.connect_timeout
        while not self.map_sent and self.failed is None:
            if time.monotonic() > deadline:
                self._fail_all(DeadlineExceededError(
                    f"rendezvous incomplete: {self.rendezvous.progress()} after "
                    f"{self.cfg.connect_timeout:g} s (KVSTORE_CONNECT_TIMEOUT)"))
                break
            self.service.poll_once(0.1)
        if self.failed is not None:
            return 1
        tick = min(1.0, self.cfg.heartbeat_interval)
        while self._workers_gone() < self.cfg.num_workers:
            if self.service.poll_once(tick):
                self.service.drain()  # heartbeats queued behind a slow message count before the check
            self.check_liveness(time.monotonic())
            self.check_stall(time.monotonic())
        code = self._stop_servers()
        if self.lost:
            names = ", ".join(f"{role} {rank} on {host}" for role, rank, host, _ in self.lost)
            log.error("the cluster lost %s; exiting with code 1", names)
            return 1
        return code

    def _stop_servers(self) -> int:
        servers = self._live_servers()
        for node in servers:
            self.service.reply(node.identity, Message(Op.SHUTDOWN))
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        while len(self.stopped_servers) < len(servers) and time.monotonic() < deadline:
            self.service.poll_once(0.1)
        missing = len(servers) - len(self.stopped_servers)
        if missing:
            log.warning("%d servers did not confirm shutdown within %g s", missing,
                        self.cfg.shutdown_timeout)
        log.info("all workers left; shut down")
        self._linger_for_status()
        self.service.close()
        return 0


def _present(cfg: kvconfig.Config) -> int:
    """The workers that register at the start: ``KVSTORE_ELASTIC_WORKERS`` of an elastic job's
    ``DMLC_NUM_WORKER`` slots, else all.  Raises ConfigError when it exceeds the slots."""
    present = cfg.elastic_workers
    if present is None:
        return cfg.num_workers
    if present > cfg.num_workers:
        raise ConfigError(f"KVSTORE_ELASTIC_WORKERS={present} exceeds the {cfg.num_workers} worker slots "
                          "(DMLC_NUM_WORKER, launch.py --max-workers)")
    return present


def _names(nodes: list[tuple[str, int]]) -> str:
    """'server 1, worker 0': the nodes a rebuild waits for."""
    return ", ".join(f"{role} {rank}" for role, rank in nodes)


def main() -> int:
    """Entry point of ``python -m kvstore.scheduler``: run the scheduler configured by the environment."""
    return run_role("scheduler", lambda cfg: Scheduler(cfg).run())

"""Worker restarts on the scheduler's side (``launch.py --max-restarts K``, ``KVSTORE_MAX_RESTARTS``).

With a budget of K > 0, a worker the scheduler would declare lost is declared **away** instead
(at most K times in all): barriers stop counting it, every live server is told (AWAY: its sync
rounds close without it, scaled as a quorum of the rest), and the other workers are told in their
heartbeat replies, not failed.  The launcher restarts it with the same rank and the next
*incarnation* (``KVSTORE_INCARNATION``); the restarted process registers although the cluster is
complete (HELLO and REGISTER sealed with the secret alone, the only late registration admitted:
a worker rank whose incarnation is above the one counted, while budget is left), gets the cluster
map with ``rejoin`` and its incarnation, and counts again.  A REGISTER of a higher incarnation
also proves the old one dead, so a SIGKILLed worker's restart need not wait for the heartbeat
timeout.  A worker away for longer than ``KVSTORE_CONNECT_TIMEOUT`` is lost for good (the job
fails, named), and so is every loss past the budget, and every server's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvstore.errors import ProtocolError
from kvstore.net.auth import sender_label
from kvstore.net.protocol import Message, Op

from .extension import SchedulerAPI
from .pipes import PipesExtension
from .state import Node, hello_nonce

log = logging.getLogger("scheduler")
STAGE = "it was a pipeline stage, and lost stages are not restarted (docs/pipeline.md)"


class Restarts:
    """Pure bookkeeping: the budget, each worker's incarnation, and who is away since when."""

    def __init__(self, budget: int, num_workers: int) -> None:
        self.budget, self.used, self.num_workers = budget, 0, num_workers
        self.incarnation: dict[int, int] = {}  # rank -> incarnation counted (absent: 0)
        self.away: dict[int, float] = {}  # rank -> when it went away (the caller's clock)
        self.servers_away: dict[int, float] = {}  # server rank -> when it went away
        self.server_incarnation: dict[int, int] = {}  # server rank -> incarnation counted (absent: 0)
        self.moved: dict[int, list] = {}  # server rank -> [rank, incarnation, host, port] of its restart

    def absorbs(self, rank: int) -> bool:
        """Whether losing worker ``rank`` now makes it away (budget left) rather than lost."""
        return rank not in self.away and self.used < self.budget

    def depart(self, rank: int, now: float) -> None:
        """Worker ``rank`` is away from ``now`` on: one restart of the budget is used."""
        self.away[rank] = now
        self.used += 1

    def check(self, rank: object, incarnation: object) -> tuple[int, int]:
        """A late REGISTER's ``(rank, incarnation)``, checked; raises ProtocolError (nothing changes)
        unless it names a worker rank, an incarnation above the one counted, and the worker is away
        or budget is left to make it so."""
        if self.budget == 0:
            raise ProtocolError("the cluster is already complete; late registrations are refused "
                                "(workers are restarted only under KVSTORE_MAX_RESTARTS > 0)")
        if not (type(rank) is int and 0 <= rank < self.num_workers and type(incarnation) is int):
            raise ProtocolError("a late REGISTER must name a worker rank (DMLC_WORKER_ID) and its "
                                "incarnation (KVSTORE_INCARNATION)")
        if incarnation <= self.incarnation.get(rank, 0):
            raise ProtocolError(f"worker {rank} incarnation {incarnation} is not above the one counted "
                                f"({self.incarnation.get(rank, 0)}); refused")
        if rank not in self.away and self.used >= self.budget:
            raise ProtocolError(f"worker {rank}'s restart is refused: all {self.budget} restarts "
                                "(KVSTORE_MAX_RESTARTS) are used")
        return rank, incarnation

    def admit(self, rank: int, incarnation: int) -> None:
        """Worker ``rank`` is back as ``incarnation``."""
        self.away.pop(rank, None)
        self.incarnation[rank] = incarnation

    def server_absorbs(self, rank: int, shards: bool) -> bool:
        """Whether losing server ``rank`` now makes it away: servers write shards, budget is left."""
        return shards and rank not in self.servers_away and self.used < self.budget

    def overdue_servers(self, now: float, timeout: float) -> list[int]:
        """Servers away for longer than ``timeout``; no longer away (the caller loses them)."""
        late = sorted(rank for rank, since in self.servers_away.items() if now - since > timeout)
        for rank in late:
            del self.servers_away[rank]
        return late

    def overdue(self, now: float, timeout: float) -> list[int]:
        """Workers away for longer than ``timeout``; they are no longer away (the caller loses them)."""
        late = sorted(rank for rank, since in self.away.items() if now - since > timeout)
        for rank in late:
            del self.away[rank]
        return late


class RestartsExtension:
    """Restarts on the scheduler's side (see the module docstring), over its :class:`SchedulerAPI`:
    a lost node within the budget is made away (:meth:`absorb`), and with KVSTORE_MAX_RESTARTS > 0
    the late HELLO and REGISTER of its restart are served here."""

    def __init__(self, api: SchedulerAPI, pipes: PipesExtension) -> None:
        self.api, self.pipes = api, pipes  # pipeline stages are never restarted
        self.book = Restarts(api.cfg.max_restarts, api.cfg.num_workers)
        if api.cfg.max_restarts or api.cfg.elastic_workers is not None:  # restarts and joins come late
            api.handle_late(Op.HELLO, self.late_hello)
            api.handle_late(Op.REGISTER, self.late_register)

    def shards_on(self) -> bool:
        """Whether servers write shards (so a lost one can be restarted from its own)."""
        cfg = self.api.cfg
        return bool(cfg.snapshot_dir and (cfg.snapshot_rounds or cfg.snapshot_seconds))

    def absorb(self, role: str, rank: int, why: str) -> str | None:
        """Make lost ``role rank`` away when the budget covers it (a worker that is no pipeline stage
        and not lost already; a server, while servers write shards) and return None; else return the
        ``why`` to declare it lost with (a stage's names why it is not restarted)."""
        stage = role == "worker" and self.pipes.is_stage(rank)  # its loss stays fatal
        if stage and self.book.budget:
            why += f"; {STAGE}"
        if role == "worker" and self.book.absorbs(rank) and not stage \
                and not any(r == role and k == rank for r, k, _, _ in self.api.lost()):
            self.worker_away(rank, why)
            return None
        if role == "server" and self.book.server_absorbs(rank, self.shards_on()):
            self.server_away(rank, why)
            return None
        return why

    def overdue(self, now: float) -> list[tuple[str, int, str]]:
        """``(role, rank, why)`` of every node away for longer than KVSTORE_CONNECT_TIMEOUT (its restart
        did not come back): workers, then servers; they are no longer away (the caller loses them)."""
        timeout = self.api.cfg.connect_timeout
        late = [("worker", rank, f"its restart did not rejoin within {timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")
                for rank in self.book.overdue(now, timeout)]
        return late + [("server", rank, f"its restart did not register within {timeout:g} s "
                                         "(KVSTORE_CONNECT_TIMEOUT)")
                       for rank in self.book.overdue_servers(now, timeout)]

    def heartbeat_fields(self) -> dict[str, Any]:
        """What a worker's heartbeat reply says of restarts: the workers away, and where the servers
        restarted from their shards are now."""
        fields: dict[str, Any] = {"away": sorted(self.book.away), **self.budget_fields()}
        if self.book.moved:
            fields["restarted"] = list(self.book.moved.values())
        return fields

    def budget_fields(self) -> dict[str, Any]:
        """What every heartbeat reply says of the budget (``restarts``: [used, budget]; none without
        restarts): a node rides over a scheduler's death only while one is left (net/heartbeat.py)."""
        return {"restarts": [self.book.used, self.book.budget]} if self.book.budget else {}

    def adopt(self, used: int, incarnations: dict[tuple[str, int], int], away: set[int], now: float,
              servers: list[list]) -> None:
        """A restarted scheduler's book, rebuilt (scheduler/recovery.py): the restarts ``used``, each
        node's ``incarnations`` by (role, rank), the workers ``away`` since ``now``, and the servers'
        ``[host, port]`` (where a restarted one now is)."""
        book = self.book
        book.used = max(book.used, used)
        for (role, rank), incarnation in incarnations.items():
            (book.incarnation if role == "worker" else book.server_incarnation)[rank] = incarnation
            if role == "server" and incarnation:
                book.moved[rank] = [rank, incarnation, *servers[rank]]
        book.away = dict.fromkeys(sorted(away), now)

    def worker_away(self, rank: int, why: str) -> None:
        """Declare worker ``rank`` away (see the module docstring): barriers release without it, every
        live server gets AWAY."""
        book = self.book
        book.depart(rank, time.monotonic())
        incarnation, host = book.incarnation.get(rank, 0), self.api.away("worker", rank)
        log.warning("worker %d (incarnation %d) on %s is lost: %s; waiting up to %g s "
                    "(KVSTORE_CONNECT_TIMEOUT) for its restart (%d of %d restarts used, "
                    "KVSTORE_MAX_RESTARTS); sync rounds close without it meanwhile", rank, incarnation, host,
                    why, self.api.cfg.connect_timeout, book.used, book.budget)
        for node in self.api.live_servers():
            self.api.reply(node.identity, Message(Op.AWAY, {"worker": rank, "incarnation": incarnation}))

    def server_away(self, rank: int, why: str) -> None:
        """Declare server ``rank`` away: its restart from its shard is awaited (one restart of the budget)."""
        book = self.book
        book.servers_away[rank] = time.monotonic()
        book.used += 1
        host = self.api.away("server", rank)
        log.warning("server %d on %s is lost: %s; waiting up to %g s (KVSTORE_CONNECT_TIMEOUT) for its "
                    "restart from its shard (%d of %d restarts used, KVSTORE_MAX_RESTARTS)", rank, host, why,
                    self.api.cfg.connect_timeout, book.used, book.budget)

    def late_hello(self, identity: bytes, msg: Message) -> Message:
        """A HELLO after the map: challenged only when restarts are on (else refused as late)."""
        if self.book.budget == 0 and self.api.cfg.elastic_workers is None:
            raise ProtocolError("the cluster is already complete; late registrations are refused")
        nonce = hello_nonce(msg.body)
        challenge = self.api.challenges.issue(identity, nonce, bound=4 * self.api.cfg.num_workers)
        return Message(Op.CHALLENGE, {"nonce": nonce, "challenge": challenge})

    def late_register(self, identity: bytes, msg: Message) -> Message:
        """A restarted node's REGISTER: checked (:meth:`Restarts.check`), its old incarnation made away
        if it was not yet, then admitted; returns its cluster map."""
        body = msg.body
        self.api.challenges.check(identity, body.get("challenge"))
        lost = self.api.lost()
        if lost:  # e.g. a pipeline stage: the job fails, nothing rejoins it
            role, rank, host, _ = lost[0]
            raise ProtocolError(f"the job has lost {role} {rank} on {host} for good; restarts are refused")
        if body.get("role") == "server":
            return self.late_server(identity, body, sender_label(msg))
        if body.get("role") != "worker":
            raise ProtocolError("the cluster is already complete; only a restarted node may register late")
        if body.get("join"):
            return self.late_join(identity, body, sender_label(msg))
        rank, incarnation = self.book.check(body.get("rank"), body.get("incarnation"))
        if self.pipes.is_stage(rank):  # a stage's restart proves it died: the pipeline fails now
            self.api.declare_lost("worker", rank, STAGE)
            raise ProtocolError(f"worker {rank}'s restart is refused: {STAGE}")
        mode = self.api.mode()
        if body.get("mode") != mode:
            raise ProtocolError(f"worker {rank}'s restart asks for {body.get('mode')!r}; the cluster runs "
                                f"{mode}")
        if rank not in self.book.away:
            self.worker_away(rank, f"replaced by its restart (incarnation {incarnation})")
        nonce = self.api.challenges.take(identity)
        self.book.admit(rank, incarnation)
        node = Node(identity=identity, role="worker", host=str(body.get("host"))[:256], wanted_rank=rank,
                    label=sender_label(msg))
        cmap = self.api.rejoin(node, rank, incarnation, False)
        log.warning("worker %d rejoined as incarnation %d from %s", rank, incarnation, node.host)
        return Message(Op.MAP, dict(cmap, nonce=nonce))

    def late_join(self, identity: bytes, body: dict[str, Any], label: str) -> Message:
        """A new worker's REGISTER in an elastic job (docs/elastic.md): an absent slot (``rank``) and an
        incarnation above the slot's last; admitted as a new member, no restart budget used.  Raises
        ProtocolError (nothing changes) for a job that is not elastic, a slot not absent, an old
        incarnation or another mode."""
        rank, incarnation = body.get("rank"), body.get("incarnation")
        if self.api.cfg.elastic_workers is None:
            raise ProtocolError("this job is not elastic (KVSTORE_ELASTIC_WORKERS, launch.py --max-workers): "
                                "a worker cannot join it")
        if not (type(rank) is int and 0 <= rank < self.api.cfg.num_workers and type(incarnation) is int):
            raise ProtocolError("a joining worker's REGISTER must name a worker slot (DMLC_WORKER_ID) and "
                                "its incarnation (KVSTORE_INCARNATION)")
        if incarnation <= self.book.incarnation.get(rank, 0):
            raise ProtocolError(f"worker {rank} joins as incarnation {incarnation}, not above the slot's "
                                f"last ({self.book.incarnation.get(rank, 0)}); refused")
        if body.get("mode") != self.api.mode():
            raise ProtocolError(f"worker {rank} joins asking for {body.get('mode')!r}; the cluster runs "
                                f"{self.api.mode()}")
        node = Node(identity=identity, role="worker", host=str(body.get("host"))[:256], wanted_rank=rank,
                    label=label)
        cmap = self.api.rejoin(node, rank, incarnation, True)  # raises for a slot that is not absent
        self.book.admit(rank, incarnation)
        log.warning("worker %d joined as incarnation %d from %s", rank, incarnation, node.host)
        return Message(Op.MAP, dict(cmap, nonce=self.api.challenges.take(identity)))

    def late_server(self, identity: bytes, body: dict[str, Any], label: str) -> Message:
        """A restarted server's REGISTER: its rank and a higher incarnation, budget left; its new address
        replaces the old one in the map and is named in workers' heartbeat replies from now on."""
        book, rank, incarnation = self.book, body.get("rank"), body.get("incarnation")
        port = body.get("port")
        if not (type(rank) is int and 0 <= rank < self.api.cfg.num_servers and type(incarnation) is int
                and type(port) is int and 0 < port < 65536):
            raise ProtocolError("a restarted server's REGISTER must name its rank (KVSTORE_SERVER_ID), "
                                "incarnation (KVSTORE_INCARNATION) and port")
        if incarnation <= book.server_incarnation.get(rank, 0):
            raise ProtocolError(f"server {rank} incarnation {incarnation} is not above the one counted; "
                                "refused")
        if rank not in book.servers_away:
            if not book.server_absorbs(rank, self.shards_on()):
                raise ProtocolError(f"server {rank}'s restart is refused: no restarts left, or no shards "
                                    "(KVSTORE_SNAPSHOT_EVERY)")
            self.server_away(rank, f"replaced by its restart (incarnation {incarnation})")
        nonce = self.api.challenges.take(identity)
        del book.servers_away[rank]
        book.server_incarnation[rank] = incarnation
        host = str(body.get("host"))[:256]
        book.moved[rank] = [rank, incarnation, host, port]
        node = Node(identity=identity, role="server", host=host, port=port, wanted_rank=rank, label=label)
        cmap = self.api.rejoin(node, rank, incarnation, False)
        log.warning("server %d restarted as incarnation %d on %s:%d", rank, incarnation, host, port)
        return Message(Op.MAP, dict(cmap, nonce=nonce, away=sorted(book.away)))

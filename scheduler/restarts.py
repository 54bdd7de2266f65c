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
import secrets
import time
from typing import Any

from kvstore.errors import AuthenticationError, ProtocolError
from kvstore.net.protocol import Message, Op

Scheduler = Any  # scheduler.scheduler.Scheduler (not imported: that module imports this one)
log = logging.getLogger("scheduler")


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


def worker_away(sched: Scheduler, rank: int, why: str) -> None:
    """Declare worker ``rank`` away (see the module docstring): barriers release without it, every
    live server gets AWAY."""
    restarts = sched.restarts
    restarts.depart(rank, time.monotonic())
    sched.liveness.forget("worker", rank)
    incarnation, host = restarts.incarnation.get(rank, 0), sched.hosts.get(("worker", rank))
    log.warning("worker %d (incarnation %d) on %s is lost: %s; waiting up to %g s "
                "(KVSTORE_CONNECT_TIMEOUT) for its restart (%d of %d restarts used, KVSTORE_MAX_RESTARTS); "
                "sync rounds close without it meanwhile", rank, incarnation, host, why,
                sched.cfg.connect_timeout, restarts.used, restarts.budget)
    sched._release(sched.barrier.leave(rank))
    for node in sched._live_servers():
        sched.service.reply(node.identity, Message(Op.AWAY, {"worker": rank, "incarnation": incarnation}))


def late_hello(sched: Scheduler, identity: bytes, msg: Message) -> Message:
    """A HELLO after the map: challenged only when restarts are on (else refused as late)."""
    if sched.restarts.budget == 0:
        raise ProtocolError("the cluster is already complete; late registrations are refused")
    nonce = msg.body.get("nonce")
    if not (isinstance(nonce, str) and 0 < len(nonce) <= 128):
        raise ProtocolError("HELLO needs a nonce (a str of at most 128 characters)")
    if len(sched.challenges) >= 4 * sched.cfg.num_workers:  # bounded: a restart needs one
        sched.challenges.pop(next(iter(sched.challenges)))
    challenge = secrets.token_hex(16)
    sched.challenges[identity] = (nonce, challenge)
    return Message(Op.CHALLENGE, {"nonce": nonce, "challenge": challenge})


def late_register(sched: Scheduler, identity: bytes, msg: Message) -> Message:
    """A restarted worker's REGISTER: checked (:meth:`Restarts.check`), its old incarnation made away
    if it was not yet, then admitted; returns its cluster map."""
    body = msg.body
    issued = sched.challenges.get(identity)
    if issued is None or body.get("challenge") != issued[1]:
        raise AuthenticationError("REGISTER must answer the challenge this connection was given")
    if sched.lost:  # e.g. a pipeline stage: the job fails, nothing rejoins it
        role, rank, host, _ = sched.lost[0]
        raise ProtocolError(f"the job has lost {role} {rank} on {host} for good; restarts are refused")
    if body.get("role") == "server":
        return late_server(sched, identity, body)
    if body.get("role") != "worker":
        raise ProtocolError("the cluster is already complete; only a restarted node may register late")
    rank, incarnation = sched.restarts.check(body.get("rank"), body.get("incarnation"))
    if rank in sched.pipe_book.addresses:  # a stage's restart proves it died: the pipeline fails now
        why = "it was a pipeline stage, and lost stages are not restarted (docs/pipeline.md)"
        sched._declare_lost("worker", rank, why, absorb=False)
        raise ProtocolError(f"worker {rank}'s restart is refused: {why}")
    if body.get("mode") != sched.mode:
        raise ProtocolError(f"worker {rank}'s restart asks for {body.get('mode')!r}; the cluster runs "
                            f"{sched.mode}")
    if rank not in sched.restarts.away:
        worker_away(sched, rank, f"replaced by its restart (incarnation {incarnation})")
    nonce = sched.challenges.pop(identity)[0]
    sched.restarts.admit(rank, incarnation)
    for old in [ident for ident, r in sched.worker_ranks.items() if r == rank]:
        del sched.worker_ranks[old]
    sched.worker_ranks[identity] = rank
    sched.hosts[("worker", rank)] = str(body.get("host"))[:256]
    sched.liveness.watch("worker", rank, time.monotonic())
    sched.barrier.num_workers += 1
    log.warning("worker %d rejoined as incarnation %d from %s", rank, incarnation,
                sched.hosts[("worker", rank)])
    return Message(Op.MAP, dict(sched.map_body, rank=rank, role="worker", nonce=nonce,
                                incarnation=incarnation, rejoin=True))


def shards_on(sched: Scheduler) -> bool:
    """Whether servers write shards (so a lost one can be restarted from its own)."""
    cfg = sched.cfg
    return bool(cfg.snapshot_dir and (cfg.snapshot_rounds or cfg.snapshot_seconds))


def server_away(sched: Scheduler, rank: int, why: str) -> None:
    """Declare server ``rank`` away: its restart from its shard is awaited (one restart of the budget)."""
    restarts = sched.restarts
    restarts.servers_away[rank] = time.monotonic()
    restarts.used += 1
    sched.liveness.forget("server", rank)
    log.warning("server %d on %s is lost: %s; waiting up to %g s (KVSTORE_CONNECT_TIMEOUT) for its restart "
                "from its shard (%d of %d restarts used, KVSTORE_MAX_RESTARTS)", rank,
                sched.hosts.get(("server", rank)), why, sched.cfg.connect_timeout, restarts.used,
                restarts.budget)


def late_server(sched: Scheduler, identity: bytes, body: dict) -> Message:
    """A restarted server's REGISTER: its rank and a higher incarnation, budget left; its new address
    replaces the old one in the map and is named in workers' heartbeat replies from now on."""
    restarts, rank, incarnation = sched.restarts, body.get("rank"), body.get("incarnation")
    port = body.get("port")
    if not (type(rank) is int and 0 <= rank < len(sched.servers) and type(incarnation) is int
            and type(port) is int and 0 < port < 65536):
        raise ProtocolError("a restarted server's REGISTER must name its rank (KVSTORE_SERVER_ID), "
                            "incarnation (KVSTORE_INCARNATION) and port")
    if incarnation <= restarts.server_incarnation.get(rank, 0):
        raise ProtocolError(f"server {rank} incarnation {incarnation} is not above the one counted; refused")
    if rank not in restarts.servers_away:
        if not restarts.server_absorbs(rank, shards_on(sched)):
            raise ProtocolError(f"server {rank}'s restart is refused: no restarts left, or no shards "
                                "(KVSTORE_SNAPSHOT_EVERY)")
        server_away(sched, rank, f"replaced by its restart (incarnation {incarnation})")
    nonce = sched.challenges.pop(identity)[0]
    del restarts.servers_away[rank]
    restarts.server_incarnation[rank] = incarnation
    host = str(body.get("host"))[:256]
    sched.servers[rank] = type(sched.servers[rank])(identity=identity, role="server", host=host, port=port,
                                                   wanted_rank=rank)
    sched.map_body["servers"][rank] = [host, port]  # a worker restarted later connects to it, by name
    sched.map_body.setdefault("server_incarnations", [0] * len(sched.servers))[rank] = incarnation
    sched.hosts[("server", rank)] = host
    restarts.moved[rank] = [rank, incarnation, host, port]
    sched.liveness.watch("server", rank, time.monotonic())
    log.warning("server %d restarted as incarnation %d on %s:%d", rank, incarnation, host, port)
    return Message(Op.MAP, dict(sched.map_body, rank=rank, role="server", nonce=nonce,
                                incarnation=incarnation, left=sorted(sched.left), away=sorted(restarts.away)))

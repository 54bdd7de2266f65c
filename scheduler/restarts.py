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

Scheduler = Any  # scheduler.process.Scheduler (not imported: that module imports this one)
log = logging.getLogger("scheduler")


class Restarts:
    """Pure bookkeeping: the budget, each worker's incarnation, and who is away since when."""

    def __init__(self, budget: int, num_workers: int) -> None:
        self.budget, self.used, self.num_workers = budget, 0, num_workers
        self.incarnation: dict[int, int] = {}  # rank -> incarnation counted (absent: 0)
        self.away: dict[int, float] = {}  # rank -> when it went away (the caller's clock)

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
    if body.get("role") != "worker":
        raise ProtocolError("the cluster is already complete; only a restarted worker may register late")
    rank, incarnation = sched.restarts.check(body.get("rank"), body.get("incarnation"))
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

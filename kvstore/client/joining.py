"""A worker's way into the cluster: registration with the scheduler (:func:`join`), a restarted
worker's rejoin with every server (:func:`rejoin`, ``launch.py --max-restarts``), and the test hook
that kills a worker at a round boundary (:func:`die_if_asked`, ``KVSTORE_TEST_DIE_AT_ROUND``), run
after each round with the write of the worker's compression residuals (:func:`after_round`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from kvstore import config as kvconfig
from kvstore.client.compress import WorkerCompression
from kvstore.client.mux import SCHEDULER, Mux, Request
from kvstore.core.partition import Key
from kvstore.errors import ConfigError, ProtocolError
from kvstore.net import address, transport
from kvstore.net.auth import Channel
from kvstore.net.handshake import register
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.dist")


def join(scheduler: transport.Socket, channel: Channel, cfg: kvconfig.Config, mode: str) -> dict:
    """Register with the scheduler and return the cluster map's body; the socket is closed on failure.

    Raises what registration raises, or :class:`ConfigError` when this worker's batches, or the map's
    chunks, could exceed the map's ``KVSTORE_MAX_MESSAGE_BYTES``: the scheduler is told this worker
    failed (LEAVE with the reason), so the other workers stop too instead of waiting for it.
    """
    try:
        body = register(scheduler, channel, cfg, {"role": "worker", "host": address.advertised_host(cfg),
                                                  "rank": cfg.worker_id, "mode": mode,
                                                  "quorum": cfg.sync_quorum,
                                                  "incarnation": cfg.incarnation,
                                                  **({"join": True} if cfg.join else {})}, "worker").body
    except BaseException:
        transport.close(scheduler)
        raise
    try:
        kvconfig.check_message_limits(body.get("max_message_bytes", 0), body.get("chunk_bytes", 0),
                                      cfg.batch_bytes, source=" (the scheduler's)")
    except ConfigError as exc:
        why = {"failure": f"its settings were refused: {exc}"}
        leave = Message(Op.LEAVE, why, seq=1, sender=body["rank"])
        try:
            transport.send(scheduler, channel.seal(leave, "scheduler"))
        finally:
            transport.close(scheduler, linger=1.0)  # the LEAVE may still leave
        raise
    return body


class WorkerRebind:
    """A worker's side of a scheduler's restart (:class:`kvstore.net.heartbeat.Rebinder`): its identity
    for the re-registration, and its requests to the scheduler held (a barrier, a LEAVE) while no
    scheduler answers, sent again once a restarted one took the worker back (a barrier carries the
    number it passed, so the scheduler answers one released before its death at once)."""

    def __init__(self, io: Mux, cfg: kvconfig.Config, cmap: dict, mode: str,
                 passed: Callable[[], int], left: Callable[[], list[int]],
                 tagged: Callable[[], dict | None] = lambda: None) -> None:
        self._io, self._cfg, self._mode, self._passed, self._left = io, cfg, mode, passed, left
        self._tagged = tagged  # the last tagged membership view it passed (a restarted scheduler keeps it)
        self._map = {k: v for k, v in cmap.items() if k not in ("nonce", "rank", "role")}

    def identity(self) -> dict:
        """The worker's re-registration (scheduler/recovery.py), with its last tagged membership view."""
        return {"role": "worker", "rank": self._io.rank, "incarnation": self._cfg.incarnation,
                "host": address.advertised_host(self._cfg), "mode": self._mode,
                "label": self._io.channel.label, "map": self._map, "passed": self._passed(),
                "left": self._left(), "counters": [[self._io.channel.label, self._io.channel.reserve()]],
                **({"view": view} if (view := self._tagged()) is not None else {})}

    def paused(self) -> None:
        """Hold what goes to the scheduler (its reply would never come)."""
        self._io.hold(SCHEDULER)

    def resumed(self) -> None:
        """Send what was held again, sealed anew, to the restarted scheduler."""
        self._io.release(SCHEDULER)


class Rejoin:
    """A restarted worker's rejoin as its other threads see it: for each server, whether that server
    has yet to count this incarnation (:meth:`pending`), which the realigner tells a server restarted
    meanwhile (kvstore/client/realign.py).  ``restarted``: the map said this worker is a restart."""

    def __init__(self, restarted: bool) -> None:
        self.restarted = restarted
        self.second: dict[int, Request] = {}  # server -> its REJOIN with ``at`` (the second step)
        self.at: int | None = None  # the round it rejoins at (final once no server is pending)
        # the step it learnt (kv.rejoined_at): ``at``, but a dist_async join's, the job's update count
        self.step: int | None = None

    def pending(self, server: int) -> bool:
        """Whether ``server`` has not yet answered this worker's whole rejoin (False for a worker that
        never restarted)."""
        request = self.second.get(server)
        return self.restarted and (request is None or not request.future.done())


def rejoin(io: Mux, servers: int, cmap: dict, request_all: Callable[[list[Request]], list[Message]],
           progress: Rejoin | None = None) -> int | None:
    """A restarted worker's rejoin (the map's ``rejoin``; None for any other map): REJOIN to every
    server, which counts it again from the first round no key has opened there and replies that
    round and the step the worker learns; then REJOIN with ``at``, the highest round, so every server
    counts it from that round of every key (kvstore/core/rejoin.py).  ``progress`` records each
    second step as it is sent, and the highest step (``kv.rejoined_at``: ``at``, but a ``dist_async``
    join's is the job's update count).  Returns ``at``.  Raises what the requests raise
    (DeadlineExceededError after KVSTORE_REQUEST_TIMEOUT), ProtocolError for a reply without a round
    or with a step that is not an int >= 0."""
    if not cmap.get("rejoin"):
        return None
    progress = Rejoin(True) if progress is None else progress
    incarnation = cmap.get("incarnation")
    joining = {"join": True} if cmap.get("join") else {}  # a new member of an elastic job: never scaled for
    what = f"{'join' if joining else 'rejoin'} of incarnation {incarnation} to server"
    replies = request_all([io.submit(i, Message(Op.REJOIN, {"incarnation": incarnation, **joining}),
                                     f"{what} {i}") for i in range(servers)])
    rounds = [reply.body.get("round") for reply in replies]
    if not all(type(r) is int and r >= 0 for r in rounds):
        raise ProtocolError(f"a server answered a REJOIN without a round: {rounds!r}"[:200])
    steps = [reply.body.get("step", r) for reply, r in zip(replies, rounds)]
    if not all(type(s) is int and s >= 0 for s in steps):
        raise ProtocolError(f"a server's REJOIN reply has a step that is not an int >= 0: {steps!r}"[:200])
    progress.at = at = max(rounds, default=0)  # set before any server can answer the second step
    step = max(steps, default=0)
    for i in range(servers):
        progress.second[i] = io.submit(i, Message(Op.REJOIN, {"incarnation": incarnation, "at": at,
                                                              **joining}), f"{what} {i}")
    request_all(list(progress.second.values()))
    progress.step = step
    log.warning("%s the cluster as incarnation %s at round %d%s", "joined" if joining else "rejoined",
                incarnation, at, f" (the job's update count {step})" if step != at else "")
    return at


def after_round(cfg: kvconfig.Config, rank: int, pushes: dict[Key, int],
                compression: WorkerCompression) -> None:
    """After a pull or pushpull: this worker's compression residuals written when due (with the
    servers' shards, ``KVSTORE_SNAPSHOT_EVERY``), then the test hook :func:`die_if_asked`."""
    compression.shards.write_if_due(cfg, rank, pushes)
    die_if_asked(cfg, rank, pushes)


def die_if_asked(cfg: kvconfig.Config, rank: int, pushes: dict[Key, int]) -> None:
    """The test hook ``KVSTORE_TEST_DIE_AT_ROUND=N`` (or ``RANK:N``, that worker only): a first
    incarnation SIGKILLs its own process once it has pushed some key N times and the call that
    waited for that round is done."""
    hook = cfg.test_die_at_round
    if hook is None or cfg.incarnation or not pushes or hook[0] not in (None, rank):
        return
    if max(pushes.values()) >= hook[1]:
        log.warning("KVSTORE_TEST_DIE_AT_ROUND: killing worker %d after round %d (SIGKILL)", rank, hook[1])
        os.kill(os.getpid(), signal.SIGKILL)

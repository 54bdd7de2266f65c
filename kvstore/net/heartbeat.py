"""A node's heartbeat to the scheduler, from a thread (and a socket) of its own.

Every ``KVSTORE_HEARTBEAT_INTERVAL`` the thread sends HEARTBEAT and reads the
replies.  A reply lists the nodes the scheduler has declared lost; with
``report_peers`` (workers) the first one to appear is passed to ``on_lost`` as a
:class:`NodeLostError` naming it, and the thread keeps beating (so the scheduler
does not take this node for lost too).  When no reply has come for
``KVSTORE_HEARTBEAT_TIMEOUT``, the scheduler itself is reported lost the same
way and the thread ends.  It never raises or exits the process: what to do is
the callback's business.  With ``stats``, each beat carries the node's snapshot
(``{"stats": stats()}``, docs/observability.md); a snapshot that fails to build or to
fit a message is left out of that beat (logged once), never the beat itself.  Each reply carries
the scheduler's clock: the round trip feeds :data:`kvstore.net.timeline.CLOCK` (the timeline's
alignment).  On :meth:`stop` one last beat goes out, so the scheduler has the node's final snapshot.

A scheduler that can come back (``KVSTORE_SCHEDULER_RESTARTS``: the local launcher restarts it under
``--max-restarts`` while the budget the replies report lasts) is ridden over: once the scheduler refuses
a beat (a restarted one does not know the session yet) or has not answered for a third of the heartbeat
timeout, the thread re-registers with it (:class:`Rebinder` gives the node's identity; HELLO, CHALLENGE,
REGISTER on a fresh socket) until one takes the node back, and beats on from there; the node's data
path runs on meanwhile.  Only when none has taken it back within the heartbeat timeout is the scheduler
reported lost, as without restarts.

With ``links`` (a worker's :class:`kvstore.net.links.ServerLinks`), once per interval the thread
also reads its liveness connections to the servers: a server partitioned from this node is reported
to ``on_lost`` as one lost, and the thread keeps beating.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvstore import config as kvconfig
from kvstore.errors import (
    AuthenticationError,
    DeadlineExceededError,
    KVStoreError,
    NodeLostError,
    ProtocolError,
)
from kvstore.net import timeline, transport
from kvstore.net.auth import channel_for, heartbeat_label, new_label
from kvstore.net.handshake import register, unsigned_refusal
from kvstore.net.links import ServerLinks
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.heartbeat")


def lost_error(entry: list) -> NodeLostError:
    """The error for one ``[role, rank, host, why]`` entry of a heartbeat reply."""
    role, rank, host, why = entry
    return NodeLostError(f"{role} {rank} on {host} is lost: {why}", role=role, rank=rank, host=host)


class Rebinder(Protocol):
    """What a node gives its heartbeat so it can take its place back with a restarted scheduler."""

    def identity(self) -> dict[str, Any]:
        """The node's re-registration: role, rank, incarnation, host (a server's port), the label its
        requests to the scheduler are sealed with, the cluster map it holds, a worker's barriers passed
        and the workers it knows have left (scheduler/recovery.py)."""
        ...

    def paused(self) -> None:
        """The scheduler stopped answering: hold what would go to it."""
        ...

    def resumed(self) -> None:
        """A scheduler took the node back: send what was held again."""
        ...


class Heartbeat(threading.Thread):
    """Beats for ``(role, rank)`` until :meth:`stop`, or until it reports a loss."""

    def __init__(self, cfg: kvconfig.Config, role: str, rank: int, session: bytes,
                 on_lost: Callable[[NodeLostError], None], report_peers: bool = True,
                 stats: Callable[[], dict] | None = None,
                 on_left: Callable[[list[int]], None] | None = None,
                 on_restarted: Callable[[list], None] | None = None,
                 rebinder: Rebinder | None = None,
                 links: ServerLinks | None = None) -> None:
        super().__init__(name=f"kvstore-heartbeat-{role}{rank}", daemon=True)
        self.cfg, self.role, self.rank, self.on_lost = cfg, role, rank, on_lost
        self.report_peers, self.stats, self.on_left = report_peers, stats, on_left
        self.on_restarted = on_restarted  # servers restarted from their shards (kvstore.client.realign)
        self.links = links  # a worker's liveness connections to the servers (read by this thread only)
        self._stats_failed = False  # a failing snapshot is logged once
        self.channel = channel_for(cfg, heartbeat_label(role, rank))
        self.channel.set_session(session)
        self._stop_event = threading.Event()
        self.lost: NodeLostError | None = None  # what was reported, if anything
        self._seqs = itertools.count(1)
        self._sent = (0, 0.0)  # (seq, unix time) of the last beat sent: its reply measures the clock
        self._away: set[int] = set()  # workers the scheduler says are away (being restarted)
        self.session, self.rebinder = session, rebinder
        self._budget = [0, cfg.max_restarts]  # restarts [used, budget], as the replies last said
        self._refused = False  # the scheduler refused a beat unsigned (a restarted one, without the session)
        self._gap: float | None = None  # when the gap being ridden over began

    def stop(self) -> None:
        """Ask the thread to end (it does within one interval)."""
        self._stop_event.set()

    def _report(self, error: NodeLostError) -> None:
        if self.lost is not None:
            return  # one report is enough: the node is failed from then on
        self.lost = error
        log.error("%s", error)
        try:
            self.on_lost(error)
        except Exception:  # noqa: BLE001 - a failing callback must not kill the heartbeat silently
            log.exception("the node-lost callback failed")

    def run(self) -> None:
        sock = transport.connect_dealer(self.cfg.root_address, curve=transport.curve_keys(self.cfg))
        interval, timeout = self.cfg.heartbeat_interval, self.cfg.heartbeat_timeout
        heard = time.monotonic()
        gap: float | None = None  # when the scheduler fell silent, while a restarted one is awaited
        try:
            if self.links is not None:
                self.links.check(heard)  # makes the links: up before the first request is answered
            last, beat_s, links_s = None, 0.0, 0.0  # the previous beat: when, how long it took to send,
            while not self._stop_event.is_set():  # and how long the links check after it took
                started = time.monotonic()
                last = self._note_late(last, started, beat_s, links_s)
                transport.send(sock, self._beat())
                beat_s = time.monotonic() - started
                if self._listen(sock, interval):
                    heard = time.monotonic()
                if self._may_rebind() and (self._refused or time.monotonic() - heard > timeout / 3):
                    gap = heard if gap is None else gap
                    within = max(0.5, min(2 * interval, timeout - (time.monotonic() - heard)))
                    new = self._ride_over(gap, within)
                    if new is not None:
                        transport.close(sock)
                        sock, heard, gap, last = new, time.monotonic(), None, None  # not late: rebound
                        continue
                if self.links is not None and self.lost is None:
                    checked = time.monotonic()
                    partitioned = self.links.check(heard)
                    links_s = time.monotonic() - checked
                    if partitioned is not None:
                        self._report(partitioned)
                if time.monotonic() - heard > timeout:
                    why = "" if gap is None else ", and no restarted scheduler took this node back"
                    self._report(NodeLostError(
                        f"scheduler at {self.cfg.root_address} is lost: no heartbeat reply for "
                        f"{timeout:g} s (KVSTORE_HEARTBEAT_TIMEOUT){why}", role="scheduler", rank=0,
                        host=self.cfg.root_uri))
                    return
            transport.send(sock, self._beat())  # the last one: the final snapshot
            sock.poll(int(min(interval, 0.5) * 1000))  # its reply: it has been read by the scheduler
        except KVStoreError as exc:  # the socket broke: as good as a silent scheduler
            self._report(NodeLostError(f"scheduler at {self.cfg.root_address} is lost: {exc}",
                                       role="scheduler", rank=0, host=self.cfg.root_uri))
        finally:
            transport.close(sock)
            if self.links is not None:
                self.links.close()

    def _note_late(self, last: float | None, started: float, beat_s: float, links_s: float) -> float:
        """Log a beat that goes out more than half a heartbeat timeout late (what held this node's
        heartbeat thread, before the scheduler names it lost); returns the beat's time.  ``beat_s`` and
        ``links_s``: the previous beat's building and sending, and the links check after it."""
        interval, timeout = self.cfg.heartbeat_interval, self.cfg.heartbeat_timeout
        if last is not None and started - last > interval + timeout / 2:
            log.warning("this node's heartbeat went out %.2f s after the previous one (every %g s expected; "
                        "a node silent for %g s is lost): the previous beat took %.2f s to send, the check "
                        "of the server links %.2f s; the rest is this process not running its heartbeat "
                        "thread (CPU starvation, a long hold of the GIL)", started - last, interval, timeout,
                        beat_s, links_s)
        return started

    def _listen(self, sock: Any, interval: float) -> bool:
        """Read replies for one interval (in short slices: stop() is quick); True if the scheduler's came."""
        heard = False
        deadline = time.monotonic() + interval
        while (left := deadline - time.monotonic()) > 0 and not self._stop_event.is_set():
            if not sock.poll(int(min(left, 0.1) * 1000) + 1):
                continue
            try:
                frames = transport.recv(sock)
            except ProtocolError as exc:
                log.warning("dropped a bad heartbeat reply: %s", exc)
                continue
            heard = self._read(frames) or heard
        return heard

    def _ride_over(self, gap: float, within: float) -> Any:
        """The scheduler is silent since ``gap`` (or refused us): hold the node's requests to it (first
        time) and try one re-registration; the new socket once a scheduler took the node back, else None."""
        if self._gap != gap:  # a new gap
            self._gap = gap
            log.warning("the scheduler at %s has not answered for %.1f s: waiting for its restart to take "
                        "this node back (KVSTORE_SCHEDULER_RESTARTS)", self.cfg.root_address,
                        time.monotonic() - gap)
            self.rebinder.paused()  # type: ignore[union-attr]
        new = self._rebind(within)
        if new is not None:
            self._refused, self._gap = False, None
            log.warning("re-registered with the restarted scheduler %.2f s after it fell silent",
                        time.monotonic() - gap)
            self.rebinder.resumed()  # type: ignore[union-attr]
        return new

    def _may_rebind(self) -> bool:
        """Whether a lost scheduler may come back: the launcher restarts it and the budget lasts."""
        used, budget = self._budget
        return self.rebinder is not None and self.cfg.scheduler_restarts and used < budget \
            and self.lost is None

    def _rebind(self, within: float) -> Any:
        """One re-registration, on a fresh socket, within ``within`` seconds: the socket (now this
        heartbeat's) once a scheduler took the node back; None when none answered (tried again).
        A refusal (another cluster, a rank not ours) is reported as the scheduler's loss."""
        sock = transport.connect_dealer(self.cfg.root_address, curve=transport.curve_keys(self.cfg))
        channel = channel_for(self.cfg, new_label(f"{self.role}{self.rank}-rebind"))
        body = dict(self.rebinder.identity(), session=self.session, used=self._budget[0],  # type: ignore[union-attr]
                    away=sorted(self._away))
        body["counters"] = [*body.get("counters", []), [self.channel.label, self.channel.reserve()]]
        try:
            register(sock, channel, dataclasses.replace(self.cfg, connect_timeout=within), body, self.role)
        except DeadlineExceededError:
            transport.close(sock)
            return None
        except KVStoreError as exc:
            transport.close(sock)
            self._report(NodeLostError(f"scheduler at {self.cfg.root_address} is lost: its restart refused "
                                       f"this node: {exc}", role="scheduler", rank=0, host=self.cfg.root_uri))
            return None
        return sock

    def _beat(self) -> list:
        """The sealed frames of one HEARTBEAT, with this node's snapshot when it builds and fits."""
        body = {"role": self.role, "rank": self.rank}
        seq = next(self._seqs)
        self._sent = (seq, time.time())
        if self.stats is not None:
            try:
                return self.channel.seal(Message(Op.HEARTBEAT, dict(body, stats=self.stats()),
                                                 seq=seq, sender=self.rank), "scheduler")
            except Exception as exc:  # noqa: BLE001 - a broken snapshot must not stop the beats
                if not self._stats_failed:
                    self._stats_failed = True
                    log.warning("heartbeats go without this node's stats: %s", str(exc)[:300])
        return self.channel.seal(Message(Op.HEARTBEAT, body, seq=seq, sender=self.rank), "scheduler")

    def _told_away(self, away: set[int]) -> None:
        """Log each worker that went away (lost, being restarted: docs/failures.md) or came back."""
        for rank in sorted(away - self._away):
            log.warning("worker %d is lost and being restarted: sync rounds close without it, scaled as "
                        "a quorum of the rest, until it rejoins", rank)
        for rank in sorted(self._away - away):
            log.info("worker %d is no longer away", rank)
        self._away = away

    def _read(self, frames: list) -> bool:
        """Handle one reply (True if it was the scheduler's): report the first lost node it names."""
        try:
            reply = self.channel.open(frames)
        except (AuthenticationError, ProtocolError) as exc:
            if unsigned_refusal(frames) is not None and self._may_rebind():
                self._refused = True  # a scheduler that does not know the session: a restarted one
                return False
            log.warning("dropped a bad heartbeat reply: %s", exc)
            return False
        if reply.op is Op.ERROR and self._may_rebind():  # a restarted scheduler that wants us back first
            self._refused = True
            return False
        budget = reply.body.get("restarts") if reply.op is Op.OK else None
        if isinstance(budget, list) and len(budget) == 2 and all(type(n) is int for n in budget):
            self._budget = budget
        left = reply.body.get("left") if reply.op is Op.OK else None
        if self.on_left is not None and isinstance(left, list) and all(type(r) is int for r in left):
            self.on_left(left)  # the workers that have left (a worker's beats only)
        restarted = reply.body.get("restarted") if reply.op is Op.OK else None
        if self.on_restarted is not None and isinstance(restarted, list):
            self.on_restarted(restarted)
        away = reply.body.get("away") if reply.op is Op.OK else None
        if isinstance(away, list) and all(type(r) is int for r in away):
            self._told_away(set(away))
        remote = reply.body.get("time") if reply.op is Op.OK else None
        if reply.seq == self._sent[0] and isinstance(remote, float):
            timeline.CLOCK.observe(self._sent[1], time.time(), remote)
        lost = reply.body.get("lost") if reply.op is Op.OK else None
        if not lost or not self.report_peers or self.lost is not None:
            return True
        try:
            error = lost_error(lost[0])
        except (TypeError, ValueError):
            log.warning("dropped a heartbeat reply with a malformed loss: %r", lost[0])
            return True
        self._report(error)
        return True

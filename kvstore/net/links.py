"""A worker's liveness check of its path to each server: a partition between the two is named within
the heartbeat deadline (docs/failures.md, "What fails").

Heartbeats go to the scheduler only, so a worker and a server that both still reach it, but not each
other, are no lost node to it.  :class:`ServerLinks` keeps one more connection to each server that
carries no message at all, only zmq's own heartbeats (``transport.connect_watch``): libzmq's I/O
threads ping every ``KVSTORE_HEARTBEAT_INTERVAL`` and answer pings outside Python, so a server busy
in its request loop (a long optimizer step, a big value being copied) still answers, and no data
message ever waits behind a ping.  zmq drops that connection when it has heard nothing for
``KVSTORE_HEARTBEAT_TIMEOUT``; the data connection is never touched (TCP keeps retrying it, so a
shorter partition heals with nothing lost).

The worker's heartbeat thread calls :meth:`ServerLinks.check` once per interval.  A dropped link
(:class:`Link`) is judged by a plain TCP connect to the server's port:

- refused: the host answers and nothing listens there: the server's process is gone, which the
  scheduler names (lost, or restarted: ``kvstore.client.realign`` then moves the link, :meth:`moved`);
- it opens: the path is back (zmq reconnects the link); nothing was lost on the data connection;
- no answer (no route, or no reply within the probe's time): partitioned, reported once a reply of
  the scheduler has come after the drop was seen without naming the server lost (the scheduler
  still hears both), as a :class:`NodeLostError` naming the server.

No per-message work: a worker's requests never look at this.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError, NodeLostError
from kvstore.net import transport
from kvstore.net.address import REACHABLE, REFUSED, UNREACHABLE, probe, zmq_host_port
from kvstore.net.curve import CurveKeys

log = logging.getLogger("kvstore.links")
Reach = Callable[[str, float], str]  # (address, timeout) -> REACHABLE, REFUSED or UNREACHABLE


@dataclass
class Link:
    """What a worker knows of its liveness connection to one server (pure logic: no sockets)."""

    address: str
    opened: float = 0.0  # when it was made (monotonic)
    up: bool = False  # its handshake is done and it has not dropped since
    ever_up: bool = False
    down_at: float | None = None  # when its drop was seen (monotonic); None while up or not yet judged
    gone: bool = False  # dropped with the server's port closed: its process is gone (the scheduler's)

    def saw(self, up: bool, now: float) -> None:
        """A monitor event: the connection ``up`` (handshake done) or dropped, seen at ``now``."""
        if up:
            self.up, self.ever_up, self.down_at, self.gone = True, True, None, False
        elif self.up:  # a drop of a connection that never came up is no news (see waited)
            self.up, self.down_at, self.gone = False, now, False

    def waited(self, now: float, timeout: float) -> None:
        """A link that has never come up within ``timeout`` s of being made counts as dropped now (a
        partition from before it was made, or a server that never answered)."""
        if not self.ever_up and self.down_at is None and now - self.opened >= timeout:
            self.down_at = now

    def partitioned(self, probe: Callable[[], str], heard: float) -> bool:
        """Whether the server is partitioned from this worker: its link dropped (zmq heard nothing for
        the heartbeat timeout), ``probe()`` finds it unreachable, and the scheduler's last reply
        (``heard``, monotonic) came after the drop was seen.  A refused probe marks it gone."""
        if self.down_at is None or self.gone or heard <= self.down_at:
            return False  # no scheduler reply since the drop: nothing to judge yet, and no probe to wait on
        found = probe()
        if found == REFUSED:
            self.gone = True
            return False
        return found == UNREACHABLE


@dataclass
class _Watched:
    link: Link
    sock: transport.Socket
    monitor: transport.Socket


class ServerLinks:
    """The liveness connections of one worker to its servers (see the module docstring).

    ``addresses``: each server's, by index; ``interval`` and ``timeout``: the heartbeat's settings;
    ``curve``: the cluster's CURVE keys (None: plain); ``reach``: the probe of a dropped link (tests may
    give another).  :meth:`check` and :meth:`close` belong to the heartbeat thread (the sockets are
    made there); :meth:`moved` may be called from any thread.
    """

    def __init__(self, addresses: Sequence[str], interval: float, timeout: float,
                 curve: CurveKeys | None = None, reach: Reach = probe) -> None:
        self.interval, self.timeout, self.curve, self.reach = interval, timeout, curve, reach
        self._targets = dict(enumerate(addresses))  # server index -> its address (moved() changes it)
        self._watched: dict[int, _Watched] = {}  # the heartbeat thread's
        self._lock = threading.Lock()  # _targets

    def moved(self, index: int, address: str) -> None:
        """Server ``index`` now listens at ``address`` (a restart): watch that from the next check."""
        with self._lock:
            self._targets[index] = address

    def check(self, heard: float) -> NodeLostError | None:
        """Read every link's events and judge the dropped ones (``heard``: the scheduler's last reply,
        monotonic); the error naming the first partitioned server, or None."""
        with self._lock:
            targets = dict(self._targets)
        probes = [0]  # one probe (at most 0.5 s) per check: many dropped links must not hold the beats

        def budgeted(address: str) -> str:
            if probes[0]:
                return REACHABLE  # judged at a later check: its drop stays recorded
            probes[0] += 1
            return self.reach(address, min(self.interval, 0.5))
        for index, address in targets.items():
            watched = self._watched.get(index)
            if watched is None or watched.link.address != address:
                if watched is not None:
                    transport.close_watch(watched.sock, watched.monitor)
                    del self._watched[index]
                try:
                    sock, monitor = transport.connect_watch(address, self.interval, self.timeout, self.curve)
                except ConfigError as exc:  # never fails the heartbeat: the data path names the address
                    log.warning("server %d is not watched for partitions: %s", index, exc)
                    continue
                watched = self._watched[index] = _Watched(Link(address, time.monotonic()), sock, monitor)
            now = time.monotonic()
            for up in transport.watch_events(watched.monitor):
                watched.link.saw(up, now)
            watched.link.waited(now, self.timeout)
            was_gone = watched.link.gone
            probing = functools.partial(budgeted, address)
            if watched.link.partitioned(probing, heard):
                host, _ = zmq_host_port(address)
                return NodeLostError(
                    f"server {index} at {address} is partitioned from this worker (the scheduler still "
                    f"hears both): its connection heard nothing for {self.timeout:g} s "
                    f"(KVSTORE_HEARTBEAT_TIMEOUT) and it cannot be reached", role="server", rank=index,
                    host=host)
            if watched.link.gone and not was_gone:
                log.info("server %d at %s closed its port: its process is gone (the scheduler names its "
                         "loss or restart)", index, address)
        return None

    def close(self) -> None:
        """Close every link (the heartbeat thread, on its way out)."""
        for watched in self._watched.values():
            transport.close_watch(watched.sock, watched.monitor)
        self._watched.clear()

"""A worker's sockets, driven by the threads that use them (no I/O thread of their own).

zmq sockets are not thread-safe, so one lock (``_io``) guards them; whoever holds
it sends what is queued and receives what has arrived.  A call that sends takes the
lock if it is free and sends at once; if another thread holds it, the message waits
in the outbox and a wake-up byte makes the holder send it.  A call that waits for
replies becomes the *leader* when the lock is free: it polls every socket, matches
replies to requests by ``seq`` and resolves their futures (its own and other
threads'), until its own reply is in.  Other waiting threads wait on their futures
and take over when the leader is done.  Compared with a dedicated I/O thread this
saves two thread switches per request, which on a busy machine is most of a small
request's round trip (docs/benchmarks.md).

The outbox (:class:`~kvstore.client.sendqueue.SendQueue`) sends the highest ``priority`` first,
never a request ahead of an earlier one sharing a key; messages are sealed as they leave it, so each
receiver sees the channel's numbers rise.  A call that finds nothing queued and the lock free seals
and sends at once (the common case, as cheap as before priorities).  A big push's chunks beyond the
call's first :data:`PACE_BYTES` are queued without being sent (``defer``): each later call sends up to
that much more, a waiting caller sends everything, and the heartbeat's :meth:`Mux.nudge` sends what
nobody sent since its last beat; meanwhile a later call's message of higher priority goes first.

A push may be *parked* (``submit(..., park=True)``, ``kvstore.client.datapath`` decides which): its
request is made but not sent, so that a pull of the same keys to the same server, if it is the next
call, takes it along (:meth:`Mux.send_parked_as`: one request and one reply for
both).  Anything else this Mux is asked to do first sends the parked push as it is: another submit,
a wait, :meth:`hold`, the heartbeat's :meth:`nudge`; and so does the releaser thread, which a park
wakes (a lock it blocks on, no timer): it runs as soon as the caller's thread lets the GIL go (a
blocking call, I/O, a sleep, a numpy or torch kernel) or, if the caller runs Python all along, after
the interpreter's switch interval (5 ms).  A caller that pulls right after pushing holds the GIL until
its pull has taken the push; one that does anything else has it sent at once (docs/benchmarks.md).

Replies nobody waits for yet (a push's ack) stay in zmq's queue until the next call
that sends or waits reads them.  :meth:`Mux.fail` (a lost peer, from the heartbeat
thread) fails every request in flight at once, without the socket lock.

Tests only: a Mux made with ``tamper`` (``kvstore.client.store.connect(..., tamper=...)``) applies it
to each message's frames after they are sealed and just before they are sent, so a test can damage a
message in flight, e.g. flip one array byte of a push to exercise ``KVSTORE_AUTH=full``.  The send is
chosen once, when the Mux is made: without ``tamper`` it is ``transport.send`` itself, at no cost.
"""

from __future__ import annotations

import itertools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.client.sendqueue import SendQueue
from kvstore.errors import (
    AuthenticationError,
    DeadlineExceededError,
    IntegrityError,
    NodeLostError,
    ProtocolError,
    StoreClosedError,
    error_from_code,
)
from kvstore.net import transport
from kvstore.net.auth import Channel, decode
from kvstore.net.protocol import Message, Op
from kvstore.net.shm import Segment
from kvstore.net.unixlink import UnixLink

log = logging.getLogger("kvstore.dist")
SCHEDULER = -1  # target index of the scheduler socket; servers are 0..S-1
_SLICE = 0.05  # a leader re-checks closing and its deadline at least this often (seconds)
_FOLLOW = 0.002  # a waiting non-leader checks whether it may lead this often (seconds)
_READ_AHEAD = 256  # with this many requests in flight, a sender also reads the replies that are in
# A call that sends hands at most this many bytes of arrays to the sockets itself (at least one message);
# the rest of its messages (a big value's chunks) wait in the outbox for the next call, a thread that
# waits for a reply, or the next heartbeat, so a later request of higher priority can go between them.
PACE_BYTES = 8 << 20
Tamper = Callable[[list], list]  # tests only: a message's sealed frames -> the frames sent instead


class SharedLanes(Protocol):
    """What a Mux asks of same-host shared memory (``kvstore.client.shmlanes.Lanes``)."""

    segments: dict[int, Segment]  # by server index

    def place(self, target: int, msg: Message, reply_bytes: int = 0,
              chunk: tuple[int, int] | None = None) -> Callable[[Any], None] | None:
        """Move ``msg``'s big arrays into ``target``'s segment; the callback that frees them, or None."""

    def resolver(self, target: int) -> Callable[[int, int], Any]:
        """The resolver of replies ``target`` wrote into its segment."""


def _tampered(tamper: Tamper) -> Callable[[transport.Socket, list], bool]:
    """``transport.send`` of the frames ``tamper`` makes of each message's (tests only)."""
    def send(sock: transport.Socket, frames: list) -> bool:
        return transport.send(sock, tamper(frames))
    return send


@dataclass
class Request:
    """One message in flight, the future its reply resolves, and (until then) where it went and what it
    was, so it can be sent again to a restarted server (:meth:`Mux.hold`)."""

    what: str
    future: Future = field(default_factory=Future)
    target: int = SCHEDULER
    msg: Message | None = None


@dataclass
class Parked:
    """A parked push (:meth:`Mux.submit` with ``park``): its request, made but not sent, and what
    sending it needs."""

    request: Request
    target: int
    nbytes: int
    priority: int
    keys: Any


class Mux:
    """The scheduler socket and one socket per server of a worker; see the module docstring."""

    def __init__(self, scheduler: transport.Socket, servers: list[transport.Socket], rank: int,
                 channel: Channel, max_frame_bytes: int = 0, names: dict[int, str] | None = None,
                 tamper: Tamper | None = None) -> None:
        self.sockets = {SCHEDULER: scheduler, **dict(enumerate(servers))}
        self.rank = rank
        self.max_frame_bytes = max_frame_bytes  # the cluster's KVSTORE_MAX_MESSAGE_BYTES (0: none)
        self.channel = channel  # seals every request, opens every reply
        self._send = transport.send if tamper is None else _tampered(tamper)  # tests only: the docstring
        self._tamper = tamper
        self.heartbeat_thread: int | None = None  # its ident (set by the store): it never waits on a link
        self._link_pending = False  # a link holds bytes the heartbeat's send left (the leader sends them)
        self._spares: dict[int, transport.Socket] = {}  # zmq sockets of servers reached over a link
        self._io = threading.Lock()  # the sockets (and the outbox's order on the wire)
        self._lock = threading.Lock()  # seq, sealing order, the in-flight table, failure, closing
        self._outbox = SendQueue()  # (target, request, seq, nbytes), unsealed, by priority (_lock)
        self.pace_bytes = PACE_BYTES  # a sending call's share of the outbox (the module constant)
        self._moved = 0  # messages sent so far (nudge: was anything sent since the last beat?)
        self._nudged = -1  # _moved at the last nudge
        self._inflight: dict[int, Request] = {}
        self._seq = itertools.count(1)
        self.failure: BaseException | None = None  # set by fail(): the cluster is broken (read it only)
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.lanes: SharedLanes | None = None  # same-host shared memory (set_lanes)
        self._resolvers: dict[transport.Socket, Callable] = {}  # socket -> its shared-memory resolver
        self.names = dict(names or {})  # a restarted server's name (net.auth.server_name) by index
        self._held: dict[int, list[Request]] = {}  # restarted servers' requests, until they align
        # (index, new socket) for the holder of _io to put in
        self._swaps: list[tuple[int, transport.Socket]] = []
        self._retired: set[transport.Socket] = set()  # swapped out: a poll result naming one is skipped
        # a push parked for a pull to take along; it stays here until it is sent or taken, so a thread
        # that finds it here waits (_park) until another thread sending it has sent it
        self._parked: Parked | None = None
        self._park = threading.Lock()  # taking or sending the parked push (never held with _lock wanted)
        self._gate = threading.Lock()  # released by each park: the releaser thread's wake-up
        self._gate.acquire()
        self._releaser: threading.Thread | None = None  # started by the first park
        self._poller = transport.Poller()
        self._poller.add(self._wake_r.fileno())
        for sock in self.sockets.values():
            self._poller.add(sock)

    def cancelled(self) -> bool:
        """Whether the store failed or closed (a link's send that waits gives up then)."""
        return self._closed or self.failure is not None

    def use_link(self, target: int, link: UnixLink | None) -> None:
        """Send everything for server ``target`` over ``link`` (kvstore.net.unixlink) from now on, its
        zmq socket still read; None: back to that socket (the link is closed).  Call it with nothing in
        flight to ``target`` (kvstore.client.unixlinks.attach does), so no message overtakes another."""
        with self._io:
            if self._swaps:
                self._apply_swaps()
            current = self.sockets[target]
            if link is not None:
                self._spares[target] = current
                self.sockets[target] = link
                self._poller.add(link)
                resolver = self._resolvers.pop(current, None)
                if resolver is not None:
                    self._resolvers[link] = resolver
            elif isinstance(current, UnixLink):
                self._unlink(target)

    def _unlink(self, target: int) -> None:
        """Put server ``target``'s zmq socket back in place of its link, which is closed (the caller
        holds ``_io``).  Its requests in flight stay in flight (a server that died: held and resent on
        its restart, or failed with its loss; a live one answers what it read over zmq from now on), but
        a LINK sent over it is failed: the link it asked for is gone."""
        link = self.sockets[target]
        if link not in self._retired:
            self._poller.remove(link)
            self._retired.add(link)
        link.close()
        spare = self._spares.pop(target)
        self.sockets[target] = spare
        resolver = self._resolvers.pop(link, None)
        if resolver is not None:
            self._resolvers[spare] = resolver
        with self._lock:
            asked = [(seq, r) for seq, r in self._inflight.items()
                     if r.target == target and r.msg is not None and r.msg.op is Op.LINK]
            for seq, _ in asked:
                del self._inflight[seq]
        for _, request in asked:
            _resolve(request, exc=NodeLostError(f"server {target} closed the link before binding it"))
        log.info("server %d is reached over zmq again: its link is closed", target)

    def set_lanes(self, lanes: SharedLanes | None) -> None:
        """Move big arrays to and from the servers of ``lanes`` (kvstore.client.shmlanes) in shared memory;
        None: no more (the segments go once no received array views them)."""
        self.lanes = lanes
        segments = {} if lanes is None else lanes.segments
        self._resolvers = {self.sockets[t]: lanes.resolver(t) for t in segments}

    # -- sending ----------------------------------------------------------------------------------
    def submit(self, target: int, msg: Message, what: str, after_failure: bool = False,
               reply_bytes: int = 0, chunk: tuple[int, int] | None = None, bypass: bool = False,
               priority: int = 0, keys: tuple | None = None, defer: bool = False,
               park: bool = False) -> Request:
        """Send ``msg`` to ``target`` (a server index or SCHEDULER); return its request.

        ``priority`` orders it among the requests waiting to be sent; ``keys`` (the keys it carries;
        None: a control message) keeps call order per key (``kvstore.client.sendqueue``); ``defer``
        leaves it in the outbox (a paced chunk, sent by the next call, a waiting thread or the
        heartbeat's :meth:`nudge`).  When nothing waits to be sent and the sockets are free, it is
        sealed and sent at once; otherwise it is sealed when it leaves the outbox, and an error
        sealing it then fails the request.  ``park``: a push a pull may take along (the module
        docstring); it is not sent yet.  A parked push is sent before ``msg``.

        After :meth:`fail`, the request is failed at once with that error, unless
        ``after_failure`` (a LEAVE still goes out, so the scheduler can finish).  ``reply_bytes``: the
        size of the reply's array, which a same-host server may write into shared memory; ``chunk``: a
        chunk's place in its piece (``kvstore.client.shmlanes.chunk_of``).  A request to a server on
        hold (:meth:`hold`) waits, unsealed, for :meth:`release`, unless ``bypass``.
        Raises :class:`StoreClosedError` after :meth:`stop`, :class:`ProtocolError` (nothing sent)
        for an array bigger than the cluster's frame limit, which the receiver would disconnect.
        """
        limit = self.max_frame_bytes
        if limit and any(a.nbytes > limit for a in msg.arrays):  # planned messages never are
            big = max(a.nbytes for a in msg.arrays)
            raise ProtocolError(f"{what}: an array of {big} bytes exceeds the cluster's "
                                f"KVSTORE_MAX_MESSAGE_BYTES={limit}; it was not sent")
        request = Request(what, target=target, msg=msg)
        nbytes = sum(a.nbytes for a in msg.arrays) if msg.arrays else 0  # before place() moves them
        release = None if self.lanes is None else self.lanes.place(target, msg, reply_bytes, chunk)
        if release is not None:  # the ranges stay reserved until the request is answered
            request.future.add_done_callback(release)
        msg.sender = self.rank
        if park and self.failure is None:
            if self._closed:
                raise StoreClosedError(f"{what}: the store is closed")
            with self._park:  # the push parked before, if any, is sent first
                self._send_parked_locked()
                self._parked = Parked(request, target, nbytes, priority, keys)
            if self._releaser is None:
                self._start_releaser()
            try:
                self._gate.release()  # the releaser sends it unless a pull takes it first
            except RuntimeError:
                pass  # released already: the releaser has not run since
            return request
        if self._parked is not None:  # a parked push goes first, as the call before this one
            self._unpark()
        self._dispatch(target, request, after_failure, bypass, nbytes, priority, keys, defer)
        return request

    def _dispatch(self, target: int, request: Request, after_failure: bool = False, bypass: bool = False,
                  nbytes: int = 0, priority: int = 0, keys: tuple | None = None, defer: bool = False) -> None:
        """Send ``request`` now if nothing waits to be sent and the sockets are free, else queue it
        (:meth:`submit`).  Raises what sealing raises and StoreClosedError."""
        if not defer and not self._outbox and self._io.acquire(blocking=False):
            try:  # nothing waits to be sent: seal and send it now, in this thread (the common case)
                self._send_now(target, request, request.what, after_failure, bypass, nbytes, priority, keys)
            finally:
                self._io.release()
            if self._outbox or self._swaps:  # another thread's, queued while we held the sockets
                self._pump()
            return
        with self._lock:
            if self._admit(target, request, request.what, after_failure, bypass):
                self._enqueue(target, request, nbytes, priority, keys)
        if not defer:
            self._pump()

    # -- a parked push -------------------------------------------------------------------------------
    def send_parked_as(self, target: int, keys: Any, op: Op, priority: int = 0,
                       before: Callable[[Request], None] | None = None) -> Request | None:
        """If the parked push goes to ``target`` with exactly ``keys``, send it now as ``op`` (a pull of
        them takes it along) at the higher of its priority and ``priority``, ``before(request)`` first,
        and return its request; else None, any parked push being sent first as it is.  The push leaves
        its slot only once sent or queued (as :meth:`_send_parked_locked`), so a call from another
        thread, or the realigner's :meth:`hold`, finds it there and waits for it.  A failure to send it
        fails its request (its caller's wait raises it)."""
        with self._park:
            parked = self._parked
            if parked is None or parked.target != target or not (parked.keys is keys or parked.keys == keys):
                self._send_parked_locked()
                return None
            request, msg = parked.request, parked.request.msg
            try:
                if msg is not None:  # None: fail() or stop() resolved it meanwhile (its future says why)
                    if before is not None:
                        before(request)
                    msg.op = op
                    self._dispatch(target, request, nbytes=parked.nbytes,
                                   priority=max(priority, parked.priority), keys=parked.keys)
            except Exception as exc:  # noqa: BLE001 - the request's failure, raised by its caller's wait
                _resolve(request, exc=exc)
            finally:
                self._parked = None
            return request

    def _unpark(self) -> None:
        """Send the parked push, if any, as it is; returns once it is sent or queued, whichever
        thread sends it."""
        with self._park:
            self._send_parked_locked()

    def _send_parked_locked(self) -> None:
        """Send the parked push, if any (the caller holds ``_park``); it leaves the slot once sent
        or queued, or failed (fail(), stop() may have taken it meanwhile).  A failure to send it
        (sealing, a closed store) fails its request, never the call that sends it."""
        parked = self._parked
        if parked is None:
            return
        try:
            self._dispatch(parked.target, parked.request, nbytes=parked.nbytes, priority=parked.priority,
                           keys=parked.keys)
        except Exception as exc:  # noqa: BLE001 - the push's own failure, raised by its key's next call
            _resolve(parked.request, exc=exc)
        finally:
            self._parked = None

    def _start_releaser(self) -> None:
        """Start the thread that sends a parked push nobody took (see the module docstring)."""
        with self._lock:
            if self._releaser is not None:
                return
            self._releaser = threading.Thread(target=self._release_parked, name="kvstore-parked-push",
                                              daemon=True)
        self._releaser.start()

    def _release_parked(self) -> None:
        """The releaser thread: each time a park opens the gate, send the parked push if it is still
        there; ends when the Mux is stopped."""
        gate = self._gate
        while True:
            gate.acquire()
            if self._closed:
                return
            parked = self._parked
            if parked is None:
                continue  # taken by its pull, or sent by a later call
            if not self._park.acquire(blocking=False):
                continue  # another thread is sending it, taking it or parking the next (which wakes us)
            try:  # only the push it woke for: a later park opened the gate again for its own
                if self._parked is parked:
                    self._send_parked_locked()  # a failure fails the push's request, not this thread
            finally:
                self._park.release()

    def _admit(self, target: int, request: Request, what: str, after_failure: bool, bypass: bool) -> bool:
        """Whether ``request`` may be sent now (the caller holds ``_lock``): else it is failed (after
        :meth:`fail`) or held (:meth:`hold`).  Raises StoreClosedError after :meth:`stop`."""
        if self._closed:
            raise StoreClosedError(f"{what}: the store is closed")
        if self.failure is not None and not after_failure:
            _resolve(request, exc=self.failure)
            return False
        if target in self._held and not bypass:
            self._held[target].append(request)
            return False
        return True

    def _send_now(self, target: int, request: Request, what: str, after_failure: bool, bypass: bool,
                  nbytes: int, priority: int, keys: tuple | None) -> None:
        """Seal and send ``request`` at once, or queue it if another thread queued one meanwhile (the
        caller holds ``_io``).  Raises what sealing raises (nothing sent) and StoreClosedError."""
        if self._swaps:
            self._apply_swaps()
        with self._lock:
            if not self._admit(target, request, what, after_failure, bypass):
                return
            if self._outbox:  # queued by another thread since we looked: it goes first
                self._enqueue(target, request, nbytes, priority, keys)
                return
            msg = request.msg
            seq = msg.seq = next(self._seq)
            try:
                frames = self.channel.seal(msg, self._name(target))
            except Exception as exc:  # nothing sent: the caller gets it; its shared memory is freed
                _resolve(request, exc=exc)
                raise
            self._inflight[seq] = request
        self._send_or_fail(target, frames, seq)
        if len(self._inflight) > _READ_AHEAD:  # a long run of pushes nobody waits for
            for sock in self.sockets.values():
                self._receive(sock)

    def _send_or_fail(self, target: int, frames: list[Any], seq: int) -> None:
        """Send sealed ``frames`` of request ``seq`` to ``target``; a failure fails that request (its
        waiting caller gets it), never the sender."""
        self._moved += 1
        sock = self.sockets[target]
        try:
            if type(sock) is UnixLink:
                self._send_linked(target, sock, frames)
            else:
                self._send(sock, frames)
        except Exception as exc:  # surface to the waiting caller
            with self._lock:
                found = self._inflight.pop(seq, None)
            if found is not None:
                _resolve(found, exc=exc)

    def _send_linked(self, target: int, link: UnixLink, frames: list[Any]) -> None:
        """Send over server ``target``'s link (the caller holds ``_io``); the heartbeat's thread never
        waits on it.  A link that is closed (or breaks) is replaced by the server's zmq socket, and the
        message goes there (a dead server's restart or loss ends it as on zmq).  Raises
        DeadlineExceededError when the server did not read it in time (the link is replaced too)."""
        if self._tamper is not None:
            frames = self._tamper(frames)
        try:
            sent = link.send(frames, threading.get_ident() != self.heartbeat_thread)
        except DeadlineExceededError:
            self._unlink(target)
            raise
        if not sent:
            self._unlink(target)
            self._send(self.sockets[target], frames)
        elif link.pending:
            self._link_pending = True

    def _name(self, target: int) -> str:
        """The name ``target`` is sealed for (the scheduler, or a server's current name)."""
        return "scheduler" if target == SCHEDULER else self.names.get(target) or f"server{target}"

    def _enqueue(self, target: int, request: Request, nbytes: int = 0, priority: int = 0,
                 keys: tuple | None = None) -> None:
        """Number ``request`` and queue it, unsealed (the caller holds ``_lock``): it is sealed when
        sent (:meth:`_flush`), so each receiver sees the channel's numbers rise in the order sent."""
        seq = request.msg.seq = next(self._seq)
        self._inflight[seq] = request
        self._outbox.put((target, request, seq, nbytes), priority, keys)

    # -- a restarted server (kvstore.client.realign) ------------------------------------------------
    def hold(self, target: int) -> None:
        """Keep every unanswered request to server ``target``, and every later one, for :meth:`release`:
        their replies from the lost server never come; what they went out as is ignored from now on."""
        if self._parked is not None:
            self._unpark()
        with self._lock:
            if target in self._held:
                return
            mine = sorted((seq, r) for seq, r in self._inflight.items() if r.target == target)
            for seq, _ in mine:
                del self._inflight[seq]
            self._held[target] = [request for _, request in mine]

    def held(self, target: int) -> list[Message]:
        """The messages of the requests held for ``target``, oldest first."""
        with self._lock:
            return [r.msg for r in self._held.get(target, []) if r.msg is not None]

    def swap(self, target: int, sock: transport.Socket, name: str) -> None:
        """Talk to server ``target`` through ``sock``, as ``name``, from now on; the old socket (and what
        it still queues) is closed by whoever drives the sockets next, and its shared memory given up."""
        with self._lock:
            self._swaps.append((target, sock))
            self.names[target] = name
            if self.lanes is not None:
                self.lanes.segments.pop(target, None)
        if self._io.acquire(blocking=False):
            try:
                self._flush()
            finally:
                self._io.release()
        else:
            self._wake()

    def _apply_swaps(self) -> None:
        """Put in the swapped sockets (the caller holds ``_io``)."""
        with self._lock:
            swaps, self._swaps = self._swaps, []
        for target, sock in swaps:
            old = self.sockets[target]
            if old not in self._retired:  # (a broken link is out of the poller already)
                self._poller.remove(old)
            self._resolvers.pop(old, None)
            _close(old)
            self._retired.add(old)
            spare = self._spares.pop(target, None)
            if spare is not None:  # the zmq socket beside a link
                self._poller.remove(spare)
                transport.close(spare)
                self._retired.add(spare)
            self.sockets[target] = sock
            self._poller.add(sock)

    def release(self, target: int) -> int:
        """Send the requests held for ``target`` again, in order, sealed anew; return how many."""
        with self._lock:
            held = self._held.pop(target, [])
            held = [r for r in held if r.msg is not None and not r.future.done()]
            for request in held:
                request.msg.shm = request.msg.reply_at = None  # inline: the new server has no segment
                self._enqueue(target, request, sum(a.nbytes for a in request.msg.arrays))
        self._pump()
        return len(held)

    def _pump(self) -> None:
        """Send from the outbox now, up to :attr:`pace_bytes` of arrays, if the sockets are free; else
        make their holder send it."""
        budget: float = self.pace_bytes
        while self._outbox or self._swaps:
            if not self._io.acquire(blocking=False):
                self._wake()  # the holder sends it: it flushes when woken and before it lets go
                return
            try:
                budget = self._flush(budget)
                if len(self._inflight) > _READ_AHEAD:  # a long run of pushes nobody waits for
                    for sock in self.sockets.values():
                        self._receive(sock)
            finally:
                self._io.release()
            if budget <= 0:
                return  # the rest waits for the next call, a waiting thread or the heartbeat
            # a message queued while we held the lock is sent by the next turn of this loop

    def nudge(self) -> None:
        """Send everything the outbox holds if nothing was sent since the last nudge (a paced big
        value's chunks nobody called to send), and a parked push still there.  The heartbeat calls
        this each beat; its thread never waits on a server (a link's record it cannot write at once is
        left to the next sender or waiting thread), whatever it sends through this Mux."""
        if self._link_pending and self._io.acquire(blocking=False):  # what the last beat left on links
            try:
                self._link_pending = False
                for target, sock in list(self.sockets.items()):
                    if type(sock) is UnixLink and sock.pending:
                        sock.try_flush()
                        if sock.broken is not None:
                            self._unlink(target)
                        elif sock.pending:
                            self._link_pending = True
            finally:
                self._io.release()
        if self._parked is not None and self._park.acquire(blocking=False):  # the releaser's backstop
            try:  # (never waits: whoever holds _park is sending, taking or replacing it)
                self._send_parked_locked()
            finally:
                self._park.release()
        idle, self._nudged = self._nudged == self._moved, self._moved
        if not idle or not self._outbox:
            return
        if not self._io.acquire(blocking=False):
            self._wake()  # its holder flushes
            return
        try:
            self._flush()
        finally:
            self._io.release()

    def _flush(self, budget: float = math.inf) -> float:
        """Send queued messages, highest priority first, sealing each as it leaves (the caller holds
        ``_io``), until the outbox is empty or ``budget`` bytes of arrays are sent; returns the budget
        left (at most 0: spent)."""
        if self._swaps:
            self._apply_swaps()
        while budget > 0:
            with self._lock:
                try:
                    target, request, seq, nbytes = self._outbox.pop()
                except IndexError:  # empty (stop() may have cleared it meanwhile)
                    return budget
                if request.msg is None or self._inflight.get(seq) is not request:
                    continue  # answered, failed, or held for a restarted server meanwhile
                try:
                    frames = self.channel.seal(request.msg, self._name(target))
                except Exception as exc:  # noqa: BLE001 - it fails its request, not the sender
                    self._inflight.pop(seq, None)
                    frames = exc
            if isinstance(frames, Exception):
                _resolve(request, exc=frames)
                continue
            self._send_or_fail(target, frames, seq)
            budget -= nbytes
        return budget

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the holder is due to wake anyway) or closed

    # -- waiting ----------------------------------------------------------------------------------
    def wait(self, request: Request, timeout: float) -> Message:
        """The reply to ``request`` (a :class:`Message`), driving the sockets while it is not in.

        Raises the request's error, or ``concurrent.futures.TimeoutError`` after ``timeout``
        seconds.
        """
        if self._parked is not None:  # sent before anything is waited for
            self._unpark()
        future = request.future
        deadline = time.monotonic() + timeout
        while not future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise FutureTimeout()
            if self._io.acquire(blocking=False):
                try:
                    self._lead(future, deadline)
                finally:
                    self._io.release()
                    self._pump()  # what other threads queued while we led, even if leading failed
            else:
                try:
                    return future.result(min(left, _FOLLOW))
                except FutureTimeout:
                    continue
        return future.result(0)

    def _lead(self, future: Future, deadline: float) -> None:
        """Poll every socket and resolve what comes in until ``future`` is done (caller holds ``_io``)."""
        self._flush()
        while not future.done() and not self._closed:
            if self._link_pending:
                self._flush_links()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for ready in self._poller.wait(min(left, _SLICE)):
                if ready == self._wake_r.fileno():
                    try:
                        self._wake_r.recv(65536)
                    except BlockingIOError:
                        pass
                    self._flush()
                elif ready not in self._retired:
                    self._receive(ready)

    def _flush_links(self) -> None:
        """Write what the heartbeat's sends left on links (the caller holds ``_io``); a link that fails
        is broken (its server's requests end as its loss or restart says)."""
        self._link_pending = False
        for target, sock in list(self.sockets.items()):
            if type(sock) is UnixLink and sock.pending:
                try:
                    flushed = sock.flush()
                except Exception as exc:  # noqa: BLE001 - the link is broken; logged, not raised
                    log.warning("a link to server %d failed: %s", sock.server, exc)
                    flushed = False
                if not flushed:
                    self._unlink(target)

    def _receive(self, sock: transport.Socket) -> None:
        """Open and match every reply waiting on ``sock`` (the caller holds ``_io``)."""
        link = type(sock) is UnixLink
        while True:
            try:
                frames = sock.recv_nowait() if link else transport.recv_nowait(sock)
                if frames is None:
                    if link and sock.broken is not None and self.sockets.get(sock.server) is sock:
                        self._unlink(sock.server)  # at its end: zmq again, never polled again
                    return
                msg = self.channel.open(frames, self._resolvers.get(sock))
            except IntegrityError as exc:  # an authentic header: its request can be failed at once
                self._fail_damaged(frames, exc)
                continue
            except (AuthenticationError, ProtocolError) as exc:
                log.warning("dropped a reply that failed to open: %s", exc)
                continue
            with self._lock:
                request = self._inflight.pop(msg.seq, None)
            if request is None:
                log.debug("reply %d matches no request (it may have timed out)", msg.seq)
            elif msg.op is Op.ERROR:
                text = f"{request.what} failed: {msg.body.get('message', '')}"
                _resolve(request, exc=error_from_code(msg.body.get("code", ""), text, msg.body.get("node")))
            else:
                _resolve(request, result=msg)

    def _fail_damaged(self, frames: list[Any], exc: IntegrityError) -> None:
        """Fail the request whose reply's array bytes were damaged in transit (KVSTORE_AUTH=full);
        a reply whose header does not decode, or replays, is dropped as any bad reply."""
        try:
            msg = decode(frames)
            self.channel.admit(msg.auth)
        except (AuthenticationError, ProtocolError) as bad:
            log.warning("dropped a reply that failed to open: %s", bad)
            return
        with self._lock:
            request = self._inflight.pop(msg.seq, None)
        if request is not None:
            _resolve(request, exc=IntegrityError(f"{request.what}: the reply's array bytes failed the "
                                                 f"integrity check (KVSTORE_AUTH=full): {exc}"))

    # -- failure and closing ----------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Fail every request in flight, and every later one, with ``error`` (a lost peer)."""
        with self._lock:
            if self._closed or self.failure is not None:
                return
            self.failure = error
            failed, self._inflight = list(self._inflight.values()), {}
            failed += [r for held in self._held.values() for r in held]
            self._held.clear()
            if self._parked is not None:
                failed.append(self._parked.request)
                self._parked = None
        for request in failed:
            _resolve(request, exc=error)
        self._wake()

    def stop(self, timeout: float) -> None:
        """Close the sockets (waiting up to ``timeout`` s for a leader to let go); fail what is left."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            left, self._inflight = list(self._inflight.values()), {}
            left += [r for held in self._held.values() for r in held]
            self._held.clear()
            self._outbox.clear()
            if self._parked is not None:
                left.append(self._parked.request)
                self._parked = None
        self._wake()
        try:
            self._gate.release()  # the releaser ends
        except RuntimeError:
            pass
        if self._io.acquire(timeout=timeout):  # a leader lets go within one poll slice
            try:
                swapped = [new for _, new in self._swaps]
                for sock in [*self.sockets.values(), *swapped, *self._spares.values()]:
                    _close(sock)
                self._wake_r.close()
                self._wake_w.close()
            finally:
                self._io.release()
        else:  # never close sockets another thread is using; the process's exit reclaims them
            log.warning("closing the store: a thread still held its sockets after %g s", timeout)
        for request in left:
            _resolve(request, exc=StoreClosedError(f"{request.what}: the store was closed"))
        self.set_lanes(None)  # shared-memory segments: freed once no received array views them


def _close(sock: Any) -> None:
    """Close a zmq socket or a link."""
    if type(sock) is UnixLink:
        sock.close()
    else:
        transport.close(sock)


def _resolve(request: Request, result: Message | None = None, exc: BaseException | None = None) -> None:
    request.msg = None  # answered: never sent again
    if request.future.done():
        return
    if exc is not None:
        request.future.set_exception(exc)
    else:
        request.future.set_result(result)

"""The worker's I/O thread: the one owner of a dist store's sockets.

API threads hand it messages through a queue plus a wake-up byte on a socket
pair (zmq sockets are not thread-safe); it sends them, matches replies to
requests by sequence number and resolves the futures the API threads wait on.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from . import transport
from .auth import Channel
from .errors import AuthenticationError, ProtocolError, StoreClosedError, error_from_code
from .protocol import Message, Op

log = logging.getLogger("kvstore.dist")
SCHEDULER = -1  # target index of the scheduler socket; servers are 0..S-1
_FAIL = object()  # outbox marker: fail every request in flight (queued by IOThread.fail)


@dataclass
class Request:
    """One message in flight and the future its reply resolves."""

    what: str
    future: Future = field(default_factory=Future)


class IOThread(threading.Thread):
    """Owns the sockets: sends queued messages, receives replies, resolves their futures."""

    def __init__(self, scheduler: Any, servers: list[Any], rank: int, channel: Channel) -> None:
        super().__init__(name=f"kvstore-io-worker{rank}", daemon=True)
        self.sockets = {SCHEDULER: scheduler, **dict(enumerate(servers))}
        self.rank = rank
        self.channel = channel  # seals every request, opens every reply
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._inflight: dict[int, Request] = {}
        self._seq = itertools.count(1)
        self._stopping = False
        self._wake_pending = False  # a wake-up byte is on its way; no need to send another
        self._closed = False  # set by the thread as it exits; later submits are refused
        self._failure: BaseException | None = None  # set by fail(): the cluster is broken
        self._lock = threading.Lock()  # orders submits against the thread's exit and fail()

    def submit(self, target: int, msg: Message, what: str, after_failure: bool = False) -> Request:
        """Queue ``msg`` for ``target`` (a server index or SCHEDULER); return its request.

        After :meth:`fail`, the request is failed at once with that error, unless
        ``after_failure`` (a LEAVE still goes out, so the scheduler can finish).
        """
        request = Request(what)
        msg.sender = self.rank
        with self._lock:  # sealed in queue order: each receiver must see the channel's numbers rise
            if self._closed:
                raise StoreClosedError(f"{what}: the store is closed")
            if self._failure is not None and not after_failure:
                _resolve(request, exc=self._failure)
                return request
            msg.seq = next(self._seq)
            frames = self.channel.seal(msg, "scheduler" if target == SCHEDULER else f"server{target}")
            self._outbox.put((target, frames, msg.seq, request))
            self._wake()
        return request

    def fail(self, error: BaseException) -> None:
        """Fail every request in flight, and every later one, with ``error`` (a lost peer)."""
        with self._lock:
            if self._closed or self._failure is not None:
                return
            self._failure = error
            self._outbox.put(_FAIL)
            self._wake()

    def stop(self) -> None:
        """Ask the thread to close its sockets and exit."""
        with self._lock:
            if not self._closed:
                self._outbox.put(None)
                self._wake()

    def _wake(self) -> None:
        # Callers queue before they look at the flag and the thread clears it before it
        # drains the queue, so every queued item is seen after at most one byte.
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the thread is already due to wake

    def run(self) -> None:
        poller = transport.Poller()
        poller.add(self._wake_r.fileno())
        for sock in self.sockets.values():
            poller.add(sock)
        try:
            while not self._stopping:
                for ready in poller.wait(None):
                    if ready == self._wake_r.fileno():
                        self._wake_r.recv(65536)
                        self._wake_pending = False
                        self._send_queued()
                    else:
                        self._receive(ready)
        finally:
            self._shut()

    def _shut(self) -> None:
        with self._lock:
            self._closed = True
            left = list(self._inflight.values())
            while not self._outbox.empty():
                item = self._outbox.get_nowait()
                if item is not None and item is not _FAIL:
                    left.append(item[3])
            self._wake_r.close()
            self._wake_w.close()
        for sock in self.sockets.values():
            transport.close(sock)
        for request in left:
            _resolve(request, exc=StoreClosedError(f"{request.what}: the store was closed"))

    def _send_queued(self) -> None:
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._stopping = True
                return
            if item is _FAIL:
                failed, self._inflight = list(self._inflight.values()), {}
                for request in failed:
                    _resolve(request, exc=self._failure)
                continue
            target, frames, seq, request = item
            self._inflight[seq] = request
            try:
                transport.send(self.sockets[target], frames)
            except Exception as exc:  # surface to the waiting caller, keep the thread alive
                self._inflight.pop(seq, None)
                _resolve(request, exc=exc)

    def _receive(self, sock: Any) -> None:
        while sock.poll(0):
            try:
                msg = self.channel.open(transport.recv(sock))
            except (AuthenticationError, ProtocolError) as exc:
                log.warning("dropped a reply that failed to open: %s", exc)
                continue
            request = self._inflight.pop(msg.seq, None)
            if request is None:
                log.debug("reply %d matches no request (it may have timed out)", msg.seq)
            elif msg.op is Op.ERROR:
                text = f"{request.what} failed: {msg.body.get('message', '')}"
                _resolve(request, exc=error_from_code(msg.body.get("code", ""), text, msg.body.get("node")))
            else:
                _resolve(request, result=msg)


def _resolve(request: Request, result: Any = None, exc: BaseException | None = None) -> None:
    if request.future.done():
        return
    if exc is not None:
        request.future.set_exception(exc)
    else:
        request.future.set_result(result)

"""The request loop shared by the scheduler and the servers: one ROUTER, one handler table.

(A node's side of registration is :mod:`kvstore.net.handshake`; the role process wrapper
``run_role`` is :mod:`kvstore.net.role`.)

A handler gets ``(identity, message)``.  When it raises, the caller gets an
ERROR reply naming the error, and the service keeps serving (its state is
untouched: handlers validate before they change anything).  Every message is
opened (authenticated, see ``kvstore.auth``) before it is decoded; one that
fails is logged (rate-limited), answered with an unsigned ERROR and dropped.
Replies are addressed to the label the peer last sent with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvstore.errors import AuthenticationError, KVStoreError, ProtocolError, error_code, error_node
from kvstore.net import protocol, transport
from kvstore.net.auth import Channel, sender_label, unsigned
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.service")

Handler = Callable[[bytes, Message], None]


class RouterService:
    """Receives requests on a bound ROUTER and dispatches them by op."""

    def __init__(self, sock: Any, channel: Channel, rank: int | None = None) -> None:
        self.sock = sock
        self.channel = channel
        self.rank = rank
        self.handlers: dict[Op, Handler] = {}
        self.peers: dict[bytes, str] = {}  # connection identity -> label it last sent with
        self._last_bad_log = 0.0

    def reply(self, identity: bytes, msg: Message) -> None:
        """Seal ``msg`` for peer ``identity`` and send it; a peer that has gone is logged, not raised."""
        msg.sender = self.rank
        self._send(identity, self.channel.seal(msg, self.peers.get(identity, "")), msg.op)

    def _send(self, identity: bytes, frames: list[Any], op: Op) -> None:
        try:
            transport.send(self.sock, frames, identity=identity)
        except KVStoreError as exc:
            log.warning("could not reply %s to %r: %s", op.name, identity, exc)

    def reply_error(self, identity: bytes, seq: int, exc: BaseException) -> None:
        """Send the ERROR reply for ``exc`` to request ``seq`` of ``identity``."""
        self.reply(identity, protocol.error_reply(seq, error_code(exc), str(exc), node=error_node(exc)))

    def handle(self, frames: list[Any]) -> None:
        """Open (authenticate and decode) one received message, identity first, and run its handler."""
        if len(frames) < 2:
            self._log_bad("a message with no payload")
            return
        identity, payload = bytes(frames[0]), frames[1:]
        try:
            msg = self.channel.open(payload)
        except (AuthenticationError, ProtocolError) as exc:  # answered unsigned: we cannot address it
            self._log_bad(str(exc))
            reply = protocol.error_reply(0, error_code(exc), str(exc), sender=self.rank)
            self._send(identity, unsigned(reply), reply.op)
            return
        self.peers[identity] = sender_label(msg)
        handler = self.handlers.get(msg.op)
        try:
            if handler is None:
                raise ProtocolError(f"op {msg.op.name} is not served here")
            handler(identity, msg)
        except Exception as exc:  # a bad request must not kill the service
            if not isinstance(exc, KVStoreError):
                log.exception("handler for %s failed", msg.op.name)
            self.reply_error(identity, msg.seq, exc)

    def poll_once(self, timeout: float) -> bool:
        """Handle at most one waiting message; return whether one was handled."""
        if not self.sock.poll(int(timeout * 1000)):
            return False
        try:
            frames = transport.recv(self.sock)
        except ProtocolError as exc:  # too many frames: read, dropped, not answered
            self._log_bad(str(exc))
            return True
        self.handle(frames)
        return True

    def drain(self, limit: int = 1000) -> int:
        """Handle the messages already waiting (at most ``limit``); return how many."""
        handled = 0
        while handled < limit:
            try:
                frames = transport.recv_nowait(self.sock)
            except ProtocolError as exc:  # too many frames: read, dropped, not answered
                self._log_bad(str(exc))
                handled += 1
                continue
            if frames is None:
                break
            self.handle(frames)
            handled += 1
        return handled

    def _log_bad(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_bad_log > 1.0:  # rate-limited: garbage must not flood the log
            self._last_bad_log = now
            log.warning("dropped a bad message: %s", what)

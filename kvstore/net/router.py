"""The request loop shared by the scheduler and the servers: one ROUTER, one handler table.

A handler gets ``(identity, message)``.  When it raises, the caller gets an
ERROR reply naming the error, and the service keeps serving (its state is
untouched: handlers validate before they change anything).  Every message is
opened (authenticated, see ``kvstore.auth``) before it is decoded; one that
fails is logged (rate-limited), answered with an unsigned ERROR and dropped.
Replies are addressed to the label the peer last sent with.
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from kvstore import config as kvconfig
from kvstore import logs
from kvstore.errors import (
    AuthenticationError,
    KVStoreError,
    ProtocolError,
    error_code,
    error_from_code,
    error_node,
)
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


def register(sock: object, channel: Channel, cfg: kvconfig.Config, body: dict, what: str) -> Message:
    """Prove the secret to the scheduler and wait for the cluster map (challenge-response).

    HELLO carries a fresh nonce; the scheduler's CHALLENGE (sealed, echoing it) gives
    the challenge that REGISTER (sealed, with ``body``) must carry; the MAP (sealed,
    echoing the nonce) gives the session the channel is then keyed to.  Raises
    :class:`DeadlineExceededError` after ``KVSTORE_CONNECT_TIMEOUT``,
    :class:`AuthenticationError` when the secrets differ, or the scheduler's error
    (e.g. an incomplete rendezvous) as its typed exception.
    """
    deadline = time.monotonic() + cfg.connect_timeout
    nonce = secrets.token_hex(16)
    transport.send(sock, channel.seal(Message(Op.HELLO, {"nonce": nonce}), "scheduler"))
    challenge = _answer(sock, channel, cfg, deadline, what, Op.CHALLENGE, nonce)
    if not isinstance(challenge.body.get("challenge"), str):
        raise ProtocolError("the scheduler's CHALLENGE carries no challenge")
    body = dict(body, challenge=challenge.body["challenge"])
    transport.send(sock, channel.seal(Message(Op.REGISTER, body), "scheduler"))
    cmap = _answer(sock, channel, cfg, deadline, what, Op.MAP, nonce)
    session = cmap.body.get("session")
    if not isinstance(session, bytes):
        raise ProtocolError("the cluster map carries no session id")
    channel.set_session(session)
    return cmap


def _answer(sock: Any, channel: Channel, cfg: kvconfig.Config, deadline: float, what: str,
            expected: Op, nonce: str) -> Message:
    """The scheduler's sealed reply ``expected`` that echoes ``nonce``; errors raised typed."""
    frames = transport.recv_within(
        sock, max(0.0, deadline - time.monotonic()),
        f"{expected.name.lower()} from the scheduler at {cfg.root_address} for this {what} (are the "
        f"scheduler and all DMLC_NUM_WORKER={cfg.num_workers} workers and DMLC_NUM_SERVER="
        f"{cfg.num_servers} servers running, with the same KVSTORE_SECRET?)")
    try:
        reply = channel.open(frames)
    except (AuthenticationError, ProtocolError):
        refusal = _unsigned_error(frames)  # the scheduler could not verify us, and said so
        if refusal is not None:
            raise refusal from None
        raise AuthenticationError(f"the scheduler at {cfg.root_address} failed to authenticate "
                                  "(does it have the same KVSTORE_SECRET?)") from None
    if reply.op is Op.ERROR:
        raise error_from_code(reply.body.get("code", ""), reply.body.get("message", ""))
    if reply.op is not expected or reply.body.get("nonce") != nonce:
        raise ProtocolError(f"expected {expected.name} for this registration, got {reply.op.name}")
    return reply


def _unsigned_error(frames: list[Any]) -> KVStoreError | None:
    """The error an unsigned ERROR reply states (trusted only during registration), else None."""
    if len(frames) < 2 or memoryview(frames[0]).nbytes:
        return None
    try:
        reply = protocol.decode(frames[1:])
    except ProtocolError:
        return None
    if reply.op is not Op.ERROR:
        return None
    return error_from_code(reply.body.get("code", ""), f"the scheduler refused this node: "
                                                       f"{reply.body.get('message', '')}")


def run_role(role: str, body: Callable[[kvconfig.Config], int],
             rank: Callable[[kvconfig.Config], int | None] = lambda cfg: None) -> int:
    """Run a role process's ``body(cfg)``: load the config, set up logging, map errors to exit codes.

    Returns 2 for an invalid setting, 1 when ``body`` raises a :class:`KVStoreError`,
    else ``body``'s own code.
    """
    try:
        cfg = kvconfig.load()
    except KVStoreError as exc:
        print(f"{role}: {exc}", file=sys.stderr)
        return 2
    logs.setup(role, rank(cfg), level=cfg.log_level or "INFO")
    try:
        return body(cfg)
    except KVStoreError as exc:
        log.error("%s", exc)
        return 1

"""The request loop shared by the scheduler and the servers: one ROUTER, one handler table.

A handler gets ``(identity, message)``.  When it raises, the caller gets an
ERROR reply naming the error, and the service keeps serving (its state is
untouched: handlers validate before they change anything).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from . import config as kvconfig
from . import logs, protocol, transport
from .errors import KVStoreError, ProtocolError, error_code, error_from_code, error_node
from .protocol import Message, Op

log = logging.getLogger("kvstore.service")

Handler = Callable[[bytes, Message], None]


class RouterService:
    """Receives requests on a bound ROUTER and dispatches them by op."""

    def __init__(self, sock: Any, rank: int | None = None) -> None:
        self.sock = sock
        self.rank = rank
        self.handlers: dict[Op, Handler] = {}
        self._last_bad_log = 0.0

    def reply(self, identity: bytes, msg: Message) -> None:
        """Send ``msg`` to peer ``identity``; a peer that has gone is logged, not raised."""
        msg.sender = self.rank
        try:
            transport.send(self.sock, protocol.encode(msg), identity=identity)
        except KVStoreError as exc:
            log.warning("could not reply %s to %r: %s", msg.op.name, identity, exc)

    def reply_error(self, identity: bytes, seq: int, exc: BaseException) -> None:
        """Send the ERROR reply for ``exc`` to request ``seq`` of ``identity``."""
        self.reply(identity, protocol.error_reply(seq, error_code(exc), str(exc), node=error_node(exc)))

    def handle(self, frames: list[Any]) -> None:
        """Decode one received message (identity first) and run its handler."""
        if len(frames) < 2:
            self._log_bad("a message with no header")
            return
        identity, payload = bytes(frames[0]), frames[1:]
        try:
            msg = protocol.decode(payload)
        except ProtocolError as exc:
            self._log_bad(str(exc))
            self.reply_error(identity, 0, exc)
            return
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
        self.handle(transport.recv(self.sock))
        return True

    def _log_bad(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_bad_log > 1.0:  # rate-limited: garbage must not flood the log
            self._last_bad_log = now
            log.warning("dropped a bad message: %s", what)


def register(sock: object, cfg: kvconfig.Config, body: dict, what: str) -> Message:
    """Send REGISTER with ``body`` to the scheduler and wait for the cluster map.

    Raises :class:`DeadlineExceededError` after ``KVSTORE_CONNECT_TIMEOUT``, or the
    scheduler's error (e.g. an incomplete rendezvous) as its typed exception.
    """
    transport.send(sock, protocol.encode(Message(Op.REGISTER, body)))
    frames = transport.recv_within(
        sock, cfg.connect_timeout,
        f"cluster map from the scheduler at {cfg.root_address} for this {what} (are the scheduler "
        f"and all DMLC_NUM_WORKER={cfg.num_workers} workers and DMLC_NUM_SERVER={cfg.num_servers} "
        "servers running?)")
    reply = protocol.decode(frames)
    if reply.op is Op.ERROR:
        raise error_from_code(reply.body.get("code", ""), reply.body.get("message", ""))
    if reply.op is not Op.MAP:
        raise ProtocolError(f"expected the cluster map, got {reply.op.name}")
    return reply


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

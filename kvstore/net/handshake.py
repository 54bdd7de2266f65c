"""A node's registration with the scheduler: the challenge-response handshake that proves the shared
secret and brings back the cluster map (HELLO, CHALLENGE, REGISTER, MAP; docs/protocol.md).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from kvstore import config as kvconfig
from kvstore.errors import (
    AuthenticationError,
    DeadlineExceededError,
    KVStoreError,
    ProtocolError,
    SchedulerRebuildingError,
    error_from_code,
)
from kvstore.net import protocol, transport
from kvstore.net.auth import Channel
from kvstore.net.protocol import Message, Op

REBUILD_POLL = 0.1  # seconds between registrations a restarted scheduler refused while rebuilding


def register(sock: object, channel: Channel, cfg: kvconfig.Config, body: dict, what: str) -> Message:
    """Prove the secret to the scheduler and wait for the cluster map (challenge-response).

    HELLO carries a fresh nonce; the scheduler's CHALLENGE (sealed, echoing it) gives
    the challenge that REGISTER (sealed, with ``body``) must carry; the MAP (sealed,
    echoing the nonce) gives the session the channel is then keyed to.  Raises
    :class:`DeadlineExceededError` after ``KVSTORE_CONNECT_TIMEOUT``,
    :class:`AuthenticationError` when the secrets differ, or the scheduler's error
    (e.g. an incomplete rendezvous) as its typed exception.  A restarted scheduler still rebuilding
    the cluster (:class:`SchedulerRebuildingError`) is asked again until the deadline.
    """
    deadline = time.monotonic() + cfg.connect_timeout
    while True:
        try:
            cmap = _handshake(sock, channel, cfg, body, what, deadline)
            break
        except SchedulerRebuildingError as exc:  # a restarted scheduler takes its old nodes back first
            if time.monotonic() + REBUILD_POLL >= deadline:
                raise DeadlineExceededError(
                    f"{what}: the restarted scheduler at {cfg.root_address} was still rebuilding the cluster "
                    f"after {cfg.connect_timeout:g} s (KVSTORE_CONNECT_TIMEOUT): {exc}") from None
            time.sleep(REBUILD_POLL)  # then a fresh HELLO: the last one's exchange is over
    session = cmap.body.get("session")
    if not isinstance(session, bytes):
        raise ProtocolError("the cluster map carries no session id")
    channel.set_session(session)
    return cmap


def _handshake(sock: object, channel: Channel, cfg: kvconfig.Config, body: dict, what: str,
               deadline: float) -> Message:
    """One HELLO, CHALLENGE, REGISTER, MAP exchange by ``deadline``; the MAP.  Raises as :func:`register`,
    and :class:`SchedulerRebuildingError` for a restarted scheduler that takes no new node yet."""
    nonce = secrets.token_hex(16)
    transport.send(sock, channel.seal(Message(Op.HELLO, {"nonce": nonce}), "scheduler"))
    challenge = _answer(sock, channel, cfg, deadline, what, Op.CHALLENGE, nonce)
    if not isinstance(challenge.body.get("challenge"), str):
        raise ProtocolError("the scheduler's CHALLENGE carries no challenge")
    body = dict(body, challenge=challenge.body["challenge"])
    transport.send(sock, channel.seal(Message(Op.REGISTER, body), "scheduler"))
    return _answer(sock, channel, cfg, deadline, what, Op.MAP, nonce)


def _answer(sock: Any, channel: Channel, cfg: kvconfig.Config, deadline: float, what: str,
            expected: Op, nonce: str) -> Message:
    """The scheduler's sealed reply ``expected`` that echoes ``nonce``; errors raised typed."""
    frames = transport.recv_within(
        sock, max(0.0, deadline - time.monotonic()),
        f"{expected.name.lower()} from the scheduler at {cfg.root_address} for this {what} (are the "
        f"scheduler and all DMLC_NUM_WORKER={cfg.num_workers} workers and DMLC_NUM_SERVER="
        f"{cfg.num_servers} servers running, with the same KVSTORE_SECRET and KVSTORE_ENCRYPT?)")
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


def unsigned_refusal(frames: list[Any]) -> dict | None:
    """The body (``code``, ``message``) of an unsigned ERROR reply, a node's refusal of a peer that
    failed to authenticate; None for any other frames."""
    if len(frames) < 2 or memoryview(frames[0]).nbytes:
        return None
    try:
        reply = protocol.decode(frames[1:])
    except ProtocolError:
        return None
    return reply.body if reply.op is Op.ERROR else None


def _unsigned_error(frames: list[Any]) -> KVStoreError | None:
    """The error an unsigned ERROR reply states (trusted only during registration), else None."""
    body = unsigned_refusal(frames)
    if body is None:
        return None
    message = f"the scheduler refused this node: {body.get('message', '')}"
    return error_from_code(body.get("code", ""), message)

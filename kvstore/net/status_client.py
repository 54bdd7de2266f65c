"""A client of the scheduler's STATUS request, holding the cluster secret and never registering
(``python -m kvstore.status``, the launcher's TensorBoard writer; docs/observability.md).

Two steps, so that a STATUS is sealed with the cluster's session: a STATUS sealed with the secret
alone is answered with the session id only (``{"session"}``); the client then asks from a channel
keyed by the secret and :func:`poll_session` of it, which the scheduler keeps from its start to its
end.  A request captured on one cluster does not verify on another (another session), and one
captured during the rendezvous is not answered again after the map (one replay table)."""

from __future__ import annotations

import itertools
import time
from typing import Any

from kvstore import config as kvconfig
from kvstore.errors import AuthenticationError, DeadlineExceededError, ProtocolError, error_from_code
from kvstore.net import transport
from kvstore.net.auth import Channel, channel_for, new_label
from kvstore.net.handshake import unsigned_refusal
from kvstore.net.protocol import Message, Op

__all__ = ["StatusClient", "poll_session"]


def poll_session(session: bytes) -> bytes:
    """What the STATUS pollers' channel is keyed by besides the secret, for the cluster ``session``
    (distinct from the nodes' key, so no node's message verifies on it or the other way round)."""
    return b"status\0" + bytes(session)


class StatusClient:
    """One connection to a scheduler that asks it for STATUS (its own DEALER and channel)."""

    def __init__(self, cfg: kvconfig.Config, where: str) -> None:
        self.where, self.cfg = where, cfg
        self.channel: Channel = channel_for(cfg, new_label("status"))  # the secret's alone: step one
        self.polled: Channel | None = None  # keyed with the session's poll key: step two
        self._session = b""  # the session id step one got (step two names it: no secret, no MAC)
        self.sock = transport.connect_dealer(where, curve=transport.curve_keys(cfg))
        self._seq = itertools.count(1)
        self._renewed = False  # a fresh channel was tried since the last reply that opened
        self._refused = False  # the last reply was the scheduler's refusal of this secret

    def status(self, timeout: float, follow: bool = False) -> dict[str, Any]:
        """The scheduler's STATUS reply body; raises DeadlineExceededError past ``timeout`` seconds,
        AuthenticationError when it refuses this secret (or its reply does not verify).  ``follow``:
        this client polls for the whole job (the TensorBoard writer), so the exiting scheduler holds,
        bounded, for its next request (scheduler/scheduler.py ``FOLLOW_LINGER``).

        The scheduler answers STATUS from a new channel once the cluster map is out, whose numbers
        start over: after a reply that fails to open, the request is asked once more from a fresh
        channel (a new label), so one client lasts across the rendezvous."""
        extra = {"follow": True} if follow else {}
        try:
            body = self._ask(timeout, extra)
        except AuthenticationError:
            if self._renewed or self._refused:
                raise
            self._renewed = True
            self.channel, self.polled = channel_for(self.cfg, new_label("status")), None
            body = self._ask(timeout, extra)
        self._renewed = False
        return body

    def _ask(self, timeout: float, extra: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        if self.polled is None:
            first = self._request(self.channel, timeout, extra)
            session = first.get("session")
            if not isinstance(session, bytes):
                if "schema" in first:  # no secret: nothing to seal with, so the status came at once
                    return first
                raise ProtocolError(f"the scheduler at {self.where} sent no session for STATUS")
            self.polled = channel_for(self.cfg, new_label("status"))
            self.polled.set_session(poll_session(session))
            self._session = session
        return self._request(self.polled, max(0.0, deadline - time.monotonic()),
                             {**extra, "session": self._session})

    def _request(self, channel: Channel, timeout: float,
                 body: dict[str, Any] | None = None) -> dict[str, Any]:
        seq = next(self._seq)
        transport.send(self.sock, channel.seal(Message(Op.STATUS, body or {}, seq=seq), "scheduler"))
        deadline = time.monotonic() + timeout
        while True:
            try:
                frames = transport.recv_within(self.sock, max(0.0, deadline - time.monotonic()), "reply")
            except DeadlineExceededError:
                raise DeadlineExceededError(f"no STATUS reply from the scheduler at {self.where} within "
                                            f"{timeout:g} s (--timeout)") from None
            reply = self._open(channel, frames)
            if reply.seq != seq:
                continue  # the late answer to an earlier request
            if reply.op is Op.ERROR:
                raise error_from_code(str(reply.body.get("code", "")), str(reply.body.get("message", "")))
            return reply.body

    def _open(self, channel: Channel, frames: list[Any]) -> Message:
        try:
            return channel.open(frames)
        except (AuthenticationError, ProtocolError):
            refusal = _unsigned_text(frames)
            self._refused = refusal is not None  # the secret is wrong: asking again cannot help
            if refusal is not None:
                raise AuthenticationError(f"the scheduler at {self.where} refused this request: "
                                          f"{refusal} (is KVSTORE_SECRET the cluster's?)") from None
            raise AuthenticationError(f"the reply of the scheduler at {self.where} failed to "
                                      "authenticate (is KVSTORE_SECRET the cluster's?)") from None

    def close(self) -> None:
        """Close the connection."""
        transport.close(self.sock)


def _unsigned_text(frames: list[Any]) -> str | None:
    """The message of an unsigned ERROR reply (a refusal), else None."""
    body = unsigned_refusal(frames)
    return None if body is None else str(body.get("message", ""))[:300]

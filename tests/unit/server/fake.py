"""The fake transport a Server is unit-tested over: no processes, no sockets.

:class:`FakeRouter` stands in for the server's bound ROUTER socket: it records each message the
server's :class:`~kvstore.net.router.RouterService` sends (through ``kvstore.net.transport.send``),
per peer identity.  :class:`FakeCluster` builds a :class:`~kvstore.server.server.Server` over it and
a cluster map, and plays its workers: each seals its requests with a channel of its own (the real
authentication, ``kvstore.net.auth``), hands the frames to the service as the request loop would,
and opens the replies sent back to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zmq

from kvstore import config
from kvstore.net.auth import channel_for
from kvstore.net.protocol import Message, Op
from kvstore.net.router import RouterService
from kvstore.server.server import Server

SESSION = b"unit-test-session-0123456789abcd"


class FakeRouter:
    """A ROUTER socket's stand-in: the messages sent to each identity, in order (frames copied)."""

    def __init__(self) -> None:
        self.sent: dict[bytes, list[list[bytes]]] = {}
        self._parts: list[bytes] = []

    def send(self, part: Any, flags: int = 0, copy: bool = True) -> None:
        """Take one frame; the last one (no SNDMORE) completes the message, identity frame first."""
        self._parts.append(bytes(part))
        if not flags & zmq.SNDMORE:
            identity, *frames = self._parts
            self.sent.setdefault(identity, []).append(frames)
            self._parts = []


class FakeCluster:
    """A Server of rank 0 over a :class:`FakeRouter`, and ``workers`` workers that talk to it."""

    def __init__(self, mode: str = "dist_sync", workers: int = 2, **env: str) -> None:
        self.cfg = config.load({"DMLC_ROLE": "server", "KVSTORE_SECRET": "unit-test-secret", **env})
        self.router = FakeRouter()
        self.service = RouterService(self.router, channel_for(self.cfg, "server"))
        cluster = {"rank": 0, "session": SESSION, "mode": mode, "num_workers": workers}
        self.server = Server(self.cfg, self.service, cluster)
        self.channels = []
        for rank in range(workers):
            channel = channel_for(self.cfg, f"worker{rank}-test")
            channel.set_session(SESSION)
            self.channels.append(channel)
        self._seq = 0

    @staticmethod
    def identity(worker: int) -> bytes:
        """The connection identity worker ``worker``'s DEALER has at the ROUTER."""
        return f"dealer-{worker}".encode()

    def send(self, worker: int, op: Op, body: dict[str, Any], arrays: list[np.ndarray] | None = None,
             rank: Any = None) -> int:
        """Seal a request of ``worker`` to server 0 (its sender field ``rank``, default ``worker``) and
        have the service handle it; return its seq."""
        self._seq += 1
        msg = Message(op, body, list(arrays or []), seq=self._seq, sender=worker if rank is None else rank)
        frames = self.channels[worker].seal(msg, "server0")
        self.service.handle([self.identity(worker), *[bytes(f) for f in frames]])
        return self._seq

    def replies(self, worker: int) -> list[Message]:
        """The replies sent to ``worker`` since the last call, opened (verified) by its channel."""
        sent = self.router.sent.pop(self.identity(worker), [])
        return [self.channels[worker].open(frames) for frames in sent]

    def init(self, key: Any, value: np.ndarray, worker: int = 0) -> Message:
        """INIT ``key`` with ``value`` (flat) from ``worker``; return its one reply."""
        self.send(worker, Op.INIT, {"keys": [key], "sizes": [value.size]}, [value.reshape(-1)])
        (reply,) = self.replies(worker)
        return reply

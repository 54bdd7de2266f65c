"""The fake transport a Server is unit-tested over: no processes, no sockets.

The server's :class:`~kvstore.net.router.RouterService` runs over an
:class:`~kvstore.net.inproc.InProcRouter` (the seam the Scheduler's tests use too), which records each
message the server sends.  :class:`FakeCluster` builds a :class:`~kvstore.server.server.Server` over it and
a cluster map, and plays its workers: each seals its requests with a channel of its own (the real
authentication, ``kvstore.net.auth``), hands the frames to the service as the request loop would,
and opens the replies sent back to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore import config
from kvstore.net.auth import channel_for
from kvstore.net.inproc import InProcRouter
from kvstore.net.protocol import Message, Op
from kvstore.net.router import RouterService
from kvstore.server.server import Server

SESSION = b"unit-test-session-0123456789abcd"


class FakeCluster:
    """A Server of rank 0 over an :class:`InProcRouter`, and ``workers`` workers that talk to it."""

    def __init__(self, mode: str = "dist_sync", workers: int = 2, **env: str) -> None:
        self.cfg = config.load({"DMLC_ROLE": "server", "KVSTORE_SECRET": "unit-test-secret", **env})
        self.router = InProcRouter()
        self.service = RouterService(None, channel_for(self.cfg, "server"), endpoint=self.router)
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
        mine = self.identity(worker)
        sent = [frames for identity, frames in self.router.sent if identity == mine]
        self.router.sent = [(identity, frames) for identity, frames in self.router.sent if identity != mine]
        return [self.channels[worker].open([bytes(f) for f in frames]) for frames in sent]

    def init(self, key: Any, value: np.ndarray, worker: int = 0) -> Message:
        """INIT ``key`` with ``value`` (flat) from ``worker``; return its one reply."""
        self.send(worker, Op.INIT, {"keys": [key], "sizes": [value.size]}, [value.reshape(-1)])
        (reply,) = self.replies(worker)
        return reply

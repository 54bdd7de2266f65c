"""An in-memory ROUTER for unit tests of a request loop: the fake transport seam (no socket, no process).

:class:`InProcRouter` is a :class:`kvstore.net.router.RouterSocket`: a test hands a node (the
``Scheduler``) one instead of binding a zmq socket, puts requests in with :meth:`deliver` (or calls
the service's ``handle`` directly) and reads what the node sent in :attr:`sent`.  Frames are kept as
given, sealed as they would travel; nothing is copied or reordered.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any


class InProcRouter:
    """Requests queued in memory, replies recorded in order: ``sent`` is [(identity, frames), ...]."""

    def __init__(self) -> None:
        self.inbox: collections.deque[list[Any]] = collections.deque()
        self.sent: list[tuple[bytes, list[Any]]] = []
        self.closed = False

    def deliver(self, identity: bytes, frames: Sequence[Any]) -> None:
        """Queue one message from peer ``identity`` (its frames as sealed, without the identity)."""
        self.inbox.append([identity, *frames])

    def send(self, identity: bytes, frames: Sequence[Any]) -> bool:
        """Record ``frames`` as sent to ``identity``; always True (no queue fills up)."""
        self.sent.append((identity, list(frames)))
        return True

    def recv(self, timeout: float | None) -> list[Any] | None:
        """The oldest delivered message, identity first, or None at once (nothing waits in memory)."""
        return self.inbox.popleft() if self.inbox else None

    def close(self) -> None:
        """Mark the socket closed."""
        self.closed = True

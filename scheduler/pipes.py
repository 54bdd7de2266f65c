"""The scheduler's book of pipeline sockets (docs/pipeline.md): which worker listens where.

A pipeline stage's worker binds one socket and publishes its address (PIPE_PUBLISH); its
neighbours look it up by rank (PIPE_LOOKUP).  Jobs without a pipeline never send either.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import ProtocolError
from kvstore.net.protocol import Message, Op

from .extension import SchedulerAPI

MAX_HOST = 255  # characters of a published host name


class PipeBook:
    """Pure bookkeeping: worker rank -> (host, port) of its pipeline socket."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.addresses: dict[int, tuple[str, int]] = {}

    def publish(self, rank: int, body: dict[str, Any]) -> None:
        """Record worker ``rank``'s address from a PIPE_PUBLISH body; raise :class:`ProtocolError`
        (state untouched) unless it is {"host": str, "port": int in [1, 65535]}."""
        host, port = body.get("host"), body.get("port")
        if not (isinstance(host, str) and 0 < len(host) <= MAX_HOST):
            raise ProtocolError(f"PIPE_PUBLISH needs a host (a str of 1 to {MAX_HOST} characters)")
        if type(port) is not int or not 1 <= port <= 65535:
            raise ProtocolError("PIPE_PUBLISH needs a port (an int in [1, 65535])")
        self.addresses[rank] = (host, port)

    def lookup(self, body: dict[str, Any]) -> list | None:
        """The [host, port] a PIPE_LOOKUP body's worker published, or None (not yet);
        raise :class:`ProtocolError` for a rank that is not an int in [0, num_workers)."""
        rank = body.get("rank")
        if type(rank) is not int or not 0 <= rank < self.num_workers:
            raise ProtocolError(f"PIPE_LOOKUP needs a worker rank in [0, {self.num_workers})")
        found = self.addresses.get(rank)
        return None if found is None else list(found)


class PipesExtension:
    """The scheduler's PIPE_PUBLISH and PIPE_LOOKUP (only registered workers may call them), over a
    :class:`PipeBook`; the restarts extension asks it which workers are stages (never restarted)."""

    def __init__(self, api: SchedulerAPI) -> None:
        self.api = api
        self.book = PipeBook(api.cfg.num_workers)
        api.handle(Op.PIPE_PUBLISH, self.on_publish)
        api.handle(Op.PIPE_LOOKUP, self.on_lookup)

    def is_stage(self, rank: int) -> bool:
        """Whether worker ``rank`` has published a pipeline socket (it is a stage)."""
        return rank in self.book.addresses

    def on_publish(self, identity: bytes, msg: Message) -> None:
        """Record the publishing worker's address; answer OK."""
        rank = self.api.worker_rank(identity)
        _no_arrays(msg)
        self.book.publish(rank, msg.body)
        self.api.reply(identity, Message(Op.OK, seq=msg.seq))

    def on_lookup(self, identity: bytes, msg: Message) -> None:
        """Answer the address the named worker published ({"address": [host, port] or None})."""
        self.api.worker_rank(identity)
        _no_arrays(msg)
        self.api.reply(identity, Message(Op.OK, {"address": self.book.lookup(msg.body)}, seq=msg.seq))


def _no_arrays(msg: Message) -> None:
    """Raise :class:`ProtocolError` when a PIPE_PUBLISH or PIPE_LOOKUP carries arrays (neither has any)."""
    if msg.arrays:
        raise ProtocolError(f"{msg.op.name} carries no arrays, not {len(msg.arrays)}")

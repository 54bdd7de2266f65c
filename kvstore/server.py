"""The server process: holds a shard of every key and serves init/push/pull.

Run it with ``python -m kvstore.server`` (``DMLC_ROLE=server`` and the other
``DMLC_*`` variables set).  It binds a port of its own (any free one), registers
with the scheduler, receives the cluster map, then serves workers until the
scheduler tells it to stop.
"""

from __future__ import annotations

import logging
import sys

from . import config as kvconfig
from . import logs, protocol, transport
from .errors import ProtocolError
from .partition import check_key
from .protocol import Message, Op
from .service import RouterService, register, run_role
from .state import Completion, ShardState

log = logging.getLogger("kvstore.server")


class Server:
    """One server: a ROUTER for workers, a DEALER to the scheduler, and a :class:`ShardState`."""

    def __init__(self, cfg: kvconfig.Config) -> None:
        cfg.require_cluster("a server")
        self.cfg = cfg
        self.host = kvconfig.node_host(cfg)
        sock, self.port = transport.bind_router(self.host)
        self.service = RouterService(sock)
        self.scheduler = transport.connect_dealer(cfg.root_address)
        self.state: ShardState | None = None
        self.service.handlers = {Op.INIT: self._on_init, Op.PUSH: self._on_push,
                                 Op.PULL: self._on_pull, Op.PUSHPULL: self._on_pushpull}

    def join(self) -> None:
        """Register with the scheduler and set up state from the cluster map."""
        cmap = register(self.scheduler, self.cfg, {"role": "server", "host": self.host,
                                                    "port": self.port, "rank": self.cfg.server_id},
                        "server")
        rank = cmap.body["rank"]
        self.service.rank = rank
        self.state = ShardState(cmap.body["num_workers"], sync=cmap.body["mode"] == "dist_sync")
        logs.set_identity("server", rank)
        log.info("serving on %s:%d in %s mode", self.host, self.port, cmap.body["mode"])

    def _reply_all(self, done: list[Completion]) -> None:
        for c in done:
            identity, seq = c.token
            arrays = [] if c.value is None else [c.value]
            self.service.reply(identity, Message(Op.OK, seq=seq, arrays=arrays))

    def _key_and_value(self, msg: Message, with_value: bool) -> tuple:
        key = check_key(msg.body.get("key"))
        if not (isinstance(msg.sender, int) and 0 <= msg.sender < self.state.num_workers):
            raise ProtocolError(f"{msg.op.name} carries no valid worker rank (got {msg.sender!r})")
        if with_value and len(msg.arrays) != 1:
            raise ProtocolError(f"{msg.op.name} of key {key!r} needs exactly one array")
        return key, (msg.arrays[0] if with_value else None)

    def _on_init(self, identity: bytes, msg: Message) -> None:
        key, value = self._key_and_value(msg, True)
        self.state.init(key, value)
        self.service.reply(identity, Message(Op.OK, seq=msg.seq))

    def _on_push(self, identity: bytes, msg: Message) -> None:
        key, value = self._key_and_value(msg, True)
        self._reply_all(self.state.push((identity, msg.seq), msg.sender, key, value))

    def _on_pull(self, identity: bytes, msg: Message) -> None:
        key, _ = self._key_and_value(msg, False)
        self._reply_all(self.state.pull((identity, msg.seq), msg.sender, key))

    def _on_pushpull(self, identity: bytes, msg: Message) -> None:
        key, value = self._key_and_value(msg, True)
        self._reply_all(self.state.pushpull((identity, msg.seq), msg.sender, key, value))

    def run(self) -> int:
        """Serve until the scheduler says SHUTDOWN; return the exit code."""
        poller = transport.Poller()
        poller.add(self.service.sock)
        poller.add(self.scheduler)
        while True:
            ready = poller.wait(None)
            if self.service.sock in ready:
                self.service.poll_once(0)
            if self.scheduler in ready:
                try:
                    msg = protocol.decode(transport.recv(self.scheduler))
                except ProtocolError as exc:
                    log.warning("dropped a bad message from the scheduler: %s", exc)
                    continue
                if msg.op is Op.SHUTDOWN:
                    transport.send(self.scheduler, protocol.encode(Message(Op.OK, seq=msg.seq)))
                    log.info("shut down by the scheduler (%d keys held)", len(self.state))
                    transport.close(self.service.sock)
                    transport.close(self.scheduler, linger=1.0)
                    return 0
                log.warning("ignored %s from the scheduler", msg.op.name)


def _serve(cfg: kvconfig.Config) -> int:
    server = Server(cfg)
    server.join()
    return server.run()


def main() -> int:
    """Entry point of ``python -m kvstore.server``."""
    return run_role("server", _serve, rank=lambda cfg: cfg.server_id)


if __name__ == "__main__":
    sys.exit(main())

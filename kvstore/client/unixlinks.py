"""A worker's Unix-socket links to the servers on its host (``kvstore.net.unixlink``).

:func:`attach` asks each server for a link (``Op.LINK`` over zmq), connects to the abstract socket a
server names, and binds the link with the server's token over it; each server so reached gets every
later request of this worker over its link (:meth:`kvstore.client.mux.Mux.use_link`), as long as it
also maps the worker's shared-memory segment (:func:`keep_with_segments`).  A server on another host
(or network namespace), one that offers none (``KVSTORE_UNIX_LINKS=0``, encryption on), one without
shared memory, or one that does not answer stays on zmq: one log line says which and why.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from kvstore.client.mux import Mux
from kvstore.config import Config
from kvstore.net import shm
from kvstore.net.protocol import Message, Op
from kvstore.net.unixlink import UnixLink

log = logging.getLogger("kvstore.dist")


def unusable(cfg: Config) -> str | None:
    """Why this worker keeps every server on zmq, or None.  A link carries headers and small arrays
    while big ones ride in shared memory: without shared memory, big values would cross it inline,
    where zmq's I/O threads move them faster (0.6x the throughput over a link, docs/benchmarks.md)."""
    if not cfg.unix_links:
        return "KVSTORE_UNIX_LINKS=0"
    if cfg.encrypt:
        return f"KVSTORE_ENCRYPT={cfg.encrypt} keeps every byte on the encrypted sockets"
    why = shm.unusable(cfg)
    if why is not None:
        return f"no same-host shared memory ({why})"
    return None


def keep_with_segments(wire: Mux, linked: list[int], segments: Collection[int]) -> list[int]:
    """Put back on zmq each linked server that did not map this worker's segment (``segments``: the
    servers that did); return those still linked.  Call it with nothing in flight to them."""
    for i in linked:
        if i not in segments:
            wire.use_link(i, None)
    return [i for i in linked if i in segments]


def attach(cfg: Config, wire: Mux, servers: int, timeout: float) -> list[int]:
    """Link this worker to each of ``servers`` that offers a link it can reach; return their indices.
    Call it with nothing in flight to the servers.  Raises nothing."""
    why = unusable(cfg)
    if why is not None:
        log.info("Unix-socket links off: %s", why)
        return []
    offers = {i: wire.submit(i, Message(Op.LINK, {}), f"link offer from server {i}") for i in range(servers)}
    linked: list[int] = []
    missed: dict[int, str] = {}
    for i, request in offers.items():
        try:
            body = wire.wait(request, timeout).body
        except Exception as exc:  # noqa: BLE001 - an old server, or none in time: it stays on zmq
            missed[i] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        address, token = body.get("address"), body.get("token")
        if not isinstance(address, str) or not isinstance(token, bytes):
            missed[i] = str(body.get("why", "no link offered"))[:200]
            continue
        try:
            # replies have no size limit, as on a DEALER (zmq's MAXMSGSIZE bounds what servers read)
            link = UnixLink(address, i, 0, cfg.request_timeout, wire.cancelled)
        except OSError as exc:  # another host or network namespace
            missed[i] = f"not reachable from here ({exc.strerror or exc})"
            continue
        wire.use_link(i, link)
        try:
            wire.wait(wire.submit(i, Message(Op.LINK, {"token": token}), f"link to server {i}"), timeout)
        except Exception as exc:  # noqa: BLE001 - back to zmq
            wire.use_link(i, None)
            missed[i] = f"the link was refused: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        linked.append(i)
    if missed:
        log.info("server(s) %s stay on zmq: %s", sorted(missed), next(iter(missed.values())))
    if linked:
        log.info("Unix-socket links to server(s) %s", linked)
    return linked

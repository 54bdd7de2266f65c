"""A worker's side of a server restarted from its shard (kvstore/server/restore.py, docs/failures.md).

The scheduler names a restarted server in every heartbeat reply (``restarted``: rank, incarnation,
host, port).  For each new one, a thread of its own (the heartbeat must go on beating):

1. holds every request to that server: those the lost server never answered and every later one
   (:meth:`Mux.hold`), taking a copy of the worker's push counts at the same instant;
2. connects to the new address and swaps the socket in (what the old one still queued is dropped);
3. sends ALIGN: for each key the worker has pushed, the round of its oldest unanswered push to that
   server (or of its next push), and its ``origin`` (the round it rejoined at, 0 if it never
   restarted); the reply comes once every worker has aligned;
4. sends the held requests again, in order, sealed anew for the new incarnation's name.

A failure (no reply within ``KVSTORE_REQUEST_TIMEOUT``) fails the store's requests (``Mux.fail``) with a
:class:`NodeLostError` naming the server, as a lost server always did.  A :class:`Realigner` works on
the store's :class:`~kvstore.client.datapath.DataPath`, never on the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvstore.client.datapath import DataPath
from kvstore.client.joining import Rejoin
from kvstore.config import Config
from kvstore.core.partition import Key
from kvstore.errors import NodeLostError
from kvstore.net import transport
from kvstore.net.auth import server_name
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.dist")


def lowest_rounds(held: list[Message], pushes: dict[Key, int]) -> tuple[list[Key], list[int]]:
    """ALIGN's keys and rounds: each key's oldest round among the ``held`` PUSH / PUSHPULL messages
    (and a row-sparse table's among its SPARSE_PUSH chunks), else its next round (``pushes``: the
    worker's pushes of each key so far)."""
    low: dict[Key, int] = {}
    for msg in held:
        if msg.op is Op.PUSH or msg.op is Op.PUSHPULL:
            for key, rnd in zip(msg.body.get("keys", []), msg.body.get("rounds", [])):
                low[key] = min(low.get(key, rnd), rnd)
        elif msg.op is Op.SPARSE_PUSH:
            key, rnd = msg.body["key"], msg.body["round"]
            low[key] = min(low.get(key, rnd), rnd)
    for key, count in pushes.items():
        low.setdefault(key, count)
    return list(low), [low[key] for key in low]


def incarnations(cmap: dict) -> list[int]:
    """Each server's incarnation in a cluster map (``server_incarnations``; 0s when absent or malformed)."""
    found = cmap.get("server_incarnations")
    count = len(cmap.get("servers") or [])
    if isinstance(found, list) and len(found) == count and all(type(i) is int and i >= 0 for i in found):
        return found
    return [0] * count


def server_names(cmap: dict) -> dict[int, str]:
    """The names of the servers a cluster map says were restarted before this worker joined."""
    return {rank: server_name(rank, inc) for rank, inc in enumerate(incarnations(cmap)) if inc}


class Realigner:
    """Starts one alignment per restarted server incarnation the scheduler names (module docstring):
    over ``path`` (the store's data path), with ``cfg`` (this worker's settings), the cluster map ``cmap``
    it joined with, and ``rejoin``, this worker's own rejoin if it was restarted (its round, and which
    servers have yet to count it).  ``moved(index, address)`` is told each restarted server's new
    address once its socket is swapped in (the heartbeat's liveness links, kvstore.net.links).
    ``hold(index)`` holds a server's requests and gives the push counts: ``DistRows.hold``, whose
    counts include the row-sparse tables' (``path.hold`` when not given)."""

    def __init__(self, path: DataPath, cfg: Config, cmap: dict, rejoin: Rejoin,
                 moved: Callable[[int, str], None] | None = None,
                 hold: Callable[[int], dict[Key, int]] | None = None) -> None:
        self.path, self.cfg, self.rejoin, self.moved = path, cfg, rejoin, moved
        self.hold = hold if hold is not None else path.hold  # the row-sparse tables' (DistRows.hold)
        # server index -> the incarnation aligned with (or being); the map's are connected already
        self.known: dict[int, int] = dict(enumerate(incarnations(cmap)))
        self.threads: list[threading.Thread] = []

    def on_restarted(self, entries: Any) -> None:
        """The heartbeat's report: ``[[rank, incarnation, host, port], ...]``; malformed ones are skipped."""
        for entry in entries if isinstance(entries, list) else []:
            if not (isinstance(entry, list) and len(entry) == 4 and all(type(v) is int for v in entry[:2])
                    and isinstance(entry[2], str) and type(entry[3]) is int):
                log.warning("ignored a malformed server restart in a heartbeat reply: %r", entry)
                continue
            rank, incarnation, host, port = entry
            if not 0 <= rank < self.path.cluster.num_servers or incarnation <= self.known.get(rank, 0):
                continue
            self.known[rank] = incarnation
            thread = threading.Thread(target=self.align, args=(rank, incarnation, host, port),
                                      name=f"kvstore-realign-{rank}", daemon=True)
            self.threads.append(thread)
            thread.start()

    def align(self, rank: int, incarnation: int, host: str, port: int) -> None:
        """Steps 1-4 of the module docstring for server ``rank``; a failure fails the store."""
        path, io, cfg = self.path, self.path.mux, self.cfg
        where = transport.address(host, port)
        try:
            sock = transport.connect_dealer(where, curve=transport.curve_keys(cfg))
            pushes = self.hold(rank)  # no push is counted but not yet held meanwhile
            io.swap(rank, sock, server_name(rank, incarnation))
            if self.moved is not None:
                self.moved(rank, where)
            keys, rounds = lowest_rounds(io.held(rank), pushes)
            # each key's next round once the held pushes are sent again: a rejoiner's first push may
            # belong beyond the rounds they open (kvstore/core/shard.py, ShardState.promise)
            nexts = [max(pushes.get(key, rnd), rnd) for key, rnd in zip(keys, rounds)]
            body = {"incarnation": cfg.incarnation, "keys": keys, "rounds": rounds, "next": nexts}
            if self.rejoin.pending(rank):  # its REJOIN (held, or still to be sent) comes after this
                body.update(origin=0, rejoining=True)
            else:
                body["origin"] = self.rejoin.at or 0
            request = io.submit(rank, Message(Op.ALIGN, body), f"align with restarted server {rank} "
                                f"({where})", bypass=True)
            reply = path.wait([request])[0]
            if self.known.get(rank) != incarnation:  # restarted again meanwhile: the newer thread releases
                return
            sent = io.release(rank)
        except Exception as exc:  # noqa: BLE001 -- any failure fails the store: its held requests never go
            if self.known.get(rank) != incarnation:  # its socket was swapped out by a newer restart's
                log.warning("server %d incarnation %d was restarted again before worker %d aligned with "
                            "it: %s", rank, incarnation, path.cluster.rank, exc)
                return
            error = NodeLostError(f"server {rank} was restarted at {where} but worker {path.cluster.rank} "
                                  f"could not align with it: {exc}", role="server", rank=rank, host=host)
            io.fail(error)
            return
        log.warning("server %d restarted (incarnation %d) at %s: aligned, %d requests sent again; it lost "
                    "%s rounds of updates", rank, incarnation, where, sent, reply.body.get("lost"))

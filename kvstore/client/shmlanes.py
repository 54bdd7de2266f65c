"""A worker's same-host shared memory: one segment per server on its host (``kvstore.net.shm``).

:func:`attach` makes the segments and offers each server its own (``Op.SHM_ATTACH``); the servers
that map it become :class:`Lanes`, which the wire (``kvstore.client.mux``) asks, for each request,
to move its big arrays into the segment (:meth:`Lanes.place`) and to read replies placed there
(:meth:`Lanes.resolver`).  Every other server, and every array that does not fit, stays on TCP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvstore.client.mux import Mux
from kvstore.config import Config
from kvstore.core.partition import Key
from kvstore.core.plan import Send, Span
from kvstore.core.values import Meta
from kvstore.net import shm
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.dist")


class Lent(np.ndarray):
    """A view of a caller's memory pushed as it is (``DataPath.send``'s ``lend``): :meth:`Lanes.place`
    never lets it leave by reference, so the caller may change that memory as soon as the call returns.
    Placed, its message keeps a view of the segment's copy instead; not placed, a copy of it."""


def _own(msg: Message) -> None:
    """Replace each :class:`Lent` array of ``msg`` (one that still refers to the caller's memory) with a
    plain copy: it goes inline."""
    for i in range(len(msg.arrays)):
        if type(msg.arrays[i]) is Lent:
            msg.arrays[i] = np.array(msg.arrays[i], copy=True, order="C")


class Lanes:
    """The segments of the servers that mapped theirs, by server index, and what went through them."""

    def __init__(self, segments: dict[int, shm.Segment]) -> None:
        self.segments = segments
        self.sent = 0  # array bytes this worker wrote into segments
        self.received = 0  # reply bytes servers wrote there
        self._full_logged: set[int] = set()
        self._piece_fits: dict[int, bool] = {}  # server -> whether the piece being chunked to it fits

    def _fits(self, target: int, segment: shm.Segment, chunk: tuple[int, int] | None) -> bool:
        """Whether a message may use the segment: always for a whole message; for a chunk of a big
        piece (``chunk``: its byte offset in the piece, the piece's bytes), whether the whole piece fit
        the free part when its first chunk left (a piece's chunks leave as one run), so a piece goes
        through the segment whole or over TCP whole, never split between them (logged once)."""
        if chunk is None:
            return True
        if chunk[0] == 0:
            self._piece_fits[target] = fits = chunk[1] <= segment.free_bytes()
            if not fits:
                self._log_full(target, chunk[1])
        return self._piece_fits.get(target, False)

    def place(self, target: int, msg: Message, reply_bytes: int = 0,
              chunk: tuple[int, int] | None = None) -> Callable[[Any], None] | None:
        """Copy ``msg``'s big arrays into ``target``'s segment and reserve ``reply_bytes`` there for the
        reply; return the callback that frees those ranges once the request is answered (None: nothing
        placed).  An array that does not fit goes inline (logged once per server), and so does every
        chunk of a piece that did not fit whole (``chunk``, :meth:`_fits`); a :class:`Lent` one is
        copied either way.  Raises nothing."""
        segment = self.segments.get(target)
        if segment is None or not self._fits(target, segment, chunk):
            _own(msg)
            return None
        taken: list[int] = []
        for i, array in enumerate(msg.arrays):
            if array.nbytes < shm.MIN_BYTES:
                continue
            off = segment.take(array.nbytes)
            if off is None:
                self._log_full(target, array.nbytes)
                continue
            segment.write(off, array)
            if type(array) is Lent:  # a resend (kvstore.client.realign) reads the copy, not the caller's
                msg.arrays[i] = segment.view(off, array.nbytes).view(array.dtype).reshape(array.shape)
            if msg.shm is None:
                msg.shm = [None] * len(msg.arrays)
            msg.shm[i] = off
            taken.append(off)
            self.sent += array.nbytes
        _own(msg)  # the small ones and those that did not fit
        if reply_bytes >= shm.MIN_BYTES:
            off = segment.take(reply_bytes, reply=True)
            if off is not None:
                msg.reply_at = [off, reply_bytes]
                taken.append(off)
        if not taken:
            return None
        return lambda _done: [segment.give(off) for off in taken]

    def _log_full(self, target: int, nbytes: int) -> None:
        if target not in self._full_logged:
            self._full_logged.add(target)
            log.warning("a %d-byte array does not fit the free shared memory of server %d's %d-byte "
                        "segment (KVSTORE_SHM_BYTES): such arrays go over TCP", nbytes, target,
                        self.segments[target].size)

    def resolver(self, target: int) -> Callable[[int, int], Any]:
        """``protocol.decode``'s resolver for replies from server ``target``."""
        segment = self.segments[target]

        def lend(off: int, nbytes: int) -> Any:
            view = segment.lend(off, nbytes)
            self.received += nbytes
            return view
        return lend


def hints(op: Op, send: Send, metas: Mapping[Key, Meta], array: Any) -> dict[str, Any]:
    """``mux.submit``'s shared-memory arguments for a data message of ``send`` (``plan.Send``) carrying
    ``array`` (or None): ``reply_bytes`` (:func:`reply_bytes`) and ``chunk`` (:func:`chunk_of`)."""
    return {"reply_bytes": reply_bytes(op, send.parts, metas), "chunk": chunk_of(send, array)}


def chunk_of(send: Send, array: Any) -> tuple[int, int] | None:
    """For a chunk of a big piece (``plan.Send`` with ``lo``) carrying ``array``: its byte offset in
    the piece and the piece's bytes; None for a whole message or one with no array."""
    if send.lo is None or send.total is None or array is None:
        return None
    return send.lo * array.dtype.itemsize, send.total * array.dtype.itemsize


def reply_bytes(op: Op, parts: list[Span], metas: Mapping[Key, Meta]) -> int:
    """The size of the reply's array to a data request of ``parts`` (``plan.Span``; one dtype), given
    each key's meta: what a same-host server may write into shared memory (0: no reply array)."""
    if op is not Op.PULL and op is not Op.PUSHPULL:
        return 0
    return sum(part.stop - part.start for part in parts) * metas[parts[0].key].dtype.itemsize


def attach(cfg: Config, wire: Mux, servers: int, timeout: float) -> Lanes | None:
    """Offer each of ``servers`` a segment through ``wire`` and return the lanes of those that mapped it
    (None: none did, or shared memory is off; one log line says why).  Raises nothing."""
    why = shm.unusable(cfg)
    if why is not None:
        log.info("same-host shared memory off: %s", why)
        return None
    segments: dict[int, shm.Segment] = {}
    try:
        for i in range(servers):
            segments[i] = shm.Segment(cfg.shm_bytes)
    except OSError as exc:
        for made in segments.values():  # their descriptors would stay open with nobody to close them
            made.close_fd()
        log.warning("same-host shared memory off: no %d-byte segment (%s); values go over TCP",
                    cfg.shm_bytes, exc.strerror or exc)
        return None
    requests = {i: wire.submit(i, Message(Op.SHM_ATTACH, seg.attach_body()),
                               f"shared-memory offer to server {i}") for i, seg in segments.items()}
    refused: dict[int, str] = {}
    for i, request in requests.items():
        try:
            body = wire.wait(request, timeout).body
            if body.get("attached") is not True:
                refused[i] = str(body.get("why", "refused"))[:200]
        except Exception as exc:  # an old server, or none in time: that pair stays on TCP
            refused[i] = f"{type(exc).__name__}: {str(exc)[:200]}"
        segments[i].close_fd()
    for i in refused:
        del segments[i]
    if refused:
        log.info("same-host shared memory not used with server(s) %s: %s", sorted(refused),
                 next(iter(refused.values())))
    if not segments:
        return None
    log.info("same-host shared memory with server(s) %s (%d-byte segments)", sorted(segments), cfg.shm_bytes)
    return Lanes(segments)

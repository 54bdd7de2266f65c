"""How a worker cuts a call's keys into messages: pure functions, no I/O.

Each key's value is split into pieces (``partition.placement``: whole on its home
server, or one slice per server).  Then, per server:

* **small pieces** (at most :data:`SMALL_BYTES`) of one dtype are packed into
  batches: one message carries many keys, their values concatenated into one
  array frame, up to ``batch_bytes`` of values per message (``batch_bytes=0``
  sends one message per piece);
* **big pieces** go alone, whole up to :data:`WHOLE_CHUNKS` chunks, and beyond that
  (pushes, INIT and STATE_SET: ``chunked``) cut into chunks of ``chunk_bytes`` (one
  message each), so a server adds one chunk while the next is on the wire, what a
  server has received but not yet read stays small (``kvstore.server.server.INBOUND_MESSAGES``),
  and no frame exceeds ``KVSTORE_MAX_MESSAGE_BYTES`` (at least ``WHOLE_CHUNKS *
  chunk_bytes``, ``kvstore.config.check_message_limits``).  Pulls ask for whole pieces.
  A whole piece lets a lone worker's push become the stored value with no copy.

A message's body names its keys, the element count of each (``sizes``) and, for a
chunk, the offset ``lo`` of the chunk in the server's slice (docs/protocol.md); a
chunk's :attr:`Send.total` is its piece's element count (an INIT chunk carries it).
The replies to a pull's messages are put back together by :func:`collect`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from kvstore.config import WHOLE_CHUNKS  # a piece of up to this many chunks goes in one message
from kvstore.core.partition import Key, Piece
from kvstore.errors import ProtocolError

SMALL_BYTES = 64 * 1024  # a piece up to this size may share a message with others
BATCH_HEADER_BYTES = 256 * 1024  # a batch's keys stay well inside the protocol's 1 MiB header limit


class Layout(Protocol):
    """The shape, dtype and element count of a key's value (a ``kvstore.core.values.Meta``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    size: int


class Span(NamedTuple):
    """Elements ``[start, stop)`` of ``key``'s flat value, carried by one message."""

    key: Key
    start: int
    stop: int


@dataclass
class Send:
    """One message to ``server``: its parts in order; ``lo`` is set for a chunk of a big piece, and
    ``total`` then holds that piece's element count.

    Complete once planned: its body and offsets are computed on first use and kept, since a
    plan is reused for every call with the same keys.
    """

    server: int
    parts: list[Span]
    lo: int | None = None
    total: int | None = None
    tag: Any = None  # the plan's tag of its keys (a push's compression: keys of one tag share batches)
    _body: dict | None = field(default=None, repr=False, compare=False)
    _offsets: list[int] | None = field(default=None, repr=False, compare=False)

    def body(self) -> dict:
        """The message body: keys, sizes and, for a chunk, its offset in the server's slice."""
        if self._body is None:
            body: dict = {"keys": [p.key for p in self.parts],
                          "sizes": [p.stop - p.start for p in self.parts]}
            if self.lo is not None:
                body["lo"] = self.lo
            self._body = body
        return self._body

    def offsets(self) -> list[int]:
        """Where each part starts in the message's array, then the array's length."""
        if self._offsets is None:
            offsets = [0]
            for part in self.parts:
                offsets.append(offsets[-1] + part.stop - part.start)
            self._offsets = offsets
        return self._offsets


def init_body(send: Send) -> dict:
    """An INIT message's body: a chunk also carries its piece's element count (``total``), since
    the server does not know the key before its last chunk."""
    body = send.body()
    return body if send.lo is None else dict(body, total=send.total)


def chunk_elements(chunk_bytes: int, dtype: np.dtype) -> int:
    """Elements per chunk of ``dtype`` (at least one)."""
    return max(1, chunk_bytes // dtype.itemsize)


def plan(entries: list[tuple[Key, np.dtype, list[Piece]]], batch_bytes: int, chunk_bytes: int,
         chunked: bool = True, tags: dict[Key, Any] | None = None) -> list[Send]:
    """The messages that carry ``entries`` (key, dtype, pieces), in the order they should be sent.

    Messages are in order of their first part's appearance.  A key is always small or
    always big (its pieces' sizes are fixed at init), so a server sees a worker's
    messages for one key in the order the calls made them.
    ``chunked=False`` sends big pieces whole (pulls: a reply is one consistent slice).
    ``tags`` gives keys a tag (None by default): only keys of one tag share a batch.
    """
    sends: list[Send] = []
    open_batches: dict[tuple, list] = {}  # (server, dtype, tag) -> [send, bytes, header bytes]
    for key, dtype, pieces in entries:
        itemsize = dtype.itemsize
        tag = None if tags is None else tags.get(key)
        for piece in pieces:
            nbytes = (piece.stop - piece.start) * itemsize
            if nbytes <= SMALL_BYTES and batch_bytes > 0:
                extra = 24 + len(key) * 4 if isinstance(key, str) else 24  # generous header estimate
                batch = open_batches.get((piece.server, dtype, tag))
                if batch is None or batch[1] + nbytes > batch_bytes or batch[2] + extra > BATCH_HEADER_BYTES:
                    batch = open_batches[(piece.server, dtype, tag)] = [Send(piece.server, [], tag=tag), 0, 0]
                    sends.append(batch[0])
                batch[0].parts.append(Span(key, piece.start, piece.stop))
                batch[1] += nbytes
                batch[2] += extra
                continue
            step = chunk_elements(chunk_bytes, dtype) if chunked and chunk_bytes > 0 else 0
            if not step or piece.stop - piece.start <= WHOLE_CHUNKS * step:
                sends.append(Send(piece.server, [Span(key, piece.start, piece.stop)], tag=tag))
                continue
            for start in range(piece.start, piece.stop, step):
                stop = min(start + step, piece.stop)
                sends.append(Send(piece.server, [Span(key, start, stop)], lo=start - piece.start,
                                  total=piece.stop - piece.start, tag=tag))
    return sends


def pack(send: Send, flats: dict[Key, np.ndarray]) -> np.ndarray:
    """The one array frame of a push-like ``send``: its parts' elements, concatenated.

    A message of one part sends a view of the value (no copy).
    """
    if len(send.parts) == 1:
        part = send.parts[0]
        return flats[part.key][part.start:part.stop]
    return np.concatenate([flats[p.key][p.start:p.stop] for p in send.parts])


def unpack(send: Send, array: np.ndarray) -> list[np.ndarray]:
    """Split a reply's array frame into one view per part of ``send``.

    Raises ValueError when the array does not hold exactly the parts' elements.
    """
    offsets = send.offsets()
    if array.ndim != 1 or array.size != offsets[-1]:
        raise ValueError(f"a reply holds {array.size} elements where {offsets[-1]} were asked for")
    if len(offsets) == 2:
        return [array]
    return [array[a:b] for a, b in zip(offsets, offsets[1:])]


def gather(sends: list[Send], frames: list[list[np.ndarray]]) -> dict[Key, list[tuple[Span, np.ndarray]]]:
    """Each key's parts, with a view of its elements, from the array frames of the replies to ``sends``.

    Raises :class:`ProtocolError` for a reply without exactly one frame or of the wrong length.
    """
    got: dict[Key, list[tuple[Span, np.ndarray]]] = {}
    for send, arrays in zip(sends, frames):
        if len(arrays) != 1:
            raise ProtocolError(f"server {send.server} answered a pull with {len(arrays)} arrays")
        try:
            views = unpack(send, arrays[0])
        except ValueError as exc:
            raise ProtocolError(f"server {send.server}: {exc}") from None
        for part, view in zip(send.parts, views):
            parts = got.get(part.key)
            if parts is None:
                got[part.key] = [(part, view)]
            else:
                parts.append((part, view))
    return got


def assemble(layout: Layout, parts: list[tuple[Span, np.ndarray]], out: Any = None) -> np.ndarray | None:
    """One key's value from its parts: written into ``out`` when that is a C-contiguous numpy array
    (then None is returned), else a view of a lone whole part or a new array."""
    if type(out) is np.ndarray and out.flags.c_contiguous:
        if len(parts) == 1 and parts[0][0].stop - parts[0][0].start == layout.size:
            np.copyto(out, parts[0][1].reshape(out.shape))
        else:
            target = out.reshape(-1)  # a view: writing it writes the out
            for part, view in parts:
                target[part.start:part.stop] = view
        return None
    if len(parts) == 1:
        return parts[0][1].reshape(layout.shape)
    array = np.empty(layout.size, layout.dtype)
    for part, view in parts:
        array[part.start:part.stop] = view
    return array.reshape(layout.shape)


def collect(keys: list[Key], layouts: Sequence[Layout], sends: list[Send], frames: list[list[np.ndarray]],
            outs: Sequence[Any] | None = None) -> list[np.ndarray | None]:
    """The value of each of ``keys`` (with its layout) from the replies' frames to ``sends``.

    ``outs`` gives each key an array to write into, or None; a key written into its out gets None in
    the result.  Raises :class:`ProtocolError` for a reply that does not match its message.
    """
    got = gather(sends, frames)
    return [assemble(layout, got[key], None if outs is None else outs[i])
            for i, (key, layout) in enumerate(zip(keys, layouts))]

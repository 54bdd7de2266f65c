"""Wire format: a msgpack header frame followed by one raw frame per array.

Pure bytes in, bytes out: this module never touches a socket (``transport``
does) and is the only one that imports msgpack.

Header (a msgpack map)::

    {"v": PROTOCOL_VERSION, "op": int(Op), "seq": int, "sender": int | None,
     "auth": [label, n, to], "body": {...}, "arrays": [[dtype, [dim, ...]], ...]}

``sender`` (the node's rank), ``seq`` (the request number, echoed by the reply)
and ``auth`` (``[label, n, to]``, checked by ``kvstore.auth``, whose MAC frame
precedes these frames on the wire) are in every header.  Array
frames follow the header in order and hold C-ordered raw bytes; decoding wraps
them without copying.  See docs/protocol.md.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from kvstore.core.dtypes import BY_NAME, DTYPES, dtype_name
from kvstore.errors import ProtocolError

PROTOCOL_VERSION = 4
MAX_HEADER_BYTES = 1 << 20


class Op(enum.IntEnum):
    """Message kinds.  Control ops go to the scheduler, data ops to servers."""

    REGISTER = 1   # node -> scheduler: role, address, wanted rank, mode
    MAP = 2        # scheduler -> node: the cluster map and the node's rank
    BARRIER = 3    # worker -> scheduler; released when every worker arrived
    LEAVE = 4      # worker -> scheduler and -> each server (after its pushes): this worker is done
    SHUTDOWN = 5   # scheduler -> server: stop serving and exit
    OK = 6         # reply: success (body and arrays depend on the request)
    ERROR = 7      # reply: {"code": error class name, "message": str}
    HEARTBEAT = 8  # node -> scheduler: {"role", "rank"}; reply OK {"lost": [[role, rank, host, why]]}
    HELLO = 20     # node -> scheduler: {"nonce"}: asks for a registration challenge
    CHALLENGE = 21  # scheduler -> node: {"nonce" (echoed), "challenge"}: REGISTER must carry it
    # Data ops carry {"keys": [...], "sizes": [...]} (+ "lo" for a chunk of one key, kvstore.plan) and
    # one flat array holding every key's elements in order (none for PULL); replies to PULL and
    # PUSHPULL carry the values the same way, once every key of the request is answered.
    INIT = 10      # worker -> server: store these slices of new keys
    PUSH = 11      # worker -> server: contribute to each key's current round
    PULL = 12      # worker -> server: read the keys' slices
    PUSHPULL = 13  # worker -> server: push, then reply with the updated slices
    OPTIMIZER_SET = 14     # worker -> server: {"spec": optimizer spec}; replaces it, drops all state
    OPTIMIZER_PARAMS = 15  # worker -> server: {"params": {...}}; changes hyper-parameters, keeps state
    OPTIMIZER_INFO = 16    # worker -> server: reply {"spec": spec | None, "num_update": int}
    STATE_GET = 17         # worker -> server: {"key"}; reply {"count", "names"} + one array per name
    STATE_SET = 18         # worker -> server: {"key", "count", "names"} + one array per name


@dataclass
class Message:
    """One decoded (or to-be-encoded) message."""

    op: Op
    body: dict[str, Any] = field(default_factory=dict)
    arrays: list[np.ndarray] = field(default_factory=list)
    seq: int = 0
    sender: int | None = None
    auth: Any = None  # [label, n, to], set by kvstore.auth.Channel.seal


def _array_meta(array: np.ndarray) -> list[Any]:
    name = dtype_name(array.dtype)
    if name is None:
        raise ProtocolError(f"dtype {array.dtype} cannot be sent; supported: {', '.join(sorted(DTYPES))}")
    return [name, list(array.shape)]


def encode(msg: Message) -> list[Any]:
    """Encode ``msg`` into frames: header bytes, then one zero-copy buffer per array.

    Raises :class:`ProtocolError` for an unsupported dtype.
    """
    arrays = [np.ascontiguousarray(a).reshape(a.shape) for a in msg.arrays]
    header = {"v": PROTOCOL_VERSION, "op": int(msg.op), "seq": msg.seq, "sender": msg.sender,
              "auth": msg.auth, "body": msg.body, "arrays": [_array_meta(a) for a in arrays]}
    frames: list[Any] = [msgpack.packb(header, use_bin_type=True)]
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{msg.op.name} header of {len(frames[0])} bytes exceeds the "
                            f"{MAX_HEADER_BYTES}-byte limit (is a key or a body field huge?)")
    frames.extend(memoryview(a.reshape(-1)).cast("B") if a.size else b"" for a in arrays)
    return frames


def _decode_header(raw: Any) -> dict[str, Any]:
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this node speaks "
                            f"version {PROTOCOL_VERSION}); run the same kvstore version everywhere")
    return header


def _decode_array(meta: Any, frame: Any) -> np.ndarray:
    if not (isinstance(meta, list) and len(meta) == 2 and meta[0] in DTYPES
            and isinstance(meta[1], list) and all(isinstance(d, int) and d >= 0 for d in meta[1])):
        raise ProtocolError(f"bad array description {meta!r}")
    dtype = BY_NAME[meta[0]]
    shape = tuple(meta[1])
    expected = math.prod(shape) * dtype.itemsize
    buf = memoryview(frame).cast("B")
    if buf.nbytes != expected:
        raise ProtocolError(f"array frame has {buf.nbytes} bytes, its header declares {expected} "
                            f"({meta[0]} {list(shape)})")
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def decode(frames: list[Any]) -> Message:
    """Decode frames (bytes-like) into a :class:`Message` whose arrays view the frames' memory.

    Raises :class:`ProtocolError` on garbage, a version mismatch, an unknown op
    or arrays that do not match their declared sizes.
    """
    if not frames:
        raise ProtocolError("empty message")
    header = _decode_header(frames[0])
    try:
        op = Op(header.get("op"))
    except ValueError:
        raise ProtocolError(f"unknown op {header.get('op')!r}") from None
    metas = header.get("arrays") or []
    body = header.get("body") or {}
    if not isinstance(metas, list) or not isinstance(body, dict):
        raise ProtocolError("header fields 'arrays'/'body' have the wrong type")
    if len(metas) != len(frames) - 1:
        raise ProtocolError(f"header declares {len(metas)} arrays but {len(frames) - 1} frames follow")
    arrays = [_decode_array(meta, frame) for meta, frame in zip(metas, frames[1:])]
    seq = header.get("seq", 0)
    sender = header.get("sender")
    if not isinstance(seq, int) or not (sender is None or isinstance(sender, int)):
        raise ProtocolError("header fields 'seq'/'sender' have the wrong type")
    return Message(op=op, body=body, arrays=arrays, seq=seq, sender=sender, auth=header.get("auth"))


def error_reply(request_seq: int, code: str, message: str, sender: int | None = None,
                node: list | None = None) -> Message:
    """Build the ERROR reply to request ``request_seq`` (``node``: the lost node a NodeLostError names)."""
    body: dict[str, Any] = {"code": code, "message": message}
    if node is not None:
        body["node"] = node
    return Message(Op.ERROR, body, seq=request_seq, sender=sender)

"""Wire format: a msgpack header frame followed by one raw frame per array.

Pure bytes in, bytes out: this module never touches a socket (``transport``
does) and is the only one that imports msgpack.

Header (a msgpack map)::

    {"v": PROTOCOL_VERSION, "op": int(Op), "seq": int, "sender": int | None,
     "auth": [label, n, to], "body": {...}, "arrays": [[dtype, [dim, ...]], ...],
     "shm": [offset | nil, ...] (optional), "reply_at": [offset, bytes] (optional)}

``sender`` (the node's rank), ``seq`` (the request number, echoed by the reply)
and ``auth`` (``[label, n, to]``, checked by ``kvstore.net.auth``, whose MAC frame
precedes these frames on the wire) are in every header.  Array
frames follow the header in order and hold C-ordered raw bytes; decoding wraps
them without copying.  An array whose ``shm`` entry is an offset travels in the
worker's shared-memory segment (``kvstore.net.shm``): its frame is empty and
``decode``'s ``resolve`` turns the offset into its bytes; ``reply_at`` is the range
a worker reserved there for the reply.  See docs/protocol.md.

``decode`` checks every field before it uses it (types, each array description's
dims and byte count, computed in Python ints before numpy sees them) and raises
:class:`ProtocolError`, never anything else, on any input whatsoever: a peer's
bytes cannot raise past a node's request loop.
"""

from __future__ import annotations

import enum
import reprlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from kvstore.core.dtypes import BY_NAME, DTYPES, dtype_name
from kvstore.errors import ProtocolError

PROTOCOL_VERSION = 12
MAX_HEADER_BYTES = 1 << 20
# An array description has at most MAX_DIMS dims: numpy 1.x builds arrays of up to 32 dims, 2.x of
# up to 64, and a wire rule must not depend on which one a node has installed (setup.py allows both).
MAX_DIMS = 32
MAX_DIM = 2**63 - 1  # the largest dim (npy_intp); their product is checked against sys.maxsize too
_REPR = reprlib.Repr()  # bounded reprs of untrusted values in error messages
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 6, 60, 60


class Op(enum.IntEnum):
    """Message kinds.  Control ops go to the scheduler, data ops to servers."""

    REGISTER = 1   # node -> scheduler: role, address, wanted rank, mode
    MAP = 2        # scheduler -> node: the cluster map and the node's rank
    BARRIER = 3    # worker -> scheduler; released when every worker arrived
    LEAVE = 4      # worker -> scheduler and -> each server (after its pushes): this worker is done
    SHUTDOWN = 5   # scheduler -> server: stop serving and exit
    OK = 6         # reply: success (body and arrays depend on the request)
    ERROR = 7      # reply: {"code": error class name, "message": str}
    HEARTBEAT = 8  # node -> scheduler: {"role", "rank", "stats"?}; reply OK {"lost": [[role, rank, ...]]}
    STATUS = 9     # secret holder -> scheduler: {}; reply OK {"schema", "cluster", "nodes", "scheduler"}
    HELLO = 20     # node -> scheduler: {"nonce"}: asks for a registration challenge
    CHALLENGE = 21  # scheduler -> node: {"nonce" (echoed), "challenge"}: REGISTER must carry it
    AWAY = 26      # scheduler -> server: {"worker", "incarnation"}: lost, to be restarted; rounds go on
    REJOIN = 27    # restarted worker -> server: {"incarnation"} (reply {"round"}), then {"incarnation", "at"}
    # Pipeline parallelism (docs/pipeline.md): a stage's worker binds one socket and publishes it.
    PIPE_PUBLISH = 28  # worker -> scheduler: {"host", "port"}: this worker's pipeline socket; reply OK
    PIPE_LOOKUP = 29   # worker -> scheduler: {"rank"}; reply OK {"address": [host, port] | None}
    PIPE_ACT = 30      # stage -> next stage: {"step", "mb"} + [activation]
    PIPE_GRAD = 31     # stage -> previous stage: {"step", "mb"} + [gradient of its output]
    PIPE_ABORT = 32    # stage -> neighbours: {"message"}: this stage failed the step; stop waiting
    SHM_ATTACH = 33  # worker -> server: {"pid", "fd", "nonce", "bytes"}; reply OK {"attached": bool, "why"}
    ALIGN = 34  # worker -> restarted server: {"incarnation", "origin", "keys", "rounds"}; OK when all have
    ROUND_ABORT = 35  # worker -> servers: {"keys", "reason"}: its pushpull of them was refused (dist_sync)
    # A stage's same-host segment for a peer (kvstore.pipeline.link.StageShm): {"offer": SHM_ATTACH's body}
    # from the stage; {"attached": bool, "why": str} back; {"free": [offset, ...]}: ranges the peer has read
    PIPE_SHM = 36
    # A same-host worker's Unix-socket link to a server (kvstore.net.unixlink): {} over zmq, reply OK
    # {"address": abstract name | None, "token": bytes, "why"}; then {"token"} over the link, reply OK
    LINK = 37
    # Data ops carry {"keys": [...], "sizes": [...]} (+ "lo" for a chunk of one key, kvstore.core.plan) and
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
    # Row-sparse keys (docs/sparse.md): arrays are [ids int64 (n,), rows (n, width)] or [ids] alone.
    SPARSE_INIT = 22  # worker -> server: {"key", "shape", "dtype", "lo", "hi", "init"}: create rows [lo, hi)
    SPARSE_SET = 23   # worker -> server: {"key"} + [ids, rows]: overwrite those rows (init from a value)
    SPARSE_PUSH = 24  # worker -> server: {"key", "round", "last"} + [ids, rows]: one chunk of a round
    SPARSE_PULL = 25  # worker -> server: {"key", "after"} + [ids]; reply [rows] once "after" rounds applied


_OPS = {int(op): op for op in Op}  # wire number -> Op, without Enum's slower lookup


@dataclass
class Message:
    """One decoded (or to-be-encoded) message."""

    op: Op
    body: dict[str, Any] = field(default_factory=dict)
    arrays: list[np.ndarray] = field(default_factory=list)
    seq: int = 0
    sender: int | None = None
    auth: Any = None  # [label, n, to], set by kvstore.net.auth.Channel.seal
    shm: list[int | None] | None = None  # per array: its offset in the worker's segment, or None (inline)
    reply_at: list[int] | None = None  # [offset, bytes]: where in its segment the worker wants the reply


def _array_meta(array: np.ndarray) -> list[Any]:
    name = dtype_name(array.dtype)
    if name is None:
        raise ProtocolError(f"dtype {array.dtype} cannot be sent; supported: {', '.join(sorted(DTYPES))}")
    if array.ndim > MAX_DIMS:
        raise ProtocolError(f"an array of {array.ndim} dims cannot be sent (at most {MAX_DIMS})")
    return [name, list(array.shape)]


def encode(msg: Message) -> list[Any]:
    """Encode ``msg`` into frames: header bytes, then one zero-copy buffer per array.

    Raises :class:`ProtocolError` for an unsupported dtype, more than ``MAX_DIMS`` dims or an
    oversize header.
    """
    arrays = [np.ascontiguousarray(a).reshape(a.shape) for a in msg.arrays]
    header = {"v": PROTOCOL_VERSION, "op": int(msg.op), "seq": msg.seq, "sender": msg.sender,
              "auth": msg.auth, "body": msg.body, "arrays": [_array_meta(a) for a in arrays]}
    shm = msg.shm
    if shm is not None:
        header["shm"] = shm
    if msg.reply_at is not None:
        header["reply_at"] = msg.reply_at
    frames: list[Any] = [msgpack.packb(header, use_bin_type=True)]
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{msg.op.name} header of {len(frames[0])} bytes exceeds the "
                            f"{MAX_HEADER_BYTES}-byte limit (is a key or a body field huge?)")
    frames.extend(memoryview(a.reshape(-1)).cast("B") if a.size and (shm is None or shm[i] is None) else b""
                  for i, a in enumerate(arrays))
    return frames


def _brief(value: Any) -> str:
    """A short repr of untrusted ``value`` for an error message (a reply must stay far below the
    header limit, whatever a peer sent)."""
    return _REPR.repr(value)


def _bytes_of(frame: Any) -> memoryview:
    """``frame`` as a flat byte view; raises ProtocolError when it is not a contiguous buffer."""
    try:
        return memoryview(frame).cast("B")
    except (TypeError, ValueError, BufferError) as exc:
        raise ProtocolError(f"a frame is not a contiguous byte buffer ({type(frame).__name__}: "
                            f"{str(exc)[:100]})") from None


def _decode_header(raw: Any) -> dict[str, Any]:
    size = raw.nbytes if type(raw) is memoryview else _bytes_of(raw).nbytes  # zmq gives memoryviews
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"header is not valid msgpack: {str(exc)[:200]}") from None
    if type(header) is not dict:
        raise ProtocolError("header is not a map")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {_brief(version)} is not supported (this node speaks "
                            f"version {PROTOCOL_VERSION}); run the same kvstore version everywhere")
    return header


def peek(raw: Any) -> dict[str, Any]:
    """The map of header frame ``raw`` without checking its op or arrays (what a message that fails
    to decode as a whole still says, e.g. its ``seq``); {} when even the map cannot be read.
    Raises nothing."""
    try:
        return _decode_header(raw)
    except Exception:
        return {}


def describe(fields: dict[str, Any]) -> str:
    """What a header's fields (:func:`peek`) say the message is, for an error message: "push of
    keys 'w', 'b' and 2 more", "pull of key 3", "leave", or "message" for an unknown op."""
    try:
        op = Op(fields.get("op")).name.lower()
    except (ValueError, TypeError):
        op = "message"
    body = fields.get("body")
    keys = body.get("keys") if isinstance(body, dict) else None
    if not isinstance(keys, list):
        keys = [body["key"]] if isinstance(body, dict) and "key" in body else []
    named = ", ".join(_brief(k) for k in keys[:3])
    named += f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{op} of key{'s' if len(keys) > 1 else ''} {named}" if keys else op


def _header_fields(header: dict[str, Any]) -> tuple[Op, int, int | None, Any, dict[str, Any], list]:
    """The header's op, seq, sender, auth, body and array descriptions, each of its wire type."""
    op = header.get("op")
    if type(op) is not int or op not in _OPS:
        raise ProtocolError(f"unknown op {_brief(op)}")
    seq, sender, auth = header.get("seq", 0), header.get("sender"), header.get("auth")
    body, metas = header.get("body", {}), header.get("arrays", [])
    if type(body) is not dict or type(metas) is not list:
        raise ProtocolError("header fields 'arrays'/'body' have the wrong type")
    if type(seq) is not int or not (sender is None or (type(sender) is int and sender >= 0)):
        raise ProtocolError(f"header fields 'seq'/'sender' have the wrong type "
                            f"(seq {_brief(seq)}, sender {_brief(sender)})")
    if auth is not None and not (type(auth) is list and len(auth) == 3 and type(auth[0]) is str
                                 and type(auth[1]) is int and type(auth[2]) is str):
        raise ProtocolError(f"the header's auth field must be nil or [label, n, to], not {_brief(auth)}")
    return _OPS[op], seq, sender, auth, body, metas


def _shape(meta: list, itemsize: int) -> tuple[tuple[int, ...], int]:
    """The shape a description declares and the bytes it takes; raises ProtocolError unless it is
    a list of at most MAX_DIMS ints in [0, MAX_DIM] whose array numpy can make (Python ints, no numpy)."""
    dims = meta[1]
    if type(dims) is not list or len(dims) > MAX_DIMS:
        raise ProtocolError(f"bad array description {_brief(meta)}: the shape must be a list of at "
                            f"most {MAX_DIMS} dims")
    count, nonzero = 1, itemsize
    for dim in dims:
        if type(dim) is not int or not 0 <= dim <= MAX_DIM:
            raise ProtocolError(f"bad array description {_brief(meta)}: each dim must be an int in "
                                f"[0, 2**63-1]")
        count *= dim
        if dim:
            nonzero *= dim
    if nonzero > sys.maxsize:  # numpy's own limit, zero dims aside (it skips them)
        raise ProtocolError(f"bad array description {_brief(meta)}: too big for this machine "
                            f"(its non-zero dims times the itemsize exceed {sys.maxsize})")
    return tuple(dims), count * itemsize


def _described(meta: Any) -> tuple[np.dtype, tuple[int, ...], int]:
    """The dtype, shape and byte count an array description declares; raises ProtocolError."""
    dtype = BY_NAME.get(meta[0]) if type(meta) is list and len(meta) == 2 and type(meta[0]) is str else None
    if dtype is None:
        raise ProtocolError(f"bad array description {_brief(meta)}: not [dtype, [dim, ...]] with a "
                            f"dtype of {', '.join(sorted(DTYPES))}")
    return (dtype, *_shape(meta, dtype.itemsize))


def _decode_array(meta: Any, frame: Any, resolve: Any = None, off: Any = None) -> np.ndarray:
    dtype, shape, expected = _described(meta)
    if off is not None:  # in shared memory: the frame must be empty
        if type(off) is not int or off < 0 or _bytes_of(frame).nbytes:
            raise ProtocolError(f"bad shared-memory entry {_brief(off)}: an offset >= 0 with an empty frame")
        if resolve is None:
            raise ProtocolError("an array in shared memory reached a node that shares no segment with "
                                "its sender")
        frame = resolve(off, expected)
    buf = _bytes_of(frame)
    if buf.nbytes != expected:
        raise ProtocolError(f"array frame has {buf.nbytes} bytes, its header declares {expected} "
                            f"({meta[0]} {_brief(meta[1])})")
    try:
        return np.frombuffer(buf, dtype=dtype).reshape(shape)
    except (ValueError, TypeError, OverflowError, MemoryError) as exc:  # not expected after the checks
        raise ProtocolError(f"bad array description {_brief(meta)}: {str(exc)[:200]}") from None


def decode(frames: Sequence[Any], resolve: Any = None) -> Message:
    """Decode frames (bytes-like) into a :class:`Message` whose arrays view the frames' memory.

    ``resolve(offset, nbytes)``, when given, returns the bytes of an array sent in shared memory
    (``kvstore.net.shm``); without it such an array is refused.  Raises :class:`ProtocolError`, and
    no other exception, for any input that is not such a message (garbage, a version mismatch, an
    unknown op, a mistyped field, a bad array description, a shared-memory range ``resolve`` refuses).
    """
    if type(frames) not in (list, tuple) or not frames:
        raise ProtocolError("empty message" if type(frames) in (list, tuple) else
                            f"frames must be a list, not {type(frames).__name__}")
    header = _decode_header(frames[0])
    op, seq, sender, auth, body, metas = _header_fields(header)
    if len(metas) != len(frames) - 1:
        raise ProtocolError(f"header declares {len(metas)} arrays but {len(frames) - 1} frames follow")
    shm, reply_at = _shm_fields(header, len(metas))
    if shm is None:
        arrays = [_decode_array(meta, frame) for meta, frame in zip(metas, frames[1:])]
    else:
        arrays = [_decode_array(meta, frame, resolve, off)
                  for meta, frame, off in zip(metas, frames[1:], shm)]
    return Message(op=op, body=body, arrays=arrays, seq=seq, sender=sender, auth=auth, shm=shm,
                   reply_at=reply_at)


def _shm_fields(header: dict[str, Any], count: int) -> tuple[list | None, list | None]:
    """The header's optional ``shm`` (one entry per array) and ``reply_at`` ([offset >= 0, bytes > 0])."""
    shm, reply_at = header.get("shm"), header.get("reply_at")
    if shm is not None and not (type(shm) is list and len(shm) == count):
        raise ProtocolError(f"the header's shm field must hold one entry per array, not {_brief(shm)}")
    if reply_at is not None and not (type(reply_at) is list and len(reply_at) == 2
                                     and all(type(n) is int for n in reply_at)
                                     and reply_at[0] >= 0 and reply_at[1] > 0):
        raise ProtocolError(f"the header's reply_at field must be [offset, bytes], not {_brief(reply_at)}")
    return shm, reply_at


def error_reply(request_seq: int, code: str, message: str, sender: int | None = None,
                node: list | None = None) -> Message:
    """Build the ERROR reply to request ``request_seq`` (``node``: the lost node a NodeLostError names)."""
    body: dict[str, Any] = {"code": code, "message": message}
    if node is not None:
        body["node"] = node
    return Message(Op.ERROR, body, seq=request_seq, sender=sender)


def pack_map(fields: dict[str, Any]) -> bytes:
    """``fields`` (str keys; values msgpack can carry: numbers, str, bytes, lists, maps) as one msgpack
    map, for the side channels outside the cluster's wire (the Spark feed's frames)."""
    return msgpack.packb(fields, use_bin_type=True)


def unpack_map(raw: Any) -> dict[str, Any]:
    """The msgpack map ``raw`` (from :func:`pack_map`).  Raises ProtocolError for anything else."""
    try:
        fields = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not valid msgpack: {str(exc)[:200]}") from None
    if not isinstance(fields, dict):
        raise ProtocolError(f"a msgpack {type(fields).__name__}, not a map")
    return fields

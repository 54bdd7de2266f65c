"""The compact layout: a small data message and its reply in one frame of fixed binary fields.

A worker's request for one small key (PUSH, PULL or PUSHPULL of ``{"keys": [k], "sizes": [n]}``,
with ``"rounds": [r]`` or not) and a server's plain OK reply (no body, at most one flat array) make
up almost all of a training loop's small messages.  In the default integrity mode such a message
travels as ONE frame instead of three (MAC, msgpack header, array)::

    [MAC (16 bytes) | fixed fields (FIELDS) | label | to | key | array bytes]

The fixed fields are, little-endian: the marker byte ``MARKER`` (0xc1, a byte msgpack never uses,
so a compact body is never read as a header map), the protocol version, the op, the key's kind
(0 none, 1 an int as 8 bytes, 2 a str in UTF-8), the array's dtype (an index in ``DTYPE_NAMES``,
255 none), the lengths of the label, the addressee and the key, then seq, sender (-1 none), the
auth number, the key's size (-1 none) and its round (-1 none).  The MAC (``kvstore.net.auth``)
covers the whole body, array bytes included, so the arrays of a compact message are authenticated
as well as its header.  Anything else (more keys, a chunk, shared memory, compression, any other
op or body) keeps the general layout of ``kvstore.net.protocol``.

Pure bytes in, bytes out; :func:`unpack` checks every field before it builds anything and raises
:class:`ProtocolError`, and nothing else, on any input.  Where the compiled ``kvstore.net._hot`` is
built (``kvstore.net.native``), :func:`seal` and :func:`unpack` run its C code, which makes the same
bytes and the same checks (tests/unit/net/test_native.py); ``compiled=False`` runs the Python.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kvstore.core.dtypes import BY_NAME, DTYPES, dtype_name
from kvstore.errors import ProtocolError
from kvstore.net import native
from kvstore.net.protocol import _OPS, PROTOCOL_VERSION, Message, Op

MARKER = 0xC1
FIELDS = struct.Struct("<BBBBBBBHQqQqq")
MAX_ARRAY_BYTES = 64 * 1024  # a bigger array keeps the general layout (its own frame, zero-copy)
MAX_KEY_BYTES = 1024  # a longer str key keeps the general layout
DTYPE_NAMES = tuple(sorted(DTYPES))
_DTYPE_CODE = {name: i for i, name in enumerate(DTYPE_NAMES)}
_NO_DTYPE = 255
_REQUESTS = (Op.PUSH, Op.PULL, Op.PUSHPULL)
_SHAPES = ({"keys", "sizes"}, {"keys", "sizes", "rounds"})
MAX_BYTES = FIELDS.size + 3 * 255 + MAX_KEY_BYTES + MAX_ARRAY_BYTES  # the largest compact body
HOT = native.module()  # the compiled layout, or None (the pure-Python path)
if HOT is not None:  # the layout's constants live here only
    HOT.configure(ProtocolError, PROTOCOL_VERSION, MARKER, _NO_DTYPE, FIELDS.size, MAX_BYTES, int(Op.OK),
                  int(Op.PUSH), int(Op.PULL), int(Op.PUSHPULL), DTYPE_NAMES,
                  tuple(BY_NAME[name].itemsize for name in DTYPE_NAMES))


def fits(msg: Message) -> bool:
    """Whether ``msg`` (auth set) can travel in the compact layout; never raises."""
    if msg.shm is not None or msg.reply_at is not None or len(msg.arrays) > 1:
        return False
    if msg.arrays:
        array = msg.arrays[0]
        if type(array) is not np.ndarray or array.ndim != 1 or array.nbytes > MAX_ARRAY_BYTES \
                or dtype_name(array.dtype) is None:
            return False
    op, body = msg.op, msg.body
    if type(body) is not dict:
        return False
    if op is Op.OK:
        return not body
    if op not in _REQUESTS or body.keys() not in _SHAPES:
        return False
    keys, sizes, rounds = body["keys"], body["sizes"], body.get("rounds", [0])
    if not (type(keys) is list and len(keys) == 1 and type(sizes) is list and len(sizes) == 1
            and type(rounds) is list and len(rounds) == 1):
        return False
    key, size, round_ = keys[0], sizes[0], rounds[0]
    short = (type(key) is int and 0 <= key < 2**64) or (type(key) is str and len(key) <= MAX_KEY_BYTES // 4)
    return short and type(size) is int and 0 <= size < 2**63 and type(round_) is int and 0 <= round_ < 2**63


def pack(msg: Message, reserve: int) -> bytearray:
    """The compact body of ``msg`` (:func:`fits` must hold) after ``reserve`` zero bytes (the MAC's
    place).  Raises ProtocolError for a label or addressee over 255 bytes."""
    label, n, to = msg.auth
    label_b, to_b = label.encode(), to.encode()
    if len(label_b) > 255 or len(to_b) > 255:
        raise ProtocolError("a channel label or addressee over 255 bytes cannot be sent compact")
    key_b, kind, size, round_ = b"", 0, -1, -1
    if msg.op is not Op.OK:
        key, size = msg.body["keys"][0], msg.body["sizes"][0]
        round_ = msg.body["rounds"][0] if "rounds" in msg.body else -1
        key_b, kind = (key.to_bytes(8, "little"), 1) if type(key) is int else (key.encode(), 2)
    array = msg.arrays[0] if msg.arrays else None
    code = _NO_DTYPE if array is None else _DTYPE_CODE[dtype_name(array.dtype)]
    sender = -1 if msg.sender is None else msg.sender
    fields = FIELDS.pack(MARKER, PROTOCOL_VERSION, int(msg.op), kind, code, len(label_b), len(to_b),
                         len(key_b), msg.seq, sender, n, size, round_)
    out = bytearray(reserve)
    out += fields
    out += label_b
    out += to_b
    out += key_b
    if array is not None:
        out += np.ascontiguousarray(array).data.cast("B")
    return out


def seal(key: Any, msg: Message) -> bytes:
    """The whole compact frame of ``msg`` (:func:`fits` must hold), its MAC first, made by ``key`` (a
    compiled ``_hot.Key``): the bytes :func:`pack` and the channel's MAC make.  Raises ProtocolError
    for a label or addressee over 255 bytes."""
    label, n, to = msg.auth
    array = msg.arrays[0] if msg.arrays else None
    code = _NO_DTYPE if array is None else _DTYPE_CODE[dtype_name(array.dtype)]
    sender = -1 if msg.sender is None else msg.sender
    if msg.op is Op.OK:
        return key.seal(msg.op, 0, code, label, to, None, msg.seq, sender, n, -1, -1,
                        None if array is None else np.ascontiguousarray(array))
    body = msg.body
    name, rounds = body["keys"][0], body.get("rounds")
    return key.seal(msg.op, 1 if type(name) is int else 2, code, label, to, name, msg.seq, sender, n,
                    body["sizes"][0], -1 if rounds is None else rounds[0],
                    None if array is None else np.ascontiguousarray(array))


def unpack(body: Any, compiled: bool = True) -> Message:
    """The message of a compact ``body`` (the frame after its MAC); raises ProtocolError unless
    every field is well formed.  ``compiled``: by the compiled layout where it is built."""
    if compiled and HOT is not None:
        op, fields, code, start, seq, sender, label, n, to = HOT.unpack(body)
        arrays = [] if code == _NO_DTYPE else [np.frombuffer(memoryview(body)[start:],
                                                             dtype=BY_NAME[DTYPE_NAMES[code]])]
        return Message(op=_OPS[op], body=fields, arrays=arrays, seq=seq, sender=sender, auth=[label, n, to])
    view = memoryview(body).cast("B") if type(body) is not memoryview else body
    if view.nbytes < FIELDS.size or view.nbytes > MAX_BYTES:
        raise ProtocolError(f"a compact message of {view.nbytes} bytes (at least {FIELDS.size}, at most "
                            f"{MAX_BYTES})")
    marker, version, op, kind, code, nl, nt, nk, seq, sender, n, size, round_ = FIELDS.unpack_from(view)
    if marker != MARKER or version != PROTOCOL_VERSION:
        raise ProtocolError(f"compact protocol version {version} is not supported (this node speaks "
                            f"version {PROTOCOL_VERSION}); run the same kvstore version everywhere")
    start = FIELDS.size
    end = start + nl + nt + nk
    if end > view.nbytes:
        raise ProtocolError("a compact message is shorter than its fields declare")
    try:
        label = str(view[start:start + nl], "utf-8")
        to = str(view[start + nl:start + nl + nt], "utf-8")
        key = _key(kind, view[start + nl + nt:end])
    except UnicodeDecodeError:
        raise ProtocolError("a compact message's label, addressee or key is not UTF-8") from None
    return Message(op=_op(op, kind), body=_body(kind, key, size, round_),
                   arrays=_arrays(code, view[end:]), seq=seq,
                   sender=None if sender == -1 else _sender(sender), auth=[label, n, to])


def _op(op: int, kind: int) -> Op:
    """The op of a compact message: a data request with a key, or an OK reply without one."""
    found = _OPS.get(op)
    if not ((found in _REQUESTS and kind) or (found is Op.OK and not kind)):
        raise ProtocolError(f"op {op} with key kind {kind} has no compact layout")
    return found


def _key(kind: int, raw: memoryview) -> Any:
    if kind == 0:
        if raw.nbytes:
            raise ProtocolError("a compact reply carries no key")
        return None
    if kind == 1:
        if raw.nbytes != 8:
            raise ProtocolError("a compact int key takes 8 bytes")
        return int.from_bytes(raw, "little")
    if kind == 2:
        return str(raw, "utf-8")
    raise ProtocolError(f"unknown compact key kind {kind}")


def _body(kind: int, key: Any, size: int, round_: int) -> dict[str, Any]:
    if kind == 0:
        if size != -1 or round_ != -1:
            raise ProtocolError("a compact reply carries no size or round")
        return {}
    if size < 0 or round_ < -1:
        raise ProtocolError(f"a compact request's size {size} or round {round_} is negative")
    return {"keys": [key], "sizes": [size]} if round_ == -1 else {"keys": [key], "sizes": [size],
                                                                  "rounds": [round_]}


def _arrays(code: int, raw: memoryview) -> list[np.ndarray]:
    if code == _NO_DTYPE:
        if raw.nbytes:
            raise ProtocolError("a compact message without an array carries array bytes")
        return []
    if code >= len(DTYPE_NAMES):
        raise ProtocolError(f"unknown compact dtype {code}")
    dtype = BY_NAME[DTYPE_NAMES[code]]
    if raw.nbytes % dtype.itemsize:
        raise ProtocolError(f"{raw.nbytes} array bytes are not a whole number of {DTYPE_NAMES[code]}")
    return [np.frombuffer(raw, dtype=dtype)]


def _sender(sender: int) -> int:
    if sender < 0:
        raise ProtocolError(f"sender {sender} is negative")
    return sender

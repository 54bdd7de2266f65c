"""A server's side of gradient compression: a compressed PUSH or PUSHPULL becomes a plain one.

A push whose body has ``"compression": [type, threshold]`` carries its keys' elements compressed
(``kvstore.core.compression``): one flat array of ``packed_size(type, sum(sizes))`` elements (float32
words for 2bit and 1bit, 2-byte values for fp16 and bf16), ``sizes`` counting original elements.
Everything is checked before it is used; a bad payload is a :class:`ProtocolError` and changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kvstore.core import compression as C
from kvstore.core.partition import Key, check_key
from kvstore.errors import ProtocolError, ShapeMismatchError
from kvstore.net.protocol import Message

WIRE_DTYPE = {"2bit": np.dtype(np.float32), "1bit": np.dtype(np.float32),
              "fp16": np.dtype(np.float16), "bf16": np.dtype(np.float16)}  # bf16: its bits, 2 bytes


def _field(msg: Message) -> tuple[str, float]:
    """The checked ``[type, threshold]`` of a compressed message."""
    field = msg.body["compression"]
    if not (isinstance(field, list) and len(field) == 2 and field[0] in C.TYPES
            and C.finite_threshold(field[1])):
        raise ProtocolError(f"{msg.op.name}: 'compression' must be [type, threshold finite as a float32] "
                            f"with a type of {list(C.TYPES)}; got {repr(field)[:80]}")
    if field[0] == "2bit" and not field[1] > 0:
        raise ProtocolError(f"{msg.op.name}: a 2bit threshold must be > 0 (got {field[1]!r})")
    return field[0], float(field[1])


def expand(msg: Message, held: Callable[[Key], int] | None = None) -> Message:
    """``msg`` as it would be uncompressed (the same message when it is not compressed).

    ``held(key)``: the elements the server holds of a key (raises for an unknown one); each key's
    declared size is checked against it before anything is dequantised (a 1bit word is 32 floats).
    Raises :class:`ProtocolError` for a bad field, keys or sizes, or an array that is not one flat
    array of the compressed length and wire dtype; :class:`ShapeMismatchError` for a size over what
    its key holds; what ``held`` raises."""
    if "compression" not in msg.body:
        return msg
    kind, threshold = _field(msg)
    sizes = msg.body.get("sizes")
    if not (isinstance(sizes, list) and all(type(n) is int and n >= 0 for n in sizes)):
        raise ProtocolError(f"{msg.op.name} needs 'keys' and one size >= 0 per key")
    if held is not None:
        _check_sizes(msg, sizes, held)
    n = sum(sizes)
    want = C.packed_size(kind, n)
    if not (len(msg.arrays) == 1 and msg.arrays[0].ndim == 1 and msg.arrays[0].size == want
            and msg.arrays[0].dtype == WIRE_DTYPE[kind]):
        got = [(str(a.dtype), a.shape) for a in msg.arrays[:2]]
        raise ProtocolError(f"{msg.op.name} compressed with {kind} of {n} elements needs one flat "
                            f"{WIRE_DTYPE[kind]} array of {want} elements; got {got}")
    values = C.decompress(kind, msg.arrays[0], n, threshold)
    return dataclasses.replace(msg, arrays=[np.ascontiguousarray(values, np.float32)])


def _check_sizes(msg: Message, sizes: list[int], held: Callable[[Key], int]) -> None:
    """Refuse a compressed push whose keys are not distinct keys of this server, one size each, each
    at most what the key holds."""
    keys = msg.body.get("keys")
    if not (isinstance(keys, list) and len(keys) == len(sizes)):
        raise ProtocolError(f"{msg.op.name} needs 'keys' and one size >= 0 per key")
    keys = [check_key(key) for key in keys]
    if len(set(keys)) != len(keys):
        raise ProtocolError(f"{msg.op.name} names a key twice")
    for key, n in zip(keys, sizes):
        if n > held(key):
            raise ShapeMismatchError(f"{msg.op.name} compressed declares {n} elements of key {key!r}, "
                                     f"which holds {held(key)} on this server")

"""Where each key lives: pure functions, the same on every worker.

A key is an int in ``[0, 2**64)`` or a str; the two kinds never collide
because the hash input is tagged with the kind.  A value with fewer than
``bound`` elements lives whole on ``home_server(key)``; a larger one is cut
into ``num_servers`` contiguous slices of its flattened elements, slice ``i``
on server ``i`` (MXNet's slice sizes).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass

from kvstore.errors import KeyTypeError

Key = int | str
MAX_INT_KEY = 2**64 - 1
MAX_STR_KEY_BYTES = 64 * 1024  # far below the protocol's header limit


def check_key(key: object) -> Key:
    """Return ``key`` as a plain int or str; raise :class:`KeyTypeError` otherwise."""
    if type(key) is int and 0 <= key <= MAX_INT_KEY:  # the common case, without the ABC check below
        return key
    if isinstance(key, str):
        if key.isascii():
            if len(key) > MAX_STR_KEY_BYTES:
                raise KeyTypeError(f"str key of {len(key)} bytes is longer than the "
                                   f"{MAX_STR_KEY_BYTES}-byte limit")
            return key
        try:
            encoded = len(key.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 for it, so no key on the wire
            raise KeyTypeError(f"str key {key[:40]!r} is not valid text (it holds a lone surrogate, "
                               "which has no UTF-8 encoding)") from None
        if encoded > MAX_STR_KEY_BYTES:
            raise KeyTypeError(f"str key of {encoded} bytes is longer than the {MAX_STR_KEY_BYTES}-byte "
                               "limit")
        return key
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        value = int(key)
        if 0 <= value <= MAX_INT_KEY:
            return value
        raise KeyTypeError(f"int key {value} is outside [0, 2**64)")
    raise KeyTypeError(f"key {key!r} of type {type(key).__name__} is not an int or a str")


def key_bytes(key: Key) -> bytes:
    """Tagged bytes of a key, so that 3 and "3" hash differently."""
    if isinstance(key, str):
        return b"s" + key.encode("utf-8")
    return b"i" + key.to_bytes(8, "little")


def home_server(key: Key, num_servers: int, seed: int) -> int:
    """Return the server that holds ``key`` whole: a seeded blake2b hash modulo ``num_servers``."""
    digest = hashlib.blake2b(key_bytes(key), digest_size=8,
                             key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") % num_servers


def slice_bounds(size: int, num_servers: int) -> list[tuple[int, int]]:
    """Return ``[(start, stop)]`` of each server's slice of ``size`` flattened elements.

    Slice ``i`` has ``round(size/S*(i+1)) - round(size/S*i)`` elements, halves
    rounded up exactly (MXNet rounds a float, which can differ on rare exact
    halves).  Slices are contiguous and cover ``[0, size)``.
    """
    edges = [math.floor(size * i / num_servers + 0.5) for i in range(num_servers + 1)]
    return list(zip(edges[:-1], edges[1:]))


@dataclass(frozen=True)
class Piece:
    """One server's share of a key: elements ``[start, stop)`` of the flattened value."""

    server: int
    start: int
    stop: int


def placement(key: Key, size: int, num_servers: int, seed: int, bound: int) -> list[Piece]:
    """Return the pieces of a ``size``-element value of ``key``: one whole piece, or one per server.

    Empty slices (possible only when ``size < num_servers``) are left out.
    """
    if size >= bound and num_servers > 1:
        return [Piece(server, start, stop)
                for server, (start, stop) in enumerate(slice_bounds(size, num_servers))
                if stop > start]
    return [Piece(home_server(key, num_servers, seed), 0, size)]

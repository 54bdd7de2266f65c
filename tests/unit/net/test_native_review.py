"""Reproducers from the hostile review of kvstore.net._hot (each fails on main at 0ec9161)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import ProtocolError
from kvstore.net import compact
from kvstore.net.auth import Channel, derive_key
from kvstore.net.protocol import PROTOCOL_VERSION, Message, Op

KEY = derive_key("review-secret")
compiled_only = pytest.mark.skipif(compact.HOT is None, reason="kvstore.net._hot is not built here")
CONFIG = (ProtocolError, PROTOCOL_VERSION, compact.MARKER, 255, compact.FIELDS.size, compact.MAX_BYTES,
          int(Op.OK), int(Op.PUSH), int(Op.PULL), int(Op.PUSHPULL), compact.DTYPE_NAMES,
          tuple(np.dtype(compact.BY_NAME[name]).itemsize for name in compact.DTYPE_NAMES))


@compiled_only
@pytest.mark.parametrize("view", ["strided", "reversed"])
def test_an_ok_reply_with_a_non_contiguous_array_seals_as_the_pure_path_does(view: str):
    """compact.seal of an OK reply whose array is a strided view gives pack's bytes, not ValueError."""
    base = np.arange(20, dtype=np.float32)
    array = base[::2] if view == "strided" else base[::-1]
    frames = []
    for compiled in (True, False):
        msg = Message(Op.OK, {}, [array], seq=3, sender=None)
        frames.append(Channel(KEY, "server0", session=b"s", compiled=compiled).seal(msg, "worker-a"))
    assert frames[0] == frames[1]


@compiled_only
def test_a_key_never_initialised_verifies_nothing():
    """A _hot.Key made without __init__ (zero-length MAC) must not call every frame authentic."""
    key = compact.HOT.Key.__new__(compact.HOT.Key)
    try:
        assert key.verify(b"\x00" * 64) is False
    except (ValueError, RuntimeError):
        pass  # refusing to work uninitialised is as good


@compiled_only
def test_a_refused_configure_leaves_the_layout_as_it_was():
    """configure() that raises (a wrong field size) keeps the 49-byte layout: 10 bytes stay too short."""
    bad = list(CONFIG)
    bad[4] = 10
    try:
        with pytest.raises(ValueError):
            compact.HOT.configure(*bad)
        body = bytes([compact.MARKER, PROTOCOL_VERSION]) + bytes(8)
        with pytest.raises(ProtocolError, match="a compact message of 10 bytes"):
            compact.HOT.unpack(body)  # today: reads 39 bytes past the buffer (ASan: heap-buffer-overflow)
    finally:
        compact.HOT.configure(*CONFIG)


@compiled_only
def test_configure_refuses_an_itemsize_that_would_divide_by_zero():
    """configure() with a zero itemsize is a ValueError, not a SIGFPE at the first message with an array."""
    bad = list(CONFIG)
    bad[11] = (0,) * len(compact.DTYPE_NAMES)
    try:
        with pytest.raises(ValueError):
            compact.HOT.configure(*bad)
    finally:
        compact.HOT.configure(*CONFIG)

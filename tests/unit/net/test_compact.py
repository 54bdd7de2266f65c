"""The compact one-frame layout of small data messages (kvstore/net/compact.py) and its sealing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import AuthenticationError, ProtocolError
from kvstore.net import compact
from kvstore.net.auth import MAC_BYTES, Channel, decode, derive_key, refusal_reason
from kvstore.net.protocol import PROTOCOL_VERSION, Message, Op

KEY = derive_key("compact-secret")


def pair(full: bool = False) -> tuple[Channel, Channel]:
    return Channel(KEY, "worker-a", full, b"sess"), Channel(KEY, "server0", full, b"sess")


SHAPES = [
    Message(Op.PUSH, {"keys": [7], "sizes": [3], "rounds": [4]}, [np.arange(3, dtype=np.float32)], seq=5,
            sender=1),
    Message(Op.PULL, {"keys": ["w/0"], "sizes": [2]}, seq=6, sender=0),
    Message(Op.PUSHPULL, {"keys": [2**64 - 1], "sizes": [2], "rounds": [0]}, [np.ones(2, np.float64)], seq=7,
            sender=3),
    Message(Op.OK, seq=8, sender=0),
    Message(Op.OK, {}, [np.arange(4, dtype=np.int64)], seq=9, sender=None),
]


@pytest.mark.parametrize("msg", SHAPES, ids=lambda m: m.op.name)
def test_small_data_messages_and_plain_replies_travel_in_one_frame(msg: Message):
    """Each compact shape is sealed as one frame and opens to the same op, body, arrays, seq, sender."""
    sender, receiver = pair()
    frames = sender.seal(msg, "server0")
    assert len(frames) == 1 and frames[0][MAC_BYTES] == compact.MARKER
    got = receiver.open(frames)
    assert (got.op, got.body, got.seq, got.sender) == (msg.op, msg.body, msg.seq, msg.sender)
    assert [(a.dtype, a.tolist()) for a in got.arrays] == [(a.dtype, a.tolist()) for a in msg.arrays]
    assert got.auth == ["worker-a", 1, "server0"]


@pytest.mark.parametrize("msg", [
    Message(Op.PUSH, {"keys": [1, 2], "sizes": [1, 1]}, [np.ones(2, np.float32)]),
    Message(Op.PUSH, {"keys": [1], "sizes": [4], "lo": 0}, [np.ones(4, np.float32)]),
    Message(Op.PUSH, {"keys": [1], "sizes": [4]}, [np.ones((2, 2), np.float32)]),
    Message(Op.PUSH, {"keys": [1], "sizes": [20000]}, [np.ones(20000, np.float32)]),
    Message(Op.OK, {"round": 3}),
    Message(Op.PULL, {"keys": [1], "sizes": [4]}, shm=[]),
    Message(Op.INIT, {"keys": [1], "sizes": [1]}, [np.ones(1, np.float32)]),
    Message(Op.OK, [1]),  # type: ignore[arg-type]  # not a map: the general layout, refused there
], ids=range(8))
def test_everything_else_keeps_the_general_layout(msg: Message):
    """More keys, a chunk, a 2-D or big array, a body, shared memory or another op: MAC frame and header."""
    sender, receiver = pair()
    frames = sender.seal(msg, "server0")
    assert len(frames) >= 2 and len(frames[0]) == MAC_BYTES
    if type(msg.body) is not dict:
        with pytest.raises(ProtocolError):
            receiver.open(frames)
        return
    assert receiver.open(frames).op is msg.op


def test_full_mode_and_unsigned_clusters_never_send_compact():
    """Full mode and unsigned clusters never send compact frames, and refuse one (mode, no secret)."""
    push = SHAPES[0]
    assert len(pair(full=True)[0].seal(push, "server0")) == 3
    assert Channel(None, "w").seal(push, "server0")[0] == b""
    compact_frames = pair()[0].seal(push, "server0")
    with pytest.raises(AuthenticationError, match="KVSTORE_AUTH=header reached") as caught:
        pair(full=True)[1].open(compact_frames)
    assert refusal_reason(caught.value) == "unauthenticated"
    with pytest.raises(AuthenticationError, match="without KVSTORE_SECRET"):
        Channel(None, "server0").open(compact_frames)


def test_every_damaged_byte_and_truncation_is_refused():
    """Any flipped byte (MAC, fields, strings, array) or truncation is refused, never decoded."""
    sender, receiver = pair()
    frame = bytes(sender.seal(SHAPES[0], "server0")[0])
    for at in range(len(frame)):
        damaged = bytearray(frame)
        damaged[at] ^= 0x40
        with pytest.raises((AuthenticationError, ProtocolError)):
            receiver.open([bytes(damaged)])
    for size in range(len(frame)):
        with pytest.raises((AuthenticationError, ProtocolError)):
            receiver.open([frame[:size]])
    assert receiver.open([frame]).seq == 5  # the genuine frame, after all that


def test_replays_and_other_addressees_are_refused_as_before():
    """The addressee check and replay protection apply to compact frames unchanged."""
    sender, receiver = pair()
    frames = sender.seal(SHAPES[1], "server0")
    receiver.open(frames)
    with pytest.raises(AuthenticationError, match="replayed"):
        receiver.open(frames)
    with pytest.raises(AuthenticationError, match="reached"):
        receiver.open(sender.seal(SHAPES[1], "server1"))


fields = st.tuples(
    st.just(compact.MARKER), st.one_of(st.just(PROTOCOL_VERSION), st.integers(0, 255)),
    st.one_of(st.sampled_from([int(Op.PUSH), int(Op.PULL), int(Op.OK)]), st.integers(0, 255)),
    st.integers(0, 3), st.one_of(st.integers(0, 6), st.just(255), st.integers(0, 255)),
    st.integers(0, 9), st.integers(0, 9), st.one_of(st.integers(0, 9), st.integers(0, 2**16 - 1)),
    st.integers(0, 2**64 - 1), st.integers(-2**63, 2**63 - 1), st.integers(0, 2**64 - 1),
    st.integers(-2**63, 2**63 - 1), st.integers(-2**63, 2**63 - 1))


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(fields, st.binary(max_size=40))
def test_any_authentic_compact_body_decodes_or_raises_protocol_error(values, rest):
    """Under a valid MAC, any fields and bytes decode to a well-typed message or raise ProtocolError only."""
    sender, _ = pair()
    body = compact.FIELDS.pack(*values) + rest
    frames = [sender._mac([body]) + body]
    sender.verify(frames)
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert msg.op in (Op.PUSH, Op.PULL, Op.PUSHPULL, Op.OK) and type(msg.seq) is int
    assert msg.sender is None or msg.sender >= 0
    assert all(a.ndim == 1 for a in msg.arrays) and len(msg.arrays) <= 1
    if msg.op is not Op.OK:
        assert msg.body["sizes"][0] >= 0 and len(msg.body["keys"]) == 1

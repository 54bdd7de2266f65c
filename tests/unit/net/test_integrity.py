"""KVSTORE_AUTH=full on frames alone: the payload tag, IntegrityError, mode mismatches, odd MAC frames,
and the request loop's sealed answer to a damaged message."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvstore.errors import AuthenticationError, ConfigError, IntegrityError, ProtocolError, error_from_code
from kvstore.net import auth, protocol, transport
from kvstore.net.auth import (
    MAC_BYTES,
    REASON_MAC,
    REASON_PAYLOAD,
    TAG_BYTES,
    Channel,
    derive_key,
    refusal_reason,
)
from kvstore.net.protocol import Message, Op
from kvstore.net.router import RouterService

KEY = derive_key("s3cret")


def push(*values: float) -> Message:
    arrays = [np.full(4, v, np.float32) for v in values] or [np.full(4, 1.0, np.float32)]
    return Message(Op.PUSH, {"keys": ["w"], "sizes": [4]}, arrays, seq=7, sender=2)


def pair(sender_full: bool = True, receiver_full: bool = True) -> tuple[Channel, Channel]:
    return Channel(KEY, "worker-a", sender_full, b"sess"), Channel(KEY, "server0", receiver_full, b"sess")


def flipped(frame, at: int = 0) -> bytes:
    raw = bytearray(bytes(frame))
    raw[at] ^= 0x01
    return bytes(raw)


def test_full_mode_appends_a_payload_tag_and_opens():
    """The MAC frame is the header MAC then the 16-byte tag; the same message opens as sent."""
    sender, receiver = pair()
    frames = sender.seal(push(3.0, 4.0), "server0")
    assert len(frames[0]) == MAC_BYTES + TAG_BYTES
    msg = receiver.open(frames)
    np.testing.assert_array_equal(msg.arrays[1], np.full(4, 4.0, np.float32))


def test_the_header_mac_is_the_same_in_both_modes():
    """Full mode's first 16 bytes are exactly header mode's MAC (header, frame count and lengths)."""
    full, header = Channel(KEY, "w", True, b"s"), Channel(KEY, "w", False, b"s")
    frames = full.seal(push(), "server0")
    assert bytes(frames[0][:MAC_BYTES]) == header._mac(frames[1:])


def test_a_damaged_array_byte_is_an_integrity_error_without_side_effects():
    """Any flipped array byte (in any array) fails the tag: IntegrityError, reason REASON_PAYLOAD; the
    genuine message still opens afterwards (verify recorded nothing)."""
    sender, receiver = pair()
    frames = sender.seal(push(1.0, 2.0), "server0")
    for index in (2, 3):
        for at in (0, 7, 15):
            damaged = list(frames)
            damaged[index] = flipped(frames[index], at)
            with pytest.raises(IntegrityError, match="integrity check") as caught:
                receiver.open(damaged)
            assert refusal_reason(caught.value) == REASON_PAYLOAD
            assert isinstance(caught.value, AuthenticationError)
    assert receiver.open(frames).seq == 7


def test_a_damaged_tag_is_an_integrity_error_and_a_damaged_header_is_not():
    """A changed tag byte fails the tag; a changed header byte fails the header MAC (REASON_MAC)."""
    sender, receiver = pair()
    frames = sender.seal(push(), "server0")
    with pytest.raises(IntegrityError):
        receiver.verify([flipped(frames[0], MAC_BYTES + 3), *frames[1:]])
    with pytest.raises(AuthenticationError) as caught:
        receiver.verify([frames[0], flipped(frames[1], 5), *frames[2:]])
    assert not isinstance(caught.value, IntegrityError) and refusal_reason(caught.value) == REASON_MAC


def test_each_message_gets_its_own_one_time_key():
    """The same payload sealed twice gets two different tags (its header, so its key, differ)."""
    sender, _ = pair()
    first, second = (sender.seal(push(5.0), "server0") for _ in range(2))
    assert bytes(first[0][MAC_BYTES:]) != bytes(second[0][MAC_BYTES:])


def test_a_message_without_arrays_is_tagged_too():
    """A PULL (no arrays) carries a tag over nothing, and opens."""
    sender, receiver = pair()
    frames = sender.seal(Message(Op.PULL, {"keys": ["w"]}, seq=3), "server0")
    assert len(frames) == 2 and len(frames[0]) == MAC_BYTES + TAG_BYTES
    assert receiver.open(frames).seq == 3


@pytest.mark.parametrize(("sender_full", "theirs"), [(True, "full"), (False, "header")])
def test_a_mode_mismatch_is_refused_with_a_clear_message(sender_full: bool, theirs: str):
    """Header-mode frames at a full-mode node, and the other way round: AuthenticationError naming
    both modes and the fix, never an IntegrityError or a crash."""
    sender, receiver = pair(sender_full, not sender_full)
    frames = sender.seal(push(), "server0")
    with pytest.raises(AuthenticationError, match=f"KVSTORE_AUTH={theirs} reached") as caught:
        receiver.open(frames)
    assert not isinstance(caught.value, IntegrityError) and "same KVSTORE_AUTH" in str(caught.value)
    assert refusal_reason(caught.value) == REASON_MAC


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("size", [0, 1, 15, 17, 31, 33, 64, 4096])
def test_odd_mac_frames_are_refused_not_crashed(full: bool, size: int):
    """A MAC frame of any other length, or a truncation of a genuine one, is an AuthenticationError
    (a push of two keys: the general layout, whose MAC has a frame of its own)."""
    sender, receiver = pair(full, full)
    frames = sender.seal(Message(Op.PUSH, {"keys": ["w", "v"], "sizes": [2, 2]}, [np.ones(4, np.float32)],
                                 seq=7, sender=2), "server0")
    genuine = bytes(frames[0])
    for mac in (genuine[:size], (genuine * 200)[:size]):
        if mac == genuine:
            continue
        with pytest.raises(AuthenticationError):
            receiver.verify([mac, *frames[1:]])


def test_frames_that_are_not_buffers_raise_ordinary_refusals():
    """A MAC frame or array that is not bytes-like raises an exception the router counts; a missing
    header is a ProtocolError."""
    sender, receiver = pair()
    frames = sender.seal(push(), "server0")
    with pytest.raises(ProtocolError):
        receiver.verify([frames[0]])
    with pytest.raises(TypeError):
        receiver.verify([frames[0], frames[1], 12345])
    with pytest.raises(TypeError):
        receiver.verify([None, *frames[1:]])


def test_full_mode_without_cryptography_says_what_to_install(monkeypatch):
    """KVSTORE_AUTH=full needs `cryptography`; without it a channel is a ConfigError naming it."""
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.poly1305", None)
    auth._poly1305.cache_clear()
    try:
        with pytest.raises(ConfigError, match="cryptography"):
            Channel(KEY, "worker-a", full=True)
        Channel(KEY, "worker-a", full=False)  # header mode never needs it
    finally:
        auth._poly1305.cache_clear()


def test_integrity_error_crosses_the_wire_as_itself():
    """error_from_code rebuilds an IntegrityError from its wire code."""
    exc = error_from_code("IntegrityError", "push of key 'w' refused")
    assert type(exc) is IntegrityError and str(exc) == "push of key 'w' refused"


class Sent:
    def __init__(self) -> None:
        self.messages: list[tuple[bytes, list]] = []

    def __call__(self, sock, frames, identity=b"") -> bool:
        self.messages.append((identity, list(frames)))
        return True


def test_the_router_answers_a_damaged_push_sealed_and_applies_nothing(monkeypatch):
    """A push with a damaged array: its handler never runs, the sender gets a sealed IntegrityError
    with its seq naming the op and key, DropLog counts it; the same frames again are a replay."""
    sent = Sent()
    monkeypatch.setattr(transport, "send", sent)
    applied = []
    svc = RouterService(None, Channel(KEY, "server0", True, b"sess"), rank=0)
    svc.handlers = {Op.PUSH: lambda ident, msg: applied.append(msg)}
    sender, _ = pair()
    msg = push(1.0)
    msg.seq = 41
    frames = sender.seal(msg, "server0")
    damaged = [frames[0], frames[1], flipped(frames[2], 2)]
    svc.handle([b"id", *damaged])
    assert applied == []
    (identity, reply_frames), = sent.messages
    reply = sender.open(reply_frames)  # sealed for worker-a
    assert (identity, reply.op, reply.seq, reply.body["code"]) == (b"id", Op.ERROR, 41, "IntegrityError")
    assert reply.body["message"] == ("push of key 'w' refused: its array bytes failed the integrity "
                                     "check (KVSTORE_AUTH=full); nothing was applied")
    assert svc.drops.totals == {REASON_PAYLOAD: 1}
    svc.handle([b"id", *damaged])  # replayed: refused as a replay, unsigned
    assert sent.messages[1][1][0] == b"" and svc.drops.totals["replayed"] == 1
    assert "replayed" in protocol.decode(sent.messages[1][1][1:]).body["message"]
    assert applied == []

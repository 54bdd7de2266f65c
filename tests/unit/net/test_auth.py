"""kvstore.auth: sealing and opening messages, on frames alone (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import AuthenticationError, ProtocolError
from kvstore.net import protocol
from kvstore.net.auth import (
    MAC_BYTES,
    REASON_ADDRESSEE,
    REASON_FRAMES,
    REASON_MAC,
    REASON_MALFORMED,
    REASON_REPLAY,
    REASON_UNDECODABLE,
    Channel,
    derive_key,
    new_label,
    refusal_reason,
    unsigned,
)
from kvstore.net.protocol import Message, Op

KEY = derive_key("s3cret")


def push(n: float = 1.0) -> Message:
    return Message(Op.PUSH, {"key": "w"}, [np.full(4, n, np.float32)], seq=7, sender=2)


def pair(full: bool = False, session: bytes = b"sess") -> tuple[Channel, Channel]:
    """A sender and a receiver named 'server0' sharing the key and session."""
    return Channel(KEY, "worker-a", full, session), Channel(KEY, "server0", full, session)


def test_sealed_message_opens_with_its_content():
    """A sealed message opens to the same op, body, arrays, seq and sender, with [label, n, to]."""
    sender, receiver = pair()
    frames = sender.seal(push(3.0), "server0")
    assert len(frames[0]) == MAC_BYTES
    msg = receiver.open(frames)
    assert (msg.op, msg.body, msg.seq, msg.sender, msg.auth) == (Op.PUSH, {"key": "w"}, 7, 2,
                                                                 ["worker-a", 1, "server0"])
    np.testing.assert_array_equal(msg.arrays[0], np.full(4, 3.0, np.float32))


def test_every_header_byte_and_frame_length_is_covered():
    """Flipping any header byte, or changing an array frame's length, fails authentication."""
    sender, receiver = pair()
    frames = sender.seal(push(), "server0")
    header = bytes(frames[1])
    for i in range(len(header)):
        bad = bytearray(header)
        bad[i] ^= 0x01
        with pytest.raises(AuthenticationError):
            receiver.open([frames[0], bytes(bad), frames[2]])
    with pytest.raises(AuthenticationError):
        receiver.open([frames[0], frames[1], bytes(frames[2]) + b"\0\0\0\0"])
    with pytest.raises(AuthenticationError):
        receiver.open([frames[0], frames[1]])  # a dropped frame
    assert receiver.open(frames).seq == 7  # the genuine one still opens: failures changed nothing


def test_payload_bytes_are_covered_only_in_full_mode():
    """By default array bytes rely on TCP; with full=True a changed byte fails authentication."""
    for full in (False, True):
        sender, receiver = pair(full)
        frames = sender.seal(push(1.0), "server0")
        forged = [frames[0], frames[1], np.full(4, 9.0, np.float32).tobytes()]
        if full:
            with pytest.raises(AuthenticationError):
                receiver.open(forged)
        else:
            np.testing.assert_array_equal(receiver.open(forged).arrays[0], np.full(4, 9.0, np.float32))


def test_replays_and_old_numbers_are_refused():
    """A message opened once is refused again, and so is any older number from that label."""
    sender, receiver = pair()
    first, second = sender.seal(push(), "server0"), sender.seal(push(), "server0")
    receiver.open(second)
    for frames in (second, first):
        with pytest.raises(AuthenticationError, match="replayed"):
            receiver.open(frames)
    receiver.open(sender.seal(push(), "server0"))  # a newer one still opens


def test_a_message_for_another_receiver_is_refused():
    """A message sealed for server1 does not open at server0 (no cross-server replay)."""
    sender, receiver = pair()
    with pytest.raises(AuthenticationError, match="server1"):
        receiver.open(sender.seal(push(), "server1"))


@pytest.mark.parametrize("other", [
    Channel(derive_key("wrong"), "x", session=b"sess"),
    Channel(KEY, "x", session=b"another cluster"),
    Channel(KEY, "x"),  # no session yet
])
def test_other_secrets_and_sessions_are_refused(other):
    """A message sealed with another secret, another cluster's session or none does not open."""
    _, receiver = pair()
    with pytest.raises(AuthenticationError):
        receiver.open(other.seal(push(), "server0"))


def test_signed_and_unsigned_nodes_refuse_each_other():
    """A node with a secret refuses unsigned messages, and a node without one refuses signed ones."""
    plain_sender, plain_receiver = Channel(None, "a"), Channel(None, "server0")
    keyed_sender, keyed_receiver = pair()
    assert plain_sender.seal(push(), "server0")[0] == b""
    with pytest.raises(AuthenticationError):
        keyed_receiver.open(plain_sender.seal(push(), "server0"))
    with pytest.raises(AuthenticationError, match="without KVSTORE_SECRET"):
        plain_receiver.open(keyed_sender.seal(push(), "server0"))
    assert plain_receiver.open(plain_sender.seal(push(), "server0")).op is Op.PUSH


@pytest.mark.parametrize("auth", [None, ["a", 1], ["a", 0, "server0"], ["a", True, "server0"], [1, 1, "s"]])
def test_bad_auth_fields_are_protocol_errors(auth):
    """Without a secret a header's auth field must still be [label, n > 0, to]."""
    receiver = Channel(None, "server0")
    with pytest.raises(ProtocolError, match="auth field"):
        receiver.open([b"", *protocol.encode(Message(Op.PULL, {"key": 1}, auth=auth))])


def test_unsigned_frames_and_short_messages():
    """unsigned() makes an empty-MAC message; open refuses fewer than two frames."""
    frames = unsigned(protocol.error_reply(0, "AuthenticationError", "no"))
    assert frames[0] == b"" and protocol.decode(frames[1:]).body["code"] == "AuthenticationError"
    with pytest.raises(ProtocolError):
        Channel(None, "x").open([b""])


def test_keys_labels_and_rename():
    """Keys depend on the secret (none without one); labels are fresh; rename readdresses a channel."""
    assert derive_key(None) is None and derive_key("") is None
    assert derive_key("a") != derive_key("b") and len(derive_key("a")) == 32
    assert new_label("worker") != new_label("worker") and new_label("worker").startswith("worker-")
    sender, receiver = pair()
    receiver.rename("server3")
    assert receiver.open(sender.seal(push(), "server3")).auth[2] == "server3"
    with pytest.raises(AuthenticationError):
        receiver.open(sender.seal(push(), "server0"))


def test_verify_then_admit_is_open_in_steps_with_reasons():
    """verify checks the MAC alone, admit the addressee and number; each refusal names its reason."""
    sender, receiver = pair()
    frames = sender.seal(push(), "server0")
    receiver.verify(frames)  # no side effect: the message still opens after
    assert receiver.admit(protocol.decode(frames[1:]).auth) == "worker-a"
    with pytest.raises(AuthenticationError) as replayed:
        receiver.admit(protocol.decode(frames[1:]).auth)
    assert refusal_reason(replayed.value) == REASON_REPLAY
    with pytest.raises(AuthenticationError) as misaddressed:
        receiver.admit(["worker-a", 99, "server1"])
    assert refusal_reason(misaddressed.value) == REASON_ADDRESSEE
    with pytest.raises(ProtocolError) as malformed:
        receiver.admit(["worker-a", 0, "server0"])
    assert refusal_reason(malformed.value) == REASON_MALFORMED
    with pytest.raises(AuthenticationError) as forged:
        receiver.verify([bytes(MAC_BYTES), *frames[1:]])
    assert refusal_reason(forged.value) == REASON_MAC
    with pytest.raises(ProtocolError) as short:
        receiver.verify([frames[0]])
    assert refusal_reason(short.value) == REASON_FRAMES
    assert refusal_reason(ValueError("anything else")) == REASON_UNDECODABLE


def test_a_bad_header_under_a_valid_mac_passes_verify_and_fails_decode():
    """The MAC covers the header bytes as they are: verify accepts garbage a key-holder sealed, and only
    decoding then refuses it (the router answers that one sealed, not as a stranger)."""
    sender, receiver = pair()
    garbage = [b"\xc1 not msgpack"]
    frames = [sender._mac(garbage), *garbage]
    receiver.verify(frames)
    with pytest.raises(ProtocolError):
        receiver.open(frames)


def test_an_oversize_header_is_refused_before_its_mac_is_computed():
    """A header frame over MAX_HEADER_BYTES cannot be ours: refused as undecodable, not hashed."""
    _, receiver = pair()
    with pytest.raises(ProtocolError, match="exceeds") as big:
        receiver.verify([bytes(MAC_BYTES), bytes(protocol.MAX_HEADER_BYTES + 1)])
    assert refusal_reason(big.value) == REASON_UNDECODABLE

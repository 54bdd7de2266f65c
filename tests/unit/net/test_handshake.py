"""kvstore.net.handshake: reading the scheduler's unsigned refusal during registration (no sockets)."""

from __future__ import annotations

from kvstore.errors import AuthenticationError, ConfigError
from kvstore.net import protocol
from kvstore.net.auth import Channel, derive_key, unsigned
from kvstore.net.handshake import _unsigned_error
from kvstore.net.protocol import Message, Op


def test_an_unsigned_error_reply_is_raised_as_its_type():
    """An unsigned ERROR names the scheduler's refusal, typed by its code."""
    frames = unsigned(protocol.error_reply(0, "AuthenticationError", "wrong secret"))
    error = _unsigned_error(frames)
    assert isinstance(error, AuthenticationError)
    assert "the scheduler refused this node: wrong secret" in str(error)
    assert isinstance(_unsigned_error(unsigned(protocol.error_reply(0, "ConfigError", "x"))), ConfigError)


def test_anything_but_an_unsigned_error_is_not_a_refusal():
    """A sealed message, an unsigned non-ERROR, garbage or a lone frame give None."""
    sealed = Channel(derive_key("s"), "scheduler").seal(
        protocol.error_reply(0, "AuthenticationError", "x"), "worker-a")
    assert _unsigned_error(sealed) is None
    assert _unsigned_error(unsigned(Message(Op.OK, {}))) is None
    assert _unsigned_error([b"", b"\xc1garbage"]) is None
    assert _unsigned_error([b""]) is None

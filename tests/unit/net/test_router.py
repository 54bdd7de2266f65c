"""kvstore.net.router without sockets: which refused messages are answered (once, unsigned; or sealed),
what is counted, and that nothing a peer sends escapes the request loop."""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import numpy as np
import pytest

from kvstore.net import protocol, transport
from kvstore.net.auth import Channel, decode, derive_key
from kvstore.net.protocol import PROTOCOL_VERSION, Message, Op
from kvstore.net.router import (
    NO_PAYLOAD,
    PEER_GONE,
    QUEUE_FULL,
    TOO_MANY_FRAMES,
    WITHHELD_FULL,
    WITHHELD_REPEAT,
    DropLog,
    RefusalGate,
    RouterService,
)

KEY = derive_key("s3cret")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_gate_answers_each_identity_once_until_it_authenticates():
    """The first refusal of an identity may be answered, later ones not; forget() re-arms it."""
    gate = RefusalGate(capacity=4)
    assert gate.may_answer(b"a") is None
    assert gate.may_answer(b"a") == WITHHELD_REPEAT
    assert gate.may_answer(b"b") is None
    gate.forget(b"a")
    assert gate.may_answer(b"a") is None and len(gate) == 2


def test_gate_is_bounded_and_frees_only_idle_identities():
    """A full table of recently heard identities answers nobody new; one silent for `idle` makes room."""
    clock = Clock()
    gate = RefusalGate(capacity=2, idle=60.0, clock=clock)
    assert gate.may_answer(b"a") is None and gate.may_answer(b"b") is None
    assert gate.may_answer(b"c") == WITHHELD_FULL
    clock.now += 30
    assert gate.may_answer(b"a") == WITHHELD_REPEAT  # heard again: b is now the least recent
    clock.now += 31
    assert gate.may_answer(b"c") is None  # b (silent 61 s) made room
    assert len(gate) == 2
    assert gate.may_answer(b"a") == WITHHELD_REPEAT  # a (heard 31 s ago) was kept


def test_drop_log_counts_everything_and_logs_at_most_once_per_interval(caplog):
    """Every event is counted; a line goes out for the first event and then at most once a second."""
    clock = Clock()
    drops = DropLog(logging.getLogger("test.drops"), every=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.drops"):
        drops.count("unauthenticated", "bad mac")
        assert drops.flush() == 1
        for _ in range(500):
            drops.count("unauthenticated")
            drops.count(WITHHELD_REPEAT)
            assert drops.flush() == 0
        clock.now += 1.0
        assert drops.flush() == 1000
        assert drops.flush() == 0
    assert len(caplog.records) == 2
    assert "unauthenticated=500" in caplog.records[1].getMessage()
    assert "in all: reply-withheld=500 unauthenticated=501" in caplog.records[1].getMessage()
    assert "last: bad mac" in caplog.records[1].getMessage()


class Sent:
    """Stands in for transport.send: records each message and can report a full queue."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, list[bytes]]] = []
        self.full = False

    def __call__(self, sock: Any, frames: list[Any], identity: bytes | None = None) -> bool:
        if self.full:
            return False
        self.messages.append((identity, [bytes(f) for f in frames]))
        return True


@pytest.fixture
def sent(monkeypatch) -> Sent:
    fake = Sent()
    monkeypatch.setattr(transport, "send", fake)
    return fake


def service(handlers: dict | None = None) -> RouterService:
    svc = RouterService(None, Channel(KEY, "server0"), rank=0)
    svc.handlers = handlers or {Op.PULL: lambda ident, msg: svc.reply(ident, Message(Op.OK, seq=msg.seq))}
    return svc


def sealed_raw(channel: Channel, header: dict, arrays: list[bytes] = ()) -> list[bytes]:
    """Frames with a valid MAC over a hand-made header (what only a holder of the key can make)."""
    frames = [msgpack.packb(header, use_bin_type=True), *arrays]
    return [channel._mac(frames), *frames]


def test_junk_from_one_identity_gets_one_unsigned_error_and_is_counted(sent):
    """Five forged messages on one connection: one unsigned ERROR, five refusals, four withheld."""
    svc = service()
    forged = Channel(derive_key("guess"), "x").seal(Message(Op.PULL, {}), "server0")
    for _ in range(5):
        svc.handle([b"id1", *forged])
    assert len(sent.messages) == 1
    identity, frames = sent.messages[0]
    reply = protocol.decode(frames[1:])
    assert identity == b"id1" and frames[0] == b"" and reply.body["code"] == "AuthenticationError"
    assert svc.drops.totals == {"unauthenticated": 5, WITHHELD_REPEAT: 4}
    svc.handle([b"id2", *forged])  # another connection gets its own answer
    assert len(sent.messages) == 2


def test_an_identity_that_authenticates_is_answered_again(sent):
    """forged, genuine, then a replay on one connection: the replay gets its own unsigned ERROR."""
    svc, sender = service(), Channel(KEY, "worker-a")
    svc.handle([b"id", *Channel(derive_key("guess"), "x").seal(Message(Op.PULL, {}), "server0")])
    genuine = sender.seal(Message(Op.PULL, {}, seq=3), "server0")
    svc.handle([b"id", *genuine])
    svc.handle([b"id", *genuine])
    kinds = [(frames[0] == b"", decode(frames).op) for _, frames in sent.messages]  # the OK: compact
    assert kinds == [(True, Op.ERROR), (False, Op.OK), (True, Op.ERROR)]
    assert "replayed" in protocol.decode(sent.messages[2][1][1:]).body["message"]
    assert svc.drops.totals["replayed"] == 1


def test_misaddressed_and_short_messages_are_strangers(sent):
    """A message sealed for another node, or without a header, is refused as unauthenticated."""
    svc, sender = service(), Channel(KEY, "worker-a")
    svc.handle([b"a", *sender.seal(Message(Op.PULL, {}), "server1")])
    svc.handle([b"b", b""])
    svc.handle([b"c"])
    assert [frames[0] for _, frames in sent.messages] == [b"", b""]
    assert svc.drops.totals == {"misaddressed": 1, "no-header": 1, NO_PAYLOAD: 1}


def test_an_authenticated_malformed_message_gets_a_sealed_error_with_its_seq(sent):
    """A valid MAC over a header with a bad array description: ERROR sealed for the sender, seq echoed."""
    svc, sender = service(), Channel(KEY, "worker-a")
    header = {"v": PROTOCOL_VERSION, "op": int(Op.PULL), "seq": 41, "sender": 0,
              "auth": ["worker-a", 1, "server0"], "body": {}, "arrays": [["float32", [3]]]}
    svc.handle([b"id", *sealed_raw(sender, header, [b"\0" * 5])])
    (identity, frames), = sent.messages
    reply = sender.open(frames)  # sealed, for worker-a: opens on its channel
    assert (reply.op, reply.seq, reply.body["code"]) == (Op.ERROR, 41, "ProtocolError")
    assert svc.drops.totals == {"malformed": 1}
    svc.handle([b"id", *sealed_raw(sender, header, [b"\0" * 5])])  # the same frames again: a replay
    assert sent.messages[1][1][0] == b"" and svc.drops.totals["replayed"] == 1


def test_undecodable_garbage_under_a_valid_mac_is_answered_sealed_without_seq(sent):
    """A key-holder's header that is not msgpack at all: sealed ERROR, seq 0."""
    svc, sender = service(), Channel(KEY, "worker-a")
    garbage = [b"\xc1 not msgpack"]
    svc.handle([b"id", sender._mac(garbage), *garbage])
    (_, frames), = sent.messages
    assert frames[0] != b"" and protocol.decode(frames[1:]).seq == 0


def test_nothing_a_decoder_or_verifier_raises_escapes(sent, monkeypatch):
    """A RuntimeError from decode (a bug) and frames that are not bytes-like are refused, not raised."""
    svc, sender = service(), Channel(KEY, "worker-a")

    def broken(frames):
        raise RuntimeError("decoder bug")

    monkeypatch.setattr(protocol, "decode", broken)
    svc.handle([b"a", *sender.seal(Message(Op.PULL, {}, seq=5), "server0")])
    (_, frames), = sent.messages
    assert frames[0] != b""  # the MAC held: answered sealed, RemoteError
    monkeypatch.undo()
    monkeypatch.setattr(transport, "send", sent)
    svc.handle([b"b", 12345, object()])
    assert sent.messages[1][1][0] == b"" and svc.drops.totals["undecodable"] == 1


def test_full_queues_and_gone_peers_drop_the_reply_and_count_it(sent, monkeypatch):
    """A reply that finds its peer's queue full, or its peer gone, is counted, not raised."""
    svc, sender = service(), Channel(KEY, "worker-a")
    sent.full = True
    svc.handle([b"id", *sender.seal(Message(Op.PULL, {}, seq=1), "server0")])
    assert svc.drops.totals == {QUEUE_FULL: 1}

    def gone(sock, frames, identity=None):
        from kvstore.errors import NodeLostError
        raise NodeLostError("peer is not connected")

    monkeypatch.setattr(transport, "send", gone)
    svc.handle([b"id", *sender.seal(Message(Op.PULL, {}, seq=2), "server0")])
    assert svc.drops.totals[PEER_GONE] == 1


def test_too_many_frames_are_counted_unanswered(sent, monkeypatch):
    """drain() counts a message transport refused for its frame count and goes on to the next one."""
    svc = service()
    waiting = [protocol.ProtocolError("a message of more than 1024 frames was refused"), None]

    def recv_nowait(sock):
        item = waiting.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    monkeypatch.setattr(transport, "recv_nowait", recv_nowait)
    assert svc.drain() == 1
    assert svc.drops.totals == {TOO_MANY_FRAMES: 1} and sent.messages == []


def test_sealed_replies_still_carry_arrays(sent):
    """The normal path is unchanged: a handler's reply is sealed for the requester's label."""
    svc, sender = service(), Channel(KEY, "worker-a")
    svc.handlers = {Op.PULL: lambda ident, msg: svc.reply(
        ident, Message(Op.OK, arrays=[np.arange(3.0)], seq=msg.seq))}
    svc.handle([b"id", *sender.seal(Message(Op.PULL, {}, seq=8), "server0")])
    reply = sender.open(sent.messages[0][1])
    assert reply.seq == 8 and reply.arrays[0].tolist() == [0.0, 1.0, 2.0]

"""The zmq layer on loopback: port 0 binding, round trips, and ZMQError mapped to our errors."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import zmq

from kvstore.errors import ConfigError, DeadlineExceededError, NodeLostError, ProtocolError
from kvstore.net import protocol, transport
from kvstore.net.protocol import Message, Op


@pytest.fixture
def router():
    """A ROUTER bound to a free loopback port."""
    sock, port = transport.bind_router("127.0.0.1")
    yield sock, port
    transport.close(sock)


def test_bind_port_zero_reports_real_port(router) -> None:
    """Binding port 0 returns the port the OS chose, and a second bind to it fails with ConfigError."""
    _, port = router
    assert 0 < port < 65536
    with pytest.raises(ConfigError, match=f"cannot bind tcp://127.0.0.1:{port}"):
        transport.bind_router("127.0.0.1", port)


def test_round_trip_with_big_zero_copy_frame(router) -> None:
    """A message with a frame above the copy threshold arrives intact, identity first at the ROUTER."""
    sock, port = router
    dealer = transport.connect_dealer(transport.address("127.0.0.1", port), identity=b"w7")
    try:
        big = np.arange(transport.COPY_THRESHOLD, dtype=np.float32)  # 4x the threshold in bytes
        transport.send(dealer, protocol.encode(Message(Op.PUSH, {"key": "k"}, [big], seq=5, sender=7)))
        frames = transport.recv_within(sock, 10, "the push")
        assert bytes(frames[0]) == b"w7"
        msg = protocol.decode(frames[1:])
        assert msg.seq == 5 and msg.sender == 7
        np.testing.assert_array_equal(msg.arrays[0], big)
        transport.send(sock, protocol.encode(Message(Op.OK, seq=5)), identity=b"w7")
        reply = protocol.decode(transport.recv_within(dealer, 10, "the reply"))
        assert reply.op is Op.OK and reply.seq == 5
    finally:
        transport.close(dealer)


def test_send_to_unknown_peer_raises_node_lost(router) -> None:
    """A ROUTER reply to a peer that is not connected raises NodeLostError, not a ZMQError."""
    sock, _ = router
    with pytest.raises(NodeLostError, match="not connected"):
        transport.send(sock, protocol.encode(Message(Op.OK)), identity=b"nobody")


def test_recv_within_deadline(router) -> None:
    """Waiting past the deadline raises DeadlineExceededError naming what was awaited."""
    sock, _ = router
    with pytest.raises(DeadlineExceededError, match="no reply from nowhere after 0.05 s"):
        transport.recv_within(sock, 0.05, "reply from nowhere")


def test_poller_sees_ready_socket(router) -> None:
    """The poller returns exactly the sockets with a waiting message."""
    sock, port = router
    dealer = transport.connect_dealer(transport.address("127.0.0.1", port))
    try:
        poller = transport.Poller()
        poller.add(sock)
        assert poller.wait(0) == []
        transport.send(dealer, [b"x"])
        assert poller.wait(10) == [sock]
    finally:
        transport.close(dealer)


def test_a_message_of_too_many_frames_is_refused_and_the_next_one_arrives() -> None:
    """recv reads an oversized multipart message to its end, refuses it, and the socket stays usable."""
    sock, port = transport.bind_router("127.0.0.1")
    dealer = transport.connect_dealer(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"x"] * (transport.MAX_FRAMES + 5))
        _refused_then_the_next_arrives(sock, dealer, "frames was refused")
    finally:
        transport.close(dealer)
        transport.close(sock)


def test_max_frame_bytes_disconnects_a_peer_that_declares_a_bigger_frame() -> None:
    """With max_frame_bytes, a frame up to the cap arrives; a bigger one never does (zmq drops the
    connection as the frame's length arrives), and the peer's reconnection is served again."""
    sock, port = transport.bind_router("127.0.0.1", max_frame_bytes=4096)
    dealer = transport.connect_dealer(transport.address("127.0.0.1", port))
    try:
        transport.send(dealer, [b"x" * 4096])
        assert bytes(transport.recv_within(sock, 10, "the frame at the cap")[1]) == b"x" * 4096
        transport.send(dealer, [b"y" * 4097])
        assert not sock.poll(500), "a frame over the cap was delivered"
        transport.send(dealer, [b"after"])  # zmq reconnects the DEALER; this one goes out on the new link
        assert bytes(transport.recv_within(sock, 10, "the message after")[1]) == b"after"
    finally:
        transport.close(dealer)
        transport.close(sock)


def test_a_router_send_to_a_peer_that_never_reads_returns_false_instead_of_blocking() -> None:
    """Once a peer's queue holds its bound of messages (and TCP's buffers are full) send returns
    False at once and sends nothing; the peer that reads again gets whole messages."""
    bound = 1024  # ROUTER_SNDHWM's mechanism, at a size this test can fill in memory
    sock, port = transport.bind_router("127.0.0.1", outbound=bound)
    dealer = transport.connect_dealer(transport.address("127.0.0.1", port))
    dealer.setsockopt(zmq.RCVHWM, 1)  # this peer's zmq stops reading TCP at once
    try:
        transport.send(dealer, [b"hello"])
        identity = bytes(transport.recv_within(sock, 10, "hello")[0])
        payload = bytes(transport.COPY_THRESHOLD)
        sent, started = 0, time.monotonic()
        while transport.send(sock, [b"%d" % sent, payload], identity=identity):
            sent += 1
            assert sent < 20 * bound, "the peer's queue never filled"
        assert sent >= bound and time.monotonic() - started < 10
        first = dealer.recv_multipart()
        assert first[0] == b"0" and len(first[1]) == len(payload)
    finally:
        transport.close(dealer)
        transport.close(sock)


def test_a_message_of_many_frames_is_counted_exactly_and_read_by_libzmq() -> None:
    """200,000 empty frames are read to their end by libzmq's own calls (no Python object a frame),
    counted exactly in the refusal, and the socket stays usable."""
    assert transport._DISCARDER is not None  # pyzmq's libzmq was found in this process
    sock, port = transport.bind_router("127.0.0.1")
    dealer = transport.connect_dealer(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b""] * 200_000)
        _refused_then_the_next_arrives(sock, dealer, r"\(200001 frames read and dropped\)")
    finally:
        transport.close(dealer)
        transport.close(sock)


def _refused_then_the_next_arrives(sock: Any, dealer: Any, refusal: str) -> None:
    """After the message waiting on ``sock``: recv refuses it (ProtocolError matching ``refusal``), and a
    next message from ``dealer`` arrives whole."""
    dealer.send_multipart([b"after", b"ok"])
    assert sock.poll(5000)
    with pytest.raises(ProtocolError, match=refusal):
        transport.recv(sock)
    assert sock.poll(5000)
    assert [bytes(f) for f in transport.recv(sock)][1:] == [b"after", b"ok"]

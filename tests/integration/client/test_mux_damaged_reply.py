"""A reply whose array bytes are damaged in transit (KVSTORE_AUTH=full) fails its request at once with
IntegrityError, instead of being dropped and leaving the call to its deadline."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.client.mux import Mux
from kvstore.errors import IntegrityError
from kvstore.net import transport
from kvstore.net.auth import Channel, derive_key
from kvstore.net.protocol import Message, Op

pytest.importorskip("cryptography")
KEY = derive_key("damaged-reply-secret")
SESSION = b"damaged-reply-session"
pytestmark = pytest.mark.timeout(30)


def test_a_damaged_reply_fails_its_request_at_once():
    server, port = transport.bind_router("127.0.0.1")
    unused, unused_port = transport.bind_router("127.0.0.1")
    wire = Mux(transport.connect_dealer(transport.address("127.0.0.1", unused_port)),
                [transport.connect_dealer(transport.address("127.0.0.1", port))], 0,
                Channel(KEY, "worker-test", full=True, session=SESSION))
    channel = Channel(KEY, "server0", full=True, session=SESSION)
    try:
        request = wire.submit(0, Message(Op.PULL, {"keys": ["w"], "sizes": [4]}), "pull of key 'w'")
        assert server.poll(10_000)
        identity, *frames = server.recv_multipart()
        pull = channel.open(frames)
        reply = channel.seal(Message(Op.OK, seq=pull.seq, arrays=[np.ones(4, np.float32)]), pull.auth[0])
        damaged = bytearray(bytes(reply[-1]))
        damaged[0] ^= 0x01
        server.send_multipart([identity, *reply[:-1], bytes(damaged)])
        started = time.monotonic()
        with pytest.raises(IntegrityError, match="pull of key 'w'.*integrity check"):
            wire.wait(request, 20)
        assert time.monotonic() - started < 5
    finally:
        wire.stop(5)
        transport.close(server)
        transport.close(unused)

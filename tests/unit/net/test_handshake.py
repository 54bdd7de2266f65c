"""kvstore.net.handshake: reading the scheduler's unsigned refusal during registration (no sockets)."""

from __future__ import annotations

from kvstore.errors import AuthenticationError, ConfigError, ProtocolError
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


def test_a_restarted_scheduler_still_rebuilding_is_asked_again_until_it_maps() -> None:
    """A registration a restarted scheduler refuses with SchedulerRebuildingError (it takes its old
    nodes back first) is made again, with a fresh HELLO, until the MAP comes; other errors still raise."""
    import threading

    import zmq

    from kvstore import config as kvconfig
    from kvstore.errors import SchedulerRebuildingError
    from kvstore.net.auth import channel_for
    from kvstore.net.handshake import register

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = kvconfig.load({"DMLC_ROLE": "worker", "KVSTORE_SECRET": "unit", "DMLC_PS_ROOT_URI": "127.0.0.1",
                         "DMLC_PS_ROOT_PORT": str(port), "KVSTORE_CONNECT_TIMEOUT": "20"})
    scheduler = channel_for(cfg, "scheduler")
    hellos: list[str] = []

    def serve() -> None:  # two refused registrations, then a map
        for attempt in range(3):
            for expected in (Op.HELLO, Op.REGISTER):
                identity, *frames = router.recv_multipart()
                msg = scheduler.open(frames)
                assert msg.op is expected
                if expected is Op.HELLO:
                    nonce = msg.body["nonce"]
                    hellos.append(nonce)
                    reply = Message(Op.CHALLENGE, {"nonce": nonce, "challenge": "c"}, seq=msg.seq)
                elif attempt < 2:
                    reply = protocol.error_reply(msg.seq, "SchedulerRebuildingError", "still rebuilding")
                else:
                    reply = Message(Op.MAP, {"nonce": nonce, "session": b"s" * 32}, seq=msg.seq)
                router.send_multipart([identity, *scheduler.seal(reply, "worker-x")])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        cmap = register(dealer, channel_for(cfg, "worker-x"), cfg, {"role": "worker"}, "worker")
        server.join(10)
        assert cmap.body["session"] == b"s" * 32
        assert len(hellos) == 3 and len(set(hellos)) == 3  # a fresh HELLO each time
        assert issubclass(SchedulerRebuildingError, ProtocolError)
    finally:
        dealer.close()
        router.close()

"""kvstore.client.mux on real sockets: threads that send and wait share a worker's sockets correctly.

A real ROUTER served by ``RouterService`` in a thread stands in for a server: it answers PULL at
once and holds PUSH replies until the test releases them.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from kvstore.client.mux import Mux
from kvstore.errors import NodeLostError, StoreClosedError
from kvstore.net import transport
from kvstore.net.auth import Channel, derive_key
from kvstore.net.protocol import Message, Op
from kvstore.net.router import RouterService
from tests.helpers import poll_for, run_parallel

KEY = derive_key("wire-test-secret")
SESSION = b"wire-test-session"


class FakeServer(threading.Thread):
    """A ROUTER that opens every message like a server does: PULL is answered with its body's
    ``n`` at once, PUSH is held until :meth:`release`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock, self.port = transport.bind_router("127.0.0.1")
        self.service = RouterService(self.sock, Channel(KEY, "server0", session=SESSION))
        self.service.handlers = {Op.PULL: self._pull, Op.PUSH: self._push}
        self.held: list[tuple[bytes, int]] = []
        self._release = threading.Event()
        self._halt = threading.Event()

    def _pull(self, identity: bytes, msg: Message) -> None:
        self.service.reply(identity, Message(Op.OK, {"n": msg.body["n"]}, seq=msg.seq))

    def _push(self, identity: bytes, msg: Message) -> None:
        self.held.append((identity, msg.seq))

    def release(self) -> None:
        """Answer every held PUSH (from the server's own thread)."""
        self._release.set()

    def run(self) -> None:
        while not self._halt.is_set():
            self.service.poll_once(0.02)
            if self._release.is_set():
                self._release.clear()
                for identity, seq in self.held:
                    self.service.reply(identity, Message(Op.OK, seq=seq))
                self.held = []
        transport.close(self.sock)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


@pytest.fixture
def wire_and_server():
    server = FakeServer()
    server.start()
    unused, unused_port = transport.bind_router("127.0.0.1")  # the scheduler's socket, never used
    wire = Mux(transport.connect_dealer(transport.address("127.0.0.1", unused_port)),
                [transport.connect_dealer(transport.address("127.0.0.1", server.port))], 0,
                Channel(KEY, "worker-test", session=SESSION))
    yield wire, server
    wire.stop(5)
    server.stop()
    transport.close(unused)


def _pull(wire: Mux, n: int):
    return wire.submit(0, Message(Op.PULL, {"n": n}), f"pull {n}")


def test_threads_sending_at_once_reach_the_server_in_sealed_order(wire_and_server) -> None:
    """8 threads x 40 requests: every message opens at the server (its numbers rise in the order the
    wire sends them; a message overtaking another would be refused as a replay) and every reply
    reaches its own caller."""
    wire, _ = wire_and_server

    def one(t: int) -> list[int]:
        got = []
        for i in range(40):
            request = _pull(wire, 1000 * t + i)
            got.append(wire.wait(request, 20).body["n"])
        return got

    results = run_parallel([lambda t=t: one(t) for t in range(8)])
    assert results == [[1000 * t + i for i in range(40)] for t in range(8)]


def test_a_waiting_thread_reads_the_replies_of_others(wire_and_server) -> None:
    """While one thread waits on a held push (and so drives the sockets), another thread's pull is
    answered and returns; the push returns once its reply comes."""
    wire, server = wire_and_server
    push = wire.submit(0, Message(Op.PUSH, {}), "push")
    outcome = {}
    leader = threading.Thread(target=lambda: outcome.setdefault("push", wire.wait(push, 20)))
    leader.start()
    poll_for(lambda: wire._io.locked(), 10, "the waiting push to drive the sockets")
    assert wire.wait(_pull(wire, 7), 10).body["n"] == 7
    assert leader.is_alive()
    server.release()
    leader.join(10)
    assert outcome["push"].op is Op.OK


def test_fail_ends_a_wait_at_once(wire_and_server) -> None:
    """fail() (a lost node, from the heartbeat thread) fails the waiting request without waiting for
    the socket lock, and every later request at once."""
    wire, _ = wire_and_server
    push = wire.submit(0, Message(Op.PUSH, {}), "push")
    errors = []

    def wait() -> None:
        try:
            wire.wait(push, 30)
        except NodeLostError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    poll_for(lambda: wire._io.locked(), 10, "the waiting push to drive the sockets")
    started = time.monotonic()
    wire.fail(NodeLostError("server 0 on 127.0.0.1 was lost", role="server", rank=0, host="127.0.0.1"))
    waiter.join(10)
    assert errors and time.monotonic() - started < 5
    with pytest.raises(NodeLostError):
        wire.wait(_pull(wire, 1), 5)


def test_a_wait_past_its_deadline_raises_timeout_and_stop_fails_what_is_left(wire_and_server) -> None:
    """A held request times out after its deadline; stop() then fails it with StoreClosedError, and
    a later submit is refused."""
    wire, _ = wire_and_server
    push = wire.submit(0, Message(Op.PUSH, {}), "push")
    started = time.monotonic()
    with pytest.raises(FutureTimeout):
        wire.wait(push, 0.3)
    assert 0.25 <= time.monotonic() - started < 5
    wire.stop(5)
    with pytest.raises(StoreClosedError):
        push.future.result(0)
    with pytest.raises(StoreClosedError):
        _pull(wire, 2)

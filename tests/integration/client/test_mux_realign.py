"""A worker's Mux across a server restart, on real sockets: requests the lost server never answered
(and later ones) are held, sent again after the socket is swapped, sealed for the new name, in order."""

from __future__ import annotations

import threading
import types

import pytest

from kvstore.client.compress import WorkerCompression
from kvstore.client.datapath import ClusterView, DataPath
from kvstore.client.joining import Rejoin
from kvstore.client.meter import WorkerMeter
from kvstore.client.mux import Mux
from kvstore.client.realign import Realigner, lowest_rounds
from kvstore.client.window import PushWindow
from kvstore.errors import StoreClosedError
from kvstore.net import transport
from kvstore.net.auth import Channel, derive_key, server_name
from kvstore.net.protocol import Message, Op
from kvstore.net.router import RouterService
from tests.helpers import poll_for

KEY = derive_key("realign-test-secret")
SESSION = b"realign-test-session"


class Server(threading.Thread):
    """A ROUTER named ``name`` that records each PUSH's body and answers it, unless ``silent``."""

    def __init__(self, name: str, silent: bool) -> None:
        super().__init__(daemon=True)
        self.sock, self.port = transport.bind_router("127.0.0.1")
        self.service = RouterService(self.sock, Channel(KEY, name, session=SESSION))
        self.service.handlers = {Op.PUSH: self._push}
        self.silent, self.bodies = silent, []
        self._halt = threading.Event()

    def _push(self, identity: bytes, msg: Message) -> None:
        self.bodies.append(msg.body)
        if not self.silent:
            self.service.reply(identity, Message(Op.OK, seq=msg.seq))

    def run(self) -> None:
        while not self._halt.is_set():
            self.service.poll_once(0.02)
        transport.close(self.sock)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


@pytest.fixture
def servers():
    started = []

    def start(name: str, silent: bool) -> Server:
        server = Server(name, silent)
        server.start()
        started.append(server)
        return server
    yield start
    for server in started:
        server.stop()


def _push(wire: Mux, n: int):
    return wire.submit(0, Message(Op.PUSH, {"keys": ["k"], "rounds": [n]}), f"push {n}")


@pytest.mark.timeout(30)
def test_held_requests_go_again_in_order_to_the_swapped_server(servers) -> None:
    """Two pushes the old server never answered and one made while held reach the new server, in order,
    sealed for its new name, and their futures resolve from its replies."""
    old, new = servers("server0", silent=True), servers(server_name(0, 1), silent=False)
    unused, unused_port = transport.bind_router("127.0.0.1")
    wire = Mux(transport.connect_dealer(transport.address("127.0.0.1", unused_port)),
                [transport.connect_dealer(transport.address("127.0.0.1", old.port))], 0,
                Channel(KEY, "worker-test", session=SESSION))
    try:
        first, second = _push(wire, 0), _push(wire, 1)
        with pytest.raises(TimeoutError):
            wire.wait(second, 0.3)  # the old server never answers
        assert len(old.bodies) == 2
        wire.hold(0)
        third = _push(wire, 2)  # held, not sent
        assert [m.body["rounds"] for m in wire.held(0)] == [[0], [1], [2]]
        assert lowest_rounds(wire.held(0), {"k": 3, "other": 5}) == (["k", "other"], [0, 5])
        wire.swap(0, transport.connect_dealer(transport.address("127.0.0.1", new.port)), server_name(0, 1))
        assert wire.release(0) == 3
        for request in (first, second, third):
            assert wire.wait(request, 10).op is Op.OK
        assert [b["rounds"] for b in new.bodies] == [[0], [1], [2]]
        assert len(old.bodies) == 2  # nothing more went to the old one
    finally:
        wire.stop(5)
        transport.close(unused)


@pytest.mark.timeout(30)
def test_held_requests_fail_when_the_wire_stops(servers) -> None:
    """A request held for a restarting server fails with StoreClosedError when the store closes."""
    old = servers("server0", silent=True)
    unused, unused_port = transport.bind_router("127.0.0.1")
    wire = Mux(transport.connect_dealer(transport.address("127.0.0.1", unused_port)),
                [transport.connect_dealer(transport.address("127.0.0.1", old.port))], 0,
                Channel(KEY, "worker-test", session=SESSION))
    wire.hold(0)
    held = _push(wire, 0)
    wire.stop(5)
    transport.close(unused)
    with pytest.raises(StoreClosedError):
        held.future.result(1)


class _AligningServer(Server):
    """A Server that also answers ALIGN, unless ``silent``, and records each ALIGN's body."""

    def __init__(self, name: str, silent: bool) -> None:
        super().__init__(name, silent)
        self.aligns: list[dict] = []
        self.service.handlers[Op.ALIGN] = self._align

    def _align(self, identity: bytes, msg: Message) -> None:
        self.aligns.append(msg.body)
        if not self.silent:
            self.service.reply(identity, Message(Op.OK, {"lost": 0}, seq=msg.seq))


def _data_path(wire: Mux, timeout: float) -> tuple[DataPath, types.SimpleNamespace]:
    """The data path a Realigner uses, over a real Mux, with one push of "k" counted; a request waits
    ``timeout`` s.  Returns it and its settings."""
    cfg = types.SimpleNamespace(incarnation=0, request_timeout=timeout, snapshot_dir=None,
                                test_die_at_round=None)
    cluster = ClusterView(0, 1, ("server0",), 0, b"", 0, "dist_sync")
    path = DataPath(cfg, cluster, wire, PushWindow(2), WorkerMeter(0, "127.0.0.1"), {}, threading.RLock(),
                    WorkerCompression(), lambda *a, **k: None)
    path._pushes["k"] = 1
    return path, cfg


@pytest.mark.timeout(30)
def test_an_alignment_superseded_by_a_newer_restart_does_not_fail_the_store() -> None:
    """A server restarted twice before its first restart aligned: the first alignment, never answered
    on its swapped-out socket, gives way to the second instead of failing the store when it times out."""
    old, first = Server("server0", silent=True), _AligningServer(server_name(0, 1), silent=True)
    second = _AligningServer(server_name(0, 2), silent=False)
    for server in (old, first, second):
        server.start()
    unused, unused_port = transport.bind_router("127.0.0.1")
    wire = Mux(transport.connect_dealer(transport.address("127.0.0.1", unused_port)),
                [transport.connect_dealer(transport.address("127.0.0.1", old.port))], 0,
                Channel(KEY, "worker-test", session=SESSION))
    path, cfg = _data_path(wire, timeout=1.5)
    try:
        push = _push(wire, 0)  # the lost server never answers it
        realigner = Realigner(path, cfg, {"servers": [["127.0.0.1", old.port]]}, Rejoin(False))
        realigner.on_restarted([[0, 1, "127.0.0.1", first.port]])
        poll_for(lambda: first.aligns, 10, "the first restart's ALIGN")
        realigner.on_restarted([[0, 2, "127.0.0.1", second.port]])
        assert wire.wait(push, 10).op is Op.OK  # sent again to the second restart, answered
        for thread in realigner.threads:
            thread.join(10)
        assert wire.failure is None  # the store was not failed
        assert wire.wait(_push(wire, 1), 10).op is Op.OK
    finally:
        wire.stop(5)
        transport.close(unused)
        for server in (old, first, second):
            server.stop()

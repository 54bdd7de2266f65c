"""Hostile review of the Unix-socket links (issue 39) on real processes: reproducers that fail on the
reviewed code, each beside the zmq behaviour it departed from."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest

from kvstore.client import unixlinks
from kvstore.client.mux import SCHEDULER, Mux
from kvstore.config import Config
from kvstore.errors import KVStoreError
from kvstore.net import transport
from kvstore.net.auth import Channel, derive_key
from kvstore.net.protocol import Message, Op
from kvstore.net.router import RouterService
from kvstore.net.unixlink import UnixLink, UnixLinks

from .conftest import unique_key

KEY = derive_key("review-links-secret")
SESSION = b"review-links-session"

@pytest.mark.timeout(90)
@pytest.mark.parametrize("links", [pytest.param("1", id="link"), pytest.param("0", id="zmq")])
def test_a_server_stalled_past_the_request_deadline_serves_the_worker_again(make_cluster, links) -> None:
    """A same-host server stopped (SIGSTOP) for longer than KVSTORE_REQUEST_TIMEOUT while its worker
    pushes 32 MB fails that push at its deadline; once the server runs again (well within the heartbeat
    timeout, so it is never lost nor restarted) the worker's next pull of another key is answered, as
    it is over zmq."""
    cluster = make_cluster("dist_sync", 1, 1, KVSTORE_SHM_BYTES=str(1 << 20), KVSTORE_UNIX_LINKS=links,
                           KVSTORE_REQUEST_TIMEOUT="2", KVSTORE_HEARTBEAT_TIMEOUT="20")
    kv = cluster.workers[0]
    assert (type(kv._io.sockets[0]) is UnixLink) == (links == "1")
    small, big = unique_key("stall"), unique_key("stall")
    kv.init([small, big], [np.full(8, 5.0, np.float32), np.zeros(8 << 20, np.float32)])
    server = next(proc.pid for name, proc, _ in cluster.procs.procs if name == "server 0")
    os.kill(server, signal.SIGSTOP)
    try:
        try:
            kv.push(big, np.ones(8 << 20, np.float32))
            kv.pull(big)  # over zmq the push went to zmq's queue: its reply is what times out
        except KVStoreError:
            pass  # the stalled push, given up on at its deadline
    finally:
        os.kill(server, signal.SIGCONT)
    try:
        np.testing.assert_array_equal(kv.pull(small), np.full(8, 5.0, np.float32))
    finally:
        try:
            kv.close()  # its LEAVE is lost the same way on the link: not the fixture's failure
        except KVStoreError:
            pass


class _Router:
    """A server's zmq side that nothing reaches (the links are what a test drives)."""

    def send(self, identity: bytes, frames: list) -> bool:
        return True

    def recv(self, timeout: float | None) -> None:
        return None

    def close(self) -> None:
        pass


class _Offering(threading.Thread):
    """A ROUTER served as a server serves LINK offers, naming ``address`` (with a token of its own)."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.sock, self.port = transport.bind_router("127.0.0.1")
        self.service = RouterService(self.sock, Channel(KEY, "server0", session=SESSION))
        self.service.handlers = {Op.LINK: lambda identity, msg: self.service.reply(
            identity, Message(Op.OK, {"address": address, "token": b"t" * 16}, seq=msg.seq))}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.service.poll_once(0.02)
        transport.close(self.sock)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


@pytest.mark.timeout(60)
def test_a_link_closed_before_its_token_is_answered_leaves_the_worker_on_zmq() -> None:
    """A server that accepts the link's connection and closes it before answering the token (a server
    at MAX_CONNECTIONS, which a local stranger can fill, does just that) leaves the worker on zmq:
    attach raises nothing and returns no linked server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"kvstore-review-{os.getpid()}-{os.urandom(4).hex()}"
    listener.bind("\0" + name)
    listener.listen(8)
    closer = threading.Thread(target=lambda: listener.accept()[0].close(), daemon=True)
    closer.start()
    server = _Offering(name)
    server.start()
    unused, unused_port = transport.bind_router("127.0.0.1")  # the scheduler's socket, never used
    wire = Mux(transport.connect_dealer(transport.address("127.0.0.1", unused_port)),
               [transport.connect_dealer(transport.address("127.0.0.1", server.port))], 0,
               Channel(KEY, "worker-test", session=SESSION))
    try:
        assert unixlinks.attach(Config(), wire, 1, 2.0) == []
        assert type(wire.sockets[0]) is not UnixLink
    finally:
        wire.stop(5)
        server.stop()
        transport.close(unused)
        listener.close()


@pytest.mark.timeout(60)
def test_the_heartbeat_thread_releasing_the_scheduler_never_waits_on_a_link() -> None:
    """The heartbeat's thread, resuming after a scheduler's restart (``Mux.release(SCHEDULER)``), sends
    what the outbox holds without waiting on a server that does not read its link now (busy in a
    handler): it returns at once, as :meth:`Mux.nudge` does, the rest left for the data path."""
    links = UnixLinks(_Router(), 0)  # a server that never reads (its loop is busy elsewhere)
    unused, unused_port = transport.bind_router("127.0.0.1")
    spare, spare_port = transport.bind_router("127.0.0.1")
    wire = Mux(transport.connect_dealer(transport.address("127.0.0.1", unused_port)),
               [transport.connect_dealer(transport.address("127.0.0.1", spare_port))], 0,
               Channel(KEY, "worker-test", session=SESSION))
    try:
        wire.use_link(0, UnixLink(links.name, 0, 0, 3.0, wire.cancelled))
        wire.submit(0, Message(Op.PUSH, {"keys": ["w"]}, arrays=[np.zeros(4 << 20, np.float32)]),
                    "push of a paced chunk", defer=True)  # left in the outbox, as a big push's later chunks
        def resumed() -> None:  # the heartbeat's thread, as the store names it to its Mux
            wire.heartbeat_thread = threading.get_ident()
            wire.release(SCHEDULER)
        released = threading.Thread(target=resumed, name="heartbeat-like")
        started = time.monotonic()
        released.start()  # the heartbeat's thread, as WorkerRebind.resumed() calls it
        released.join(10)
        took = time.monotonic() - started
    finally:
        wire.stop(5)
        links.close()
        transport.close(unused)
        transport.close(spare)
    assert took < 1.0, f"the heartbeat's thread waited {took:.1f} s on a server's link"

"""KVSTORE_ENCRYPT=curve through real processes: an encrypted cluster computes, its bytes are not
readable on the wire, and a node in the other mode fails at its connect deadline, naming the knob."""

from __future__ import annotations

import dataclasses
import selectors
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq.auth

from kvstore.client.store import DistKVStore
from kvstore.errors import DeadlineExceededError

from ..conftest import Cluster, unique_key

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("keys", ["derived", "files"])
def test_an_encrypted_cluster_pushes_and_pulls(make_cluster, tmp_path: Path, keys: str) -> None:
    """2 workers, 1 server, dist_sync, CURVE keys from the secret or from zmq certificate files."""
    settings = {"KVSTORE_ENCRYPT": "curve"}
    if keys == "files":
        zmq.auth.create_certificates(str(tmp_path), "server")
        settings["KVSTORE_CURVE_KEYS"] = str(tmp_path)
    cluster: Cluster = make_cluster("dist_sync", 2, 1, **settings)
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(1000, np.float32)))
    cluster.run(lambda kv: kv.push(key, np.full(1000, kv.rank + 1.0, np.float32)))
    for out in cluster.run(lambda kv: kv.pull(key)):
        np.testing.assert_array_equal(out, np.full(1000, 3.0, np.float32))


class Recorder(threading.Thread):
    """A TCP relay to ``port`` on loopback that keeps every byte it carries, both ways."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.target, self.seen, self._halt = port, bytearray(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self._halt.is_set():
            for event, _ in self.selector.select(0.05):
                if event.fileobj is self.listener:
                    client, _ = self.listener.accept()
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                    self.selector.register(client, selectors.EVENT_READ, upstream)
                    self.selector.register(upstream, selectors.EVENT_READ, client)
                    continue
                data = event.fileobj.recv(1 << 16)
                if not data:
                    self._drop(event.fileobj, event.data)
                    continue
                with self.lock:
                    self.seen += data
                event.data.sendall(data)

    def _drop(self, *socks: socket.socket) -> None:
        for sock in socks:
            if sock.fileno() >= 0:
                self.selector.unregister(sock)
                sock.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()


@pytest.mark.parametrize("encrypt", ["off", "curve"])
def test_the_wire_shows_plaintext_only_without_encryption(make_cluster, encrypt: str) -> None:
    """A relay between a worker and the scheduler sees the registration's field names and the cluster
    map in the clear with KVSTORE_ENCRYPT=off, and none of them (only the CURVE greeting) with curve."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_ENCRYPT=encrypt)
    relay = Recorder(cluster.cfg.root_port)
    relay.start()
    try:
        cfg = dataclasses.replace(cluster.cfg, root_port=relay.port)
        cluster.workers.append(DistKVStore("dist_sync", cfg))
        kv = cluster.workers[0]
        kv.init("w", np.ones(4))
        kv.barrier()  # one more message each way through the relay
        kv.close()  # leaves through the relay, which must still be there
        with relay.lock:
            seen = bytes(relay.seen)
    finally:
        relay.stop()
    markers = [b"nonce", b"challenge", b"servers", b"dist_sync", b"127.0.0.1"]
    visible = [m for m in markers if m in seen]
    if encrypt == "off":
        assert visible == markers and b"NULL" in seen
    else:
        assert visible == [] and b"CURVE" in seen


@pytest.mark.parametrize("cluster_mode,worker_mode", [("curve", None), ("off", "curve")],
                         ids=["plain-worker", "encrypted-worker"])
def test_a_node_in_the_other_mode_fails_at_its_deadline(make_cluster, cluster_mode: str,
                                                        worker_mode: str | None) -> None:
    """The zmq handshake never completes; registration ends at KVSTORE_CONNECT_TIMEOUT with a
    DeadlineExceededError that names KVSTORE_ENCRYPT."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_ENCRYPT=cluster_mode)
    stranger = dataclasses.replace(cluster.cfg, encrypt=worker_mode, connect_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="KVSTORE_ENCRYPT"):
        DistKVStore("dist_sync", stranger)
    assert time.monotonic() - started < 5.0
    (kv,) = cluster.connect()  # the cluster itself is fine
    kv.init("w", np.ones(2))
    np.testing.assert_array_equal(kv.pull("w"), np.ones(2))

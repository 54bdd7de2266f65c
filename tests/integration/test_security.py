"""Authentication through real processes: a stranger can neither join, push, pull nor stop anything,
and a replayed message is refused."""

from __future__ import annotations

import dataclasses
import subprocess
import time

import numpy as np
import pytest
import zmq

from kvstore.client.store import DistKVStore
from kvstore.errors import AuthenticationError
from kvstore.net import protocol
from kvstore.net.auth import Channel, derive_key
from kvstore.net.protocol import Message, Op
from tests.helpers import REPO, python

from .conftest import Cluster, insider, unique_key


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _exchange(sock: zmq.Socket, frames: list) -> list:
    sock.send_multipart(frames)
    assert sock.poll(5000), "no answer"
    return sock.recv_multipart()


@pytest.mark.parametrize("secret", ["wrong", None], ids=["wrong-secret", "no-secret"])
def test_a_worker_without_the_secret_cannot_join(make_cluster, secret: str | None) -> None:
    """A worker with another secret (or none) gets AuthenticationError; the right one then joins."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False)
    stranger = dataclasses.replace(cluster.cfg, secret=secret, connect_timeout=10.0)
    started = time.monotonic()
    with pytest.raises(AuthenticationError):
        DistKVStore("dist_sync", stranger)
    assert time.monotonic() - started < 10.0
    (kv,) = cluster.connect()
    kv.init("w", np.ones(2))
    np.testing.assert_array_equal(kv.pull("w"), np.ones(2))


def test_forged_and_replayed_pushes_change_nothing(make_cluster) -> None:
    """A push sealed with another secret is refused; a genuine push sent twice is applied once."""
    cluster: Cluster = make_cluster("dist_async", 1, 1)
    (kv,) = cluster.workers
    key = unique_key()
    kv.init(key, np.zeros(3))
    sock = _dealer(kv._cluster.servers[0])
    try:
        forger = Channel(derive_key("guess"), "forger", session=b"whatever")
        forged = Message(Op.PUSH, {"keys": [key], "sizes": [3]}, [np.full(3, 100.0)], seq=1, sender=0)
        reply = _exchange(sock, forger.seal(forged, "server0"))
        assert reply[0] == b"" and protocol.decode(reply[1:]).body["code"] == "AuthenticationError"
        sealer = insider(kv, "insider")
        genuine = sealer.seal(Message(Op.PUSH, {"keys": [key], "sizes": [3]}, [np.full(3, 5.0)], seq=2,
                                      sender=0), "server0")
        assert sealer.open(_exchange(sock, genuine)).op is Op.OK
        reply = _exchange(sock, genuine)  # the same frames again: a replay
        assert reply[0] == b"" and "replayed" in protocol.decode(reply[1:]).body["message"]
    finally:
        sock.close()
    np.testing.assert_array_equal(kv.pull(key), np.full(3, 5.0))  # async assigns: the one genuine push


def test_a_stranger_cannot_make_the_scheduler_release_or_stop(make_cluster) -> None:
    """Unsigned LEAVE and BARRIER to the scheduler are refused (answered once per connection, then
    dropped); the cluster goes on."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1)
    for op in (Op.LEAVE, Op.BARRIER, Op.HEARTBEAT):
        sock = _dealer(cluster.cfg.root_address)  # a connection's first refusal is answered
        try:
            frames = [b"", *protocol.encode(Message(op, {}, seq=1, auth=["stranger", 1, "scheduler"]))]
            reply = _exchange(sock, frames)
            assert protocol.decode(reply[1:]).body["code"] == "AuthenticationError"
            sock.send_multipart(frames)  # a second one on the same connection is dropped, unanswered
            assert not sock.poll(300)
        finally:
            sock.close()
    cluster.run(lambda kv: kv.barrier())  # still two workers to meet: nobody was counted out
    _, log = next((p, lg) for name, p, lg in cluster.procs.procs if name == "scheduler")
    assert "left" not in log.read_text()


def test_full_mode_authenticates_payloads_end_to_end(make_cluster) -> None:
    """With KVSTORE_AUTH=full every node MACs array bytes too, and push/pull work as usual."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=10, KVSTORE_AUTH="full")
    key = unique_key()

    def work(kv):
        kv.init(key, np.zeros(25, np.float32))
        kv.push(key, np.full(25, kv.rank + 1.0, np.float32))
        return kv.pull(key)

    for out in cluster.run(work):
        np.testing.assert_array_equal(out, np.full(25, 3.0, np.float32))
    assert cluster.workers[0]._io.channel.full


def test_scheduler_refuses_a_public_address_without_a_secret() -> None:
    """A scheduler asked to listen on 0.0.0.0 with no KVSTORE_SECRET exits non-zero and says why."""
    env = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "0.0.0.0", "DMLC_PS_ROOT_PORT": "0",
           "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([python(), "-m", "kvstore.scheduler"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode != 0
    assert "without KVSTORE_SECRET" in done.stderr and "KVSTORE_INSECURE=1" in done.stderr

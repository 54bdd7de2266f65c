"""Every user error is raised by the call that made it; cluster errors name what went wrong."""

from __future__ import annotations

import dataclasses
import os

import msgpack
import numpy as np
import pytest
import zmq

import kvstore
from kvstore.client.store import DistKVStore
from kvstore.core.values import Meta
from kvstore.errors import (
    ConfigError,
    DeadlineExceededError,
    DTypeMismatchError,
    DuplicateInitError,
    KeyNotInitializedError,
    KeyTypeError,
    ProtocolError,
    ShapeMismatchError,
    StoreClosedError,
)
from kvstore.net import protocol
from kvstore.net.protocol import Message, Op
from tests.helpers import run_parallel

from .conftest import Cluster, insider, unique_key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """One 2-worker, 2-server dist_sync cluster for the error tests."""
    c = Cluster(tmp_path_factory.mktemp("errors"), "dist_sync", 2, 2)
    c.connect()
    yield c
    c.close()


def test_user_errors_raise_before_sending(cluster: Cluster) -> None:
    """Uninitialised keys, second inits, bad shapes, dtypes and key types raise on the caller."""
    kv = cluster.workers[0]
    key = unique_key()
    with pytest.raises(KeyNotInitializedError, match=f"key '{key}' has not been initialised"):
        kv.push(key, np.ones(2))
    with pytest.raises(KeyNotInitializedError):
        kv.pull(key)
    cluster.run(lambda w: w.init(key, np.zeros(3, np.float32)))
    with pytest.raises(DuplicateInitError):
        kv.init(key, np.zeros(3, np.float32))
    with pytest.raises(ShapeMismatchError, match=r"shape \(4,\)"):
        kv.push(key, np.ones(4, np.float32))
    with pytest.raises(DTypeMismatchError, match="float64"):
        kv.push(key, np.ones(3, np.float64))
    with pytest.raises(ShapeMismatchError):
        kv.pull(key, out=np.empty(5, np.float32))
    with pytest.raises(KeyTypeError):
        kv.push(1.5, np.ones(3, np.float32))
    with pytest.raises(KeyTypeError):
        kv.pull(-1)
    with pytest.raises(TypeError):
        kv.push(key, [1.0, 2.0, 3.0])
    # nothing was sent: a normal round still closes with exactly one push per worker
    cluster.run(lambda w: w.push(key, np.ones(3, np.float32)))
    for out in cluster.run(lambda w: w.pull(key)):
        np.testing.assert_array_equal(out, np.full(3, 2.0, np.float32))


def test_server_side_push_failure_raised_by_next_wait(cluster: Cluster) -> None:
    """A push the server rejects is raised by the next pull of that key, naming key and op."""
    key = unique_key()
    cluster.run(lambda w: w.init(key, np.zeros(4, np.float32)))
    kv = cluster.workers[1]
    real = kv._meta[key]
    kv._meta[key] = Meta((5,), real.dtype, False, 5)  # lie to the client so the server must refuse
    kv._path._placements.pop(key, None)  # and let it place the lie afresh
    try:
        kv.push(key, np.ones(5, np.float32))
    finally:
        kv._meta[key] = real
        kv._path._plans.clear()  # the lie's messages were planned and remembered
        kv._path._placements.pop(key, None)  # and its pieces
    with pytest.raises(ShapeMismatchError, match=rf"push of key '{key}' to server \d .* failed"):
        kv.pull(key)
    np.testing.assert_array_equal(kv.pull(key), np.zeros(4, np.float32))  # the store is untouched


def test_push_failure_raised_by_barrier_after_joining_it(cluster: Cluster) -> None:
    """A rejected push is raised by barrier() on its worker; the other workers' barrier still returns."""
    key = unique_key()
    cluster.run(lambda w: w.init(key, np.zeros(4, np.float32)))
    bad = cluster.workers[1]
    real = bad._meta[key]
    bad._meta[key] = Meta((6,), real.dtype, False, 6)
    bad._path._placements.pop(key, None)
    try:
        bad.push(key, np.ones(6, np.float32))
    finally:
        bad._meta[key] = real
        bad._path._plans.clear()
        bad._path._placements.pop(key, None)

    def barrier(kv):
        try:
            kv.barrier()
        except ShapeMismatchError as exc:
            return exc
        return None

    results = cluster.run(barrier)
    assert results[0] is None
    assert isinstance(results[1], ShapeMismatchError) and key in str(results[1])


def test_pull_deadline_names_the_key(cluster: Cluster) -> None:
    """A dist_sync pull that waits for pushes that never come raises DeadlineExceededError."""
    key = unique_key()
    cluster.run(lambda w: w.init(key, np.zeros(2)))
    kv = cluster.workers[0]
    saved = kv._cfg
    kv._cfg = kv._path._cfg = dataclasses.replace(saved, request_timeout=0.5)
    try:
        kv.push(key, np.ones(2))
        with pytest.raises(DeadlineExceededError, match=rf"pull of key '{key}' .* after 0.5 s"):
            kv.pull(key)
    finally:
        kv._cfg = kv._path._cfg = saved
    cluster.workers[1].push(key, np.ones(2))  # close the round so teardown can drain
    np.testing.assert_array_equal(kv.pull(key), np.full(2, 2.0))


def test_garbage_to_server_is_rejected_and_serving_goes_on(cluster: Cluster) -> None:
    """Garbage, unsigned and wrong-version messages get unsigned ERRORs, bad sealed requests sealed ones;
    stored values are unchanged."""
    key = unique_key()
    cluster.run(lambda w: w.init(key, np.full(3, 7.0)))
    host, port = cluster.workers[0]._cluster.servers[0].rsplit(":", 1)
    server = "server0"  # the address of server rank 0, as the map lists it
    tester = insider(cluster.workers[0], "tester")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"{host}:{port}")
    try:
        wrong_version = msgpack.packb({"v": 99, "op": 11, "seq": 1})
        pull = Message(Op.PULL, {"keys": [key], "sizes": [3]}, seq=1, sender=0, auth=["x", 1, server])
        unsigned = [b"", *protocol.encode(pull)]
        for frames in ([b"\xc1garbage"], [b"0" * 16, wrong_version], unsigned):
            stranger = zmq.Context.instance().socket(zmq.DEALER)  # one answered refusal per connection
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(f"{host}:{port}")
            try:
                stranger.send_multipart(frames)
                assert stranger.poll(5000), "the server did not answer"
                reply = stranger.recv_multipart()
            finally:
                stranger.close()
            assert reply[0] == b"", "a refusal is unsigned: the peer could not be verified"
            assert protocol.decode(reply[1:]).body["code"] in {"ProtocolError", "AuthenticationError"}
        for msg in (Message(Op.PUSH, {"keys": [key], "sizes": [9]}, [np.ones(9)], seq=2, sender=0),
                    Message(Op.PULL, {"keys": [2.5], "sizes": [1]}, seq=3, sender=0),
                    Message(Op.PULL, {"keys": [key], "sizes": [3]}, seq=4, sender=99)):
            sock.send_multipart(tester.seal(msg, server))
            assert sock.poll(5000), "the server did not answer"
            reply = tester.open(sock.recv_multipart())
            assert reply.op is Op.ERROR and reply.body["code"] in {
                "ProtocolError", "ShapeMismatchError", "KeyTypeError", "KeyNotInitializedError"}
    finally:
        sock.close()
    for out in cluster.run(lambda w: w.pull(key)):
        np.testing.assert_array_equal(out, np.full(3, 7.0))


def test_closed_store_raises(make_cluster) -> None:
    """Every call on a closed store raises StoreClosedError; close is idempotent."""
    c = make_cluster("dist_async", num_workers=1, num_servers=1)
    kv = c.workers[0]
    kv.init("a", np.zeros(1))
    kv.close()
    kv.close()
    for call in (lambda: kv.push("a", np.ones(1)), lambda: kv.pull("a"), kv.barrier,
                 lambda: kv.init("b", np.zeros(1))):
        with pytest.raises(StoreClosedError):
            call()


def test_forked_child_cannot_use_parent_store(make_cluster) -> None:
    """A forked child gets StoreClosedError instead of touching the parent's sockets."""
    c = make_cluster("dist_async", num_workers=1, num_servers=1)
    kv = c.workers[0]
    kv.init("f", np.zeros(1))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            kv.pull("f")
            os.write(write, b"no error")
        except StoreClosedError:
            os.write(write, b"StoreClosedError")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 100) == b"StoreClosedError" and status == 0
    os.close(read)
    assert kv.pull("f")[0] == 0.0  # the parent's store still works


def test_rendezvous_deadline_names_counts(make_cluster) -> None:
    """When a worker never comes, the others get DeadlineExceededError saying who registered."""
    c = make_cluster("dist_sync", num_workers=2, num_servers=1, connect=False,
                     KVSTORE_CONNECT_TIMEOUT=1.5)
    cfg = dataclasses.replace(c.cfg, connect_timeout=20)
    with pytest.raises(DeadlineExceededError, match=r"1/2 workers and 1/1 servers registered"):
        DistKVStore("dist_sync", cfg)
    poll_exit = c.procs.procs[0][1].wait(timeout=10)
    assert poll_exit == 1  # the scheduler reports the failure in its exit code


def test_worker_deadline_without_scheduler(tmp_path) -> None:
    """With no scheduler at the root address, create fails after KVSTORE_CONNECT_TIMEOUT."""
    ctx_sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = ctx_sock.bind_to_random_port("tcp://127.0.0.1")
    ctx_sock.close()  # a port nobody listens on any more
    cfg = kvstore.config.load({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
                               "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1",
                               "KVSTORE_CONNECT_TIMEOUT": "0.5"})
    with pytest.raises(DeadlineExceededError, match="challenge from the scheduler at"):
        DistKVStore("dist_sync", cfg)


def test_mode_mismatch_is_refused(make_cluster) -> None:
    """Workers asking for dist_sync and dist_async in one cluster both get ConfigError."""
    c = make_cluster("dist_sync", num_workers=2, num_servers=1, connect=False)

    def join(mode: str):
        try:
            return DistKVStore(mode, c.cfg)
        except ConfigError as exc:
            return exc

    results = run_parallel([lambda: join("dist_sync"), lambda: join("dist_async")])
    assert all(isinstance(r, ConfigError) and "disagree" in str(r) for r in results)


def test_requested_ranks_are_honoured(make_cluster) -> None:
    """DMLC_WORKER_ID values that are complete and unique become the ranks."""
    c = make_cluster("dist_async", num_workers=3, num_servers=1, connect=False)
    wanted = [2, 0, 1]
    stores = run_parallel([lambda w=w: DistKVStore("dist_async", dataclasses.replace(c.cfg, worker_id=w))
                           for w in wanted])
    c.workers = stores
    assert [kv.rank for kv in stores] == wanted


def test_create_dist_without_environment(monkeypatch) -> None:
    """create('dist_sync') outside a cluster raises ConfigError naming the variables and launch.py."""
    for name in ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER",
                 "DMLC_NUM_WORKER"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="DMLC_PS_ROOT_URI.*launch.py"):
        kvstore.create("dist_sync")


def test_protocol_error_type() -> None:
    """A reply that is not msgpack decodes to ProtocolError, never to a msgpack exception."""
    with pytest.raises(ProtocolError):
        protocol.decode([b"\x00\x01\x02"])


def _barrier_with_deadline(kv, seconds: float) -> None:
    saved = kv._cfg
    kv._cfg = kv._barriers._cfg = kv._path._cfg = dataclasses.replace(saved, request_timeout=seconds)
    try:
        kv.barrier()
    finally:
        kv._cfg = kv._barriers._cfg = kv._path._cfg = saved


def test_timed_out_barrier_is_withdrawn(cluster: Cluster) -> None:
    """A barrier that timed out leaves no stale entry: a lone later arrival still waits."""
    first, second = cluster.workers
    with pytest.raises(DeadlineExceededError, match="barrier among all workers"):
        _barrier_with_deadline(first, 0.3)
    with pytest.raises(DeadlineExceededError):  # would pass if first's old entry still counted
        _barrier_with_deadline(second, 0.3)
    assert cluster.run(lambda kv: kv.barrier()) == [None, None]
    assert cluster.run(lambda kv: kv.barrier()) == [None, None]  # and the next one still pairs


def test_submit_after_close_is_refused(make_cluster) -> None:
    """A request that races close() gets StoreClosedError, never an OSError or a silent drop."""
    c = make_cluster("dist_async", num_workers=1, num_servers=1)
    kv = c.workers[0]
    kv.close()
    with pytest.raises(StoreClosedError):
        kv._io.submit(0, Message(Op.PULL, {"key": "x"}), "pull of key 'x'")


def test_argument_errors_change_nothing(cluster: Cluster) -> None:
    """Over-long keys, repeated pushpull keys, expanded or bfloat16 outs raise before sending."""
    torch = pytest.importorskip("torch")
    key = unique_key()
    cluster.run(lambda w: w.init(key, torch.zeros(3)))
    kv = cluster.workers[0]
    with pytest.raises(KeyTypeError, match="byte limit"):
        kv.push("x" * (1 << 20), np.ones(1))
    with pytest.raises(ValueError, match="each key once"):
        kv.pushpull([key, key], [torch.ones(3), torch.ones(3)])
    with pytest.raises(ValueError, match="share memory"):
        kv.pull(key, out=torch.zeros(1).expand(3))
    with pytest.raises(DTypeMismatchError, match="bfloat16"):
        kv.push(key, torch.ones(3, dtype=torch.bfloat16))
    param = torch.nn.Parameter(torch.ones(3))
    cluster.run(lambda w: w.push(key, torch.full((3,), 2.0)))
    kv.pull(key, out=param)  # a parameter that requires grad is filled without autograd errors
    assert torch.equal(param.detach(), torch.full((3,), 4.0))

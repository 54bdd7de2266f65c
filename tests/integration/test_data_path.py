"""The fast data path through real servers: batches, whole pieces and chunks, every setting.

Clusters here use a 4 KiB chunk (``KVSTORE_CHUNK_BYTES``), so a slice of more than
4 chunks (4096 float32 elements) travels in chunks, next to small keys packed into
batches and mid-sized slices sent whole; every value must come back exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import KeyNotInitializedError, ProtocolError, ShapeMismatchError
from kvstore.net import protocol
from kvstore.net.protocol import Message, Op
from tests.helpers import poll_for

from .conftest import Cluster, insider, unique_key

CHUNK = 4096  # bytes

SETTINGS = {
    "default": {},
    "unbatched": {"KVSTORE_BATCH_BYTES": "0"},
    "rank_order": {"KVSTORE_SUM_ORDER": "rank"},
    "unchunked": {"KVSTORE_CHUNK_BYTES": "0", "KVSTORE_MAX_MESSAGE_BYTES": "0"},  # unlimited, or refused
}


def _keys(tag: str) -> dict:
    """Key -> (shape, dtype): 60 small keys of three dtypes, a split key sent whole, a chunked one."""
    keys = {f"{tag}/small{i}": ((1 + i % 7,), ("float32", "float64", "int32")[i % 3]) for i in range(60)}
    keys[f"{tag}/split"] = ((3000,), "float32")        # 1500 elements per server: whole
    keys[f"{tag}/big"] = ((50, 1000), "float32")       # 25,000 per server: 25 chunks of 1024
    return keys


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_kind_of_message_sums_exactly(make_cluster, setting: str) -> None:
    """3 workers x 2 servers: push, pull (into outs, new arrays, a non-contiguous out) and pushpull
    of batched, whole and chunked values give exactly the sum of every worker's push."""
    env = {"KVSTORE_CHUNK_BYTES": str(CHUNK), **SETTINGS[setting]}
    cluster: Cluster = make_cluster("dist_sync", 3, 2, **env)
    keys = _keys(unique_key())
    names = list(keys)
    W = cluster.num_workers

    def value(key: str, rank: int, step: int) -> np.ndarray:
        shape, dtype = keys[key]
        base = np.arange(np.prod(shape)).reshape(shape) % 97
        return (base * (rank + 1) + step).astype(dtype)

    def expected(key: str, step: int) -> np.ndarray:
        return sum(value(key, r, step) for r in range(W)).astype(keys[key][1])

    def work(kv):
        kv.init(names, [np.zeros(*keys[k]) for k in names])
        kv.push(names, [value(k, kv.rank, 1) for k in names])
        outs = [np.empty(*keys[k]) for k in names]
        kv.pull(names, out=outs)
        fresh = kv.pull(names)
        wide = np.zeros((50, 2000), np.float32)[:, ::2]  # a non-contiguous out of the big key
        kv.pull(names[-1], out=wide)
        grads = [value(k, kv.rank, 2) for k in names]
        kv.pushpull(names, grads)  # written back into grads
        return outs, fresh, wide.copy(), grads, kv._path.plan(names)[0]

    results = cluster.run(work)
    for outs, fresh, wide, grads, _ in results:
        for key, out, new, after in zip(names, outs, fresh, grads):
            np.testing.assert_array_equal(out, expected(key, 1), err_msg=key)
            np.testing.assert_array_equal(new, expected(key, 1), err_msg=key)
            np.testing.assert_array_equal(after, expected(key, 2), err_msg=key)
        np.testing.assert_array_equal(wide, expected(names[-1], 1))
    sends = results[0][4]
    batched = any(len(s.parts) > 1 for s in sends)
    chunked = any(s.lo is not None for s in sends)
    assert batched == (setting != "unbatched")
    assert chunked == (setting != "unchunked")


def test_async_chunks_apply_once_complete(make_cluster) -> None:
    """dist_async: a chunked push is applied when its last chunk arrives, so a pull sees all of it.

    One server: with a key split over two, each server applies the pushes in its own arrival
    order, so the slices may come from different workers' pushes (as in MXNet)."""
    cluster: Cluster = make_cluster("dist_async", 2, 1, KVSTORE_CHUNK_BYTES=str(CHUNK))
    key = unique_key()
    shape = (40_000,)

    def work(kv):
        kv.init(key, np.zeros(shape, np.float32))
        kv.barrier()
        for step in range(3):
            kv.push(key, np.full(shape, 10.0 * kv.rank + step, np.float32))
        kv.barrier()
        return kv.pull(key)

    finals = cluster.run(work)
    assert any(s.lo is not None for s in cluster.workers[0]._path.plan([key])[0])
    for got in finals:  # async assigns: the last complete push of either worker, never a mix
        assert got[0] in (2.0, 12.0)
        np.testing.assert_array_equal(got, np.full(shape, got[0], np.float32))
    np.testing.assert_array_equal(finals[0], finals[1])  # both pulled after every push was applied


def _exchange(sock, frames) -> list:
    sock.send_multipart(frames)
    assert sock.poll(10_000), "the server did not answer"
    return sock.recv_multipart()


def test_a_bad_entry_refuses_the_whole_message(make_cluster) -> None:
    """A batch with one uninitialised key, a wrong total size, or a chunk out of order gets an ERROR
    and changes nothing; the server goes on serving."""
    import zmq

    cluster: Cluster = make_cluster("dist_async", 1, 1, KVSTORE_CHUNK_BYTES=str(CHUNK))
    (kv,) = cluster.workers
    good, big = unique_key(), unique_key()
    kv.init([good, big], [np.zeros(3, np.float32), np.zeros(10_000, np.float32)])
    sealer = insider(kv, "batcher")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kv._cluster.servers[0])
    bad = [
        (Message(Op.PUSH, {"keys": [good, "never-initialised"], "sizes": [3, 2]},
                 [np.full(5, 9.0, np.float32)], seq=1, sender=0), KeyNotInitializedError),
        (Message(Op.PUSH, {"keys": [good], "sizes": [3]}, [np.full(4, 9.0, np.float32)], seq=2, sender=0),
         ProtocolError),
        (Message(Op.PUSH, {"keys": [good, good], "sizes": [3, 3]}, [np.full(6, 9.0, np.float32)],
                 seq=3, sender=0), ProtocolError),
        (Message(Op.PUSH, {"keys": [big], "sizes": [1024], "lo": 1024}, [np.full(1024, 9.0, np.float32)],
                 seq=4, sender=0), ProtocolError),  # its first chunk must start at 0
        (Message(Op.PULL, {"keys": [good], "sizes": [2]}, seq=5, sender=0), ShapeMismatchError),
    ]
    try:
        for msg, error in bad:
            reply = sealer.open(_exchange(sock, sealer.seal(msg, "server0")))
            assert reply.op is Op.ERROR and reply.body["code"] == error.__name__, reply.body
    finally:
        sock.close()
    np.testing.assert_array_equal(kv.pull(good), np.zeros(3, np.float32))
    np.testing.assert_array_equal(kv.pull(big), np.zeros(10_000, np.float32))
    kv.push([good, big], [np.ones(3, np.float32), np.ones(10_000, np.float32)])
    np.testing.assert_array_equal(kv.pull(big), np.ones(10_000, np.float32))
    assert protocol.PROTOCOL_VERSION == 12  # 6: STATUS, stats, push_window; 7: SPARSE_*; 8: AWAY, REJOIN;
    # 9: PIPE_* (pipelines); 10: SHM_ATTACH and the shm / reply_at header fields; 11: the compact layout;
    # 12: ALIGN (server restarts)


def test_pushed_arrays_may_change_at_once_and_buffers_are_reused_only_when_acknowledged(make_cluster) -> None:
    """A worker's second push of a key while its first is still in an open round does not overwrite
    the first (its buffer is reused only once acknowledged); arrays changed right after push, batched
    or sent as views, do not change what was pushed."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, KVSTORE_CHUNK_BYTES=str(CHUNK))
    a, b = cluster.workers
    big, small = unique_key(), [unique_key() for _ in range(3)]
    shape = (30_000,)  # chunked on both servers
    cluster.run(lambda kv: kv.init([big, *small], [np.zeros(shape, np.float32)] + [np.zeros(4)] * 3))
    value = np.full(shape, 1.0, np.float32)
    a.push(big, value)
    value[:] = 999.0  # the push returned: the caller may reuse its array
    a.push(big, np.full(shape, 2.0, np.float32))  # round 1 is still open: the first buffer is in flight
    assert not all(r.future.done() for r in a._path._buffers[big][1])
    smalls = [np.full(4, float(i)) for i in range(3)]
    a.push(small, smalls)
    for array in smalls:
        array[:] = -1.0
    b.push(big, np.full(shape, 10.0, np.float32))
    np.testing.assert_array_equal(b.pull(big), np.full(shape, 11.0, np.float32))
    b.push(big, np.full(shape, 20.0, np.float32))
    np.testing.assert_array_equal(b.pull(big), np.full(shape, 22.0, np.float32))
    np.testing.assert_array_equal(a.pull(big), np.full(shape, 22.0, np.float32))
    first = a._path._buffers[big][0]
    a.push(big, np.full(shape, 3.0, np.float32))  # acknowledged by now: its buffer is reused
    assert np.shares_memory(a._path._buffers[big][0], first)
    b.push(big, np.full(shape, 30.0, np.float32))
    np.testing.assert_array_equal(a.pull(big), np.full(shape, 33.0, np.float32))
    b.push(small, [np.zeros(4)] * 3)
    for i, got in enumerate(a.pull(small)):
        np.testing.assert_array_equal(got, np.full(4, float(i)))


@pytest.mark.parametrize("mode", ["dist_sync", "dist_async"])
def test_threads_pushing_one_chunked_key_never_mix_their_chunks(make_cluster, mode: str) -> None:
    """Two threads of one worker pushing the same chunked key: each push reaches the server as one
    run of chunks, so every stored value is one thread's push, never a mix, and nothing is refused."""
    from tests.helpers import run_parallel

    cluster: Cluster = make_cluster(mode, 1, 1, KVSTORE_CHUNK_BYTES=str(CHUNK))
    (kv,) = cluster.workers
    key = unique_key()
    shape = (50_000,)  # 13 chunks
    kv.init(key, np.zeros(shape, np.float32))
    assert sum(s.lo is not None for s in kv._path.plan([key])[0]) > 4

    def pusher(fill: float) -> list[float]:
        seen = []
        for _ in range(15):
            kv.push(key, np.full(shape, fill, np.float32))
            got = kv.pull(key)
            assert len(set(got.tolist())) == 1, "a stored value mixes two pushes"
            seen.append(float(got[0]))
        return seen

    for seen in run_parallel([lambda: pusher(1.0), lambda: pusher(2.0)]):
        assert set(seen) <= {1.0, 2.0}
    kv.barrier()  # raises any push the server refused


def test_close_releases_a_thread_waiting_on_the_sockets(make_cluster) -> None:
    """A pull waiting (as the thread driving the sockets) for a round that cannot close is ended by
    close() from another thread with StoreClosedError, at once rather than at its deadline."""
    import threading
    import time

    from kvstore.errors import StoreClosedError

    cluster: Cluster = make_cluster("dist_sync", 2, 1)
    a, _ = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(3)))
    a.push(key, np.ones(3))  # worker 1 never pushes: the round stays open
    outcome = {}

    def wait() -> None:
        try:
            a.pull(key)
        except StoreClosedError as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    poll_for(lambda: a._io._io.locked(), 10, "the waiting pull to drive the sockets")
    started = time.monotonic()
    a.close()
    waiter.join(10)
    assert not waiter.is_alive() and isinstance(outcome.get("error"), StoreClosedError)
    assert time.monotonic() - started < a._cfg.shutdown_timeout + 2

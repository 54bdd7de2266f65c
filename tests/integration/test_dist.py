"""dist_sync / dist_async semantics through real scheduler and server processes."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.partition import placement
from tests.helpers import run_parallel

from .conftest import Cluster, unique_int_key, unique_key

BOUND = 1000  # the clusters' KVSTORE_BIGARRAY_BOUND: values with >= 1000 elements are split


def _triangle(w: int) -> float:
    return w * (w + 1) / 2


@pytest.mark.parametrize("size", [7, BOUND - 1, BOUND, 3 * BOUND + 1], ids=["small", "below", "at", "above"])
@pytest.mark.parametrize("keykind", ["int", "str"])
def test_sync_push_sums_every_worker(sync_cluster: Cluster, size: int, keykind: str) -> None:
    """W workers pushing ones*(rank+1) pull W(W+1)/2, whole or split, for int and str keys."""
    key = unique_int_key() if keykind == "int" else unique_key()
    shape = (size,) if size % 2 else (2, size // 2)
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(key, np.zeros(shape, np.float32))
        kv.push(key, np.ones(shape, np.float32) * (kv.rank + 1))
        return kv.pull(key)

    for out in sync_cluster.run(work):
        assert out.shape == shape and out.dtype == np.float32
        np.testing.assert_array_equal(out, np.full(shape, _triangle(W), np.float32))
    pieces = placement(key, size, sync_cluster.num_servers, sync_cluster.workers[0]._cluster.seed, BOUND)
    assert len(pieces) == (sync_cluster.num_servers if size >= BOUND else 1)


def test_sync_rounds_assign_not_accumulate(sync_cluster: Cluster) -> None:
    """Each dist_sync round stores that round's sum, replacing the previous value."""
    key = unique_key()
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(key, np.full(5, 100.0))
        seen = []
        for step in range(1, 4):
            kv.push(key, np.full(5, float(step * (kv.rank + 1))))
            seen.append(float(kv.pull(key)[0]))
        return seen

    for seen in sync_cluster.run(work):
        assert seen == [step * _triangle(W) for step in range(1, 4)]


def test_second_push_waits_for_next_round(sync_cluster: Cluster) -> None:
    """Two pushes from a worker before a pull land in two rounds; the pull sees the second."""
    key = unique_key()
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(key, np.zeros(3))
        kv.push(key, np.full(3, kv.rank + 1.0))
        kv.push(key, np.full(3, 10.0 * (kv.rank + 1)))
        return kv.pull(key)

    for out in sync_cluster.run(work):
        np.testing.assert_array_equal(out, np.full(3, 10 * _triangle(W)))


def test_list_push_is_summed_and_many_keys(sync_cluster: Cluster) -> None:
    """A list of values for one key is summed; lists of keys push and pull together."""
    keys = [unique_key() for _ in range(3)]
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(keys, [np.zeros((2, 2), np.float64)] * 3)
        kv.push(keys, [[np.ones((2, 2)), np.ones((2, 2))], np.ones((2, 2)), np.full((2, 2), 3.0)])
        outs = [np.empty((2, 2)) for _ in keys]
        kv.pull(keys, out=outs)
        return [o[0, 0] for o in outs]

    for got in sync_cluster.run(work):
        assert got == [2 * W, W, 3 * W]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
def test_dtypes_round_trip(sync_cluster: Cluster, dtype: str) -> None:
    """Every supported dtype is stored, summed and pulled without conversion."""
    key = unique_key()
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(key, np.zeros(4, dtype))
        kv.push(key, np.arange(4).astype(dtype))
        return kv.pull(key)

    for out in sync_cluster.run(work):
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, (np.arange(4) * W).astype(dtype))


def test_int_and_str_keys_never_collide(sync_cluster: Cluster) -> None:
    """3, '3', 2, 2**32 + 2 and 2**64 - 1 are five different keys."""
    keys = [3 + 7_000_000, str(3 + 7_000_000), 2, 2**32 + 2, 2**64 - 1]

    def work(kv):
        if 2 in kv._meta:  # another parametrisation of this module's cluster already used them
            return [int(kv.pull(k)[0]) for k in keys]
        kv.init(keys, [np.full(1, i, np.int64) for i in range(len(keys))])
        return [int(kv.pull(k)[0]) for k in keys]

    for got in sync_cluster.run(work):
        assert got == list(range(len(keys)))


def test_pushpull_and_broadcast(sync_cluster: Cluster) -> None:
    """pushpull writes the round's sum in place (or into out); broadcast gives rank 0's value."""
    key, bkey = unique_key(), unique_key()
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(key, np.zeros(6, np.float32))
        value = np.ones(6, np.float32) * (kv.rank + 1)
        kv.pushpull(key, value)
        out = np.empty(6, np.float32)
        kv.pushpull(key, np.ones(6, np.float32), out=out)
        got = kv.broadcast(bkey, np.full(4, float(kv.rank + 5)))
        return value, out, got

    for value, out, got in sync_cluster.run(work):
        np.testing.assert_array_equal(value, np.full(6, _triangle(W), np.float32))
        np.testing.assert_array_equal(out, np.full(6, float(W), np.float32))
        np.testing.assert_array_equal(got, np.full(4, 5.0))


def test_torch_tensors(sync_cluster: Cluster) -> None:
    """CPU tensors push and pull; a key initialised with a tensor pulls a tensor; out is filled."""
    torch = pytest.importorskip("torch")
    key = unique_key()
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(key, torch.zeros(2, 3))
        grad = torch.ones(3, 2).t() * (kv.rank + 1)  # non-contiguous
        kv.push(key, grad)
        out = torch.empty(2, 3)
        kv.pull(key, out=out)
        return kv.pull(key), out, grad

    for pulled, out, _ in sync_cluster.run(work):
        assert isinstance(pulled, torch.Tensor)
        assert torch.equal(pulled, torch.full((2, 3), _triangle(W)))
        assert torch.equal(out, pulled)


def test_pushed_value_is_never_written(sync_cluster: Cluster) -> None:
    """The array a worker pushed keeps its contents after pulls (unlike MXNet)."""
    key = unique_key()

    def work(kv):
        kv.init(key, np.zeros(2000, np.float32))  # split over the servers
        grad = np.full(2000, kv.rank + 1.0, np.float32)
        kv.push(key, grad)
        kv.pull(key)
        return grad, kv.rank

    for grad, rank in sync_cluster.run(work):
        np.testing.assert_array_equal(grad, np.full(2000, rank + 1.0, np.float32))


def test_async_applies_each_push(async_cluster: Cluster) -> None:
    """dist_async assigns each push on arrival: a worker's own pull sees its own push."""
    key = unique_key()

    def work(kv):
        kv.init(key, np.zeros(3000, np.float32))
        kv.barrier()
        kv.push(key, np.full(3000, kv.rank + 1.0, np.float32))
        mine = kv.pull(key)
        kv.barrier()
        return mine, kv.pull(key), kv.rank

    results = async_cluster.run(work)
    valid = {r + 1.0 for r in range(async_cluster.num_workers)}
    finals = [final for _, final, _ in results]
    for final in finals[1:]:
        np.testing.assert_array_equal(final, finals[0])  # after the barrier all see the same
    seed = async_cluster.workers[0]._cluster.seed
    for piece in placement(key, 3000, async_cluster.num_servers, seed, BOUND):
        # each server's slice holds whichever push reached that server last
        assert set(finals[0][piece.start:piece.stop].tolist()) <= valid
        assert len(set(finals[0][piece.start:piece.stop].tolist())) == 1
    for mine, _, _ in results:
        assert set(mine.tolist()) <= valid
    if async_cluster.num_workers == 1:
        np.testing.assert_array_equal(results[0][0], np.full(3000, 1.0, np.float32))


def test_async_pushpull(async_cluster: Cluster) -> None:
    """dist_async pushpull returns a value that includes this worker's push at its arrival."""
    key = unique_key()

    def work(kv):
        kv.init(key, np.zeros(4, np.int64))
        out = kv.pushpull(key, np.full(4, kv.rank + 1, np.int64), out=np.empty(4, np.int64))
        return out

    valid = {r + 1 for r in range(async_cluster.num_workers)}
    for out in async_cluster.run(work):
        assert int(out[0]) in valid and len(set(out.tolist())) == 1


def test_properties(sync_cluster: Cluster) -> None:
    """rank, num_workers, num_servers and type describe the cluster."""
    ranks = sync_cluster.run(lambda kv: (kv.rank, kv.num_workers, kv.num_servers, kv.type))
    assert ranks == [(r, sync_cluster.num_workers, sync_cluster.num_servers, "dist_sync")
                     for r in range(sync_cluster.num_workers)]


def test_threads_share_one_store(sync_cluster: Cluster) -> None:
    """Several threads of each worker push and pull their own keys on one store concurrently."""
    keys = [unique_key() for _ in range(4)]
    W = sync_cluster.num_workers

    def work(kv):
        kv.init(keys, [np.zeros(1500, np.float32)] * len(keys))  # split over the servers

        def one(i: int) -> float:
            for step in range(1, 4):
                kv.push(keys[i], np.full(1500, float(step * (i + 1)), np.float32))
                out = kv.pull(keys[i])
            assert len(set(out.tolist())) == 1
            return float(out[0])

        return run_parallel([lambda i=i: one(i) for i in range(len(keys))])

    for got in sync_cluster.run(work):
        assert got == [3.0 * (i + 1) * W for i in range(len(keys))]


def test_a_server_binds_the_port_it_is_given(make_cluster) -> None:
    """KVSTORE_NODE_PORT (a port a cluster manager chose) is the port the server binds and registers."""
    import socket

    with socket.socket() as probe:  # a port free right now; the server binds it a moment later
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cluster = make_cluster(num_workers=1, num_servers=1, KVSTORE_NODE_PORT=port)
    kv = cluster.workers[0]
    assert list(kv._cluster.servers) == [f"tcp://127.0.0.1:{port}"]
    kv.init("p", np.ones(3, np.float32))
    assert (kv.pull("p") == 1).all()

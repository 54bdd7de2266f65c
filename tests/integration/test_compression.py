"""Gradient compression on real processes (2 workers, 2 servers, in-process workers): element for element
as the reference (a worker's list summed, quantised once, its residual kept by the worker; servers
dequantise then sum), collective and refused after the first push, malformed payloads refused with state
untouched."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import compression as C
from kvstore.errors import ConfigError, DTypeMismatchError, KVStoreError, ProtocolError
from kvstore.net.protocol import Message, Op
from tests import compression_ref as ref

from .conftest import Cluster, insider, unique_key

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind,threshold", [("2bit", 0.5), ("1bit", 0.0)])
def test_dist_sync_2w2s_matches_the_reference(make_cluster, kind: str, threshold: float) -> None:
    """A big key (sliced over both servers, chunked) and small batched keys, 3 rounds, two values per push."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=100, KVSTORE_CHUNK_BYTES="1024")
    big, smalls = unique_key(), [unique_key() for _ in range(3)]
    sizes = {big: 3000, **{k: 7 + i for i, k in enumerate(smalls)}}
    cluster.run(lambda kv: kv.set_gradient_compression({"type": kind, "threshold": threshold}))
    cluster.run(lambda kv: kv.init(list(sizes), [np.zeros(n, np.float32) for n in sizes.values()]))
    rng = np.random.default_rng(7)
    residual = {(w, k): np.zeros(n, np.float32) for w in range(2) for k, n in sizes.items()}
    keys = list(sizes)

    def push(kv, grads: dict, step: int) -> list:
        values = [list(grads[kv.rank, k]) for k in keys]
        if step == 2:  # pushpull too
            kv.pushpull(keys, values, out=[np.empty(sizes[k], np.float32) for k in keys])
        else:
            kv.push(keys, values)
        return kv.pull(keys)

    for step in range(3):
        grads = {(w, k): (rng.standard_normal((2, n)) * 0.7).astype(np.float32)
                 for w in range(2) for k, n in sizes.items()}
        pulled = cluster.run(lambda kv, g=grads, s=step: push(kv, g, s))
        for i, k in enumerate(keys):
            want = sum(ref.roundtrip(kind, grads[w, k][0] + grads[w, k][1], residual[w, k], threshold)
                       for w in range(2))
            for got in pulled:
                assert got[i].tobytes() == want.astype(np.float32).tobytes(), (step, k)
    kv0 = cluster.workers[0]
    assert kv0.get_gradient_compression() == {"type": kind, "threshold": threshold}
    np.testing.assert_array_equal(kv0._compress.residuals[big], residual[0, big])
    sent = kv0.stats()
    assert sent  # the worker's counters saw compressed bytes (benchmarks/compression.py measures them)


def test_collective_refusals(make_cluster) -> None:
    """A bad setting on one worker fails it on every worker; after a push it is refused everywhere;
    a non-float32 key is refused at push."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1)
    a, b = cluster.workers

    def bad_on_one(kv) -> str:
        try:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.5 if kv.rank else 0})
        except (ValueError, KVStoreError) as exc:  # its own ValueError, or the other's failure
            return type(exc).__name__
        return "ok"
    assert cluster.run(bad_on_one) == ["ValueError", "RemoteError"]
    assert a.get_gradient_compression() is None and b.get_gradient_compression() is None
    key, other = unique_key(), unique_key()
    cluster.run(lambda kv: kv.set_gradient_compression({"type": "2bit", "threshold": 1.0}))
    cluster.run(lambda kv: kv.init([key, other], [np.zeros(4, np.float32), np.zeros(4)]))
    with pytest.raises(DTypeMismatchError, match="float32 values only"):
        a.push(other, np.ones(4))
    a.push(key, np.full(4, 1.5, np.float32))
    b.push(key, np.full(4, -0.2, np.float32))
    np.testing.assert_array_equal(a.pull(key), np.full(4, 1.0, np.float32))

    def again(kv) -> str:
        try:
            kv.set_gradient_compression({"type": "1bit"})
        except ConfigError as exc:
            return str(exc)
        return "ok"
    messages = cluster.run(again)
    assert all("before the first push" in m for m in messages), messages


def test_malformed_compressed_payloads_are_refused_with_state_untouched(make_cluster) -> None:
    import zmq

    cluster: Cluster = make_cluster("dist_async", 1, 1)
    (kv,) = cluster.workers
    key = unique_key()
    kv.init(key, np.full(40, 3.0, np.float32))
    sealer = insider(kv, "compressor")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kv._cluster.servers[0])
    words = C.quantise("2bit", np.ones(40, np.float32), np.zeros(40, np.float32), 0.5)
    bodies = [({"compression": ["3bit", 0.5]}, words), ({"compression": ["2bit", 0]}, words),
              ({"compression": ["2bit", float("nan")]}, words), ({"compression": "2bit"}, words),
              ({"compression": ["2bit", 0.5]}, words[:2]),  # 40 values need 3 words
              ({"compression": ["2bit", 0.5]}, words.view(np.int32)),
              ({"compression": ["fp16", 0.0]}, np.ones(40, np.float32)),
              ({"compression": ["2bit", 0.5], "sizes": [-1]}, words)]
    try:
        for seq, (extra, array) in enumerate(bodies, 1):
            body = {"keys": [key], "sizes": [40], **extra}
            msg = Message(Op.PUSH, body, [array], seq=seq, sender=0)
            sock.send_multipart(sealer.seal(msg, "server0"))
            assert sock.poll(10_000), "the server did not answer"
            reply = sealer.open(sock.recv_multipart())
            assert reply.op is Op.ERROR and reply.body["code"] == ProtocolError.__name__, (extra, reply.body)
    finally:
        sock.close()
    np.testing.assert_array_equal(kv.pull(key), np.full(40, 3.0, np.float32))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.push(key, np.ones(40, np.float32))
    np.testing.assert_array_equal(kv.pull(key), np.full(40, 0.5, np.float32))


@pytest.mark.parametrize("kind,feedback", [("fp16", False), ("bf16", True)])
def test_half_precision_pushes_2w2s(make_cluster, kind: str, feedback: bool) -> None:
    """fp16 / bf16 pushes (torch's rounding as the reference), with error feedback kept per worker;
    servers sum in fp32."""
    torch = pytest.importorskip("torch")
    half = torch.float16 if kind == "fp16" else torch.bfloat16
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=100)
    key, n = unique_key(), 500
    cluster.run(lambda kv: kv.set_gradient_compression({"type": kind, "error_feedback": feedback}))
    cluster.run(lambda kv: kv.init(key, np.zeros(n, np.float32)))
    residual = [torch.zeros(n), torch.zeros(n)]
    rng = np.random.default_rng(3)
    for step in range(3):
        grads = (rng.standard_normal((2, n)) * 10).astype(np.float32)
        pulled = cluster.run(lambda kv, g=grads: (kv.push(key, g[kv.rank]), kv.pull(key))[1])
        want = torch.zeros(n)
        for w in range(2):
            value = torch.from_numpy(grads[w]) + (residual[w] if feedback else 0)
            sent = value.to(half).float()
            if feedback:
                residual[w] = value - sent
            want += sent
        for got in pulled:
            assert got.tobytes() == want.numpy().tobytes(), step


def test_residuals_are_saved_per_rank_and_restored_for_the_same_worker_count(make_cluster, tmp_path,
                                                                             caplog) -> None:
    snap = tmp_path / "snap"
    key = unique_key()
    first: Cluster = make_cluster("dist_sync", 2, 1)
    first.run(lambda kv: kv.set_gradient_compression({"type": "2bit", "threshold": 1.0}))
    first.run(lambda kv: kv.init(key, np.zeros(20, np.float32)))
    first.run(lambda kv: kv.push(key, np.linspace(-0.9, 0.9 + kv.rank, 20, dtype=np.float32)))
    first.run(lambda kv: kv.save_checkpoint(str(snap)))
    saved = [kv._compress.residuals[key].copy() for kv in first.workers]
    assert any(s.any() for s in saved)
    again: Cluster = make_cluster("dist_sync", 2, 1, connect=False)
    again.connect(resume=str(snap))
    again.run(lambda kv: kv.set_gradient_compression({"type": "2bit", "threshold": 1.0}))
    for kv, residual in zip(again.workers, saved):
        assert kv._compress.residuals[key].tobytes() == residual.tobytes()
    fewer: Cluster = make_cluster("dist_sync", 1, 1, connect=False)
    (kv,) = fewer.connect(resume=str(snap))
    with caplog.at_level("WARNING", logger="kvstore.dist"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
    assert kv._compress.residuals == {}
    assert "saved by [2] worker(s), this cluster has 1: they are dropped" in caplog.text

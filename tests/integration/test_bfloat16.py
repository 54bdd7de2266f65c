"""bfloat16 torch tensors through a real dist_sync cluster (2 workers, 2 servers): fp32 on servers."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore.core import checkpoint, precision, snapshot
from kvstore.core import optimizer as kvopt
from kvstore.core.dtypes import BF16
from kvstore.errors import DTypeMismatchError
from kvstore.net.protocol import Message, Op

from .conftest import Cluster, insider

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(60)
SIZE = 1500  # over the bound: split across both servers


def _grad(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(SIZE, generator=gen).to(torch.bfloat16)


def test_dist_sync_bf16_sum_and_sgd_use_fp32_masters(make_cluster) -> None:
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=1000)
    w0 = torch.linspace(-1, 1, SIZE).to(torch.bfloat16)

    def plain(kv) -> torch.Tensor:
        zeros = [torch.zeros(n, dtype=torch.bfloat16) for n in (SIZE, 3)]
        kv.init(["s", "small"], zeros)
        kv.push("s", _grad(0, kv.rank))
        return kv.pull("s")

    for got in cluster.run(plain):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, (_grad(0, 0).float() + _grad(0, 1).float()).to(torch.bfloat16))

    def trained(kv) -> torch.Tensor:
        kv.init("w", w0)
        kv.set_optimizer(kvopt.create("sgd", learning_rate=0.01))
        for step in range(3):
            kv.push("w", _grad(step, kv.rank))
        return kv.pull("w")

    master = w0.float()
    for step in range(3):
        master -= 0.01 * (_grad(step, 0).float() + _grad(step, 1).float())
    for got in cluster.run(trained):
        assert torch.equal(got, master.to(torch.bfloat16))


def test_dist_states_and_checkpoint_of_bf16_keys_match_local(make_cluster, tmp_path) -> None:
    """A dist store saves a bfloat16 key's adam states (and snapshot) as the local store does: a
    bfloat16 entry of float32 moments, equal to the local run's; the file loads back.  Rank 1
    pushes zeros, so each round's sum is exact in bfloat16 in both stores."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=1000)
    zero = torch.zeros(SIZE, dtype=torch.bfloat16)
    w0 = torch.linspace(-1, 1, SIZE).to(torch.bfloat16)
    spec = {"learning_rate": 0.01}
    path = tmp_path / "states"

    def trained(kv) -> None:
        kv.init("w", w0)
        kv.set_optimizer(kvopt.create("adam", **spec))
        for step in range(2):
            kv.push("w", zero if kv.rank else _grad(step, 0))
        kv.save_optimizer_states(str(path))
        kv.save_checkpoint(str(tmp_path / "ck"))
        kv.load_optimizer_states(str(path))

    cluster.run(trained)
    local = kvstore.create("local")
    local.init("w", w0)
    local.set_optimizer(kvopt.create("adam", **spec))
    for step in range(2):
        local.push("w", [_grad(step, 0), zero])
    local.save_optimizer_states(str(tmp_path / "local"))
    (dist,) = checkpoint.read_states(path).entries
    (mine,) = checkpoint.read_states(tmp_path / "local").entries
    assert dist.dtype == mine.dtype == BF16 and dist.count == mine.count
    for name, array in mine.arrays.items():
        np.testing.assert_array_equal(dist.arrays[name], array)
    values, states = snapshot.read(str(tmp_path / "ck"))
    assert values["w"].dtype == BF16 and states.entries[0].dtype == BF16
    np.testing.assert_array_equal(values["w"].view(np.uint16),
                                  precision.from_tensor(local.pull("w")).view(np.uint16))


def test_server_refuses_float32_push_to_bf16_key(make_cluster) -> None:
    """A push of float32 values to a bfloat16 key (which the client never sends) is refused by the
    server with DTypeMismatchError, and the key keeps its value."""
    import zmq

    cluster: Cluster = make_cluster("dist_async", 1, 1)
    (kv,) = cluster.workers
    w0 = torch.linspace(-1, 1, 40).to(torch.bfloat16)
    kv.init("b", w0)
    kv.init("f", np.zeros(40, np.float32))
    sealer = insider(kv, "precision")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kv._cluster.servers[0])
    sends = [("b", np.ones(40, np.float32)), ("f", precision.narrow(np.ones(40, np.float32)))]
    try:
        for seq, (key, array) in enumerate(sends, 1):
            msg = Message(Op.PUSH, {"keys": [key], "sizes": [40]}, [array], seq=seq, sender=0)
            sock.send_multipart(sealer.seal(msg, "server0"))
            assert sock.poll(10_000), "the server did not answer"
            reply = sealer.open(sock.recv_multipart())
            assert reply.op is Op.ERROR and reply.body["code"] == DTypeMismatchError.__name__, reply.body
    finally:
        sock.close()
    assert torch.equal(kv.pull("b"), w0)
    np.testing.assert_array_equal(kv.pull("f"), np.zeros(40, np.float32))

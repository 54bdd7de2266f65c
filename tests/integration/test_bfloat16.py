"""bfloat16 torch tensors through a real dist_sync cluster (2 workers, 2 servers): fp32 on servers."""

from __future__ import annotations

import pytest

from kvstore.core import optimizer as kvopt

from .conftest import Cluster

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

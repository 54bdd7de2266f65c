"""The dist_*_device modes through real scheduler and server processes (MXNet's device scenario).

Each worker holds its values on several "devices": numpy arrays and CPU tensors
always, CUDA tensors (several on one GPU when it has one) where CUDA is there.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from tests.helpers import cuda_devices

from .conftest import Cluster, unique_key

BOUND = 1000  # the clusters' KVSTORE_BIGARRAY_BOUND: the "split" key has more elements
DEVICES = 2
KINDS = ["numpy", "cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _values(kind: str, shape: tuple[int, ...], fill: float, count: int) -> list:
    """``count`` values of ``shape`` filled with ``fill``, one per simulated device."""
    if kind == "numpy":
        return [np.full(shape, fill, np.float32) for _ in range(count)]
    import torch

    devices = cuda_devices(count) if kind == "cuda" else ["cpu"] * count
    return [torch.full(shape, fill, dtype=torch.float32, device=d) for d in devices]


def _host(value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.cpu().numpy()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [7, 2 * BOUND + 1], ids=["small", "split"])
def test_device_scenario_pulls_the_closed_form_on_every_device(make_cluster, kind: str, size: int) -> None:
    """W workers x 2 devices push ones*(rank+1) with sgd; every device and CPU out pulls the closed form."""
    cluster: Cluster = make_cluster("dist_sync_device", 3, 2, bound=BOUND)
    W, key, shape = cluster.num_workers, unique_key(), (size,)
    lr, rescale = 0.25, 0.5

    def work(kv):
        kv.init(key, _values(kind, shape, 1.0, 1)[0])
        kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=lr, rescale_grad=rescale))
        seen = []
        for _ in range(3):
            pushed = _values(kind, shape, kv.rank + 1.0, DEVICES)
            kv.push(key, pushed)
            outs = _values(kind, shape, np.nan, DEVICES)
            kv.pull(key, out=outs)
            seen.append([_host(o) for o in outs] + [_host(v) for v in pushed])
        cpu_outs = [np.empty(shape, np.float32) for _ in range(DEVICES)]
        kv.pushpull(key, _values(kind, shape, kv.rank + 1.0, DEVICES), out=cpu_outs)
        return seen, cpu_outs, kv.pull(key)

    for rank, (seen, cpu_outs, fresh) in enumerate(cluster.run(work)):
        for step, arrays in enumerate(seen, 1):
            want = 1.0 - lr * rescale * DEVICES * W * (W + 1) / 2 * step
            for out in arrays[:DEVICES]:
                np.testing.assert_array_equal(out, np.full(shape, want, np.float32))
            for pushed in arrays[DEVICES:]:  # what a device pushed is never written to
                np.testing.assert_array_equal(pushed, np.full(shape, rank + 1.0, np.float32))
        want = 1.0 - lr * rescale * DEVICES * W * (W + 1) / 2 * 4
        for out in cpu_outs:
            np.testing.assert_array_equal(out, np.full(shape, want, np.float32))
        assert type(fresh) is type(_values(kind, shape, 0.0, 1)[0])
        np.testing.assert_array_equal(_host(fresh), np.full(shape, want, np.float32))


@pytest.mark.parametrize("kind", ["numpy", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_async_device_applies_each_workers_sum(make_cluster, kind: str) -> None:
    """dist_async_device: each worker's device sum is applied on arrival; the total is the same."""
    cluster: Cluster = make_cluster("dist_async_device", 2, 2, bound=BOUND)
    key, shape = unique_key(), (2 * BOUND,)

    def work(kv):
        kv.init(key, _values(kind, shape, 0.0, 1)[0])
        kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
        kv.push(key, _values(kind, shape, kv.rank + 1.0, DEVICES))
        kv.barrier()
        outs = _values(kind, shape, np.nan, DEVICES)
        kv.pull(key, out=outs)
        return [_host(o) for o in outs]

    for outs in cluster.run(work):
        for out in outs:  # sgd with lr 1: w = 0 - (2*1 + 2*2)
            np.testing.assert_array_equal(out, np.full(shape, -6.0, np.float32))


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("uok", [True, False], ids=["update_on_kvstore", "update_per_device"])
def test_trainer_on_dist_sync_device_matches_one_local_model(make_cluster, kind: str, uok: bool) -> None:
    """2 workers x 2 replicas on dist_sync_device end with one local model's weights (global batches)."""
    import torch

    from kvstore.data import split
    from kvstore.trainer import Trainer
    from tests.unit.test_trainer_devices import (
        OPTIMIZERS,
        assert_replicas_equal,
        batches,
        replicas,
        train_replicated,
        train_single,
    )

    cluster: Cluster = make_cluster("dist_sync_device", 2, 2, bound=500)  # the 640-element weight splits
    rows, prefix = batches(5), unique_key("trainer")
    devices = cuda_devices(2) if kind == "cuda" else ["cpu", "cpu"]

    built = [replicas(devices) for _ in range(cluster.num_workers)]  # here: torch's seed is global

    def work(kv):
        models = built[kv.rank]
        trainer = Trainer([m.parameters() for m in models], "sgd", OPTIMIZERS["sgd"], kvstore=kv,
                          update_on_kvstore=uok, key_prefix=prefix)
        mine = [split(batch, kv.num_workers, kv.rank) for batch in rows]
        for batch, share in zip(rows, mine):  # step with the global batch size
            train_replicated(models, _Scaled(trainer, len(batch)), [share])
        return models

    reference = train_single("sgd", rows)
    for models in cluster.run(work):
        assert_replicas_equal(models)
        for a, b in zip(models[0].parameters(), reference.parameters()):
            a = a.detach().cpu()
            assert torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-5), (a - b).abs().max()


class _Scaled:
    """A trainer whose step always passes the global batch size."""

    def __init__(self, trainer, global_batch: int) -> None:
        self.trainer, self.global_batch = trainer, global_batch

    def step(self, _local: int) -> None:
        self.trainer.step(self.global_batch)


def test_create_with_a_device_name_turns_gpu_sums_on_for_the_shared_store(make_cluster, monkeypatch) -> None:
    """The process's dist store, made as dist_sync, becomes a device store when dist_sync_device is asked."""
    from kvstore.client import instance as dist
    from kvstore.client.store import DistKVStore, Owner

    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False)
    owner = Owner()
    store = DistKVStore("dist_sync", cluster.cfg, owner=owner)  # as create_dist makes it
    cluster.workers = [store]
    monkeypatch.setattr(dist, "_held", dist._Held(store, owner))
    assert dist.create_dist("dist_sync") is store and not store._device_mode
    assert dist.create_dist("dist_sync_device") is store and store._device_mode
    assert dist.create_dist("dist_sync") is store and store._device_mode and store.type == "dist_sync"

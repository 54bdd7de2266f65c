"""The 'device' store and kvstore.device: CPU values behave as in 'local'; CUDA values are summed,
stored and updated on a GPU (those tests are marked ``cuda`` and skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore import device as D
from kvstore.base import DEVICE_TYPES
from kvstore.core import optimizer as O
from kvstore.errors import DTypeMismatchError, ShapeMismatchError
from kvstore.stores import KNOWN_TYPES
from tests.helpers import cuda_devices


def _script(kv) -> list[np.ndarray]:
    """A fixed sequence of store calls with numpy and CPU-tensor values; returns what it pulled."""
    rng = np.random.default_rng(7)
    seen = []
    kv.init(["a", 3], [np.zeros((4, 3), np.float32), torch.zeros(5, dtype=torch.float64)])
    for _ in range(3):
        grads = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3)]
        kv.push("a", [grads[0], torch.from_numpy(grads[1]), grads[2]])
        kv.push(3, [torch.ones(5, dtype=torch.float64)] * 2)
        seen += [kv.pull("a"), kv.pull(3).numpy()]
    kv.set_optimizer(O.create("adam", learning_rate=0.1, wd=0.01))
    for _ in range(3):
        out = np.empty((4, 3), np.float32)
        kv.pushpull("a", rng.standard_normal((4, 3)).astype(np.float32), out=out)
        seen.append(out)
    return seen


def test_device_names_are_the_device_modes() -> None:
    """Every *_device name and MXNet's device aliases are device modes; the others are not."""
    assert DEVICE_TYPES <= set(KNOWN_TYPES)
    assert {"device", "dist_sync_device", "dist_async_device", "dist_device_sync", "dist_device_async",
            "local_allreduce_device"} == DEVICE_TYPES
    assert kvstore.create("device")._device_mode and not kvstore.create("local")._device_mode


@pytest.mark.parametrize("name", ["device", "local_allreduce_device"])
def test_device_store_on_cpu_values_acts_exactly_like_local(name: str) -> None:
    """Without CUDA values a device store gives bit-identical results to 'local' and never makes a comm."""
    device, local = kvstore.create(name), kvstore.create("local")
    for got, want in zip(_script(device), _script(local), strict=True):
        np.testing.assert_array_equal(got, want)
    assert device._comm is None  # torch.cuda was never needed


def test_device_store_mixed_numpy_and_tensor_values_sum() -> None:
    """numpy arrays and CPU tensors pushed together for one key are summed."""
    kv = kvstore.create("device")
    kv.init(1, np.zeros(3, np.float32))
    kv.push(1, [np.ones(3, np.float32), torch.full((3,), 2.0), np.full(3, 4.0, np.float32)])
    np.testing.assert_array_equal(kv.pull(1), np.full(3, 7.0, np.float32))


def test_device_store_rejects_bad_values_and_keeps_state() -> None:
    """Sparse or bfloat16 tensors and wrong shapes raise clear errors; the stored value is unchanged."""
    kv = kvstore.create("device")
    kv.init(1, np.arange(3, dtype=np.float32))
    with pytest.raises(TypeError, match="dense"):
        kv.push(1, torch.zeros(3).to_sparse())
    with pytest.raises(DTypeMismatchError):
        kv.push(1, torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ShapeMismatchError):
        kv.push(1, [np.zeros(3, np.float32), torch.zeros(4)])
    np.testing.assert_array_equal(kv.pull(1), np.arange(3, dtype=np.float32))


def test_merge_placement_picks_the_least_loaded_device_and_keeps_it() -> None:
    """Each key's merge device is the least-loaded of its pushers' devices at first use, then fixed."""
    place = D.MergePlacement()
    gpus = [torch.device("cuda", i) for i in range(3)]
    assert place.device("big", 100, gpus) == gpus[0]  # a tie goes to the lowest index
    assert place.device("mid", 60, gpus) == gpus[1]
    assert place.device("small", 10, gpus[:2]) == gpus[1]  # 60 < 100 on the devices it pushes from
    assert place.device("big", 100, gpus[1:]) == gpus[0]  # fixed at first use
    assert place.device("other", 5, gpus) == gpus[2]
    assert place.loads() == {"cuda:0": 100, "cuda:1": 70, "cuda:2": 5}


def test_as_tensor_shares_or_copies_numpy() -> None:
    """as_tensor shares a writable contiguous array and copies a read-only or strided one."""
    a = np.zeros(4, np.float32)
    assert D.as_tensor(a).data_ptr() == a.ctypes.data
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    assert D.as_tensor(frozen).data_ptr() != frozen.ctypes.data
    np.testing.assert_array_equal(D.as_tensor(np.arange(8.0)[::2]).numpy(), [0.0, 2.0, 4.0, 6.0])


# -- CUDA -------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_reduce_sums_on_the_gpu_exactly_like_numpy() -> None:
    """A GPU reduce of CUDA, CPU-tensor and numpy values equals numpy's sum bit for bit."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((64, 33)).astype(np.float32) for _ in range(4)]
    devs = cuda_devices(2)
    values = [torch.from_numpy(arrays[0]).to(devs[0]), torch.from_numpy(arrays[1]).to(devs[1]),
              torch.from_numpy(arrays[2]), arrays[3]]
    kv = kvstore.create("device")
    kv.init("k", np.zeros((64, 33), np.float32))
    total = kv._device().reduce("k", kv._meta["k"], values)
    assert total.device.type == "cuda"
    np.testing.assert_array_equal(total.cpu().numpy(), arrays[0] + arrays[1] + arrays[2] + arrays[3])
    np.testing.assert_array_equal(values[0].cpu().numpy(), arrays[0])  # inputs untouched


@pytest.mark.cuda
@pytest.mark.parametrize("name,params", [("sgd", {"momentum": 0.9, "wd": 0.01}), ("adam", {"wd": 0.01}),
                                         ("rmsprop", {"centered": True})])
def test_device_store_updates_on_the_gpu_like_local(name: str, params: dict) -> None:
    """The device store moves a key to its GPU and runs the optimizer there, matching 'local' on CPU."""
    rng = np.random.default_rng(1)
    devs = cuda_devices(2)
    device, local = kvstore.create("device"), kvstore.create("local")
    init = rng.standard_normal((16, 8)).astype(np.float32)
    for kv in (device, local):
        kv.init("w", torch.from_numpy(init.copy()))
        kv.set_optimizer(O.create(name, learning_rate=0.05, **params))
    for _ in range(4):
        grads = [rng.standard_normal((16, 8)).astype(np.float32) for _ in devs]
        device.push("w", [torch.from_numpy(g).to(d) for g, d in zip(grads, devs)])
        local.push("w", [torch.from_numpy(g) for g in grads])
    assert device._store["w"].device.type == "cuda"  # the store lives on the GPU now
    assert all(a.device.type == "cuda" for a in device.get_optimizer().states["w"].values())
    outs = [torch.full((16, 8), float("nan"), device=d) for d in devs] + [np.empty((16, 8), np.float32)]
    device.pull("w", out=outs)
    want = local.pull("w").numpy()
    for out in outs:
        np.testing.assert_allclose(out if isinstance(out, np.ndarray) else out.cpu().numpy(), want,
                                   rtol=1e-5, atol=1e-6)
    fresh = device.pull("w")
    assert isinstance(fresh, torch.Tensor) and fresh.device.type == "cpu"  # initialised from a CPU tensor


@pytest.mark.cuda
def test_device_store_cpu_push_after_gpu_and_state_round_trip(tmp_path) -> None:
    """CPU values reach a key on the GPU; states saved from the GPU load back and continue alike."""
    dev = cuda_devices(1)[0]
    kv = kvstore.create("device")
    kv.init("w", torch.zeros(5, device=dev))
    kv.set_optimizer(O.create("sgd", learning_rate=0.1, momentum=0.9))
    kv.push("w", torch.ones(5, device=dev))
    kv.push("w", np.ones(5, np.float32))  # numpy after the key moved to the GPU
    kv.save_optimizer_states(tmp_path / "s", dump_optimizer=True)
    other = kvstore.create("device")
    other.init("w", kv.pull("w"))
    other.load_optimizer_states(tmp_path / "s")
    for store in (kv, other):
        store.push("w", torch.ones(5, device=dev))
    fresh = kv.pull("w")
    assert fresh.device == torch.device(dev)  # initialised from a CUDA tensor: pulled onto its device
    np.testing.assert_allclose(fresh.cpu().numpy(), other.pull("w").cpu().numpy(), rtol=1e-6)


@pytest.mark.cuda
def test_to_host_lands_in_pinned_memory_and_deliver_fills_every_device() -> None:
    """to_host copies once into pinned memory; deliver writes numpy or GPU sources into every out."""
    devs = cuda_devices(3)
    comm = D.DeviceComm()
    src = torch.arange(1000, dtype=torch.float32, device=devs[0])
    host = comm.to_host(src)
    assert torch.from_numpy(host).is_pinned()
    np.testing.assert_array_equal(host, np.arange(1000, dtype=np.float32))
    for source in (host, src):
        outs = [torch.zeros(1000, device=d) for d in devs] + [np.zeros(1000, np.float32), torch.zeros(1000)]
        comm.deliver(source, outs)
        for out in outs:
            np.testing.assert_array_equal(out if isinstance(out, np.ndarray) else out.cpu().numpy(), host)


@pytest.mark.cuda
def test_pinned_cpu_value_may_change_once_push_returns() -> None:
    """A pinned CPU tensor pushed with GPU values is read before push returns."""
    dev = cuda_devices(1)[0]
    n = 1 << 24
    kv = kvstore.create("device")
    kv.init("k", torch.zeros(n))
    pinned = torch.ones(n).pin_memory()
    torch.cuda._sleep(50_000_000)  # keep the GPU busy so a late copy would see the change
    kv.push("k", [torch.ones(n, device=dev), pinned])
    pinned.fill_(100.0)
    assert torch.equal(kv.pull("k"), torch.full((n,), 2.0))


@pytest.mark.cuda
def test_threads_on_their_own_streams_share_a_device_store() -> None:
    """A pull on another thread's stream, after a push returned, sees that push's update."""
    import threading

    dev = cuda_devices(1)[0]
    n = 1 << 22
    kv = kvstore.create("device")
    kv.init("k", torch.zeros(n, device=dev))
    kv.set_optimizer(O.create("sgd", learning_rate=1.0))
    pushed = threading.Event()
    seen = []

    def pusher() -> None:
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            torch.cuda._sleep(50_000_000)
            kv.push("k", torch.full((n,), -5.0, device=dev))  # sgd with lr 1: w = 0 - (-5)
        pushed.set()

    def puller() -> None:
        assert pushed.wait(30)
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            out = torch.zeros(n, device=dev)
            kv.pull("k", out=out)
            seen.append(out.cpu())

    threads = [threading.Thread(target=pusher), threading.Thread(target=puller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(seen[0], torch.full((n,), 5.0))

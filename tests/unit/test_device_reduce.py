"""kvstore.device's one-call reduction: which call sums a key's values (choose_reduction), the stacked
sum on CPU against the CPU path, and on a GPU (tests marked ``cuda``, skipped without one) the one
call against the loop of additions it replaced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore import device as D
from kvstore.core import precision
from kvstore.core import values as V
from kvstore.core.dtypes import BF16
from tests.helpers import cuda_devices

CPU = torch.device("cpu")
GPU0, GPU1, GPU2 = (torch.device("cuda", i) for i in range(3))  # objects only: no CUDA needed


def _loop(values: list[torch.Tensor], device) -> torch.Tensor:
    """The reduction the device modes used before: a copy of the first value, then one ``+=`` per value."""
    total = values[0].to(device, copy=True)
    for value in values[1:]:
        total += value.to(device)
    return total


def _integral(rng: np.random.Generator, count: int, shape: tuple[int, ...]) -> list[np.ndarray]:
    """float32 arrays of small integers: every order of their sum is exact, so every order agrees."""
    return [rng.integers(-1000, 1000, shape).astype(np.float32) for _ in range(count)]


# -- choosing the call (pure) -----------------------------------------------------------------------

def test_one_value_is_copied_whatever_it_is() -> None:
    """A single value (numpy, CPU or CUDA tensor) is copied to the merge device, not reduced."""
    for place in (None, CPU, GPU1):
        assert D.choose_reduction([place], contiguous=True, nccl=True) is D.Reduction.COPY


def test_one_contiguous_tensor_per_gpu_with_nccl_takes_reduce_add() -> None:
    """Contiguous CUDA tensors on distinct GPUs, torch built with NCCL: one reduce_add (an NCCL reduce)."""
    assert D.choose_reduction([GPU0, GPU1], contiguous=True, nccl=True) is D.Reduction.REDUCE_ADD
    assert D.choose_reduction([GPU2, GPU0, GPU1], contiguous=True, nccl=True) is D.Reduction.REDUCE_ADD


@pytest.mark.parametrize("devices,contiguous,nccl", [
    ([GPU0, GPU0], True, True),  # replicas on one GPU: NCCL refuses two buffers on one device
    ([GPU0, GPU1, GPU0], True, True),  # two of three on one GPU
    ([GPU0, GPU1], True, False),  # no NCCL: reduce_add would loop over additions
    ([GPU0, GPU1], False, True),  # a strided tensor: NCCL needs contiguous buffers
    ([GPU0, CPU], True, True),  # a CPU tensor among them
    ([GPU0, None], False, True),  # a numpy array among them
    ([None, None, CPU], False, True),  # no GPU at all (a device store's sum of host values)
], ids=["replicas", "two-on-one", "no-nccl", "strided", "cpu-tensor", "numpy", "host-only"])
def test_anything_else_takes_the_stacked_sum(devices, contiguous: bool, nccl: bool) -> None:
    """Replicas on one GPU, host values, strided tensors or no NCCL: the stacked sum (one sum call)."""
    assert D.choose_reduction(devices, contiguous=contiguous, nccl=nccl) is D.Reduction.STACKED_SUM


# -- the stacked sum on CPU ------------------------------------------------------------------------

@pytest.mark.parametrize("count", [2, 3, 4, 7])
def test_stacked_sum_of_host_values_equals_the_cpu_path(count: int) -> None:
    """numpy and CPU-tensor values of exact sums: the stacked sum equals the CPU path's sum exactly."""
    rng = np.random.default_rng(count)
    arrays = _integral(rng, count, (5, 3))
    values = [a if i % 2 else torch.from_numpy(a) for i, a in enumerate(arrays)]
    meta = V.meta_of(arrays[0])
    total = D.stacked_sum(values, (5, 3), torch.float32, CPU)
    assert total.dtype == torch.float32 and total.shape == (5, 3)
    np.testing.assert_array_equal(total.numpy(), V.summed("k", meta, values))
    for value, array in zip(values, _integral(np.random.default_rng(count), count, (5, 3))):
        np.testing.assert_array_equal(value if isinstance(value, np.ndarray) else value.numpy(), array)


def test_stacked_sum_of_two_values_is_their_float_sum_bit_for_bit() -> None:
    """Two random float32 values sum to exactly ``a + b`` (one addition: every order agrees)."""
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    total = D.stacked_sum([a, torch.from_numpy(b)], (1000,), torch.float32, CPU)
    np.testing.assert_array_equal(total.numpy(), a + b)


@pytest.mark.parametrize("count", [3, 8])
def test_stacked_sum_of_random_values_is_the_loop_within_rounding(count: int) -> None:
    """Random float32 values: the stacked sum is the loop of additions within float32 rounding."""
    rng = np.random.default_rng(count)
    tensors = [torch.from_numpy(rng.standard_normal(4096).astype(np.float32)) for _ in range(count)]
    got = D.stacked_sum(tensors, (4096,), torch.float32, CPU)
    torch.testing.assert_close(got, _loop(tensors, CPU), rtol=1e-6, atol=1e-6 * count)


def test_stacked_sum_keeps_an_integer_dtype_and_wraps_like_numpy() -> None:
    """int32 values sum in int32 (torch's sum would widen to int64), wrapping as numpy's loop does."""
    big = np.full(4, 2**31 - 10, np.int32)
    values = [big, torch.from_numpy(big.copy()), np.arange(4, dtype=np.int32)]
    total = D.stacked_sum(values, (4,), torch.int32, CPU)
    assert total.dtype == torch.int32
    meta = V.meta_of(big)
    np.testing.assert_array_equal(total.numpy(), V.summed("k", meta, values))


def test_stacked_sum_of_bfloat16_rounds_once_like_the_cpu_path() -> None:
    """bfloat16 values (kvstore's, ml_dtypes' and tensors) sum in float32 and round once, as the CPU path."""
    rng = np.random.default_rng(5)
    tensors = [torch.from_numpy(rng.standard_normal(257).astype(np.float32)).bfloat16() for _ in range(3)]
    internal = precision.from_tensor(tensors[0].clone())  # kvstore's BF16 numpy array
    assert internal.dtype == BF16
    values = [internal, tensors[1], tensors[2]]
    got = D.stacked_sum(values, (257,), torch.bfloat16, CPU)
    want = precision.sum_bf16([precision.from_tensor(t) for t in tensors])
    np.testing.assert_array_equal(precision.from_tensor(got).view(np.uint16), want.view(np.uint16))


def test_as_tensor_turns_bfloat16_arrays_into_bfloat16_tensors() -> None:
    """kvstore's BF16 arrays (shared) and ml_dtypes' bfloat16 arrays become bfloat16 tensors."""
    tensor = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    internal = precision.from_tensor(tensor.clone())
    shared = D.as_tensor(internal)
    assert shared.dtype == torch.bfloat16 and shared.data_ptr() == internal.ctypes.data
    assert torch.equal(shared, tensor)
    pytest.importorskip("ml_dtypes")
    assert torch.equal(D.as_tensor(precision.for_user(internal)), tensor)


# -- CUDA --------------------------------------------------------------------------------------------

def _gpu_values(arrays: list[np.ndarray], devices: list[str]) -> list[torch.Tensor]:
    return [torch.from_numpy(a).to(d) for a, d in zip(arrays, devices)]


@pytest.mark.cuda
@pytest.mark.parametrize("count", [2, 3, 4, 6, 8])
def test_one_call_sum_of_replicas_on_one_gpu_equals_the_loop(count: int) -> None:
    """Replicas on one GPU: reduce (one stacked sum) equals the loop of additions on that GPU."""
    dev = cuda_devices(1)[0]
    kv = kvstore.create("device")
    kv.init("exact", np.zeros((64, 33), np.float32))
    kv.init("random", np.zeros((64, 33), np.float32))
    comm = kv._device()
    exact = _gpu_values(_integral(np.random.default_rng(count), count, (64, 33)), [dev] * count)
    assert D.choose_reduction([v.device for v in exact], True, True) is D.Reduction.STACKED_SUM
    total = comm.reduce("exact", kv._meta["exact"], exact)
    assert total.device == torch.device(dev) and all(total.data_ptr() != v.data_ptr() for v in exact)
    assert torch.equal(total, _loop(exact, dev))
    rng = np.random.default_rng(100 + count)
    arrays = [rng.standard_normal((64, 33)).astype(np.float32) for _ in range(count)]
    noisy = _gpu_values(arrays, [dev] * count)
    total = comm.reduce("random", kv._meta["random"], noisy)
    if count <= 4:  # torch's four accumulators per output add up to four values in list order
        assert torch.equal(total, _loop(noisy, dev))
    else:
        torch.testing.assert_close(total, _loop(noisy, dev), rtol=1e-6, atol=1e-5)


@pytest.mark.cuda
def test_one_call_sum_of_float16_replicas_rounds_once() -> None:
    """float16 replicas on one GPU sum in float32 and round once (the loop rounded at every addition)."""
    dev = cuda_devices(1)[0]
    rng = np.random.default_rng(9)
    arrays = [rng.standard_normal(4096).astype(np.float16) for _ in range(3)]
    kv = kvstore.create("device")
    kv.init("h", np.zeros(4096, np.float16))
    total = kv._device().reduce("h", kv._meta["h"], _gpu_values(arrays, [dev] * 3))
    assert total.dtype == torch.float16
    want = (arrays[0].astype(np.float32) + arrays[1] + arrays[2]).astype(np.float16)
    np.testing.assert_array_equal(total.cpu().numpy(), want)


@pytest.mark.cuda
def test_reduce_add_sums_one_tensor_per_gpu_like_the_loop() -> None:
    """One tensor per GPU (2+ GPUs): reduce_add's NCCL reduce equals the loop; the inputs stay as pushed."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2+ CUDA devices (one tensor per GPU)")
    count = torch.cuda.device_count()
    devs = [f"cuda:{i}" for i in range(count)]
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal((128, 65)).astype(np.float32) for _ in devs]
    values = _gpu_values(arrays, devs)
    kv = kvstore.create("device")
    kv.init("k", np.zeros((128, 65), np.float32))
    comm = kv._device()
    total = comm.reduce("k", kv._meta["k"], values)
    assert total.device == torch.device(comm.placement.device("k", 0, []))
    want = _loop(values, total.device)
    if count == 2:  # one addition: every order agrees
        assert torch.equal(total, want)
    else:
        torch.testing.assert_close(total, want, rtol=1e-6, atol=1e-5)
    for value, array in zip(values, arrays):
        np.testing.assert_array_equal(value.cpu().numpy(), array)


@pytest.mark.cuda
def test_deliver_stages_a_bfloat16_value_from_the_wire() -> None:
    """A bfloat16 value off the wire (kvstore's BF16 numpy) reaches a CUDA bfloat16 out unchanged."""
    dev = cuda_devices(1)[0]
    tensor = torch.arange(100, dtype=torch.float32).bfloat16()
    wire = precision.from_tensor(tensor.clone())
    out = torch.zeros(100, dtype=torch.bfloat16, device=dev)
    kvstore.create("device")._device().deliver(wire, [out])
    assert torch.equal(out.cpu(), tensor)

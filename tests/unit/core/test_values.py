"""Unit tests of kvstore.core.values: numpy arrays and torch tensors in, numpy out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore.core import values as V
from kvstore.errors import DTypeMismatchError, ShapeMismatchError


def meta(shape=(2, 3), dtype=np.float32, tensor=False) -> V.Meta:
    """A Meta built from an example value (so the test does not depend on Meta's field order)."""
    example = np.zeros(shape, dtype)
    return V.meta_of(torch.from_numpy(example) if tensor else example)


# -- recognising values -----------------------------------------------------------------------------

def test_is_value_accepts_arrays_and_tensors_only():
    """numpy arrays and torch tensors are values; lists, scalars and None are not."""
    assert V.is_value(np.zeros(2)) and V.is_value(torch.zeros(2))
    assert V.is_tensor(torch.zeros(2)) and not V.is_tensor(np.zeros(2))
    for other in ([1.0, 2.0], 1.0, np.float32(1), None, "x"):
        assert not V.is_value(other)


def test_as_array_of_numpy_is_the_same_object():
    """A numpy array is used as is (no copy)."""
    array = np.ones(3, np.float32)
    assert V.as_array(array) is array


def test_as_array_of_cpu_tensor_shares_memory():
    """A CPU tensor is viewed, not copied: writing the tensor shows in the array."""
    tensor = torch.zeros(3, dtype=torch.float64)
    array = V.as_array(tensor)
    tensor[1] = 7
    np.testing.assert_array_equal(array, [0, 7, 0])
    assert array.dtype == np.float64


def test_as_array_of_tensor_requiring_grad():
    """A leaf tensor with requires_grad is accepted (detached)."""
    tensor = torch.ones(2, requires_grad=True)
    np.testing.assert_array_equal(V.as_array(tensor), [1, 1])


@pytest.mark.parametrize("value", [np.zeros(2, bool), np.zeros(2, np.complex64), np.zeros(2, np.uint8),
                                   np.zeros(2, np.int16), torch.zeros(2, dtype=torch.bool),
                                   torch.zeros(2, dtype=torch.int8)], ids=lambda v: str(v.dtype))
def test_as_array_rejects_unsupported_dtypes(value):
    """Dtypes outside float16/32/64 and int32/64 raise DTypeMismatchError naming the supported ones."""
    with pytest.raises(DTypeMismatchError, match="float32"):
        V.as_array(value)


@pytest.mark.parametrize("value", [[1.0], 3.0, None, "abc"], ids=repr)
def test_as_array_rejects_non_values(value):
    """Anything but an array or tensor raises TypeError."""
    with pytest.raises(TypeError):
        V.as_array(value)


def test_meta_of_describes_shape_dtype_kind_and_size():
    """meta_of records shape, dtype, whether the value is a tensor, and its element count."""
    m = V.meta_of(np.zeros((2, 3, 4), np.int32))
    assert (m.shape, m.dtype, m.tensor, m.size) == ((2, 3, 4), np.dtype(np.int32), False, 24)
    t = V.meta_of(torch.zeros((5,), dtype=torch.float16))
    assert (t.shape, t.dtype, t.tensor, t.size) == ((5,), np.dtype(np.float16), True, 5)
    assert V.meta_of(np.zeros((), np.float64)).size == 1
    assert V.meta_of(np.zeros((4, 0), np.float64)).size == 0


# -- check / summed ---------------------------------------------------------------------------------

def test_check_accepts_a_matching_value():
    """A value of the initialised shape and dtype passes."""
    V.check("k", meta(), np.zeros((2, 3), np.float32), "pushed value")


def test_check_shape_mismatch_names_key_and_shapes():
    """A wrong shape raises ShapeMismatchError naming the key and both shapes."""
    with pytest.raises(ShapeMismatchError) as info:
        V.check("w", meta(), np.zeros((3, 2), np.float32), "pushed value")
    assert "'w'" in str(info.value) and "(3, 2)" in str(info.value) and "(2, 3)" in str(info.value)


def test_check_dtype_mismatch_names_both_dtypes():
    """A wrong dtype raises DTypeMismatchError naming both dtypes."""
    with pytest.raises(DTypeMismatchError) as info:
        V.check(3, meta(), np.zeros((2, 3), np.float64), "out")
    assert "float64" in str(info.value) and "float32" in str(info.value)


def test_dtype_mismatch_names_the_fix():
    """A float64 push into a float32 key (np.ones(shape)) is refused, naming the conversion to make:
    ``value.astype(np.float32)`` for an array, ``value.to(torch.float32)`` for a tensor, and the dtype
    an ``out`` must have."""
    with pytest.raises(DTypeMismatchError, match=r"push value\.astype\(np\.float32\) instead"):
        V.check(3, meta(), np.ones((2, 3)), "pushed value")
    with pytest.raises(DTypeMismatchError, match=r"push value\.to\(torch\.float32\) instead"):
        V.check(3, meta(), torch.ones((2, 3), dtype=torch.float64), "pushed value")
    with pytest.raises(DTypeMismatchError, match="pass an out of dtype float32"):
        V.check(3, meta(), np.ones((2, 3)), "out")


def test_summed_adds_all_values_into_a_new_c_array():
    """summed returns a new C-contiguous array with the sum; inputs are unchanged."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones((2, 3), np.float32)
    total = V.summed("k", meta(), [a, b, b])
    np.testing.assert_array_equal(total, [[2, 3, 4], [5, 6, 7]])
    assert total.flags.c_contiguous and total.flags.writeable
    assert not np.shares_memory(total, a)
    np.testing.assert_array_equal(a, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(b, np.ones((2, 3)))


def test_summed_of_one_value_is_a_copy():
    """A single value is copied, so the store never aliases the user's array."""
    a = np.ones((2, 3), np.float32)
    total = V.summed("k", meta(), [a])
    total += 1
    np.testing.assert_array_equal(a, np.ones((2, 3)))


def test_summed_of_non_contiguous_and_read_only_values():
    """Strided and read-only values sum correctly into a C-contiguous result."""
    base = np.arange(12, dtype=np.float32).reshape(2, 6)
    strided = base[:, ::2]
    frozen = np.full((2, 3), 10, np.float32)
    frozen.setflags(write=False)
    total = V.summed("k", meta(), [strided, frozen])
    np.testing.assert_array_equal(total, [[10, 12, 14], [16, 18, 20]])
    assert total.flags.c_contiguous


def test_summed_mixes_tensors_and_arrays():
    """Tensors and arrays for one key sum together; the tensor is unchanged."""
    t = torch.ones(2, 3)
    total = V.summed("k", meta(), [t, np.full((2, 3), 2, np.float32)])
    np.testing.assert_array_equal(total, np.full((2, 3), 3))
    assert torch.equal(t, torch.ones(2, 3))


def test_summed_checks_every_value():
    """A bad second value raises even when the first fits."""
    with pytest.raises(ShapeMismatchError):
        V.summed("k", meta(), [np.zeros((2, 3), np.float32), np.zeros(6, np.float32)])


# -- out handling -----------------------------------------------------------------------------------

def test_check_out_rejects_read_only_array():
    """A read-only out raises ValueError saying so."""
    out = np.zeros((2, 3), np.float32)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        V.check_out("k", meta(), out)


def test_check_out_rejects_wrong_shape_and_dtype():
    """An out of the wrong shape or dtype raises the matching error."""
    with pytest.raises(ShapeMismatchError):
        V.check_out("k", meta(), np.zeros(6, np.float32))
    with pytest.raises(DTypeMismatchError):
        V.check_out("k", meta(), torch.zeros((2, 3), dtype=torch.float64))


def test_write_into_array_and_strided_array():
    """write copies values into a numpy out in place, strided outs included."""
    out = np.zeros((2, 3), np.int64)
    V.write(out, np.arange(6, dtype=np.int64).reshape(2, 3))
    np.testing.assert_array_equal(out, [[0, 1, 2], [3, 4, 5]])
    big = np.zeros((2, 6), np.int64)
    V.write(big[:, 1::2], np.arange(6, dtype=np.int64).reshape(2, 3))
    np.testing.assert_array_equal(big, [[0, 0, 0, 1, 0, 2], [0, 3, 0, 4, 0, 5]])


def test_write_into_tensor_keeps_the_tensor_object():
    """write fills a tensor (even a transposed one) in place."""
    out = torch.zeros(3, 2).t()
    V.write(out, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert torch.equal(out, torch.tensor([[0.0, 1, 2], [3, 4, 5]]))


def test_write_from_flat_array_reshapes_to_out():
    """A flat array (as assembled from slices) is written in the out's shape."""
    out = np.zeros((2, 2), np.float32)
    V.write(out, np.array([1, 2, 3, 4], np.float32))
    np.testing.assert_array_equal(out, [[1, 2], [3, 4]])


def test_new_value_is_a_fresh_writable_array():
    """new_value copies into a new writable array of the key's shape."""
    source = np.array([1, 2, 3, 4, 5, 6], np.float32)
    source.setflags(write=False)
    fresh = V.new_value(meta(), source)
    assert isinstance(fresh, np.ndarray)
    assert fresh.shape == (2, 3) and fresh.flags.writeable
    assert not np.shares_memory(fresh, source)


def test_new_value_is_a_tensor_for_tensor_keys():
    """For a key initialised with a tensor, new_value returns a tensor."""
    fresh = V.new_value(meta(tensor=True), np.ones(6, np.float32))
    assert isinstance(fresh, torch.Tensor)
    assert fresh.shape == (2, 3) and fresh.dtype == torch.float32


def test_a_masked_array_is_refused_rather_than_its_mask_ignored():
    """A numpy masked array as a value (or out) is a TypeError naming the mask; a plain array is not."""
    masked = np.ma.array(np.ones(3, np.float32), mask=[0, 1, 0])
    with pytest.raises(TypeError, match="mask"):
        V.describe(masked)
    kv = kvstore.create("local")
    kv.init("w", np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="mask"):
        kv.push("w", masked)
    kv.push("w", masked.filled(0))

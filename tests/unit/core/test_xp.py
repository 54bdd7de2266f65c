"""Unit tests of kvstore.core.xp: the array operations shared by numpy arrays and (CPU) torch tensors."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import xp

torch = pytest.importorskip("torch")

FLOATS = [np.float16, np.float32, np.float64]
ROUND_TRIP = [np.float16, np.float32, np.float64, np.int32, np.int64]
SIDES = ["numpy", "torch"]


def values(shape=(3, 4), dtype=np.float64, seed=0) -> np.ndarray:
    """Reproducible values of ``shape`` and ``dtype``, none of them zero."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) + 3.0).astype(dtype)


def on(side: str, array: np.ndarray):
    """``array`` as a numpy array or as a CPU tensor (own memory either way)."""
    return array.copy() if side == "numpy" else torch.tensor(array)


def back(a) -> np.ndarray:
    """Test-side conversion of either kind to numpy, independent of xp.to_numpy."""
    return a.copy() if isinstance(a, np.ndarray) else a.detach().cpu().clone().numpy()


def assert_side(a, side: str) -> None:
    if side == "numpy":
        assert isinstance(a, np.ndarray)
    else:
        assert isinstance(a, torch.Tensor) and a.device.type == "cpu"


# -- kinds and dtypes ------------------------------------------------------------------------------

def test_is_numpy_is_tensor_is_cuda():
    """is_numpy / is_tensor tell arrays from tensors (not lists or scalars); no CPU value is CUDA."""
    a, t = np.ones(3), torch.ones(3)
    assert xp.is_numpy(a) and not xp.is_numpy(t)
    assert xp.is_tensor(t) and not xp.is_tensor(a)
    assert xp.is_tensor(torch.nn.Parameter(torch.ones(2))) and xp.is_tensor(torch.tensor(1.0))
    for other in ([1.0], 1.0, None, np.float64(1.0)):
        assert not xp.is_numpy(other) and not xp.is_tensor(other) and not xp.is_cuda(other)
    assert not xp.is_cuda(a) and not xp.is_cuda(t)


@pytest.mark.parametrize("dtype", ROUND_TRIP)
def test_dtype_of_gives_numpy_dtypes_for_both_kinds(dtype):
    """dtype_of is the numpy dtype for an array and for a tensor of the same dtype."""
    a = np.zeros(2, dtype)
    t = torch.from_numpy(np.zeros(2, dtype))
    assert xp.dtype_of(a) == np.dtype(dtype) and isinstance(xp.dtype_of(a), np.dtype)
    assert xp.dtype_of(t) == np.dtype(dtype) and isinstance(xp.dtype_of(t), np.dtype)


def test_dtype_of_bfloat16_tensor_is_kvstores_bf16():
    """A bfloat16 tensor is described by kvstore's BF16 (its bits) and maps back to torch.bfloat16."""
    from kvstore.core.dtypes import BF16

    assert xp.dtype_of(torch.ones(2, dtype=torch.bfloat16)) == BF16
    assert xp.torch_dtype(xp.numpy_dtype_of_torch(torch.bfloat16)) == torch.bfloat16


@pytest.mark.parametrize("dtype", ROUND_TRIP)
def test_numpy_and_torch_dtypes_round_trip(dtype):
    """torch_dtype maps a numpy dtype to torch's and numpy_dtype_of_torch maps it back."""
    expected = {np.float16: torch.float16, np.float32: torch.float32, np.float64: torch.float64,
                np.int32: torch.int32, np.int64: torch.int64}[dtype]
    assert xp.torch_dtype(np.dtype(dtype)) == expected
    assert xp.numpy_dtype_of_torch(expected) == np.dtype(dtype)
    assert xp.numpy_dtype_of_torch(xp.torch_dtype(np.dtype(dtype))) == np.dtype(dtype)


# -- places ----------------------------------------------------------------------------------------

def test_same_place():
    """Two arrays, or two CPU tensors, share a place; an array and a tensor never do."""
    a, b, t, u = np.ones(2), np.zeros(3, np.float32), torch.ones(2), torch.zeros(3, dtype=torch.int64)
    assert xp.same_place(a, b) and xp.same_place(b, a)
    assert xp.same_place(t, u) and xp.same_place(u, t)
    assert not xp.same_place(a, t) and not xp.same_place(t, a)
    assert not xp.same_place(t, [1.0]) and not xp.same_place(a, [1.0])


def test_place_strings():
    """place names 'numpy' for an array and 'torch <device>' for a tensor."""
    assert xp.place(np.ones(2)) == "numpy"
    assert xp.place(torch.ones(2)) == "torch cpu"


# -- new arrays ------------------------------------------------------------------------------------

@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", FLOATS + [np.int32])
def test_zeros_keeps_side_and_shape_in_the_requested_dtype(side, dtype):
    """zeros gives zeros of the template's shape and side, in the dtype asked (not the template's)."""
    like = on(side, values((2, 3, 4), np.float64))
    z = xp.zeros(like, np.dtype(dtype))
    assert_side(z, side)
    assert tuple(z.shape) == (2, 3, 4) and xp.dtype_of(z) == np.dtype(dtype)
    np.testing.assert_array_equal(back(z), np.zeros((2, 3, 4), dtype))
    assert np.all(back(like) != 0)  # the template is untouched


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_empty_keeps_side_and_shape_in_the_requested_dtype(side, dtype):
    """empty gives a new array of the template's shape and side in the dtype asked."""
    like = on(side, values((5,), np.float32))
    e = xp.empty(like, np.dtype(dtype))
    assert_side(e, side)
    assert tuple(e.shape) == (5,) and xp.dtype_of(e) == np.dtype(dtype)
    assert e is not like
    xp.assign(e, like)  # it is a separate, writable buffer
    e += 1
    np.testing.assert_array_equal(back(like), values((5,), np.float32))


@pytest.mark.parametrize("side", SIDES)
def test_zeros_and_empty_of_a_0d_template(side):
    """A 0-d template gives 0-d results on its side."""
    like = on(side, np.array(2.5))
    for made in (xp.zeros(like, np.dtype(np.float32)), xp.empty(like, np.dtype(np.float32))):
        assert_side(made, side)
        assert tuple(made.shape) == () and xp.dtype_of(made) == np.float32


# -- copies ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_cast_copy_is_a_real_contiguous_copy_in_the_dtype(side, dtype):
    """cast_copy of a transposed source is C-contiguous, in dtype, equal, and independent of it."""
    src_np = values((3, 4), np.float64)
    src = on(side, src_np).T
    out = xp.cast_copy(src, np.dtype(dtype))
    assert_side(out, side)
    assert tuple(out.shape) == (4, 3) and xp.dtype_of(out) == np.dtype(dtype)
    assert out.flags.c_contiguous if side == "numpy" else out.is_contiguous()
    np.testing.assert_array_equal(back(out), src_np.T.astype(dtype))
    out += 100
    np.testing.assert_array_equal(back(src), src_np.T)


@pytest.mark.parametrize("side", SIDES)
def test_cast_copy_to_the_same_dtype_still_copies(side):
    """cast_copy to the source's own dtype returns a new buffer, not the source."""
    src = on(side, values((4,), np.float32))
    out = xp.cast_copy(src, np.dtype(np.float32))
    assert out is not src
    out *= 0
    np.testing.assert_array_equal(back(src), values((4,), np.float32))


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_copy_is_a_real_contiguous_copy_keeping_the_dtype(side, dtype):
    """copy keeps dtype and values, is C-contiguous from a transposed source, and is independent."""
    src_np = values((2, 5), dtype)
    src = on(side, src_np).T
    out = xp.copy(src)
    assert_side(out, side)
    assert xp.dtype_of(out) == np.dtype(dtype) and tuple(out.shape) == (5, 2)
    assert out.flags.c_contiguous if side == "numpy" else out.is_contiguous()
    np.testing.assert_array_equal(back(out), src_np.T)
    out -= 7
    np.testing.assert_array_equal(back(src), src_np.T)


def test_copy_of_a_tensor_that_requires_grad_is_detached():
    """copy of a parameter is a plain tensor (no grad tracking) with the same values."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    out = xp.copy(p)
    assert not out.requires_grad
    out += 1  # would fail on a leaf that requires grad
    np.testing.assert_array_equal(p.detach().numpy(), [1.0, 2.0])


# -- arithmetic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("side", SIDES)
def test_scale_into_computes_in_outs_dtype(side):
    """scale_into(out32, a16, f) equals numpy's float32 a16.astype(float32) * float32(f), bit for bit."""
    a16 = values((64,), np.float16, seed=3)
    expected = a16.astype(np.float32) * np.float32(0.1)
    out = on(side, np.full(64, np.nan, np.float32))
    xp.scale_into(out, on(side, a16), 0.1)
    assert xp.dtype_of(out) == np.float32
    np.testing.assert_array_equal(back(out), expected)
    assert not np.array_equal(expected, (a16 * np.float16(0.1)).astype(np.float32))  # float16 would differ


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scale_into_same_dtype_and_source_unchanged(side, dtype):
    """scale_into writes a * factor into out and leaves a unchanged."""
    a_np = values((3, 4), dtype)
    a, out = on(side, a_np), on(side, np.zeros((3, 4), dtype))
    xp.scale_into(out, a, -0.5)
    np.testing.assert_array_equal(back(out), a_np * dtype(-0.5))
    np.testing.assert_array_equal(back(a), a_np)


@pytest.mark.parametrize("side", SIDES)
def test_clip_in_place(side):
    """clip_ bounds every value to [-bound, bound] in place and keeps the others."""
    a = on(side, np.array([-3.0, -0.5, 0.0, 0.25, 2.0, 0.75]))
    before = a
    assert xp.clip_(a, 0.75) is None
    assert a is before
    np.testing.assert_array_equal(back(a), [-0.75, -0.5, 0.0, 0.25, 0.75, 0.75])


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sqrt_in_place_returns_the_same_object(side, dtype):
    """sqrt_ overwrites a with its square root and returns a itself."""
    a_np = np.array([0.0, 1.0, 2.0, 9.0, 0.25], dtype)
    a = on(side, a_np)
    out = xp.sqrt_(a)
    assert out is a
    # torch's CPU square root need not round like numpy's (1 ulp apart on some builds)
    np.testing.assert_allclose(back(a), np.sqrt(a_np), rtol=2 * np.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sqrt_returns_a_new_object(side, dtype):
    """sqrt returns a new array on a's side holding sqrt(a); a is unchanged."""
    a_np = np.array([4.0, 2.0, 0.0, 16.0], dtype)
    a = on(side, a_np)
    out = xp.sqrt(a)
    assert_side(out, side)
    assert out is not a and xp.dtype_of(out) == np.dtype(dtype)
    np.testing.assert_allclose(back(out), np.sqrt(a_np), rtol=2 * np.finfo(dtype).eps, atol=0)
    np.testing.assert_array_equal(back(a), a_np)
    out += 1
    np.testing.assert_array_equal(back(a), a_np)


@pytest.mark.parametrize("side", SIDES)
def test_assign_casts_to_dst_dtype(side):
    """assign writes src into dst in place, cast to dst's dtype (float64 rounded to float32/float16)."""
    src_np = values((2, 3), np.float64, seed=5)
    for dtype in (np.float32, np.float16):
        dst = on(side, np.zeros((2, 3), dtype))
        before = dst
        xp.assign(dst, on(side, src_np))
        assert dst is before and xp.dtype_of(dst) == np.dtype(dtype)
        np.testing.assert_array_equal(back(dst), src_np.astype(dtype))


@pytest.mark.parametrize("side", SIDES)
def test_assign_into_a_view_writes_the_base(side):
    """assign into a (transposed) view writes through to the viewed array."""
    base = on(side, np.zeros((2, 3)))
    xp.assign(base.T, on(side, np.arange(6.0).reshape(3, 2)))
    np.testing.assert_array_equal(back(base), np.arange(6.0).reshape(3, 2).T)


# -- conversions -----------------------------------------------------------------------------------

@pytest.mark.parametrize("side", SIDES)
def test_to_numpy_is_an_independent_contiguous_copy(side):
    """to_numpy gives a C-contiguous numpy array equal to a, sharing no memory with it."""
    a_np = values((3, 4), np.float32)
    a = on(side, a_np)
    out = xp.to_numpy(a.T)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, a_np.T)
    out[...] = 0
    np.testing.assert_array_equal(back(a), a_np)
    out2 = xp.to_numpy(a)
    assert out2 is not a
    out2 += 1
    np.testing.assert_array_equal(back(a), a_np)


def test_to_numpy_of_a_parameter_and_a_0d_tensor():
    """to_numpy works on a tensor that requires grad and on a 0-d tensor (giving a 0-d array)."""
    p = torch.nn.Parameter(torch.tensor([1.5, -2.0]))
    np.testing.assert_array_equal(xp.to_numpy(p), [1.5, -2.0])
    zero_d = xp.to_numpy(torch.tensor(3.25, dtype=torch.float64))
    assert isinstance(zero_d, np.ndarray) and zero_d.shape == () and zero_d == 3.25


def test_to_numpy_of_a_tensor_with_the_neg_bit():
    """to_numpy of a lazily negated view holds the negated values and is independent of the source."""
    if not hasattr(torch, "_neg_view"):
        pytest.skip("this torch has no _neg_view")
    src = torch.tensor([1.0, -2.0, 3.5])
    view = torch._neg_view(src)
    assert view.is_neg()
    out = xp.to_numpy(view)
    assert isinstance(out, np.ndarray) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, [-1.0, 2.0, -3.5])
    out[...] = 9.0
    np.testing.assert_array_equal(src.numpy(), [1.0, -2.0, 3.5])


@pytest.mark.parametrize("side", SIDES)
def test_like_puts_a_numpy_array_on_the_templates_side(side):
    """like copies a numpy array (even a transposed one) to the template's side, C-contiguous, own memory."""
    template = on(side, np.zeros((4, 3), np.float16))
    array = values((3, 4), np.float64)
    out = xp.like(template, array.T)
    assert_side(out, side)
    assert tuple(out.shape) == (4, 3)
    assert xp.dtype_of(out) == np.float64  # the array's dtype, not the template's
    assert out.flags.c_contiguous if side == "numpy" else out.is_contiguous()
    np.testing.assert_array_equal(back(out), array.T)
    out += 1
    np.testing.assert_array_equal(array, values((3, 4), np.float64))
    array[...] = 0
    np.testing.assert_array_equal(back(out), values((3, 4), np.float64).T + 1)


def test_like_of_a_0d_array_onto_a_tensor():
    """like keeps a 0-d array 0-d on the tensor side."""
    out = xp.like(torch.ones(()), np.array(2.0, np.float32))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == () and out.dtype == torch.float32
    assert out.item() == 2.0

"""The few array operations the update rules and the device modes need, for numpy and torch alike.

Each function takes numpy arrays or torch tensors (any device) and keeps what it
returns on the same side: a tensor stays a tensor on its device, an array stays
an array.  The optimizer's rules are written once against these functions plus
Python's in-place operators (``+=``, ``*=``, ...), which both libraries share, so
the torch path runs exactly the arithmetic of the numpy path.  torch is never
imported here: a tensor can only arrive if the caller already imported it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from kvstore.core import precision
from kvstore.core.dtypes import BF16
from kvstore.errors import DTypeMismatchError

Array = Any  # np.ndarray or torch.Tensor


def _torch() -> Any:
    return sys.modules["torch"]


def is_numpy(a: Array) -> bool:
    """True for a numpy array (everything else handled here is a torch tensor)."""
    return isinstance(a, np.ndarray)


def is_tensor(a: Any) -> bool:
    """True for a torch tensor (checked without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


def is_cuda(a: Any) -> bool:
    """True for a torch tensor on a CUDA device."""
    return is_tensor(a) and a.device.type == "cuda"


@functools.cache
def numpy_dtype_of_torch(dtype: Any) -> np.dtype:
    """The numpy dtype of a torch dtype (bfloat16: kvstore's BF16); DTypeMismatchError for one numpy
    lacks."""
    if dtype == _torch().bfloat16:
        return BF16
    try:
        return _torch().empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise DTypeMismatchError(f"dtype {dtype} is not supported: numpy has no such dtype") from None


@functools.cache
def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a numpy dtype."""
    if dtype == BF16:
        return _torch().bfloat16
    return _torch().from_numpy(np.empty(0, dtype)).dtype


def dtype_of(a: Array) -> np.dtype:
    """``a``'s dtype as a numpy dtype (DTypeMismatchError for a tensor dtype numpy lacks)."""
    if not is_numpy(a):
        return numpy_dtype_of_torch(a.dtype)
    return BF16 if a.dtype.kind == "V" and precision.is_bf16(a.dtype) else a.dtype


def same_place(a: Array, b: Array) -> bool:
    """Whether ``a`` and ``b`` are both numpy arrays, or both tensors on one device."""
    if is_numpy(a) or is_numpy(b):
        return is_numpy(a) and is_numpy(b)
    return is_tensor(a) and is_tensor(b) and a.device == b.device


def place(a: Array) -> str:
    """Where ``a`` lives, for messages: ``'numpy'`` or the tensor's device (``'cuda:0'``)."""
    return "numpy" if is_numpy(a) else f"torch {a.device}"


def zeros(like: Array, dtype: np.dtype) -> Array:
    """Zeros of ``like``'s shape and ``dtype``, on ``like``'s side (and device)."""
    if is_numpy(like):
        return np.zeros(like.shape, dtype)
    return _torch().zeros(like.shape, dtype=torch_dtype(np.dtype(dtype)), device=like.device)


def empty(like: Array, dtype: np.dtype) -> Array:
    """An uninitialised array of ``like``'s shape and ``dtype``, on ``like``'s side (and device)."""
    if is_numpy(like):
        return np.empty(like.shape, dtype)
    return _torch().empty(like.shape, dtype=torch_dtype(np.dtype(dtype)), device=like.device)


def cast_copy(a: Array, dtype: np.dtype) -> Array:
    """A C-contiguous copy of ``a`` in ``dtype``, on ``a``'s side."""
    if is_numpy(a):
        return a.astype(dtype, order="C")
    return a.detach().to(torch_dtype(np.dtype(dtype)), memory_format=_torch().contiguous_format, copy=True)


def copy(a: Array) -> Array:
    """A contiguous copy of ``a`` on its side."""
    return cast_copy(a, dtype_of(a))


def scale_into(out: Array, a: Array, factor: float) -> None:
    """``out = a * factor``, computed in ``out``'s dtype (``a`` is cast first)."""
    if is_numpy(out):
        np.multiply(a, factor, out=out, dtype=out.dtype)
    else:
        out.copy_(a)
        out.mul_(factor)


def clip_(a: Array, bound: float) -> None:
    """Clip ``a`` in place to ``[-bound, bound]``."""
    if is_numpy(a):
        np.clip(a, -bound, bound, out=a)
    else:
        a.clamp_(-bound, bound)


def sqrt_(a: Array) -> Array:
    """Square root of ``a`` in place; returns ``a``."""
    if is_numpy(a):
        return np.sqrt(a, out=a)
    return a.sqrt_()


def sqrt(a: Array) -> Array:
    """A new array holding the square root of ``a``."""
    return np.sqrt(a) if is_numpy(a) else a.sqrt()


def assign(dst: Array, src: Array) -> None:
    """Copy ``src`` into ``dst`` (same side and shape; cast to ``dst``'s dtype)."""
    if is_numpy(dst):
        dst[...] = src
    else:
        dst.copy_(src)


def numpy_view(a: Array) -> np.ndarray:
    """``a`` as numpy: itself, a view of a CPU tensor, or a copy of a tensor on another device."""
    if is_numpy(a):
        return precision.internal(a) if a.dtype.kind == "V" and precision.is_bf16(a.dtype) else a
    tensor = a.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    return precision.from_tensor(tensor) if tensor.dtype == _torch().bfloat16 else tensor.numpy()


def to_numpy(a: Array) -> np.ndarray:
    """A new C-contiguous numpy array holding ``a``'s values (a tensor is copied off its device)."""
    return np.array(numpy_view(a), copy=True, order="C")


def like(template: Array, array: np.ndarray) -> Array:
    """``array`` (numpy) copied to ``template``'s side and device, C-contiguous."""
    if is_numpy(template):
        return np.array(array, copy=True, order="C")
    return from_numpy(np.array(array, copy=True, order="C")).to(template.device)


def from_numpy(array: np.ndarray) -> Array:
    """A CPU tensor sharing ``array``'s memory (a BF16 array becomes a bfloat16 tensor)."""
    return precision.to_tensor(array) if array.dtype == BF16 else _torch().from_numpy(array)

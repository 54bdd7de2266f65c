"""Numpy arrays and torch tensors in, numpy out: the only place that looks inside user values.

torch is never imported here unless the user already handed us a tensor
(``sys.modules`` tells), so ``import kvstore`` stays free of torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DTypeMismatchError, ShapeMismatchError
from .protocol import DTYPES, dtype_name


def is_tensor(value: Any) -> bool:
    """True for a torch tensor (checked without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_value(value: Any) -> bool:
    """True for a numpy array or a torch tensor."""
    return isinstance(value, np.ndarray) or is_tensor(value)


@dataclass(frozen=True)
class Meta:
    """What a key was initialised with: shape, dtype, and whether it came as a tensor."""

    shape: tuple[int, ...]
    dtype: np.dtype
    tensor: bool
    size: int  # number of elements


def as_array(value: Any) -> np.ndarray:
    """Return a numpy view of ``value`` (a copy only for GPU tensors); raise TypeError otherwise."""
    if isinstance(value, np.ndarray):
        array = value
    elif is_tensor(value):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if tensor.is_conj() or tensor.is_neg():
            tensor = tensor.resolve_conj().resolve_neg()
        try:
            array = tensor.numpy()
        except TypeError:  # a dtype numpy cannot hold, e.g. bfloat16
            raise DTypeMismatchError(f"dtype {tensor.dtype} is not supported; use one of "
                                     f"{', '.join(sorted(DTYPES))}") from None
    else:
        raise TypeError(f"values must be numpy arrays or torch tensors, not {type(value).__name__}")
    if dtype_name(array.dtype) is None:
        raise DTypeMismatchError(f"dtype {array.dtype} is not supported; use one of (native-order) "
                                 f"{', '.join(sorted(DTYPES))}")
    return array


def meta_of(value: Any) -> Meta:
    """Describe ``value`` for the key it initialises."""
    array = as_array(value)
    return Meta(tuple(array.shape), array.dtype, is_tensor(value), int(array.size))


def check(key: Any, meta: Meta, array: np.ndarray, what: str) -> None:
    """Raise a shape or dtype mismatch error when ``array`` does not fit ``meta``."""
    if tuple(array.shape) != meta.shape:
        raise ShapeMismatchError(f"{what} of key {key!r} has shape {tuple(array.shape)}, but the key "
                                 f"was initialised with shape {meta.shape}")
    if array.dtype != meta.dtype:
        raise DTypeMismatchError(f"{what} of key {key!r} has dtype {array.dtype}, but the key was "
                                 f"initialised with dtype {meta.dtype}")


def summed(key: Any, meta: Meta, values: list[Any]) -> np.ndarray:
    """Return a new C-contiguous array holding the sum of ``values`` (checked against ``meta``).

    The caller owns the result; the user's values are never written to.
    """
    arrays = [as_array(v) for v in values]
    for array in arrays:
        check(key, meta, array, "pushed value")
    total = np.array(arrays[0], copy=True, order="C")
    for array in arrays[1:]:
        total += array
    return total


def check_out(key: Any, meta: Meta, out: Any) -> None:
    """Raise when ``out`` cannot receive ``key``'s value (type, shape, dtype, read-only)."""
    array = as_array(out)
    check(key, meta, array, "out")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError(f"out of key {key!r} is read-only")
    if is_tensor(out) and out.numel() > 1 and 0 in out.stride():
        raise ValueError(f"out of key {key!r} has elements that share memory (an expanded tensor)")


def write(out: Any, array: np.ndarray) -> None:
    """Copy ``array`` into ``out`` (numpy array or torch tensor, any device) in place."""
    if isinstance(out, np.ndarray):
        np.copyto(out, array.reshape(out.shape))
    else:
        torch = sys.modules["torch"]
        with torch.no_grad():  # out may be a parameter that requires grad
            out.copy_(torch.from_numpy(np.ascontiguousarray(array).reshape(out.shape)))


def new_value(meta: Meta, array: np.ndarray) -> Any:
    """Return a fresh writable value of ``meta``'s kind (tensor or array) holding ``array``."""
    fresh = np.array(array, copy=True, order="C").reshape(meta.shape)
    if meta.tensor:
        return sys.modules["torch"].from_numpy(fresh)
    return fresh

"""Numpy arrays and torch tensors in, numpy out: the only place that looks inside user values.

torch is never imported here unless the user already handed us a tensor
(``sys.modules`` tells), so ``import kvstore`` stays free of torch.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.core import precision, xp
from kvstore.core.dtypes import BF16, DTYPES, dtype_name
from kvstore.core.xp import is_tensor
from kvstore.errors import DTypeMismatchError, ShapeMismatchError


def is_value(value: Any) -> bool:
    """True for a numpy array or a torch tensor."""
    return isinstance(value, np.ndarray) or is_tensor(value)


@dataclass(frozen=True)
class Meta:
    """What a key was initialised with: shape, dtype, whether it came as a tensor, and on which device."""

    shape: tuple[int, ...]
    dtype: np.dtype
    tensor: bool
    size: int  # number of elements
    device: str | None = None  # a tensor's device ('cpu', 'cuda:1'); None for numpy


def as_array(value: Any) -> np.ndarray:
    """Return a numpy view of ``value`` (a copy only for tensors off the CPU).

    Raises TypeError for anything but an array or a dense tensor, DTypeMismatchError
    for a dtype the wire cannot carry.
    """
    describe(value)
    return xp.numpy_view(value)


def describe(value: Any) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, numpy dtype)`` of an array or tensor, without copying it off its device.

    Raises TypeError for anything else (or a sparse tensor, or a masked array: its mask would be
    ignored), DTypeMismatchError for a dtype the wire cannot carry.
    """
    if isinstance(value, np.ndarray):
        if type(value) is not np.ndarray and isinstance(value, np.ma.MaskedArray):
            raise TypeError("values must not be masked arrays: kvstore would ignore the mask; pass "
                            "value.filled(fill) with the fill the masked elements should count as")
        shape, dtype = tuple(value.shape), xp.dtype_of(value)
    elif is_tensor(value):
        if value.layout != sys.modules["torch"].strided:
            raise TypeError(f"values must be dense tensors, not {value.layout} ones")
        shape, dtype = tuple(value.shape), xp.dtype_of(value)
    else:
        raise TypeError(f"values must be numpy arrays or torch tensors, not {type(value).__name__}")
    if dtype_name(dtype) is None:
        raise DTypeMismatchError(f"dtype {dtype} is not supported; use one of (native-order) "
                                 f"{', '.join(sorted(DTYPES))}")
    return shape, dtype


def meta_of(value: Any) -> Meta:
    """Describe ``value`` for the key it initialises."""
    shape, dtype = describe(value)
    return Meta(shape, dtype, is_tensor(value), int(np.prod(shape, dtype=np.int64)),
                str(value.device) if is_tensor(value) else None)


def check(key: Any, meta: Meta, value: Any, what: str) -> None:
    """Raise a shape or dtype mismatch error when ``value`` (array or tensor) does not fit ``meta``."""
    shape, dtype = describe(value)
    if shape != meta.shape:
        raise ShapeMismatchError(f"{what} of key {key!r} has shape {shape}, but the key "
                                 f"was initialised with shape {meta.shape}")
    if dtype != meta.dtype:
        raise DTypeMismatchError(f"{what} of key {key!r} has dtype {dtype}, but the key was "
                                 f"initialised with dtype {meta.dtype}: {dtype_fix(value, what, meta.dtype)}")


def dtype_fix(value: Any, what: str, dtype: np.dtype) -> str:
    """How to give ``value`` (named ``what``) the key's ``dtype``, for a DTypeMismatchError's message
    (``np.ones(shape)`` is float64 where the key is float32).  Raises nothing."""
    name = dtype_name(np.dtype(dtype)) or np.dtype(dtype).name
    converted = f"value.to(torch.{name})" if is_tensor(value) else f"value.astype(np.{name})"
    if what == "out":
        return f"pass an out of dtype {name}"
    return f"push {converted} instead (kvstore never converts a value)"


def summed(key: Any, meta: Meta, values: list[Any], out: np.ndarray | None = None) -> np.ndarray:
    """Return a C-contiguous array holding the sum of ``values`` (checked against ``meta``): a new
    one, or ``out`` (C-contiguous, of the key's shape and dtype) reused.

    The caller owns the result; the user's values are never written to.
    """
    if len(values) == 1 and type(values[0]) is np.ndarray and out is None:  # the common case
        value = values[0]
        if value.shape == meta.shape and value.dtype == meta.dtype:
            return np.array(value, copy=True, order="C")
    for value in values:
        if not (type(value) is np.ndarray and value.shape == meta.shape and value.dtype == meta.dtype):
            check(key, meta, value, "pushed value")
    arrays = [v if type(v) is np.ndarray else xp.numpy_view(v) for v in values]  # checked just above
    if meta.dtype == BF16:  # summed in float32, rounded once
        total = precision.sum_bf16(arrays)
        if out is not None:
            np.copyto(out, total.reshape(out.shape))
        return total if out is None else out
    if out is None:
        total = np.array(arrays[0], copy=True, order="C")
    else:
        total = out
        np.copyto(total, arrays[0])
    for array in arrays[1:]:
        total += array
    return total


def check_out(key: Any, meta: Meta, out: Any) -> None:
    """Raise when ``out`` cannot receive ``key``'s value (type, shape, dtype, read-only)."""
    if (type(out) is np.ndarray and out.shape == meta.shape and out.dtype == meta.dtype
            and out.flags.writeable):
        return  # the common case, checked directly
    check(key, meta, out, "out")
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError(f"out of key {key!r} is read-only")
    if is_tensor(out) and out.numel() > 1 and 0 in out.stride():
        raise ValueError(f"out of key {key!r} has elements that share memory (an expanded tensor)")


def write(out: Any, array: Any) -> None:
    """Copy ``array`` (numpy, or a tensor on any device) into ``out`` (the same, any device) in place."""
    if isinstance(out, np.ndarray):
        np.copyto(xp.numpy_view(out), xp.numpy_view(array).reshape(out.shape))
        return
    torch = sys.modules["torch"]
    if isinstance(array, np.ndarray):
        array = xp.from_numpy(np.ascontiguousarray(array))
    with torch.no_grad():  # out may be a parameter that requires grad
        out.copy_(array.reshape(out.shape))


def new_value(meta: Meta, array: Any) -> Any:
    """Return a fresh writable value of ``meta``'s kind holding ``array`` (numpy or a tensor).

    Keys initialised with a tensor get a tensor on the device the key was initialised on.
    """
    if not meta.tensor:
        fresh = (np.array(array, copy=True, order="C") if type(array) is np.ndarray  # as xp.to_numpy
                 else xp.to_numpy(array)).reshape(meta.shape)
        return precision.for_user(fresh) if fresh.dtype == BF16 else fresh
    if isinstance(array, np.ndarray):
        fresh = xp.from_numpy(np.array(array, copy=True, order="C").reshape(meta.shape))
        return fresh if meta.device in (None, "cpu") else fresh.to(meta.device)
    return array.detach().to(meta.device or "cpu", copy=True).reshape(meta.shape)

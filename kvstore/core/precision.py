"""bfloat16 values: their 16 bits inside kvstore, fp32 for arithmetic, ml_dtypes for numpy users.

Inside kvstore a bfloat16 value is a numpy array of :data:`~kvstore.core.dtypes.BF16` (its bits as a
one-field structured dtype).  Sums and updates happen in float32 (MXNet's ``multi_precision``): the
stores keep a float32 master copy of a bfloat16 key and round to bfloat16 (nearest even, as torch
does) only when a value leaves them.  torch tensors are reinterpreted bit for bit
(``tensor.view(torch.int16)``); numpy users get ``ml_dtypes.bfloat16`` arrays.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np

from kvstore.core.dtypes import BF16
from kvstore.errors import DTypeMismatchError

F32 = np.dtype(np.float32)


def is_bf16(dtype: Any) -> bool:
    """True for kvstore's bfloat16 dtype or ml_dtypes' (checked without importing ml_dtypes)."""
    return dtype == BF16 or getattr(dtype, "name", None) == "bfloat16"


def bits(array: np.ndarray) -> np.ndarray:
    """The uint16 bits of a bfloat16 array (kvstore's or ml_dtypes'), as a view."""
    return array.view(np.uint16)


def internal(array: np.ndarray) -> np.ndarray:
    """A bfloat16 array (kvstore's or ml_dtypes') as kvstore's :data:`BF16`, a view."""
    return array if array.dtype == BF16 else array.view(np.uint16).view(BF16)


def widen(array: np.ndarray) -> np.ndarray:
    """A new float32 array holding a bfloat16 array's values exactly."""
    return (bits(array).astype(np.uint32) << np.uint32(16)).view(np.float32)


def narrow(array: np.ndarray) -> np.ndarray:
    """A new :data:`BF16` array: ``array`` (float32) rounded to nearest even, as torch rounds
    (a NaN keeps its sign and top payload bits, made quiet)."""
    u = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(array)
    out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out.view(BF16)


def to_tensor(array: np.ndarray) -> Any:
    """A CPU torch bfloat16 tensor sharing a :data:`BF16` array's memory (C-contiguous copy first if
    needed)."""
    torch = sys.modules["torch"]
    return torch.from_numpy(np.ascontiguousarray(bits(array)).view(np.int16)).view(torch.bfloat16)


def from_tensor(tensor: Any) -> np.ndarray:
    """A CPU torch bfloat16 tensor's bits as a :data:`BF16` numpy view."""
    return tensor.view(sys.modules["torch"].int16).numpy().view(np.uint16).view(BF16)


def ml_bfloat16() -> np.dtype:
    """``ml_dtypes.bfloat16``; DTypeMismatchError naming it when ml_dtypes is not installed."""
    try:
        return np.dtype(importlib.import_module("ml_dtypes").bfloat16)
    except ImportError:
        raise DTypeMismatchError("bfloat16 values reach numpy as ml_dtypes.bfloat16 arrays: "
                                 "pip install ml_dtypes (or kvstore[bfloat16])") from None


def for_user(array: np.ndarray) -> np.ndarray:
    """A :data:`BF16` array as the ``ml_dtypes.bfloat16`` array a numpy user gets (a view)."""
    return bits(array).view(ml_bfloat16())


def master(array: np.ndarray) -> np.ndarray:
    """What a store keeps of a value: float32 for bfloat16 (the master copy), else ``array``."""
    return widen(array) if array.dtype == BF16 else array


def sum_bf16(arrays: list[np.ndarray]) -> np.ndarray:
    """The sum of bfloat16 arrays, taken in float32 and rounded once, as a new :data:`BF16` array."""
    total = widen(arrays[0])
    for array in arrays[1:]:
        total += widen(array)
    return narrow(total)

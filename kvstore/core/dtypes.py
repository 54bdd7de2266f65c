"""The dtypes a value may have: those the wire format (kvstore.net.protocol) and the file format
(kvstore.core.checkpoint) carry, by their names."""

from __future__ import annotations

import numpy as np

DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64"})
BY_NAME = {name: np.dtype(name) for name in DTYPES}  # wire name -> (native-order) numpy dtype
_NAMES = {dtype: name for name, dtype in BY_NAME.items()}  # dtype.name is slow on the hot path


def dtype_name(dtype: np.dtype) -> str | None:
    """The wire name of ``dtype`` (native byte order only), or None when it cannot be sent; never raises."""
    return _NAMES.get(dtype)

"""The dtypes a value may have: those the wire format (kvstore.net.protocol) and the file format
(kvstore.core.checkpoint) carry, by their names."""

from __future__ import annotations

import numpy as np

# bfloat16 inside kvstore (wire, servers, files): its 16 bits as a one-field structured dtype, so it
# needs no ml_dtypes, is never equal to uint16, and an .npy file keeps the tag (kvstore.core.precision)
BF16 = np.dtype([("bfloat16", np.uint16)])
DTYPES = frozenset({"bfloat16", "float16", "float32", "float64", "int32", "int64"})
BY_NAME = {name: BF16 if name == "bfloat16" else np.dtype(name) for name in DTYPES}  # wire name -> dtype
_NAMES = {dtype: name for name, dtype in BY_NAME.items()}  # dtype.name is slow on the hot path


def dtype_name(dtype: np.dtype) -> str | None:
    """The wire name of ``dtype`` (native byte order only), or None when it cannot be sent; never raises."""
    return _NAMES.get(dtype)

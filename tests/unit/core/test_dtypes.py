"""Unit tests of kvstore.core.dtypes: the dtypes values may have, shared by the wire and file formats."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import dtypes
from kvstore.net import protocol


@pytest.mark.parametrize("name", ["float16", "float32", "float64", "int32", "int64"])
def test_each_supported_dtype_has_its_name(name):
    """A native-order dtype of the table maps to its name, and the name back to the dtype."""
    assert dtypes.dtype_name(np.dtype(name)) == name
    assert dtypes.BY_NAME[name] == np.dtype(name)


@pytest.mark.parametrize("dtype", [np.dtype(">f4") if np.little_endian else np.dtype("<f4"),
                                   np.dtype(np.int8), np.dtype(np.bool_), np.dtype(np.complex64),
                                   np.dtype(object)])
def test_other_dtypes_have_no_name(dtype):
    """Non-native byte order, other kinds and object dtypes cannot be carried: None, not an error."""
    assert dtypes.dtype_name(dtype) is None


def test_protocol_carries_exactly_the_core_table():
    """The wire format uses the same table (net imports it from core, not the other way round)."""
    assert protocol.DTYPES is dtypes.DTYPES
    assert protocol.dtype_name is dtypes.dtype_name

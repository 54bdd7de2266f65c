"""Unit tests of kvstore.core.rowsparse: RowSparse, merged rows, row ranges, initializers, outs."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core import rowsparse as R
from kvstore.errors import DTypeMismatchError, ProtocolError, ShapeMismatchError

META = R.SparseMeta((10, 2, 3), np.dtype(np.float32))


def test_merge_sorts_and_sums_repeated_ids() -> None:
    """merge gives sorted distinct ids with the rows of repeated ids summed."""
    ids = np.array([5, 1, 5, 0, 1], np.int64)
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    got_ids, got_rows = R.merge(ids, rows)
    assert list(got_ids) == [0, 1, 5]
    np.testing.assert_array_equal(got_rows, [[6, 7], [2 + 8, 3 + 9], [0 + 4, 1 + 5]])


def test_rows_of_takes_rowsparse_dense_and_torch_sparse_values() -> None:
    """rows_of accepts RowSparse, a dense table and an nn.Embedding(sparse=True) gradient alike."""
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(10, 6, sparse=True)
    emb(torch.tensor([3, 3, 7])).sum().backward()
    meta = R.SparseMeta((10, 6), np.dtype(np.float32))
    extra = R.RowSparse([7], np.ones((1, 6), np.float32), (10, 6))
    ids, rows = R.rows_of("k", meta, [emb.weight.grad, extra])
    assert list(ids) == [3, 7] and np.allclose(rows, [[2] * 6, [2] * 6])
    ids, rows = R.rows_of("k", meta, [np.ones((10, 6), np.float32)])
    assert list(ids) == list(range(10)) and rows.shape == (10, 6)


def test_rows_of_refuses_bad_ids_widths_and_dtypes() -> None:
    """An id out of range, a wrong row width, a wrong dtype and a wrong table shape raise clearly."""
    with pytest.raises(ShapeMismatchError, match="out of range"):
        R.rows_of("k", META, [R.RowSparse([10], np.zeros((1, 2, 3), np.float32), (10, 2, 3))])
    with pytest.raises(ShapeMismatchError, match="out of range"):
        R.rows_of("k", META, [R.RowSparse([-1], np.zeros((1, 2, 3), np.float32), (10, 2, 3))])
    with pytest.raises(ShapeMismatchError, match="wide"):
        R.rows_of("k", META, [R.RowSparse([1], np.zeros((1, 6), np.float32), (10, 6))])
    with pytest.raises(DTypeMismatchError):
        R.rows_of("k", META, [R.RowSparse([1], np.zeros((1, 2, 3), np.float64), (10, 2, 3))])
    with pytest.raises(ShapeMismatchError, match="table"):
        R.rows_of("k", META, [R.RowSparse([1], np.zeros((1, 2, 3), np.float32), (11, 2, 3))])
    with pytest.raises(ValueError, match="one row"):
        R.RowSparse([1, 2], np.zeros((1, 2, 3), np.float32), (10, 2, 3))


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_a_table_is_the_same_for_any_number_of_servers(kind: str) -> None:
    """Generating each server's row range gives the same table as one range, for 1 to 7 servers."""
    spec = R.parse_init("k", {"type": kind, "seed": 11})
    whole = R.generate(spec, 0, 101, 5, np.dtype(np.float32))
    for servers in range(1, 8):
        parts = [R.generate(spec, lo, hi, 5, np.dtype(np.float32)) for lo, hi in R.row_bounds(101, servers)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert len(np.unique(whole)) == whole.size  # no repeats: every element its own counter


def test_initializers_have_their_documented_distributions() -> None:
    """uniform stays in [low, high) with the right mean; normal has the asked mean and sigma;
    another seed gives another table."""
    u = R.generate(R.parse_init("k", {"type": "uniform", "low": 1.0, "high": 3.0}), 0, 2000, 50,
                   np.dtype(np.float64))
    assert 1.0 <= u.min() and u.max() < 3.0 and abs(u.mean() - 2.0) < 0.01
    n = R.generate(R.parse_init("k", {"type": "normal", "mean": 1.0, "sigma": 2.0}), 0, 2000, 50,
                   np.dtype(np.float64))
    assert abs(n.mean() - 1.0) < 0.03 and abs(n.std() - 2.0) < 0.03
    other = R.generate(R.parse_init("k", {"type": "normal", "mean": 1.0, "sigma": 2.0, "seed": 1}), 0, 2000,
                       50, np.dtype(np.float64))
    assert not np.array_equal(n, other)
    assert not R.generate(R.parse_init("k", None), 0, 4, 2, np.dtype(np.float32)).any()
    with pytest.raises(ValueError, match="init must be"):
        R.parse_init("k", "xavier")
    with pytest.raises(ValueError, match="takes"):
        R.parse_init("k", {"type": "uniform", "scale": 2})


def test_split_cuts_sorted_ids_by_row_range() -> None:
    """split gives each server the positions of the ids in its row range; ranges never cut a row."""
    bounds = R.row_bounds(10, 3)
    assert bounds == [(0, 3), (3, 7), (7, 10)]
    assert R.split(np.array([0, 2, 3, 9], np.int64), bounds) == [(0, 2), (2, 3), (3, 4)]


def test_deliver_fills_a_dense_out_with_zeros_elsewhere_or_returns_rowsparse() -> None:
    """deliver writes asked rows into a dense out and zeros the rest, or makes a RowSparse."""
    meta = R.SparseMeta((4, 2), np.dtype(np.float32))
    out = np.full((4, 2), 9, np.float32)
    R.deliver(meta, np.array([1, 3]), np.ones((2, 2), np.float32), out)
    np.testing.assert_array_equal(out, [[0, 0], [1, 1], [0, 0], [1, 1]])
    got = R.deliver(meta, np.array([2]), np.ones((1, 2), np.float32), None)
    assert isinstance(got, R.RowSparse) and list(got.indices) == [2]
    np.testing.assert_array_equal(got.todense()[2], [1, 1])
    with pytest.raises(ShapeMismatchError):
        R.deliver(meta, np.array([2]), np.ones((1, 2), np.float32), np.zeros((3, 2), np.float32))


def test_pull_ids_takes_one_array_or_one_per_out() -> None:
    """pull_ids repeats one array for every out, or checks one per out."""
    meta = R.SparseMeta((4, 2), np.dtype(np.float32))
    assert [list(a) for a in R.pull_ids("k", meta, [3, 0, 3], 2)] == [[3, 0, 3], [3, 0, 3]]
    assert [list(a) for a in R.pull_ids("k", meta, [np.array([1]), np.array([2])], 2)] == [[1], [2]]
    with pytest.raises(ValueError, match="outs"):
        R.pull_ids("k", meta, [np.array([1])] * 3, 2)
    with pytest.raises(TypeError, match="integers"):
        R.pull_ids("k", meta, np.array([1.5]), 1)


@pytest.mark.parametrize("shape, dtype", [
    ([8, "3"], "float32"), ([8, 2.5], "float32"), ([True, 3], "float32"), ([8], "float32"),
    ("8,3", "float32"),
    ([2**64 - 1, 2], "float32"), ([2, 2**62, 2**62], "float32"), ([2, 2**32, 2**31], "float32"),
    ([8, 0], "float32"), ([8, 3], ["float32"]), ([8, 3], None), ([8, 3], "bogus")])
def test_wire_meta_refuses_what_is_not_a_table_shape_and_dtype_name(shape, dtype) -> None:
    """A SPARSE_INIT's shape must be 2+ true ints with rows under 2**63 elements (no int64
    wrap-around) and its dtype a name: ProtocolError otherwise, not a silent conversion."""
    with pytest.raises(ProtocolError, match="SPARSE_INIT of key 'k'"):
        R.wire_meta("k", shape, dtype)
    assert R.wire_meta("k", [8, 3, 2], "float16") == ((8, 3, 2), np.dtype(np.float16))


@pytest.mark.parametrize("init", [{"type": "normal", "sigma": float("nan")},
                                  {"type": "uniform", "high": float("inf")},
                                  {"type": "normal", "mean": "x"}, {"type": "uniform", "low": None},
                                  5, ["x"]])
def test_parse_init_refuses_non_finite_or_non_numeric_parameters(init) -> None:
    """An init whose parameter is NaN, infinite or not a number, or that is neither a name nor a
    dict, raises a ValueError naming the key (a server answers it; no table of NaN is made)."""
    with pytest.raises(ValueError, match="key 'k': .*(finite number|a name or a dict)"):
        R.parse_init("k", init)

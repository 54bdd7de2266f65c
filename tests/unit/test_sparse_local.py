"""Row-sparse keys in the local store (docs/sparse.md): init, push, row_sparse_pull, optimizer updates."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore import RowSparse
from kvstore.errors import DuplicateInitError, KeyNotInitializedError, ShapeMismatchError

SHAPE = (30, 3)


def _rs(ids: list[int], value: float) -> RowSparse:
    rows = np.stack([np.full(SHAPE[1], value + i, np.float32) for i in range(len(ids))])
    return RowSparse(np.array(ids), rows, SHAPE)


def test_row_sparse_pull_semantics() -> None:
    """row_ids unsorted and repeated; one array for several outs or one per out; zeros elsewhere."""
    kv = kvstore.create("local")
    value = np.arange(90, dtype=np.float32).reshape(SHAPE)
    kv.init("e", value, stype="row_sparse")
    outs = [np.full(SHAPE, 7, np.float32), np.full(SHAPE, 7, np.float32)]
    kv.row_sparse_pull("e", out=outs, row_ids=np.array([5, 2, 5]))
    for out in outs:
        assert set(np.flatnonzero(out.any(axis=1))) == {2, 5}
        np.testing.assert_array_equal(out[[2, 5]], value[[2, 5]])
    kv.row_sparse_pull("e", out=outs, row_ids=[np.array([1]), np.array([29, 0])])
    np.testing.assert_array_equal(outs[0][1], value[1])
    np.testing.assert_array_equal(outs[1][[0, 29]], value[[0, 29]])
    assert not outs[1][1].any()
    got = kv.row_sparse_pull(["e"], row_ids=[np.array([4, 4])])
    assert isinstance(got[0], RowSparse) and list(got[0].indices) == [4]
    np.testing.assert_array_equal(kv.pull("e"), value)
    kv.init("f", RowSparse([2], np.ones((1, 3), np.float32), SHAPE))  # a RowSparse value: row_sparse
    assert list(kv.row_sparse_pull("f", row_ids=[2, 3]).rows[:, 0]) == [1.0, 0.0]


def test_push_sums_values_and_repeated_ids_and_assigns_rows_without_optimizer() -> None:
    """Without an optimizer the pushed rows (summed over values and repeats) replace the stored rows;
    the rows not pushed keep their values."""
    kv = kvstore.create("local")
    kv.init("e", np.ones(SHAPE, np.float32), stype="row_sparse")
    kv.push("e", [_rs([3, 1, 3], 10.0), _rs([1], 100.0)])
    table = kv.pull("e")
    np.testing.assert_array_equal(table[3], np.full(3, 10.0 + 12.0))
    np.testing.assert_array_equal(table[1], np.full(3, 11.0 + 100.0))
    assert np.all(table[[0, 2, 4]] == 1.0)


def test_bad_calls_raise_and_change_nothing() -> None:
    """Duplicate init, a dense pull/pushpull of a row-sparse key's wrong kind, out-of-range ids and
    unknown keys raise; the table is unchanged."""
    kv = kvstore.create("local")
    kv.init("e", shape=SHAPE, init="normal")
    kv.init("d", np.zeros(3, np.float32))
    before = kv.pull("e")
    with pytest.raises(DuplicateInitError):
        kv.init("e", shape=SHAPE)
    with pytest.raises(DuplicateInitError):
        kv.init("d", shape=SHAPE)
    with pytest.raises(TypeError, match="dense"):
        kv.push("d", _rs([1], 1.0))
    with pytest.raises(ShapeMismatchError, match="out of range"):
        kv.push("e", [_rs([1], 1.0), _rs([30], 1.0)])
    with pytest.raises(KeyNotInitializedError):
        kv.row_sparse_pull("nope", row_ids=[1])
    with pytest.raises(ValueError, match="shape"):
        kv.init("x", shape=(5,))
    with pytest.raises(ValueError, match="stype"):
        kv.init("y", np.zeros(SHAPE, np.float32), stype="csr")
    np.testing.assert_array_equal(kv.pull("e"), before)


def test_embedding_gradients_and_tensor_tables() -> None:
    """An nn.Embedding(sparse=True) gradient pushes only its rows; a table initialised from a tensor
    pulls as tensors (dense outs as tensors too)."""
    torch = pytest.importorskip("torch")
    kv = kvstore.create("local")
    emb = torch.nn.Embedding(*SHAPE, sparse=True)
    kv.init("w", emb.weight.detach().clone(), stype="row_sparse")
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
    emb(torch.tensor([4, 4, 9])).sum().backward()
    kv.push("w", emb.weight.grad)
    whole = kv.pull("w")
    assert isinstance(whole, torch.Tensor)
    expect = emb.weight.detach().clone()
    expect[4] -= 2.0
    expect[9] -= 1.0
    torch.testing.assert_close(whole, expect)
    out = torch.zeros(SHAPE)
    kv.row_sparse_pull("w", out=out, row_ids=torch.tensor([9]))
    torch.testing.assert_close(out[9], expect[9])


@pytest.mark.parametrize("name,params", [("sgd", {"momentum": 0.9, "wd": 0.1}), ("adam", {"wd": 0.1})])
def test_lazy_and_standard_updates_against_dense_keys(name: str, params: dict) -> None:
    """lazy_update=False equals a dense key's optimizer on the dense gradient; lazy_update=True equals
    a dense key holding only the rows pushed (the same rows each step), the others untouched."""
    start = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    rows = [2, 11, 12]
    grads = [_rs(rows, 0.3 * s) for s in range(4)]
    results = {}
    for lazy in (True, False):
        kv = kvstore.create("local")
        kv.init("e", start, stype="row_sparse")
        kv.set_optimizer(kvstore.optimizer.create(name, learning_rate=0.1, lazy_update=lazy, **params))
        for g in grads:
            kv.push("e", g)
        results[lazy] = kv.pull("e")
    dense = kvstore.create("local")
    dense.init("all", start.copy())
    dense.init("some", start[rows].copy())
    dense.set_optimizer(kvstore.optimizer.create(name, learning_rate=0.1, **params))
    for g in grads:
        dense.push(["all", "some"], [g.todense(), g.rows])
    np.testing.assert_allclose(results[False], dense.pull("all"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(results[True][rows], dense.pull("some"), rtol=1e-5, atol=1e-6)
    others = np.setdiff1d(np.arange(SHAPE[0]), rows)
    np.testing.assert_array_equal(results[True][others], start[others])
    assert not np.allclose(results[False][others], start[others])  # wd reached every row

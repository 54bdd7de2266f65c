"""RowReducer (kvstore/sparse_reduce.py) in a local store: merged rows in, the summed rows of the touched
rows out, with only those rows and ids pushed."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore import RowSparse
from kvstore.sparse_reduce import RowReducer


def test_one_worker_gets_its_rows_merged_and_empty_steps_are_steps() -> None:
    """Repeated ids are summed, the result is sorted; a table without rows this step gives none; the
    initial value given to init is read back whole."""
    kv = kvstore.create("local")
    start = np.arange(12, dtype=np.float32).reshape(6, 2)
    reducer = RowReducer(kv, "r", [("a", (6, 2), np.float32), ("b", (4, 3), np.float64)])
    reducer.init([start, None])
    np.testing.assert_array_equal(reducer.initial(0), start)
    grad = RowSparse(np.array([5, 1, 5]), np.array([[1, 1], [2, 2], [3, 3]], np.float32), (6, 2))
    a, b = reducer.reduce([grad, None])
    assert a.indices.tolist() == [1, 5] and a.rows.tolist() == [[2, 2], [4, 4]]
    assert b.indices.size == 0 and b.rows.shape == (0, 3)
    a, b = reducer.reduce([None, RowSparse(np.array([3]), np.ones((1, 3)), (4, 3))])
    assert a.indices.size == 0 and b.indices.tolist() == [3] and b.rows.tolist() == [[1, 1, 1]]


def test_a_gradient_of_another_shape_or_a_pull_without_push_is_refused() -> None:
    """A gradient for a table of another shape raises ValueError naming the table; pull() before a push
    raises RuntimeError."""
    reducer = RowReducer(kvstore.create("local"), "s", [("t", (5, 2), np.float32)])
    reducer.init()
    with pytest.raises(ValueError, match="'t'"):
        reducer.push([RowSparse(np.array([0]), np.ones((1, 2), np.float32), (6, 2))])
    with pytest.raises(RuntimeError, match="push"):
        reducer.pull()


def test_a_store_that_runs_an_optimizer_is_refused() -> None:
    """init raises ConfigError when the store runs an optimizer: it would update the rows, not sum them."""
    kv = kvstore.create("local")
    kv.set_optimizer(kvstore.optimizer.create("sgd"))
    with pytest.raises(kvstore.errors.ConfigError, match="only sums"):
        RowReducer(kv, "o", [("t", (5, 2), np.float32)]).init()


@pytest.mark.parametrize("bad", [6, -1])
def test_a_row_id_outside_the_table_is_refused_and_the_next_step_sums_right(bad: int) -> None:
    """A gradient with a row id outside its table raises ValueError naming the table and the id (after
    pushing a poisoned step, so other workers' pulls fail too); the next step sums right."""
    reducer = RowReducer(kvstore.create("local"), "p", [("t", (6, 2), np.float32), ("u", (3, 1), np.float32)])
    reducer.init()
    with pytest.raises(ValueError, match=rf"'t'.*row id {bad}"):
        reducer.reduce([RowSparse(np.array([0, bad]), np.ones((2, 2), np.float32), (6, 2)), None])
    with pytest.raises(RuntimeError, match="push"):
        reducer.pull()
    a, u = reducer.reduce([RowSparse(np.array([5, 5]), np.ones((2, 2), np.float32), (6, 2)), None])
    assert a.indices.tolist() == [5] and a.rows.tolist() == [[2, 2]] and u.indices.size == 0

"""kvstore.client.compress.RowResiduals: 2bit / 1bit residuals of row-sparse pushes, kept per (table,
row id) on the worker, bounded, and what a small sparse model trained through them converges to."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.compress import ROW_RESIDUAL_BYTES, RowResiduals
from kvstore.core import compression as C
from kvstore.core.dynamic import full_bytes
from kvstore.core.rowsparse import DynamicSpec

T = 0.5


def _sent(spec: C.Spec, res: RowResiduals, key, ids, rows) -> np.ndarray:
    """What the server stores of a push (one message, as DistRows sends it): the dequantised rows of
    those with a residual row, the others as they are (they travel uncompressed)."""
    ids, rows = np.asarray(ids, np.int64), np.asarray(rows, np.float32)
    has = res.reserve(key, ids, rows.shape[1])
    out = rows.copy()
    packed = res.quantise(spec, key, ids[has], rows[has])
    out[has] = C.dequantise(spec.type, packed, int(has.sum()) * rows.shape[1],
                            spec.threshold).reshape(-1, rows.shape[1])
    return out


def _rows(n: int, width: int = 1) -> RowResiduals:
    """Residuals bounded at ``n`` rows of ``width`` per table (its byte budget)."""
    res = RowResiduals(budget=n * RowResiduals.row_bytes(width))
    assert res.rows_for(width) == n
    return res


def test_a_rows_residual_carries_to_its_next_push_by_row_id_and_table() -> None:
    """2bit: 0.3 sends 0 and keeps 0.3; the same row's next 0.3 sends +t (0.6 >= t), whatever other rows
    the pushes carry; another table's row of that id has its own residual."""
    spec = C.Spec("2bit", T)
    res = RowResiduals()
    rows = np.full((2, 3), 0.3, np.float32)
    np.testing.assert_array_equal(_sent(spec, res, "a", [5, 8], rows), 0.0)
    np.testing.assert_allclose(res.residual("a", np.array([5, 8])), 0.3)
    second = _sent(spec, res, "a", [1, 5], rows)  # row 1 is new (0.3: nothing), row 5 carries 0.3
    np.testing.assert_array_equal(second, [[0, 0, 0], [T, T, T]])
    np.testing.assert_allclose(res.residual("a", np.array([1, 5, 8])), [[0.3] * 3, [0.1] * 3, [0.3] * 3],
                               rtol=1e-6)
    np.testing.assert_array_equal(_sent(spec, res, "b", [5], rows[:1]), 0.0)  # table b: its own


def test_one_bit_rows_follow_the_dense_keys_rule() -> None:
    """1bit on rows is the dense rule per element: r += g; r > t sends +1 (r -= 1), else -1 (r += 1)."""
    spec = C.Spec("1bit", 0.0)
    res = RowResiduals()
    grad = np.array([[0.25, -0.25], [2.0, 0.0]], np.float32)
    np.testing.assert_array_equal(_sent(spec, res, 0, [3, 4], grad), [[1, -1], [1, -1]])
    np.testing.assert_allclose(res.residual(0, np.array([3, 4])), [[-0.75, 0.75], [1.0, 1.0]])


def test_the_residuals_are_bounded_and_a_forgotten_row_starts_at_zero() -> None:
    """At most ``rows_for(width)`` rows of residual per table: pushing past it forgets rows (their residual is
    lost: they start again at zero), never a row of the push itself."""
    spec = C.Spec("2bit", T)
    res = _rows(4)
    rows = np.full((4, 1), 0.3, np.float32)
    _sent(spec, res, "t", [0, 1, 2, 3], rows)
    _sent(spec, res, "t", [10, 11, 12, 13], rows)
    assert len(res.tables["t"]) == 4
    np.testing.assert_array_equal(res.residual("t", np.array([0, 1, 2, 3])), 0.0)
    np.testing.assert_array_equal(_sent(spec, res, "t", [0], rows[:1]), 0.0)  # 0.3 again: no +t


def test_a_small_sparse_model_converges_under_2bit_rows_near_uncompressed() -> None:
    """A 300 x 4 embedding table fitting a hidden one through bags of 3 ids (sgd on summed bags, the
    table updated with the rows the server would store) reaches, under 2bit (threshold 0.05), a
    held-out squared error within 0.002 of the uncompressed run's, both below a tenth of the start's."""
    rng = np.random.default_rng(0)
    rows, width, steps, lr = 300, 4, 600, 0.05
    hidden = rng.normal(0, 0.3, (rows, width)).astype(np.float32)
    test = rng.integers(0, rows, (500, 3))

    def error(table: np.ndarray) -> float:
        return float(((table[test].sum(1) - hidden[test].sum(1)) ** 2).mean())

    def train(spec: C.Spec | None) -> tuple[float, float]:
        table = np.zeros((rows, width), np.float32)
        start = error(table)
        res = RowResiduals()
        data = np.random.default_rng(1)
        for _ in range(steps):
            bags = data.integers(0, rows, (32, 3))
            diff = table[bags].sum(1) - hidden[bags].sum(1)
            ids, inverse = np.unique(bags, return_inverse=True)
            grad = np.zeros((ids.size, width), np.float32)
            np.add.at(grad, inverse.reshape(bags.shape), diff[:, None, :] / 32)
            if spec is not None:
                grad = _sent(spec, res, "emb", ids, grad)
            table[ids] -= lr * 10 * grad
        return start, error(table)

    start, plain = train(None)
    _, quantised = train(C.Spec("2bit", 0.05))
    assert plain < start / 10 and quantised < start / 10, (start, plain, quantised)
    assert abs(quantised - plain) <= 0.002, (plain, quantised)


def test_every_row_of_a_fixed_table_pushed_whole_keeps_its_residual_or_travels_exact() -> None:
    """A table of 8 rows pushed whole under 2bit t=0.5 with 0.3 everywhere, the residuals bounded at 4
    rows: rows 0..3 keep residuals (6 x t sent over 10 pushes), rows 4..7 travel uncompressed (0.3 each
    time): every row delivers the 3.0 pushed, none starves."""
    spec = C.Spec("2bit", 0.5)
    res = _rows(4)
    ids = np.arange(8, dtype=np.int64)
    rows = np.full((8, 1), 0.3, np.float32)
    total = np.zeros((8, 1), np.float32)
    for _ in range(10):
        total += _sent(spec, res, "f", ids, rows)
        np.testing.assert_array_equal(res.reserve("f", ids, 1), [True] * 4 + [False] * 4)
    np.testing.assert_allclose(total, 3.0, rtol=1e-6)
    np.testing.assert_allclose(res.residual("f", ids[:4]), 0.0, atol=1e-6)


def test_quantise_refuses_rows_with_no_residual_and_takes_an_empty_message() -> None:
    """quantise codes only reserved rows (KeyError for others, nothing changed); an empty message
    (a server given no ids) codes to zero words, even for a table never reserved."""
    spec = C.Spec("2bit", 0.5)
    res = _rows(2)
    assert res.quantise(spec, "never", np.zeros(0, np.int64), np.zeros((0, 1), np.float32)).size == 0
    res.reserve("t", np.array([1, 2, 3], np.int64), 1)
    with pytest.raises(KeyError):
        res.quantise(spec, "t", np.array([1, 3], np.int64), np.full((2, 1), 0.3, np.float32))
    np.testing.assert_array_equal(res.residual("t", np.array([1, 2, 3])), 0.0)


def test_the_bound_is_bytes_per_table_whatever_the_width() -> None:
    """The default budget (ROW_RESIDUAL_BYTES) gives fewer rows to wider tables, and a table filled to
    its bound holds no more than the budget (pool, counters and id map), at width 1 and 1024."""
    res = RowResiduals()
    assert res.budget == ROW_RESIDUAL_BYTES
    assert res.rows_for(1024) < res.rows_for(16) < res.rows_for(1)
    assert res.rows_for(1024) * 4 * 1024 <= ROW_RESIDUAL_BYTES
    small = RowResiduals(budget=1 << 20)
    for width in (1, 1024):
        n = small.rows_for(width)
        assert full_bytes(DynamicSpec(capacity=n), width, np.dtype(np.float32)) <= 1 << 20
        small.reserve(width, np.arange(n + 100, dtype=np.int64), width)
        table = small.tables[width]
        assert len(table) == n and table.nbytes() <= 1 << 20, (width, table.nbytes())


def test_residual_of_a_table_never_pushed_is_a_key_error() -> None:
    """A table never pushed has no width to answer rows of: KeyError (not (n, 0) rows)."""
    with pytest.raises(KeyError):
        RowResiduals().residual("never", np.array([1, 2], np.int64))


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_a_cast_with_error_feedback_keeps_what_each_rows_cast_lost(kind: str) -> None:
    """fp16 / bf16 with error_feedback on rows: what a row sent over pushes plus its residual equals what
    was pushed (float32 rounding aside), by row id; a row with no room for a residual is cast as it is."""
    spec = C.Spec(kind, error_feedback=True)
    res = _rows(2, width=3)
    grad = np.array([[1e-4, 1.0 + 1e-3, -3.3337], [0.1, 0.2, 0.3], [7.0001, 8, 9]], np.float32)
    ids = np.array([4, 9, 11], np.int64)
    sent = np.zeros((3, 3), np.float32)
    for _ in range(3):
        has = res.reserve("t", ids[:2], 3)
        assert has.all()
        full = np.concatenate([has, [False]])  # row 11 has no residual row (the budget is 2 rows)
        half = res.cast(spec, "t", ids, grad, full)
        sent += C.from_half(kind, half.reshape(-1)).reshape(3, 3)
    np.testing.assert_allclose(sent[:2] + res.residual("t", ids[:2]), 3 * grad[:2], rtol=1e-5)
    plain = C.from_half(kind, C.to_half(kind, grad[2].copy(), None))
    np.testing.assert_array_equal(sent[2], 3 * plain)
    assert not np.allclose(res.residual("t", ids[:2]), 0)  # the casts lost something, kept here

"""Unit tests of kvstore.core.agreement: digests of a collective's arguments and what differs."""

from __future__ import annotations

from kvstore.core.agreement import digest, disagreement
from kvstore.errors import CollectiveMismatchError


def _d(*entries, root=0):
    return digest(entries, root=root)


def test_equal_digests_agree() -> None:
    """Workers with the same keys, shapes, dtypes and root agree (None)."""
    same = _d(("a", (2, 3), "float32"), ("b", (), "int64"))
    assert disagreement("x", {0: same, 1: same, 2: same}) is None


def test_shape_dtype_and_root_are_named_with_the_ranks() -> None:
    """A worker's other shape, dtype and root are named against the largest group's lowest rank."""
    ref = _d(("w", (3,), "float32"))
    odd = _d(("w", (4,), "float64"), root=1)
    error = disagreement("broadcast", {0: ref, 1: odd, 2: ref})
    assert isinstance(error, CollectiveMismatchError)
    assert error.ranks == [1]
    text = str(error)
    assert "broadcast" in text and "worker 1 differs from workers [0, 2]" in text
    assert "root_rank 1 (worker 0: 0)" in text
    assert "key 'w' (4,) float64 (worker 0: (3,) float32)" in text


def test_key_sets_and_order() -> None:
    """Keys one worker lacks or adds are listed; the same keys in another order are said to be."""
    ref = _d(("a", (1,), "f"), ("b", (1,), "f"))
    assert "key(s) worker 0 lacks: ['c']" in str(disagreement("x", {0: ref, 1: _d(("a", (1,), "f"),
                                                                                 ("c", (1,), "f"))}))
    assert "missing: ['b']" in str(disagreement("x", {0: ref, 1: _d(("a", (1,), "f"))}))
    text = str(disagreement("x", {0: ref, 1: _d(("b", (1,), "f"), ("a", (1,), "f"))}))
    assert "another order" in text


def test_int_keys_and_no_root() -> None:
    """Int keys keep their type; a collective without a root compares keys only."""
    error = disagreement("init", {0: digest([(7, (2,), "float32")]), 1: digest([(7, (3,), "float32")])})
    assert "key 7 (3,) float32" in str(error)

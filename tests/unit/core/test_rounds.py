"""Unit tests of kvstore.core.rounds.Round on its own: adding, holding, draining, closing one round.

ShardState's behaviour over many rounds is tested in test_shard.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.core.rounds import Round
from kvstore.errors import ProtocolError


def ro(values, dtype=np.float64) -> np.ndarray:
    """A read-only array, like one decoded from a received frame."""
    array = np.array(values, dtype=dtype)
    array.setflags(write=False)
    return array


def test_ordered_round_holds_a_higher_rank_until_the_lower_one_is_added():
    """In rank order, rank 1's chunk waits for rank 0's; the round is done once both are added."""
    active = {0, 1}
    rnd = Round([0, 1])
    assert rnd.contribute("b", 1, ro([10.0, 20.0]), 0, 2, 2, True, active) is True
    assert rnd.nheld == 1 and rnd.acc is None and not rnd.done(active)
    assert rnd.held_bytes() == 16
    assert rnd.contribute("a", 0, ro([1.0, 2.0]), 0, 2, 2, True, active) is True
    assert rnd.nheld == 0 and rnd.done(active)
    np.testing.assert_array_equal(rnd.total(2), [11.0, 22.0])
    assert rnd.tokens == {1: ["b"], 0: ["a"]}


def test_arrival_order_adds_at_once_and_the_first_whole_push_is_not_copied():
    """Unordered, nothing is held; a lone whole push is the accumulator itself until a second one."""
    active = {0, 1}
    rnd = Round([0, 1])
    first = ro([1.0, 2.0])
    rnd.contribute("b", 1, first, 0, 2, 2, False, active)
    assert rnd.acc is first and not rnd.owned and rnd.nheld == 0
    rnd.contribute("a", 0, ro([3.0, 4.0]), 0, 2, 2, False, active)
    assert rnd.owned and rnd.acc is not first
    np.testing.assert_array_equal(first, [1.0, 2.0])
    np.testing.assert_array_equal(rnd.total(2), [4.0, 6.0])


def test_a_chunk_does_not_complete_a_contribution_until_it_reaches_the_end():
    """contribute reports completion only for the chunk that ends at the key's size."""
    rnd = Round([0])
    assert rnd.contribute("a0", 0, ro([1.0, 2.0]), 0, 2, 4, True, {0}) is False
    assert rnd.contribute("a1", 0, ro([3.0, 4.0]), 2, 4, 4, True, {0}) is True
    np.testing.assert_array_equal(rnd.total(4), [1.0, 2.0, 3.0, 4.0])


def test_check_part_refuses_other_offsets_than_the_rounds():
    """A chunk starting where a part starts must end where it ends."""
    rnd = Round([0, 1])
    rnd.contribute("a", 0, ro([1.0, 2.0]), 0, 2, 4, True, {0, 1})
    rnd.check_part("k", 1, 0, 2)
    with pytest.raises(ProtocolError, match=r"\[0, 3\).*\[0, 2\)"):
        rnd.check_part("k", 1, 0, 3)


def test_leave_releases_held_chunks_and_total_zeroes_what_none_covered():
    """When the lower rank leaves having sent nothing, the held chunk is added; uncovered elements are 0."""
    active = {0, 1}
    rnd = Round([0, 1])
    rnd.contribute("b", 1, ro([5.0, 6.0]), 0, 2, 4, True, active)
    assert rnd.nheld == 1
    active.discard(1)
    rnd.leave(1, active, 4)
    assert rnd.tokens[1] == []
    assert rnd.nheld == 1  # rank 0 is still expected
    active.discard(0)
    rnd.leave(0, active, 4)
    assert rnd.nheld == 0 and rnd.done(active)
    np.testing.assert_array_equal(rnd.total(4), [5.0, 6.0, 0.0, 0.0])

"""kvstore.core.membership: the agreed view of the workers and an epoch's split over it."""

from __future__ import annotations

import pytest

from kvstore.core.membership import EpochSplit, Membership, check_tag, view_of


def test_a_view_is_the_slots_not_left_in_rank_order() -> None:
    """A barrier reply's ``left`` (or a map's ``absent``) leaves the held slots, ascending; its number and
    tag come with it, else the number given."""
    view = view_of({"left": [1, 3], "view": 7, "tag": [2, 40]}, 5, 0)
    assert view == Membership(7, (0, 2, 4), 5, (2, 40))
    assert view.size == 3 and view.index(4) == 2 and 2 in view and 1 not in view
    assert view_of({"absent": [2, 3]}, 4, 5) == Membership(5, (0, 1), 4, ())
    with pytest.raises(ValueError, match="worker 1 is not in membership view 7"):
        view.index(1)


def test_a_tag_is_a_few_ints() -> None:
    """A tag is a sequence of at most 8 ints; a str, a float or nine ints are refused."""
    assert check_tag([1, 2]) == (1, 2) and check_tag(()) == ()
    for bad, error in (("ab", TypeError), ([1.5], TypeError), (range(9), ValueError), (3, TypeError)):
        with pytest.raises(error):
            check_tag(bad)


def test_a_tag_s_ints_fit_in_msgpack() -> None:
    """Ints msgpack carries (-2**63 up to 2**64 - 1) pass; one outside raises ValueError before any send."""
    assert check_tag([-2 ** 63, 2 ** 64 - 1]) == (-2 ** 63, 2 ** 64 - 1)
    for bad in ([2 ** 64], [-2 ** 63 - 1], [0, 10 ** 30]):
        with pytest.raises(ValueError, match="64 bits"):
            check_tag(bad)


@pytest.mark.parametrize("samples,workers,batch,min_batch", [
    (60, 2, 4, 1), (60, 4, 4, 1), (61, 3, 4, 1), (7, 4, 2, 1), (3, 4, 2, 1), (100, 3, 8, 8), (10, 1, 3, 1)])
def test_every_sample_is_in_one_part_and_the_epoch_has_the_biggest_parts_batches(
        samples: int, workers: int, batch: int, min_batch: int) -> None:
    """The parts cover the epoch's order once, in rank order; a step's rows of a part are within it and a
    part with fewer batches than the epoch's steps has empty rows (a step of zeros) in the rest; with
    min_batch 1 every position is in some step's rows."""
    split = EpochSplit(samples, workers, batch, min_batch)
    bounds = [split.bounds(p) for p in range(workers)]
    assert bounds[0][0] == 0 and bounds[-1][1] == samples
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
    assert split.steps == max(split.batches(p) for p in range(workers))
    seen = []
    for part in range(workers):
        for index in range(split.steps):
            lo, hi = split.rows(part, index)
            assert bounds[part][0] <= lo <= hi <= bounds[part][1]
            assert (hi > lo) == (index < split.batches(part))
            assert hi - lo <= batch and (hi == lo or hi - lo >= min_batch)
            seen.extend(range(lo, hi))
    assert len(seen) == len(set(seen))
    if min_batch == 1:
        assert sorted(seen) == list(range(samples))


def test_a_split_refuses_bad_counts() -> None:
    """Counts below 1, a min_batch above the batch size and a part outside the workers are ValueErrors."""
    for args in ((0, 1, 1), (1, 0, 1), (1, 1, 0), (4, 2, 2, 3)):
        with pytest.raises(ValueError):
            EpochSplit(*args)
    with pytest.raises(ValueError):
        EpochSplit(4, 2, 2).bounds(2)

"""Unit tests of kvstore.data: per-worker dataset shards and per-device batch slices."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from kvstore import data as D


class Dataset:
    """A map-style dataset that is neither a list nor an array (like a torch Dataset)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return (i, i * i)


def parts(dataset, num_parts: int, even: bool) -> list:
    """Every part of ``dataset``, as lists."""
    return [list(D.split(dataset, num_parts, i, even)) for i in range(num_parts)]


# -- split ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,num_parts", [(10, 3), (12, 4), (7, 7), (100, 6), (5, 1)])
def test_even_parts_have_equal_size_and_drop_the_tail(size, num_parts):
    """even=True: every part has size // num_parts items, contiguous, in order; the remainder is dropped."""
    got = parts(list(range(size)), num_parts, even=True)
    step = size // num_parts
    assert got == [list(range(i * step, (i + 1) * step)) for i in range(num_parts)]


@pytest.mark.parametrize("size,num_parts", [(10, 3), (12, 4), (2, 5), (0, 3), (100, 7), (5, 1)])
def test_uneven_parts_cover_everything_and_differ_by_at_most_one(size, num_parts):
    """even=False: parts concatenate to the whole; the first size % num_parts parts have one more."""
    got = parts(list(range(size)), num_parts, even=False)
    assert sum(got, []) == list(range(size))
    base, extra = divmod(size, num_parts)
    assert [len(p) for p in got] == [base + (i < extra) for i in range(num_parts)]


def test_numpy_split_is_a_view_along_the_first_axis():
    """A numpy array gives a view of its rows."""
    x = np.arange(20).reshape(10, 2)
    part = D.split(x, 3, 1)
    np.testing.assert_array_equal(part, x[3:6])
    assert np.shares_memory(part, x)


def test_tensor_split_is_a_view():
    """A torch tensor gives a view of its rows."""
    x = torch.arange(20).reshape(10, 2)
    part = D.split(x, 3, 2, even=False)
    assert torch.equal(part, x[7:10])
    assert part.data_ptr() == x[7].data_ptr()


@pytest.mark.parametrize("dataset", [list(range(9)), tuple(range(9)), range(9)])
def test_builtin_sequences_keep_their_type(dataset):
    """Lists, tuples and ranges are sliced into their own type."""
    part = D.split(dataset, 3, 1)
    assert type(part) is type(dataset) and part == dataset[3:6]


def test_other_datasets_get_a_part_wrapper():
    """Any other object with len and [i] gives a Window: len, indexes (negative too), iteration."""
    part = D.split(Dataset(10), 3, 1, even=False)  # items 4..6
    assert isinstance(part, D.Window) and len(part) == 3
    assert part[0] == (4, 16) and part[-1] == (6, 36) and part[np.int64(1)] == (5, 25)
    assert list(part) == [(4, 16), (5, 25), (6, 36)]
    assert (5, 25) in part
    for bad in (3, -4):
        with pytest.raises(IndexError):
            part[bad]


def test_part_slices_and_splits_again():
    """A Window's slices and its own splits are Windows over the original items."""
    part = D.split(Dataset(20), 2, 1)  # items 10..19
    assert list(part[2:4]) == [(12, 144), (13, 169)] and isinstance(part[2:4], D.Window)
    sub = D.split(part, 5, 4)
    assert isinstance(sub, D.Window) and list(sub) == [(18, 324), (19, 361)]
    with pytest.raises(ValueError):
        part[::2]


def test_window_copies_as_any_object_does():
    """A Window copies (copy, deepcopy: the protocol a DataLoader's spawned workers pickle it by) into an
    equal Window over the same items, as the class it renames did."""
    part = D.split(Dataset(20), 2, 1)  # items 10..19
    for copied in (copy.copy(part), copy.deepcopy(part)):
        assert isinstance(copied, D.Window) and list(copied) == list(part)
    inner = D.Window(part, 2, 4)  # a window of a window: over the original items
    assert list(copy.deepcopy(inner)) == [(12, 144), (13, 169)]


@pytest.mark.parametrize("num_parts,part_index", [(0, 0), (-1, 0), (3, 3), (3, -1)])
def test_bad_part_numbers_raise_value_error(num_parts, part_index):
    """num_parts < 1 or a part_index outside [0, num_parts) raises ValueError."""
    with pytest.raises(ValueError):
        D.split(list(range(10)), num_parts, part_index)


def test_even_split_needs_an_item_per_part():
    """even=True with fewer items than parts raises ValueError; even=False gives empty parts."""
    with pytest.raises(ValueError, match="3 items into 4"):
        D.split([1, 2, 3], 4, 0)
    assert D.split([1, 2, 3], 4, 3, even=False) == []


@pytest.mark.parametrize("dataset", [5, None, {1, 2}, iter([1, 2]), {0: "a", 1: "b"}, np.array(3.0)])
def test_objects_without_len_and_index_raise_type_error(dataset):
    """Scalars, sets, iterators, mappings and 0-d arrays raise TypeError."""
    with pytest.raises(TypeError):
        D.split(dataset, 2, 0)


def test_non_int_part_numbers_raise_type_error():
    """Float part numbers raise TypeError."""
    with pytest.raises(TypeError):
        D.split([1, 2], 2.0, 0)


# -- split_and_load ---------------------------------------------------------------------------------

def test_split_and_load_even_over_cpu_devices():
    """A batch divisible by the device count gives equal consecutive slices on those devices."""
    batch = torch.arange(24.0).reshape(6, 4)
    slices = D.split_and_load(batch, ["cpu", "cpu", torch.device("cpu")])
    assert [tuple(s.shape) for s in slices] == [(2, 4)] * 3
    assert torch.equal(torch.cat(slices), batch)
    assert all(s.device.type == "cpu" for s in slices)


def test_split_and_load_uneven_follows_mxnet():
    """even_split=False: each slice has size // n items and the last takes the rest (MXNet's rule)."""
    batch = torch.arange(11)
    slices = D.split_and_load(batch, ["cpu"] * 4, even_split=False)
    assert [len(s) for s in slices] == [2, 2, 2, 5]
    assert torch.equal(torch.cat(slices), batch)


def test_split_and_load_numpy_input_gives_tensors():
    """A numpy batch is turned into tensors (sharing its memory on the CPU)."""
    batch = np.arange(8, dtype=np.float32).reshape(4, 2)
    slices = D.split_and_load(batch, ["cpu", "cpu"])
    assert all(isinstance(s, torch.Tensor) for s in slices)
    np.testing.assert_array_equal(slices[1].numpy(), batch[2:])
    assert np.shares_memory(slices[0].numpy(), batch)


@pytest.mark.parametrize("axis", [1, -2])
def test_split_and_load_along_another_axis(axis):
    """batch_axis=1 (or its negative form) cuts the second axis."""
    batch = torch.arange(30).reshape(2, 5, 3)
    slices = D.split_and_load(batch, ["cpu"] * 2, batch_axis=axis, even_split=False)
    assert [tuple(s.shape) for s in slices] == [(2, 2, 3), (2, 3, 3)]
    assert torch.equal(torch.cat(slices, dim=1), batch)


def test_split_and_load_one_device_returns_the_whole_batch():
    """One device gives a one-element list holding the whole batch (even if it cannot be split)."""
    batch = torch.arange(7)
    (only,) = D.split_and_load(batch, [torch.device("cpu")])
    assert torch.equal(only, batch)


def test_split_and_load_uneven_size_with_even_split_names_both_numbers():
    """even_split=True with a size the device count does not divide raises ValueError naming both."""
    with pytest.raises(ValueError, match=r"10 items.*3 devices"):
        D.split_and_load(torch.zeros(10), ["cpu"] * 3)


@pytest.mark.parametrize("even", [True, False])
def test_split_and_load_more_devices_than_items(even):
    """Fewer items than devices raises ValueError, even with even_split=False."""
    with pytest.raises(ValueError, match="2 items"):
        D.split_and_load(torch.zeros(2, 3), ["cpu"] * 3, even_split=even)


def test_split_and_load_argument_errors():
    """No devices or a bad axis raise ValueError; a list batch or a bare device raise TypeError."""
    with pytest.raises(ValueError, match="at least one"):
        D.split_and_load(torch.zeros(4), [])
    with pytest.raises(ValueError, match="batch_axis"):
        D.split_and_load(torch.zeros(4, 2), ["cpu", "cpu"], batch_axis=2)
    with pytest.raises(ValueError, match="batch_axis"):
        D.split_and_load(torch.tensor(1.0), ["cpu", "cpu"])
    with pytest.raises(TypeError):
        D.split_and_load([1, 2, 3, 4], ["cpu", "cpu"])
    with pytest.raises(TypeError):
        D.split_and_load(torch.zeros(4), "cpu")


def test_share_gives_each_worker_of_a_view_its_part_in_rank_order():
    """Under a view of ranks (0, 2, 3) the three shares, by rank order, cover every item once; a rank
    not in the view has none (ValueError)."""
    from kvstore.core.membership import Membership

    view = Membership(4, (0, 2, 3), 4)
    parts = [D.share(list(range(10)), view, rank) for rank in view.ranks]
    assert parts == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="worker 1 is not in membership view 4"):
        D.share(list(range(10)), view, 1)

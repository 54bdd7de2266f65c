"""Data helpers for data-parallel training: shard a dataset per worker, split a batch per device.

:func:`split` gives worker ``rank`` of ``num_workers`` its contiguous shard; :func:`share` gives a
worker its shard under an agreed membership view (an elastic job, docs/elastic.md);
:func:`split_and_load` is MXNet's ``gluon.utils.split_and_load`` for torch.
torch is imported only inside :func:`split_and_load`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvstore.core.membership import Membership
from kvstore.core.values import is_tensor


class Window(Sequence):
    """A read-only window ``dataset[start:stop]`` over an indexable dataset, without copying it.

    Supports ``len``, int indexes (negative ones count from the end; IndexError outside the
    part), slices (a smaller Window), iteration and the other Sequence methods.
    """

    def __new__(cls, dataset: Any, start: int, stop: int) -> Window:
        if isinstance(dataset, Window):  # a part of a part is the part's slice: it indexes the original
            return dataset[start:stop]
        return super().__new__(cls)

    def __init__(self, dataset: Any, start: int, stop: int) -> None:
        if isinstance(dataset, Window):
            return  # made by __new__: the slice of ``dataset``, set up already
        self._dataset = dataset
        self._indices = range(start, stop)

    def __getnewargs__(self) -> tuple[Any, int, int]:
        """What copy and pickle pass to ``__new__`` (it takes the dataset and the bounds)."""
        return self._dataset, self._indices.start, self._indices.stop

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            indices = self._indices[index]
            if indices.step != 1:
                raise ValueError("a Window can only be sliced with step 1")
            return Window(self._dataset, indices.start, indices.stop)
        try:
            position = self._indices[operator.index(index)]
        except IndexError:
            raise IndexError(f"index {index} is out of range for a part of {len(self)} items") from None
        return self._dataset[position]

    def __iter__(self) -> Iterator[Any]:
        for position in self._indices:
            yield self._dataset[position]

    def __repr__(self) -> str:
        return (f"Window({type(self._dataset).__name__}, items {self._indices.start} to "
                f"{self._indices.stop - 1}, {len(self)} in all)")


def _bounds(size: int, num_parts: int, part_index: int, even: bool) -> tuple[int, int]:
    """``(start, stop)`` of part ``part_index`` of ``size`` items (see :func:`split`)."""
    if even:
        if size < num_parts:
            raise ValueError(f"cannot split {size} items into {num_parts} non-empty equal parts "
                             "(use even=False to allow empty parts)")
        step = size // num_parts
        return part_index * step, (part_index + 1) * step
    base, extra = divmod(size, num_parts)
    start = part_index * base + min(part_index, extra)
    return start, start + base + (1 if part_index < extra else 0)


def split(dataset: Any, num_parts: int, part_index: int, even: bool = True) -> Any:
    """Return contiguous part ``part_index`` of ``num_parts`` of ``dataset`` (e.g. one worker's shard).

    With ``even=True`` every part has exactly ``len(dataset) // num_parts`` items and the
    remainder at the end is dropped, so every worker runs the same number of steps (workers
    with different numbers of batches would wait for each other at the end of a dist_sync
    epoch).  With ``even=False`` the parts cover every item and their sizes differ by at most
    one: the first ``len(dataset) % num_parts`` parts have one more item.

    numpy arrays and torch tensors give views (along the first axis); lists, tuples, ranges
    and Windows give slices of their own type; anything else with ``len`` and ``[i]`` (a torch
    Dataset, say) gives a :class:`Window` over it.  Raises TypeError when ``dataset`` has no
    ``len`` or no ``[i]`` (or is a mapping) or the counts are not ints; ValueError when
    ``num_parts < 1``, ``part_index`` is outside ``[0, num_parts)``, or with ``even=True`` there
    are fewer items than parts.
    """
    num_parts, part_index = operator.index(num_parts), operator.index(part_index)
    if num_parts < 1:
        raise ValueError(f"num_parts must be at least 1, not {num_parts}")
    if not 0 <= part_index < num_parts:
        raise ValueError(f"part_index {part_index} is outside [0, {num_parts})")
    if isinstance(dataset, Mapping) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(f"split needs a sequence with len() and [i], not {type(dataset).__name__}")
    start, stop = _bounds(len(dataset), num_parts, part_index, even)
    if isinstance(dataset, (np.ndarray, list, tuple, range, Window)) or is_tensor(dataset):
        return dataset[start:stop]
    return Window(dataset, start, stop)


def share(dataset: Any, view: Membership, rank: int, even: bool = False) -> Any:
    """Worker ``rank``'s share of ``dataset`` under the membership ``view`` (``kv.membership()``, agreed
    at an epoch's start, docs/elastic.md): part ``view.index(rank)`` of ``view.size`` (:func:`split`),
    so the workers of one view, in rank order, hold every item once.  ``even=False`` (the default
    here) keeps every item, the parts differing by one at most; ``even=True`` is :func:`split`'s.
    Raises ValueError when ``rank`` is not in the view (it joined after it: no share until the next),
    and what :func:`split` raises."""
    return split(dataset, view.size, view.index(operator.index(rank)), even)


def split_and_load(batch: Any, devices: Sequence[Any], batch_axis: int = 0,
                   even_split: bool = True) -> list[Any]:
    """Cut ``batch`` along ``batch_axis`` into one slice per device and move each to its device.

    ``batch`` is a torch tensor or a numpy array (turned into a tensor sharing its memory);
    ``devices`` are ``torch.device``\\ s or strs such as ``"cpu"`` or ``"cuda:1"``.  One device
    gives ``[batch.to(device)]``.  As in MXNet, each slice has ``size // len(devices)`` items and
    the last takes the rest; ``even_split=True`` requires the size to be divisible.  A slice
    already on its device is a view of ``batch``.  Raises TypeError for a batch that is not an
    array or tensor or for ``devices`` that is not a list; ValueError for no devices, a bad
    axis, a size smaller than the number of devices, or (``even_split``) a size the number of
    devices does not divide.
    """
    import torch

    if isinstance(batch, np.ndarray):
        batch = torch.from_numpy(batch)
    elif not isinstance(batch, torch.Tensor):
        raise TypeError(f"batch must be a torch tensor or a numpy array, not {type(batch).__name__}")
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of devices, not {type(devices).__name__}")
    if len(devices) == 0:
        raise ValueError("split_and_load needs at least one device")
    axis = operator.index(batch_axis)
    if not -batch.dim() <= axis < batch.dim():
        raise ValueError(f"batch_axis {batch_axis} is out of range for a batch of shape {tuple(batch.shape)}")
    axis %= batch.dim()
    if len(devices) == 1:
        return [batch.to(devices[0])]
    size, count = batch.shape[axis], len(devices)
    if size < count:
        raise ValueError(f"cannot split a batch of {size} items along axis {axis} over {count} devices")
    if even_split and size % count:
        raise ValueError(f"a batch of {size} items along axis {axis} cannot be split evenly over {count} "
                         f"devices; use a batch size that is a multiple of {count} or even_split=False")
    step = size // count
    return [batch.narrow(axis, i * step, step if i < count - 1 else size - i * step).to(device)
            for i, device in enumerate(devices)]

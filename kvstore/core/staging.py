"""A key's first value (INIT) or optimizer state (STATE_SET) gathered from chunks, in order, by one
worker, before it takes effect (:class:`kvstore.core.shard.ShardState` keeps a table of these).

Pure numpy, no I/O.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from kvstore.core.partition import Key
from kvstore.errors import ProtocolError


class Staged:
    """A key's first value (INIT) or optimizer state (STATE_SET) being gathered from its chunks."""

    __slots__ = ("worker", "bufs", "covered", "info")

    def __init__(self, worker: int, arrays: list[np.ndarray], total: int, info: Any) -> None:
        self.worker, self.info, self.covered = worker, info, 0
        self.bufs = [np.empty(total, a.dtype) for a in arrays]  # pages are touched as chunks arrive



def stage(table: dict[Key, Staged], what: str, worker: int, key: Key, arrays: list[np.ndarray],
           lo: int, total: int, info: Any) -> list[np.ndarray] | None:
    """Copy a checked chunk into ``table[key]`` (a new entry at offset 0); return the whole arrays,
    removed from ``table``, once they are covered, else None.  Raises as :func:`check_chunk`."""
    staged = table.get(key)
    lo, hi = check_chunk(staged, what, worker, key, arrays, lo, total, info)
    if lo == 0:
        staged = table[key] = Staged(worker, arrays, total, info)
    for buf, array in zip(staged.bufs, arrays):
        buf[lo:hi] = array
    staged.covered = hi
    if hi < total:
        return None
    del table[key]
    return staged.bufs


def check_chunk(staged: Staged | None, what: str, worker: int, key: Key, arrays: list[np.ndarray],
                 lo: int, total: int, info: Any) -> tuple[int, int]:
    """The chunk's ``[lo, hi)``; raises :class:`ProtocolError` for a chunk that is malformed or does
    not continue ``staged`` (``TypeError`` for a ``lo`` that is not an int)."""
    lo = operator.index(lo)
    n = arrays[0].size if arrays else 0
    if not n or any(not isinstance(a, np.ndarray) or a.ndim != 1 or a.size != n for a in arrays):
        raise ProtocolError(f"{what} of key {key!r}: a chunk is one non-empty 1-D array per state, "
                            "all of one length")
    if type(total) is not int or not 0 <= lo <= total - n:
        raise ProtocolError(f"{what} of key {key!r}: chunk [{lo}, {lo + n}) is not inside [0, {total!r})")
    if lo == 0:
        return lo, n
    if staged is None:
        problem = "no chunk at offset 0 came first"
    elif staged.worker != worker:
        problem = f"worker {staged.worker} is sending this key's chunks"
    elif staged.covered != lo:
        problem = f"the chunks so far cover [0, {staged.covered})"
    elif staged.bufs[0].size != total:
        problem = f"the first chunk gave {staged.bufs[0].size} elements in all, this one {total}"
    elif [b.dtype for b in staged.bufs] != [a.dtype for a in arrays]:
        problem = f"dtypes {[str(a.dtype) for a in arrays]} differ from the first chunk's"
    elif staged.info != info:
        problem = f"{info!r} differs from the first chunk's {staged.info!r}"
    else:
        return lo, lo + n
    raise ProtocolError(f"{what} of key {key!r}: worker {worker}'s chunk at offset {lo} does not continue "
                        f"it ({problem}): chunks must come in order, from one worker")

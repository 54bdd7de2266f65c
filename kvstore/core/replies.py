"""What :class:`kvstore.core.shard.ShardState` hands back: answered requests, and the small helpers
that make them.  Pure, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class Completion:
    """A request that is now answered: ``value`` is the slice to send back, or None for a bare ack;
    ``error`` (a round aborted, :meth:`kvstore.core.shard.ShardState.abort`) answers it with that error."""

    token: Any
    value: np.ndarray | None = None
    error: Exception | None = None


class _Assembly:
    """A dist_async contribution being gathered from its chunks."""

    __slots__ = ("buf", "covered", "tokens")

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.covered = 0
        self.tokens: list = []


_SILENT = object()  # marks the push half of a pushpull, whose ack is folded into the pull's reply


def _acks(tokens: Iterable[Any]) -> list[Completion]:
    """Bare acks of ``tokens`` (a pushpull's silent push half has none)."""
    return [Completion(t) for t in tokens if t is not _SILENT]


def _part_of(value: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``value`` itself when ``[lo, hi)`` is all of it, else the view ``value[lo:hi]`` (1-D)."""
    return value if lo == 0 and hi == value.size else value[lo:hi]

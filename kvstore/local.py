"""The in-process stores: ``'local'`` and (until the device issue lands) ``'device'``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import KVStore
from .partition import Key

LocalUpdater = Callable[[Key, Any, Any], None]


class LocalKVStore(KVStore):
    """A store held in this process: pushes are summed, then assigned or given to the updater."""

    def __init__(self, name: str = "local") -> None:
        super().__init__(name)
        self._store: dict[Key, np.ndarray] = {}
        self._updater: LocalUpdater | None = None

    def _set_updater(self, updater: LocalUpdater) -> None:
        """Apply pushes with ``updater(key, pushed, stored)``, which updates ``stored`` in place.

        The two values are tensors for keys initialised with torch tensors, else
        numpy arrays (MXNet's updater contract).
        """
        self._updater = updater

    def _view(self, key: Key, array: np.ndarray) -> Any:
        return sys.modules["torch"].from_numpy(array) if self._meta[key].tensor else array

    def _init(self, items: list[tuple[Key, np.ndarray]]) -> None:
        with self._lock:
            for key, array in items:
                self._store[key] = array

    def _push(self, items: list[tuple[Key, np.ndarray]], priority: int) -> None:
        with self._lock:
            for key, total in items:
                if self._updater is None:
                    self._store[key] = total
                else:
                    self._updater(key, self._view(key, total), self._view(key, self._store[key]))

    def _pull(self, keys: list[Key], priority: int) -> list[np.ndarray]:
        with self._lock:
            return [self._store[k].copy() for k in keys]  # an updater may change them in place

    def barrier(self) -> None:
        """Nothing to wait for in a single process."""
        self._check_open()

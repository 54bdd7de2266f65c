"""The in-process stores: ``'local'`` and (until the device issue lands) ``'device'``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from . import checkpoint
from .base import KVStore
from .errors import DTypeMismatchError, OptimizerError
from .optimizer import Optimizer
from .partition import Key

LocalUpdater = Callable[[Key, Any, Any], None]


class LocalKVStore(KVStore):
    """A store held in this process: pushes are summed, then assigned or given to the updater."""

    def __init__(self, name: str = "local") -> None:
        super().__init__(name)
        self._store: dict[Key, np.ndarray] = {}
        self._updater: LocalUpdater | None = None
        self._optimizer: Optimizer | None = None

    def _set_updater(self, updater: LocalUpdater) -> None:
        """Apply pushes with ``updater(key, pushed, stored)``, which updates ``stored`` in place.

        The two values are tensors for keys initialised with torch tensors, else
        numpy arrays (MXNet's updater contract).  Replaces any optimizer.
        """
        with self._lock:
            self._updater, self._optimizer = updater, None

    def _set_optimizer(self, optimizer: Optimizer) -> None:
        with self._lock:  # the store uses the object itself, so its changes take effect at once
            self._updater, self._optimizer = None, optimizer
            optimizer.reset_states()

    def _need_optimizer(self, what: str) -> Optimizer:
        if self._optimizer is None:
            raise OptimizerError(f"{what}: no optimizer is set (call set_optimizer)")
        return self._optimizer

    def _set_optimizer_params(self, params: dict[str, Any]) -> None:
        with self._lock:
            self._need_optimizer("set_optimizer_params").set_params(**params)

    def get_optimizer(self) -> Optimizer | None:
        """The optimizer object in effect (the one given to set_optimizer), or None."""
        return self._optimizer

    def _save_states(self, fname: str, dump_optimizer: bool) -> None:
        with self._lock:
            opt = self._need_optimizer("save_optimizer_states")
            states = checkpoint.optimizer_states(opt, self._store, dump_optimizer)
        checkpoint.write_states(fname, states)

    def _load_states(self, fname: str) -> None:
        states = checkpoint.read_states(fname)
        with self._lock:
            self._optimizer = checkpoint.restore_optimizer(states, self._optimizer, self._store)
            self._updater = None

    def _view(self, key: Key, array: np.ndarray) -> Any:
        return sys.modules["torch"].from_numpy(array) if self._meta[key].tensor else array

    def _init(self, items: list[tuple[Key, np.ndarray]]) -> None:
        with self._lock:
            for key, array in items:
                self._store[key] = array

    def _push(self, items: list[tuple[Key, np.ndarray]], priority: int) -> None:
        with self._lock:
            if self._optimizer is not None:
                for key, total in items:
                    if total.dtype.kind != "f":
                        raise DTypeMismatchError(f"key {key!r} holds {total.dtype}; the optimizer "
                                                 "updates floating-point keys only")
            for key, total in items:
                if self._optimizer is not None:
                    self._optimizer.update(key, self._store[key], total)
                elif self._updater is None:
                    self._store[key] = total
                else:
                    self._updater(key, self._view(key, total), self._view(key, self._store[key]))

    def _pull(self, keys: list[Key], priority: int) -> list[np.ndarray]:
        with self._lock:
            return [self._store[k].copy() for k in keys]  # an updater may change them in place

    def barrier(self) -> None:
        """Nothing to wait for in a single process."""
        self._check_open()

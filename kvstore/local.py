"""The in-process stores: ``'local'`` (held in numpy) and ``'device'``.

A ``'device'`` store sums CUDA values on a GPU (``kvstore.device``) and, as MXNet's
does, moves a key's stored value to that GPU the first time a GPU sum reaches it;
from then on the optimizer (or updater) runs there on torch tensors.  Keys only
ever pushed from numpy or CPU tensors stay in numpy, exactly as in ``'local'``.
A call that queues GPU work on stored values waits for it before it releases the
store's lock, so threads on different CUDA streams can share one store.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.base import KVStore, Pushed
from kvstore.core import checkpoint, precision, snapshot, xp
from kvstore.core import compression as C
from kvstore.core import rowsparse as R
from kvstore.core.dtypes import BF16
from kvstore.core.dynamic import DynamicRows, apply_dynamic, check_state, load_state, state_entry, table_label
from kvstore.core.optimizer import Optimizer, from_spec
from kvstore.core.partition import Key
from kvstore.core.sparse_update import apply_rows
from kvstore.core.values import Meta
from kvstore.core.worker_sets import WorkerSet
from kvstore.device import settle
from kvstore.errors import DTypeMismatchError, OptimizerError, ShapeMismatchError, UnsupportedError

LocalUpdater = Callable[[Key, Any, Any], None]


class LocalKVStore(KVStore):
    """A store held in this process: pushes are summed, then assigned or given to the updater."""

    def __init__(self, name: str = "local") -> None:
        super().__init__(name)
        self._store: dict[Key, Any] = {}  # numpy arrays; in 'device' mode also CUDA tensors
        self._updater: LocalUpdater | None = None
        self._optimizer: Optimizer | None = None
        self._residuals: dict[tuple[Key, int], Any] = {}  # 'device' compression: one per (key, value)
        self._dynamic: dict[Key, DynamicRows] = {}  # dynamic row-sparse tables (kvstore/core/dynamic.py)

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

    def _declared(self) -> dict[Key, np.dtype]:
        """The bfloat16 keys' dtype: state files record it, as dist stores do, while the store
        holds (and the optimizer updates) their float32 master copies."""
        return {k: m.dtype for k, m in self._meta.items() if m.dtype == BF16}

    def _states_file(self, opt: Optimizer, dump_optimizer: bool) -> checkpoint.StatesFile:
        """``opt``'s state of every key: the fixed keys' whole, each dynamic table's held rows by id."""
        fixed = copy.copy(opt)  # the dynamic tables' pool-sized state has no weight in _store
        fixed.states = {k: v for k, v in opt.states.items() if k not in self._dynamic}
        states = checkpoint.optimizer_states(fixed, self._store, dump_optimizer, self._declared())
        for key, table in self._dynamic.items():
            entry = state_entry(opt, key, table, self._sparse.metas[key].shape[1:])
            if entry is not None:
                states.entries.append(entry)
        return states

    def _save_states(self, fname: str, dump_optimizer: bool, collective: bool = True) -> None:
        with self._lock:
            opt = self._need_optimizer("save_optimizer_states")
            states = self._states_file(opt, dump_optimizer)
        checkpoint.write_states(fname, states)

    def _load_states(self, fname: str) -> None:
        states = checkpoint.read_states(fname)
        with self._lock:
            dynamic = [e for e in states.entries if e.key in self._dynamic]
            fixed = checkpoint.StatesFile(states.optimizer, states.num_update,
                                          [e for e in states.entries if e.key not in self._dynamic])
            check = from_spec(states.optimizer) if states.optimizer is not None else self._optimizer
            for entry in dynamic:  # checked before anything changes
                if check is None:
                    break  # restore_optimizer raises
                if entry.ids is None:
                    raise ShapeMismatchError(f"the file's state of key {entry.key!r} is a fixed table's; "
                                             "the key is a dynamic table")
                check_state(check, entry.key, self._dynamic[entry.key], entry.ids, entry.arrays)
            self._optimizer = checkpoint.restore_optimizer(fixed, self._optimizer, self._store,
                                                           self._declared())
            for entry in dynamic:
                load_state(self._optimizer, entry.key, self._dynamic[entry.key], entry.ids, entry.arrays,
                           entry.count)
            self._updater = None

    def _save_checkpoint(self, directory: str) -> None:
        with self._lock:
            values: dict[Key, Any] = {k: self._outgoing(k, xp.to_numpy(v)) for k, v in self._store.items()}
            for key, table in self._dynamic.items():  # the rows held, by id
                slots, _ = table.live_slots(0, table.used)
                ids = table.ids[slots]
                order = np.argsort(ids, kind="stable")
                shape = self._sparse.metas[key].shape
                rows = table.weight[slots[order]].reshape(-1, *shape[1:])
                values[key] = R.RowSparse(ids[order], rows, shape)
            states = None if self._optimizer is None else self._states_file(self._optimizer, True)
        snapshot.write(directory, values, states)

    def _view(self, key: Key, array: Any) -> Any:
        if xp.is_numpy(array) and self._meta[key].tensor:
            return sys.modules["torch"].from_numpy(array)
        return array

    def _to_device(self, key: Key, total: Any) -> Any:
        """Move ``key``'s stored value (and optimizer state) to ``total``'s GPU; return the stored value."""
        stored = self._store[key] = xp.like(total, xp.to_numpy(self._store[key]))
        state = None if self._optimizer is None else self._optimizer.states.get(key)
        if state is not None:
            self._optimizer.states[key] = {n: xp.like(total, xp.to_numpy(a)) for n, a in state.items()}
        return stored

    def _init(self, items: list[tuple[Key, np.ndarray]], members: WorkerSet | None = None) -> None:
        with self._lock:
            for key, array in items:
                self._store[key] = precision.master(array)  # bfloat16: a float32 master copy

    def _push(self, groups: list[Pushed], priority: int) -> None:
        items = [(key, self._compressed_sum(key, meta, values) if self._compression is not None
                  else self._sum(key, meta, values)) for key, meta, values in groups]
        items = [(key, precision.master(total) if xp.is_numpy(total) else total) for key, total in items]
        with self._lock:
            if self._optimizer is not None:
                for key, total in items:
                    if xp.dtype_of(total).kind != "f":
                        raise DTypeMismatchError(f"key {key!r} holds {xp.dtype_of(total)}; the optimizer "
                                                 "updates floating-point keys only")
            touched = []
            for key, total in items:
                stored = self._store[key]
                if xp.is_tensor(total) and not xp.same_place(stored, total):
                    stored = self._to_device(key, total)  # a GPU sum: the key moves to its GPU
                elif xp.is_numpy(total) and xp.is_tensor(stored):
                    total = xp.like(stored, total)  # CPU values for a key that lives on a GPU
                if self._optimizer is not None:
                    self._optimizer.update(key, stored, total)
                elif self._updater is None:
                    self._store[key] = total
                else:
                    self._updater(key, self._view(key, total), self._view(key, stored))
                touched.append(self._store[key])
            settle(touched)  # no GPU work on the store is left pending once the lock is released

    def _compressed_sum(self, key: Key, meta: Meta, values: list[Any]) -> Any:
        """MXNet's CommDevice: each value quantised with its own residual (on its device), the
        dequantised values summed."""
        spec = self._compression
        if meta.size < spec.size_lower_bound:
            return self._sum(key, meta, values)
        C.check_dtype(key, meta.dtype)
        plain = []
        with self._lock:
            for i, value in enumerate(values):
                flat = value.reshape(-1)
                residual = None
                if spec.residual:
                    residual = self._residuals.get((key, i))
                    if residual is None:
                        residual = self._residuals[(key, i)] = xp.zeros(flat, np.dtype(np.float32))
                wire = C.compress(spec, flat, residual)
                plain.append(C.decompress(spec.type, wire, meta.size, spec.threshold).reshape(meta.shape))
        return self._sum(key, meta, plain)

    # -- row-sparse keys (kvstore/sparse.py checks the arguments): a (rows, width) numpy table each ----
    def _rows_init(self, items: list[tuple]) -> None:
        with self._lock:
            for key, meta, spec, array in items:
                if meta.dynamic is not None:
                    self._dynamic[key] = DynamicRows(meta.width, meta.dtype, spec, meta.dynamic)
                    continue
                shape = (meta.num_rows, meta.width)
                self._store[key] = (R.generate(spec, 0, *shape, meta.dtype) if array is None
                                    else np.array(array, copy=True).reshape(shape))

    def _rows_push(self, items: list[tuple]) -> None:
        with self._lock:
            if self._updater is not None:
                raise UnsupportedError("row-sparse pushes are applied by an optimizer (set_optimizer) or "
                                       "assigned, never given to an updater function")
            for key, _, ids, rows in items:
                table = self._dynamic.get(key)
                if table is not None:
                    apply_dynamic(self._optimizer, key, table, ids, rows)
                else:
                    apply_rows(self._optimizer, key, self._store[key], ids, rows)

    def _rows_pull(self, key: Key, meta: R.SparseMeta, ids: np.ndarray, admit: bool = False) -> np.ndarray:
        with self._lock:
            table = self._dynamic.get(key)
            return self._store[key][ids] if table is None else table.read(ids, admit)

    def stats(self, cluster: bool = False) -> dict[str, Any]:
        """``{"dynamic_tables": {label: counters}}`` (labels: :func:`table_label`): each dynamic table's
        rows, evictions, admissions, expirations and hit rate (:meth:`DynamicRows.stats`), the one kind
        of counter a local store has (``cluster`` is accepted for the dist stores' signature: there is
        no other node)."""
        with self._lock:
            return {"dynamic_tables": {table_label(k): t.stats() for k, t in self._dynamic.items()}}

    def _pull(self, keys: list[Key], priority: int, outs: list[list[Any]] | None = None) -> list[Any]:
        with self._lock:
            copies = [xp.copy(self._store[k]) for k in keys]  # an updater may change them in place
            settle(copies)
            return [self._outgoing(k, c) for k, c in zip(keys, copies)]

    def _outgoing(self, key: Key, value: Any) -> Any:
        """``value`` as it leaves the store: a bfloat16 key's float32 master copy rounded to bfloat16."""
        meta = self._meta.get(key)  # a row-sparse table has none here: never bfloat16
        if meta is None or meta.dtype != BF16:
            return value
        return precision.narrow(xp.to_numpy(value))

    def barrier(self) -> None:
        """Nothing to wait for in a single process."""
        self._check_open()

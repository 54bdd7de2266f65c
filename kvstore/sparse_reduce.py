"""Sparse gradients summed over the workers through row-sparse keys, so that only the rows a step touched
travel (docs/sparse.md): what :func:`kvstore.DistributedOptimizer` does with ``nn.Embedding(sparse=True)``
gradients, and :class:`kvstore.SparseTrainer` with ``update_on_kvstore=False``.

* :class:`RowReducer` is the one implementation: numpy rows in, the sum over the workers of every row
  some worker touched out, the same on every worker.
* :class:`SparseGrads` puts a DistributedOptimizer's torch parameters through it.

torch is imported only when these are used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.base import KVStore
from kvstore.core import rowsparse as R
from kvstore.core.rowsparse import RowSparse
from kvstore.errors import ConfigError

Tensor = Any  # a torch.Tensor; torch is not imported when this module loads
# A worker's touched ids travel as float rows: float32 holds every id below 2**24 exactly.
_EXACT_FLOAT32 = 1 << 24


class RowReducer:
    """Sums row-sparse gradients of ``tables`` (``(name, shape, dtype)`` each) over the workers of
    ``kv``, moving only the rows touched (collective: every worker makes the same calls).

    Three row-sparse keys under ``prefix`` (never compressed; the store holds no optimizer for them:
    rows pushed in a round replace the stored rows with their sum over the workers):

    * ``{prefix}/rows/{name}``: the table's gradient rows, summed;
    * ``{prefix}/ids/{name}``: which rows each worker touched, worker r's ids in rows
      ``[r * num_rows, r * num_rows + n_r)`` (a slot a worker alone writes);
    * ``{prefix}/counts``: ``n_r`` of each table and worker, one row each.

    A step: every worker pushes its merged rows, its ids and its counts (a worker with no rows pushes
    none: a dist_sync round counts every worker), then pulls the counts, the ids of every worker's slot
    and the summed rows of their union.  Per step and table a worker sends its touched rows and their
    ids, and receives the union's rows and every worker's ids: nothing grows with the table.  The
    servers hold, per table, the table's size plus ``num_workers * num_rows`` ids.
    """

    def __init__(self, kv: KVStore, prefix: str, tables: Sequence[tuple[str, tuple[int, ...], Any]]) -> None:
        self.kv, self.prefix = kv, prefix
        self.tables = [(name, tuple(int(n) for n in shape), np.dtype(dtype)) for name, shape, dtype in tables]
        self.row_keys = [f"{prefix}/rows/{name}" for name, _, _ in self.tables]
        self.id_keys = [f"{prefix}/ids/{name}" for name, _, _ in self.tables]
        self.count_key = f"{prefix}/counts"
        self._pushed = False

    def _id_dtype(self, shape: tuple[int, ...]) -> np.dtype:
        return np.dtype(np.float32 if shape[0] <= _EXACT_FLOAT32 else np.float64)

    def init(self, values: Sequence[Any] | None = None) -> None:
        """Make the keys (collective).  ``values[i]``, when given, is table i's initial value (rank 0's
        is stored: :meth:`initial` reads it back); else the rows start at zero.  ConfigError when the
        store runs an optimizer (it would update the rows pushed instead of summing them)."""
        if not self.tables:
            return
        if self.kv.get_optimizer() is not None:
            raise ConfigError(f"summing sparse gradients needs a store that only sums, but this "
                              f"{self.kv.type} store runs an optimizer (a Trainer with update_on_kvstore, or "
                              "kv.set_optimizer, set one); use another store, or update_on_kvstore=True")
        workers = self.kv.num_workers
        for i, (key, ids, (_, shape, dtype)) in enumerate(zip(self.row_keys, self.id_keys, self.tables)):
            value = None if values is None else values[i]
            if value is None:
                self.kv.init(key, shape=shape, dtype=dtype.name)
            else:
                self.kv.init(key, value, stype="row_sparse")
            self.kv.init(ids, shape=(workers * shape[0], 1), dtype=self._id_dtype(shape).name)
        self.kv.init(self.count_key, shape=(len(self.tables) * workers, 1), dtype="float64")

    def initial(self, i: int) -> np.ndarray:
        """Table i as :meth:`init` stored it (rank 0's value), whole; call it before the first push."""
        shape = self.tables[i][1]
        return self.kv.row_sparse_pull(self.row_keys[i], row_ids=np.arange(shape[0])).rows.reshape(shape)

    def push(self, grads: Sequence[RowSparse | None]) -> None:
        """Send this worker's rows of every table (None: no rows), their ids and their counts; returns
        at once.  A gradient of another shape than its table, or with a row id outside the table,
        raises ValueError naming the table (and the id) after pushing a *poisoned* step instead (no
        rows, a negative count), so the round still closes and :meth:`pull` raises on every other
        worker rather than waiting for this one.  Raises what ``push`` raises (a row of another
        dtype), before anything is sent."""
        if len(grads) != len(self.tables):
            raise ValueError(f"{len(grads)} gradients for {len(self.tables)} tables")
        if not self.tables:
            return
        merged, bad = [], None
        for i, (grad, (name, shape, dtype)) in enumerate(zip(grads, self.tables)):
            if grad is None:
                merged.append((np.zeros(0, np.int64), np.zeros((0, *shape[1:]), dtype)))
                continue
            bad = bad or _refusal(i, name, shape, grad)
            if bad is None:
                merged.append(R.merge(grad.indices,
                                      np.asarray(grad.rows).reshape(len(grad.indices), *shape[1:])))
        if bad is not None:
            self._push_poisoned(*bad)
            raise ValueError(bad[3])
        self._send(merged, [len(ids) for ids, _ in merged], {})
        self._pushed = True

    def _push_poisoned(self, table: int, code: int, bad_id: int | None, why: str) -> None:
        """Push a step without rows whose count of ``table`` is ``code`` (< 0: what was wrong, read by
        :meth:`pull`), with ``bad_id`` in this worker's first id slot of it."""
        empty = [(np.zeros(0, np.int64), np.zeros((0, *shape[1:]), dtype)) for _, shape, dtype in self.tables]
        counts = [code if i == table else 0 for i in range(len(self.tables))]
        self._send(empty, counts, {} if bad_id is None else {table: bad_id})

    def _send(self, merged: list[tuple[np.ndarray, np.ndarray]], counts: list[int],
              first_ids: dict[int, int]) -> None:
        """Push each table's merged ``(ids, rows)``, its ids into this worker's slots (``first_ids``: a
        table's first slot's id instead, for a poisoned step) and ``counts``."""
        workers, rank = self.kv.num_workers, self.kv.rank
        slots = np.arange(len(self.tables), dtype=np.int64) * workers + rank
        values: list[Any] = []
        for (ids, rows), (_, shape, _) in zip(merged, self.tables):
            values.append(RowSparse(ids, rows, shape))
        for i, ((ids, _), (_, shape, _)) in enumerate(zip(merged, self.tables)):
            shown = np.array([first_ids[i]]) if i in first_ids else ids
            own = rank * shape[0] + np.arange(len(shown), dtype=np.int64)
            values.append(RowSparse(own, shown.astype(self._id_dtype(shape)).reshape(-1, 1),
                                    (workers * shape[0], 1)))
        values.append(RowSparse(slots, np.array(counts, np.float64).reshape(-1, 1),
                                (len(self.tables) * workers, 1)))
        self.kv.push([*self.row_keys, *self.id_keys, self.count_key], values)

    def pull(self) -> list[RowSparse]:
        """The summed rows of every row some worker touched in the round :meth:`push` sent, per table
        (sorted distinct ids): the same on every worker.  RuntimeError without a push first."""
        if not self.tables:
            return []
        if not self._pushed:
            raise RuntimeError("RowReducer.pull() without push() first")
        self._pushed = False
        workers = self.kv.num_workers
        counts = self.kv.row_sparse_pull(self.count_key, row_ids=np.arange(len(self.tables) * workers))
        counts = counts.rows.reshape(len(self.tables), workers).astype(np.int64)
        if (counts < 0).any():
            raise self._poisoned(counts)
        slots = [np.concatenate([r * shape[0] + np.arange(n, dtype=np.int64) for r, n in enumerate(row)])
                 for row, (_, shape, _) in zip(counts, self.tables)]
        got = self.kv.row_sparse_pull(self.id_keys, row_ids=slots)
        unions = [np.unique(ids.rows.reshape(-1).astype(np.int64)) for ids in got]
        summed = self.kv.row_sparse_pull(self.row_keys, row_ids=unions)
        return [RowSparse(union, rows.rows.reshape(len(union), *shape[1:]), shape)
                for union, rows, (_, shape, _) in zip(unions, summed, self.tables)]

    def _poisoned(self, counts: np.ndarray) -> ValueError:
        """The error of a step some worker poisoned (a negative count, :meth:`push`): names the worker,
        the table and what was wrong (the bad row id, read from that worker's first id slot)."""
        table, worker = (int(n) for n in np.argwhere(counts < 0)[0])
        name, shape, _ = self.tables[table]
        if counts[table, worker] == _BAD_SHAPE:
            what = f"a gradient of another shape than the table's {shape}"
        else:
            got = self.kv.row_sparse_pull(self.id_keys[table], row_ids=np.array([worker * shape[0]]))
            what = f"row id {int(got.rows.reshape(-1)[0])} outside [0, {shape[0]})"
        return ValueError(f"worker {worker} pushed {what} for table {name!r}: this step's sparse reduction "
                          f"failed on every worker (nothing was summed); the next step starts afresh")

    def reduce(self, grads: Sequence[RowSparse | None]) -> list[RowSparse]:
        """:meth:`push` then :meth:`pull`."""
        self.push(grads)
        return self.pull()


_BAD_ID, _BAD_SHAPE = -1, -2  # a poisoned step's count (RowReducer.push): what was wrong


def _refusal(table: int, name: str, shape: tuple[int, ...],
             grad: RowSparse) -> tuple[int, int, int | None, str] | None:
    """Why table ``table``'s gradient cannot be pushed, as ``(table, count code, bad id or None,
    message)``, or None when it can: another shape than the table's, or a row id outside it."""
    if tuple(grad.shape) != shape:
        return table, _BAD_SHAPE, None, f"table {name!r} is {shape}, its gradient {tuple(grad.shape)}"
    ids = grad.indices
    outside = ids[(ids < 0) | (ids >= shape[0])] if ids.size else ids
    if outside.size:
        return (table, _BAD_ID, int(outside[0]),
                f"table {name!r} has {shape[0]} rows, but its gradient has row id {int(outside[0])}")
    return None


class SparseGrads:
    """The parameters of a DistributedOptimizer whose gradients are sparse (``nn.Embedding(sparse=True)``)
    and that the optimizer needs sparse (``torch.optim.SparseAdam``): summed over the workers by a
    :class:`RowReducer` (keys under ``prefix``, each table named as its parameter), so only the rows a
    step touched travel.

    Which parameters: decided at the first step, over every worker (a gradient sparse on any worker),
    and kept.  Each step every worker pushes its rows (none when it has no gradient) before the dense
    pushpull and pulls the summed rows of every row some worker touched after it: the reduced
    gradient, sparse, on every worker alike."""

    def __init__(self, kv: KVStore, prefix: str, names: list[str], as_dense: bool) -> None:
        self.kv, self.prefix, self.names, self.as_dense = kv, prefix, names, as_dense
        self.chosen: list[int] = []  # indices into the wrapper's parameters
        self.reducer: RowReducer | None = None

    def decide(self, params: list[Tensor]) -> None:
        """Choose the parameters whose gradient is sparse on some worker (collective: one small
        pushpull, the first step only; nothing with ``sparse_as_dense``)."""
        import torch

        if self.as_dense:
            return
        kinds = torch.tensor([p.grad is not None and p.grad.is_sparse for p in params], dtype=torch.float32)
        key = f"{self.prefix}/sparse"
        self.kv.init(key, torch.zeros_like(kinds))
        self.kv.pushpull(key, kinds)
        self.chosen = [i for i, seen in enumerate(kinds.tolist()) if seen > 0]

    def init(self, params: list[Tensor]) -> None:
        """Make the chosen parameters' keys (their rows start at zero, on the servers)."""
        self.reducer = RowReducer(self.kv, self.prefix, [(self.names[i], tuple(params[i].shape),
                                                          _np_dtype(params[i])) for i in self.chosen])
        self.reducer.init()

    def push(self, params: list[Tensor]) -> None:
        """Push each chosen parameter's rows (every row for a dense gradient); returns at once."""
        grads: list[RowSparse | None] = []
        for i in self.chosen:
            p = params[i]
            if p.grad is None:
                grads.append(None)
            elif p.grad.is_sparse:
                value = p.grad.detach().coalesce()
                grads.append(RowSparse(value.indices()[0].cpu(), value.values().cpu(), tuple(p.shape)))
            else:  # a dense gradient for a table: every row
                grads.append(RowSparse(np.arange(p.shape[0]), p.grad.detach().cpu(), tuple(p.shape)))
        if self.reducer is None:
            raise RuntimeError("SparseGrads.push() before init()")
        self.reducer.push(grads)

    def pull(self, params: list[Tensor], present: Tensor, scale: float) -> None:
        """Give each chosen parameter the summed rows of every row some worker touched (times
        ``scale``), as a sparse gradient; None where no worker had a gradient."""
        import torch

        if self.reducer is None:
            return
        for i, got in zip(self.chosen, self.reducer.pull()):
            p = params[i]
            if present[i] == 0:
                p.grad = None
                continue
            ids = torch.from_numpy(got.indices)
            rows = torch.as_tensor(np.asarray(got.rows), dtype=p.dtype).reshape(len(ids), *p.shape[1:])
            if scale != 1.0:
                rows = rows * scale
            p.grad = torch.sparse_coo_tensor(ids.reshape(1, -1), rows, tuple(p.shape), is_coalesced=True,
                                             check_invariants=False)  # ids: sorted, distinct, in range


def _np_dtype(p: Tensor) -> np.dtype:
    """The numpy dtype of a float tensor ``p``."""
    return np.dtype(str(p.dtype).removeprefix("torch."))

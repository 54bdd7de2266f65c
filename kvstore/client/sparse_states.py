"""The optimizer state of row-sparse keys in ``save_optimizer_states`` / ``load_optimizer_states`` of a
dist store: gathered whole from the servers' row ranges (SPARSE_PULL with ``state``) by the worker
that writes the file, and scattered back in row messages (SPARSE_SET with ``state``) to any number of
servers.  The file holds them as it holds a dense key's state (docs/formats.md)."""

from __future__ import annotations

import numpy as np

from kvstore.client.sparse import DistRows
from kvstore.core import checkpoint
from kvstore.core import rowsparse as R
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key
from kvstore.errors import DTypeMismatchError, OptimizerError, ShapeMismatchError, UnsupportedError
from kvstore.net.protocol import Message, Op


def _cuts(rows: DistRows, meta: R.SparseMeta, names: int = 1) -> list[tuple[int, int, int]]:
    """``(server, start, stop)`` row messages covering the table, each at most a chunk of ``names``
    arrays of rows."""
    step = max(1, rows.rows_per_message(meta) // max(1, names))
    return [(server, start, min(hi, start + step)) for server, lo, hi in rows.ranges(meta)
            for start in range(lo, hi, step)]


def _refuse_dynamic(what: str, metas: dict[Key, R.SparseMeta]) -> None:
    dynamic = sorted(str(k) for k, m in metas.items() if m.dynamic is not None)
    if dynamic:
        raise UnsupportedError(f"{what}: dynamic tables ({dynamic}) are not saved yet (docs/sparse.md, "
                               "'Dynamic tables')")


def gather(rows: DistRows, metas: dict[Key, R.SparseMeta]) -> list[checkpoint.StateEntry]:
    """Every row-sparse key's state, whole (keys never updated have none and are left out);
    UnsupportedError for a dynamic table (not saved yet)."""
    _refuse_dynamic("save_optimizer_states", metas)
    entries = []
    for key, meta in metas.items():
        cuts = _cuts(rows, meta, 4)  # adam keeps two arrays, mixed precision three: a reply stays small
        submit = rows.link.path.mux.submit
        requests = [submit(server, Message(Op.SPARSE_PULL, {"key": key, "after": 0, "state": True},
                                                     [np.arange(start, stop, dtype=np.int64)]),
                                     f"state rows [{start}, {stop}) of key {key!r} from server {server}")
                    for server, start, stop in cuts]
        replies = rows.link.path.wait(requests)
        names = {tuple(r.body.get("names", ())) for r in replies}
        if len(names) != 1:
            raise OptimizerError(f"the servers disagree on the optimizer state of key {key!r}: {names}")
        (state_names,) = names
        if not state_names:
            continue
        arrays = {name: np.concatenate([r.arrays[i] for r in replies]).reshape(meta.shape)
                  for i, name in enumerate(state_names)}
        count = max(int(r.body.get("count", 0)) for r in replies)
        entries.append(checkpoint.StateEntry(key, meta.shape, meta.dtype, count, arrays))
    return entries


def tables(rows: DistRows, metas: dict[Key, R.SparseMeta]) -> dict[Key, np.ndarray]:
    """Every row-sparse table, whole, for a snapshot (the writing worker holds them while it writes);
    UnsupportedError for a dynamic table (not saved yet)."""
    _refuse_dynamic("save_checkpoint", metas)
    return {key: rows.pull(key, meta, np.arange(meta.num_rows, dtype=np.int64)).reshape(meta.shape)
            for key, meta in metas.items()}


def check(entries: list[checkpoint.StateEntry], metas: dict[Key, R.SparseMeta], optimizer: Optimizer) -> None:
    """Raise (before anything is sent) when a row-sparse key's saved state does not fit its table or
    the optimizer: OptimizerError for other state names, ShapeMismatchError for another shape,
    DTypeMismatchError for another dtype (of the table, or of a state array)."""
    for entry in entries:
        meta = metas[entry.key]
        mixed = "weight32" in optimizer.state_names(meta.dtype)  # a float32 master copy
        dtype = np.dtype(np.float32) if mixed else meta.dtype  # as create_state
        bad = [f"{n} {a.dtype}" for n, a in entry.arrays.items() if a.dtype != dtype]
        if np.dtype(entry.dtype) != meta.dtype or bad:
            raise DTypeMismatchError(f"key {entry.key!r}: saved state is for a {np.dtype(entry.dtype)} table "
                                     f"({', '.join(bad) or 'its arrays fit'}); the table is {meta.dtype} "
                                     f"and its state arrays {dtype}")
        want = set(optimizer.state_names(meta.dtype))
        if set(entry.arrays) != want:
            raise OptimizerError(f"key {entry.key!r}: {optimizer.name} state needs arrays {sorted(want)}, "
                                 f"got {sorted(entry.arrays)}")
        for name, array in entry.arrays.items():
            if array.size != meta.num_rows * meta.width:
                raise ShapeMismatchError(f"key {entry.key!r}: saved state {name!r} of {array.size} elements "
                                         f"does not fit the {meta.shape} table")


def scatter(rows: DistRows, entries: list[checkpoint.StateEntry], metas: dict[Key, R.SparseMeta]) -> None:
    """Install the checked ``entries`` on the servers holding each table's rows."""
    requests = []
    for entry in entries:
        meta = metas[entry.key]
        for name, array in entry.arrays.items():
            table = np.ascontiguousarray(array).reshape(meta.num_rows, meta.width)
            for server, start, stop in _cuts(rows, meta):
                body = {"key": entry.key, "state": name, "count": entry.count}
                ids = np.arange(start, stop, dtype=np.int64)
                msg = Message(Op.SPARSE_SET, body, [ids, table[start:stop]])
                what = f"state {name!r} of key {entry.key!r} rows [{start}, {stop}) to server {server}"
                requests.append(rows.link.path.mux.submit(server, msg, what))
                if len(requests) >= 8:
                    rows.link.path.wait(requests)
                    requests = []
    rows.link.path.wait(requests)

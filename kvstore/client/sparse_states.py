"""The optimizer state of row-sparse keys in ``save_optimizer_states`` / ``load_optimizer_states`` of a
dist store: gathered whole from the servers' row ranges (SPARSE_PULL with ``state``) by the worker
that writes the file, and scattered back in row messages (SPARSE_SET with ``state``) to any number of
servers.  The file holds them as it holds a dense key's state (docs/formats.md)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvstore.client.sparse import DistRows
from kvstore.core import checkpoint
from kvstore.core import rowsparse as R
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key
from kvstore.errors import DTypeMismatchError, OptimizerError, ShapeMismatchError
from kvstore.net.protocol import Message, Op


def _cuts(rows: DistRows, meta: R.SparseMeta, names: int = 1) -> list[tuple[int, int, int]]:
    """``(server, start, stop)`` row messages covering the table, each at most a chunk of ``names``
    arrays of rows."""
    step = max(1, rows.rows_per_message(meta) // max(1, names))
    return [(server, start, min(hi, start + step)) for server, lo, hi in rows.ranges(meta)
            for start in range(lo, hi, step)]


def walk_dynamic(rows: DistRows, key: Key, meta: R.SparseMeta,
                 state: bool) -> Iterator[tuple[int, Message]]:
    """Each server's rows of dynamic table ``key``, one reply of at most a chunk at a time
    (``(server, reply)``: arrays ``[ids, rows, *states]``, ``state``: with the optimizer's rows)."""
    limit = max(1, rows.rows_per_message(meta) // 4)
    for server in range(rows.link.path.cluster.num_servers):
        start = 0
        while start >= 0:
            body = {"key": key, "after": 0, "held": start, "limit": limit, "state": state}
            msg = Message(Op.SPARSE_PULL, body, [np.zeros(0, np.int64)])
            what = f"rows held of dynamic key {key!r} from slot {start} of server {server}"
            (reply,) = rows.link.path.wait([rows.link.path.mux.submit(server, msg, what)])
            yield server, reply
            start = int(reply.body["next"])


def _gather_dynamic(rows: DistRows, key: Key, meta: R.SparseMeta) -> checkpoint.StateEntry | None:
    """Dynamic ``key``'s state rows held on every server, sorted by id (None: never updated)."""
    ids, parts, names, count = [], [], set(), 0
    for _, reply in walk_dynamic(rows, key, meta, True):
        names.add(tuple(reply.body.get("names", ())))
        count = max(count, int(reply.body.get("count", 0)))
        ids.append(reply.arrays[0])
        parts.append(reply.arrays[2:])
    names.discard(())  # a server without rows answers no state
    if len(names) > 1:
        raise OptimizerError(f"the servers disagree on the optimizer state of key {key!r}: {names}")
    if not names:
        return None
    (state_names,) = names
    all_ids = np.concatenate(ids)
    order = np.argsort(all_ids, kind="stable")
    n = all_ids.size
    arrays = {name: np.concatenate([p[i] for p in parts if p]).reshape(n, meta.width)[order]
              .reshape(n, *meta.shape[1:]) for i, name in enumerate(state_names)}
    return checkpoint.StateEntry(key, (n, *meta.shape[1:]), meta.dtype, count, arrays, all_ids[order])


def gather(rows: DistRows, metas: dict[Key, R.SparseMeta]) -> list[checkpoint.StateEntry]:
    """Every row-sparse key's state, whole (keys never updated have none and are left out); a dynamic
    table's is the rows its servers hold, with their ids."""
    entries = []
    for key, meta in metas.items():
        if meta.dynamic is not None:
            entry = _gather_dynamic(rows, key, meta)
            if entry is not None:
                entries.append(entry)
            continue
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


def _dynamic_rows(rows: DistRows, key: Key, meta: R.SparseMeta) -> R.RowSparse:
    """Dynamic ``key``'s rows held on every server, sorted by id."""
    ids, parts = [], []
    for _, reply in walk_dynamic(rows, key, meta, False):
        ids.append(reply.arrays[0])
        parts.append(reply.arrays[1])
    all_ids = np.concatenate(ids)
    order = np.argsort(all_ids, kind="stable")
    held = np.concatenate(parts)[order].reshape(all_ids.size, *meta.shape[1:])
    return R.RowSparse(all_ids[order], held, meta.shape)


def tables(rows: DistRows, metas: dict[Key, R.SparseMeta]) -> dict[Key, np.ndarray | R.RowSparse]:
    """Every row-sparse table for a snapshot (the writing worker holds them while it writes): a fixed
    table whole, a dynamic table as a RowSparse of the rows its servers hold."""
    return {key: _dynamic_rows(rows, key, meta) if meta.dynamic is not None
            else rows.pull(key, meta, np.arange(meta.num_rows, dtype=np.int64)).reshape(meta.shape)
            for key, meta in metas.items()}


def check(entries: list[checkpoint.StateEntry], metas: dict[Key, R.SparseMeta], optimizer: Optimizer) -> None:
    """Raise (before anything is sent) when a row-sparse key's saved state does not fit its table or
    the optimizer: OptimizerError for other state names, ShapeMismatchError for another shape,
    DTypeMismatchError for another dtype (of the table, or of a state array)."""
    for entry in entries:
        meta = metas[entry.key]
        if (meta.dynamic is None) != (entry.ids is None):
            kind = "a fixed" if entry.ids is None else "a dynamic"
            raise ShapeMismatchError(f"key {entry.key!r}: the saved state is {kind} table's; the key is not")
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
        if entry.ids is not None:
            if np.unique(entry.ids).size != entry.ids.size:
                raise OptimizerError(f"key {entry.key!r}: saved row ids repeat")
            if tuple(entry.shape[1:]) != tuple(meta.shape[1:]):
                raise ShapeMismatchError(f"key {entry.key!r}: saved state rows of {entry.shape[1:]} do not "
                                         f"fit rows of {meta.shape[1:]}")
            continue
        for name, array in entry.arrays.items():
            if array.size != meta.num_rows * meta.width:
                raise ShapeMismatchError(f"key {entry.key!r}: saved state {name!r} of {array.size} elements "
                                         f"does not fit the {meta.shape} table")


def scatter(rows: DistRows, entries: list[checkpoint.StateEntry], metas: dict[Key, R.SparseMeta]) -> None:
    """Install the checked ``entries`` on the servers holding each table's rows."""
    requests = []
    for entry in entries:
        meta = metas[entry.key]
        if entry.ids is not None:
            _scatter_dynamic(rows, entry, meta)
            continue
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


def _scatter_dynamic(rows: DistRows, entry: checkpoint.StateEntry, meta: R.SparseMeta) -> None:
    """Send a dynamic table's saved state rows to the servers their ids hash to, in chunks."""
    assert entry.ids is not None
    order = np.argsort(entry.ids, kind="stable")
    ids = entry.ids[order]
    step = max(1, rows.rows_per_message(meta))
    requests = []
    for name, array in entry.arrays.items():
        table = np.ascontiguousarray(array).reshape(ids.size, meta.width)[order]
        for server, where in rows.dynamic_cuts(ids):
            for start in range(0, where.size, step):
                part = where[start:start + step]
                body = {"key": entry.key, "state": name, "count": entry.count}
                msg = Message(Op.SPARSE_SET, body, [ids[part], table[part]])
                what = f"state {name!r} of {part.size} rows of dynamic key {entry.key!r} to server {server}"
                requests.append(rows.link.path.mux.submit(server, msg, what))
                if len(requests) >= 8:
                    rows.link.path.wait(requests)
                    requests = []
    rows.link.path.wait(requests)

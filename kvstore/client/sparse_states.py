"""Row-sparse keys in ``save_optimizer_states`` / ``load_optimizer_states`` and ``save_checkpoint`` of a
dist store: tables and their optimizer state streamed from the servers (SPARSE_PULL of row ranges, or
a walk of a dynamic table's pool) a chunk at a time while the worker that writes the file writes it,
and states scattered back in row messages (SPARSE_SET with ``state``) to any number of
servers.  The file holds them as it holds a dense key's state (docs/formats.md)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvstore.client.sparse import DistRows, SetCall
from kvstore.core import checkpoint, snapshot
from kvstore.core import rowsparse as R
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key
from kvstore.errors import DTypeMismatchError, OptimizerError, ShapeMismatchError
from kvstore.net.protocol import Message, Op

IN_FLIGHT = 8  # state messages of a fixed table sent before their acks are waited for (as an init's rows)


def _cuts(rows: DistRows, meta: R.SparseMeta, names: int = 1) -> list[tuple[int, int, int]]:
    """``(server, start, stop)`` row messages covering the table, each at most a chunk of ``names``
    arrays of rows."""
    step = max(1, rows.rows_per_message(meta) // max(1, names))
    return [(server, start, min(hi, start + step)) for server, lo, hi in rows.ranges(meta)
            for start in range(lo, hi, step)]


def walk_dynamic(rows: DistRows, key: Key, meta: R.SparseMeta, state: bool,
                 limit: int = 0) -> Iterator[tuple[int, Message]]:
    """Each server's rows of dynamic table ``key``, one reply of at most a chunk (or ``limit`` rows)
    at a time (``(server, reply)``: arrays ``[ids, rows, *states]``, ``state``: with the optimizer's
    rows; ``rows`` in the body: how many that server holds)."""
    limit = limit or max(1, rows.rows_per_message(meta) // 4)
    for server in range(rows.link.path.cluster.num_servers):
        start = 0
        while start >= 0:
            body = {"key": key, "after": 0, "held": start, "limit": limit, "state": state}
            msg = Message(Op.SPARSE_PULL, body, [np.zeros(0, np.int64)])
            what = f"rows held of dynamic key {key!r} from slot {start} of server {server}"
            (reply,) = rows.link.path.wait([rows.link.path.mux.submit(server, msg, what)])
            yield server, reply
            start = int(reply.body["next"])


def _probe_dynamic(rows: DistRows, key: Key, meta: R.SparseMeta) -> tuple[int, int, dict[str, np.dtype]]:
    """``(rows held, update count, {state name: dtype})`` of dynamic ``key`` over every server (one
    row asked of each)."""
    held, count, names = 0, 0, set()
    dtypes: dict[str, np.dtype] = {}
    for server in range(rows.link.path.cluster.num_servers):
        body = {"key": key, "after": 0, "held": 0, "limit": 1, "state": True}
        msg = Message(Op.SPARSE_PULL, body, [np.zeros(0, np.int64)])
        (reply,) = rows.link.path.wait([rows.link.path.mux.submit(server, msg, f"rows held of {key!r}")])
        held += int(reply.body["rows"])
        count = max(count, int(reply.body.get("count", 0)))
        got = tuple(reply.body.get("names", ()))
        names.add(got)
        dtypes.update((n, a.dtype) for n, a in zip(got, reply.arrays[2:]))
    names.discard(())  # a server without rows answers no state
    if len(names) > 1:
        raise OptimizerError(f"the servers disagree on the optimizer state of key {key!r}: {names}")
    return held, count, dtypes


def _walked(rows: DistRows, key: Key, meta: R.SparseMeta, index: int, state: bool,
            held: int) -> checkpoint.Chunked:
    """Array ``index`` of every walk reply of dynamic ``key`` (0: ids, 1: rows, 2...: states), streamed;
    ValueError (the file is not written) when the servers' rows changed since they were counted."""
    def chunks() -> Iterator[np.ndarray]:
        for _, reply in walk_dynamic(rows, key, meta, state):
            yield reply.arrays[index]
    if index == 0:
        return checkpoint.Chunked((held,), np.dtype(np.int64), chunks)
    return checkpoint.Chunked((held, *meta.shape[1:]), np.dtype(meta.dtype), chunks)


def _gather_dynamic(rows: DistRows, key: Key, meta: R.SparseMeta) -> checkpoint.StateEntry | None:
    """Dynamic ``key``'s state rows held on every server, with their ids, streamed server by server
    when written (None: never updated)."""
    held, count, dtypes = _probe_dynamic(rows, key, meta)
    if not dtypes:
        return None
    arrays = {}
    for i, (name, dtype) in enumerate(dtypes.items()):
        stream = _walked(rows, key, meta, 2 + i, True, held)
        arrays[name] = checkpoint.Chunked(stream.shape, dtype, stream.chunks)
    ids = _walked(rows, key, meta, 0, False, held)
    return checkpoint.StateEntry(key, (held, *meta.shape[1:]), meta.dtype, count, arrays, ids)


def _gather_fixed(rows: DistRows, key: Key, meta: R.SparseMeta) -> checkpoint.StateEntry | None:
    """Fixed ``key``'s state arrays, each streamed a chunk of rows at a time when written (None:
    never updated)."""
    submit = rows.link.path.mux.submit
    probes = [submit(server, Message(Op.SPARSE_PULL, {"key": key, "after": 0, "state": True},
                                     [np.arange(lo, lo + 1, dtype=np.int64)]),
                     f"state of key {key!r} from server {server}")
              for server, lo, _ in rows.ranges(meta)]
    replies = rows.link.path.wait(probes)
    names = {tuple(r.body.get("names", ())) for r in replies}
    if len(names) != 1:
        raise OptimizerError(f"the servers disagree on the optimizer state of key {key!r}: {names}")
    (state_names,) = names
    if not state_names:
        return None
    count = max(int(r.body.get("count", 0)) for r in replies)
    cuts = _cuts(rows, meta, 4)  # adam keeps two arrays, mixed precision three: a reply stays small

    def stream(index: int) -> Iterator[np.ndarray]:
        for server, start, stop in cuts:
            msg = Message(Op.SPARSE_PULL, {"key": key, "after": 0, "state": True},
                          [np.arange(start, stop, dtype=np.int64)])
            what = f"state rows [{start}, {stop}) of key {key!r} from server {server}"
            (reply,) = rows.link.path.wait([submit(server, msg, what)])
            yield reply.arrays[index]

    arrays = {name: checkpoint.Chunked(meta.shape, replies[0].arrays[i].dtype,
                                       lambda i=i: stream(i))
              for i, name in enumerate(state_names)}
    return checkpoint.StateEntry(key, meta.shape, meta.dtype, count, arrays)


def gather(rows: DistRows, metas: dict[Key, R.SparseMeta]) -> list[checkpoint.StateEntry]:
    """Every row-sparse key's state (keys never updated have none and are left out), as arrays the
    file writer streams from the servers a chunk at a time: the writing worker never holds a table's
    state whole.  A dynamic table's is the rows its servers hold, with their ids."""
    entries = []
    for key, meta in metas.items():
        gathered = _gather_dynamic if meta.dynamic is not None else _gather_fixed
        entry = gathered(rows, key, meta)
        if entry is not None:
            entries.append(entry)
    return entries


def tables(rows: DistRows, metas: dict[Key, R.SparseMeta]) -> dict[Key, snapshot.Value]:
    """Every row-sparse table for a snapshot, streamed from the servers a chunk of rows at a time as
    the file is written (the writing worker never holds one whole): a fixed table as its whole value,
    a dynamic table as the rows its servers hold and their ids."""
    out: dict[Key, snapshot.Value] = {}
    for key, meta in metas.items():
        if meta.dynamic is not None:
            held, _, _ = _probe_dynamic(rows, key, meta)
            out[key] = snapshot.HeldRows(_walked(rows, key, meta, 0, False, held),
                                         _walked(rows, key, meta, 1, False, held))
            continue
        step = rows.rows_per_message(meta)

        def chunks(key: Key = key, meta: R.SparseMeta = meta, step: int = step) -> Iterator[np.ndarray]:
            for start in range(0, meta.num_rows, step):
                ids = np.arange(start, min(meta.num_rows, start + step), dtype=np.int64)
                yield rows.pull(key, meta, ids)

        out[key] = checkpoint.Chunked(meta.shape, np.dtype(meta.dtype), chunks)
    return out


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
        if entry.ids is not None:  # (left in the file, they are checked per message by the servers)
            if isinstance(entry.ids, np.ndarray) and np.unique(entry.ids).size != entry.ids.size:
                raise OptimizerError(f"key {entry.key!r}: saved row ids repeat")
            if tuple(entry.shape[1:]) != tuple(meta.shape[1:]):
                raise ShapeMismatchError(f"key {entry.key!r}: saved state rows of {entry.shape[1:]} do not "
                                         f"fit rows of {meta.shape[1:]}")
            continue
        for name, array in entry.arrays.items():
            if array.size != meta.num_rows * meta.width:
                raise ShapeMismatchError(f"key {entry.key!r}: saved state {name!r} of {array.size} elements "
                                         f"does not fit the {meta.shape} table")


def scatter(rows: DistRows, entries: list[checkpoint.StateEntry], metas: dict[Key, R.SparseMeta],
            call: SetCall | None = None) -> None:
    """Install the checked ``entries`` on the servers holding each table's rows, a chunk of rows at a
    time (an entry left in its file is never held whole; at most IN_FLIGHT messages wait for their
    acks).  Every array left in the file is read through once first (its CRC checked): a damaged file
    is refused before a row of state is sent.  The messages are sets of ``call`` (settled by the
    caller), or of a call of their own settled at the end."""
    checkpoint.check_stored(*(a for e in entries for a in (e.ids, *e.arrays.values())))
    own = call is None
    call = SetCall(rows) if call is None else call  # settled: a restart cannot bring back what they replaced
    for entry in entries:
        meta = metas[entry.key]
        if entry.ids is not None:
            _scatter_dynamic(rows, entry, meta, call)
            continue
        cuts = _cuts(rows, meta)
        requests = []
        for name, array in entry.arrays.items():
            chunks = checkpoint.runs(array, [(stop - start) * meta.width for _, start, stop in cuts], True)
            for (server, start, stop), chunk in zip(cuts, chunks):
                body = call.stamp(server, entry.key, {"key": entry.key, "state": name, "count": entry.count})
                ids = np.arange(start, stop, dtype=np.int64)
                msg = Message(Op.SPARSE_SET, body, [ids, chunk.reshape(stop - start, meta.width)])
                what = f"state {name!r} of key {entry.key!r} rows [{start}, {stop}) to server {server}"
                requests.append(rows.link.path.mux.submit(server, msg, what))
                if len(requests) >= IN_FLIGHT:  # a few in flight: the wire holds a few chunks of rows
                    rows.link.path.wait(requests)
                    requests = []
        rows.link.path.wait(requests)
    if own:
        call.settle()


def _scatter_dynamic(rows: DistRows, entry: checkpoint.StateEntry, meta: R.SparseMeta, call: SetCall) -> None:
    """Send a dynamic table's saved state rows to the servers their ids hash to, a chunk of rows (of
    every state array) at a time."""
    assert entry.ids is not None
    step = max(1, rows.rows_per_message(meta) // max(1, len(entry.arrays)))
    total = int(entry.shape[0])
    sizes = [min(step, total - start) for start in range(0, total, step)]
    ids_runs = checkpoint.runs(entry.ids, sizes, True)  # checked by scatter
    state_runs = {name: checkpoint.runs(array, [n * meta.width for n in sizes], True)
                  for name, array in entry.arrays.items()}
    for n in sizes:
        ids = next(ids_runs)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        states = {name: next(run).reshape(n, meta.width)[order] for name, run in state_runs.items()}
        requests = []
        for server, where in rows.dynamic_cuts(ids):
            if not where.size:
                continue
            for name, table in states.items():
                body = call.stamp(server, entry.key, {"key": entry.key, "state": name, "count": entry.count})
                msg = Message(Op.SPARSE_SET, body, [ids[where], table[where]])
                what = f"state {name!r} of {where.size} rows of dynamic key {entry.key!r} to server {server}"
                requests.append(rows.link.path.mux.submit(server, msg, what))
        rows.link.path.wait(requests)

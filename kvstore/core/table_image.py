"""A server's row-sparse tables in its shard (docs/failures.md, docs/formats.md ``server_shard``), pure.

:func:`capture` copies each table a server holds (:class:`~kvstore.core.sparse_shard.RowTables`) as of
one instant between two requests: a fixed table's row range, a dynamic table's rows with their ids
and counters (:meth:`DynamicRows.snapshot`), the optimizer's state rows of either and the key's update
count, and the round bookkeeping a restart needs (rounds closed, each worker's pushes applied).  An
open round's rows are never in it: they are applied only when the round closes.  Unlike a dense
key's value (never written to: each update stores a new array) a table is updated in place, so its
rows are copied, as the optimizer's state is.

:func:`entries` and :func:`from_entries` turn the images into the shard manifest's ``tables`` entries
and arrays and back (checking everything, :class:`FormatError` naming what is wrong); :func:`install`
puts them into a restarted server's tables and optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.core import rowsparse as R
from kvstore.core.dtypes import BY_NAME, dtype_name
from kvstore.core.dynamic import DynamicImage, DynamicRows, fit_state, state_of
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key, check_key
from kvstore.core.sparse_shard import RowTables, Table
from kvstore.errors import FormatError, KeyTypeError


@dataclass
class TableImage:
    """One row-sparse key's table on one server, as of the image.

    A fixed table: ``shape`` the whole table's, rows ``[lo, hi)`` in ``rows``.  A dynamic one
    (``dynamic`` set): ``shape`` a row's, ``rows`` the rows held (``dynamic`` has their ids and
    counters), ``init`` and ``spec`` its initialiser and DynamicSpec."""

    shape: tuple[int, ...]
    rows: np.ndarray
    round: int = 0  # rounds closed (dist_sync)
    applied: dict[int, int] = field(default_factory=dict)  # dist_async: worker -> its highest push
    # number applied + 1 (its retries of pushes numbered below it are dropped after a restart)
    count: int | None = None  # the key's optimizer update count (None: never updated)
    states: dict[str, np.ndarray] = field(default_factory=dict)  # state name -> its rows, as ``rows``
    lo: int = 0
    hi: int = 0
    dynamic: DynamicImage | None = None
    init: dict[str, Any] = field(default_factory=dict)
    spec: R.DynamicSpec | None = None


def copied(array: np.ndarray, spare: np.ndarray | None) -> np.ndarray:
    """A copy of ``array``, into ``spare`` when that has its shape and dtype (no new allocation)."""
    if spare is not None and spare.shape == array.shape and spare.dtype == array.dtype:
        np.copyto(spare, array)
        return spare
    return np.array(array, copy=True)


def capture(tables: RowTables, optimizer: Optimizer | None,
            spare: dict[Key, TableImage] | None = None) -> dict[Key, TableImage]:
    """A copy of every table of ``tables`` and of ``optimizer``'s state of it, as of now.  ``spare``:
    the tables of an earlier image nobody reads any more, whose fixed tables' arrays take the copies
    (memory already touched: several times faster than fresh pages)."""
    found: dict[Key, TableImage] = {}
    spare = spare or {}
    for key, table in tables.tables.items():
        count = None if optimizer is None else optimizer.counts.get(key)
        round_ = table.applied if tables.sync else 0
        if table.dynamic is None:
            states = {} if optimizer is None else optimizer.states.get(key) or {}
            old = spare.get(key)
            image = TableImage(table.shape, copied(table.weight, old.rows if old is not None else None),
                               round_, dict(table.numbered), count,
                               {n: copied(a, old.states.get(n) if old is not None else None)
                                for n, a in states.items()}, table.lo, table.hi)
        else:
            rows = table.dynamic
            snap = rows.snapshot()
            got = None if optimizer is None else state_of(optimizer, key, rows, snap.slots)
            image = TableImage(table.shape[1:], snap.rows, round_, dict(table.numbered), count, got or {},
                               dynamic=snap, init=dict(rows.init), spec=rows.spec)
        found[key] = image
    return found


def install(tables: RowTables, optimizer: Optimizer | None, images: dict[Key, TableImage]) -> None:
    """Hold ``images`` in ``tables`` (a restarted server's, holding none of them yet) and their state
    in ``optimizer`` (when set): rows, counters, rounds, update counts."""
    for key, image in images.items():
        width = int(np.prod(image.shape[1:] if image.dynamic is None else image.shape, dtype=np.int64))
        if image.dynamic is None:
            weight = image.rows.reshape(image.hi - image.lo, width)
            tables.restore(key, Table(image.shape, image.lo, image.hi, weight), image.round, image.applied)
            if optimizer is not None and image.states:
                optimizer.states[key] = {n: a.reshape(weight.shape) for n, a in image.states.items()}
        else:
            assert image.spec is not None
            rows = DynamicRows(width, image.rows.dtype, image.init, image.spec, tables.clock)
            slots = rows.restore(image.dynamic)
            empty = np.zeros((0, width), rows.dtype)
            table = Table((R.DYNAMIC_ROWS, *image.shape), 0, 0, empty, dynamic=rows)
            tables.restore(key, table, image.round, image.applied)
            if optimizer is not None and image.states:
                optimizer.states[key] = optimizer.create_state(key, rows.weight)
                fit_state(optimizer, key, rows.weight, np.zeros(0, np.int64))
                for name, array in optimizer.states[key].items():
                    if name in image.states:  # a saved state the optimizer keeps (the shard's own)
                        array[slots] = image.states[name].reshape(slots.size, width)
        if optimizer is not None and image.count is not None:
            optimizer.counts[key] = image.count
            optimizer.num_update = max(optimizer.num_update, image.count)


def entries(images: dict[Key, TableImage], arrays: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The manifest's ``tables`` entries of ``images``; their arrays are added to ``arrays``."""
    out = []
    for index, (key, image) in enumerate(images.items()):
        name = f"t{index}"
        arrays[f"{name}/rows"] = image.rows
        states = {}
        for i, (state, array) in enumerate(image.states.items()):
            states[state] = f"{name}/state/{i}"
            arrays[states[state]] = array
        entry: dict[str, Any] = {
            "key": key, "shape": list(image.shape), "dtype": dtype_name(image.rows.dtype),
            "rows": f"{name}/rows", "round": image.round,
            "applied": [[w, n] for w, n in sorted(image.applied.items())], "count": image.count,
            "states": states}
        if image.dynamic is None:
            entry.update(lo=image.lo, hi=image.hi)
        else:
            assert image.spec is not None
            snap = image.dynamic
            for part in ("ids", "last", "idle", "freq", "unset", "pending_ids", "pending_counts"):
                arrays[f"{name}/{part}"] = getattr(snap, part)
            entry["dynamic"] = {"init": image.init, "spec": image.spec.wire(), "tick": snap.tick,
                                "counts": snap.counts, "arrays": name}
        out.append(entry)
    return out


def _count(value: Any, what: str, where: str) -> int:
    if type(value) is not int or value < 0:
        raise FormatError(f"{where}: {what} must be an int >= 0, not {str(value)[:40]!r}")
    return value


def _array(arrays: dict[str, np.ndarray], name: Any, what: str, where: str, dtype: Any = None,
           size: int | None = None) -> np.ndarray:
    """Array ``name`` of the file, of ``dtype`` and ``size`` elements when given; FormatError otherwise."""
    array = arrays.get(name) if isinstance(name, str) else None
    if array is None or (dtype is not None and array.dtype != np.dtype(dtype)) or (
            size is not None and array.size != size):
        raise FormatError(f"{where}: {what} is missing or not of its dtype and size")
    return array


def _dynamic(meta: Any, arrays: dict[str, np.ndarray], n: int, key: Key, where: str) -> tuple[
        DynamicImage, dict[str, Any], R.DynamicSpec]:
    """A dynamic table's ``dynamic`` entry: its image of ``n`` rows (their rows set later), init, spec."""
    what = f"dynamic table {key!r}"
    if not (isinstance(meta, dict) and isinstance(meta.get("counts"), dict)
            and isinstance(meta.get("arrays"), str)):
        raise FormatError(f"{where}: {what} lacks its 'counts' or 'arrays'")
    try:
        init = R.parse_init(key, meta.get("init"))
        spec = R.parse_spec(key, meta.get("spec"))
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{where}: {what}: {exc}") from None
    name = meta["arrays"]
    parts = {part: _array(arrays, f"{name}/{part}", f"{what}'s {part!r}", where, dtype, n)
             for part, dtype in (("ids", np.int64), ("last", np.int64), ("idle", np.float64),
                                 ("freq", np.int64), ("unset", np.bool_))}
    pending = _array(arrays, f"{name}/pending_ids", f"{what}'s pending ids", where, np.int64)
    counts = _array(arrays, f"{name}/pending_counts", f"{what}'s pending counts", where, np.int64,
                    pending.size)
    if np.unique(parts["ids"]).size != n:
        raise FormatError(f"{where}: {what}'s ids are not distinct")
    image = DynamicImage(parts["ids"], np.zeros((n, 0)), parts["last"], parts["idle"], parts["freq"],
                         parts["unset"], _count(meta.get("tick"), "'tick'", where),
                         {k: _count(v, f"counter {k!r}", where) for k, v in meta["counts"].items()},
                         pending, counts)
    return image, init, spec


def entry_key(entry: Any, where: str, field_name: str) -> Key:
    """The key of one ``field_name`` entry (``keys`` or ``tables``) of a shard's manifest; FormatError
    when the entry is not an object or its key is not a key."""
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: a '{field_name}' entry must be an object")
    try:
        return check_key(entry.get("key"))
    except KeyTypeError as exc:
        raise FormatError(f"{where}: {exc}") from None


def _table(entry: Any, arrays: dict[str, np.ndarray], where: str) -> tuple[Key, TableImage]:
    """One ``tables`` entry of a shard's manifest, checked."""
    key = entry_key(entry, where, "tables")
    shape, dtype = entry.get("shape"), entry.get("dtype")
    applied, states = entry.get("applied"), entry.get("states")
    if not (isinstance(shape, list) and shape and all(type(n) is int and n > 0 for n in shape)
            and dtype in BY_NAME and isinstance(applied, list) and isinstance(states, dict)):
        raise FormatError(f"{where}: table {key!r} lacks its shape, dtype, 'applied' or 'states'")
    dynamic = entry.get("dynamic")
    rows = _array(arrays, entry.get("rows"), f"table {key!r}'s rows", where, BY_NAME[dtype])
    width = int(np.prod(shape if dynamic is not None else shape[1:], dtype=np.int64))
    if rows.ndim != 2 or rows.shape[1] != width:
        raise FormatError(f"{where}: table {key!r}'s rows are {rows.shape}, not rows of {width}")
    pairs = {}
    for pair in applied:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise FormatError(f"{where}: table {key!r}: 'applied' holds [worker, count] pairs")
        pairs[_count(pair[0], "a worker rank", where)] = _count(pair[1], "a count", where)
    found = {name: _array(arrays, array, f"table {key!r}'s state {name!r}", where, size=rows.size)
             for name, array in states.items()}
    count = entry.get("count")
    image = TableImage(tuple(shape), rows, _count(entry.get("round"), "'round'", where), pairs,
                       None if count is None else _count(count, "'count'", where), found)
    if dynamic is None:
        image.lo, image.hi = _count(entry.get("lo"), "'lo'", where), _count(entry.get("hi"), "'hi'", where)
        if not image.lo < image.hi <= shape[0] or rows.shape[0] != image.hi - image.lo or len(shape) < 2:
            raise FormatError(f"{where}: table {key!r}'s rows [{image.lo}, {image.hi}) do not fit {shape}")
    else:
        image.dynamic, image.init, image.spec = _dynamic(dynamic, arrays, rows.shape[0], key, where)
        if image.spec.capacity and rows.shape[0] > image.spec.capacity:
            raise FormatError(f"{where}: dynamic table {key!r} holds {rows.shape[0]} rows, more than its "
                              f"capacity of {image.spec.capacity}")
        image.dynamic.rows = rows
    return key, image


def check_states(images: dict[Key, TableImage], optimizer: Optimizer | None, where: str) -> None:
    """FormatError naming ``where`` when a table's state arrays are not the names and dtypes
    ``optimizer`` (the shard's own; None: none set) keeps for it: installed, the others would be
    dropped and the table would go on without them silently."""
    for key, image in images.items():
        if not image.states:
            continue
        dtype = image.rows.dtype
        if optimizer is None:
            raise FormatError(f"{where}: table {key!r} holds optimizer state but the shard has no optimizer")
        want = optimizer.state_names(dtype)
        kept = np.dtype(np.float32) if "weight32" in want else dtype  # as create_state makes them
        if set(image.states) != set(want):
            raise FormatError(f"{where}: table {key!r} holds states {sorted(image.states)}; "
                              f"{optimizer.name} keeps {sorted(want)}")
        wrong = [name for name, array in image.states.items() if array.dtype != kept]
        if wrong:
            raise FormatError(f"{where}: table {key!r}'s states {wrong} are not of the dtype "
                              f"{optimizer.name} keeps them in")


def from_entries(found: Any, arrays: dict[str, np.ndarray], where: str) -> dict[Key, TableImage]:
    """The images of a shard manifest's ``tables`` (absent: none); FormatError naming ``where``."""
    if found is None:
        return {}
    if not isinstance(found, list):
        raise FormatError(f"{where}: 'tables' must be a list")
    images = dict(_table(entry, arrays, where) for entry in found)
    if len(images) != len(found):
        raise FormatError(f"{where}: a table is stored twice")
    return images

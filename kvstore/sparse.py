"""Row-sparse keys for every store (docs/sparse.md): :class:`RowSparse` and the argument handling of
``init(..., stype='row_sparse')``, a row-sparse ``push``, ``row_sparse_pull`` and a whole ``pull``.

A store hands :class:`SparseCalls` its dense keys' metas and three primitives (a table's init, a push of
merged rows, a pull of sorted distinct rows); this module checks the user's arguments, merges pushed
rows and writes pulled rows into outs, so the
local and dist stores share every rule.  Nothing is sent before every argument is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvstore.core import rowsparse as R
from kvstore.core import xp
from kvstore.core.partition import Key, check_key
from kvstore.core.rowsparse import RowSparse, SparseMeta
from kvstore.core.values import Meta
from kvstore.errors import DuplicateInitError, KeyNotInitializedError, ShapeMismatchError

__all__ = ["RowSparse", "SparseCalls", "WHOLE_PULL_BYTES"]

# A whole pull of a row-sparse key is refused above this many bytes: a table that big is meant to stay
# on the servers (use row_sparse_pull for the rows a batch needs).
WHOLE_PULL_BYTES = 256 << 20


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


InitRows = Callable[[list[tuple[Key, SparseMeta, dict, np.ndarray | None]]], None]
PushRows = Callable[[list[tuple[Key, SparseMeta, np.ndarray, np.ndarray]]], None]
PullRows = Callable[[Key, SparseMeta, np.ndarray, bool], np.ndarray]


class SparseCalls:
    """The row-sparse calls of one store: its row-sparse keys' metas and the argument rules.

    ``dense`` is the store's dense keys' metas (a key is one or the other); ``init_rows(items)``
    creates tables (each item ``(key, meta, init spec, value or None)``), ``push_rows(items)`` sends
    merged rows (``(key, meta, ids, rows)``), ``pull_rows(key, meta, ids, admit)`` returns sorted distinct
    rows (``admit``: a dynamic table stores the rows it did not hold)."""

    def __init__(self, dense: Mapping[Key, Meta], init_rows: InitRows, push_rows: PushRows,
                 pull_rows: PullRows) -> None:
        self.dense, self.init_rows, self.push_rows, self.pull_rows = dense, init_rows, push_rows, pull_rows
        self.metas: dict[Key, SparseMeta] = {}

    # -- which calls are ours -------------------------------------------------------------------------
    def owns(self, keys: list[Key]) -> bool:
        """Whether any of ``keys`` is row-sparse."""
        return bool(self.metas) and any(k in self.metas for k in keys)

    def handles_push(self, key: Any, value: Any) -> bool:
        """Whether a push of ``value`` to ``key`` is a row-sparse one (a row-sparse key or value)."""
        keys = _as_list(key)
        if self.metas and any(check_key(k) in self.metas for k in keys):
            return True
        return any(R.is_sparse_value(v) for v in _flat(value))

    def meta(self, key: Key) -> SparseMeta:
        """``key``'s meta; KeyNotInitializedError when it is not a row-sparse key."""
        try:
            return self.metas[key]
        except KeyError:
            if key in self.dense:
                raise TypeError(f"key {key!r} is dense (stype 'default'); row-sparse values and "
                                "row_sparse_pull need a key initialised with stype='row_sparse'") from None
            raise KeyNotInitializedError(f"key {key!r} has not been initialised; call kv.init(key, "
                                         "value, stype='row_sparse') on every worker first") from None

    # -- init -------------------------------------------------------------------------------------
    @staticmethod
    def wants_init(value: Any, stype: str, dynamic: Any = None) -> bool:
        """Whether ``init(key, value, stype)`` makes row-sparse keys: ``stype='row_sparse'`` (or another
        non-default one, refused later), no value, a row-sparse value (RowSparse, sparse tensor), or
        ``dynamic``."""
        if stype != "default" or value is None or dynamic is not None:
            return True
        return any(R.is_sparse_value(v) for v in _flat(value))

    def init(self, key: Any, value: Any, stype: str, shape: Any, dtype: Any, init: Any,
             dynamic: Any = None, width: Any = None) -> None:
        """``init`` of row-sparse keys: from values (rank 0's), or from ``shape``/``dtype``/``init``
        without any value (the table is generated on the servers), or a dynamic table of rows of
        ``width`` (``dynamic``: True or a dict of :class:`kvstore.core.rowsparse.DynamicSpec`'s fields).
        Raises ValueError for a bad stype, shape or dynamic spec, DuplicateInitError for a key that
        exists, ShapeMismatchError for values."""
        if stype not in R.STYPES:
            raise ValueError(f"stype must be one of {R.STYPES}, not {stype!r}")
        if width is not None and dynamic is None:
            raise ValueError("width= makes a dynamic table (with dynamic=True or a dict); a fixed table "
                             "takes shape=")
        keys = [check_key(k) for k in _as_list(key)]
        values = [None] * len(keys) if value is None else (
            _as_list(value) if isinstance(key, (list, tuple)) else [value])
        if len(values) != len(keys) or len(set(keys)) != len(keys):
            raise ValueError(f"{len(keys)} distinct keys need as many values, got {len(values)}")
        items = []
        for k, v in zip(keys, values):
            if k in self.metas or k in self.dense:
                raise DuplicateInitError(f"key {k!r} is already initialised")
            items.append(self._dynamic_item(k, v, shape, dtype, init, dynamic, width) if dynamic is not None
                         else self._init_item(k, v, shape, dtype, init))
        self.metas.update((k, meta) for k, meta, _, _ in items)  # known during the init (its resume)
        try:
            self.init_rows(items)
        except BaseException:
            for k, _, _, _ in items:
                self.metas.pop(k, None)
            raise

    @staticmethod
    def _dynamic_item(key: Key, value: Any, shape: Any, dtype: Any, init: Any, dynamic: Any,
                      width: Any) -> tuple:
        if value is not None or shape is not None or width is None:
            raise ValueError(f"key {key!r}: a dynamic table takes width= (an int, or a row's shape), "
                             "dtype= and init=, and no value or shape")
        row = (width,) if isinstance(width, int) else tuple(width)
        full, dt = R.check_meta(key, (R.DYNAMIC_ROWS, *row), dtype)
        return key, SparseMeta(full, dt, dynamic=R.parse_spec(key, dynamic)), R.parse_init(key, init), None

    def _init_item(self, key: Key, value: Any, shape: Any, dtype: Any, init: Any) -> tuple:
        if value is None:
            if shape is None:
                raise ValueError(f"key {key!r}: init needs a value, or shape= (and dtype=, init=)")
            full, dt = R.check_meta(key, shape, dtype)
            return key, SparseMeta(full, dt), R.parse_init(key, init), None
        if isinstance(value, RowSparse):
            array = value.todense()
        elif R.is_sparse_value(value):
            array = xp.to_numpy(value.detach().to_dense())
        else:
            array = xp.to_numpy(value) if xp.is_tensor(value) else np.asarray(value)
        full, dt = R.check_meta(key, array.shape, array.dtype)
        return key, SparseMeta(full, dt, xp.is_tensor(value)), {"type": "zeros", "seed": 0}, array

    # -- push -------------------------------------------------------------------------------------
    def push(self, key: Any, value: Any) -> None:
        """A push to row-sparse keys: each key's values merged into sorted distinct rows (repeats
        summed), checked, then sent.  Raises TypeError for a row-sparse value to a dense key,
        ShapeMismatchError for a wrong width or a row id out of range (nothing sent)."""
        pairs = _pairs(key, value)
        items = []
        for k, vs in pairs:
            meta = self.meta(k)
            ids, rows = R.rows_of(k, meta, vs)
            items.append((k, meta, ids, rows))
        self.push_rows(items)

    # -- pulls ------------------------------------------------------------------------------------
    def row_sparse_pull(self, key: Any, out: Any, row_ids: Any, admit: bool = False) -> Any:
        """MXNet's ``row_sparse_pull``: the rows ``row_ids`` (unsorted, repeats allowed; one array, or
        one per out) into each dense ``out`` (the other rows zeroed), or, without ``out``, a
        :class:`RowSparse` (a list of them for a list of keys).  ``admit``: a dynamic table stores
        the rows it did not hold (else they are answered with their initial value, not stored)."""
        if row_ids is None:
            raise ValueError("row_sparse_pull needs row_ids")
        single = not isinstance(key, (list, tuple))
        keys = [check_key(k) for k in _as_list(key)]
        if single:
            outs, ids_per_key = [out], [row_ids]
        else:
            outs = [None] * len(keys) if out is None else _as_list(out)
            ids_per_key = _as_list(row_ids)
            if len(outs) != len(keys) or len(ids_per_key) != len(keys):
                raise ValueError(f"{len(keys)} keys need as many outs and row_ids")
        results = [self._pull_key(k, o, r, admit) for k, o, r in zip(keys, outs, ids_per_key)]
        return results[0] if single else results

    def _pull_key(self, key: Key, out: Any, row_ids: Any, admit: bool) -> Any:
        meta = self.meta(key)
        if meta.dynamic is None and admit:
            raise ValueError(f"row_sparse_pull of key {key!r}: admit applies to dynamic tables only")
        if meta.dynamic is not None and out is not None:
            raise ValueError(f"row_sparse_pull of dynamic key {key!r} takes no out (its ids are unbounded): "
                             "it returns a RowSparse")
        targets = [None] if out is None else _as_list(out)
        for target in targets:
            if target is not None and tuple(target.shape) != meta.shape:
                raise ShapeMismatchError(f"row_sparse_pull out of key {key!r} has shape "
                                         f"{tuple(target.shape)}; the table is {meta.shape}")
        ids = R.pull_ids(key, meta, row_ids, len(targets))
        wanted = np.unique(np.concatenate(ids)) if len(ids) > 1 else np.unique(ids[0])
        rows = self.pull_rows(key, meta, wanted, admit)
        results = []
        for target, asked in zip(targets, ids):
            mine = wanted if len(ids) == 1 else np.unique(asked)
            picked = rows if mine.size == wanted.size else rows[np.searchsorted(wanted, mine)]
            results.append(R.deliver(meta, mine, picked, target))
        return results[0] if out is None else out

    def pull_whole(self, key: Any, out: Any) -> Any:
        """``pull`` of whole row-sparse keys, each below :data:`WHOLE_PULL_BYTES`; dense values."""
        single = not isinstance(key, (list, tuple))
        keys = [check_key(k) for k in _as_list(key)]
        outs = [out] if single else ([None] * len(keys) if out is None else _as_list(out))
        results = []
        for k, o in zip(keys, outs):
            meta = self.meta(k)
            if meta.nbytes > WHOLE_PULL_BYTES:
                raise ValueError(f"pull of row_sparse key {k!r}: its table of {meta.nbytes} bytes is over "
                                 f"the {WHOLE_PULL_BYTES}-byte limit of a whole pull; use "
                                 "kv.row_sparse_pull(key, row_ids=...) for the rows you need")
            rows = self.pull_rows(k, meta, np.arange(meta.num_rows, dtype=np.int64), False)
            dense = rows.reshape(meta.shape)
            if meta.tensor and o is None:
                dense = xp.from_numpy(np.ascontiguousarray(dense))
            if o is None:
                results.append(dense)
            else:
                for target in _as_list(o):
                    R.deliver(meta, np.arange(meta.num_rows), rows, target)
                results.append(o)
        return results[0] if single else results


def _flat(value: Any) -> list[Any]:
    out = []
    for v in _as_list(value):
        out.extend(_as_list(v))
    return out


def _pairs(key: Any, value: Any) -> list[tuple[Key, list[Any]]]:
    """Keys with their values, repeats merged (base.group's rule, for row-sparse values too)."""
    if isinstance(key, (list, tuple)):
        vals = _as_list(value)
        if len(vals) != len(key):
            raise ValueError(f"{len(key)} keys but {len(vals)} values")
        pairs = [(check_key(k), _as_list(v)) for k, v in zip(key, vals)]
    else:
        pairs = [(check_key(key), _as_list(value))]
    merged: dict[Key, list[Any]] = {}
    for k, vs in pairs:
        if not vs:
            raise TypeError(f"no values for key {k!r}")
        merged.setdefault(k, []).extend(vs)
    return list(merged.items())

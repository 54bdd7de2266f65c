"""Row-sparse values, pure: :class:`RowSparse`, the checks that turn a pushed value into merged rows,
row ranges over servers, ``row_sparse_pull``'s row ids and outs, and the table initializers.

A row-sparse key holds a table of ``shape[0]`` rows of ``shape[1:]`` each.  A pushed value is a
:class:`RowSparse`, a torch sparse COO tensor (what ``nn.Embedding(sparse=True)`` makes) or a dense
array of the whole table; :func:`rows_of` turns it into sorted, distinct row ids and their rows
(repeated ids summed).  Servers hold contiguous row ranges (:func:`row_bounds`), never a part of a
row.  The initializers draw each element from a counter-based hash of ``(seed, row, column)``, so a
table is the same whatever the number of servers that generate its ranges.
torch is never imported here unless the user handed us a tensor.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.core import xp
from kvstore.core.dtypes import BY_NAME
from kvstore.core.partition import slice_bounds
from kvstore.errors import DTypeMismatchError, ProtocolError, ShapeMismatchError

STYPES = ("default", "row_sparse")
SPARSE_DTYPES = frozenset({np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)})
INITIALIZERS = {"zeros": {}, "uniform": {"low": -0.07, "high": 0.07}, "normal": {"mean": 0.0, "sigma": 0.01}}
BLOCK = 1 << 20  # elements generated at a time by the initializers (bounded scratch memory)
POLICIES = ("lru", "lfu")  # a dynamic table's eviction policies
DYNAMIC_ROWS = 2**64  # a dynamic table's shape[0]: the id space (its RowSparse values carry it)
ID_SALT = 0x3C6EF372FE94F82B  # a dynamic table's ids past 2**64 // width are hashed with it (generate_ids)


@dataclass(frozen=True, eq=False)
class RowSparse:
    """A row-sparse value of a table of ``shape``: ``rows[i]`` is row ``indices[i]``; rows not listed
    are zero.  ``indices`` may be unsorted and repeat (repeats are summed when pushed)."""

    indices: np.ndarray
    rows: np.ndarray
    shape: tuple[int, ...]

    def __init__(self, indices: Any, rows: Any, shape: Any) -> None:
        """Raises ValueError when ``rows`` is not one row of ``shape[1:]`` per index."""
        idx = np.asarray(xp.to_numpy(indices) if xp.is_tensor(indices) else indices).reshape(-1)
        data = xp.to_numpy(rows) if xp.is_tensor(rows) else np.asarray(rows)
        shape = tuple(int(n) for n in shape)
        if idx.size and idx.dtype.kind not in "iu":
            raise ValueError(f"RowSparse indices must be integers, not {idx.dtype}")
        if len(shape) < 1 or data.shape != (idx.size, *shape[1:]):
            raise ValueError(f"RowSparse rows of shape {data.shape} do not hold one row of {shape[1:]} "
                             f"for each of the {idx.size} indices")
        object.__setattr__(self, "indices", idx.astype(np.int64, copy=False))
        object.__setattr__(self, "rows", data)
        object.__setattr__(self, "shape", shape)

    @property
    def data(self) -> np.ndarray:
        """MXNet's name for :attr:`rows`."""
        return self.rows

    def todense(self) -> np.ndarray:
        """The whole table as a new dense array (repeated indices summed)."""
        out = np.zeros(self.shape, self.rows.dtype)
        np.add.at(out, self.indices, self.rows)
        return out

    def __repr__(self) -> str:
        return f"RowSparse({self.indices.size} rows of {self.shape}, {self.rows.dtype})"


@dataclass(frozen=True)
class DynamicSpec:
    """How a dynamic table forgets, per server: at most ``capacity`` rows (0: no bound), evicting the
    least recently (``'lru'``) or least frequently (``'lfu'``, ties least recent) used; a row is stored
    once pushed ``admit_after`` times; a row untouched for ``ttl`` seconds (0: never) is dropped."""

    capacity: int = 0
    policy: str = "lru"
    admit_after: int = 1
    ttl: float = 0.0

    def wire(self) -> dict[str, Any]:
        """The spec as a msgpack-safe dict (what SPARSE_INIT carries)."""
        return {"capacity": self.capacity, "policy": self.policy, "admit_after": self.admit_after,
                "ttl": self.ttl}


def parse_spec(key: Any, given: Any) -> DynamicSpec:
    """``dynamic=`` of ``init``: True (no forgetting) or a dict of :class:`DynamicSpec`'s fields.
    ValueError for anything else."""
    if given is True:
        return DynamicSpec()
    if not isinstance(given, Mapping):
        raise ValueError(f"key {key!r}: dynamic must be True or a dict of {sorted(DynamicSpec().wire())}, "
                         f"not {given!r}")
    unknown = sorted(set(given) - set(DynamicSpec().wire()))
    if unknown:
        raise ValueError(f"key {key!r}: dynamic takes {sorted(DynamicSpec().wire())}, not {unknown}")
    capacity, admit = given.get("capacity", 0), given.get("admit_after", 1)
    policy, ttl = given.get("policy", "lru"), given.get("ttl", 0.0)
    if type(capacity) is not int or not 0 <= capacity < 2**40:
        raise ValueError(f"key {key!r}: dynamic capacity must be an int in [0, 2**40), not {capacity!r}")
    if type(admit) is not int or not 1 <= admit < 2**31:
        raise ValueError(f"key {key!r}: dynamic admit_after must be an int >= 1, not {admit!r}")
    if policy not in POLICIES:
        raise ValueError(f"key {key!r}: dynamic policy must be one of {POLICIES}, not {policy!r}")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl < float("inf"):
        raise ValueError(f"key {key!r}: dynamic ttl must be seconds >= 0, not {ttl!r}")
    return DynamicSpec(capacity, policy, admit, float(ttl))


@dataclass(frozen=True)
class SparseMeta:
    """What a row-sparse key was initialised with: the table's shape and dtype, whether it came as a
    tensor (pulls then give tensors)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    tensor: bool = False
    dynamic: DynamicSpec | None = None  # a dynamic table (ids any 64-bit value, shape[0] DYNAMIC_ROWS)

    @property
    def num_rows(self) -> int:
        """Rows in the table."""
        return self.shape[0]

    @property
    def width(self) -> int:
        """Elements per row."""
        return int(np.prod(self.shape[1:], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole table."""
        return self.num_rows * self.width * self.dtype.itemsize


def is_sparse_value(value: Any) -> bool:
    """True for a :class:`RowSparse` or a torch sparse COO tensor."""
    if isinstance(value, RowSparse):
        return True
    return xp.is_tensor(value) and value.layout == sys.modules["torch"].sparse_coo


def check_meta(key: Any, shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """A row-sparse table's ``(shape, dtype)``; ValueError / DTypeMismatchError when it cannot be one."""
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError:
        raise ValueError(f"key {key!r}: shape must be a tuple of ints, not {shape!r}") from None
    if len(shape) < 2 or any(n < 1 for n in shape):
        raise ValueError(f"key {key!r}: a row_sparse table needs a shape of 2 or more dims >= 1, "
                         f"got {shape}")
    dtype = xp.numpy_dtype_of_torch(dtype) if "torch" in str(type(dtype)) else np.dtype(dtype or "float32")
    if dtype not in SPARSE_DTYPES:
        raise DTypeMismatchError(f"key {key!r}: a row_sparse table holds float16, float32 or float64, "
                                 f"not {dtype}")
    return shape, dtype


def wire_meta(key: Any, shape: Any, dtype_name: Any) -> tuple[tuple[int, ...], np.dtype]:
    """A SPARSE_INIT's ``(shape, dtype)`` as sent: ProtocolError unless ``shape`` is a list of 2+ ints
    (not bools, floats or strings) in ``[1, 2**63)`` whose rows hold under ``2**63`` elements and
    ``dtype_name`` a dtype's name; DTypeMismatchError for a dtype a table cannot hold."""
    good = (isinstance(shape, list) and len(shape) >= 2
            and all(type(n) is int and 0 < n < 2**63 for n in shape) and math.prod(shape[1:]) < 2**63)
    if not (good and isinstance(dtype_name, str) and dtype_name in BY_NAME):
        raise ProtocolError(f"SPARSE_INIT of key {key!r} needs a shape of 2+ ints in [1, 2**63) with rows "
                            f"of under 2**63 elements, and a dtype name; got {shape!r}, {dtype_name!r}")
    return check_meta(key, shape, BY_NAME[dtype_name])


def key_seed(key: Any) -> int:
    """The default init seed of ``key``: a hash of the key (``3`` and ``'3'`` differ), so two tables
    of the same shape and init start different unless given one seed."""
    digest = hashlib.blake2b(f"{type(key).__name__}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def parse_init(key: Any, init: Any, seed: int | None = None) -> dict[str, Any]:
    """An initializer as a plain dict ``{"type", "seed", ...params}``: ``None`` or ``'zeros'``,
    ``'uniform'`` (low=-0.07, high=0.07), ``'normal'`` (mean=0, sigma=0.01), or a dict
    ``{"type": ..., param: value, "seed": int}``; the seed defaults to :func:`key_seed`.
    ValueError for anything else."""
    if not (init is None or isinstance(init, (str, Mapping))):
        raise ValueError(f"key {key!r}: init must be a name or a dict, not {init!r}")
    spec = {"type": "zeros"} if init is None else {"type": init} if isinstance(init, str) else dict(init)
    kind = spec.pop("type", None)
    if kind not in INITIALIZERS:
        raise ValueError(f"key {key!r}: init must be one of {sorted(INITIALIZERS)} (or a dict with "
                         f"'type'), not {init!r}")
    seed = key_seed(key) if seed is None else seed
    out: dict[str, Any] = {"type": kind, "seed": int(spec.pop("seed", seed))}
    if not 0 <= out["seed"] < 2**63:
        raise ValueError(f"key {key!r}: init seed must be in [0, 2**63)")
    for name, default in INITIALIZERS[kind].items():
        value = spec.pop(name, default)
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            out[name] = math.nan
        if not math.isfinite(out[name]):  # a NaN or infinite parameter would fill the table with NaN
            raise ValueError(f"key {key!r}: {kind} init's {name!r} must be a finite number, not {value!r}")
    if spec:
        raise ValueError(f"key {key!r}: {kind} init takes {sorted(INITIALIZERS[kind])}, not {sorted(spec)}")
    return out


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 counters (wrapping arithmetic, in place)."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def _uniform01(counters: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """Doubles in (0, 1) from the hash of ``(seed, stream, counter)``."""
    with np.errstate(over="ignore"):
        salt = mix(np.array([seed * 2 + stream], np.uint64) + np.uint64(0x632BE59BD9B4E019))[0]
        bits = mix((counters + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + salt)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def generate(spec: dict[str, Any], lo: int, hi: int, width: int, dtype: np.dtype) -> np.ndarray:
    """Rows ``[lo, hi)`` of a table of rows of ``width`` elements, as ``spec`` (:func:`parse_init`)
    initialises it: element ``(r, c)`` depends only on the seed, ``r * width + c`` and the spec."""
    out = np.zeros((hi - lo, width), dtype)
    if spec["type"] == "zeros" or hi <= lo:
        return out
    flat = out.reshape(-1)
    start = lo * width
    for offset in range(0, flat.size, BLOCK):
        n = min(BLOCK, flat.size - offset)
        _fill(spec, flat[offset:offset + n], np.arange(start + offset, start + offset + n, dtype=np.uint64))
    return out


def generate_ids(spec: dict[str, Any], ids: np.ndarray, width: int, dtype: np.dtype) -> np.ndarray:
    """The rows of int64 row ids ``ids`` (any 64-bit values: a dynamic table's) by :func:`generate`'s
    rule: an id in ``[0, 2**64 // width)`` is row ``id`` of a fixed table of that seed (counters
    ``id * width + c``); any other (a negative one, one with high bits set) is hashed first
    (``mix(id ^ ID_SALT) * width + c`` modulo 2**64), so ids differing only in their top bits do not
    wrap onto one row."""
    out = np.zeros((ids.size, width), dtype)
    if spec["type"] == "zeros" or not ids.size:
        return out
    step = max(1, BLOCK // width)
    columns = np.arange(width, dtype=np.uint64)
    bound = np.uint64(2**64 // width) if width > 1 else None  # ids from it on would wrap: hashed
    with np.errstate(over="ignore"):
        for first in range(0, ids.size, step):
            part = ids[first:first + step].astype(np.int64, copy=False).view(np.uint64)
            wraps = None if bound is None else part >= bound
            if wraps is not None and wraps.any():
                part = part.copy()
                part[wraps] = mix(part[wraps] ^ np.uint64(ID_SALT))
            counters = (part[:, None] * np.uint64(width) + columns).reshape(-1)
            _fill(spec, out[first:first + step].reshape(-1), counters)
    return out


def _fill(spec: dict[str, Any], flat: np.ndarray, counters: np.ndarray) -> None:
    """Write ``spec``'s values for uint64 ``counters`` into ``flat`` (a 1-d view).

    A normal initialiser draws Box-Muller pairs: counters ``2p`` and ``2p + 1`` are the cosine and sine
    normals of pair ``p`` (two uniforms hashed from ``p``), so a run of adjacent pairs, as a row of
    even width or a range of rows is, costs one pair's hashes and logarithm per two elements; the value
    of a counter is the same whichever way it is computed.  The arithmetic is in float64 for a float64
    table and in float32 for any other (numpy's float32 logarithms and sines are vectorised: about 15
    to 35 times faster here), so a value depends on the counter, the spec and the table's dtype only."""
    work = np.float64 if flat.dtype == np.float64 else np.float32
    if spec["type"] == "uniform":
        u = _uniform01(counters, spec["seed"], 0)
        flat[:] = spec["low"] + (spec["high"] - spec["low"]) * u
        return
    mean, sigma = work(spec["mean"]), work(spec["sigma"])
    one = np.uint64(1)
    evens = counters[0::2]
    if (counters.size % 2 == 0 and counters.size and not int(counters[0]) & 1
            and np.array_equal(counters[1::2], evens + one)):
        radius, angle = _pair(evens >> one, spec["seed"], work)
        flat[0::2] = mean + sigma * (radius * np.cos(angle))
        flat[1::2] = mean + sigma * (radius * np.sin(angle))
        return
    radius, angle = _pair(counters >> one, spec["seed"], work)  # any counters: each element's own pair
    odd = (counters & one).astype(bool)
    flat[:] = mean + sigma * (radius * np.where(odd, np.sin(angle), np.cos(angle)))


def _pair(pairs: np.ndarray, seed: int, work: type) -> tuple[np.ndarray, np.ndarray]:
    """Box-Muller's radius and angle of each pair number (two independent hashed streams), in ``work``
    precision."""
    u = _uniform01(pairs, seed, 0).astype(work)
    v = _uniform01(pairs, seed, 1).astype(work)
    return np.sqrt(work(-2.0) * np.log(u)), work(2.0 * np.pi) * v


def merge(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct ids and their rows, repeated ids' rows summed (in the rows' dtype)."""
    if ids.size == 0:
        return ids.astype(np.int64), rows
    if ids.size > 1 and np.all(ids[1:] > ids[:-1]):
        return ids, rows  # already sorted and distinct (the common case of a merged push)
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    first = np.concatenate(([True], ids[1:] != ids[:-1]))
    if first.all():
        return ids, rows[order]
    out = rows[order[first]]  # each id's first row, then the (few) repeats added into it
    group = np.cumsum(first) - 1
    repeats = ~first
    np.add.at(out, group[repeats], rows[order[repeats]])
    return ids[first], out


def _parts(key: Any, meta: SparseMeta, value: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, rows)`` of one pushed value, unmerged; errors name ``key``."""
    if isinstance(value, RowSparse):
        if value.shape[1:] != meta.shape[1:]:
            raise ShapeMismatchError(f"pushed rows of key {key!r} are {value.shape[1:]} wide; the table's "
                                     f"rows are {meta.shape[1:]}")
        if value.shape != meta.shape and meta.dynamic is None:  # a dynamic table takes any shape[0]
            raise ShapeMismatchError(f"pushed RowSparse of key {key!r} has shape {value.shape}, but the "
                                     f"table is {meta.shape}")
        ids, rows = value.indices, value.rows
    elif is_sparse_value(value):
        shape = tuple(value.shape)
        same = shape[1:] == meta.shape[1:] if meta.dynamic is not None else shape == meta.shape
        if not same or value.sparse_dim() != 1:
            raise ShapeMismatchError(f"pushed sparse tensor of key {key!r} has shape {tuple(value.shape)} "
                                     f"({value.sparse_dim()} sparse dims); the table is {meta.shape} "
                                     "with sparse rows")
        value = value.detach()
        ids, rows = xp.to_numpy(value._indices()[0]), xp.to_numpy(value._values())
    elif meta.dynamic is not None:
        raise ShapeMismatchError(f"pushed value of dynamic key {key!r} must be a RowSparse or a sparse COO "
                                 f"tensor (a dense table of every id cannot be), not {type(value).__name__}")
    else:
        array = xp.to_numpy(value) if xp.is_tensor(value) else value
        if not isinstance(array, np.ndarray) or array.shape != meta.shape:
            got = getattr(array, "shape", type(array).__name__)
            raise ShapeMismatchError(f"pushed value of row_sparse key {key!r} must be a RowSparse, a "
                                     f"sparse COO tensor or a dense array of {meta.shape}, not {got}")
        ids, rows = np.arange(meta.num_rows, dtype=np.int64), array
    if rows.dtype != meta.dtype:
        raise DTypeMismatchError(f"pushed rows of key {key!r} are {rows.dtype}; the table is {meta.dtype}")
    if rows.shape[1:] != meta.shape[1:]:
        raise ShapeMismatchError(f"pushed rows of key {key!r} are {rows.shape[1:]} wide; the table's "
                                 f"rows are {meta.shape[1:]}")
    return check_ids(key, meta, ids), rows.reshape(len(ids), meta.width)


def check_ids(key: Any, meta: SparseMeta, ids: Any) -> np.ndarray:
    """``ids`` (an int array or tensor, any shape) as flat int64; ShapeMismatchError for an id out of
    ``[0, num_rows)``, TypeError for non-integers."""
    array = np.asarray(xp.to_numpy(ids) if xp.is_tensor(ids) else ids).reshape(-1)
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(f"row ids of key {key!r} must be integers, not {array.dtype}")
    if meta.dynamic is not None:  # any 64-bit id; a uint64 one keeps its bits
        return array.view(np.int64) if array.dtype == np.uint64 else array.astype(np.int64, copy=False)
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= meta.num_rows:
        bad = low if low < 0 else high
        raise ShapeMismatchError(f"row id {bad} of key {key!r} is out of range: the table has "
                                 f"{meta.num_rows} rows")
    return array.astype(np.int64, copy=False)


def rows_of(key: Any, meta: SparseMeta, values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """One key's pushed values as sorted distinct row ids and ``(n, width)`` rows, repeats summed.
    Raises (nothing pushed yet) ShapeMismatchError for a wrong table shape, row width or a row id
    out of range, DTypeMismatchError for another dtype."""
    parts = [_parts(key, meta, v) for v in values]
    if len(parts) == 1:
        ids, rows = parts[0]
    else:
        ids = np.concatenate([p[0] for p in parts])
        rows = np.concatenate([p[1] for p in parts])
    return merge(ids, np.ascontiguousarray(rows))


def row_bounds(num_rows: int, num_servers: int) -> list[tuple[int, int]]:
    """Each server's row range ``[lo, hi)`` of a table (MXNet's slice sizes, over whole rows)."""
    return slice_bounds(num_rows, num_servers)


def split(ids: np.ndarray, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """For sorted ``ids``, each server's ``(start, stop)`` positions in ``ids``."""
    edges = np.searchsorted(ids, [lo for lo, _ in bounds] + [bounds[-1][1]])
    return [(int(edges[i]), int(edges[i + 1])) for i in range(len(bounds))]


def pull_ids(key: Any, meta: SparseMeta, row_ids: Any, count: int) -> list[np.ndarray]:
    """``row_sparse_pull``'s row ids as ``count`` flat int64 arrays: one array for every out, or one
    per out.  ValueError for a count mismatch; see :func:`check_ids`."""
    if isinstance(row_ids, (list, tuple)) and row_ids and not np.isscalar(row_ids[0]):
        if len(row_ids) != count:
            raise ValueError(f"key {key!r}: {len(row_ids)} row_ids arrays for {count} outs")
        return [check_ids(key, meta, r) for r in row_ids]
    ids = check_ids(key, meta, row_ids)
    return [ids] * count


def deliver(meta: SparseMeta, ids: np.ndarray, rows: np.ndarray, out: Any) -> Any:
    """Write the pulled ``rows`` of sorted distinct ``ids`` into ``out``: a dense array or tensor of
    the table's shape (rows not asked for become zero), or None for a new :class:`RowSparse`."""
    shaped = rows.reshape((ids.size, *meta.shape[1:]))
    if out is None:
        return RowSparse(ids, shaped, meta.shape)
    if tuple(out.shape) != meta.shape:
        raise ShapeMismatchError(f"row_sparse_pull out has shape {tuple(out.shape)}; the table is "
                                 f"{meta.shape}")
    if xp.is_tensor(out):
        torch = sys.modules["torch"]
        with torch.no_grad():
            out.zero_()
            out[torch.from_numpy(ids).to(out.device)] = torch.from_numpy(shaped).to(out.device, out.dtype)
        return out
    out[...] = 0
    out[ids] = shaped
    return out

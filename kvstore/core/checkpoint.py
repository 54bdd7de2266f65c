"""The one file format for everything kvstore persists (docs/formats.md); no pickle anywhere.

Users import it as ``kvstore.checkpoint`` (``kvstore/__init__.py`` binds that name to this module).

A file is an uncompressed zip holding ``manifest.json`` and one ``.npy`` member
per array.  Member names are generated (``arrays/000000.npy``...), never taken
from user strings; the manifest maps each array's name to its member.  Files
are written to a temporary name in the target's directory, fsync'd and then
renamed over the target, so a crash never leaves a half-written file under the
real name (:mod:`kvstore.core.storage`, which also takes storage URLs such as
``s3://``).  Readers refuse files of a newer format version.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
from numpy.lib import format as npy

from kvstore.core import storage, xp
from kvstore.core.dtypes import BY_NAME, DTYPES, dtype_name
from kvstore.core.optimizer import Optimizer, from_spec
from kvstore.core.partition import Key, check_key
from kvstore.errors import (
    DTypeMismatchError,
    FormatError,
    KeyNotInitializedError,
    KeyTypeError,
    OptimizerError,
    ShapeMismatchError,
)

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "Chunked", "StateEntry", "StatesFile", "Stored", "load_arrays",
           "read", "read_states", "save_arrays", "write", "write_states"]

FORMAT_VERSION = 1
FORMAT_NAME = "kvstore"
MANIFEST = "manifest.json"
RESERVED = ("format", "version", "arrays")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps: the same content gives the same bytes
# What a damaged zip or .npy member can raise while being read (OSError: seeks to bad offsets).
CHECK_BLOCK = 1 << 20  # bytes read at a time when a streamed member's CRC is checked
_DAMAGE = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, KeyError, EOFError, zlib.error,
           NotImplementedError, OSError, RuntimeError)


# -- the container ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chunked:
    """An array written without being held whole: ``shape`` and ``dtype`` up front, then its rows
    from ``chunks()`` in order (each a C-contiguous array of that dtype; their elements must add up to
    the shape's).  The file holds it as one ``.npy`` member like any array (a table streamed server by
    server)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def size(self) -> int:
        """Elements in all."""
        return math.prod(self.shape)


def _write_chunked(out: IO[bytes], array: Chunked, name: str) -> None:
    """One ``.npy`` member of ``array``'s chunks; ValueError when they do not fill its shape exactly."""
    header = {"descr": npy.dtype_to_descr(np.dtype(array.dtype)), "fortran_order": False,
              "shape": tuple(array.shape)}
    try:
        npy.write_array_header_1_0(out, header)
    except ValueError:  # a header too long for format 1.0 (as npy.write_array does)
        npy.write_array_header_2_0(out, header)
    written = 0
    for chunk in array.chunks():
        if chunk.dtype != array.dtype:
            raise ValueError(f"array {name!r}: a chunk of {chunk.dtype}, not {array.dtype}")
        written += chunk.size
        if written > array.size:
            raise ValueError(f"array {name!r}: its chunks hold more than the {array.size} elements of "
                             f"{array.shape}")
        out.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
    if written != array.size:
        raise ValueError(f"array {name!r}: its chunks hold {written} of the {array.size} elements of "
                         f"{array.shape}")


def write(path: str | os.PathLike, manifest: Mapping[str, Any],
          arrays: Mapping[str, np.ndarray | Chunked]) -> None:
    """Write ``arrays`` and the JSON-safe ``manifest`` fields to ``path``, atomically.

    The stored manifest is ``{"format": "kvstore", "version": FORMAT_VERSION, "arrays":
    {name: member}, **manifest}``.  ``path`` is a local path or a storage URL
    (:mod:`kvstore.core.storage`).  The file appears under ``path`` only once it is complete
    (written to a temporary file beside it, fsync'd, then ``os.replace``'d; in an object store
    moved from a temporary key); on any failure the temporary file is removed and an existing
    file at ``path`` is left as it was.
    Raises ValueError when ``manifest`` uses a reserved key (format, version, arrays) or an
    array needs pickle (object dtype), TypeError for names that are not strs, values that are
    not numpy arrays (or :class:`Chunked`) or a manifest JSON cannot hold, OSError from the file
    system or store, and ConfigError for a storage URL without its packages (the
    ``kvstore-ps[storage]`` extra).  A :class:`Chunked` array's chunks are written as they come (a
    failure while producing them, or chunks that do not fill its shape, leave no file).
    """
    reserved = sorted(set(manifest) & set(RESERVED))
    if reserved:
        raise ValueError(f"manifest keys {reserved} are reserved by the file format")
    members: dict[str, str] = {}
    for index, (name, array) in enumerate(arrays.items()):
        if not isinstance(name, str):
            raise TypeError(f"array names must be strs, not {type(name).__name__} {name!r}")
        if not isinstance(array, (np.ndarray, Chunked)):
            raise TypeError(f"array {name!r} must be a numpy array, not {type(array).__name__}")
        if array.dtype.hasobject:
            raise ValueError(f"array {name!r} has dtype {array.dtype}, which would need pickle")
        members[name] = f"arrays/{index:06d}.npy"
    document = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "arrays": members, **manifest}
    encoded = json.dumps(document, separators=(",", ":")).encode("utf-8")
    storage.atomic_write(path, lambda f: _write_zip(f, encoded, members, arrays))


def _member_info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    return info


def _write_zip(f: IO[bytes], manifest: bytes, members: Mapping[str, str],
               arrays: Mapping[str, np.ndarray | Chunked]) -> None:
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr(_member_info(MANIFEST), manifest)
        for name, member in members.items():
            with zf.open(_member_info(member), "w", force_zip64=True) as out:
                array = arrays[name]
                if isinstance(array, Chunked):
                    _write_chunked(out, array, name)
                else:
                    npy.write_array(out, array, allow_pickle=False)


@dataclass(frozen=True)
class Stored:
    """An array left in its file (:func:`read` with ``streamed``): its ``shape`` and ``dtype`` (its
    header checked against its member's size), its elements read a run at a time (:meth:`runs`) or
    whole (:meth:`read`), each time from the file (which must not change meanwhile)."""

    path: str
    member: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        """Elements in all."""
        return math.prod(self.shape)

    def check(self) -> None:
        """Read the member through once (a block at a time: memory stays small) so its CRC, checked at
        its end, is; FormatError when the file is damaged."""
        with _opened(self.path) as zf, zf.open(self.member) as f:
            while f.read(CHECK_BLOCK):
                pass

    def runs(self, sizes: Iterable[int], checked: bool = False) -> Iterator[np.ndarray]:
        """Consecutive runs of the array's elements (flat, C order), one of each of ``sizes`` elements,
        read as they are asked for: memory holds one run.  The member is read through once first
        (:meth:`check`, unless ``checked``: the caller did) so a damaged file raises before the first
        run is handed out (the servers are sent nothing of it).  FormatError when the file is damaged
        or the runs pass the array's end."""
        if not checked:
            self.check()
        with _opened(self.path) as zf, _member_data(zf, self.member, self.name, self.path) as f:
            done = 0
            for size in sizes:
                if done + size > self.size:
                    raise FormatError(f"{self.path}: array {self.name!r} has {self.size} elements, not "
                                      f"{done + size}")
                data = f.read(size * self.dtype.itemsize)
                if len(data) != size * self.dtype.itemsize:
                    raise FormatError(f"{self.path}: array {self.name!r} ends early (truncated)")
                done += size
                yield np.frombuffer(data, self.dtype).copy()  # writable, and its own memory

    def read(self) -> np.ndarray:
        """The whole array (its CRC checked as its last byte is read)."""
        (flat,) = self.runs([self.size], checked=True)
        return flat.reshape(self.shape)


def check_stored(*arrays: Any) -> None:
    """:meth:`Stored.check` each of ``arrays`` left in its file (others are skipped): a load that sends
    several arrays a run at a time calls it first, so a damaged one is refused before any is sent."""
    for array in arrays:
        if isinstance(array, Stored):
            array.check()


def runs(array: np.ndarray | Stored, sizes: list[int], checked: bool = False) -> Iterator[np.ndarray]:
    """Consecutive flat runs of ``array``'s elements, one of each of ``sizes``: slices of an array in
    memory, or read from its file a run at a time (a :class:`Stored`, its member checked first unless
    ``checked``)."""
    if isinstance(array, Stored):
        yield from array.runs(sizes, checked)
        return
    flat, start = np.ascontiguousarray(array).reshape(-1), 0
    for size in sizes:
        yield flat[start:start + size]
        start += size


@contextlib.contextmanager
def _opened(where: str) -> Iterator[zipfile.ZipFile]:
    """The kvstore file at ``where`` as an open zip; its damage raised as FormatError."""
    with storage.open_read(where) as f:
        try:
            with zipfile.ZipFile(f) as zf:
                yield zf
        except FormatError:
            raise
        except _DAMAGE as exc:
            raise FormatError(f"{where} is not a readable kvstore file (damaged or not a zip "
                              f"archive): {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def _member_data(zf: zipfile.ZipFile, member: str, name: str, where: str) -> Iterator[IO[bytes]]:
    """Member ``member`` (array ``name``) opened at its first data byte (after its .npy header)."""
    _header(zf, member, name, where)
    with zf.open(member) as f:
        version = npy.read_magic(f)
        (npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0)(f)
        yield f


Streamed = Callable[[Mapping[str, Any], str, int], bool]  # (manifest, array name, its bytes): left in file


def read(path: str | os.PathLike, streamed: Streamed | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a file written by :func:`write`: ``(manifest fields, {name: array})``.

    The manifest returned holds the caller's fields only (format, version and arrays are
    taken out).  Nothing is unpickled.  With ``streamed``, an array for which
    ``streamed(manifest, name, its bytes)`` is true is left in the file: a :class:`Stored` (its header
    checked), read later a run at a time.  Raises FileNotFoundError (and other OSErrors) when
    the file cannot be opened, and FormatError when it is not a zip, has no or a malformed
    manifest, is of another format or a newer version (the message says to upgrade), lacks
    a listed member, or holds a damaged or truncated array or one that would need pickle.
    """
    where = os.fspath(path)
    with _opened(where) as zf:
        document = _manifest(zf, where)
        members = document.pop("arrays")
        arrays: dict[str, Any] = {}
        for name, member in members.items():
            info, shape, dtype = _header(zf, member, name, where)
            if streamed is not None and streamed(document, name, math.prod(shape) * dtype.itemsize):
                arrays[name] = Stored(where, member, name, shape, dtype)
            else:
                with zf.open(info) as f:
                    arrays[name] = npy.read_array(f, allow_pickle=False)
    for key in RESERVED:
        document.pop(key, None)
    return document, arrays


def _manifest(zf: zipfile.ZipFile, where: str) -> dict[str, Any]:
    try:
        raw = zf.read(MANIFEST)
    except KeyError:
        raise FormatError(f"{where} is not a kvstore file: it has no {MANIFEST}") from None
    try:
        document = json.loads(raw.decode("utf-8"))
    except ValueError as exc:
        raise FormatError(f"{where}: {MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise FormatError(f"{where} is not a kvstore file: its {MANIFEST} does not say "
                          f"format {FORMAT_NAME!r}")
    version = document.get("version")
    if not _is_int(version) or version < 1:
        raise FormatError(f"{where}: bad format version {version!r}")
    if version > FORMAT_VERSION:
        raise FormatError(f"{where} is in kvstore file format version {version}, but this kvstore "
                          f"reads versions up to {FORMAT_VERSION}: upgrade kvstore to read it")
    members = document.get("arrays")
    if not (isinstance(members, dict) and all(isinstance(m, str) for m in members.values())):
        raise FormatError(f"{where}: the manifest's 'arrays' is not a mapping of names to members")
    return document


def _read_member(zf: zipfile.ZipFile, member: str, name: str, where: str) -> np.ndarray:
    """One array, its header checked against the member's size before any data is read."""
    info, _, _ = _header(zf, member, name, where)
    with zf.open(info) as f:
        return npy.read_array(f, allow_pickle=False)


def _header(zf: zipfile.ZipFile, member: str, name: str,
            where: str) -> tuple[zipfile.ZipInfo, tuple[int, ...], np.dtype]:
    """The member, shape and dtype of array ``name`` (member ``member``), its header checked against
    the member's size (FormatError when they disagree, or it needs pickle)."""
    try:
        info = zf.getinfo(member)
    except KeyError:
        raise FormatError(f"{where}: member {member!r} of array {name!r} is missing") from None
    with zf.open(info) as f:
        version = npy.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = npy.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = npy.read_array_header_2_0(f)
        else:
            raise FormatError(f"{where}: array {name!r} uses .npy version {version}, which is not "
                              "supported")
        if dtype.hasobject:
            raise FormatError(f"{where}: array {name!r} has dtype {dtype}, which needs pickle; refused")
        expected = math.prod(shape) * dtype.itemsize
        stored = info.file_size - f.tell()
    if stored != expected:
        raise FormatError(f"{where}: array {name!r} ({dtype}{list(shape)}) should have {expected} data "
                          f"bytes but its member has {stored} (truncated or damaged)")
    return info, tuple(shape), dtype


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- plain arrays (like mx.nd.save / mx.nd.load) ------------------------------------------------------

def save_arrays(path: str | os.PathLike, arrays: Mapping[str, Any]) -> None:
    """Save named numpy arrays or torch tensors (any device) to ``path`` atomically.

    Raises TypeError for a name that is not a str or a value that is neither an array nor a
    tensor, DTypeMismatchError for a dtype kvstore does not support (float16/32/64,
    int32/64), OSError from the file system.
    """
    from kvstore.core.values import as_array

    if not isinstance(arrays, Mapping):
        raise TypeError(f"save_arrays takes a mapping of names to arrays, not {type(arrays).__name__}")
    write(path, {"kind": "arrays"}, {name: as_array(value) for name, value in arrays.items()})


def load_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load the arrays :func:`save_arrays` wrote, as numpy arrays.

    Raises FileNotFoundError/OSError when the file cannot be opened, FormatError when it is
    damaged or holds something other than saved arrays (e.g. optimizer states).
    """
    manifest, arrays = read(path)
    _expect_kind(manifest, "arrays", path)
    return arrays


def _expect_kind(manifest: Mapping[str, Any], kind: str, path: Any) -> None:
    got = manifest.get("kind")
    if got != kind:
        raise FormatError(f"{os.fspath(path)} holds {got!r}, not {kind!r}")


# -- optimizer states ---------------------------------------------------------------------------------

@dataclass
class StateEntry:
    """One key's optimizer state, whole (not sliced): the weight's shape/dtype, count and arrays."""

    key: Key
    shape: tuple[int, ...]
    dtype: np.dtype
    count: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    ids: np.ndarray | None = None  # a dynamic table's: the row ids (int64) of the arrays' rows
    # (arrays and ids may be Chunked when written, Stored when read with ``streamed``: never held whole)


@dataclass
class StatesFile:
    """What an optimizer-states file holds: the optimizer spec (if dumped), num_update, entries."""

    optimizer: dict[str, Any] | None
    num_update: int
    entries: list[StateEntry] = field(default_factory=list)


def write_states(path: str | os.PathLike, states: StatesFile) -> None:
    """Write ``states`` to ``path`` atomically (kind ``"optimizer_states"``, docs/formats.md).

    Raises ValueError for an entry that does not describe itself (an unsupported dtype, a
    negative count, an array whose size differs from the shape's, a key twice), KeyTypeError
    for a bad key, TypeError for a spec JSON cannot hold, OSError from the file system.
    """
    arrays: dict[str, np.ndarray] = {}
    entries: list[dict[str, Any]] = []
    seen: set[Key] = set()  # 3 and "3" are different keys (and never equal)
    for index, entry in enumerate(states.entries):
        key = check_key(entry.key)
        if key in seen:
            raise ValueError(f"key {key!r} has two state entries")
        seen.add(key)
        shape = tuple(int(d) for d in entry.shape)
        name = dtype_name(np.dtype(entry.dtype))
        if name is None or any(d < 0 for d in shape) or not _is_int(entry.count) or entry.count < 0:
            raise ValueError(f"state entry of key {key!r} is malformed: shape {shape}, dtype "
                             f"{entry.dtype}, count {entry.count!r}")
        names: dict[str, str] = {}
        for state, array in entry.arrays.items():
            if not isinstance(state, str):
                raise TypeError(f"state names of key {key!r} must be strs, not {type(state).__name__}")
            if not isinstance(array, (np.ndarray, Chunked)) or array.size != math.prod(shape):
                raise ValueError(f"state {state!r} of key {key!r} does not have the {math.prod(shape)} "
                                 f"elements of shape {shape}")
            names[state] = f"{index}/{state}"
            arrays[names[state]] = array
        item = {"key": key, "shape": list(shape), "dtype": name, "count": entry.count, "states": names}
        if entry.ids is not None:  # a dynamic table's rows: shape[0] of them, by id
            ids = entry.ids
            if not (isinstance(ids, (np.ndarray, Chunked)) and ids.dtype == np.int64
                    and tuple(ids.shape) == shape[:1]):
                raise ValueError(f"row ids of key {key!r} must be int64 of shape {shape[:1]}")
            item["ids"] = f"{index}:ids"  # ':' is never in a state's member name
            arrays[item["ids"]] = ids
        entries.append(item)
    if not _is_int(states.num_update) or states.num_update < 0:
        raise ValueError(f"num_update must be a non-negative int, not {states.num_update!r}")
    manifest = {"kind": "optimizer_states", "optimizer": states.optimizer, "num_update": states.num_update,
                "keys": entries}
    write(path, manifest, arrays)


def read_states(path: str | os.PathLike, streamed: Callable[[Key, int], bool] | None = None) -> StatesFile:
    """Read a file :func:`write_states` wrote.

    The arrays of each entry of key ``k`` whose weight takes ``n`` bytes (its manifest's shape and
    dtype) with ``streamed(k, n)`` true (a row-sparse table's) are left in the file as
    :class:`Stored` arrays (a dynamic table's ``ids`` too, in the file's order: not sorted), read
    later a run at a time.  Raises FileNotFoundError/OSError when it cannot be opened, FormatError
    when it is damaged, of another kind, or an entry is malformed (bad key, shape, count or dtype, a
    missing array, an array whose size disagrees with the shape, a key twice).  The optimizer spec
    itself is checked only when it is used (:func:`restore_optimizer`).
    """
    where = os.fspath(path)
    manifest, arrays = read(where, _streamed_states(streamed) if streamed is not None else None)
    _expect_kind(manifest, "optimizer_states", where)
    spec, num_update, keys = manifest.get("optimizer"), manifest.get("num_update"), manifest.get("keys")
    if spec is not None and not isinstance(spec, dict):
        raise FormatError(f"{where}: 'optimizer' must be a spec object or null")
    if not _is_int(num_update) or num_update < 0 or not isinstance(keys, list):
        raise FormatError(f"{where}: 'num_update' or 'keys' is missing or malformed")
    entries = [_entry(item, arrays, where) for item in keys]
    if len({e.key for e in entries}) != len(entries):
        raise FormatError(f"{where}: a key has more than one state entry")
    return StatesFile(spec, num_update, entries)


def _streamed_states(streamed: Callable[[Key, int], bool]) -> Streamed:
    """``read``'s ``streamed`` for a states file: every array (and ids) of each entry whose key and
    weight's bytes (its shape and dtype in the manifest) ``streamed`` says to leave in the file."""
    left: set[str] | None = None

    def is_left(document: Mapping[str, Any], name: str, nbytes: int) -> bool:
        nonlocal left
        if left is None:
            left = set()
            items = document.get("keys")
            for item in items if isinstance(items, list) else []:
                if not isinstance(item, dict) or not isinstance(item.get("states"), dict):
                    continue
                shape, dtype = item.get("shape"), item.get("dtype")
                if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
                        and isinstance(dtype, str) and dtype in BY_NAME):
                    continue
                try:
                    key = check_key(item.get("key"))
                except KeyTypeError:
                    continue
                if streamed(key, math.prod(shape) * BY_NAME[dtype].itemsize):
                    left.update(n for n in item["states"].values() if isinstance(n, str))
                    if isinstance(item.get("ids"), str):
                        left.add(item["ids"])
        return name in left
    return is_left


def _entry(item: Any, arrays: Mapping[str, Any], where: str) -> StateEntry:
    if not isinstance(item, dict) or not {"key", "shape", "dtype", "count", "states"} <= set(item):
        raise FormatError(f"{where}: state entry {item!r:.200} lacks key, shape, dtype, count or states")
    try:
        key = check_key(item["key"])
    except KeyTypeError as exc:
        raise FormatError(f"{where}: {exc}") from None
    shape, dtype, count, states = item["shape"], item["dtype"], item["count"], item["states"]
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise FormatError(f"{where}: key {key!r} has a bad shape {shape!r:.200}")
    if dtype not in DTYPES:
        raise FormatError(f"{where}: key {key!r} has unknown dtype {dtype!r:.100}; known: {sorted(DTYPES)}")
    if not _is_int(count) or count < 0:
        raise FormatError(f"{where}: key {key!r} has a bad count {count!r:.100}")
    if not (isinstance(states, dict) and all(isinstance(n, str) for n in states.values())):
        raise FormatError(f"{where}: key {key!r} has a bad 'states' mapping")
    out: dict[str, np.ndarray] = {}
    for state, name in states.items():
        array = arrays.get(name)
        if array is None:
            raise FormatError(f"{where}: state {state!r} of key {key!r} names missing array {name!r}")
        if array.size != math.prod(shape) or dtype_name(array.dtype) is None:
            raise FormatError(f"{where}: state {state!r} of key {key!r} is {array.dtype}{list(array.shape)}, "
                              f"which does not fit shape {shape}")
        out[state] = array if isinstance(array, Stored) else array.reshape(shape)
    ids = None
    if "ids" in item:  # a dynamic table's rows
        ids = arrays.get(item["ids"]) if isinstance(item["ids"], str) else None
        if ids is None or ids.dtype != np.int64 or list(ids.shape) != shape[:1]:
            raise FormatError(f"{where}: key {key!r} has 'ids' that are not int64 of shape {shape[:1]}")
        if isinstance(ids, Stored):  # streamed: in the file's order
            return StateEntry(key, tuple(shape), BY_NAME[dtype], count, out, ids)
        order = np.argsort(ids, kind="stable")  # written as the servers held them: read sorted
        ids, out = ids[order], {name: array[order] for name, array in out.items()}
    return StateEntry(key, tuple(shape), BY_NAME[dtype], count, out, ids)


def _key_order(key: Key) -> tuple[bool, Any]:
    return isinstance(key, str), key


def optimizer_states(optimizer: Optimizer, weights: Mapping[Key, Any], dump_optimizer: bool,
                     declared: Mapping[Key, np.dtype] | None = None) -> StatesFile:
    """The states of every key ``optimizer`` holds state for (ints first, then strs, each sorted).

    Each entry takes its shape from ``weights[key]`` and its dtype from ``declared[key]`` when
    given (a store's bfloat16 key, held as a float32 master copy), else from the weight; the
    spec is included when ``dump_optimizer``.  Raises KeyNotInitializedError when a key with
    state has no weight.
    """
    from kvstore.core.values import describe

    entries = []
    for key in sorted(optimizer.states, key=_key_order):
        got = optimizer.get_state(key)
        if got is None:
            continue
        if key not in weights:
            raise KeyNotInitializedError(f"the optimizer has state for key {key!r}, which has no weight")
        shape, dtype = describe(weights[key])  # a weight on a GPU is not copied
        dtype = (declared or {}).get(key, dtype)
        count, arrays = got
        entries.append(StateEntry(key, shape, dtype, int(count), arrays))
    return StatesFile(optimizer.spec() if dump_optimizer else None, int(optimizer.num_update), entries)


def restore_optimizer(states: StatesFile, optimizer: Optimizer | None, weights: Mapping[Key, Any],
                      declared: Mapping[Key, np.dtype] | None = None) -> Optimizer:
    """The optimizer to use after loading ``states``, with their state installed.

    With a spec in ``states`` that is a new optimizer built from it (``optimizer`` is not
    touched); otherwise ``optimizer`` itself, its states, counts and num_update replaced
    (keys absent from ``states`` start afresh).  Everything is checked before anything
    changes.  Raises OptimizerError for a bad spec, no spec and no optimizer, or states
    that do not fit the optimizer; KeyNotInitializedError for a key not in ``weights``;
    ShapeMismatchError / DTypeMismatchError when an entry's shape or dtype differs from
    the weight's (``declared[key]`` when given, as for :func:`optimizer_states`), or the entry is a
    dynamic table's (with row ids).
    """
    if states.optimizer is not None:
        target = scratch = from_spec(states.optimizer)
    elif optimizer is None:
        raise OptimizerError("the optimizer-states file holds no optimizer and none is set "
                             "(set one first, or save with dump_optimizer=True)")
    else:
        target, scratch = optimizer, copy.copy(optimizer)  # filled first; `optimizer` changes at the end
        scratch.states, scratch.counts = {}, {}
    scratch.num_update = int(states.num_update)
    for entry in states.entries:
        if entry.key not in weights:
            raise KeyNotInitializedError(f"the file has optimizer state for key {entry.key!r}, which is "
                                         "not initialised")
        weight = weights[entry.key]
        if entry.ids is not None:
            raise ShapeMismatchError(f"optimizer state of key {entry.key!r} is a dynamic table's (rows by "
                                     "id); the key is not a dynamic table")
        if tuple(weight.shape) != tuple(entry.shape):
            raise ShapeMismatchError(f"optimizer state of key {entry.key!r} is for shape "
                                     f"{tuple(entry.shape)}, but the key has shape {tuple(weight.shape)}")
        dtype = (declared or {}).get(entry.key, xp.dtype_of(weight))
        if dtype != np.dtype(entry.dtype):
            raise DTypeMismatchError(f"optimizer state of key {entry.key!r} is for dtype "
                                     f"{dtype_name(entry.dtype)}, but the key has dtype "
                                     f"{dtype_name(dtype) or dtype}")
        scratch.set_state(entry.key, weight, entry.count, entry.arrays)
    if scratch is not target:
        target.states.clear()
        target.states.update(scratch.states)
        target.counts.clear()
        target.counts.update(scratch.counts)
        target.num_update = scratch.num_update
    return target

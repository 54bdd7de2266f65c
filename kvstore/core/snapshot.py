"""Server snapshots on disk: every key's value (and the optimizer's state) as one generation.

Users import it as ``kvstore.snapshot`` (``kvstore/__init__.py`` binds that name to this module).

A snapshot directory holds numbered generations and a pointer to the newest
complete one::

    DIR/LATEST                      "snapshot-000003\\n" (written last, atomically)
    DIR/snapshot-000003/values.arrays      every key's whole value (kind "values")
    DIR/snapshot-000003/optimizer.states   the optimizer and its state, when one is set
    DIR/snapshot-000002/...                the generation before, kept

A generation is written in a temporary directory, flushed, renamed into place,
and only then named in ``LATEST``; a crash at any point leaves ``LATEST`` naming
the previous complete generation.  ``DIR`` may be a storage URL (``s3://``...,
:mod:`kvstore.core.storage`): there a generation is written in place, and is
complete only once ``LATEST`` names it.  All files use kvstore's format
(docs/formats.md): no pickle.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.core import checkpoint, storage
from kvstore.core.checkpoint import Chunked, StatesFile, Stored
from kvstore.core.partition import Key, check_key
from kvstore.core.rowsparse import DYNAMIC_ROWS, RowSparse
from kvstore.errors import FormatError, KeyTypeError

__all__ = ["HeldRows", "POINTER", "newest", "read", "read_generation", "write"]

POINTER = "LATEST"
VALUES = "values.arrays"
STATES = "optimizer.states"
_GENERATION = re.compile(r"snapshot-(\d{6,})")


@dataclass(frozen=True)
class HeldRows:
    """A dynamic table's rows as a writer streams them (ids and rows in the same order, neither held
    whole); read back as a :class:`RowSparse`, or (``read_values``' ``stream_above``) as two
    :class:`Stored` arrays left in the file, in the file's order."""

    indices: Chunked | Stored
    rows: Chunked | Stored


Value = np.ndarray | Chunked | RowSparse | HeldRows  # what write_values takes for a key


def write_values(path: str, values: Mapping[Key, Value]) -> None:
    """Write every key's value to ``path`` atomically (kind ``"values"``); a dynamic table's value is a
    :class:`RowSparse` (or :class:`HeldRows`) of the rows it holds, written as its rows and
    (``row_ids``) their ids; a :class:`Chunked` value is streamed.  KeyTypeError for a bad key."""
    keys = [check_key(k) for k in values]
    arrays: dict[str, np.ndarray | Chunked] = {}
    row_ids: dict[str, str] = {}
    for i, k in enumerate(keys):
        value = values[k]
        if isinstance(value, Chunked):
            arrays[str(i)] = value
        elif isinstance(value, (RowSparse, HeldRows)):
            arrays[str(i)] = value.rows
            row_ids[str(i)] = f"ids:{i}"
            arrays[row_ids[str(i)]] = value.indices
        else:
            arrays[str(i)] = np.asarray(value)
    manifest: dict[str, Any] = {"kind": "values", "keys": keys}
    if row_ids:
        manifest["row_ids"] = row_ids
    checkpoint.write(path, manifest, arrays)


Read = np.ndarray | RowSparse | Stored | HeldRows  # what read_values gives for a key


def read_values(path: str, stream_above: int | None = None) -> dict[Key, Read]:
    """Read what :func:`write_values` wrote (a dynamic table as a :class:`RowSparse` of shape
    ``(DYNAMIC_ROWS, *row)``); FormatError when it is damaged or of another kind.  With
    ``stream_above``, a value of more bytes is left in the file (a :class:`Stored`) and so is every
    dynamic table (a :class:`HeldRows` of Stored ids and rows, in the file's order), to be read a
    run at a time."""

    def streamed(document: Mapping[str, Any], name: str, nbytes: int) -> bool:
        assert stream_above is not None
        ids = document.get("row_ids")
        dynamic = isinstance(ids, dict) and (name in ids or name in ids.values())
        return dynamic or nbytes > stream_above

    manifest, arrays = checkpoint.read(path, streamed if stream_above is not None else None)
    if manifest.get("kind") != "values" or not isinstance(manifest.get("keys"), list):
        raise FormatError(f"{path} holds {manifest.get('kind')!r}, not a snapshot's values")
    try:
        keys = [check_key(k) for k in manifest["keys"]]
    except KeyTypeError as exc:
        raise FormatError(f"{path}: {exc}") from None
    row_ids = manifest.get("row_ids", {})
    names = {str(i) for i in range(len(keys))}
    if not (isinstance(row_ids, dict) and set(row_ids) <= names
            and all(isinstance(v, str) and v not in names for v in row_ids.values())):
        raise FormatError(f"{path}: 'row_ids' must map value names to other arrays' names")
    if len(set(keys)) != len(keys) or set(arrays) != names | set(row_ids.values()):
        raise FormatError(f"{path}: the keys and the arrays do not match")
    out: dict[Key, Read] = {}
    for i, k in enumerate(keys):
        value = arrays[str(i)]
        ids = arrays.get(row_ids.get(str(i), ""))
        if ids is None:
            out[k] = value
            continue
        if ids.dtype != np.int64 or tuple(ids.shape) != tuple(value.shape[:1]) or len(value.shape) < 2:
            raise FormatError(f"{path}: the row ids of key {k!r} are not int64, one per row")
        if isinstance(value, Stored) or isinstance(ids, Stored):
            if not (isinstance(value, Stored) and isinstance(ids, Stored)):
                raise FormatError(f"{path}: the rows and row ids of key {k!r} are not both streamed")
            out[k] = HeldRows(ids, value)
            continue
        order = np.argsort(ids, kind="stable")  # written as the servers held them: read sorted
        out[k] = RowSparse(ids[order], value[order], (DYNAMIC_ROWS, *value.shape[1:]))
    return out


def _generations(names: list[str]) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_GENERATION.fullmatch, names) if m)


def _pointed(directory: str) -> str | None:
    """The generation ``LATEST`` names now, or None (no pointer, or not a generation's name)."""
    try:
        name = storage.read_text(storage.join(directory, POINTER)).strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _GENERATION.fullmatch(name) else None


def write(directory: str, values: Mapping[Key, Value], states: StatesFile | None) -> str:
    """Write a new generation of ``values`` (and ``states``) under ``directory``; return its path.

    ``directory`` is a local path or a storage URL (:mod:`kvstore.core.storage`).  ``LATEST``
    names the generation only once it is complete; the generation before it is kept and
    older ones are removed.  On a local disk a generation is written in a temporary folder
    and renamed into place; in an object store it is written in place (a number a killed
    writer left half-written is never reused, and is removed by the next write).  Raises
    OSError from the file system, ConfigError for a URL without its packages, and the errors
    of :func:`write_values` and :func:`kvstore.checkpoint.write_states`.
    """
    storage.makedirs(directory)
    try:
        names = storage.listdir(directory)
    except FileNotFoundError:  # an object store's empty prefix
        names = []
    for stale in names:  # left by a writer that was killed mid-write
        if stale.startswith(".snapshot-") and ".tmp-" in stale:
            storage.remove_tree(storage.join(directory, stale))
    done = _generations(names)
    previous = _pointed(directory)
    name = f"snapshot-{(done[-1] + 1 if done else 1):06d}"
    final = storage.join(directory, name)
    renamed = storage.renames_folders(directory)
    where = storage.join(directory, storage.temp_name(name)) if renamed else final
    if renamed:
        storage.make_folder(where)
    try:
        write_values(storage.join(where, VALUES), values)
        if states is not None:
            checkpoint.write_states(storage.join(where, STATES), states)
        if renamed:
            storage.rename_folder(where, final)
    except BaseException:
        storage.remove_tree(where)
        raise
    storage.atomic_write(storage.join(directory, POINTER), lambda f: f.write(f"{name}\n".encode()))
    if renamed:  # every generation here is complete: keep the newest before this one
        kept = f"snapshot-{done[-1]:06d}" if done else None
    else:  # a generation is complete when LATEST named it: keep the one it named
        kept = previous
    for old in done:
        if f"snapshot-{old:06d}" != kept:
            storage.remove_tree(storage.join(directory, f"snapshot-{old:06d}"))
    return final


def newest(directory: str) -> str:
    """The path of the generation ``LATEST`` names in ``directory`` (a local path or a storage URL).

    Raises FileNotFoundError when it holds no snapshot, FormatError when ``LATEST`` is damaged or
    names no generation, ConfigError for a URL without its packages.
    """
    pointer = storage.join(directory, POINTER)
    try:
        name = storage.read_text(pointer).strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} holds no snapshot (no {POINTER} file); take one with "
                                "kv.save_checkpoint(dir)") from None
    except UnicodeDecodeError:
        raise FormatError(f"{pointer} is not text: it is damaged") from None
    if not _GENERATION.fullmatch(name) or not storage.isdir(storage.join(directory, name)):
        raise FormatError(f"{pointer} names {name!r:.80}, which is not a snapshot generation here")
    return storage.join(directory, name)


def read_generation(generation: str, stream_above: int | None = None) -> tuple[dict[Key, Read],
                                                                                StatesFile | None]:
    """The values and optimizer states of the generation at ``generation`` (from :func:`newest`);
    ``stream_above``: values (:func:`read_values`) and keys' states of more bytes are left in the
    files (:class:`Stored`).  Raises OSError (FileNotFoundError once a later write removed it),
    FormatError when it is damaged."""
    values = read_values(storage.join(generation, VALUES), stream_above)
    states_path = storage.join(generation, STATES)
    streamed = None if stream_above is None else (lambda key, nbytes: nbytes > stream_above)
    states = checkpoint.read_states(states_path, streamed) if storage.exists(states_path) else None
    return values, states


def read(directory: str, stream_above: int | None = None) -> tuple[dict[Key, Read], StatesFile | None]:
    """The values and optimizer states of the generation ``LATEST`` names (``stream_above``: as
    :func:`read_generation`).

    ``directory`` is a local path or a storage URL.  Raises FileNotFoundError when it holds
    no snapshot, FormatError when ``LATEST`` or the generation is damaged, ConfigError for a
    URL without its packages.
    """
    return read_generation(newest(directory), stream_above)


def check_fits(values: Mapping[Key, Read], key: Key, shape: tuple[int, ...], dtype: Any) -> None:
    """Raise a shape or dtype error when the snapshot's value of ``key`` cannot serve that key (a
    dynamic table's rows, a :class:`RowSparse`, serve a dynamic table of the same rows only)."""
    from kvstore.errors import DTypeMismatchError, ShapeMismatchError

    value = values[key]
    dynamic = len(shape) > 1 and shape[0] == DYNAMIC_ROWS
    rows = isinstance(value, (RowSparse, HeldRows))
    if rows != dynamic:
        saved = "a dynamic table's rows" if rows else "a whole value"
        raise ShapeMismatchError(f"the snapshot holds {saved} for key {key!r}, but it is initialised "
                                 f"{'as' if dynamic else 'not as'} a dynamic table")
    held = value.rows if isinstance(value, (RowSparse, HeldRows)) else value
    got = (DYNAMIC_ROWS, *held.shape[1:]) if rows else tuple(held.shape)
    if got != tuple(shape):
        raise ShapeMismatchError(f"the snapshot holds key {key!r} with shape {got}, but it "
                                 f"is initialised with shape {tuple(shape)}")
    if held.dtype != np.dtype(dtype):
        raise DTypeMismatchError(f"the snapshot holds key {key!r} as {held.dtype}, but it is initialised "
                                 f"as {np.dtype(dtype)}")

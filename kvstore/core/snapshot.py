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
the previous complete generation.  All files use kvstore's format
(docs/formats.md): no pickle.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvstore.core import checkpoint
from kvstore.core.checkpoint import StatesFile
from kvstore.core.partition import Key, check_key
from kvstore.errors import FormatError, KeyTypeError

__all__ = ["POINTER", "read", "write"]

POINTER = "LATEST"
VALUES = "values.arrays"
STATES = "optimizer.states"
_GENERATION = re.compile(r"snapshot-(\d{6,})")


def write_values(path: str, values: Mapping[Key, np.ndarray]) -> None:
    """Write every key's value to ``path`` atomically (kind ``"values"``); KeyTypeError for a bad key."""
    keys = [check_key(k) for k in values]
    checkpoint.write(path, {"kind": "values", "keys": keys},
                     {str(i): np.asarray(values[k]) for i, k in enumerate(keys)})


def read_values(path: str) -> dict[Key, np.ndarray]:
    """Read what :func:`write_values` wrote; FormatError when it is damaged or of another kind."""
    manifest, arrays = checkpoint.read(path)
    if manifest.get("kind") != "values" or not isinstance(manifest.get("keys"), list):
        raise FormatError(f"{path} holds {manifest.get('kind')!r}, not a snapshot's values")
    try:
        keys = [check_key(k) for k in manifest["keys"]]
    except KeyTypeError as exc:
        raise FormatError(f"{path}: {exc}") from None
    if len(set(keys)) != len(keys) or set(arrays) != {str(i) for i in range(len(keys))}:
        raise FormatError(f"{path}: the keys and the arrays do not match")
    return {k: arrays[str(i)] for i, k in enumerate(keys)}


def _generations(directory: str) -> list[int]:
    found = []
    for name in os.listdir(directory):
        match = _GENERATION.fullmatch(name)
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def write(directory: str, values: Mapping[Key, np.ndarray], states: StatesFile | None) -> str:
    """Write a new generation of ``values`` (and ``states``) under ``directory``; return its path.

    ``LATEST`` names it only once it is complete; the generation before it is kept and
    older ones are removed.  Raises OSError from the file system, and the errors of
    :func:`write_values` and :func:`kvstore.checkpoint.write_states`.
    """
    os.makedirs(directory, exist_ok=True)
    for stale in os.listdir(directory):  # left by a writer that was killed mid-write
        if stale.startswith(".snapshot-") and ".tmp-" in stale:
            shutil.rmtree(os.path.join(directory, stale), ignore_errors=True)
    done = _generations(directory)
    name = f"snapshot-{(done[-1] + 1 if done else 1):06d}"
    temp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(temp)
    try:
        write_values(os.path.join(temp, VALUES), values)
        if states is not None:
            checkpoint.write_states(os.path.join(temp, STATES), states)
        checkpoint.fsync_directory(temp)
        os.rename(temp, os.path.join(directory, name))
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    checkpoint.fsync_directory(directory)
    checkpoint.atomic_write(os.path.join(directory, POINTER), lambda f: f.write(f"{name}\n".encode()))
    for old in done[:-1]:  # keep the generation before this one
        shutil.rmtree(os.path.join(directory, f"snapshot-{old:06d}"), ignore_errors=True)
    return os.path.join(directory, name)


def read(directory: str) -> tuple[dict[Key, np.ndarray], StatesFile | None]:
    """The values and optimizer states of the generation ``LATEST`` names.

    Raises FileNotFoundError when ``directory`` holds no snapshot, FormatError when
    ``LATEST`` or the generation is damaged.
    """
    pointer = os.path.join(directory, POINTER)
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} holds no snapshot (no {POINTER} file); take one with "
                                "kv.save_checkpoint(dir)") from None
    except UnicodeDecodeError:
        raise FormatError(f"{pointer} is not text: it is damaged") from None
    if not _GENERATION.fullmatch(name) or not os.path.isdir(os.path.join(directory, name)):
        raise FormatError(f"{pointer} names {name!r:.80}, which is not a snapshot generation here")
    values = read_values(os.path.join(directory, name, VALUES))
    states_path = os.path.join(directory, name, STATES)
    states = checkpoint.read_states(states_path) if os.path.exists(states_path) else None
    return values, states


def check_fits(values: Mapping[Key, np.ndarray], key: Key, shape: tuple[int, ...], dtype: Any) -> None:
    """Raise a shape or dtype error when the snapshot's value of ``key`` cannot serve that key."""
    from kvstore.errors import DTypeMismatchError, ShapeMismatchError

    value = values[key]
    if tuple(value.shape) != tuple(shape):
        raise ShapeMismatchError(f"the snapshot holds key {key!r} with shape {tuple(value.shape)}, but it "
                                 f"is initialised with shape {tuple(shape)}")
    if value.dtype != np.dtype(dtype):
        raise DTypeMismatchError(f"the snapshot holds key {key!r} as {value.dtype}, but it is initialised "
                                 f"as {np.dtype(dtype)}")

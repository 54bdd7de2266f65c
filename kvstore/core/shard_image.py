"""A server's shard image: its slices and row-sparse tables, their rounds and their optimizer state,
taken at one instant.

Pure, no I/O: :func:`capture` reads a :class:`~kvstore.core.shard.ShardState` (and the server's
optimizer) between two requests, so every key is as of the same instant and each key's value is
exactly the sum of its closed rounds (``dist_sync``) or applied contributions (``dist_async``): an
open round's accumulator or a half-assembled push is never in it.  Round numbers are per key, so
the image records each key's own: ``round`` (rounds closed) and ``applied`` (each worker's
contributions applied).  Taking it costs no barrier and no copy of the values (a stored value is
never written to: every update stores a new array); only the optimizer's state arrays, which an
update changes in place, are copied.  Row-sparse tables (given as the server's ``RowTables``) are
updated in place too, so their rows are copied (:mod:`kvstore.core.table_image`).

:func:`to_file` and :func:`from_file` turn an image into the manifest fields and arrays of the one
file format (:mod:`kvstore.core.checkpoint`, ``"kind": "server_shard"``, docs/formats.md) and back;
:func:`from_file` checks everything first and raises :class:`~kvstore.errors.FormatError` naming
what is wrong.  :mod:`kvstore.server.shards` writes and reads the files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.core import table_image
from kvstore.core.optimizer import Optimizer, from_spec
from kvstore.core.partition import Key
from kvstore.core.shard import ShardState
from kvstore.core.sparse_shard import RowTables
from kvstore.core.table_image import TableImage, copied
from kvstore.errors import FormatError, OptimizerError

KIND = "server_shard"
SHARD_VERSION = 2  # 2: row-sparse tables (``tables``); a shard without the field is 1 (dense keys only)


@dataclass
class KeyImage:
    """One key's slice as of the image: its value, rounds and optimizer state."""

    value: np.ndarray
    round: int                                   # rounds closed (dist_sync); 0 in dist_async
    applied: dict[int, int] = field(default_factory=dict)  # worker -> its contributions applied
    bf16: bool = False                           # held as the float32 master copy of a bfloat16 key
    count: int | None = None                     # the key's optimizer update count (None: no state)
    states: dict[str, np.ndarray] = field(default_factory=dict)
    members: tuple[int, ...] | None = None       # the key's worker set (None: every worker)


@dataclass
class ShardImage:
    """Everything one server holds of the dense keys and the row-sparse tables, as of one instant."""

    rank: int
    number: int                                  # the server's shards so far, this one included
    mode: str                                    # "dist_sync" or "dist_async"
    num_workers: int
    optimizer: dict[str, Any] | None             # the optimizer's spec (None: values are assigned)
    num_update: int
    keys: dict[Key, KeyImage]
    session: str = ""  # the cluster's session id (hex): a restart refuses a shard of another job
    tables: dict[Key, TableImage] = field(default_factory=dict)  # its row-sparse tables
    calls: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (worker, call) -> parts of an
    # init's or load's SPARSE_SETs held, its settle not answered yet (RowTables.calls)

    def step(self) -> int:
        """The furthest key's (or table's) progress: rounds closed, or (async) one worker's most
        contributions."""
        held = [*self.keys.values(), *self.tables.values()]
        return max((k.round if self.mode == "dist_sync" else max(k.applied.values(), default=0)
                    for k in held), default=0)


def capture(state: ShardState, optimizer: Optimizer | None, bf16_keys: set[Key], rank: int, number: int,
            spare: dict[Key, KeyImage] | None = None, tables: RowTables | None = None,
            spare_tables: dict[Key, TableImage] | None = None) -> ShardImage:
    """An image of ``state`` and ``tables`` (the row-sparse ones, copied: :mod:`kvstore.core.table_image`),
    and ``optimizer``'s state of their keys (copied), as of now.

    ``spare`` (``spare_tables``): the keys (tables) of an earlier image nobody reads any more, whose
    state arrays (and fixed tables' rows) are reused as the copies' buffers (a copy into memory
    already touched is several times faster than one into fresh pages).
    """
    keys: dict[Key, KeyImage] = {}
    spare = spare or {}
    for key, value, rounds, applied in state.applied_state():  # key groups form again afterwards
        image = KeyImage(value, rounds if state.sync else 0, applied, key in bf16_keys,
                         members=state.members_of(key))
        found = optimizer.get_state(key) if optimizer is not None else None
        if found is not None:
            old = spare.get(key)
            image.count = found[0]
            image.states = {name: copied(array, old.states.get(name) if old is not None else None)
                            for name, array in found[1].items()}
        keys[key] = image
    spec = optimizer.spec() if optimizer is not None else None
    return ShardImage(rank, number, "dist_sync" if state.sync else "dist_async", state.num_workers, spec,
                      optimizer.num_update if optimizer is not None else 0, keys,
                      tables={} if tables is None else table_image.capture(tables, optimizer, spare_tables),
                      calls={} if tables is None else {c: sorted(p) for c, p in tables.calls.items()})


def to_file(image: ShardImage) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The manifest fields and the arrays that store ``image`` (docs/formats.md, ``server_shard``)."""
    arrays: dict[str, np.ndarray] = {}
    entries = []
    for index, (key, held) in enumerate(image.keys.items()):
        arrays[f"{index}/value"] = held.value
        states = {}
        for name, array in held.states.items():
            states[name] = f"{index}/state/{len(states)}"
            arrays[states[name]] = array
        entry = {"key": key, "value": f"{index}/value", "round": held.round,
                 "applied": [[w, n] for w, n in sorted(held.applied.items())], "bfloat16": held.bf16,
                 "count": held.count, "states": states}
        if held.members is not None:  # absent: every worker (a shard written before worker sets)
            entry["workers"] = list(held.members)
        entries.append(entry)
    manifest = {"kind": KIND, "rank": image.rank, "number": image.number, "mode": image.mode,
                "num_workers": image.num_workers, "optimizer": image.optimizer,
                "num_update": image.num_update, "step": image.step(), "keys": entries,
                "session": image.session, "shard_version": SHARD_VERSION,
                "tables": table_image.entries(image.tables, arrays),
                "set_calls": [[w, c, parts] for (w, c), parts in sorted(image.calls.items())]}
    return manifest, arrays


def _count(value: Any, what: str, where: str) -> int:
    if type(value) is not int or value < 0:
        raise FormatError(f"{where}: {what} must be an int >= 0, not {str(value)[:40]!r}")
    return value


def _key_image(entry: Any, arrays: dict[str, np.ndarray], where: str) -> tuple[Key, KeyImage]:
    """One ``keys`` entry of a shard's manifest, checked."""
    key = table_image.entry_key(entry, where, "keys")
    value = arrays.get(entry.get("value")) if isinstance(entry.get("value"), str) else None
    applied, states = entry.get("applied"), entry.get("states")
    if value is None or not isinstance(applied, list) or not isinstance(states, dict):
        raise FormatError(f"{where}: key {key!r} lacks its value, 'applied' or 'states'")
    pairs = {}
    for pair in applied:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise FormatError(f"{where}: key {key!r}: 'applied' holds [worker, count] pairs")
        pairs[_count(pair[0], "a worker rank", where)] = _count(pair[1], "a count", where)
    found = {}
    for name, array_name in states.items():
        state = arrays.get(array_name) if isinstance(array_name, str) else None
        if state is None or state.size != value.size:
            raise FormatError(f"{where}: key {key!r}'s state {name!r} is missing or not the value's size")
        found[name] = state
    count, workers = entry.get("count"), entry.get("workers")
    if workers is not None and not (isinstance(workers, list) and workers):
        raise FormatError(f"{where}: key {key!r}: 'workers' is a non-empty list of worker ranks")
    image = KeyImage(value, _count(entry.get("round"), "'round'", where), pairs,
                     entry.get("bfloat16") is True,
                     None if count is None else _count(count, "'count'", where), found,
                     None if workers is None else tuple(sorted({_count(w, "a worker rank", where)
                                                                for w in workers})))
    return key, image


def from_file(manifest: dict[str, Any], arrays: dict[str, np.ndarray], where: str) -> ShardImage:
    """The image a shard file stores; raises :class:`FormatError` (naming ``where``) if malformed."""
    if manifest.get("kind") != KIND:
        raise FormatError(f"{where} is not a server shard (kind {str(manifest.get('kind'))[:40]!r})")
    version = manifest.get("shard_version", 1)
    if type(version) is not int or not 1 <= version <= SHARD_VERSION:
        raise FormatError(f"{where} is a server shard of version {str(version)[:40]}; this kvstore reads "
                          f"versions 1 to {SHARD_VERSION}: restart the server with the kvstore that wrote it")
    entries, mode, spec = manifest.get("keys"), manifest.get("mode"), manifest.get("optimizer")
    if not isinstance(entries, list) or mode not in ("dist_sync", "dist_async") or not (
            spec is None or isinstance(spec, dict)):
        raise FormatError(f"{where}: a shard needs 'keys', a mode and an optimizer spec or null")
    keys = dict(_key_image(entry, arrays, where) for entry in entries)
    if len(keys) != len(entries):
        raise FormatError(f"{where}: a key is stored twice")
    rank = _count(manifest.get("rank"), "'rank'", where)
    number = _count(manifest.get("number"), "'number'", where)
    session = manifest.get("session", "")
    if not isinstance(session, str):
        raise FormatError(f"{where}: 'session' must be a str")
    tables = table_image.from_entries(manifest.get("tables"), arrays, where)
    if set(tables) & set(keys):
        raise FormatError(f"{where}: a key is stored both as a dense key and as a table")
    if tables:
        try:
            optimizer = None if spec is None else from_spec(spec)
        except OptimizerError as exc:
            raise FormatError(f"{where}: its optimizer: {exc}") from None
        table_image.check_states(tables, optimizer, where)
    return ShardImage(rank, number, mode, _count(manifest.get("num_workers"), "'num_workers'", where), spec,
                      _count(manifest.get("num_update"), "'num_update'", where), keys, session, tables,
                      _calls(manifest.get("set_calls", []), where))


def _calls(found: Any, where: str) -> dict[tuple[int, int], list[int]]:
    """A manifest's ``set_calls`` ([worker, call, [parts]] each); FormatError naming ``where``."""
    if not isinstance(found, list):
        raise FormatError(f"{where}: 'set_calls' must be a list")
    calls = {}
    for entry in found:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], list)):
            raise FormatError(f"{where}: 'set_calls' holds [worker, call, [parts]] entries")
        parts = [_count(p, "a set's part", where) for p in entry[2]]
        calls[(_count(entry[0], "a worker rank", where), _count(entry[1], "a call", where))] = parts
    return calls

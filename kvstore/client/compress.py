"""A worker's gradient compression in dist modes: the setting, the residuals, the compressed arrays.

A worker's values for a key are summed first, then each push message's elements are compressed once
(``kvstore.core.compression``), each key slice with its own residual, which stays on this worker
(one flat float32 array per whole key).  The message's body names the compression
(``{"compression": [type, threshold]}``); its ``sizes`` still count original elements
(docs/protocol.md).  Servers decompress before they sum (``kvstore.server.decompress``).

With ``KVSTORE_SNAPSHOT_EVERY`` a worker also writes its residuals at the points servers write their
shards (every N of its rounds, or N seconds): ``KVSTORE_SNAPSHOT_DIR/worker-RANK/residuals.values``,
atomically, from a copy, on a thread of its own; a restarted worker (``--max-restarts``) starts from
them instead of zeros (docs/failures.md).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable

import numpy as np

from kvstore.config import Config
from kvstore.core import compression as C
from kvstore.core import rowsparse as R
from kvstore.core import snapshot, storage
from kvstore.core.dynamic import MAP_ENTRIES, SLOT_BYTES, DynamicRows, IdMap
from kvstore.core.partition import Key
from kvstore.core.plan import Send, pack
from kvstore.core.values import Meta
from kvstore.errors import ConfigError, FormatError

log = logging.getLogger("kvstore.dist")
_RESIDUALS = re.compile(r"residuals-worker(\d+)-of-(\d+)\.values")
ROW_RESIDUAL_BYTES = 64 << 20  # 2bit/1bit row residual bytes per table and worker (docs/compression.md)
_GENERATION = re.compile(r"snapshot-\d{6,}")  # as kvstore.core.snapshot names them


class WorkerCompression:
    """The compression setting of one dist store, and its residuals by key."""

    def __init__(self) -> None:
        self.spec: C.Spec | None = None
        self.residuals: dict[Key, np.ndarray] = {}
        self.rows = RowResiduals()  # row-sparse tables' residuals, by (table, row id)
        self.shards = ResidualShards(self)  # written with the servers' shards (KVSTORE_SNAPSHOT_EVERY)
        self._lock = threading.Lock()  # two threads may push one key

    def tags(self, keys: Iterable[Key], metas: dict[Key, Meta]) -> dict[Key, bool] | None:
        """Which of ``keys`` travel compressed (a push plan's tags), or None without compression.

        Raises DTypeMismatchError for a compressed key that is not float32."""
        spec = self.spec
        if spec is None:
            return None
        tags = {}
        for key in keys:
            meta = metas[key]
            tags[key] = meta.size >= spec.size_lower_bound
            if tags[key]:
                C.check_dtype(key, meta.dtype)
        return tags

    def encode(self, send: Send, flats: dict[Key, np.ndarray]) -> tuple[np.ndarray, dict | None]:
        """``send``'s array, compressed when its keys are, and the body fields that say so."""
        spec = self.spec
        if spec is None or not send.tag:
            return pack(send, flats), None
        grad = pack(send, flats)
        with self._lock:
            residual = self._residual(send, flats) if spec.residual else None
            wire = C.compress(spec, grad, residual)
            if residual is not None and len(send.parts) > 1:
                self._scatter(send, residual)
        if spec.type == "bf16":
            wire = wire.view(np.float16)  # bfloat16 bits travel in a 2-byte wire dtype
        return wire, {"compression": spec.wire()}

    def _residual(self, send: Send, flats: dict[Key, np.ndarray]) -> np.ndarray:
        """The residual of ``send``'s elements: a view for one part, else a concatenated copy."""
        for part in send.parts:
            held = self.residuals.get(part.key)
            if held is None or held.size != flats[part.key].size:  # a restored one must fit its key
                self.residuals[part.key] = np.zeros(flats[part.key].size, np.float32)
        return pack(send, self.residuals)

    def _scatter(self, send: Send, residual: np.ndarray) -> None:
        offsets = send.offsets()
        for part, a, b in zip(send.parts, offsets, offsets[1:]):
            self.residuals[part.key][part.start:part.stop] = residual[a:b]

    def state(self) -> dict[Key, np.ndarray]:
        """A copy of every key's residual (for a checkpoint)."""
        with self._lock:
            return {key: r.copy() for key, r in self.residuals.items()}

    def save(self, directory: str, rank: int, num_workers: int) -> None:
        """Write this worker's residuals into the snapshot generation ``LATEST`` names (after
        ``save_checkpoint`` wrote it); nothing without residuals.  Raises OSError."""
        residuals = self.state()
        if not residuals:
            return
        generation = _latest(directory)
        snapshot.write_values(storage.join(generation, f"residuals-worker{rank}-of-{num_workers}.values"),
                              residuals)

    def restore(self, cfg: Config, rank: int, num_workers: int, rejoined: bool) -> None:
        """Saved residuals, if any: a restarted worker's own last ones, else ``KVSTORE_RESUME``'s."""
        if rejoined:
            self.shards.read(cfg, rank)
        elif cfg.resume is not None:
            self.load(cfg.resume, rank, num_workers)

    def load(self, directory: str, rank: int, num_workers: int) -> None:
        """Restore this worker's residuals from the ``KVSTORE_RESUME`` snapshot when it was saved by
        as many workers; drop them with a warning when by another count."""
        try:
            generation = _latest(directory)
            names = storage.listdir(generation)
        except (OSError, ValueError):
            return  # no snapshot: the restore of values reports it
        counts = {int(m.group(2)) for m in map(_RESIDUALS.fullmatch, names) if m}
        if not counts:
            return
        if counts != {num_workers}:
            log.warning("the snapshot's compression residuals were saved by %s worker(s), this cluster "
                        "has %d: they are dropped (residuals start at zero)", sorted(counts), num_workers)
            return
        path = storage.join(generation, f"residuals-worker{rank}-of-{num_workers}.values")
        if storage.exists(path):
            self.take(snapshot.read_values(path))

    def take(self, residuals: dict[Key, np.ndarray]) -> None:
        """Start from saved ``residuals`` (each key's, as flat float32 arrays)."""
        with self._lock:
            self.residuals.update({k: np.array(r, np.float32).reshape(-1) for k, r in residuals.items()})


class RowResiduals:
    """A worker's 2bit / 1bit (and fp16 / bf16 ``error_feedback``) residuals of row-sparse tables: per
    table, one float32 row per row id it pushed, in at most ``budget`` bytes (:meth:`rows_for` rows: a
    :class:`DynamicRows` of zeros capped at that many; past it, the rows pushed least recently are
    forgotten, approximately as a dynamic table evicts, and start again at zero).  A push first
    :meth:`reserve` s its rows (never forgetting one of them); the rows it has no room for travel
    uncompressed (2bit, 1bit) or cast without a residual (fp16, bf16).  Each call is thread-safe; a
    push's ``reserve`` and its ``quantise`` / ``cast`` calls must not interleave with another push of
    the same table
    (:class:`kvstore.client.sparse.DistRows` sends one push at a time under its lock)."""

    def __init__(self, budget: int = ROW_RESIDUAL_BYTES) -> None:
        self.budget = budget
        self.tables: dict[Key, DynamicRows] = {}
        self._lock = threading.Lock()

    @staticmethod
    def row_bytes(width: int) -> int:
        """The bytes one residual row of ``width`` elements takes at most: its float32 values, its
        slot's counters and its id map entries."""
        return 4 * width + SLOT_BYTES + int(MAP_ENTRIES * IdMap.ENTRY_BYTES)

    def rows_for(self, width: int) -> int:
        """How many residual rows of ``width`` elements a table keeps: as many as ``budget`` holds
        (at least one)."""
        return max(1, self.budget // self.row_bytes(width))

    def reserve(self, key: Key, ids: np.ndarray, width: int) -> np.ndarray:
        """Take one push of distinct int64 ``ids`` of table ``key`` (rows of ``width`` elements): each
        id keeps its residual row or is given one (zeros) as room allows, never forgetting a row of
        ``ids`` for another; a bool per id: True where it has a residual row (its rows are then
        quantised by :meth:`quantise`), False where there was no room (they travel uncompressed)."""
        with self._lock:
            table = self.tables.get(key)
            if table is None or table.width != width:
                table = DynamicRows(width, np.dtype(np.float32), R.parse_init(key, "zeros"),
                                    R.DynamicSpec(capacity=self.rows_for(width)))
                self.tables[key] = table
            keep, _, _ = table.admit(np.asarray(ids, np.int64))
            has = np.zeros(ids.size, bool)
            has[keep] = True
            return has

    def quantise(self, spec: C.Spec, key: Key, ids: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The packed words (flat float32) of float32 ``rows`` ``(n, width)`` of distinct int64 ``ids``
        of table ``key`` under 2bit / 1bit ``spec``: each row's residual is added before it is coded
        and keeps what was not sent.  Raises KeyError unless every id has a residual row (given by
        :meth:`reserve` for this push)."""
        flat = np.ascontiguousarray(rows, np.float32).reshape(-1)
        if not ids.size:
            return C.quantise(spec.type, flat, np.zeros(0, np.float32), spec.threshold)
        with self._lock:
            table = self.tables[key]
            slots = table.map.get(np.asarray(ids, np.int64))
            if (slots < 0).any():
                raise KeyError(f"table {key!r}: {int((slots < 0).sum())} row(s) of the push have no "
                               "residual row (reserve them first)")
            residual = table.weight[slots]  # a copy: the rows' residuals, in ids' order
            packed = C.quantise(spec.type, flat, residual.reshape(-1), spec.threshold)
            table.weight[slots] = residual
        return packed

    def cast(self, spec: C.Spec, key: Key, ids: np.ndarray, rows: np.ndarray, has: np.ndarray) -> np.ndarray:
        """fp16 / bf16 ``spec`` with ``error_feedback``: the half-precision values (fp16, or bf16 bits as
        uint16), shaped as ``rows``, of float32 ``rows`` ``(n, width)`` of distinct int64 ``ids`` of
        table ``key``: a row with a residual row (``has``, from :meth:`reserve`) casts residual + row and
        keeps what the cast lost, the others are cast as they are.  Raises KeyError as :meth:`quantise`."""
        flat = np.ascontiguousarray(rows, np.float32)
        kept = np.flatnonzero(has)
        out = C.to_half(spec.type, flat.reshape(-1), None).reshape(flat.shape)
        if not kept.size:
            return out
        with self._lock:
            table = self.tables[key]
            slots = table.map.get(np.asarray(ids[kept], np.int64))
            if (slots < 0).any():
                raise KeyError(f"table {key!r}: {int((slots < 0).sum())} row(s) of the push have no "
                               "residual row (reserve them first)")
            residual = table.weight[slots]  # a copy: the rows' residuals, in ids' order
            out[kept] = C.to_half(spec.type, flat[kept].reshape(-1), residual.reshape(-1)).reshape(
                kept.size, -1)
            table.weight[slots] = residual
        return out

    def residual(self, key: Key, ids: np.ndarray) -> np.ndarray:
        """The residual rows of ``ids`` of table ``key`` now (zeros for rows it keeps none of).
        Raises KeyError for a table never pushed (its width is not known here)."""
        with self._lock:
            table = self.tables[key]
            slots = table.map.get(np.asarray(ids, np.int64))
            out = np.zeros((ids.size, table.width), np.float32)
            out[slots >= 0] = table.weight[slots[slots >= 0]]
            return out


def residual_path(directory: str, rank: int) -> str:
    """Where worker ``rank`` writes its residuals under ``KVSTORE_SNAPSHOT_DIR``."""
    return storage.join(directory, f"worker-{rank}", "residuals.values")


class ResidualShards:
    """A worker's residuals written at the servers' shard points, and read back by its restart."""

    def __init__(self, compression: WorkerCompression) -> None:
        self.compression = compression
        self.step, self.at = 0, time.monotonic()  # the last write's round and time
        self.thread: threading.Thread | None = None
        self.written = 0

    def due(self, cfg: Config, pushes: dict[Key, int]) -> bool:
        """Whether a write is due: residuals exist and N rounds (the worker's most pushes of a key) or N
        seconds have passed since the last one, and none is in flight."""
        if not (self.compression.residuals and cfg.snapshot_dir) or (self.thread and self.thread.is_alive()):
            return False
        if cfg.snapshot_rounds:
            return max(pushes.values(), default=0) >= self.step + cfg.snapshot_rounds
        return bool(cfg.snapshot_seconds) and time.monotonic() - self.at >= cfg.snapshot_seconds

    def write_if_due(self, cfg: Config, rank: int, pushes: dict[Key, int]) -> bool:
        """Copy the residuals and write them on a thread when :meth:`due`; return whether it was."""
        if not self.due(cfg, pushes):
            return False
        self.step, self.at = max(pushes.values(), default=0), time.monotonic()
        path = residual_path(cfg.snapshot_dir, rank)
        self.thread = threading.Thread(target=self._write, args=(path, self.compression.state()),
                                       name="kvstore-residuals", daemon=True)
        self.thread.start()
        return True

    def _write(self, path: str, residuals: dict[Key, np.ndarray]) -> None:
        try:
            storage.makedirs(storage.parent(path))
            snapshot.write_values(path, residuals)
            self.written += 1
        except (OSError, ValueError, ConfigError) as exc:  # never fatal: the previous file stays in effect
            log.error("could not write the compression residuals to %s: %s", path, exc)

    def read(self, cfg: Config, rank: int) -> bool:
        """A restarted worker's residuals from its last write (True), or none written (False)."""
        path = residual_path(cfg.snapshot_dir, rank) if cfg.snapshot_dir else None
        try:
            if path is None or not storage.exists(path):
                return False
        except (OSError, ConfigError) as exc:
            log.warning("compression residuals start at zero: %s", exc)
            return False
        try:
            found = snapshot.read_values(path)
        except FormatError as exc:
            log.warning("compression residuals start at zero: %s", exc)
            return False
        self.compression.take(found)
        log.warning("restarted with the compression residuals its last incarnation wrote to %s", path)
        return True


def _latest(directory: str) -> str:
    """The path of the snapshot generation ``LATEST`` names; ValueError for a bad pointer."""
    name = storage.read_text(storage.join(directory, snapshot.POINTER)).strip()
    if not _GENERATION.fullmatch(name):
        raise ValueError(f"{directory}: LATEST names {name!r:.80}")
    return storage.join(directory, name)

"""A server's own shard files: written every ``KVSTORE_SNAPSHOT_EVERY`` rounds or seconds, read back.

The server loop calls :meth:`ShardWriter.tick` between requests.  When a shard is due (the
server's furthest key has closed ``N`` rounds more than at the last shard, or ``N`` seconds have
passed, or keys were initialised since the last shard: a restart from it would lack them), it
takes an image of its state at once (:func:`kvstore.core.shard_image.capture`: no barrier, no
copy of the values, a copy of the optimizer state) and a thread of its own writes it, so training
stops only for the capture.  While one write is in flight no other image is taken
(memory stays one image).  Files live in ``KVSTORE_SNAPSHOT_DIR/server-RANK/shard-NUMBER.kvs``, in
the one file format (atomic: a crash mid-write leaves the previous shard in effect); the latest two
are kept and older ones removed.  ``KVSTORE_SNAPSHOT_DIR`` may be a storage URL (``s3://``...,
:mod:`kvstore.core.storage`): each shard file is then moved onto its name from a temporary key.
A failed write is logged and counted, never fatal: training goes
on with the previous shard in effect.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from kvstore.config import Config
from kvstore.core import checkpoint, storage
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key
from kvstore.core.shard import ShardState
from kvstore.core.shard_image import ShardImage, capture, from_file, to_file
from kvstore.core.sparse_shard import RowTables
from kvstore.errors import ConfigError, FormatError

log = logging.getLogger("kvstore.server")
KEEP = 2  # the latest shard and the one before it
CHECK_EVERY = 0.05  # seconds between two looks at the rounds (a scan of the keys) at most
SETS_QUIET = 0.5  # seconds without a new SPARSE_SET after which the rows set are due in a shard (a
# load's sets, a message after another, wait for its end: one shard, not one per message)
_NAME = re.compile(r"^shard-(\d{8})\.kvs$")


def server_dir(directory: str, rank: int) -> str:
    """The folder of server ``rank``'s shards under ``directory``."""
    return storage.join(directory, f"server-{rank}")


def shard_files(directory: str, rank: int) -> list[tuple[int, str]]:
    """Server ``rank``'s shard files under ``directory`` as (number, path), oldest first."""
    folder = server_dir(directory, rank)
    try:
        names = storage.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), storage.join(folder, name)) for name in names if (m := _NAME.match(name))]
    return sorted(found)


def read_latest(directory: str, rank: int) -> ShardImage | None:
    """Server ``rank``'s newest readable shard under ``directory`` (None: none written yet).

    A damaged newest file is skipped with a warning for the one before it; raises
    :class:`FormatError` when shards exist and none is readable.
    """
    files = shard_files(directory, rank)
    errors = []
    for _, path in reversed(files):
        try:
            manifest, arrays = checkpoint.read(path)
            return from_file(manifest, arrays, path)
        except FormatError as exc:
            log.warning("skipping a damaged shard: %s", exc)
            errors.append(str(exc))
    if errors:
        raise FormatError(f"no readable shard of server {rank} under {directory}: {'; '.join(errors)}")
    return None


class ShardWriter:
    """When a server's shard is due, its capture, and its write on a thread of its own."""

    def __init__(self, directory: str, rank: int, rounds: int = 0, seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, session: str = "") -> None:
        if not (rounds > 0 or seconds > 0):
            raise ValueError("a ShardWriter needs a period in rounds or seconds")
        self.directory, self.folder = directory, server_dir(directory, rank)
        storage.makedirs(self.folder)
        self.rank, self.rounds, self.seconds, self.clock = rank, rounds, seconds, clock
        self.session = session  # recorded in each shard: a restart refuses another job's
        files = shard_files(directory, rank)
        self.number = files[-1][0] if files else 0  # a restart goes on numbering
        self.last_step = 0
        self.last_time = self.last_check = clock()
        self.thread: threading.Thread | None = None
        self.written = self.failed = 0
        self.keys_written = 0  # keys in the last image written
        self.optimizer_written: tuple[Optimizer | None, int] = (None, 0)  # its optimizer and params
        self.optimizer_failed: tuple[Optimizer | None, int] = (None, 0)  # those of the last failed write
        self.last_written: ShardImage | None = None  # the last image written (its buffers are reused)
        self.keys_seen: int | None = None  # keys in the last image (None: none taken by this process)
        self.optimizer_seen: tuple[Optimizer | None, int] = (None, 0)  # the last image's, and its params
        self.sets_seen = 0  # RowTables.sets in the last image taken
        self.sets_written = self.sets_failed = 0  # ... in the last image written, or whose write failed
        self.sets_wanted = 0  # the sets a settle request waits for (want_sets): due at once
        self._sets_noticed, self._sets_moved_at = 0, 0.0  # sets when last looked at, and since when

    def tick(self, state: ShardState | None, optimizer: Optimizer | None, bf16_keys: set[Key],
             tables: RowTables | None = None) -> bool:
        """Capture a shard of ``state`` and the row-sparse ``tables`` and start writing it when one is
        due; return whether one was."""
        now = self.clock()
        if state is None or (self.thread is not None and self.thread.is_alive()):
            return False
        if not self._due(state, optimizer, now, tables):
            return False
        self.number += 1
        last, self.last_written = self.last_written, None  # its arrays become this image's copies
        image = capture(state, optimizer, bf16_keys, self.rank, self.number,
                        last.keys if last is not None else None, tables,
                        last.tables if last is not None else None)
        image.session = self.session
        self.last_step, self.last_time, self.keys_seen = image.step(), now, held_keys(image)
        self.optimizer_seen = _optimizer_at(optimizer)
        self.sets_seen = 0 if tables is None else tables.sets
        self.thread = threading.Thread(target=self._write, args=(image, self.optimizer_seen, self.sets_seen),
                                       name="kvstore-shard", daemon=True)
        self.thread.start()
        return True

    def _due(self, state: ShardState, optimizer: Optimizer | None, now: float,
             tables: RowTables | None = None) -> bool:
        """Whether a shard is due: a fresh server's first (at once, keys or none: a server that never
        holds a key restarts from it), keys initialised, an optimizer set or its hyper-parameters
        changed since the last one (a restart from it would lack the keys, apply no optimizer, or an
        old learning rate or rescale_grad), rows or states set (SPARSE_SET: a restart would bring back
        the init spec's rows) once a settle request waits for them or none came for SETS_QUIET
        seconds, else ``seconds`` passed or ``rounds`` more closed (looked at every CHECK_EVERY at
        most)."""
        if self.keys_seen is None:
            if self.number == 0:
                return True
            self.keys_seen = keys_of(state, tables)  # a restarted server: what the shard it started from held
            self.optimizer_seen = _optimizer_at(optimizer)
        seen, version = self.optimizer_seen
        if keys_of(state, tables) > self.keys_seen or optimizer is not seen or \
                _optimizer_at(optimizer)[1] != version:
            return True
        if tables is not None and tables.sets > self.sets_seen:
            if tables.sets != self._sets_noticed:
                self._sets_noticed, self._sets_moved_at = tables.sets, now
            if self.sets_wanted > self.sets_seen or now - self._sets_moved_at >= SETS_QUIET:
                return True
        if self.seconds > 0:
            return now - self.last_time >= self.seconds
        if now - self.last_check < CHECK_EVERY:
            return False
        self.last_check = now
        return progress_of(state, tables) >= self.last_step + self.rounds

    def _write(self, image: ShardImage, optimizer_at: tuple[Optimizer | None, int], sets: int = 0) -> None:
        """Write ``image`` (holding ``sets`` SPARSE_SETs) atomically, then remove all but the latest
        :data:`KEEP` shards."""
        path = storage.join(self.folder, f"shard-{image.number:08d}.kvs")
        started = time.monotonic()
        try:
            checkpoint.write(path, *to_file(image))
            for _, old in shard_files(self.directory, self.rank)[:-KEEP]:
                storage.remove(old)
        except Exception as exc:  # noqa: BLE001 -- any failure (a store backend's own errors, MemoryError):
            self.failed += 1  # counted, so a change of optimizer waiting for this write is answered
            self.optimizer_failed = optimizer_at
            self.sets_failed = max(self.sets_failed, sets)
            log.error("server %d could not write shard %d (%s): the previous one stays in effect",
                      self.rank, image.number, exc)
            return
        self.written += 1
        self.keys_written = held_keys(image)
        self.optimizer_written = optimizer_at
        self.sets_written = max(self.sets_written, sets)
        self.last_written = image
        log.info("server %d wrote shard %d (step %d, keys %d) to %s in %.3f s", self.rank, image.number,
                 image.step(), held_keys(image), path, time.monotonic() - started)

    def holds_all(self, keys: int, optimizer: Optimizer | None, sets: int = 0) -> bool:
        """Whether the last shard written holds ``keys`` keys, ``optimizer`` with its current
        hyper-parameters and ``sets`` SPARSE_SETs (for the test hook that kills a server once a restart
        from its shard is whole)."""
        return self.keys_written >= keys and self.holds_optimizer(optimizer) and self.sets_written >= sets

    def holds_optimizer(self, optimizer: Optimizer | None) -> bool:
        """Whether the last shard written holds ``optimizer`` with its current hyper-parameters."""
        return _same(self.optimizer_written, _optimizer_at(optimizer))

    def settled(self, optimizer: Optimizer | None) -> bool:
        """Whether a shard of ``optimizer`` at its current hyper-parameters has been written, or its
        write failed (logged): a server acknowledges a change of optimizer only then, so a restart
        from its shard cannot lose an acknowledged one (docs/failures.md)."""
        now = _optimizer_at(optimizer)
        return _same(self.optimizer_written, now) or _same(self.optimizer_failed, now)

    def want_sets(self, sets: int) -> None:
        """A settle request waits for the first ``sets`` SPARSE_SETs (RowTables.sets): a shard holding
        them is due at the next tick (unless written already)."""
        self.sets_wanted = max(self.sets_wanted, sets)

    def sets_settled(self, sets: int) -> bool:
        """Whether a shard holding the first ``sets`` SPARSE_SETs has been written, or its write failed
        (logged): a settle request is answered only then (docs/failures.md)."""
        return self.sets_written >= sets or self.sets_failed >= sets

    def look_now(self) -> None:
        """Look at the rounds at the next tick, whenever the last look was (the test hook
        ``KVSTORE_TEST_SERVER_DIE_AT_ROUND`` waits for a shard this way instead of racing the job)."""
        self.last_check = float("-inf")

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a write in flight (logged when it outlasts it)."""
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                log.warning("server %d: a shard write still runs after %.1f s; leaving it", self.rank,
                            timeout)


def held_keys(image: ShardImage) -> int:
    """How many keys ``image`` holds: dense keys and row-sparse tables."""
    return len(image.keys) + len(image.tables)


def keys_of(state: ShardState, tables: RowTables | None) -> int:
    """How many keys a server holds: dense keys and row-sparse tables."""
    return len(state) + (len(tables) if tables is not None else 0)


def progress_of(state: ShardState, tables: RowTables | None) -> int:
    """A server's furthest key's progress, its tables' included (a shard's step)."""
    return max(state.progress(), tables.progress() if tables is not None else 0)


def _same(a: tuple[Optimizer | None, int], b: tuple[Optimizer | None, int]) -> bool:
    """Whether two :func:`_optimizer_at` results name the same optimizer object at the same version."""
    return a[0] is b[0] and a[1] == b[1]


def _optimizer_at(optimizer: Optimizer | None) -> tuple[Optimizer | None, int]:
    """Which optimizer, and how often its hyper-parameters were set: a shard is due when either moves."""
    return optimizer, (0 if optimizer is None else optimizer.params_version)


def shard_writer(cfg: Config, rank: int, session: str = "") -> ShardWriter | None:
    """Server ``rank``'s writer as ``cfg`` asks, or None (no
    ``KVSTORE_SNAPSHOT_EVERY``).  Raises :class:`ConfigError` naming the folder when it cannot be made."""
    if not (cfg.snapshot_rounds or cfg.snapshot_seconds):
        return None
    try:
        return ShardWriter(cfg.snapshot_dir, rank, cfg.snapshot_rounds, cfg.snapshot_seconds, session=session)
    except OSError as exc:
        raise ConfigError(f"KVSTORE_SNAPSHOT_DIR={cfg.snapshot_dir!r}: cannot make server {rank}'s shard "
                          f"folder ({exc})") from None

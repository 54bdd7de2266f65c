"""A TensorBoard event file written by the launcher's writer thread (``launch.py --tensorboard``),
locally or under a storage URL; all its file access goes through :mod:`kvstore.core.storage`."""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import math
import os
import socket
import time
from typing import Any

from kvstore.core import storage
from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.launcher")
REMOTE_EVERY = 5.0  # seconds between writes of an event file's part to an object store
PART_BYTES = 1 << 20  # an event file on an object store goes on in a new part past this size


class EventFile:
    """One run's TensorBoard event file under ``folder``, written in the caller's thread (no thread of
    its own): :meth:`add` queues an event, :meth:`flush` appends what is queued in one go.  An append
    that fails (a full disk) is cut off again, so the file stays readable and later appends go on
    from its last whole record; the events of the failed one are dropped.

    Under a storage URL (an object store cannot append) the file is a series of parts, each a whole
    event file: the current part is kept in memory and written whole (:func:`storage.atomic_write`)
    at most every ``REMOTE_EVERY`` seconds and at :meth:`close`; past ``PART_BYTES`` the next flush
    starts a new part.  TensorBoard reads the parts in name order, each one's new bytes as it grows."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.remote = not storage.is_local(folder)
        self.path: str | None = None  # once created (a remote file: its current part)
        self._file: io.FileIO | None = None
        self._size = 0  # bytes of whole records in the file (or part)
        self._pending: list[bytes] = []
        self._part = bytearray()  # remote: the current part's bytes
        self._stored = 0  # remote: how many of them the store holds
        self._stored_at = -math.inf

    def add(self, event: Any) -> None:
        """Queue ``event`` (an ``event_pb2.Event``) for the next :meth:`flush`."""
        self._pending.append(event.SerializeToString())

    def flush(self) -> None:
        """Append the queued events (the file is created at the first).  Raises OSError, the file then
        cut back to its last whole record and the queued events dropped."""
        records, self._pending = self._pending, []
        if self.path is None:
            self._create()
        data = _framed(records, with_version=self._size == 0)
        if not data:
            return
        if self.remote:
            self._part += data
            self._size += len(data)
            if time.monotonic() - self._stored_at >= REMOTE_EVERY:
                self._store()
            return
        assert self._file is not None
        done = 0
        try:
            while done < len(data):
                done += self._file.write(data[done:]) or 0
        except OSError:
            with contextlib.suppress(OSError):
                self._file.truncate(self._size)  # the part of a record written would end the file
            raise
        self._size += len(data)

    def _create(self) -> None:
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                f"{next(_event_files):06d}")
        if self.remote:
            self.path = storage.join(self.folder, name)
            self._part, self._size, self._stored = bytearray(), 0, 0
            return
        storage.makedirs(self.folder)
        self.path = storage.join(self.folder, name)
        self._file = storage.open_append(self.path)  # held until close()

    def _store(self) -> None:
        """Write the current part whole; past PART_BYTES the next flush starts a new one.  Raises
        OSError, the part cut back to what the store holds."""
        assert self.path is not None
        part = bytes(self._part)
        try:
            storage.atomic_write(self.path, lambda f: f.write(part))
        except OSError:
            del self._part[self._stored:]
            self._size = self._stored
            raise
        self._stored, self._stored_at = len(part), time.monotonic()
        if self._stored >= PART_BYTES:
            self.path = None

    def close(self) -> None:
        """Close the file: a local one drops what was not flushed; a remote one writes what the store
        does not hold yet (a failure is logged, not raised)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.remote and self.path is not None and self._stored < len(self._part):
            try:
                self._store()
            except (OSError, ConfigError) as exc:
                log.warning("the last events of %s are lost: %s", self.path, exc)


def _framed(records: list[bytes], with_version: bool) -> bytes:
    """``records`` framed as TFRecords, after the file version event when ``with_version``."""
    from tensorboard.compat.proto import event_pb2  # the extra
    from tensorboard.summary.writer.record_writer import RecordWriter

    if with_version:  # every event file starts with its version
        records = [event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString(),
                   *records]
    if not records:
        return b""
    blob = io.BytesIO()
    framed = RecordWriter(blob)
    for record in records:
        framed.write(record)
    return blob.getvalue()


_event_files = itertools.count()

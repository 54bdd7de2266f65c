"""kvstore.launch.eventfile.EventFile under a storage URL (fsspec's in-process ``memory://`` store):
the parts it writes whole, when it writes them, and that together they read back as one run."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("fsspec")

from kvstore.core import storage  # noqa: E402
from kvstore.launch import eventfile  # noqa: E402
from kvstore.launch import tensorboard as kvtensorboard  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _scalar(step: int):
    return kvtensorboard._event("loss", float(step), step, time.time())


def _values(folder: str, local: Path) -> list[float]:
    """The 'loss' values of every part under ``folder``, read by TensorBoard's own loader from copies."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    local.mkdir()
    for name in sorted(storage.listdir(folder)):
        with storage.open_read(storage.join(folder, name)) as src:
            (local / name).write_bytes(src.read())
    events = EventAccumulator(str(local), purge_orphaned_data=False)
    events.Reload()
    return [scalar.value for scalar in events.Scalars("loss")]


def test_parts_are_written_at_most_every_interval_and_at_close(monkeypatch, tmp_path: Path) -> None:
    """Flushes within REMOTE_EVERY keep the part in memory; close writes it; the store's file reads back
    every value in order."""
    folder = f"memory://tb-{uuid.uuid4().hex}/worker-0"
    writer = eventfile.EventFile(folder)
    for step in range(3):
        writer.add(_scalar(step))
        writer.flush()
    assert len(storage.listdir(folder)) == 1  # the first flush wrote the part; the next two waited
    writer.close()
    assert _values(folder, tmp_path / "read") == [0.0, 1.0, 2.0]


def test_a_full_part_goes_on_in_a_new_one_that_reads_back_after_it(monkeypatch, tmp_path: Path) -> None:
    """Past PART_BYTES the next flush starts a new part (its own version record), named after the last:
    TensorBoard reads them as one run, in order."""
    monkeypatch.setattr(eventfile, "REMOTE_EVERY", 0.0)
    monkeypatch.setattr(eventfile, "PART_BYTES", 200)
    folder = f"memory://tb-{uuid.uuid4().hex}/worker-0"
    writer = eventfile.EventFile(folder)
    for step in range(12):
        writer.add(_scalar(step))
        writer.flush()
    writer.close()
    names = storage.listdir(folder)
    assert len(names) >= 3, names
    assert _values(folder, tmp_path / "read") == [float(step) for step in range(12)]


def test_a_failed_write_keeps_what_the_store_holds_and_goes_on(monkeypatch, tmp_path: Path) -> None:
    """A write the store refuses raises OSError; the part is cut back to what the store holds (the events
    of the failed flush are dropped) and the next flush writes the part on from there."""
    monkeypatch.setattr(eventfile, "REMOTE_EVERY", 0.0)
    folder = f"memory://tb-{uuid.uuid4().hex}/worker-0"
    writer = eventfile.EventFile(folder)
    writer.add(_scalar(0))
    writer.flush()
    real = storage.atomic_write

    def full(location, fill):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "atomic_write", full)
    writer.add(_scalar(1))
    with pytest.raises(OSError):
        writer.flush()
    monkeypatch.setattr(storage, "atomic_write", real)
    writer.add(_scalar(2))
    writer.flush()
    writer.close()
    assert _values(folder, tmp_path / "read") == [0.0, 2.0]

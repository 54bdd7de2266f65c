"""kvstore.snapshot: generations on disk, written so that a crash never leaves a broken one."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.core import checkpoint, snapshot
from kvstore.core import optimizer as O
from kvstore.errors import DTypeMismatchError, FormatError, ShapeMismatchError

VALUES = {3: np.arange(4.0), "w": np.ones((2, 3), np.float32), 2**64 - 1: np.zeros(1, np.int64)}


def test_values_and_states_round_trip(tmp_path: Path) -> None:
    """Int and str keys with their values, and the optimizer states, read back as written."""
    states = checkpoint.StatesFile({"name": "sgd", "params": {}}, 7,
                                   [checkpoint.StateEntry("w", (2, 3), np.dtype(np.float32), 7,
                                                          {"mom": np.full((2, 3), 0.5, np.float32)})])
    where = snapshot.write(str(tmp_path), VALUES, states)
    assert os.path.basename(where) == "snapshot-000001"
    values, got = snapshot.read(str(tmp_path))
    assert set(values) == set(VALUES)
    for key, value in VALUES.items():
        assert values[key].dtype == value.dtype and np.array_equal(values[key], value)
    assert got.num_update == 7 and np.array_equal(got.entries[0].arrays["mom"], np.full((2, 3), 0.5))
    snapshot.write(str(tmp_path / "plain"), VALUES, None)  # no optimizer: no states file
    assert snapshot.read(str(tmp_path / "plain"))[1] is None


def test_a_crash_while_writing_leaves_the_previous_generation(tmp_path: Path, monkeypatch) -> None:
    """If writing a generation fails part-way, LATEST still names the last complete one, and no
    temporary directory is left behind."""
    snapshot.write(str(tmp_path), VALUES, None)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_states", crash)
    states = checkpoint.StatesFile(None, 0, [])
    with pytest.raises(OSError, match="disk full"):
        snapshot.write(str(tmp_path), {3: np.full(4, 9.0)}, states)
    assert (tmp_path / "LATEST").read_text() == "snapshot-000001\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "snapshot-000001"]
    np.testing.assert_array_equal(snapshot.read(str(tmp_path))[0][3], np.arange(4.0))


def test_the_generation_before_is_kept_and_older_ones_removed(tmp_path: Path) -> None:
    """After three snapshots the directory holds the newest two; LATEST names the newest."""
    for i in range(3):
        snapshot.write(str(tmp_path), {1: np.full(2, float(i))}, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "snapshot-000002", "snapshot-000003"]
    np.testing.assert_array_equal(snapshot.read(str(tmp_path))[0][1], np.full(2, 2.0))


def test_missing_and_damaged_snapshots_are_reported(tmp_path: Path) -> None:
    """No LATEST is FileNotFoundError; a LATEST naming nothing, or a values file of another kind,
    is FormatError."""
    with pytest.raises(FileNotFoundError, match="no LATEST"):
        snapshot.read(str(tmp_path))
    (tmp_path / "LATEST").write_text("../../etc\n")
    with pytest.raises(FormatError):
        snapshot.read(str(tmp_path))
    snapshot.write(str(tmp_path), VALUES, None)
    checkpoint.save_arrays(tmp_path / "snapshot-000001" / snapshot.VALUES, {"a": np.zeros(1)})
    with pytest.raises(FormatError, match="not a snapshot's values"):
        snapshot.read(str(tmp_path))


def test_check_fits_names_the_mismatch() -> None:
    """A snapshot value of another shape or dtype than the key's init raises the matching error."""
    snapshot.check_fits(VALUES, "w", (2, 3), np.float32)
    with pytest.raises(ShapeMismatchError, match="shape"):
        snapshot.check_fits(VALUES, "w", (3, 2), np.float32)
    with pytest.raises(DTypeMismatchError):
        snapshot.check_fits(VALUES, "w", (2, 3), np.float64)


def test_local_store_saves_values_and_optimizer_state(tmp_path: Path) -> None:
    """kv.save_checkpoint on a local store writes every key and the optimizer's state."""
    kv = kvstore.create("local")
    kv.init(["a", 5], [np.zeros(3, np.float32), np.ones(2)])
    kv.set_optimizer(O.create("sgd", learning_rate=1.0, momentum=0.5))
    kv.push("a", np.ones(3, np.float32))
    kv.save_checkpoint(tmp_path)
    values, states = snapshot.read(str(tmp_path))
    np.testing.assert_array_equal(values["a"], np.full(3, -1.0, np.float32))
    np.testing.assert_array_equal(values[5], np.ones(2))
    assert states.optimizer["name"] == "sgd" and [e.key for e in states.entries] == ["a"]


def test_stale_temporary_generations_are_cleaned_and_binary_pointers_refused(tmp_path: Path) -> None:
    """A killed writer's temporary directory is removed by the next write; a LATEST that is not
    text is a FormatError."""
    (tmp_path / ".snapshot-000001.tmp-1-deadbeef").mkdir(parents=True)
    snapshot.write(str(tmp_path), VALUES, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "snapshot-000001"]
    (tmp_path / "LATEST").write_bytes(b"\xff\xfe")
    with pytest.raises(FormatError, match="not text"):
        snapshot.read(str(tmp_path))


def test_a_dynamic_tables_rows_round_trip_with_their_ids_and_fit_only_a_dynamic_table(tmp_path) -> None:
    """write_values keeps a RowSparse value as its rows and int64 ids (row_ids); read_values gives it
    back; check_fits refuses it for a fixed key and a whole value for a dynamic key, and ids of another
    length are a FormatError."""
    from kvstore.core.rowsparse import DYNAMIC_ROWS, RowSparse

    rows = RowSparse(np.array([-4, 9], np.int64), np.ones((2, 3), np.float32), (DYNAMIC_ROWS, 3))
    path = str(tmp_path / "v")
    snapshot.write_values(path, {"d": rows, "w": np.zeros(2, np.float32)})
    back = snapshot.read_values(path)
    assert isinstance(back["d"], RowSparse) and list(back["d"].indices) == [-4, 9]
    np.testing.assert_array_equal(back["d"].rows, rows.rows)
    snapshot.check_fits(back, "d", (DYNAMIC_ROWS, 3), np.float32)
    with pytest.raises(ShapeMismatchError, match="dynamic"):
        snapshot.check_fits(back, "d", (5, 3), np.float32)
    with pytest.raises(ShapeMismatchError, match="dynamic"):
        snapshot.check_fits(back, "w", (DYNAMIC_ROWS, 2), np.float32)
    manifest, arrays = checkpoint.read(path)
    arrays[manifest["row_ids"]["0"]] = np.arange(3, dtype=np.int64)
    checkpoint.write(str(tmp_path / "bad"), manifest, arrays)
    with pytest.raises(FormatError, match="row ids"):
        snapshot.read_values(str(tmp_path / "bad"))


def test_values_past_a_size_and_dynamic_tables_can_be_left_in_the_file(tmp_path) -> None:
    """read_values(stream_above=N) leaves a value of more than N bytes (a Stored) and every dynamic
    table (a HeldRows of Stored ids and rows, in the file's order) in the file; check_fits judges them
    as the values read whole; smaller values read whole."""
    from kvstore.core.rowsparse import DYNAMIC_ROWS, RowSparse

    rows = RowSparse(np.array([9, -4], np.int64), np.arange(6, dtype=np.float32).reshape(2, 3),
                     (DYNAMIC_ROWS, 3))
    big, small = np.arange(64, dtype=np.float32).reshape(16, 4), np.ones(2, np.float32)
    snapshot.write_values(str(tmp_path / "v"), {"d": rows, "big": big, "small": small})
    back = snapshot.read_values(str(tmp_path / "v"), stream_above=32)
    assert isinstance(back["big"], checkpoint.Stored) and isinstance(back["small"], np.ndarray)
    np.testing.assert_array_equal(back["big"].read(), big)
    held = back["d"]
    assert isinstance(held, snapshot.HeldRows)
    np.testing.assert_array_equal(held.indices.read(), [9, -4])
    np.testing.assert_array_equal(held.rows.read(), rows.rows)
    snapshot.check_fits(back, "d", (DYNAMIC_ROWS, 3), np.float32)
    snapshot.check_fits(back, "big", (16, 4), np.float32)
    with pytest.raises(ShapeMismatchError, match="dynamic"):
        snapshot.check_fits(back, "d", (5, 3), np.float32)
    with pytest.raises(ShapeMismatchError, match="shape"):
        snapshot.check_fits(back, "big", (4, 16), np.float32)

"""kvstore.core.storage: plain paths, file:// and fsspec URLs (memory:// here; s3:// against a real
S3-compatible server in tests/integration/test_storage_s3.py)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.core import checkpoint, snapshot, storage
from kvstore.errors import ConfigError
from tests.helpers import REPO

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def memory_url() -> str:
    """A fresh memory:// folder, removed afterwards."""
    url = f"memory://kvstore-test/{uuid.uuid4().hex}"
    yield url
    storage.remove_tree(url)


def _memory_names(url: str) -> list[str]:
    return sorted(storage.listdir(url))


def test_local_paths_and_file_urls_name_the_same_file(tmp_path: Path) -> None:
    """A plain path and file:// (with or without localhost) are the same local path; other URLs are not
    local; join and parent work on both."""
    assert storage.local_path(tmp_path / "x") == str(tmp_path / "x")
    assert storage.local_path(f"file://{tmp_path}/x") == f"{tmp_path}/x"
    assert storage.local_path(f"file://localhost{tmp_path}/x") == f"{tmp_path}/x"
    assert storage.local_path("s3://bucket/x") is None and not storage.is_local("memory://a")
    assert storage.join("s3://bucket/run/", "LATEST") == "s3://bucket/run/LATEST"
    assert storage.parent("s3://bucket/run/LATEST") == "s3://bucket/run"
    assert storage.absolute("s3://bucket/run") == "s3://bucket/run"
    assert storage.absolute("relative") == str(Path.cwd() / "relative")


def test_save_checkpoint_to_a_file_url_writes_that_path(tmp_path: Path, monkeypatch) -> None:
    """save_checkpoint("file:///.../x") writes the folder /.../x, not a folder named "file:" here."""
    monkeypatch.chdir(tmp_path)
    kv = kvstore.create("local")
    kv.init("w", np.arange(3.0))
    kv.save_checkpoint(f"file://{tmp_path}/ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (tmp_path / "ckpt" / "LATEST").read_text() == "snapshot-000001\n"
    np.testing.assert_array_equal(snapshot.read(f"file://{tmp_path}/ckpt")[0]["w"], np.arange(3.0))


def test_plain_paths_never_import_fsspec(tmp_path: Path) -> None:
    """import kvstore, a checkpoint to a plain path and a file:// URL, and reading them back, leave
    fsspec unimported (kvstore stays light without the storage extra)."""
    code = ("import sys, numpy as np, kvstore\n"
            "kv = kvstore.create('local'); kv.init('w', np.ones(2))\n"
            f"kv.save_checkpoint({str(tmp_path / 'a')!r}); kv.save_checkpoint('file://{tmp_path}/b')\n"
            f"kvstore.snapshot.read('file://{tmp_path}/b')\n"
            "assert 'fsspec' not in sys.modules, 'fsspec imported'\nprint('light')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "light" in out.stdout, out.stderr


def test_a_url_without_fsspec_is_a_config_error_naming_the_extra(monkeypatch) -> None:
    """Without fsspec a storage URL raises ConfigError saying to install kvstore-ps[storage]; an
    unknown protocol is a ConfigError too."""
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec raises ImportError
    with pytest.raises(ConfigError, match=r"kvstore-ps\[storage\]"):
        checkpoint.save_arrays("s3://bucket/x.arrays", {"a": np.zeros(1)})
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="nosuchproto"):
        checkpoint.load_arrays("nosuchproto://bucket/x.arrays")


def test_arrays_and_states_round_trip_through_memory(memory_url: str) -> None:
    """save_arrays/load_arrays and write_states/read_states work on a memory:// URL, leaving no
    temporary key behind."""
    checkpoint.save_arrays(f"{memory_url}/w.arrays", {"a": np.arange(4.0), "b": np.ones((2, 2), np.float32)})
    got = checkpoint.load_arrays(f"{memory_url}/w.arrays")
    np.testing.assert_array_equal(got["a"], np.arange(4.0))
    states = checkpoint.StatesFile({"name": "sgd", "params": {}}, 3, [checkpoint.StateEntry(
        "w", (2,), np.dtype(np.float32), 3, {"mom": np.full(2, 0.5, np.float32)})])
    checkpoint.write_states(f"{memory_url}/opt.states", states)
    back = checkpoint.read_states(f"{memory_url}/opt.states")
    assert back.num_update == 3 and np.array_equal(back.entries[0].arrays["mom"], np.full(2, 0.5))
    assert _memory_names(memory_url) == ["opt.states", "w.arrays"]


def test_a_failed_write_to_memory_keeps_the_old_file_and_no_temporary(memory_url: str, monkeypatch) -> None:
    """An array failing mid-write to a memory:// URL leaves the file before it readable and no
    temporary key."""
    target = f"{memory_url}/f.arrays"
    checkpoint.save_arrays(target, {"a": np.ones(3)})

    def failing(fp, array, **kwargs):
        fp.write(b"partial")
        raise RuntimeError("store on fire")

    monkeypatch.setattr(checkpoint.npy, "write_array", failing)
    with pytest.raises(RuntimeError, match="store on fire"):
        checkpoint.save_arrays(target, {"a": np.zeros(3)})
    monkeypatch.undo()
    np.testing.assert_array_equal(checkpoint.load_arrays(target)["a"], np.ones(3))
    assert _memory_names(memory_url) == ["f.arrays"]


def test_checkpoints_to_memory_keep_the_previous_generation(memory_url: str) -> None:
    """kv.save_checkpoint to memory:// three times: LATEST names the third, the second is kept, the first
    removed, and the store reads back the newest values and optimizer state."""
    kv = kvstore.create("local")
    kv.init("w", np.zeros(3, np.float32))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0, momentum=0.5))
    for _ in range(3):
        kv.push("w", np.ones(3, np.float32))
        kv.save_checkpoint(memory_url)
    assert _memory_names(memory_url) == ["LATEST", "snapshot-000002", "snapshot-000003"]
    values, states = snapshot.read(memory_url)
    now = np.empty(3, np.float32)
    kv.pull("w", out=now)
    np.testing.assert_array_equal(values["w"], now)
    np.testing.assert_array_equal(now, np.full(3, -1.0 - 1.5 - 1.75, np.float32))  # sgd, momentum 0.5
    assert states.num_update == 3


def test_a_half_written_generation_in_an_object_store_is_never_trusted(memory_url: str) -> None:
    """A generation a killed writer left without LATEST naming it is not read, its number is not
    reused, and the next write removes it while keeping the generation LATEST named."""
    snapshot.write(memory_url, {1: np.zeros(2)}, None)
    snapshot.write_values(f"{memory_url}/snapshot-000002/values.arrays", {1: np.full(2, 9.0)})  # no LATEST
    np.testing.assert_array_equal(snapshot.read(memory_url)[0][1], np.zeros(2))
    assert snapshot.write(memory_url, {1: np.ones(2)}, None) == f"{memory_url}/snapshot-000003"
    assert _memory_names(memory_url) == ["LATEST", "snapshot-000001", "snapshot-000003"]
    np.testing.assert_array_equal(snapshot.read(memory_url)[0][1], np.ones(2))

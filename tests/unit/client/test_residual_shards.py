"""Unit tests of a worker's residual shards (kvstore.client.compress.ResidualShards): written every N of
its rounds with the servers' shards, read back by its restart."""

from __future__ import annotations

import numpy as np

from kvstore import config
from kvstore.client.compress import WorkerCompression, residual_path


def _cfg(tmp_path, every: str = "3") -> config.Config:
    return config.load({"KVSTORE_SNAPSHOT_EVERY": every, "KVSTORE_SNAPSHOT_DIR": str(tmp_path)})


def test_residuals_are_written_every_n_rounds_and_read_by_a_restart(tmp_path) -> None:
    """Nothing before round 3, a copy at round 3 (later changes not in it), read back into a fresh worker."""
    cfg = _cfg(tmp_path)
    worker = WorkerCompression()
    worker.residuals["w"] = np.array([0.5, -0.25], np.float32)
    assert not worker.shards.write_if_due(cfg, 1, {"w": 2})
    assert worker.shards.write_if_due(cfg, 1, {"w": 3})
    worker.residuals["w"][:] = 9.0  # after the copy: not in the file
    worker.shards.thread.join(10)
    assert worker.shards.written == 1 and not worker.shards.write_if_due(cfg, 1, {"w": 5})
    restarted = WorkerCompression()
    restarted.restore(cfg, 1, 2, rejoined=True)
    np.testing.assert_array_equal(restarted.residuals["w"], [0.5, -0.25])


def test_without_residuals_or_a_file_nothing_is_written_or_read(tmp_path) -> None:
    """No residuals: no file; a restart with no file (or another rank's) keeps zeros (none)."""
    cfg = _cfg(tmp_path, "1")
    worker = WorkerCompression()
    assert not worker.shards.write_if_due(cfg, 0, {"w": 10})
    restarted = WorkerCompression()
    restarted.restore(cfg, 0, 2, rejoined=True)
    assert restarted.residuals == {}
    assert not (tmp_path / "worker-0").exists()
    assert residual_path(str(tmp_path), 0) == str(tmp_path / "worker-0" / "residuals.values")

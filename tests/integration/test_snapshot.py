"""Server snapshots: kv.save_checkpoint mid-training and launch.py --resume on a fresh cluster
(with another number of servers) continue exactly where the run stopped."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.checkpoint import load_arrays
from tests.helpers import finish, launch

SCRIPT = Path(__file__).parent / "scripts" / "snapshot_train.py"
ENV = {"KVSTORE_BIGARRAY_BOUND": "100", "KVSTORE_SHUTDOWN_TIMEOUT": "5"}  # the 8x32 weight is sliced


def _run(args: list[str], timeout: float = 90) -> str:
    rc, out = finish(launch(args, {**os.environ, **ENV}), timeout)
    assert rc == 0, out
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_snapshot_resumes_to_the_unbroken_run(tmp_path: Path, optimizer: str) -> None:
    """6 steps unbroken on 2 servers equal 3 steps + a snapshot on 1 server + 3 resumed on 2, bit for bit."""
    unbroken, resumed, snap = tmp_path / "unbroken.arrays", tmp_path / "resumed.arrays", tmp_path / "snap"
    alongside = launch(["-n", "2", "-s", "2", str(SCRIPT), optimizer, "0", "6", "--out", str(unbroken)],
                       {**os.environ, **ENV})  # the unbroken run, while the broken one runs

    def broken() -> None:
        _run(["-n", "2", "-s", "1", str(SCRIPT), optimizer, "0", "3", "--save", str(snap)])
        assert (snap / "LATEST").read_text().strip() == "snapshot-000001"
        _run(["-n", "2", "-s", "2", "--resume", str(snap), str(SCRIPT), optimizer, "3", "6",
              "--out", str(resumed)])
    same_as_unbroken(alongside, unbroken, resumed, broken)


def same_as_unbroken(alongside: subprocess.Popen, unbroken: Path, resumed: Path, broken: Callable[[], None],
                     timeout: float = 90) -> None:
    """Run ``broken`` (a broken run and its resume, writing ``resumed``) while the unbroken run
    ``alongside`` (writing ``unbroken``) goes on; then the two hold the same arrays, bit for bit."""
    try:
        broken()
        rc, out = finish(alongside, timeout)
    finally:
        if alongside.poll() is None:  # the broken run failed first
            os.killpg(alongside.pid, signal.SIGKILL)
            alongside.communicate()
    assert rc == 0, out
    expected, got = load_arrays(unbroken), load_arrays(resumed)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert np.array_equal(got[name], value), f"{name} differs after the resume"


def test_resume_without_a_snapshot_is_refused(tmp_path: Path) -> None:
    """launch.py --resume on a directory with no snapshot fails at once, saying so."""
    rc, out = finish(launch(["-n", "1", "--resume", str(tmp_path), str(SCRIPT), "sgd", "0", "1"]), 30)
    assert rc != 0 and "no snapshot there" in out


def test_keys_initialised_after_set_optimizer_get_their_state_back(make_cluster, tmp_path: Path) -> None:
    """Under resume, a key initialised after set_optimizer still continues from its snapshot state."""
    import dataclasses

    import kvstore
    from kvstore.client.store import DistKVStore

    first = make_cluster("dist_sync", 1, 1)
    (kv,) = first.workers
    kv.init(["a", "b"], [np.ones(2), np.ones(2)])
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))
    kv.push(["a", "b"], [np.ones(2), np.ones(2)])
    kv.save_checkpoint(tmp_path / "snap")
    kv.push(["a", "b"], [np.ones(2), np.ones(2)])
    want = kv.pull("a")  # the unbroken run's second step (momentum carried over)

    second = make_cluster("dist_sync", 1, 2, connect=False)
    cfg = dataclasses.replace(second.cfg, resume=str(tmp_path / "snap"))
    resumed = DistKVStore("dist_sync", cfg)
    second.workers = [resumed]
    resumed.init("a", np.zeros(2))
    resumed.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))
    resumed.init("b", np.zeros(2))  # after set_optimizer
    resumed.push(["a", "b"], [np.ones(2), np.ones(2)])
    np.testing.assert_array_equal(resumed.pull("a"), want)
    np.testing.assert_array_equal(resumed.pull("b"), want)


@pytest.mark.timeout(90)
def test_a_scalar_key_resumes_from_its_snapshot(make_cluster, tmp_path: Path) -> None:
    """A 0-d key (a learnable scale) saved by save_checkpoint resumes under KVSTORE_RESUME with shape ()
    (a dist init sends a view of its value: one that keeps a 0-d value 0-d)."""
    import dataclasses

    from kvstore.client.store import DistKVStore

    first = make_cluster("dist_sync", 1, 1)
    (kv,) = first.workers
    kv.init("s", np.array(2.0, np.float32))
    kv.push("s", np.array(3.0, np.float32))
    kv.save_checkpoint(tmp_path / "snap")
    second = make_cluster("dist_sync", 1, 1, connect=False)
    resumed = DistKVStore("dist_sync", dataclasses.replace(second.cfg, resume=str(tmp_path / "snap")))
    second.workers = [resumed]
    resumed.init("s", np.array(0.0, np.float32))
    got = resumed.pull("s")
    assert got.shape == () and float(got) == 3.0

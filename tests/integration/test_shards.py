"""Server shards (KVSTORE_SNAPSHOT_EVERY): each server writes its own slices, rounds and optimizer
state while training goes on, keeps the latest two, and each shard is one consistent instant."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.optimizer import create
from kvstore.server.shards import read_latest, shard_files
from tests.helpers import poll_for
from tests.integration import test_restarts

SCRIPT = Path(__file__).parent / "scripts" / "shard_train.py"
STEPS = 400  # long enough (about 0.5 s) for the writer to look at the rounds (every 50 ms at most)
launches = test_restarts.launches  # the fixture: launch.py runs whose processes are all killed at teardown


def expected(rounds: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A key's value and momentum after ``rounds`` rounds of two workers' all-ones pushes."""
    opt = create("sgd", learning_rate=0.01, momentum=0.9)
    weight = np.zeros(size, np.float32)
    for _ in range(rounds):
        opt.update("k", weight, np.full(size, 2.0, np.float32))
    return weight, opt.get_state("k")[1]["mom"]


@pytest.mark.timeout(90)
def test_each_server_writes_consistent_shards_every_n_rounds(launches, tmp_path: Path) -> None:
    """2 servers, 2 workers, 40 steps, KVSTORE_SNAPSHOT_EVERY=5: the job finishes; each server keeps
    at most 2 shards, numbered on; in the latest, each key's value and momentum are exactly those of
    its recorded round (0 < round <= 40), and both workers' applied pushes equal that round."""
    env = {"KVSTORE_SNAPSHOT_EVERY": "5", "KVSTORE_SNAPSHOT_DIR": str(tmp_path), "KVSTORE_LOG_LEVEL": "INFO"}
    run = launches(["-n", "2", "-s", "2", str(SCRIPT), str(STEPS)], env)
    assert run.finish(60) == 0, run.output
    assert re.search(r"server 1 wrote shard \d+ \(step \d+, keys \d+\)", run.output), run.output
    sizes: dict[str, int] = {}
    for rank in (0, 1):
        files = shard_files(str(tmp_path), rank)
        assert 1 <= len(files) <= 2, files
        image = read_latest(str(tmp_path), rank)
        assert image.number == files[-1][0] >= len(files) and image.optimizer["name"] == "sgd"
        for key, held in image.keys.items():
            assert 0 < held.round <= STEPS and held.applied == {0: held.round, 1: held.round}
            value, mom = expected(held.round, held.value.size)
            np.testing.assert_allclose(held.value, value, rtol=1e-6, err_msg=f"{key} on server {rank}")
            np.testing.assert_allclose(held.states["mom"], mom, rtol=1e-6)
            sizes[key] = sizes.get(key, 0) + held.value.size
    assert sizes == {"w": 200, "b": 3}  # 'w' sliced over both servers, 'b' on one


@pytest.mark.timeout(90)
def test_a_server_sigkilled_mid_training_leaves_a_complete_consistent_shard(launches, tmp_path: Path) -> None:
    """SIGKILL of server 0 after a shard of 3 steps or more, shards still being written: the job fails as
    it does without shards (137, named), and server 0's newest readable shard is whole and one instant
    (each key's value and momentum those of its round)."""
    env = {"KVSTORE_SNAPSHOT_EVERY": "3", "KVSTORE_SNAPSHOT_DIR": str(tmp_path), "KVSTORE_LOG_LEVEL": "INFO"}
    run = launches(["-n", "2", "-s", "2", str(SCRIPT), "1000000"], env)
    trained = re.compile(r"server 0 wrote shard \d+ \(step (?:[3-9]|\d\d+),")  # not its first ones
    poll_for(lambda: trained.search(run.output) or run.proc.poll() is not None, 60,
             "server 0's first shard of 3 steps or more")
    pids = test_restarts.role_pids(run.tag, "KVSTORE_SERVER_ID=0")
    assert run.proc.poll() is None and len(pids) == 1, run.output
    os.kill(pids[0], signal.SIGKILL)
    assert run.finish(60) == 137, run.output
    assert "server 0 exited with code 137" in run.output, run.output
    image = read_latest(str(tmp_path), 0)
    assert image.number >= 2 and len(shard_files(str(tmp_path), 0)) <= 2
    for key, held in image.keys.items():
        value, mom = expected(held.round, held.value.size)
        np.testing.assert_allclose(held.value, value, rtol=1e-6, err_msg=f"{key} at round {held.round}")
        np.testing.assert_allclose(held.states["mom"], mom, rtol=1e-6)

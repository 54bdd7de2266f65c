"""A split Session's edge cases in elastic dist_sync jobs (docs/elastic.md): joins at an epoch's first
step, workers without a batch in their process's first step, a leaver's last barrier, checkpoints once
worker 0 has left, a join before the job's first view (it waits for it), a join as the job ends
(refused).  KVSTORE_REQUEST_TIMEOUT is short, so a hang fails fast."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import REPO, python

SCRIPT = Path(__file__).parent / "scripts" / "elastic_split_edges.py"
ENV = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
       "KVSTORE_CONNECT_TIMEOUT": "60", "KVSTORE_REQUEST_TIMEOUT": "10"}


def launch(tmp_path: Path, options: list[str], *args: str) -> subprocess.CompletedProcess:
    """launch.py with 1 server and ``options`` running the edge-case script with ``args``."""
    argv = [python(), "launch.py", "-s", "1", *options, str(SCRIPT), str(tmp_path / "rec"), *args]
    return subprocess.run(argv, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True,
                          timeout=120)


def records(tmp_path: Path, ranks: int) -> dict[int, list[list[str]]]:
    """Each worker's record lines, split in words, by rank."""
    return {rank: [line.split() for line in (tmp_path / f"rec.{rank}").read_text().splitlines()]
            for rank in range(ranks) if (tmp_path / f"rec.{rank}").exists()}


def rows_by_epoch(found: dict[int, list[list[str]]]) -> dict[int, list[int]]:
    """Every sample id trained on, by epoch, over all workers (sorted)."""
    rows: dict[int, list[int]] = defaultdict(list)
    for lines in found.values():
        for line in lines:
            if len(line) == 4 and line[1] == "data":
                rows[int(line[2])].extend(int(r) for r in line[3].split(","))
    return {epoch: sorted(ids) for epoch, ids in rows.items()}


def test_a_worker_that_joins_at_an_epochs_first_step_uses_its_view_and_does_not_hang(tmp_path: Path) -> None:
    """A joiner whose map carries epoch 1's view (already released) and whose first step is that epoch's
    first goes on in epoch 1 pushing zeros, instead of opening a membership barrier nobody joins; it
    gets a share from epoch 2 on and every sample is seen once per epoch."""
    proc = launch(tmp_path, ["-n", "2", "--min-workers", "2", "--max-workers", "3"],
                  "join_at_start", "16", "4", "1", "3")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    found = records(tmp_path, 3)
    assert sorted(found) == [0, 1, 2], output[-4000:]
    assert rows_by_epoch(found) == {e: list(range(16)) for e in range(3)}
    joiner = found[2]
    assert [line[1] for line in joiner[:2]] == ["zero", "zero"]  # epoch 1 (steps 2, 3): not its own
    assert int(joiner[0][0]) == 2 and joiner[-1] == ["end", "6"]
    assert {int(line[2]) for line in joiner if line[1] == "data"} == {2}


def test_a_worker_without_a_batch_in_its_first_step_meets_the_rescale_agreement(tmp_path: Path) -> None:
    """3 samples over 2 workers, batches of 2, min_batch 2: parts of 2 and 1, so worker 1 has no batch
    in any step; its zero steps meet worker 0's first-step agreement of the servers' rescale_grad, in
    the job's first step and again in a relaunch resumed from a checkpoint (no hang either time)."""
    ckpt = tmp_path / "ckpt"
    first = launch(tmp_path, ["-n", "2"], "plain", "3", "2", "2", "2", str(ckpt))
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    found = records(tmp_path, 2)
    assert found[1] == [["0", "zero"], ["1", "zero"], ["end", "2"]] and found[0][-1] == ["end", "2"]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000001", "step-00000002"]
    shutil.rmtree(ckpt / "step-00000002")  # as if the job died during step 2
    second = launch(tmp_path, ["-n", "2"], "plain", "3", "2", "2", "2", str(ckpt))
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    found = records(tmp_path, 2)
    assert found[1] == [["1", "zero"], ["end", "2"]] and found[0][0][:3] == ["1", "data", "1"]


def test_a_leaver_s_last_barrier_paired_with_the_next_membership_view_fails_on_both(tmp_path: Path) -> None:
    """Worker 1 stops after epoch 0 and meets one more kv.barrier() before it closes its store; worker 0's
    epoch 1 membership view pairs with it: both fail with CollectiveMismatchError (the launch fails)
    instead of worker 0 training epoch 1 on a view that names the leaver (half its samples lost)."""
    proc = launch(tmp_path, ["-n", "2"], "leave_barrier", "8", "2", "1", "2")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "CollectiveMismatchError" in output and "asked for a plain barrier" in output, output[-4000:]
    assert rows_by_epoch(records(tmp_path, 2)) == {0: list(range(8))}  # no step of epoch 1 trained


def test_checkpoints_go_on_after_worker_0_leaves_and_a_resume_finds_them(tmp_path: Path) -> None:
    """Worker 0 leaves after epoch 0 (8 samples, 2 workers, batches of 2: 2 steps an epoch, 4 for one
    worker); worker 1 trains epochs 1 and 2 alone and, the lowest rank of their views, writes their
    checkpoints (every step) up to the job's last, 10, which the resume path takes as the newest."""
    import torch

    import kvstore

    ckpt = tmp_path / "ckpt"
    proc = launch(tmp_path, ["-n", "2"], "rank0_leaves", "8", "2", "1", "3", str(ckpt))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    found = records(tmp_path, 2)
    assert found[0][-1] == ["end", "2"] and found[1][-1] == ["end", "10"]
    assert rows_by_epoch(found) == {e: list(range(8)) for e in range(3)}
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{s:08d}" for s in range(1, 11)]
    trainer = kvstore.Trainer([("w", torch.nn.Parameter(torch.zeros(4)))], "sgd", {"learning_rate": 1.0},
                              kvstore="local", update_on_kvstore=True)
    newest = kvstore.Session(trainer, str(ckpt)).latest()
    assert newest is not None and newest.endswith("step-00000010")
    meta = json.loads((ckpt / "step-00000005" / "session.json").read_text())  # epoch 1, written by rank 1
    assert (meta["epoch"], meta["index"], meta["epoch_start"], meta["epoch_workers"]) == (1, 3, 2, 1)


def weights(tmp_path: Path, ranks: int) -> dict[int, dict[int, float]]:
    """Each worker's weights after each of its steps (step -> the first element), by rank."""
    found = {}
    for rank in range(ranks):
        path = tmp_path / f"rec.w.{rank}"
        if path.exists():
            pairs = (line.split() for line in path.read_text().splitlines())
            found[rank] = {int(step): float(w) for step, w in pairs}
    return found


@pytest.mark.parametrize("mode", ["join_at_begin", "join_after_init"])
def test_a_join_before_the_jobs_first_view_waits_for_it_and_takes_a_part(tmp_path: Path, mode: str) -> None:
    """A worker joined before anyone's first step (before the first init, or after init and
    set_optimizer) follows the others' barriers until the first epoch's view, which names it: it trains
    a part of every epoch, every sample is seen once per epoch, and every step's update (read by every
    worker) is the sum of 2**rank over the workers with a batch in it, nothing lost or applied twice."""
    proc = launch(tmp_path, ["-n", "2", "--min-workers", "2", "--max-workers", "3"],
                  mode, "12", "2", "1", "2")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "KeyNotInitializedError" not in output and "ConfigError" not in output, output[-4000:]
    found = records(tmp_path, 3)
    assert sorted(found) == [0, 1, 2], output[-4000:]
    assert rows_by_epoch(found) == {e: list(range(12)) for e in range(2)}
    for rank in range(3):  # parts of 4 samples, 2 steps an epoch: each a batch in every step
        assert [line[:3] for line in found[rank][:-1]] == [[str(s), "data", str(s // 2)] for s in range(4)]
        assert found[rank][-1] == ["end", "4"]
    drop = {s: sum(2 ** rank for rank, lines in found.items() for line in lines
                   if line[0] == str(s) and line[1] == "data") for s in range(4)}
    reference = {s: -float(sum(drop[t] for t in range(s + 1))) for s in range(4)}
    assert weights(tmp_path, 3) == {rank: reference for rank in range(3)}


def test_a_join_asked_after_the_last_worker_left_does_not_fail_the_launch(tmp_path: Path) -> None:
    """Worker 0 asks for a join once every worker has closed its store and the scheduler has exited, and
    is still running when the launcher reads it: the join is refused and logged, no worker starts, and
    the launch exits 0."""
    argv = [python(), "launch.py", "-s", "1", "-n", "2", "--min-workers", "1", "--max-workers", "3",
            str(SCRIPT), str(tmp_path / "rec"), "join_at_end", "8", "2", "1", "1"]
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:  # to the launcher's exit (the test's timeout bounds it)
            lines.append(line)
            if "join was asked as the job ends" in line:
                (tmp_path / "rec-refused").touch()  # worker 0 may exit now
        returncode = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
    output = "".join(lines)
    assert returncode == 0, output[-4000:]
    assert "join was asked as the job ends" in output and "refused" in output, output[-4000:]
    assert "starting worker 2" not in output, output[-4000:]
    assert rows_by_epoch(records(tmp_path, 3)) == {0: list(range(8))}

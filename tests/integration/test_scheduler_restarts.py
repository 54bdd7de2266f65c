"""A scheduler that can die (launch.py --max-restarts): SIGKILLed, it is restarted at its port, every
node re-registers with its identity, and the job ends as an unbroken run would; dying together with a
server is not survivable and fails the launch fast, named."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.checkpoint import load_arrays
from tests.helpers import poll_for
from tests.integration.test_restarts import launches, role_pids  # noqa: F401 -- the fixture

SCRIPT = Path(__file__).parent / "scripts" / "server_restart_train.py"
WORKERS = 2
# a restarted scheduler is a new Python process: 6 s of silence leaves it time to start on a loaded machine
ENV = {"KVSTORE_HEARTBEAT_TIMEOUT": "6", "KVSTORE_CONNECT_TIMEOUT": "30"}
REBOUND = re.compile(r"\[(worker|server) (\d)\].*re-registered with the restarted scheduler ([\d.]+) s after")


def _run(launches, tmp_path: Path, steps: int, die_at: str, restarts: int = 1,  # noqa: F811
         extra: dict[str, str] | None = None) -> tuple[str, list[dict[str, np.ndarray]]]:
    """2 workers, 2 servers, --max-restarts ``restarts``, the scheduler SIGKILLed at ``die_at``: the
    output and every worker's final values."""
    run = launches(["-n", str(WORKERS), "-s", "2", "--max-restarts", str(restarts), str(SCRIPT), str(steps),
                    str(tmp_path / "w"), "dist_sync"],
                   {**ENV, "KVSTORE_TEST_SCHEDULER_DIE_AT": die_at, **(extra or {})})
    assert run.finish(90) == 0, run.output
    output = run.output
    assert "scheduler exited with code 137; restarting it as incarnation 1" in output, output
    assert "at the same port" in output, output
    rebound = {(role, int(rank)) for role, rank, _ in REBOUND.findall(output)}
    assert rebound == {("worker", 0), ("worker", 1), ("server", 0), ("server", 1)}, output
    assert "cluster rebuilt" in output and "did not confirm shutdown" not in output, output
    assert "not its own in its counters" not in output, output  # every node's replay floors were taken
    return output, [load_arrays(str(tmp_path / f"w.{rank}")) for rank in range(WORKERS)]


def _unbroken(values: list[dict[str, np.ndarray]], steps: int) -> None:
    """Every element of every key holds every round of both workers, once: -2 x steps."""
    for name in values[0]:
        for rank in range(WORKERS):
            assert np.array_equal(values[rank][name], np.full_like(values[rank][name], -WORKERS * steps)), \
                (name, rank, np.unique(values[rank][name]))


@pytest.mark.timeout(120)
def test_a_scheduler_sigkilled_mid_training_is_restarted_and_the_job_ends_with_the_unbroken_weights(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """The scheduler SIGKILLed after its 15th heartbeat, while the workers push: it is restarted at its
    port, every node re-registers before the workers finish, and every element ends at exactly the
    unbroken run's value (no round lost or applied twice)."""
    steps = 600
    output, values = _run(launches, tmp_path, steps, "beats:15")
    for rank in range(WORKERS):  # the workers were still training when they re-registered
        back = re.search(rf"\[worker {rank}\].*re-registered with the restarted scheduler", output)
        assert back and back.start() < output.index(f"[worker {rank}] done {steps} steps"), output
    _unbroken(values, steps)


@pytest.mark.timeout(120)
def test_a_scheduler_sigkilled_while_a_barrier_is_open_repeats_only_that_barrier(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """Killed once the first worker is in the script's 6th barrier (after 5 collective ones): the new
    scheduler counts the 5 passed, the open one is sent again and released once, and the job ends
    with the unbroken weights."""
    steps = 40
    output, values = _run(launches, tmp_path, steps, "barrier:6")
    assert "KVSTORE_TEST_SCHEDULER_DIE_AT=barrier:6" in output, output
    assert "5 barriers passed" in output, output
    _unbroken(values, steps)


@pytest.mark.timeout(120)
def test_a_worker_lost_after_the_schedulers_restart_is_restarted_and_rejoins(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """Restarts go on after the rebuild: worker 1 SIGKILLed at its 1000th round, after the scheduler's
    restart, rejoins the restarted scheduler (from the rebuilt budget: 2 of 2 used) and the job ends
    with the unbroken weights (the rounds without it are scaled as a quorum's)."""
    steps = 1200
    output, values = _run(launches, tmp_path, steps, "beats:5", restarts=2,
                          extra={"KVSTORE_TEST_DIE_AT_ROUND": "1:1000"})
    assert output.index("cluster rebuilt") < output.index("killing worker 1 after round 1000"), output
    assert "worker 1 exited with code 137; restarting it as incarnation 1 (2 of 2 restarts used)" in output
    assert re.search(r"\[scheduler\].*worker 1 rejoined as incarnation 1", output), output
    _unbroken(values, steps)


@pytest.mark.timeout(90)
def test_the_scheduler_and_a_server_dying_together_fail_the_launch_fast_and_named(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """SIGKILL the scheduler and server 1 at once: not survivable (the new scheduler could not rebuild
    the cluster without the server), so the launcher stops everything within seconds and says why."""
    run = launches(["-n", str(WORKERS), "-s", "2", "--max-restarts", "2", str(SCRIPT), "1000000",
                    str(tmp_path / "w"), "dist_sync"], ENV)
    poll_for(lambda: all(f"[worker {r}] training as rank" in run.output for r in range(WORKERS)), 60,
             f"training:\n{run.output}")
    pids = role_pids(run.tag, "DMLC_ROLE=scheduler") + role_pids(run.tag, "KVSTORE_SERVER_ID=1")
    assert len(pids) == 2, pids
    killed = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    code = run.finish(60)
    assert code != 0, run.output
    assert time.monotonic() - killed < 30, run.output  # with the stop's grace (KVSTORE_SHUTDOWN_TIMEOUT)
    assert re.search(r"the scheduler and server 1 died together: not survivable", run.output), run.output
    assert "restarting it as incarnation 1 (1 of 2 restarts used; at the same port" not in run.output


@pytest.mark.timeout(120)
def test_a_scheduler_killed_before_the_cluster_is_complete_fails_the_launch_named(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """The scheduler SIGKILLed while the workers are still starting (no cluster map yet, so nothing to
    rebuild from): not restarted, the launch fails at once and names why (found by review: a restart
    then refused every first registration and the job failed later, unnamed)."""
    run = launches(["-n", "2", "-s", "1", "--max-restarts", "1", str(SLOW_START), str(tmp_path)], ENV)
    poll_for(lambda: len(role_pids(run.tag, "DMLC_ROLE=worker")) >= 2, 60, "the workers to start")
    (pid,) = role_pids(run.tag, "DMLC_ROLE=scheduler")
    os.kill(pid, signal.SIGKILL)
    assert run.finish(60) != 0, run.output
    assert "the scheduler died before the cluster was complete" in run.output, run.output
    assert "restarting it as incarnation 1" not in run.output, run.output


SLOW_START = Path(__file__).parent / "scripts" / "slow_start_train.py"


@pytest.mark.timeout(150)
def test_a_worker_closing_while_the_scheduler_is_down_counts_as_left(launches, tmp_path: Path) -> None:  # noqa: F811
    """Worker 1 closes in the scheduler's gap: its LEAVE waits until its heartbeat has re-registered it
    with the restarted scheduler, which counts it as left; worker 0's barrier is released alone and the
    job ends 0 (found by review: the closing worker's heartbeat stopped first, the rebuild waited for it
    and declared it lost)."""
    run = launches(["-n", "2", "-s", "1", "--max-restarts", "1", str(LEAVE_IN_GAP), str(tmp_path)], ENV)
    poll_for(lambda: all((tmp_path / f"ready.{r}").exists() for r in (0, 1)), 60, "both workers ready")
    (pid,) = role_pids(run.tag, "DMLC_ROLE=scheduler")
    os.kill(pid, signal.SIGKILL)
    (tmp_path / "go").write_text("1")
    assert run.finish(120) == 0, run.output
    assert "cluster rebuilt" in run.output and "worker 0 passed its barrier" in run.output, run.output
    assert "leave message to the scheduler: no reply" not in run.output, run.output


LEAVE_IN_GAP = Path(__file__).parent / "scripts" / "leave_in_gap_train.py"

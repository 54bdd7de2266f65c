"""Unit tests of the local launcher's elastic control (kvstore.launch.elastic) and its options."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvstore.launch.elastic import (
    DEATH_UNSEEN,
    JoinControl,
    death_unseen,
    elastic_slots,
    job_ending,
    left_slots,
    restart_env,
)
from kvstore.launch.group import RoleGroup
from kvstore.launch.options import parse_args
from kvstore.launch.roleprocess import RoleProcess, RoleSpec, RoleState


def test_complete_join_lines_are_counted_once(tmp_path: Path) -> None:
    """Each complete line 'join' asks one join, once; a partial line waits; other lines are ignored."""
    control = JoinControl(str(tmp_path / "c"), 4)
    assert control.asked() == 0
    with open(control.path, "a") as f:
        f.write("join\nhello\njo")
    assert control.asked() == 1
    with open(control.path, "a") as f:
        f.write("in\njoin\n")
    assert control.asked() == 2
    assert control.asked() == 0


def test_a_joiner_takes_the_lowest_free_slot_one_incarnation_up() -> None:
    """The lowest slot no live worker holds, incarnation one above its last; None when all are held."""
    control = JoinControl("/dev/null", 4)
    assert control.slot({0, 1}, {0: 0, 1: 0}) == (2, 1)
    assert control.slot({0, 2, 3}, {0: 0, 1: 0, 2: 1, 3: 1}) == (1, 1)
    assert control.slot({0, 1, 3}, {2: 1, 3: 1}) == (2, 2)
    assert control.slot({0, 1, 2, 3}, {}) is None


def test_a_join_asked_as_the_job_ends_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The job is ending once its scheduler is gone (every worker left) or no worker runs: a join
    then is refused with the reason logged, even with slots free; otherwise it takes a slot."""
    assert job_ending(2, False) is None
    assert "scheduler is gone" in (job_ending(1, True) or "")
    assert job_ending(0, False) == "every worker has exited"
    control = JoinControl("/dev/null", 4)
    with caplog.at_level("WARNING", logger="kvstore.launcher"):
        assert control.join(set(), {0: 0, 1: 0}, "--max-workers", ending=job_ending(0, False)) is None
    assert "join was asked as the job ends (every worker has exited): refused" in caplog.text
    assert control.join({0}, {0: 0, 1: 0}, "--max-workers", ending=job_ending(1, False)) == (1, 1)


def test_elastic_options_are_checked() -> None:
    """--min-workers <= -n <= --max-workers, the local and ray launchers only; --max-restarts combines."""
    cfg = parse_args(["-n", "2", "--min-workers", "1", "--max-workers", "4", "x.py"])
    assert (cfg.min_workers, cfg.max_workers, cfg.num_workers) == (1, 4, 2)
    cfg = parse_args(["-n", "2", "--max-workers", "3", "--launcher", "ray", "x.py"])
    assert (cfg.launcher, cfg.max_workers) == ("ray", 3)
    cfg = parse_args(["-n", "2", "--max-workers", "4", "--max-restarts", "1", "x.py"])
    assert (cfg.max_workers, cfg.max_restarts, cfg.env["KVSTORE_MAX_RESTARTS"]) == (4, 1, "1")
    for bad in (["-n", "5", "--max-workers", "4"], ["-n", "2", "--min-workers", "3"],
                ["-n", "2", "--max-workers", "4", "--launcher", "mpi"]):
        with pytest.raises(SystemExit):
            parse_args([*bad, "x.py"])


def test_elastic_slots_checks_the_counts_as_the_launcher_does() -> None:
    """elastic_slots (the Ray launcher's check): B slots, N for a job that is not elastic; ValueError
    unless 1 <= A <= N <= B."""
    assert elastic_slots(2, None, None) == 2
    assert elastic_slots(2, 1, 4) == 4 and elastic_slots(2, 2, None) == 2
    for bad in ((5, None, 4), (2, 3, None), (2, 0, 4)):
        with pytest.raises(ValueError):
            elastic_slots(*bad)


def test_a_joined_workers_restart_is_the_slots_next_incarnation_without_the_join() -> None:
    """restart_env: the next KVSTORE_INCARNATION, KVSTORE_JOIN dropped, the rest kept."""
    env = {"KVSTORE_JOIN": "1", "KVSTORE_INCARNATION": "1", "DMLC_WORKER_ID": "2"}
    assert restart_env(env, 2) == {"KVSTORE_INCARNATION": "2", "DMLC_WORKER_ID": "2"}
    assert restart_env({"A": "b"}, 1) == {"A": "b", "KVSTORE_INCARNATION": "1"}


def test_left_slots_are_those_that_exited_0_and_no_live_worker_holds() -> None:
    """A slot whose worker exited 0 has left unless a later join holds it (starting, running, or failed
    and being restarted); a slot never started is not the launcher's to name."""
    ok, live, failed = RoleState.SUCCEEDED, RoleState.RUNNING, RoleState.FAILED
    workers = [(0, live), (1, ok), (2, ok), (2, RoleState.STARTING), (3, ok), (3, failed),
               (4, RoleState.STOPPED)]
    assert left_slots(workers) == [1]
    assert left_slots([(0, ok), (1, ok)]) == [0, 1]
    assert left_slots([]) == []


# a joined worker that exits 3; restarted (no KVSTORE_JOIN, the next incarnation) it exits 0
JOINED_FLAKY = ("import os, sys; sys.exit(0 if os.environ.get('KVSTORE_INCARNATION') == '3' "
                "and 'KVSTORE_JOIN' not in os.environ else 3)")


@pytest.mark.timeout(30)
def test_a_joined_worker_that_fails_is_restarted_without_kvstore_join() -> None:
    """RoleGroup's restart of a worker started with KVSTORE_JOIN=1 as incarnation 2 runs it again as
    incarnation 3 without KVSTORE_JOIN, and the group succeeds."""
    group = RoleGroup()
    env = {**os.environ, "KVSTORE_JOIN": "1", "KVSTORE_INCARNATION": "2"}
    spec = RoleSpec("worker", 2, [sys.executable, "-c", JOINED_FLAKY], env)
    child = RoleProcess(spec, output=lambda _: None)
    group.add(child.start())
    try:
        assert group.supervise(1, grace=1.0, restarts=1) is None
        assert child.state is RoleState.SUCCEEDED and child.spec.env["KVSTORE_INCARNATION"] == "3"
        assert "KVSTORE_JOIN" not in child.spec.env
    finally:
        group.stop()


def test_a_closed_scheduler_port_while_its_process_runs_holds_a_join_for_a_while() -> None:
    """A join that finds the scheduler's port closed while its process still counts as running, workers
    run and restarts are on waits (the launcher has yet to see a SIGKILL: a loaded CI run refused it as the
    job's end); not without restarts, workers or a running process, nor past DEATH_UNSEEN."""
    assert death_unseen(True, True, 2, 0.0) and death_unseen(True, True, 1, DEATH_UNSEEN - 0.1)
    assert not death_unseen(False, True, 2, 0.0)
    assert not death_unseen(True, False, 2, 0.0)
    assert not death_unseen(True, True, 0, 0.0)
    assert not death_unseen(True, True, 2, DEATH_UNSEEN)

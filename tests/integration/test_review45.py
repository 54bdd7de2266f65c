"""Review 45's reproducers with real processes through launch.py (fixed): a join asked while a SIGKILLed
scheduler is being restarted waits for the restarted one instead of being refused as the job's end."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers import poll_for
from tests.integration.test_elastic_restarts import ENV, SCRIPT, _steps, _stop
from tests.integration.test_restarts import launches, role_pids  # noqa: F401 -- the fixture

REFUSED = "join was asked as the job ends"


def _control(run) -> Path:
    """The elastic control file every role is told of (KVSTORE_ELASTIC_CONTROL, from worker 0)."""
    (pid,) = poll_for(lambda: role_pids(run.tag, "DMLC_WORKER_ID=0"), 30, "worker 0's process")
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (path,) = [entry.split(b"=", 1)[1].decode() for entry in environ
               if entry.startswith(b"KVSTORE_ELASTIC_CONTROL=")]
    return Path(path)


@pytest.mark.timeout(150)
def test_a_join_asked_while_the_scheduler_restarts_is_not_refused_as_the_jobs_end(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """A job 2 of 3 slots under --max-restarts 1: the scheduler is SIGKILLed and a join asked at once;
    the launcher restarts the scheduler and the join is not dropped as if the job were ending (its
    scheduler is coming back, its workers run): worker 2 joins and trains."""
    stop = tmp_path / "stop"
    run = launches(["-n", "2", "-s", "2", "--max-workers", "3", "--max-restarts", "1", str(SCRIPT),
                    str(tmp_path / "rec"), str(stop)], {**ENV, "KVSTORE_HEARTBEAT_TIMEOUT": "6"})
    poll_for(lambda: _steps(tmp_path, 0) >= 10, 60, f"worker 0's steps:\n{run.output}")
    control = _control(run)
    (pid,) = role_pids(run.tag, "DMLC_ROLE=scheduler")
    os.kill(pid, signal.SIGKILL)
    with open(control, "a") as asked:
        asked.write("join\n")
    poll_for(lambda: REFUSED in run.output or _steps(tmp_path, 2) >= 5 or run.proc.poll() is not None, 90,
             "worker 2's steps, or the join refused")
    assert REFUSED not in run.output, run.output
    _stop(tmp_path, stop)
    assert run.finish(60) == 0, run.output

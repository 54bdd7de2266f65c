"""RoleGroup's restart of a lost scheduler (launch.py --max-restarts, local launcher) over real, tiny
processes: at its port, unless it exited by itself or another role died with it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvstore.launch.group import RoleGroup, SchedulerRestart
from kvstore.launch.roleprocess import RoleProcess, RoleSpec, RoleState
from kvstore.scheduler.recovery import write_digest

# a scheduler's first incarnation SIGKILLs itself; its restart writes the port file back and stays up
SCHEDULER = ("import os, signal, sys, time\n"
             "if os.environ.get('KVSTORE_INCARNATION') != '1': os.kill(os.getpid(), signal.SIGKILL)\n"
             "open(sys.argv[1], 'w').write(os.environ['DMLC_PS_ROOT_PORT'] + ' ' + "
             "os.environ['KVSTORE_RESTARTS_USED'])\n"
             "time.sleep(30)")
# a worker that exits 0 once the restarted scheduler has written the port file back
WORKER = ("import os, sys, time\n"
          "read = lambda: open(sys.argv[1]).read() if os.path.exists(sys.argv[1]) else ''\n"
          "while ' ' not in read(): time.sleep(0.01)")


def _start(group: RoleGroup, role: str, code: str, *args: str) -> RoleProcess:
    spec = RoleSpec(role, None if role == "scheduler" else 0, [sys.executable, "-c", code, *args],
                    dict(os.environ))
    return group.add(RoleProcess(spec, output=lambda _: None).start())


@pytest.mark.timeout(30)
def test_a_scheduler_killed_by_a_signal_is_restarted_at_its_port(tmp_path: Path) -> None:
    """SIGKILLed after its cluster map went out (its session's digest is written), the scheduler runs
    again as incarnation 1 with its port and the restarts used; the launch goes on (the worker sees the
    port file written again) and succeeds."""
    port_file = tmp_path / "scheduler.port"
    port_file.write_text("4242\n")
    write_digest(str(port_file), b"the cluster's session")  # the first incarnation sent its map
    group = RoleGroup()
    scheduler = _start(group, "scheduler", SCHEDULER, str(port_file))
    worker = _start(group, "worker", WORKER, str(port_file))
    try:
        policy = SchedulerRestart(4242, str(port_file), window=1.0)
        assert group.supervise(1, grace=0.5, restarts=1, scheduler=policy) is None
        assert worker.state is RoleState.SUCCEEDED
        assert scheduler.spec.env["KVSTORE_INCARNATION"] == "1"
        assert scheduler.spec.env["DMLC_PS_ROOT_PORT"] == "4242"
        assert port_file.read_text() == "4242 1"
    finally:
        group.stop()


@pytest.mark.timeout(30)
def test_a_scheduler_that_exits_by_itself_or_dies_with_a_worker_is_not_restarted(tmp_path: Path) -> None:
    """A scheduler exiting 1 (its own decision) fails the launch; SIGKILLed together with a worker, too."""
    port_file = tmp_path / "scheduler.port"
    policy = SchedulerRestart(4242, str(port_file), window=1.0)
    group = RoleGroup()
    scheduler = _start(group, "scheduler", "import sys; sys.exit(1)")
    try:
        assert group.supervise(1, grace=0.5, restarts=3, scheduler=policy) is scheduler
        assert scheduler.state is RoleState.FAILED and "KVSTORE_INCARNATION" not in scheduler.spec.env
    finally:
        group.stop()
    group = RoleGroup()
    _start(group, "worker", "import os, signal, time\n"
                            "if os.environ.get('KVSTORE_INCARNATION') != '1':\n"
                            "    os.kill(os.getpid(), signal.SIGKILL)\n"
                            "time.sleep(30)")
    scheduler = _start(group, "scheduler", "import os, signal, time; time.sleep(0.3); "
                                           "os.kill(os.getpid(), signal.SIGKILL)")
    try:
        assert group.supervise(1, grace=0.5, restarts=3, scheduler=policy) is scheduler
        assert "KVSTORE_INCARNATION" not in scheduler.spec.env
    finally:
        group.stop()

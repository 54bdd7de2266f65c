"""RoleGroup's restart policy (launch.py --max-restarts) over real, tiny processes; and the flag."""

from __future__ import annotations

import os
import sys

import pytest

from kvstore.launch.group import RoleGroup
from kvstore.launch.options import parse_args
from kvstore.launch.roleprocess import RoleProcess, RoleSpec, RoleState

# exits 3 in its first incarnation, 0 once restarted
FLAKY = "import os, sys; sys.exit(0 if os.environ.get('KVSTORE_INCARNATION') == '1' else 3)"


def _group(code: str, role: str = "worker") -> tuple[RoleGroup, RoleProcess]:
    """A group of one started ``role`` running ``code``."""
    group = RoleGroup()
    spec = RoleSpec(role, 0, [sys.executable, "-c", code], dict(os.environ))
    child = RoleProcess(spec, output=lambda _: None)
    group.add(child.start())
    return group, child


@pytest.mark.timeout(30)
def test_a_failed_worker_is_restarted_with_the_next_incarnation() -> None:
    """With one restart, the worker that exits 3 runs again as incarnation 1 and the group succeeds."""
    group, child = _group(FLAKY)
    try:
        assert group.supervise(1, grace=1.0, restarts=1) is None
        assert child.state is RoleState.SUCCEEDED and child.spec.env["KVSTORE_INCARNATION"] == "1"
    finally:
        group.stop()


@pytest.mark.timeout(30)
def test_without_restarts_left_the_failure_is_returned() -> None:
    """With no restarts the first failure is the group's; a failed server is never restarted."""
    for role, restarts in (("worker", 0), ("server", 3)):
        group, child = _group(FLAKY, role)
        try:
            assert group.supervise(1, grace=1.0, restarts=restarts) is child
            assert child.exit_code == 3
        finally:
            group.stop()


def test_max_restarts_sets_the_budget_for_every_role_and_is_local_only() -> None:
    """--max-restarts K puts KVSTORE_MAX_RESTARTS=K in every role's environment; ssh and mpi refuse it."""
    cfg = parse_args(["-n", "2", "--max-restarts", "2", "train.py"])
    assert cfg.max_restarts == 2 and cfg.env["KVSTORE_MAX_RESTARTS"] == "2"
    assert "KVSTORE_MAX_RESTARTS" not in parse_args(["-n", "2", "train.py"]).env
    for argv in (["--launcher", "ssh", "-H", __file__, "--max-restarts", "1"], ["--max-restarts", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["-n", "2", *argv, "train.py"])

"""kvstore.launch.roleprocess and kvstore.launch.group: the one role-process type every launcher uses,
its states and transitions (a failed role can start again), its output, port, wait and stop, and the
fail-fast supervision of a group.  Real (``sh``) processes, each a fraction of a second."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore.launch.group import RoleGroup
from kvstore.launch.roleprocess import (
    TRANSITIONS,
    Killed,
    RoleProcess,
    RoleSpec,
    RoleState,
    start_pump,
)

S = RoleState


class Lines:
    """An ``output`` that keeps a role's lines, and can wait for one."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self._cond = threading.Condition()

    def __call__(self, line: bytes) -> None:
        with self._cond:
            self.lines.append(line)
            self._cond.notify_all()

    def wait_for(self, line: bytes, timeout: float = 10.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: line in self.lines, timeout), self.lines


def sh(script: str, role: str = "worker", rank: int | None = 0, **options: object) -> RoleProcess:
    """An unstarted RoleProcess of ``sh -c script`` (started here, in its own group)."""
    return RoleProcess(RoleSpec(role, rank, ["sh", "-c", script], {"PATH": "/usr/bin:/bin"}),
                       **options)


def piped_stdin(spec: RoleSpec) -> subprocess.Popen:
    """A start function whose process reads a pipe on stdin, as a tether does."""
    return subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def test_the_transitions_are_a_state_machine_with_a_way_back_from_failed() -> None:
    """STARTING -> RUNNING -> an end; FAILED -> STARTING is the one way back (a restart); SUCCEEDED and
    STOPPED are final."""
    assert TRANSITIONS[S.STARTING] == {S.RUNNING, S.SUCCEEDED, S.FAILED, S.STOPPED}
    assert TRANSITIONS[S.RUNNING] == {S.SUCCEEDED, S.FAILED, S.STOPPED}
    assert TRANSITIONS[S.FAILED] == {S.STARTING}
    assert TRANSITIONS[S.SUCCEEDED] == TRANSITIONS[S.STOPPED] == frozenset()
    assert set(TRANSITIONS) == set(RoleState)


def test_a_failed_role_goes_back_to_starting_and_runs_again(tmp_path: Path) -> None:
    """exit 3 -> FAILED; a restart before its process is reaped is refused; after stop(), restart()
    -> STARTING with no exit code, and start() runs the spec again (here it then exits 0: SUCCEEDED,
    which no restart leaves)."""
    mark = tmp_path / "ran"
    role = sh(f"if [ -e {mark} ]; then exit 0; fi; touch {mark}; exit 3", output=Lines())
    assert role.state is S.STARTING
    role.start()
    assert role.wait(time.monotonic() + 10) == 3 and role.state is S.FAILED
    with pytest.raises(RuntimeError, match="stop its process before a restart"):
        role.restart()
    assert role.stop(1.0) is None and role.state is S.FAILED  # it had exited: still FAILED
    role.restart()
    assert (role.state, role.exit_code, role.proc) == (S.STARTING, None, None)
    role.start()
    assert role.wait(time.monotonic() + 10) == 0 and role.state is S.SUCCEEDED
    role.stop(1.0)
    with pytest.raises(RuntimeError, match="no transition from succeeded to starting"):
        role.restart()
    with pytest.raises(RuntimeError, match="cannot be started"):
        role.start()


def test_a_command_that_cannot_start_is_failed_and_can_be_restarted() -> None:
    """start() raises the OSError; the role is FAILED (nothing to reap), so restart() is allowed."""
    role = RoleProcess(RoleSpec("worker", 0, ["/nonexistent/kvstore-test"], {}))
    with pytest.raises(OSError):
        role.start()
    assert role.state is S.FAILED and role.wait(time.monotonic() + 1) is None
    role.restart()
    assert role.state is S.STARTING


def test_output_is_prefixed_with_the_role_and_rank(capfd: pytest.CaptureFixture[str]) -> None:
    """By default every line goes to stdout as ``[worker 1] line``; the exit is RUNNING -> SUCCEEDED."""
    role = sh("echo hi; echo there", rank=1).start()
    assert role.state in (S.RUNNING, S.SUCCEEDED)
    assert role.wait(time.monotonic() + 10) == 0
    role.stop(1.0)
    assert capfd.readouterr().out == "[worker 1] hi\n[worker 1] there\n"
    assert role.state is S.SUCCEEDED


def test_an_announcing_role_is_starting_until_its_line_which_is_not_copied() -> None:
    """With ``announce``, the role stays STARTING until a line ends with it (after a partial line of
    someone else's, as an ssh login may print); that part of the line is kept, the mark is not."""
    lines = Lines()
    role = sh("sleep 0.3; printf 'banner'; echo MARK; echo out; echo MARK; sleep 30", announce=b"MARK\n",
              output=lines).start()
    try:
        assert role.state is S.STARTING and not role.wait_started(0.05)
        assert role.wait_started(10) and role.state is S.RUNNING
        lines.wait_for(b"MARK\n")  # only the first one is the announcement
        assert lines.lines == [b"banner\n", b"out\n", b"MARK\n"]
    finally:
        assert role.stop(5.0) is None
    assert role.state is S.STOPPED and role.exit_code == 143


def test_stop_says_what_it_had_to_kill() -> None:
    """stop(): SIGTERM to the group suffices (None, STOPPED, 143); a process that ignores SIGTERM is
    SIGKILLed at the deadline (PROCESS, 137); what an exited process left in its group and ignores
    SIGTERM is killed too (GROUP), and the role stays what it was (SUCCEEDED)."""
    polite = sh("exec sleep 30").start()
    assert polite.stop(5.0) is None and (polite.state, polite.exit_code) == (S.STOPPED, 143)

    lines = Lines()
    stubborn = sh("trap '' TERM; echo ready; while :; do sleep 0.05; done", output=lines).start()
    lines.wait_for(b"ready\n")
    start = time.monotonic()
    assert stubborn.stop(0.3) is Killed.PROCESS and stubborn.exit_code == 137
    assert time.monotonic() - start < 5

    lines = Lines()
    leaver = sh("(trap '' TERM; echo ready; exec sleep 30) & exit 0", output=lines).start()
    lines.wait_for(b"ready\n")
    assert leaver.wait(time.monotonic() + 10) == 0
    assert leaver.stop(0.3) is Killed.GROUP and leaver.state is S.SUCCEEDED


def test_a_tethered_role_is_stopped_by_closing_its_stdin() -> None:
    """tethered: request_stop() closes the process's stdin (a tether then stops its role); one that
    does not exit by the deadline is SIGKILLed (its leftovers are the tether's to end, not ours)."""
    tether_like = sh("read line; exit 0", start=piped_stdin, tethered=True).start()
    assert tether_like.stop(5.0) is None and (tether_like.state, tether_like.exit_code) == (S.STOPPED, 0)
    deaf = sh("trap '' TERM; exec sleep 30", start=piped_stdin, tethered=True).start()
    assert deaf.stop(0.3) is Killed.PROCESS and deaf.exit_code == 137


def test_read_port_returns_the_port_or_none_on_exit_or_deadline(tmp_path: Path) -> None:
    """read_port: the port the role wrote (atomically) to its port file; None at once when it exits
    first (its exit code tells); None at the deadline while it runs."""
    path = tmp_path / "scheduler.port"
    writer = sh(f"echo 4321 > {path}.tmp; mv {path}.tmp {path}; exec sleep 30", output=Lines()).start()
    assert writer.read_port(str(path), 10) == 4321
    writer.stop(5.0)
    quitter = sh("exit 5", output=Lines()).start()
    start = time.monotonic()
    assert quitter.read_port(str(tmp_path / "never"), 30) is None and quitter.exit_code == 5
    assert time.monotonic() - start < 10
    quitter.stop(1.0)
    silent = sh("exec sleep 30", output=Lines()).start()
    assert silent.read_port(str(tmp_path / "never"), 0.2) is None and silent.exit_code is None
    silent.stop(5.0)


def test_on_exit_is_called_once_per_exit_even_when_registered_late() -> None:
    """on_exit callbacks run when the exit is seen; one registered after it runs at once."""
    seen: list[int | None] = []
    role = sh("exit 2", output=Lines())
    role.on_exit(lambda r: seen.append(r.exit_code))
    role.start()
    role.wait(time.monotonic() + 10)
    time.sleep(0.05)  # the callbacks run right after the exit is recorded
    role.on_exit(lambda r: seen.append(r.exit_code))
    assert seen == [2, 2]
    role.stop(1.0)


def test_the_pump_hands_over_every_line_then_ends() -> None:
    """start_pump copies lines (newline kept, a last line without one too) and calls on_end."""
    proc = subprocess.Popen([sys.executable, "-c", "print('a'); print('b', end='')"], stdout=subprocess.PIPE)
    lines, ended = Lines(), threading.Event()
    start_pump(proc.stdout, lines, ended.set).join(10)
    proc.wait()
    assert lines.lines == [b"a\n", b"b"] and ended.is_set()


# -- the group ----------------------------------------------------------------------------------------

def test_the_group_fails_fast_with_the_first_failure_and_stops_the_rest() -> None:
    """supervise() returns the first role to fail (what the launcher reports); stop() then stops the
    others against one deadline (SIGTERM sufficed: nothing killed)."""
    group = RoleGroup()
    blocked = group.add(sh("exec sleep 30", rank=0, output=Lines(), stop_wait=5.0).start())
    failing = group.add(sh("sleep 0.2; exit 3", rank=1, output=Lines(), stop_wait=5.0).start())
    assert group.supervise(workers=2, grace=5.0) is failing
    assert group.failed() is failing and failing.exit_code == 3
    assert group.stop() == []
    assert blocked.state is S.STOPPED and failing.state is S.FAILED


def test_the_group_succeeds_when_every_worker_does(caplog: pytest.LogCaptureFixture) -> None:
    """Workers exiting 0 end the supervision (None); a server still running after the grace is logged,
    and stop() reports a role it had to kill, with the seconds it was given."""
    group = RoleGroup()
    lines = Lines()
    server = group.add(sh("trap '' TERM; echo ready; while :; do sleep 0.05; done", role="server",
                          output=lines, stop_wait=0.3).start())
    lines.wait_for(b"ready\n")
    for rank in range(2):
        group.add(sh("exit 0", rank=rank, output=Lines(), stop_wait=5.0).start())
    assert group.supervise(workers=2, grace=0.2) is None
    assert "server 0 did not exit within 0.2 s of the workers" in caplog.text
    assert group.stop() == [(server, Killed.PROCESS, 0.3)]
    assert [role.state for role in group.roles] == [S.STOPPED, S.SUCCEEDED, S.SUCCEEDED]

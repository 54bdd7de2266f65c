"""The tether on real processes: its child lives exactly as long as the pipe from its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.launch import tether
from tests.helpers import poll_for, tagged_pids

# A child that ignores SIGTERM, says so on stdout, and waits to be killed.
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")


class Spawned:
    """The processes a test started: tethers (and holders of tethers), and every child they started,
    found by the test's tag in their environment.  :meth:`cleanup` kills and reaps them all."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.procs: list[subprocess.Popen] = []

    def tether(self, argv: list[str], env: dict[str, str], **popen: Any) -> subprocess.Popen:
        """:func:`tether.spawn` of ``argv`` with ``env`` and the tag added; the tether is recorded."""
        proc = tether.spawn(argv, {**env, "KVSTORE_TEST_TAG": self.tag}, **popen)
        self.procs.append(proc)
        return proc

    def popen(self, argv: list[str], **popen: Any) -> subprocess.Popen:
        """Start ``argv`` with the tag in its environment (its descendants inherit it); it is recorded."""
        proc = subprocess.Popen(argv, env={**os.environ, "KVSTORE_TEST_TAG": self.tag}, **popen)
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        """SIGKILL and reap every recorded process, SIGKILL every tagged one, and wait until none is left."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        for pid in tagged_pids(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        poll_for(lambda: not tagged_pids(self.tag), 10, "every tethered process to be gone")


@pytest.fixture
def spawned(tag: str) -> Iterator[Spawned]:
    """A :class:`Spawned` whose processes are killed and reaped after the test, pass or fail."""
    record = Spawned(tag)
    try:
        yield record
    finally:
        record.cleanup()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _child_of(pid: int, timeout: float = 10.0) -> int:
    """The pid of the tether's one child, once it has started."""
    def child() -> int | None:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None
    return poll_for(child, timeout, f"tether {pid} to start its child")


def test_exit_code_output_and_environment_pass_through(spawned: Spawned) -> None:
    """The child sees the requested environment and cwd; its output and exit code are the tether's."""
    proc = spawned.tether(["sh", "-c", 'echo "$TETHER_X $(pwd)"; exit 7'], {"TETHER_X": "hello"},
                          cwd="/tmp", stdout=subprocess.PIPE)
    out = proc.stdout.read()  # not communicate(): closing stdin would stop the child
    assert (proc.wait(30), out.decode().split()) == (7, ["hello", "/tmp"])


def test_announce_writes_the_started_line_before_the_childs_output(spawned: Spawned) -> None:
    """With announce the first bytes on stdout are STARTED; without it, there is no such line."""
    proc = spawned.tether(["echo", "child"], {}, announce=True, stdout=subprocess.PIPE)
    assert proc.stdout.read() == tether.STARTED + b"child\n" and proc.wait(30) == 0
    proc = spawned.tether(["echo", "child"], {}, stdout=subprocess.PIPE)
    assert proc.stdout.read() == b"child\n" and proc.wait(30) == 0


def test_a_signal_death_is_128_plus_the_signal(spawned: Spawned) -> None:
    """A child killed by SIGKILL makes the tether exit 137, as a shell reports it."""
    proc = spawned.tether(["sh", "-c", "kill -9 $$"], {})
    assert proc.wait(30) == 128 + signal.SIGKILL


def test_release_stops_the_child_gracefully(spawned: Spawned) -> None:
    """Closing the tether's stdin sends SIGTERM to the child's group: the tether exits 143 at once."""
    proc = spawned.tether(["sleep", "60"], {})
    child = _child_of(proc.pid)
    tether.release(proc)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert poll_for(lambda: not _alive(child), 10, "the child to be gone")


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(spawned: Spawned) -> None:
    """A child that ignores SIGTERM is SIGKILLed after its KVSTORE_SHUTDOWN_TIMEOUT, and it is said."""
    proc = spawned.tether([sys.executable, "-c", STUBBORN], {"KVSTORE_SHUTDOWN_TIMEOUT": "0.5"},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    tether.release(proc)
    assert proc.wait(30) == 128 + signal.SIGKILL
    assert b"did not stop within 0.5 s of SIGTERM; killed it" in proc.stderr.read()


def test_a_closed_output_pipe_does_not_keep_the_tether_from_killing(spawned: Spawned) -> None:
    """The reader of the tether's stdout and stderr is gone (a killed ssh client, a dead actor) and the
    child ignores SIGTERM: the tether still SIGKILLs it after the grace (reporting it cannot break that)."""
    proc = spawned.tether([sys.executable, "-c", STUBBORN], {"KVSTORE_SHUTDOWN_TIMEOUT": "0.5"},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout.readline() == b"ready\n"
    child = _child_of(proc.pid)
    proc.stdout.close()  # the reader goes away: the tether's next write to stdout or stderr fails
    tether.release(proc)
    assert proc.wait(30) == 128 + signal.SIGKILL
    assert poll_for(lambda: not _alive(child), 10, "the child that ignores SIGTERM to be killed")


@pytest.mark.parametrize("how", ["exits by itself", "stops on SIGTERM"])
def test_what_the_child_leaves_in_its_group_is_killed(spawned: Spawned, how: str) -> None:
    """The child starts a grandchild (in its process group) that ignores SIGTERM, then exits by itself
    or on the tether's SIGTERM: the grandchild is SIGKILLed after a grace, and the tether reports it."""
    script = ("import subprocess, sys, time\n"
              f"g = subprocess.Popen([sys.executable, '-c', {STUBBORN!r}], stdout=subprocess.PIPE)\n"
              "assert g.stdout.readline() == b'ready\\n'\n"
              "print(g.pid, flush=True)\n"
              + ("" if how == "exits by itself" else "time.sleep(60)\n"))
    proc = spawned.tether([sys.executable, "-c", script], {"KVSTORE_SHUTDOWN_TIMEOUT": "0.5"},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    grandchild = int(proc.stdout.readline())
    if how == "stops on SIGTERM":
        tether.release(proc)
    expected = 0 if how == "exits by itself" else 128 + signal.SIGTERM
    assert proc.wait(30) == expected
    assert poll_for(lambda: not _alive(grandchild), 10, "the grandchild that ignores SIGTERM to be killed")
    assert b"left in its process group did not stop within 0.5 s of SIGTERM; killed it" in proc.stderr.read()


def test_the_parents_death_stops_the_child(spawned: Spawned) -> None:
    """When the process holding the pipe is SIGKILLed, the tether stops its child and exits."""
    holder = spawned.popen(
        [sys.executable, "-c", "from kvstore.launch import tether; import sys, time\n"
         "p = tether.spawn(['sleep', '60'], {}); print(p.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    tether_pid = int(holder.stdout.readline())
    child = _child_of(tether_pid)
    holder.kill()
    holder.wait(30)
    assert poll_for(lambda: not _alive(child), 10, "the tethered child to stop after its parent died")
    assert poll_for(lambda: not _alive(tether_pid), 10, "the tether to exit")


@pytest.mark.parametrize("line,word", [(b"not json\n", "not JSON"), (b'{"env": {}}\n', "argv"),
                                       (b'{"argv": ["x"], "env": {"A": 1}}\n', "env"), (b"", "not JSON"),
                                       (b'{"argv": ["x"], "announce": 1}\n', "announce"),
                                       (b'{"argv": ["x"], "env": {"KVSTORE_SHUTDOWN_TIMEOUT": "-1"}}\n',
                                        "KVSTORE_SHUTDOWN_TIMEOUT")])
def test_a_bad_request_exits_2_naming_the_problem(line: bytes, word: str) -> None:
    """A malformed request line starts nothing and exits 2 with a message naming the bad field."""
    proc = subprocess.run([sys.executable, "-m", "kvstore.launch.tether"], input=line, capture_output=True,
                          timeout=30)
    assert proc.returncode == 2 and word in proc.stderr.decode(), proc.stderr


def test_a_missing_program_exits_127(spawned: Spawned) -> None:
    """A program that does not exist makes the tether exit 127 with the reason."""
    proc = spawned.tether(["no-such-program-kvstore"], {}, stderr=subprocess.PIPE)
    assert proc.wait(30) == 127
    assert b"cannot start no-such-program-kvstore" in proc.stderr.read()

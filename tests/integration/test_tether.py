"""The tether on real processes: its child lives exactly as long as the pipe from its parent."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import tether
from tests.helpers import poll_for


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


def test_exit_code_output_and_environment_pass_through() -> None:
    """The child sees the requested environment and cwd; its output and exit code are the tether's."""
    proc = tether.spawn(["sh", "-c", 'echo "$TETHER_X $(pwd)"; exit 7'], {"TETHER_X": "hello"},
                        cwd="/tmp", stdout=subprocess.PIPE)
    out = proc.stdout.read()  # not communicate(): closing stdin would stop the child
    assert (proc.wait(30), out.decode().split()) == (7, ["hello", "/tmp"])


def test_a_signal_death_is_128_plus_the_signal() -> None:
    """A child killed by SIGKILL makes the tether exit 137, as a shell reports it."""
    proc = tether.spawn(["sh", "-c", "kill -9 $$"], {})
    assert proc.wait(30) == 128 + signal.SIGKILL


def test_release_stops_the_child_gracefully() -> None:
    """Closing the tether's stdin sends SIGTERM to the child's group: the tether exits 143 at once."""
    proc = tether.spawn(["sleep", "60"], {})
    child = _child_of(proc.pid)
    tether.release(proc)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert poll_for(lambda: not _alive(child), 10, "the child to be gone")


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    """A child that ignores SIGTERM is SIGKILLed after its KVSTORE_SHUTDOWN_TIMEOUT."""
    script = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('ready', flush=True); time.sleep(60)")
    proc = tether.spawn([sys.executable, "-c", script], {"KVSTORE_SHUTDOWN_TIMEOUT": "0.5"},
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    tether.release(proc)
    assert proc.wait(30) == 128 + signal.SIGKILL
    assert b"did not stop within 0.5 s" in proc.stderr.read()


def test_the_parents_death_stops_the_child() -> None:
    """When the process holding the pipe is SIGKILLed, the tether stops its child and exits."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "from kvstore import tether; import sys, time\n"
         "p = tether.spawn(['sleep', '60'], {}); print(p.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        tether_pid = int(holder.stdout.readline())
        child = _child_of(tether_pid)
    finally:
        holder.kill()
        holder.wait()
    assert poll_for(lambda: not _alive(child), 10, "the tethered child to stop after its parent died")
    assert poll_for(lambda: not _alive(tether_pid), 10, "the tether to exit")


@pytest.mark.parametrize("line,word", [(b"not json\n", "not JSON"), (b'{"env": {}}\n', "argv"),
                                       (b'{"argv": ["x"], "env": {"A": 1}}\n', "env"), (b"", "not JSON"),
                                       (b'{"argv": ["x"], "env": {"KVSTORE_SHUTDOWN_TIMEOUT": "-1"}}\n',
                                        "KVSTORE_SHUTDOWN_TIMEOUT")])
def test_a_bad_request_exits_2_naming_the_problem(line: bytes, word: str) -> None:
    """A malformed request line starts nothing and exits 2 with a message naming the bad field."""
    proc = subprocess.run([sys.executable, "-m", "kvstore.tether"], input=line, capture_output=True,
                          timeout=30)
    assert proc.returncode == 2 and word in proc.stderr.decode(), proc.stderr


def test_a_missing_program_exits_127() -> None:
    """A program that does not exist makes the tether exit 127 with the reason."""
    proc = tether.spawn(["no-such-program-kvstore"], {}, stderr=subprocess.PIPE)
    assert proc.wait(30) == 127
    assert b"cannot start no-such-program-kvstore" in proc.stderr.read()

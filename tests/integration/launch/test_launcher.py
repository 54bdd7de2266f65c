"""The launcher end to end: real processes, prefixed output, fail-fast, no process left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.launch.node import role_command
from tests.helpers import REPO, finish, launch, poll_for, tagged_pids

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "sum_check.py")


def _launch(args: list[str], tag: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {"KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_LOG_LEVEL": "INFO",
           "KVSTORE_CONNECT_TIMEOUT": "30", **(env or os.environ), "KVSTORE_TEST_TAG": tag}
    return launch(args, env)


@pytest.mark.parametrize("mode,workers,servers", [("dist_sync", 2, 2), ("dist_sync", 3, 1),
                                                    ("dist_async", 1, 2)])
def test_launch_runs_every_role_and_exits_zero(tag: str, mode: str, workers: int, servers: int) -> None:
    """-n W -s S trains nothing but sums right on every worker, prefixes output, exits 0, leaks nothing."""
    rc, out = finish(_launch(["-n", str(workers), "-s", str(servers), SCRIPT, mode], tag))
    assert rc == 0, out
    for rank in range(workers):
        assert f"[worker {rank}] RESULT ok rank={rank} of {workers} servers={servers}" in out, out
    assert "[scheduler]" in out and "[server 0]" in out
    # the script never calls close(): the exit hook must leave, so the scheduler stops the servers
    assert "all workers left; shut down" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


def test_servers_default_to_workers(tag: str) -> None:
    """Without -s the launcher starts as many servers as workers."""
    rc, out = finish(_launch(["-n", "2", SCRIPT, "dist_sync"], tag))
    assert rc == 0 and "servers=2" in out, out


def test_failing_worker_stops_everything(tag: str) -> None:
    """A worker that raises makes the launcher exit non-zero within seconds, naming it, leaving no process."""
    start = time.monotonic()
    rc, out = finish(_launch(["-n", "3", "-s", "2", SCRIPT, "dist_sync", "1"], tag), timeout=60)
    elapsed = time.monotonic() - start
    assert rc == 1, out
    assert "worker 1 exited with code 1" in out and "fails on purpose" in out, out
    assert elapsed < 30, f"took {elapsed:.1f} s"  # the others were blocked in a pull with a 600 s deadline
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


def test_worker_exit_code_is_propagated(tag: str) -> None:
    """The launcher exits with the failed worker's own exit code."""
    # one worker: a sys.exit(3) leaves the cluster (exit hooks cannot see the code), so another
    # worker would carry on without it and might fail first
    rc, out = finish(_launch(["-n", "1", "-s", "1", SCRIPT, "dist_sync", "0", "3"], tag))
    assert rc == 3 and "worker 0 exited with code 3" in out, out


def test_sigint_leaves_nothing(tag: str) -> None:
    """Ctrl-C (SIGINT) while workers are blocked stops every process and exits 130."""
    proc = _launch(["-n", "2", "-s", "1", sys.executable, "-c",
                    "import kvstore, numpy as np; kv = kvstore.create('dist_sync'); "
                    "kv.init(1, np.zeros(1)); print('READY', flush=True); "
                    # worker 0 waits for a round worker 1 never joins; worker 1 waits at a barrier
                    "kv.push(1, np.ones(1)) or kv.pull(1) if kv.rank == 0 else kv.barrier()"], tag)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[worker 1] READY"):
            break
    proc.send_signal(signal.SIGINT)
    rc, out = finish(proc, timeout=30)
    assert rc == 130, "".join(lines) + out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


def test_launch_without_command_is_an_error() -> None:
    """launch.py without a worker command exits 2 with a usage message."""
    result = subprocess.run([sys.executable, "launch.py", "-n", "2"], cwd=REPO, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "command" in result.stderr


def test_node_dispatches_by_role(tmp_path: Path) -> None:
    """kvstore.node runs modules for scheduler/server and the command (with python for .py) for workers."""
    assert role_command("scheduler", []) == [sys.executable, "-m", "kvstore.scheduler"]
    assert role_command("server", ["x"]) == [sys.executable, "-m", "kvstore.server"]
    assert role_command("worker", ["train.py", "--lr", "1"]) == [sys.executable, "train.py", "--lr", "1"]
    assert role_command("worker", ["echo", "hi"]) == ["echo", "hi"]
    env = {k: v for k, v in os.environ.items() if k != "DMLC_ROLE"}
    missing = subprocess.run([sys.executable, "-m", "kvstore.node", "echo"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "DMLC_ROLE is not set" in missing.stderr
    worker = subprocess.run([sys.executable, "-m", "kvstore.node", sys.executable, "-c", "print('ran')"],
                            env={**env, "DMLC_ROLE": "worker"}, cwd=REPO, capture_output=True, text=True,
                            timeout=30)
    assert worker.returncode == 0 and worker.stdout.strip() == "ran"


def test_parent_omp_threads_reach_workers_and_bad_settings_exit_2(tag: str) -> None:
    """OMP_NUM_THREADS from the launcher's env reaches workers; an invalid setting is a message, exit 2."""
    cmd = ["-n", "1", "-s", "1", sys.executable, "-c",
           "import os, kvstore; kv = kvstore.create('dist_sync'); "
           "print('OMP', os.environ['OMP_NUM_THREADS'])"]
    rc, out = finish(_launch(cmd, tag, env={**os.environ, "OMP_NUM_THREADS": "3", "KVSTORE_TEST_TAG": tag}))
    assert rc == 0 and "[worker 0] OMP 3" in out, out
    rc, out = finish(_launch(cmd, tag, env={**os.environ, "KVSTORE_CONNECT_TIMEOUT": "soon"}))
    assert rc == 2 and "KVSTORE_CONNECT_TIMEOUT='soon'" in out and "Traceback" not in out, out


def test_missing_command_exits_127(tag: str) -> None:
    """A worker command that does not exist is a one-line error and exit 127, with nothing left."""
    rc, out = finish(_launch(["-n", "1", "-s", "1", "no-such-command-kvstore"], tag))
    assert rc == 127 and "cannot start no-such-command-kvstore" in out and "Traceback" not in out, out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


def test_exit_seen_while_a_grandchild_holds_the_output(tag: str) -> None:
    """A worker that exits while its child keeps stdout open is reported at once, and the child killed."""
    start = time.monotonic()
    rc, out = finish(_launch(["-n", "1", "-s", "1", sys.executable, "-c",
                               "import subprocess, sys; subprocess.Popen(['sleep', '60']); sys.exit(3)"],
                              tag), timeout=45)
    assert rc == 3 and "worker 0 exited with code 3" in out, out
    assert time.monotonic() - start < 30
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


def test_a_grandchild_that_ignores_sigterm_is_killed(tag: str) -> None:
    """What a worker leaves in its process group is SIGKILLed at the stop deadline, even if it ignores
    SIGTERM and its worker has exited 0 (the launcher then logs what it killed)."""
    grandchild = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print('stubborn', flush=True); time.sleep(60)")
    # the worker exits once the grandchild has said it ignores SIGTERM
    code = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
            "stdout=subprocess.PIPE, text=True); print(p.stdout.readline().strip(), flush=True)")
    rc, out = finish(_launch(["-n", "1", "-s", "1", sys.executable, "-c", code], tag,
                             {**os.environ, "KVSTORE_SHUTDOWN_TIMEOUT": "1"}), timeout=45)
    assert rc == 0 and "[worker 0] stubborn" in out, out
    assert "what worker 0 left in its process group" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 10, "the stubborn grandchild to be killed")


def test_a_server_port_exported_to_the_launcher_is_not_given_to_every_server(tag: str) -> None:
    """KVSTORE_NODE_PORT is per server: exported to the launcher, it would make two servers collide,
    so a local child does not inherit it (nor any other per-role variable)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    exported = {**os.environ, "KVSTORE_NODE_PORT": port, "KVSTORE_PORT_FILE": "/nonexistent/x"}
    rc, out = finish(_launch(["-n", "2", "-s", "2", SCRIPT, "dist_sync"], tag, exported))
    assert rc == 0 and "RESULT ok rank=1 of 2 servers=2" in out, out


def _pid_of(tag: str, role: str, rank: int) -> int | None:
    """The pid of the launched ``role`` with ``rank`` (found by its environment), if it runs."""
    wanted = {b"DMLC_ROLE=" + role.encode(),
              (b"DMLC_WORKER_ID=" if role == "worker" else b"KVSTORE_SERVER_ID=") + str(rank).encode()}
    for pid in tagged_pids(tag):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ:
            return pid
    return None


@pytest.mark.parametrize("role", ["worker", "server"])
def test_sigkill_mid_training_makes_the_launcher_exit_naming_the_node(tag: str, tmp_path: Path,
                                                                      role: str) -> None:
    """SIGKILL a worker or server while dist_sync rounds run: the launcher exits non-zero naming it,
    and nothing is left running."""
    script = str(Path(__file__).parents[1] / "scripts" / "steady_worker.py")
    env = {**os.environ, "KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
           "KVSTORE_HEARTBEAT_TIMEOUT": "3"}
    proc = _launch(["-n", "3", "-s", "2", script, str(tmp_path)], tag, env)
    poll_for(lambda: len(list(tmp_path.iterdir())) == 3, 60, "every worker to finish a round")
    os.kill(poll_for(lambda: _pid_of(tag, role, 1), 10, f"{role} 1's pid"), signal.SIGKILL)
    rc, out = finish(proc, timeout=60)
    assert rc != 0, out
    assert f"{role} 1 exited with code" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


FAIL_TOGETHER = """
import os, signal, sys, time, traceback
from pathlib import Path

signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop must not cut a traceback short
rank, meet = os.environ["DMLC_WORKER_ID"], Path(sys.argv[1])
(meet / f"ready{rank}").touch()
deadline = time.monotonic() + 30
while len(list(meet.glob("ready*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.005)  # polling interval of a deadline-bounded wait for the other worker


def hook(kind, exc, tb):
    for line in "".join(traceback.format_exception(kind, exc, tb)).splitlines(keepends=True):
        sys.stderr.write(line)
        sys.stderr.flush()
        time.sleep(0.005)  # pacing: one line at a time, so two workers' lines would interleave


def inner():
    raise ValueError(f"boom {rank}")


def middle():
    inner()


def outer():
    middle()


sys.excepthook = hook
outer()
"""


def test_workers_failing_together_print_whole_tracebacks_and_a_summary(tag: str, tmp_path: Path) -> None:
    """Two workers that raise at the same moment: each traceback comes out in one piece, and the
    launcher's last line says which failed first, with its exception and exit code."""
    script = tmp_path / "fail_together.py"
    script.write_text(FAIL_TOGETHER)
    rc, out = finish(_launch(["-n", "2", "-s", "1", str(script), str(tmp_path)], tag), timeout=60)
    assert rc == 1, out
    lines = out.splitlines()
    summary = r"launch\.py: worker ([01]) failed first \(exit 1\): ValueError: boom (\d)"
    last = re.fullmatch(summary, lines[-1])
    assert last and last.group(1) == last.group(2), out
    for rank in (0, 1):
        start = lines.index(f"[worker {rank}] Traceback (most recent call last):")
        end = lines.index(f"[worker {rank}] ValueError: boom {rank}")
        block = lines[start:end + 1]
        assert len(block) >= 7 and all(line.startswith(f"[worker {rank}] ") for line in block), out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


@pytest.mark.parametrize("kind,threshold", [("2bit", 0.5), ("1bit", 0.0)])
def test_compressed_pushes_match_the_reference_under_the_launcher(tag: str, kind: str,
                                                                  threshold: float) -> None:
    """launch.py -n 2 -s 2: 2bit and 1bit pushes of two values each sum, bit for bit, as the plain
    reference rules say, on both workers."""
    script = str(Path(__file__).parents[1] / "scripts" / "compression_check.py")
    rc, out = finish(_launch(["-n", "2", "-s", "2", script, kind, str(threshold)], tag))
    assert rc == 0, out
    for rank in range(2):
        assert f"[worker {rank}] RESULT ok rank={rank} kind={kind} servers=2" in out, out

"""``launch.py --launcher ssh`` against a real sshd on 127.0.0.1: every role over ssh under a tether,
fail-fast, Ctrl-C, --sync-dst-dir, unreachable hosts, and no process (local or remote) left behind.

The module's sshd runs as the test user on a free port with keys made for this run; the launcher is
given them through ``--ssh-args``.  "Remote" processes are children of that sshd, so a leak shows as
a live descendant of it, or as a live process carrying the test's tag in its environment.  Its
``MaxStartups 8`` (stricter than sshd's default 10:30:100) drops every connection that arrives while 8
are not yet logged in, so a launcher that opened more at once to one host would fail here.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, finish, poll_for, tagged_pids, terminate

SSHD = "/usr/sbin/sshd"
SCRIPT = str(Path(__file__).parents[1] / "scripts" / "sum_check.py")


@dataclass(frozen=True)
class Sshd:
    """A running sshd: its port, the --ssh-args that log in to it, its process, its log."""

    port: int
    ssh_args: str
    proc: subprocess.Popen
    workdir: Path
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state, ppid, ...
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_descendant(pid: int, ancestor: int) -> bool:
    return pid in _descendants(ancestor)


def _start_sshd(workdir: Path, attempt: int) -> tuple[subprocess.Popen, int, Path]:
    """Start sshd on a free port; return it, the port and its log file (the process may have exited)."""
    port = _free_port()
    config = workdir / "sshd_config"
    config.write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {workdir / 'host_key'}",
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}", f"PidFile {workdir / 'sshd.pid'}",
        "StrictModes no", "UsePAM no", "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "MaxStartups 8",
        "LogLevel INFO", ""]))
    log = workdir / f"sshd-{attempt}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    poll_for(lambda: proc.poll() is not None or "Server listening" in log.read_text(errors="replace"),
             20, "sshd to listen or exit")
    return proc, port, log


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    """A real sshd on 127.0.0.1 (a free port) accepting a key made for this module."""
    if not os.path.exists(SSHD) or shutil.which("ssh") is None:
        pytest.skip(f"needs OpenSSH: {SSHD} and ssh (apt-get install openssh-server)")
    workdir = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / key)],
                       check=True, timeout=30)
    shutil.copy(workdir / "client_key.pub", workdir / "authorized_keys")
    try:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
    except OSError:
        pass  # not root: sshd then runs without privilege separation
    for attempt in range(5):
        proc, port, log = _start_sshd(workdir, attempt)
        if proc.poll() is None:
            break
        text = log.read_text(errors="replace")
        if "Address already in use" not in text and "Bind to port" not in text:
            pytest.fail(f"sshd did not start:\n{text}")
    else:
        pytest.fail(f"sshd found no free port in 5 tries:\n{text}")
    ssh_args = shlex.join(["-F", "/dev/null", "-i", str(workdir / "client_key"), "-o", "IdentitiesOnly=yes",
                           "-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no",
                           "-o", "LogLevel=ERROR"])
    yield Sshd(port, ssh_args, proc, workdir, log)
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    terminate(proc)


def _hostfile(tmp_path: Path, *entries: str) -> str:
    path = tmp_path / "hosts"
    path.write_text("# hosts for the ssh launcher test\n" + "\n".join(entries) + "\n")
    return str(path)


def _launch(sshd: Sshd, hostfile: str, args: list[str], tag: str, cwd: Path = REPO,
            env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``launch.py --launcher ssh -H hostfile ARGS`` from ``cwd``, output merged."""
    env = {"KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_CONNECT_TIMEOUT": "30",
           "KVSTORE_LOG_LEVEL": "INFO", **os.environ, **(env or {})}
    argv = [sys.executable, str(REPO / "launch.py"), "--launcher", "ssh", "-H", hostfile,
            "--ssh-args", sshd.ssh_args, "--env", f"KVSTORE_TEST_TAG={tag}", *args]
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


class _Output:
    """A process's output, read by a thread of its own, so a test can wait for a line with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait up to ``timeout`` for the process to exit and its output to end; return (exit code,
        output).  Past it, the process's group is killed and the test fails with the output so far."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            self._reader.join(10)
            so_far = "".join(self.lines)
            raise AssertionError(f"launcher did not finish within {timeout} s:\n{so_far}") from None
        self._reader.join(10)
        assert not self._reader.is_alive(), "the launcher's output did not end within 10 s of its exit"
        self.proc.stdout.close()
        return rc, "".join(self.lines)


def _nothing_left(sshd: Sshd, tag: str) -> None:
    """Every role (here or remote: they carry the tag), every ssh client and every ssh session (and
    the tether in it: sshd's descendants) is gone."""
    poll_for(lambda: not tagged_pids(tag), 15, "every launched process to exit")
    poll_for(lambda: not _descendants(sshd.proc.pid), 15, "every ssh session (and tether) to end")


def test_cluster_over_ssh_sums_and_leaves_nothing(sshd: Sshd, tag: str, tmp_path: Path) -> None:
    """-n 2 -s 2 over two hostfile entries: every worker sums right, output is prefixed, exit 0,
    servers bind the hostfile's names, and no process is left here or "remotely"."""
    hosts = _hostfile(tmp_path, f"127.0.0.1:{sshd.port}", f"localhost:{sshd.port}  # the same sshd")
    rc, out = finish(_launch(sshd, hosts, ["-n", "2", "-s", "2", SCRIPT, "dist_sync"], tag), timeout=60)
    assert rc == 0, out
    for rank in range(2):
        assert f"[worker {rank}] RESULT ok rank={rank} of 2 servers=2" in out, out
    # process i runs on host i % 2: server 0 on 127.0.0.1, server 1 on localhost (its DMLC_NODE_HOST)
    assert "serving on 127.0.0.1:" in out and "serving on localhost:" in out, out
    assert "[scheduler]" in out and "[server 0]" in out and "[server 1]" in out, out
    assert "scheduler on 127.0.0.1:" in out, out
    _nothing_left(sshd, tag)


@pytest.mark.timeout(180)  # its waits' worst case passes the default 120 s
def test_secret_travels_on_stdin_not_command_lines(sshd: Sshd, tag: str, tmp_path: Path) -> None:
    """Ctrl-C while workers block: exit 130, nothing left.  Before it, while the cluster runs: the
    secret is on no process's command line, yet every remote role has it (and so authenticated)."""
    secret = f"ssh-test-secret-{uuid.uuid4().hex}"
    hosts = _hostfile(tmp_path, f"127.0.0.1:{sshd.port}")
    proc = _launch(sshd, hosts, ["-n", "2", "-s", "1", sys.executable, "-c",
                                 "import kvstore, numpy as np; kv = kvstore.create('dist_sync'); "
                                 "kv.init(1, np.zeros(1)); print('READY', flush=True); "
                                 # worker 0 waits for a round worker 1 never joins; 1 waits at a barrier
                                 "kv.push(1, np.ones(1)) or kv.pull(1) if kv.rank == 0 else kv.barrier()"],
                   tag, env={"KVSTORE_SECRET": secret})
    output = _Output(proc)
    try:
        def ready() -> set[str]:
            return {line.split("]")[0] for line in list(output.lines) if line.endswith("] READY\n")}
        poll_for(lambda: len(ready()) == 2, 60, "both workers to print READY")  # both joined and block now
        on_command_lines = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and secret.encode() in (entry / "cmdline").read_bytes():
                    on_command_lines.append(entry.name)
            except OSError:
                continue
        assert not on_command_lines, f"the secret is on the command line of pids {on_command_lines}"
        roles = [pid for pid in tagged_pids(tag) if b"DMLC_ROLE=" in Path(f"/proc/{pid}/environ").read_bytes()
                 and _is_descendant(pid, sshd.proc.pid)]
        assert len(roles) == 3, ("two workers and a server under sshd", roles)
        for pid in roles:
            assert f"KVSTORE_SECRET={secret}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    finally:
        proc.send_signal(signal.SIGINT)
        rc, out = output.finish(30)
    assert rc == 130, out
    assert "interrupted; stopping every process" in out and "killed after" not in out, out  # EOF sufficed
    _nothing_left(sshd, tag)


def _remote_pid(tag: str, role: str) -> int | None:
    """The pid of a remote process running as ``role`` (found by its environment), if there is one."""
    for pid in tagged_pids(tag):
        try:
            if f"DMLC_ROLE={role}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


@pytest.mark.timeout(180)  # its waits' worst case passes the default 120 s
def test_a_longer_remote_grace_is_waited_for_before_ssh_is_killed(sshd: Sshd, tag: str,
                                                                  tmp_path: Path) -> None:
    """The roles get KVSTORE_SHUTDOWN_TIMEOUT=3 (--env), the launcher has 1, and the worker ignores
    SIGTERM: on Ctrl-C the launcher waits for the remote tether, which SIGKILLs the worker after its
    3 s and says so through the still open connection; the launcher kills no ssh client, exits 130,
    and the worker is gone."""
    hosts = _hostfile(tmp_path, f"127.0.0.1:{sshd.port}")
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('READY', flush=True); time.sleep(100)")
    proc = _launch(sshd, hosts, ["--env", "KVSTORE_SHUTDOWN_TIMEOUT=3", "-n", "1", "-s", "1",
                                 sys.executable, "-c", stubborn], tag, env={"KVSTORE_SHUTDOWN_TIMEOUT": "1"})
    output = _Output(proc)
    try:
        poll_for(lambda: "[worker 0] READY\n" in output.lines, 60, "the worker to ignore SIGTERM")
        worker = poll_for(lambda: _remote_pid(tag, "worker"), 10, "the remote worker's pid")
        assert _is_descendant(worker, sshd.proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        rc, out = output.finish(30)
    assert rc == 130, out
    assert "[worker 0] kvstore.tether: " in out, out
    assert "did not stop within 3 s of SIGTERM; killed it" in out, out  # by the tether, said over ssh
    assert "killed after" not in out, out  # every ssh client exited by itself
    poll_for(lambda: worker not in tagged_pids(tag), 15, "the remote worker to be gone")
    _nothing_left(sshd, tag)


@pytest.mark.timeout(180)  # its waits' worst case passes the default 120 s
def test_many_roles_on_one_host_stay_under_maxstartups(sshd: Sshd, tag: str, tmp_path: Path) -> None:
    """-n 20 -s 1 on one host: 21 ssh logins to an sshd that drops any connection past 8 not yet logged
    in.  The launcher keeps at most 8 of them starting at a time, so every role runs, the launcher
    exits 0, the tethers' STARTED lines are not printed, and sshd dropped nothing."""
    hosts = _hostfile(tmp_path, f"127.0.0.1:{sshd.port}")
    before = sshd.log.read_text(errors="replace").count("past MaxStartups")
    rc, out = finish(_launch(sshd, hosts, ["-n", "20", "-s", "1", "sh", "-c", "echo hello $DMLC_WORKER_ID"],
                             tag, env={"KVSTORE_SHUTDOWN_TIMEOUT": "1"}), timeout=90)
    assert rc == 0, out
    assert all(f"[worker {rank}] hello {rank}\n" in out for rank in range(20)), out
    assert "kvstore.tether: started" not in out, out
    assert sshd.log.read_text(errors="replace").count("past MaxStartups") == before
    _nothing_left(sshd, tag)


def test_failing_worker_over_ssh_stops_everything(sshd: Sshd, tag: str, tmp_path: Path) -> None:
    """A remote worker that raises: the launcher exits 1 within seconds naming worker 1, leaving nothing."""
    hosts = _hostfile(tmp_path, f"127.0.0.1:{sshd.port}", f"localhost:{sshd.port}")
    start = time.monotonic()
    rc, out = finish(_launch(sshd, hosts, ["-n", "2", "-s", "1", SCRIPT, "dist_sync", "1"], tag), timeout=60)
    elapsed = time.monotonic() - start
    assert rc == 1, out
    assert "worker 1 on 127.0.0.1:" in out and "exited with code 1" in out, out
    assert "[worker 1] RuntimeError: worker 1 fails on purpose" in out, out
    assert elapsed < 30, f"took {elapsed:.1f} s"  # worker 0 was blocked in a pull with a 600 s deadline
    assert "killed after" not in out, out  # closing the tethers' stdin stopped the remote roles
    _nothing_left(sshd, tag)


def test_sync_dst_dir_runs_the_copy(sshd: Sshd, tag: str, tmp_path: Path) -> None:
    """--sync-dst-dir rsyncs the current directory to DIR on each host and runs there; the remote role
    gets the --env and KVSTORE_* variables but not the rest of the launcher's environment."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "where.py").write_text(
        "import os, kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "print('WHERE', os.path.abspath(__file__), os.getcwd(), flush=True)\n"
        "print('ENV', os.environ.get('KVSTORE_FROM_LAUNCHER'), os.environ.get('FROM_ENV_FLAG'),\n"
        "      os.environ.get('NOT_FORWARDED'), os.environ['OMP_NUM_THREADS'], flush=True)\n")
    hosts = _hostfile(tmp_path, f"127.0.0.1:{sshd.port}", f"localhost:{sshd.port}")
    proc = _launch(sshd, hosts, ["--sync-dst-dir", str(dst), "--env", "FROM_ENV_FLAG=yes",
                                 "-n", "1", "-s", "1", "where.py"], tag, cwd=src,
                   env={"KVSTORE_FROM_LAUNCHER": "fwd", "NOT_FORWARDED": "leak"})
    rc, out = finish(proc, timeout=60)
    assert rc == 0, out
    assert (dst / "where.py").read_text() == (src / "where.py").read_text()
    assert f"[worker 0] WHERE {dst / 'where.py'} {dst}" in out, out
    assert "[worker 0] ENV fwd yes None 1" in out, out
    assert out.count("[launcher] INFO rsync ") == 2, out  # one per distinct host
    _nothing_left(sshd, tag)


def test_unreachable_host_is_a_clear_error(sshd: Sshd, tag: str, tmp_path: Path) -> None:
    """A host where nothing listens: ssh exits 255 and the launcher says so, quickly; so does rsync."""
    hosts = _hostfile(tmp_path, f"127.0.0.1:{_free_port()}")
    start = time.monotonic()
    rc, out = finish(_launch(sshd, hosts, ["-n", "1", "-s", "1", SCRIPT, "dist_sync"], tag), timeout=60)
    assert rc == 255, out
    assert "ssh exited with code 255 (is 127.0.0.1 reachable" in out and "Connection refused" in out, out
    assert time.monotonic() - start < 20, out
    rc, out = finish(_launch(sshd, hosts, ["--sync-dst-dir", str(tmp_path / "dst"), "-n", "1", "-s", "1",
                                           SCRIPT, "dist_sync"], tag), timeout=60)
    # rsync's own code: 255 (its ssh failed) or 12 (the stream closed first), by timing
    assert rc in (12, 255) and f"--sync-dst-dir: rsync to {tmp_path / 'dst'} on 127.0.0.1:" in out, out
    assert "Connection refused" in out, out
    assert "[scheduler]" not in out, out  # nothing was started
    _nothing_left(sshd, tag)


def test_missing_remote_command_exits_127(sshd: Sshd, tag: str, tmp_path: Path) -> None:
    """A worker command that does not exist on the host: exit 127, as with the local launcher."""
    hosts = _hostfile(tmp_path, f"127.0.0.1:{sshd.port}")
    rc, out = finish(_launch(sshd, hosts, ["-n", "1", "-s", "1", "no-such-command-kvstore"], tag), timeout=60)
    assert rc == 127, out
    assert "cannot start no-such-command-kvstore" in out and "worker 0 on 127.0.0.1:" in out, out
    _nothing_left(sshd, tag)

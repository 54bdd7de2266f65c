"""Clusters on namespaced hosts (tests/hosts.py): real network stacks with their own addresses, not
127.0.0.1.  The launcher runs on host 0 (so the scheduler binds 10.45.0.1, its address on the route
to the hosts); roles reach hosts 1-3 over ssh (an sshd per host) or Open MPI's mpirun.

Needs root (CI runs as root); skips with the reason elsewhere.  docs/hosts.md says what these showed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.core import checkpoint
from tests.helpers import REPO, finish, launch, poll_for, tagged_pids
from tests.hosts import Host, Hosts, unavailable

pytestmark = pytest.mark.hosts  # the second tier (about a minute of namespaced jobs)
SCRIPTS = Path(__file__).parent / "scripts"
ROUNDS = str(SCRIPTS / "hosts_rounds.py")
TRAINER = str(SCRIPTS / "trainer_equiv.py")
NAMED = (r"NodeLostError: server 0 at tcp://10\.45\.0\.2:\d+ is partitioned from this worker "
         r"\(the scheduler still hears both\)")
ENV = {"KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_CONNECT_TIMEOUT": "30", "KVSTORE_REQUEST_TIMEOUT": "30",
       "KVSTORE_LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Four namespaced hosts, each with an sshd; every namespace and process is gone afterwards."""
    why = unavailable()
    if why:
        pytest.skip(why)
    if not os.path.exists("/usr/sbin/sshd") or shutil.which("ssh") is None:
        pytest.skip("needs OpenSSH: /usr/sbin/sshd and ssh (apt-get install openssh-server)")
    with Hosts(4) as made:
        made.sshd()
        yield made
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert made.tag not in listed, listed


def _hostfile(hosts: Hosts, name: str, *entries: Host) -> str:
    path = hosts.workdir / name
    path.write_text("".join(f"{host.address}\n" for host in entries))
    return str(path)


class _Job:
    """A launcher started on a host, its output read by a thread that stamps each line's arrival."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def text(self) -> str:
        return "".join(line for _, line in list(self.lines))

    def first(self, pattern: str) -> float | None:
        """When the first line matching ``pattern`` arrived (None: none has)."""
        return next((at for at, line in list(self.lines) if re.search(pattern, line)), None)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait up to ``timeout`` for the launcher; return (exit code, output).  Past it, kill its
        process group and fail with the output so far."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(30)
            raise AssertionError(f"launcher did not finish within {timeout} s:\n{self.text()}") from None
        self._reader.join(10)
        return rc, self.text()


def _launch(host: Host, args: list[str], tag: str, env: dict[str, str] | None = None) -> _Job:
    """``launch.py ARGS`` on ``host`` (in the repository), output merged, tagged for the leak check."""
    # PYTHONPATH: roles started over ssh import this checkout's kvstore, not an installed one elsewhere
    argv = [sys.executable, str(REPO / "launch.py"), "--env", f"KVSTORE_TEST_TAG={tag}",
            "--env", f"PYTHONPATH={REPO}", *args]
    return _Job(host.popen(argv, {**ENV, **(env or {})}, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True))


def _ssh(hosts: Hosts, hostfile: str) -> list[str]:
    return ["--launcher", "ssh", "-H", hostfile, "--ssh-args", hosts.ssh_args]


def _registered_from(out: str) -> list[str]:
    return re.findall(r"(?:worker|server) registered from (\S+)", out)


def test_four_hosts_over_ssh_train_to_the_loopback_weights(hosts: Hosts, tag: str, tmp_path: Path) -> None:
    """-n 4 -s 2 over ssh on four hosts (the scheduler on host 0, every role on its hostfile host) ends
    with the same weights as the same job on loopback; every role registered from its own address."""
    args = ["-n", "4", "-s", "2", TRAINER, "sgd", "1"]
    bound = {"KVSTORE_BIGARRAY_BOUND": "500"}  # the first layer's 640-element weight spans both servers
    on_hosts = tmp_path / "hosts.arrays"
    hostfile = _hostfile(hosts, "train", hosts[1], hosts[2], hosts[3], hosts[0])
    job = _launch(hosts[0], [*_ssh(hosts, hostfile), *args, str(on_hosts)], tag, bound)
    on_loopback = tmp_path / "loopback.arrays"
    loopback = launch([*args, str(on_loopback)], {**os.environ, **ENV, **bound, "KVSTORE_TEST_TAG": tag})
    rc, out = job.finish(120)
    assert rc == 0, out
    rc_loop, out_loop = finish(loopback, 120)
    assert rc_loop == 0, out_loop
    assert "scheduler on 10.45.0.1:" in out, out
    # servers 0, 1 on hosts 1, 2; workers 0-3 on hosts 3, 0, 1, 2 (process i on host i mod 4)
    assert sorted(_registered_from(out)) == sorted(["10.45.0.2", "10.45.0.3", "10.45.0.4", "10.45.0.1",
                                                    "10.45.0.2", "10.45.0.3"]), out
    assert "serving on 10.45.0.2:" in out and "serving on 10.45.0.3:" in out, out
    assert set(_registered_from(out_loop)) == {"127.0.0.1"}, out_loop
    dist, reference = checkpoint.load_arrays(on_hosts), checkpoint.load_arrays(on_loopback)
    assert set(dist) == set(reference) and dist
    for key, weight in reference.items():
        np.testing.assert_allclose(dist[key], weight, rtol=1e-5, atol=1e-6, err_msg=key)
    poll_for(lambda: not tagged_pids(tag), 20, "every role of both jobs to exit")


def test_kvstore_node_with_a_hostfile_under_mpirun(hosts: Hosts, tag: str) -> None:
    """``launch.py --launcher mpi -H hostfile``: mpirun starts ``python -m kvstore.node`` on each host
    (over the hosts' sshds), the ranks derive their roles and addresses, every worker sums right.
    Before the fix, ranks on other hosts lacked DMLC_PS_ROOT_URI and exited 2."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun (apt-get install openmpi-bin)")
    hostfile = _hostfile(hosts, "mpi", *hosts)
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_plm_rsh_args": hosts.ssh_args, "KVSTORE_BIGARRAY_BOUND": "1000"}
    job = _launch(hosts[0], ["--launcher", "mpi", "-H", hostfile, "-n", "3", "-s", "2",
                             str(SCRIPTS / "sum_check.py"), "dist_sync"], tag, env)
    rc, out = job.finish(120)
    assert rc == 0, out
    for rank in range(3):
        assert f"[worker {rank}] RESULT ok rank={rank} of 3 servers=2" in out, out
    # the scheduler and server 0 on host 0, then server 1, workers 0, 1, 2 on hosts 1, 2, 3, 0
    assert "scheduler 10.45.0.1:" in out, out
    assert sorted(_registered_from(out)) == sorted(["10.45.0.1", "10.45.0.2", "10.45.0.3", "10.45.0.4",
                                                    "10.45.0.1"]), out
    poll_for(lambda: not tagged_pids(tag), 20, "every rank to exit")


def test_shared_memory_within_a_host_never_across(hosts: Hosts, tag: str) -> None:
    """One server and two workers on host 1, a third worker on host 2: the same-host workers move the
    256 KiB value through shared memory, the other worker over TCP (the server refused its segment)."""
    hostfile = _hostfile(hosts, "shm", hosts[1], hosts[1], hosts[1], hosts[2])
    job = _launch(hosts[0], [*_ssh(hosts, hostfile), "-n", "3", "-s", "1", ROUNDS, "shm", "0"], tag)
    rc, out = job.finish(120)
    assert rc == 0, out
    lanes = dict(re.findall(r"\[worker (\d)\] LANES rank=\d servers=(\[.*?\]) sent=", out))
    assert lanes == {"0": "[0]", "1": "[0]", "2": "[]"}, out
    for rank in (0, 1):
        sent = int(re.search(rf"\[worker {rank}\] LANES .* sent=(\d+)", out).group(1))
        assert sent >= 64 * 1024 * 4, out  # its push (and rank 0's init) went through the segment
    poll_for(lambda: not tagged_pids(tag), 20, "every role to exit")


@pytest.mark.timeout(180)
def test_a_cut_host_heals_within_the_deadline_and_is_named_past_it(hosts: Hosts, tag: str) -> None:
    """Server on host 1, workers on hosts 2 and 3, heartbeats 0.2 s / 4 s.  Host 3 cut off for 1 s:
    the job goes on once it is back.  Cut for good: the scheduler names worker 1 lost on its address
    within the heartbeat timeout plus one interval (and load slack), worker 0 raises NodeLostError
    naming it, and the launcher fails (docs/failures.md: a worker whose machine is gone), SIGKILLing
    the ssh client to the cut host once its stop deadline has passed (docs/launching.md, Stopping)."""
    interval, timeout = 0.2, 4.0
    hostfile = _hostfile(hosts, "cut", hosts[1], hosts[2], hosts[3])
    env = {"KVSTORE_HEARTBEAT_INTERVAL": str(interval), "KVSTORE_HEARTBEAT_TIMEOUT": str(timeout),
           "KVSTORE_SHUTDOWN_TIMEOUT": "1"}  # the launcher waits 1 + 5 s for the cut host's ssh
    job = _launch(hosts[0], [*_ssh(hosts, hostfile), "-n", "2", "-s", "1", ROUNDS, "rounds", "90"], tag, env)
    victim = hosts[3]

    def rounds(rank: int) -> int:
        found = re.findall(rf"\[worker {rank}\] ROUNDS rank={rank} n=(\d+)", job.text())
        return int(found[-1]) if found else 0

    try:
        poll_for(lambda: rounds(0) and rounds(1), 60, "both workers to run rounds")
        hosts.cut(victim)
        cut_at = time.monotonic()
        poll_for(lambda: time.monotonic() - cut_at > 1.0, 5, "a 1 s cut")
        before = rounds(1)
        hosts.heal(victim)
        poll_for(lambda: rounds(1) >= before + 30, 30, f"rounds to go on after the heal:\n{job.text()}")
        assert job.proc.poll() is None and "is lost" not in job.text(), job.text()

        hosts.cut(victim)
        cut_at = time.monotonic()
        named = poll_for(lambda: job.first(r"worker 1 on 10\.45\.0\.4 is lost"), timeout + 30,
                         f"the scheduler or worker 0 to name worker 1 lost:\n{job.text()}")
        rc, out = job.finish(60)
    finally:
        hosts.heal(victim)
    took = named - cut_at
    assert timeout <= took + 0.5, (took, out)  # not before its heartbeats stopped for the timeout
    assert took <= timeout + interval + 3.0, (took, out)  # 3 s of slack for a loaded machine
    assert rc != 0, out
    assert "NodeLostError: worker 1 on 10.45.0.4 is lost: no heartbeat for 4 s" in out, out
    assert "killed after their stop timeout: worker 1 (the ssh client; host 10.45.0.4" in out, out
    poll_for(lambda: not tagged_pids(tag), 30, "every role, the cut-off worker included, to exit")


@pytest.mark.timeout(120)
def test_a_partition_between_a_worker_and_a_server_alone_is_named_within_the_heartbeat_deadline(
        hosts: Hosts, tag: str) -> None:
    """Server on host 1, workers on hosts 2 and 3, heartbeats 0.2 s / 2 s, the default 600 s request
    timeout; only hosts 1 and 3 partitioned (both still reach the scheduler): worker 1 raises
    NodeLostError naming server 0, its address and the partition within the heartbeat timeout plus
    one interval (and load slack), and the launcher fails (docs/failures.md)."""
    interval, timeout = 0.2, 2.0
    hostfile = _hostfile(hosts, "pair", hosts[1], hosts[2], hosts[3])
    env = {"KVSTORE_HEARTBEAT_INTERVAL": str(interval), "KVSTORE_HEARTBEAT_TIMEOUT": str(timeout),
           "KVSTORE_REQUEST_TIMEOUT": "600", "KVSTORE_SHUTDOWN_TIMEOUT": "1"}
    job = _launch(hosts[0], [*_ssh(hosts, hostfile), "-n", "2", "-s", "1", ROUNDS, "rounds", "90"], tag, env)
    try:
        poll_for(lambda: "ROUNDS rank=1 n=10" in job.text(), 60, f"worker 1 to run rounds:\n{job.text()}")
        hosts.partition(hosts[1], hosts[3])
        cut_at = time.monotonic()
        named = poll_for(lambda: job.first(NAMED), timeout + 30,
                         f"worker 1 to name the partition:\n{job.text()}")
        rc, out = job.finish(60)
    finally:
        hosts.rejoin(hosts[1], hosts[3])
    took = named - cut_at
    assert timeout <= took + 0.5, (took, out)  # not before its link heard nothing for the timeout
    assert took <= timeout + interval + 3.0, (took, out)  # 3 s of slack for a loaded machine
    assert rc != 0, out
    assert "[worker 1]" in next(line for at, line in job.lines if at == named), out
    assert "no heartbeat for" not in out and "DeadlineExceededError" not in out, out
    poll_for(lambda: not tagged_pids(tag), 30, "every role to exit")


@pytest.mark.timeout(120)
def test_a_short_partition_heals_and_a_busy_server_is_not_partitioned(hosts: Hosts, tag: str) -> None:
    """Heartbeats 0.2 s / 2.5 s.  Hosts 1 (the server) and 3 (worker 1) partitioned for 0.8 s, then
    the server's request loop blocked for 4 s (KVSTORE_TEST_SERVER_STALL: longer than the heartbeat
    timeout, as a long optimizer step): nothing is named, and the job ends with the weight an
    unbroken run gives (every step's update applied once)."""
    steps, workers = 300, 2
    hostfile = _hostfile(hosts, "heal", hosts[1], hosts[2], hosts[3])
    env = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "2.5",
           "KVSTORE_REQUEST_TIMEOUT": "600", "KVSTORE_TEST_SERVER_STALL": f"{2 * 200}:4"}
    job = _launch(hosts[0], [*_ssh(hosts, hostfile), "-n", str(workers), "-s", "1", ROUNDS, "steps",
                             str(steps)], tag, env)
    try:
        poll_for(lambda: "ROUNDS rank=1 n=10" in job.text(), 60, f"worker 1 to run steps:\n{job.text()}")
        hosts.partition(hosts[1], hosts[3])
        cut_at = time.monotonic()
        poll_for(lambda: time.monotonic() - cut_at > 0.8, 5, "a 0.8 s partition")
    finally:
        hosts.rejoin(hosts[1], hosts[3])
    assert "ROUNDS rank=1 n=200" not in job.text(), f"the stall came before the heal:\n{job.text()}"
    rc, out = job.finish(90)
    assert rc == 0, out
    assert "KVSTORE_TEST_SERVER_STALL: the request loop blocks for 4 s" in out, out
    assert "partitioned" not in out and "is lost" not in out, out
    expected = -0.5 * sum(step % 3 + 1 for step in range(steps)) * workers * (workers + 1) / 2
    finals = [float(w) for w in re.findall(r"FINAL rank=\d w=(\S+)", out)]
    assert finals == [expected] * workers, (finals, expected, out)
    poll_for(lambda: not tagged_pids(tag), 30, "every role to exit")


def test_the_harness_relays_shapes_cuts_and_leaves_nothing() -> None:
    """A relay adds its delay each way, a cut host is unreachable and reachable again once healed, a
    rate shows as the htb class; after a failure inside the block no namespace or process is left."""
    why = unavailable()
    if why:
        pytest.skip(why)
    probe = ("import socket, sys, time; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), "
             "timeout=float(sys.argv[3])); t = time.monotonic(); s.sendall(b'x'); s.recv(1); "
             "print(time.monotonic() - t)")
    echo = ("import socket, sys; s = socket.create_server((sys.argv[1], 7000)); print('up', flush=True)\n"
            "while True:\n    c, _ = s.accept(); c.sendall(c.recv(1)); c.close()")
    with pytest.raises(RuntimeError, match="on purpose"):
        with Hosts(2) as made:
            a, b = made
            server = b.popen([sys.executable, "-c", echo, b.address], stdout=subprocess.PIPE, text=True)
            assert server.stdout.readline() == "up\n"
            direct = float(a.run([sys.executable, "-c", probe, b.address, "7000", "10"], check=True).stdout)
            relay = made.relay(a, b, 7000, 0.1)
            delayed = float(a.run([sys.executable, "-c", probe, relay.address, str(relay.port), "10"],
                                  check=True).stdout)
            assert direct < 0.1 and 0.2 <= delayed < 1.0, (direct, delayed)
            made.cut(b)
            assert a.run([sys.executable, "-c", probe, b.address, "7000", "0.5"]).returncode != 0
            made.heal(b)
            a.run([sys.executable, "-c", probe, b.address, "7000", "10"], check=True)
            made.link(a, b).rate(50)
            assert "rate 50Mbit" in a.run(["tc", "class", "show", "dev", "eth0"], check=True).stdout
            inits = [made[0].init_pid, made[1].init_pid]
            raise RuntimeError("on purpose")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert made.tag not in listed, listed
    assert server.wait(10) is not None and relay.proc.poll() is not None  # their hosts' inits took them
    poll_for(lambda: not any(_alive(pid) for pid in inits), 10, "the hosts' inits to go")
    assert not made.workdir.exists()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False

"""``python -m kvstore.status`` against real clusters, and the scheduler's barrier stall inspector.

Every cluster is torn down by ``make_cluster`` (workers closed, processes killed and joined); the
status tool runs as a subprocess with a deadline.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.errors import StallError
from tests.helpers import REPO, poll_for
from tests.integration.conftest import SECRET


def status_tool(cluster, *args: str, secret: str | None = SECRET, address: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m kvstore.status ARGS`` for ``cluster``'s scheduler (or ``address``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_"))}
    if secret is not None:
        env["KVSTORE_SECRET"] = secret
    where = address or f"127.0.0.1:{cluster.env['DMLC_PS_ROOT_PORT']}"
    return subprocess.run([sys.executable, "-m", "kvstore.status", *args, where], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_status_json_lists_every_node(make_cluster):
    """--json prints the scheduler's snapshot, whose nodes are every server and worker, with ranks."""
    cluster = make_cluster(num_workers=2, num_servers=2, KVSTORE_HEARTBEAT_INTERVAL=0.2)
    expected = {("server", 0), ("server", 1), ("worker", 0), ("worker", 1)}

    def every_snapshot() -> dict | None:
        done = status_tool(cluster, "--json", "--timeout", "20")
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        return status if {(n["role"], n["rank"]) for n in status["nodes"]} == expected else None

    status = poll_for(every_snapshot, 30, "a snapshot of every node in the STATUS reply")
    assert all(n["schema"] == 1 and isinstance(n["pid"], int) for n in status["nodes"])
    assert status["schema"] == 1
    assert status["cluster"]["complete"] is True and status["cluster"]["mode"] == "dist_sync"
    sched = status["scheduler"]
    assert sched["role"] == "scheduler" and sched["schema"] == 1 and sched["joins"] == 4
    assert {(row["role"], row["rank"]) for row in sched["nodes"]} == expected
    assert all(not row["lost"] and not row["left"] for row in sched["nodes"])


@pytest.mark.timeout(120)
def test_status_live_view_draws_the_nodes(make_cluster):
    """Without --json the view is drawn (two frames, the second with rates) until interrupted; here
    it is ended by its timeout kill after a couple of frames."""
    cluster = make_cluster(num_workers=1, num_servers=1)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_"))},
           "KVSTORE_SECRET": SECRET}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.status", "--interval", "0.2",
                             f"127.0.0.1:{cluster.env['DMLC_PS_ROOT_PORT']}"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        frames = 0
        text = ""
        while frames < 2:
            line = proc.stdout.readline()
            assert line, f"the view ended early:\n{text}"
            text += line
            frames += line.count("\x1b[H\x1b[2J")
        assert "kvstore cluster at 127.0.0.1:" in text and "server" in text and "worker" in text
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(120)
def test_status_with_a_wrong_secret_fails_clearly(make_cluster):
    """A wrong or missing secret gets one clear line naming the address, and exit code 1."""
    cluster = make_cluster(num_workers=1, num_servers=1)
    for secret in ("not-the-secret", None):
        done = status_tool(cluster, "--json", "--timeout", "20", secret=secret)
        assert done.returncode == 1, done.stdout
        assert "refused" in done.stderr and cluster.env["DMLC_PS_ROOT_PORT"] in done.stderr
        assert done.stderr.count("\n") == 1 and not done.stdout


@pytest.mark.timeout(60)
def test_status_without_a_scheduler_names_the_address():
    """Nothing listening: exit 1 after --timeout, with a line naming the address."""
    with socket.socket() as probe:  # a port nobody listens on: bound, then released
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = status_tool(None, "--json", "--timeout", "1", address=f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in done.stderr and "no STATUS reply" in done.stderr


def _scheduler_log(cluster) -> str:
    return next(log.read_text(errors="replace") for name, _, log in cluster.procs.procs
                if name == "scheduler")


@pytest.mark.timeout(120)
def test_barrier_stall_names_the_missing_worker(make_cluster):
    """KVSTORE_STALL_WARN=1: a barrier worker 1 is held back from is logged once, naming worker 1."""
    cluster = make_cluster(num_workers=2, num_servers=1, KVSTORE_STALL_WARN=1)
    kv0, kv1 = cluster.workers
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(kv0.barrier)
        line = poll_for(lambda: next((ln for ln in _scheduler_log(cluster).splitlines()
                                      if "KVSTORE_STALL_WARN" in ln), None), 20, "the stall warning")
        assert "for worker 1 (" in line and "workers [0] are in it" in line
        assert not waiting.done()
        kv1.barrier()  # the held-back worker arrives: both go through
        waiting.result(timeout=30)
    assert _scheduler_log(cluster).count("KVSTORE_STALL_WARN") == 1


@pytest.mark.timeout(120)
def test_barrier_stall_abort_raises_stall_error(make_cluster):
    """KVSTORE_STALL_ABORT=2: the waiting worker's barrier raises StallError naming worker 1."""
    cluster = make_cluster(num_workers=2, num_servers=1, KVSTORE_STALL_WARN=1, KVSTORE_STALL_ABORT=2)
    kv0 = cluster.workers[0]
    with pytest.raises(StallError) as caught:
        kv0.barrier()
    assert "worker 1" in str(caught.value) and "KVSTORE_STALL_ABORT=2" in str(caught.value)


@pytest.mark.timeout(120)
def test_status_against_a_cluster_without_a_secret(make_cluster):
    """Without KVSTORE_SECRET (a loopback cluster) the tool gets the status, before the map and after."""
    cluster = make_cluster(num_workers=1, num_servers=1, connect=False, KVSTORE_SECRET="")
    done = status_tool(cluster, "--json", "--timeout", "20", secret=None)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cluster"]["complete"] is False
    cluster.connect()
    done = status_tool(cluster, "--json", "--timeout", "20", secret=None)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cluster"]["complete"] is True

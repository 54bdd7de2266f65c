"""Counters and the servers' stall inspector (issue 21) on a real cluster: a worker held back by the
test (no sleep in the library) is named by the server's stall warning within the threshold, shows as
the round's last arrival in ``stats(cluster=True)``, and with KVSTORE_STALL_ABORT a pull waiting on
it raises StallError naming it."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.errors import StallError
from tests.helpers import poll_for

from .conftest import unique_key

pytestmark = pytest.mark.timeout(60)


def server_log(cluster) -> str:
    return next(log.read_text() for name, _, log in cluster.procs.procs if name == "server 0")


def test_a_worker_counts_its_calls_and_bytes(make_cluster):
    cluster = make_cluster("dist_sync", num_workers=1, num_servers=1)
    kv = cluster.workers[0]
    key = unique_key()
    kv.init(key, np.zeros(1000, np.float32))
    for _ in range(3):
        kv.push(key, np.ones(1000, np.float32))
    kv.pull(key)
    stats = kv.stats()
    assert stats["schema"] == 1 and stats["role"] == "worker" and stats["rank"] == 0
    assert stats["ops"] == {"push": 3, "pull": 1, "pushpull": 0, "init": 1, "barrier": 0}
    assert stats["bytes_out"] >= 4 * 4000 and stats["bytes_in"] >= 4000
    assert stats["latency"]["push"]["count"] == 3 and stats["last_op"] == "pull"
    assert set(stats["blocked_s"]) == {"pull", "barrier", "push_window"}


def test_the_stall_warning_names_the_late_worker_and_stats_show_it_last(make_cluster):
    cluster = make_cluster("dist_sync", num_workers=2, num_servers=1, KVSTORE_STALL_WARN=1,
                           KVSTORE_HEARTBEAT_INTERVAL=0.2, KVSTORE_HEARTBEAT_TIMEOUT=5)
    kv0, kv1 = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(4, np.float32)))
    kv0.push(key, np.ones(4, np.float32))
    started = time.monotonic()
    line = poll_for(lambda: next((ln for ln in server_log(cluster).splitlines() if "has waited" in ln), None),
                    10, "the server's stall warning")
    assert time.monotonic() - started < 5
    assert f"key {key!r}" in line and "worker 1 (never seen here)" in line and "worker 0" not in line
    kv1.push(key, np.ones(4, np.float32))
    assert np.all(kv0.pull(key) == 2)

    def server_saw_round() -> dict | None:
        nodes = kv0.stats(cluster=True)["nodes"]
        server = next((n for n in nodes if n["role"] == "server"), None)
        return server if server and server["rounds_applied"] >= 1 else None

    server = poll_for(server_saw_round, 10, "the server's snapshot of the closed round")
    assert server["last_round"]["last_worker"] == 1 and server["last_round"]["key"] == key
    assert server["last_round"]["waited_s"] >= 1.0 and server["last_arrivals"] == {"1": 1}
    assert {(n["role"], n["rank"]) for n in kv0.stats(cluster=True)["nodes"]} >= {
        ("server", 0), ("worker", 0), ("worker", 1)}


def test_stall_abort_answers_a_waiting_pull_with_stall_error(make_cluster):
    cluster = make_cluster("dist_sync", num_workers=2, num_servers=1, KVSTORE_STALL_WARN=1,
                           KVSTORE_STALL_ABORT=2)
    kv0, kv1 = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(4, np.float32)))
    kv0.push(key, np.ones(4, np.float32))
    started = time.monotonic()
    with pytest.raises(StallError, match=r"worker 1 .*KVSTORE_STALL_ABORT=2"):
        kv0.pull(key)
    assert time.monotonic() - started < 10
    kv1.push(key, np.ones(4, np.float32))  # the round still closes with both pushes
    assert np.all(kv1.pull(key) == 2)

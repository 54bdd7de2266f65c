"""The push window (KVSTORE_PUSH_WINDOW, issue 20) on real processes: what a server and a worker
hold stays bounded whatever the skew, a push beyond the window is refused (and the pusher told),
and the orders users write still work.

Memory is read from /proc (VmRSS, and VmHWM: the peak) of the process concerned; a server's peak is
its own (without the same-host workers' shared-memory pages it maps), which it logs at shutdown
(kvstore/server/peakmem.py, docs/shm.md)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import ProtocolError
from tests.helpers import poll_for, python

from .conftest import unique_key

MB = 1 << 20
pytestmark = [pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc"),
              pytest.mark.timeout(60)]


def status_mb(pid: int, field: str) -> float:
    """``field`` (VmRSS, VmHWM) of process ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for pid {pid}")


def server_pid(cluster) -> int:
    return next(proc.pid for name, proc, _ in cluster.procs.procs if name == "server 0")


def own_mb(pid: int) -> float:
    """Process ``pid``'s resident memory without shared-memory pages (VmRSS - RssShmem) in MiB."""
    return status_mb(pid, "VmRSS") - status_mb(pid, "RssShmem")


def logged_own_peak_mb(cluster) -> float:
    """Server 0's own peak in MiB, from the line it logs at shutdown (call after ``cluster.close()``)."""
    log = next(path for name, _, path in cluster.procs.procs if name == "server 0").read_text()
    found = re.findall(r"MB held, peak RSS [\d.]+ MB, own ([\d.]+) MB", log)
    assert found, f"server 0 logged no peak at shutdown:\n{log[-2000:]}"
    return float(found[-1])


def test_a_worker_far_ahead_is_held_by_its_window_and_the_server_stays_bounded(make_cluster):
    """Worker 0 pushes a 32 MB key 20 rounds while worker 1 has pushed none: it is held after its
    window (2) and the server holds O(workers x window x key), not 20 rounds of 32 MB (640 MB)."""
    cluster = make_cluster("dist_sync", num_workers=2, num_servers=1, bound=1 << 30)
    kv0, kv1 = cluster.workers
    key, n, rounds = unique_key(), 8 * MB, 20  # 8 Mi float32: 32 MB
    cluster.run(lambda kv: kv.init(key, np.zeros(n, np.float32)))
    before = own_mb(server_pid(cluster))
    done = [0]

    def push_ahead() -> None:
        for r in range(rounds):
            kv0.push(key, np.full(n, r, np.float32))
            done[0] += 1

    thread = threading.Thread(target=push_ahead, daemon=True)
    thread.start()
    poll_for(lambda: kv0._window.waiting or not thread.is_alive(), 30, "worker 0 to be held or done")
    assert thread.is_alive() and done[0] == 2, f"{done[0]} pushes went out with no worker 1 push"
    for _ in range(rounds):
        kv1.push(key, np.full(n, 100, np.float32))
    thread.join(30)
    assert not thread.is_alive()
    assert np.all(kv0.pull(key) == rounds - 1 + 100)
    bound = 2 * 2 * 32 * 2  # workers x window x 32 MB, twice over for zmq's inbound queues
    cluster.close()
    grown = logged_own_peak_mb(cluster) - before  # the server's lifetime peak: at least the growth
    assert grown < bound, f"the server grew {grown:.0f} MB (bound {bound} MB)"


def test_a_push_beyond_the_window_is_refused_and_the_pusher_told(make_cluster):
    """A worker that ignores its window (its client-side limit lifted) has the third push refused:
    the refusal is raised by its next call on the key, and the key's value misses only that push."""
    cluster = make_cluster("dist_sync", num_workers=2, num_servers=1)
    kv0, kv1 = cluster.workers
    key = unique_key()
    cluster.run(lambda kv: kv.init(key, np.zeros(4, np.float32)))
    kv0._window.size = 100  # a misbehaving client
    for value in (1, 2, 3):
        kv0.push(key, np.full(4, value, np.float32))
    third = kv0._window._pending[key][-1][0]  # its refusal must come before worker 1's pushes
    with pytest.raises(ProtocolError, match="KVSTORE_PUSH_WINDOW"):
        kv0._io.wait(third, 10)
    kv1.push(key, np.full(4, 10, np.float32))
    kv1.push(key, np.full(4, 20, np.float32))
    with pytest.raises(ProtocolError, match="KVSTORE_PUSH_WINDOW"):
        kv0.pull(key)
    assert np.all(kv0.pull(key) == 22)  # rounds 1 and 2; the refused push changed nothing
    assert np.all(kv1.pull(key) == 22)


def test_orders_users_write_still_work(make_cluster):
    """Pushes of many keys then one pull each; repeated push then barrier; pushpull in a loop."""
    cluster = make_cluster("dist_sync", num_workers=2, num_servers=2)
    keys = [unique_key() for _ in range(12)]

    def script(kv) -> list[float]:
        for key in keys:
            kv.init(key, np.zeros(3, np.float32))
        for step in range(3):
            for key in keys:
                kv.push(key, np.full(3, step + 1, np.float32))
        kv.barrier()
        seen = [float(kv.pull(key)[0]) for key in keys]
        out = np.empty(3, np.float32)
        for _ in range(5):
            kv.pushpull(keys[0], np.ones(3, np.float32), out=out)
        return seen + [float(out[0])]

    for seen in cluster.run(script):
        assert seen == [6.0] * len(keys) + [2.0]


_FLOOD = """
import sys
from pathlib import Path
import numpy as np
import kvstore

def hwm():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

kv = kvstore.create("dist_async")
value = np.ones(1 << 20, np.float32)  # 4 MB
kv.init("w", value)
kv.pull("w")
base = hwm()
for _ in range(int(sys.argv[1])):
    kv.push("w", value)
print("GROWN", hwm() - base, flush=True)
print("VALUE", float(kv.pull("w")[0]), flush=True)
kv.close()
"""


def test_an_async_push_flood_keeps_the_worker_bounded(make_cluster, tmp_path: Path):
    """1,000 pushes of 4 MB without a pull used to queue 1.16 GB in the worker; with the window the
    worker's peak grows by a few pushes' worth."""
    cluster = make_cluster("dist_async", num_workers=1, num_servers=1, connect=False)
    script = tmp_path / "flood.py"
    script.write_text(_FLOOD)
    proc = cluster.procs.start("worker 0", [python(), str(script), "300"],
                               {**cluster.env, "DMLC_ROLE": "worker"})
    proc.wait(50)
    out = cluster.procs.output()
    assert proc.returncode == 0, out
    grown = float(out.split("GROWN ")[1].split()[0])
    assert grown < 64, f"the worker grew {grown:.0f} MB over 300 pushes of 4 MB\n{out}"
    assert float(out.split("VALUE ")[1].split()[0]) == 1.0

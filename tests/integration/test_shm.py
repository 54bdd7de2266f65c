"""Same-host shared memory between a worker and a server (kvstore.net.shm, docs/shm.md).

Every cluster here runs on one host, so a worker's big arrays go through its segment unless shared
memory is off or the segment is too small; values must be exact either way, and no segment may
outlive its processes, whatever killed them.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from kvstore.net import shm
from tests.helpers import poll_for, python

from .conftest import Cluster, unique_key

N = (4 << 20) // 4  # 4 MB of float32: one whole message each way (under WHOLE_CHUNKS chunks)
SHM_DIR = Path("/dev/shm")


def _exact_rounds(kv, steps: int = 2) -> None:
    """Init two 4 MB keys, then ``steps`` rounds of push then pull into outs, each checked exactly."""
    keys = [unique_key("shm"), unique_key("shm")]
    kv.init(keys, [np.zeros(N, np.float32)] * 2)
    for step in range(steps):
        kv.push(keys, [np.arange(N, dtype=np.float32) + step + i for i in range(2)])
        outs = [np.empty(N, np.float32) for _ in keys]
        kv.pull(keys, out=outs)
        for i, out in enumerate(outs):
            np.testing.assert_array_equal(out, np.arange(N, dtype=np.float32) + step + i)


def _ours() -> set[str]:
    """Entries of /dev/shm a kvstore segment could have left (none, by design)."""
    return {name for name in os.listdir(SHM_DIR) if "kvstore" in name or name.startswith("kvs")}


@pytest.mark.timeout(60)
def test_same_host_values_go_through_shared_memory_exactly(make_cluster) -> None:
    """1w1s on one host, shared memory on by default: 4 MB pushes and pulls go through the segment (both
    counters grow), come back exact, and every range of the segment is free again once the replies are
    consumed."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1)
    kv = cluster.workers[0]
    lanes = kv._io.lanes
    assert lanes is not None and list(lanes.segments) == [0]
    _exact_rounds(kv, steps=2)
    assert lanes.sent >= (2 + 2 * 2) * N * 4  # the init and both pushes of both keys
    assert lanes.received >= 2 * 2 * N * 4  # both pulls of both keys
    segment = lanes.segments[0]
    poll_for(lambda: segment.free_bytes() == segment.size - shm.HEAD, 10, "every range to be free")
    cluster.close()
    assert _ours() == set()


@pytest.mark.timeout(60)
def test_too_small_or_off_falls_back_to_tcp(make_cluster, caplog) -> None:
    """A segment too small for 4 MB values sends them over TCP, with one warning; KVSTORE_SHM=0 makes
    no segment at all; values are exact either way."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_SHM="1")
    with caplog.at_level(logging.WARNING, logger="kvstore.dist"):
        kv = cluster.connect(shm_bytes=1 << 20)[0]
        _exact_rounds(kv, steps=2)
    assert kv._io.lanes is not None and kv._io.lanes.sent == 0 and kv._io.lanes.received == 0
    fits = [r for r in caplog.records if "does not fit the free shared memory" in r.getMessage()]
    assert len(fits) == 1, [r.getMessage() for r in caplog.records]
    cluster.close()
    off: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_SHM="0")
    kv = off.connect()[0]
    assert kv._io.lanes is None
    _exact_rounds(kv, steps=1)


@pytest.mark.timeout(60)
def test_a_begun_pushpull_copies_its_value_before_it_returns(make_cluster) -> None:
    """The Trainer's overlap lends a lone value to the lanes (one copy, into the segment): a value
    changed as soon as ``_pushpull_begin`` returns still pushes what it held, through the segment and,
    with shared memory off, over TCP."""
    for env in ({}, {"KVSTORE_SHM": "0"}):
        cluster: Cluster = make_cluster("dist_sync", 1, 1, **env)
        kv = cluster.workers[0]
        key, value, out = unique_key("lent"), np.arange(N, dtype=np.float32), np.empty(N, np.float32)
        kv.init(key, np.zeros(N, np.float32))
        sent = 0 if kv._io.lanes is None else kv._io.lanes.sent
        finish = kv._pushpull_begin([key], [value], [out])
        value[:] = -1  # the caller's memory changes at once
        finish()
        np.testing.assert_array_equal(out, np.arange(N, dtype=np.float32))
        if not env:
            assert kv._io.lanes.sent >= sent + N * 4  # through the segment
        cluster.close()


def _chunked_round(kv, n: int) -> tuple[int, int]:
    """Init, push and pull one ``n``-float value, checked exactly; the bytes the lanes sent and received."""
    key, out = unique_key("chunked"), np.empty(n, np.float32)
    kv.init(key, np.zeros(n, np.float32))
    kv.push(key, np.arange(n, dtype=np.float32))
    kv.pull(key, out=out)
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32))
    return kv._io.lanes.sent, kv._io.lanes.received


@pytest.mark.timeout(60)
def test_a_chunked_value_goes_through_the_segment_whole_or_over_tcp_whole(make_cluster) -> None:
    """A 12 MB value (2 MiB chunks: its init, its push; its pull is one reply) goes through a 64 MiB
    segment whole, and over TCP whole with an 8 MiB one; exact either way."""
    n = (12 << 20) // 4
    roomy: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_SHM="1")
    assert _chunked_round(roomy.connect(shm_bytes=64 << 20)[0], n) == (2 * n * 4, n * 4)
    roomy.close()
    tight: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_SHM="1")
    assert _chunked_round(tight.connect(shm_bytes=8 << 20)[0], n) == (0, 0)
    tight.close()


WORKER = """
import os, threading, numpy as np
from kvstore import config
from kvstore.client.store import DistKVStore
kv = DistKVStore("dist_sync", config.load())
kv.init("w", np.zeros({n}, np.float32))
kv.push("w", np.ones({n}, np.float32))
out = np.empty({n}, np.float32)
kv.pull("w", out=out)
assert (out == 1).all()
open({ready!r}, "w").write(str(kv._io.lanes.sent if kv._io.lanes else 0))
threading.Event().wait(60)  # until the test kills it
"""


@pytest.mark.timeout(60)
def test_no_segment_outlives_a_sigkill_of_every_role(make_cluster, tmp_path: Path) -> None:
    """A worker process and its server both map the segment; after SIGKILL of the worker, the server
    and the scheduler, nothing of it is left in /dev/shm (a memfd has no name there)."""
    before = _ours()
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_SHM="1")
    ready = tmp_path / "ready"
    cluster.procs.start("worker 0", [python(), "-c", WORKER.format(n=N, ready=str(ready))],
                        {**cluster.env, "DMLC_ROLE": "worker"})
    poll_for(lambda: ready.exists() and ready.read_text(), 40, "the worker's push and pull")
    assert int(ready.read_text()) >= 2 * N * 4  # the init and the push went through the segment
    pids = {name: proc.pid for name, proc, _ in cluster.procs.procs}
    maps = Path(f"/proc/{pids['server 0']}/maps").read_text()
    assert "memfd:kvstore-shm" in maps  # the server really maps the worker's segment
    for name in ("worker 0", "server 0", "scheduler"):
        os.kill(pids[name], signal.SIGKILL)
    for _, proc, _ in cluster.procs.procs:
        proc.wait(10)
    assert _ours() - before == set()

"""``priority`` through real processes: the order a server sees a worker's requests arrive in.

The servers log each data request as it arrives (``KVSTORE_TEST_ARRIVALS``, a test hook installed
only when set).  A 64 MB value travels in 2 MiB chunks; the chunks beyond a call's first
``Mux.pace_bytes`` wait in the worker's outbox, so a later request of higher priority goes between
them, while call order holds between requests of one key and between requests of equal priority.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .conftest import unique_key

BIG = 16 << 20  # float32 elements: 64 MB


def _arrivals(log: Path, op: str) -> list[list[str]]:
    """The keys of each ``op`` request the server logged, in arrival order."""
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [line["keys"] for line in lines if line["op"] == op]


def test_a_small_urgent_push_overtakes_a_big_pushs_chunks(make_cluster, tmp_path: Path) -> None:
    """A 64 MB push at priority 0 then a 4-byte push at priority 10: the server sees the small key
    before the big value's last chunk, and both values arrive whole."""
    log = tmp_path / "arrivals.jsonl"
    cluster = make_cluster("dist_sync", 1, 1, bound=1 << 30, KVSTORE_TEST_ARRIVALS=str(log))
    kv = cluster.workers[0]
    big, small = unique_key("big"), unique_key("small")
    kv.init([big, small], [np.zeros(BIG, np.float32), np.zeros(1, np.float32)])
    kv.push(big, np.full(BIG, 3, np.float32), priority=0)
    kv.push(small, np.full(1, 7, np.float32), priority=10)
    assert kv.pull(small).tolist() == [7.0]
    assert np.array_equal(kv.pull(big), np.full(BIG, 3, np.float32))
    pushes = _arrivals(log, "PUSH")
    chunks = [i for i, keys in enumerate(pushes) if keys == [big]]
    assert len(chunks) == BIG * 4 // (2 << 20)  # 2 MiB chunks (KVSTORE_CHUNK_BYTES)
    assert pushes.index([small]) < chunks[-1]


def test_equal_priorities_and_one_keys_requests_keep_call_order(make_cluster, tmp_path: Path) -> None:
    """At equal priority a small push issued after a 64 MB one arrives after its last chunk; a pull of
    the big key at priority 10 right after its push (dist_async: answered at once) still sees it."""
    log = tmp_path / "arrivals.jsonl"
    cluster = make_cluster("dist_async", 1, 1, bound=1 << 30, KVSTORE_TEST_ARRIVALS=str(log))
    kv = cluster.workers[0]
    big, small = unique_key("big"), unique_key("small")
    kv.init([big, small], [np.zeros(BIG, np.float32), np.zeros(1, np.float32)])
    kv.push(big, np.full(BIG, 3, np.float32))
    kv.push(small, np.full(1, 7, np.float32))
    assert np.array_equal(kv.pull(big, priority=10), np.full(BIG, 3, np.float32))
    assert kv.pull(small).tolist() == [7.0]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    order = [(line["op"], line["keys"]) for line in lines]
    last_chunk = max(i for i, entry in enumerate(order) if entry == ("PUSH", [big]))
    assert order.index(("PUSH", [small])) > last_chunk
    assert order.index(("PULL", [big])) > last_chunk

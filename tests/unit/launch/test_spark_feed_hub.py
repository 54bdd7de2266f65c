"""kvstore.launch.spark_feed's hub over real local sockets, no Spark: dealing and its handshake."""

from __future__ import annotations

import threading
import time

from kvstore.launch import spark_feed as feed

SECRET = "s3cret"


def _run_epoch(num_workers: int, batch_size: int, rows: int, timeout: float) -> dict:
    """One epoch of ``rows`` rows through a hub to ``num_workers`` workers whose every batch is a
    collective step (a barrier, as a dist_sync pushpull is); returns what each worker saw."""
    hub = feed.FeedHub(SECRET, num_workers, 1, batch_size, timeout)
    spec = feed.FeedSpec("127.0.0.1", hub.port, 1, batch_size, timeout, (feed.Column("x", "<i8"),),
                         max(batch_size, 1024))
    hub.begin_epoch(0)
    step = threading.Barrier(num_workers, timeout=timeout * 3)
    out: dict = {}

    def worker(rank: int) -> None:
        got: list[int] = []
        try:
            worker_feed = feed.WorkerFeed(spec, SECRET, rank)
            for epoch in worker_feed:
                for batch in epoch:
                    got.extend(int(v) for v in batch["x"])
                    step.wait()
            worker_feed.close()
            out[rank] = got
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[rank] = exc
            step.abort()

    def feeder() -> None:
        try:
            out["feeder"] = list(feed.feed_partition(spec, SECRET, 0, 0, ((i,) for i in range(rows))))
            out["dealt"] = hub.end_epoch(0)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["feeder"] = exc

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(num_workers)]
    threads.append(threading.Thread(target=feeder))
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout * 4)
    finally:
        hub.close()
    return out


def test_small_batches_with_a_collective_per_step_do_not_deadlock() -> None:
    """Batches of 32 rows in 1024-row chunks, every step a collective: each worker gets its share, every
    row once, shares within one row (the hub never blocks on one rank while another has no batch)."""
    started = time.monotonic()
    out = _run_epoch(2, 32, 4096 + 3, timeout=3.0)
    assert not isinstance(out.get("feeder"), Exception), out.get("feeder")
    got = [out[0], out[1]]
    assert all(isinstance(rows, list) for rows in got), got
    assert sorted(got[0] + got[1]) == list(range(4096 + 3))
    assert abs(len(got[0]) - len(got[1])) <= 1
    assert out["dealt"] == 4096 + 3
    assert time.monotonic() - started < 3.0


def test_three_workers_tiny_batches_get_every_row_once() -> None:
    """Three workers, batches of 5 rows: every row once, shares within one row, no deadlock."""
    out = _run_epoch(3, 5, 2500, timeout=3.0)
    got = [out[r] for r in range(3)]
    assert all(isinstance(rows, list) for rows in got), got
    assert sorted(sum(got, [])) == list(range(2500))
    assert max(map(len, got)) - min(map(len, got)) <= 1

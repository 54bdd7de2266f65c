"""kvstore.launch.spark_feed's hub over real local sockets, no Spark: dealing and its handshake."""

from __future__ import annotations

import socket
import struct
import threading
import time

from kvstore.launch import spark_feed as feed
from tests.helpers import read_exactly

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


def _stranger(port: int) -> socket.socket:
    """A connection without the secret that has read the hub's nonce frame."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    (size,) = struct.unpack("<I", _read(conn, 4))
    _read(conn, size)
    return conn


def _read(conn: socket.socket, size: int) -> bytes:
    return read_exactly(conn, size, "closed")


def _closed_by_hub(conn: socket.socket, within: float) -> bool:
    """Whether the hub closes ``conn`` within ``within`` seconds (data it sends first is skipped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not conn.recv(4096):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def test_a_hello_over_the_small_limit_is_refused_before_its_body() -> None:
    """A stranger announcing a 200 MiB hello is cut off at once: the hub does not read (or allocate) it."""
    hub = feed.FeedHub(SECRET, 2, 1, 32, 60.0)
    try:
        conn = _stranger(hub.port)
        conn.sendall(struct.pack("<I", 200 << 20) + b"\0" * 4096)
        assert _closed_by_hub(conn, 3.0)
        conn.close()
    finally:
        hub.close()


def test_a_silent_stranger_is_dropped_at_the_handshake_deadline(monkeypatch) -> None:
    """A connection that never answers the nonce is closed after the handshake deadline, not feed_timeout."""
    monkeypatch.setattr(feed, "HANDSHAKE_SECONDS", 0.3)
    hub = feed.FeedHub(SECRET, 2, 1, 32, 60.0)
    try:
        conn = _stranger(hub.port)
        assert _closed_by_hub(conn, 3.0)
        conn.close()
    finally:
        hub.close()


JUNK = (b"\x05\0\0\0notmp", struct.pack("<I", 3) + b"\x93\1\2", struct.pack("<I", 1) + b"\x80",
        struct.pack("<I", 2) + b"\x81\xc1", b"\xff\xff")  # not msgpack, a list, a map without mac, ...


def test_junk_from_strangers_and_a_full_handshake_cap_do_not_stop_the_hub(monkeypatch) -> None:
    """Past the cap of unauthenticated connections a stranger is answered busy and closed; junk hellos
    are dropped; a real worker (retrying while the cap is full) and feeder still run an epoch."""
    monkeypatch.setattr(feed, "HANDSHAKE_SECONDS", 0.5)
    monkeypatch.setattr(feed, "MAX_HANDSHAKES", 2)
    hub = feed.FeedHub(SECRET, 1, 1, 4, 5.0)
    spec = feed.FeedSpec("127.0.0.1", hub.port, 1, 4, 5.0, (feed.Column("x", "<i8"),), 1024)
    try:
        held = [_stranger(hub.port), _stranger(hub.port)]
        refused = socket.create_connection(("127.0.0.1", hub.port), timeout=5.0)
        assert _closed_by_hub(refused, 3.0)  # no nonce: closed at once
        refused.close()
        worker = feed.WorkerFeed(spec, SECRET, 0)  # retries until a stranger's handshake deadline passes
        for conn in held:
            conn.close()
        for junk in JUNK:
            junky = _stranger(hub.port)
            junky.sendall(junk)
            assert _closed_by_hub(junky, 3.0)
            junky.close()
        hub.begin_epoch(0)
        assert list(feed.feed_partition(spec, SECRET, 0, 0, ((i,) for i in range(10)))) == [10]
        hub.end_epoch(0)
        rows = [int(v) for epoch in worker for batch in epoch for v in batch["x"]]
        worker.close()
        assert rows == list(range(10))
    finally:
        hub.close()

"""A peer offering a server shared memory cannot kill it, make it write where the peer may not, or
make it hold memory (issue 38; docs/shm.md#what-a-server-checks).

Each test is a hand-made peer holding the cluster's secret and session (a DEALER of its own, as any
worker could be): it offers the live server descriptors of its choosing with SHM_ATTACH and sends
pushes that name ranges in them, and the server must refuse what it cannot map safely, with a
reason, and keep serving.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvstore.client import shmlanes
from kvstore.net import shm
from kvstore.net.protocol import PROTOCOL_VERSION, Message, Op
from tests.helpers import poll_for, python

from .conftest import Cluster, insider, unique_key

SEG_BYTES = 2 << 20
N = 1024  # float32 elements of the key the attacks push to (4 KiB)


class Peer:
    """A DEALER to server 0 that seals as an insider, and the server's process (checked alive)."""

    def __init__(self, cluster: Cluster, label: str) -> None:
        kv = cluster.workers[0]
        self.channel = insider(kv, label)
        self.proc = next(p for name, p, _ in cluster.procs.procs if name == "server 0")
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(kv._cluster.servers[0])
        self._seq = 100

    def ask(self, msg: Message) -> Message:
        """Send ``msg`` sealed for server 0; its reply (OK or ERROR) within 10 s.  Fails the test when
        the server exits meanwhile, naming the signal that ended it."""
        self._seq += 1
        msg.seq, msg.sender = self._seq, 0
        return self._reply(self.channel.seal(msg, "server0"), msg.seq, msg.op.name)

    def _reply(self, frames: list[Any], seq: int, what: str) -> Message:
        self.sock.send_multipart(frames)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            code = self.proc.poll()
            assert code is None, f"the server exited with status {code} (a negative status is a signal)"
            if self.sock.poll(50):
                reply = self.channel.open(self.sock.recv_multipart())
                if reply.seq == seq:
                    return reply
        raise AssertionError(f"the server did not answer {what} within 10 s")

    def attach(self, body: dict[str, Any]) -> tuple[bool, str]:
        """Offer ``body`` (SHM_ATTACH); whether the server mapped it, and why not."""
        reply = self.ask(Message(Op.SHM_ATTACH, body))
        assert reply.op is Op.OK, reply.body
        return reply.body["attached"], reply.body["why"]

    def push_from(self, key: str, off: int, elements: int) -> Message:
        """A PUSH of ``key`` whose one array of ``elements`` float32 lies at ``off`` in the segment
        (the header made by hand: encoding an array of that size would allocate it here)."""
        self._seq += 1
        header = {"v": PROTOCOL_VERSION, "op": int(Op.PUSH), "seq": self._seq, "sender": 0,
                  "auth": [self.channel.label, next(self.channel._counter), "server0"],
                  "body": {"keys": [key], "sizes": [elements]}, "arrays": [["float32", [elements]]],
                  "shm": [off]}
        frames = [msgpack.packb(header, use_bin_type=True), b""]
        return self._reply([self.channel._mac(frames), *frames], self._seq, "PUSH")

    def close(self) -> None:
        self.sock.close()


def _body(fd: int, size: int, pid: int | None = None) -> dict[str, Any]:
    """An SHM_ATTACH body for ``fd`` of this process (or ``pid``'s), its nonce written at its start."""
    nonce = os.urandom(shm.NONCE_BYTES)
    os.pwrite(fd, nonce, 0)
    return {"pid": pid or os.getpid(), "fd": fd, "nonce": nonce, "bytes": size}


def _status(pid: int) -> dict[str, int]:
    """``/proc/<pid>/status``'s memory fields, in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssShmem")}


@pytest.fixture
def served(make_cluster):
    """A dist_async 1w1s cluster holding a 4 KiB key, and a hand-made peer of its server."""
    cluster: Cluster = make_cluster("dist_async", 1, 1, KVSTORE_SHM="1")
    key = unique_key("attacked")
    cluster.workers[0].init(key, np.zeros(N, np.float32))
    peer = Peer(cluster, "attacker")
    yield cluster, peer, key
    peer.close()


@pytest.mark.timeout(60)
def test_a_segment_truncated_after_its_offer_cannot_kill_the_server(served) -> None:
    """An unsealed memfd is refused with a reason naming the seals, so truncating it and pushing from
    past its new end gets an ERROR, not a SIGBUS: the server lives and serves the worker."""
    cluster, peer, key = served
    fd = os.memfd_create("attack", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, SEG_BYTES)
        attached, why = peer.attach(_body(fd, SEG_BYTES))
        os.ftruncate(fd, shm.HEAD)  # keeps only the nonce's page
        reply = peer.push_from(key, SEG_BYTES // 2, N)
    finally:
        os.close(fd)
    assert not attached and "seal" in why, why
    assert reply.op is Op.ERROR
    np.testing.assert_array_equal(cluster.workers[0].pull(key), np.zeros(N, np.float32))


@pytest.mark.timeout(60)
def test_a_sealed_segment_cannot_be_truncated_under_the_server(served) -> None:
    """The worker's own segment (kvstore.net.shm.Segment) is accepted, and sealed: truncating or
    growing it fails in the worker, so no push can name a page that is gone."""
    _, peer, key = served
    seg = shm.Segment(SEG_BYTES)
    try:
        assert peer.attach(seg.attach_body()) == (True, "")
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, shm.HEAD)
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 2 * SEG_BYTES)
        assert peer.push_from(key, shm.HEAD, N).op is Op.OK
    finally:
        seg.close_fd()


@pytest.mark.timeout(60)
def test_descriptors_that_are_not_a_sealed_memfd_are_refused_with_a_reason(served, tmp_path) -> None:
    """A regular file, a tmpfs file in /dev/shm and a pipe, each offered with the nonce and size it
    holds, are refused with a reason; the server answers each and lives."""
    _, peer, _ = served
    reasons = []
    with open(tmp_path / "plain", "w+b") as plain, tempfile.TemporaryFile(dir="/dev/shm") as tmpfs:
        for fh in (plain, tmpfs):
            os.ftruncate(fh.fileno(), SEG_BYTES)
            reasons.append(peer.attach(_body(fh.fileno(), SEG_BYTES)))
    r, w = os.pipe()
    try:
        reasons.append(peer.attach({"pid": os.getpid(), "fd": r, "nonce": bytes(16), "bytes": SEG_BYTES}))
    finally:
        os.close(r)
        os.close(w)
    assert [attached for attached, _ in reasons] == [False] * 3, reasons
    assert all("memfd" in why for _, why in reasons), reasons


@pytest.mark.timeout(60)
def test_a_read_only_descriptor_is_never_written(served) -> None:
    """A sealed memfd the peer holds only read-only is refused (the server writes pull replies into a
    segment), so the server never reopens it read-write."""
    _, peer, _ = served
    seg = shm.Segment(SEG_BYTES)
    ro = os.open(f"/proc/self/fd/{seg.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        body = {**seg.attach_body(), "fd": ro}
        attached, why = peer.attach(body)
    finally:
        os.close(ro)
        seg.close_fd()
    assert not attached and "read-only" in why, why


@pytest.mark.timeout(60)
def test_a_push_declaring_more_than_its_key_is_refused_before_any_copy(served) -> None:
    """Pushes from a sparse sealed segment declaring 1 GiB (over the frame limit), 8 MiB for a 4 KiB
    key, or 4 KiB for a key the server does not hold, are refused before the server reads a page of
    the segment: its shared pages do not grow, its RSS grows by under 64 MB."""
    _, peer, key = served
    seg = shm.Segment((1 << 30) + shm.HEAD)
    try:
        assert peer.attach(seg.attach_body()) == (True, "")
        before = _status(peer.proc.pid)
        replies = [peer.push_from(key, shm.HEAD, (1 << 30) // 4), peer.push_from(key, shm.HEAD, 2 << 20),
                   peer.push_from(unique_key("unheld"), shm.HEAD, N)]
        after = _status(peer.proc.pid)
    finally:
        seg.close_fd()
    assert [reply.op for reply in replies] == [Op.ERROR] * 3, [reply.body for reply in replies]
    assert after["RssShmem"] - before["RssShmem"] < 1 << 20, (before, after)
    assert after["VmRSS"] - before["VmRSS"] < 64 << 20, (before, after)


def _maps_inode(pid: int, inode: int) -> bool:
    """Whether process ``pid`` maps the memfd of ``inode``."""
    return any(len(f) >= 6 and f[4] == str(inode) and f[5].startswith("/memfd:")
               for f in (line.split() for line in Path(f"/proc/{pid}/maps").read_text().splitlines()))


HOLDER = """
import sys, threading
from kvstore.net import shm
seg = shm.Segment({size})
body = seg.attach_body()
open({out!r}, "w").write(" ".join([str(body["pid"]), str(body["fd"]), body["nonce"].hex()]))
threading.Event().wait(60)  # until the test kills it
"""


@pytest.mark.timeout(60)
def test_a_departed_peers_segment_is_unmapped(served, tmp_path: Path) -> None:
    """A peer process that maps a segment, has the server copy 4 MiB out of it, then dies without
    LEAVE: the server unmaps the segment (its pages leave the server) and keeps serving."""
    cluster, peer, key = served
    big = unique_key("departed")
    cluster.workers[0].init(big, np.zeros((4 << 20) // 4, np.float32))
    out = tmp_path / "holder"
    holder = cluster.procs.start("holder", [python(), "-c", HOLDER.format(size=8 << 20, out=str(out))], {})
    poll_for(lambda: out.exists() and out.read_text(), 30, "the holder's segment")
    pid, fd, nonce = out.read_text().split()
    body = {"pid": int(pid), "fd": int(fd), "nonce": bytes.fromhex(nonce), "bytes": 8 << 20}
    inode = os.stat(f"/proc/{pid}/fd/{fd}").st_ino  # the worker's own segment is mapped there too
    assert peer.attach(body) == (True, "")
    assert peer.push_from(big, shm.HEAD, (4 << 20) // 4).op is Op.OK
    assert _maps_inode(peer.proc.pid, inode)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    poll_for(lambda: not _maps_inode(peer.proc.pid, inode), 10, "the server to unmap the segment")
    assert peer.proc.poll() is None
    np.testing.assert_array_equal(cluster.workers[0].pull(key), np.zeros(N, np.float32))


@pytest.mark.timeout(60)
def test_a_worker_whose_offer_is_refused_goes_over_tcp_with_one_log_line(make_cluster, monkeypatch,
                                                                          caplog) -> None:
    """A worker offering an unsealed segment (as one before issue 38 would) is refused with a reason;
    it says so in one log line and its values go over TCP, exact."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, connect=False, KVSTORE_SHM="1")
    monkeypatch.setattr(shmlanes.shm, "Segment", functools.partial(shm.Segment, seals=0))
    with caplog.at_level(logging.INFO, logger="kvstore.dist"):
        kv = cluster.connect()[0]
    assert kv._io.lanes is None
    lines = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
    assert len(lines) == 1 and "not used with server(s) [0]" in lines[0] and "seal" in lines[0], lines
    key, n = unique_key("tcp"), (4 << 20) // 4
    kv.init(key, np.zeros(n, np.float32))
    kv.push(key, np.arange(n, dtype=np.float32))
    np.testing.assert_array_equal(kv.pull(key), np.arange(n, dtype=np.float32))

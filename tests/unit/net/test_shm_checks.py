"""What a server checks before it maps a peer's segment or reads it (kvstore.net.shm, issue 38), on
real memfds, files and processes."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import ProtocolError
from kvstore.net import protocol, shm
from kvstore.net.protocol import Message, Op

SIZE = 1 << 20


@pytest.fixture
def segment():
    seg = shm.Segment(SIZE)
    yield seg
    seg.close_fd()


def _refused(body: dict) -> str:
    mapping, why = shm.open_mapping(body)
    assert mapping is None
    return why


@pytest.mark.timeout(10)
def test_a_segment_is_sealed_against_shrinking_and_growing(segment) -> None:
    """A worker's segment carries F_SEAL_SHRINK, F_SEAL_GROW and F_SEAL_SEAL: its size cannot change,
    and no seal can be added or removed."""
    assert fcntl.fcntl(segment.fd, fcntl.F_GET_SEALS) == shm.OFFERED_SEALS
    for size in (shm.HEAD, 2 * segment.size):
        with pytest.raises(PermissionError):
            os.ftruncate(segment.fd, size)
    with pytest.raises(PermissionError):
        fcntl.fcntl(segment.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)


@pytest.mark.timeout(10)
def test_a_memfd_without_both_size_seals_is_refused() -> None:
    """Unsealed, or sealed against shrinking only or growing only: refused, naming the seals."""
    for seals in (0, fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL):
        seg = shm.Segment(SIZE, seals=seals)
        try:
            assert "not sealed against shrinking and growing" in _refused(seg.attach_body())
        finally:
            seg.close_fd()


@pytest.mark.timeout(10)
def test_files_that_are_not_memfds_are_refused_before_they_are_opened(tmp_path) -> None:
    """A regular file with the nonce and the size, and a pipe, are refused as not a memfd."""
    nonce = os.urandom(shm.NONCE_BYTES)
    with open(tmp_path / "file", "w+b") as fh:
        fh.write(nonce)
        fh.truncate(SIZE)
        fh.flush()
        body = {"pid": os.getpid(), "fd": fh.fileno(), "nonce": nonce, "bytes": SIZE}
        assert "not a memfd" in _refused(body)
    r, w = os.pipe()
    try:
        assert "'pipe:" in _refused({**body, "fd": r}) and "not a memfd" in _refused({**body, "fd": w})
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.timeout(10)
def test_a_descriptor_held_read_only_or_write_only_is_refused(segment) -> None:
    """The same sealed memfd, held by the peer read-only or write-only, is refused naming the mode:
    a server never opens a peer's file for more than the peer holds it for."""
    body = segment.attach_body()
    for flags, mode in ((os.O_RDONLY, "read-only"), (os.O_WRONLY, "write-only")):
        fd = os.open(f"/proc/self/fd/{segment.fd}", flags | os.O_CLOEXEC)
        try:
            assert f"holds the memfd {mode}" in _refused({**body, "fd": fd})
        finally:
            os.close(fd)
    assert shm.open_mapping(body)[1] == ""  # read-write: mapped


@pytest.mark.timeout(10)
def test_another_size_or_huge_pages_are_refused(segment) -> None:
    """A body declaring another size than the memfd's is refused; so is a memfd of huge pages (a
    fault there raises SIGBUS when the pool is empty), where this kernel makes one."""
    assert "not the" in _refused({**segment.attach_body(), "bytes": segment.size + shm.HEAD})
    try:
        fd = os.memfd_create("huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    except OSError:
        pytest.skip("no MFD_HUGETLB here")
    try:
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, shm.OFFERED_SEALS)
        body = {"pid": os.getpid(), "fd": fd, "nonce": bytes(shm.NONCE_BYTES), "bytes": 2 << 20}
        assert "huge pages" in _refused(body)
    finally:
        os.close(fd)


def _push(off: int, elements: int) -> list:
    """The frames of a PUSH of one float32 array of ``elements`` at ``off`` in a segment."""
    array = np.zeros(elements, np.float32)
    return protocol.encode(Message(Op.PUSH, {"keys": ["k"], "sizes": [elements]}, [array], shm=[off]))


@pytest.mark.timeout(10)
def test_arrays_are_views_until_settled_and_copied_only_when_the_check_accepts(segment) -> None:
    """Decoding yields a view of the segment (nothing read); settle copies it out only when the
    check passes (a refused request reads no page); the resolver refuses an array over the limit."""
    grown: list[int] = []
    peers = shm.ServerPeers(lambda: grown.append(1), max_array_bytes=256 << 10)
    assert peers.attach(b"w", segment.attach_body()) == (True, "")
    segment.write(shm.HEAD, np.arange(1024, dtype=np.float32))
    msg = protocol.decode(_push(shm.HEAD, 1024), peers.resolver(b"w"))
    assert np.shares_memory(msg.arrays[0], peers._maps[b"w"].map)  # a view, not a copy

    def refuse(_msg: Message) -> None:
        raise ProtocolError("no such key")
    with pytest.raises(ProtocolError, match="no such key"):
        peers.settle(b"w", msg, refuse)
    assert grown == [] and peers._maps[b"w"].reach == shm.HEAD  # no page was read
    peers.settle(b"w", msg, lambda _msg: None)
    assert not np.shares_memory(msg.arrays[0], peers._maps[b"w"].map)
    np.testing.assert_array_equal(msg.arrays[0], np.arange(1024, dtype=np.float32))
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(_push(shm.HEAD, (64 << 10) + 1), peers.resolver(b"w"))  # 4 bytes over


HOLDER = ("import sys, threading; from kvstore.net import shm; seg = shm.Segment(1 << 20); "
          "b = seg.attach_body(); print(b['pid'], b['fd'], b['nonce'].hex(), flush=True); "
          "threading.Event().wait(30)")


@pytest.mark.timeout(30)
def test_a_sweep_unmaps_the_segment_of_a_process_that_is_gone(monkeypatch) -> None:
    """A segment offered by another process stays mapped while it lives and is unmapped by the first
    sweep after it is killed."""
    monkeypatch.setattr(shm, "SWEEP_SECONDS", 0.0)
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        pid, fd, nonce = child.stdout.readline().split()
        peers = shm.ServerPeers()
        body = {"pid": int(pid), "fd": int(fd), "nonce": bytes.fromhex(nonce), "bytes": 1 << 20}
        assert peers.attach(b"w", body) == (True, "")
        assert peers.sweep() == 0 and peers.resolver(b"w") is not None
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    assert peers.sweep() == 1 and peers.resolver(b"w") is None


def test_without_fcntl_kvstore_imports_and_shared_memory_is_off() -> None:
    """A platform without fcntl (no sealing) still imports kvstore and creates a store; shared memory
    is unusable there, with the reason, so every pair stays on TCP."""
    code = ("import sys; sys.modules['fcntl'] = None\n"
            "import kvstore\n"
            "from kvstore.config import Config\n"
            "from kvstore.net import shm\n"
            "kvstore.create('local')\n"
            "print(shm.unusable(Config()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "seal" in done.stdout

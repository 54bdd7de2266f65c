"""kvstore.net.shm's segments and the protocol's shared-memory fields, on real memfd segments."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kvstore.errors import ProtocolError
from kvstore.net import protocol, shm
from kvstore.net.protocol import Message, Op
from kvstore.server.peakmem import PeakMemory


@pytest.fixture
def segment():
    seg = shm.Segment(1 << 20)
    yield seg
    seg.close_fd()


@pytest.mark.timeout(10)
def test_ranges_are_taken_freed_and_merged(segment) -> None:
    """Ranges are page-aligned, None when none fits, and freed ranges merge back into one."""
    room = segment.size - shm.HEAD
    a, b = segment.take(5000), segment.take(room - 2 * 4096)
    assert a == shm.HEAD and b == shm.HEAD + 8192 and segment.take(4096) is None
    segment.give(a)
    segment.give(b)
    assert segment.free_bytes() == room and segment.take(room) == shm.HEAD


@pytest.mark.timeout(10)
def test_a_reply_range_is_freed_by_its_last_view(segment) -> None:
    """A range lent to a reply stays taken after its request ends, until the last array viewing it
    is gone; a range not reserved for a reply is refused."""
    off = segment.take(8192, reply=True)
    with pytest.raises(ProtocolError, match="did not reserve"):
        segment.lend(off + 4096, 4096)
    array = np.frombuffer(segment.lend(off, 8192), np.float32).reshape(2, -1)[1:]
    segment.give(off)  # the request is answered: its reply's array still views the range
    assert segment.free_bytes() == segment.size - shm.HEAD - 8192
    del array
    gc.collect()
    assert segment.free_bytes() == segment.size - shm.HEAD


@pytest.mark.timeout(10)
def test_a_server_maps_only_the_segment_with_the_nonce(segment) -> None:
    """open_mapping maps the worker's segment through /proc and reads and writes its bytes; a wrong
    nonce, a descriptor that does not exist and a malformed body are refused with a reason."""
    body = segment.attach_body()
    mapping, why = shm.open_mapping(body)
    assert why == "" and mapping is not None
    segment.write(shm.HEAD, np.arange(4, dtype=np.int64))
    assert np.frombuffer(mapping.copy_out(shm.HEAD, 32), np.int64).tolist() == [0, 1, 2, 3]
    mapping.write(2 * shm.HEAD, 16, np.array([7, 8], np.int64))
    assert np.frombuffer(segment.map, np.int64, 2, 2 * shm.HEAD).tolist() == [7, 8]
    with pytest.raises(ProtocolError, match="outside"):
        mapping.copy_out(segment.size - 8, 16)
    mapping.close()
    assert shm.open_mapping({**body, "nonce": bytes(16)})[1].endswith("another host")
    assert "cannot be opened" in shm.open_mapping({**body, "fd": 10**6})[1]
    assert shm.open_mapping({**body, "pid": "1"}) == (None, "a malformed SHM_ATTACH body")


@pytest.mark.timeout(10)
def test_arrays_in_shared_memory_decode_only_through_a_resolver() -> None:
    """An array marked in ``shm`` travels as an empty frame and decodes through the resolver; without
    one, with a non-empty frame or a bad reply_at, decoding raises ProtocolError."""
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    frames = protocol.encode(Message(Op.PUSH, {}, [value], shm=[4096], reply_at=[8192, 24]))
    assert bytes(frames[1]) == b""
    got = protocol.decode(frames, lambda off, n: memoryview(value.tobytes()) if off == 4096 else b"")
    np.testing.assert_array_equal(got.arrays[0], value)
    assert got.shm == [4096] and got.reply_at == [8192, 24]
    with pytest.raises(ProtocolError, match="shares no segment"):
        protocol.decode(frames)
    with pytest.raises(ProtocolError, match="empty frame"):
        protocol.decode([frames[0], value.tobytes()], lambda off, n: value.tobytes())
    bad = protocol.encode(Message(Op.PULL, {}, reply_at=[8192, 0]))
    with pytest.raises(ProtocolError, match="reply_at"):
        protocol.decode(bad)


def _own_now() -> int:
    """This process's resident bytes without shared-memory pages (VmRSS - RssShmem)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status", encoding="ascii"))
    return (int(fields["VmRSS"].split()[0]) - int(fields["RssShmem"].split()[0])) * 1024


@pytest.mark.timeout(30)
def test_a_servers_own_peak_counts_its_copy_and_not_the_segment_pages() -> None:
    """Copying 64 MB out of a worker's segment checkpoints PeakMemory before each 16 MiB step past
    what the mapping touched and once after; its own peak counts the 64 MB copy, not the 64 MB of
    segment pages the mapping brought into this process's RSS, which the total counts."""
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("/proc/self/clear_refs cannot be written here")
    nbytes = 64 << 20
    seg = shm.Segment(nbytes + shm.HEAD)
    seg.write(shm.HEAD, np.ones(nbytes, np.uint8))  # the worker's pages exist before the server maps them
    memory, calls = PeakMemory(), []
    memory.checkpoint()
    memory.total = memory.own = 0  # this test's interval only, not the process's earlier peak
    before = _own_now()
    mapping, _ = shm.open_mapping(seg.attach_body(), lambda: (calls.append(1), memory.checkpoint()))
    seg.close_fd()
    assert bytes(mapping.copy_out(shm.HEAD, nbytes)[-2:]) == b"\x01\x01"  # the copy is gone after this
    mapping.copy_out(shm.HEAD, nbytes // 2)  # below what the mapping touched: no checkpoint
    total, own = memory.report()
    assert len(calls) == nbytes // shm.GROW_STEP + 1
    assert before + 0.9 * nbytes <= own <= before + nbytes + shm.GROW_STEP + (8 << 20), (before, own)
    assert total - own >= 1.5 * nbytes  # the segment pages, mapped twice in this one process, are in total
    mapping.close()

"""kvstore.client.shmlanes' choice of what goes through a segment, on real memfd segments."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.shmlanes import Lanes
from kvstore.net import shm
from kvstore.net.protocol import Message, Op

CHUNK = 256 << 10


def _chunk(lanes: Lanes, lo: int, piece: int) -> bool:
    """Place one CHUNK-byte chunk at byte ``lo`` of a ``piece``-byte piece; whether it used the segment."""
    msg = Message(Op.PUSH, {}, [np.ones(CHUNK, np.uint8)])
    release = lanes.place(0, msg, chunk=(lo, piece))
    if release is not None:
        release(None)
    return msg.shm is not None


@pytest.mark.timeout(10)
def test_a_piece_goes_through_the_segment_whole_or_over_tcp_whole() -> None:
    """Every chunk of a piece that fits the segment's free part when its first chunk leaves goes
    through it; no chunk of one that does not fit does, even once ranges are free again."""
    segment = shm.Segment(1 << 20)
    try:
        lanes = Lanes({0: segment})
        fits, big = 3 * CHUNK, 5 * CHUNK  # the free part: 1 MiB less the nonce's page
        assert all(_chunk(lanes, lo, fits) for lo in range(0, fits, CHUNK))
        assert not any(_chunk(lanes, lo, big) for lo in range(0, big, CHUNK))
        assert _chunk(lanes, 0, CHUNK) and lanes.sent == 4 * CHUNK
    finally:
        segment.close_fd()


@pytest.mark.timeout(10)
def test_a_segment_that_cannot_be_made_leaves_no_descriptor_of_the_others(monkeypatch) -> None:
    """attach makes one segment per server; when one cannot be made (no memory, no sealing), the
    descriptors of those already made are closed and shared memory is off (None)."""
    import contextlib
    import gc
    import os

    from kvstore import config
    from kvstore.client import shmlanes

    made, inodes = [], []
    real = shm.Segment

    def second_fails(nbytes: int) -> shm.Segment:
        if made:
            raise OSError(12, "Cannot allocate memory")
        made.append(real(nbytes))
        inodes.append((os.fstat(made[-1].fd).st_dev, os.fstat(made[-1].fd).st_ino))
        return made[-1]

    cfg = config.load({"KVSTORE_SHM_BYTES": str(1 << 20)})
    assert shm.unusable(cfg) is None
    monkeypatch.setattr(shm, "Segment", second_fails)
    assert shmlanes.attach(cfg, None, 2, 1.0) is None
    assert len(made) == 1 and made[0].fd is None
    made.clear()  # the mapping (which holds a descriptor of its own) goes with the segment
    gc.collect()
    still = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile (listdir's own)
            found = os.stat(f"/proc/self/fd/{fd}")
            if (found.st_dev, found.st_ino) == inodes[0]:
                still.append(fd)
    assert still == []  # no descriptor of that segment's memfd is left open


@pytest.mark.timeout(10)
def test_a_lent_array_never_leaves_by_reference() -> None:
    """A Lent view of a caller's array: placed, its message holds a read-only view of the segment's
    copy; too small, not fitting, or with no segment for the server, a copy of it; either way the
    caller's later writes do not reach the message."""
    from kvstore.client.shmlanes import Lent

    segment = shm.Segment(1 << 20)
    try:
        lanes = Lanes({0: segment})
        big, small, huge = (np.arange(n, dtype=np.float32) for n in (shm.MIN_BYTES, 16, 1 << 20))
        msg = Message(Op.PUSH, {}, [big.view(Lent), small.view(Lent)])
        release = lanes.place(0, msg)
        unplaced = [Message(Op.PUSH, {}, [huge.view(Lent)]), Message(Op.PUSH, {}, [big.view(Lent)])]
        assert lanes.place(0, unplaced[0]) is None and lanes.place(1, unplaced[1]) is None  # full; none
        for source in (big, small, huge):
            source += 1  # the caller's memory changes once place returns
        assert msg.shm is not None and msg.shm[0] is not None and msg.shm[1] is None
        sent = [*msg.arrays, *(m.arrays[0] for m in unplaced)]
        assert all(type(a) is np.ndarray for a in sent)
        assert not msg.arrays[0].flags.writeable  # the segment's copy, read-only
        for array, n in zip(sent, (shm.MIN_BYTES, 16, 1 << 20, shm.MIN_BYTES)):
            np.testing.assert_array_equal(array, np.arange(n, dtype=np.float32))
        assert release is not None
        release(None)
    finally:
        segment.close_fd()

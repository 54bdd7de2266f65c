"""The wire side of compression without a cluster: push plans keep compressed keys out of uncompressed
batches, a worker's message compresses its run of elements with per-key residuals, and a server's
``expand`` gives back exactly the dequantised values or a ProtocolError."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.compress import WorkerCompression
from kvstore.core import compression as C
from kvstore.core.partition import Piece
from kvstore.core.plan import plan
from kvstore.errors import ProtocolError
from kvstore.net.protocol import Message, Op
from kvstore.server.decompress import expand
from tests import compression_ref as ref

pytestmark = pytest.mark.timeout(30)
F32 = np.dtype(np.float32)


def test_tags_keep_compressed_keys_in_their_own_batches() -> None:
    entries = [(k, F32, [Piece(0, 0, 10)]) for k in ("a", "b", "c")]
    sends = plan(entries, 1 << 20, 1 << 20, tags={"a": True, "b": False, "c": True})
    assert [([p.key for p in s.parts], s.tag) for s in sends] == [(["a", "c"], True), (["b"], False)]
    assert len(plan(entries, 1 << 20, 1 << 20)) == 1


def test_a_batch_is_compressed_as_one_run_with_per_key_residuals_and_expanded_back() -> None:
    work = WorkerCompression()
    work.spec = C.parse({"type": "2bit", "threshold": 0.5})
    sizes = {"a": 7, "b": 30}
    sends = plan([(k, F32, [Piece(0, 0, n)]) for k, n in sizes.items()], 1 << 20, 1 << 20,
                 tags=work.tags(sizes, {k: _Meta(n) for k, n in sizes.items()}))
    (send,) = sends
    rng = np.random.default_rng(0)
    want_residual = {k: np.zeros(n, np.float32) for k, n in sizes.items()}
    for _ in range(3):
        flats = {k: (rng.standard_normal(n) * 0.6).astype(np.float32) for k, n in sizes.items()}
        array, extra = work.encode(send, flats)
        assert extra == {"compression": ["2bit", 0.5]} and array.size == C.packed_size("2bit", 37)
        run = np.concatenate([flats["a"], flats["b"]])
        residual = np.concatenate([want_residual["a"], want_residual["b"]])
        assert array.tobytes() == ref.quantise_2bit(run, residual, 0.5)
        want_residual = {"a": residual[:7], "b": residual[7:]}
        for k in sizes:
            assert work.residuals[k].tobytes() == want_residual[k].tobytes()
        msg = expand(Message(Op.PUSH, {**send.body(), **extra}, [array], sender=0))
        assert msg.arrays[0].tobytes() == np.array(ref.dequantise_2bit(array.tobytes(), 37, 0.5)).tobytes()


class _Meta:
    def __init__(self, size: int) -> None:
        self.size, self.dtype = size, F32


def test_expand_refuses_what_does_not_fit() -> None:
    words = np.zeros(3, np.float32)
    good = {"keys": ["k"], "sizes": [40], "compression": ["2bit", 0.5]}
    assert expand(Message(Op.PUSH, good, [words])).arrays[0].shape == (40,)
    plain = Message(Op.PUSH, {"keys": ["k"], "sizes": [3]}, [words])
    assert expand(plain) is plain
    for body, arrays in [({**good, "compression": ["2bit", -1]}, [words]),
                         ({**good, "compression": [1, 0.5]}, [words]),
                         ({**good, "compression": ["2bit", 1e300]}, [words]),
                         ({**good, "compression": ["1bit", True]}, [words]),
                         ({**good, "sizes": [40.0]}, [words]), ({**good, "sizes": "40"}, [words]),
                         (good, [words[:2]]), (good, [words, words]), (good, []),
                         (good, [words.reshape(3, 1)]), (good, [words.astype(np.float64)]),
                         ({**good, "compression": ["bf16", 0.0]}, [np.zeros(40, np.float32)])]:
        with pytest.raises(ProtocolError):
            expand(Message(Op.PUSH, body, arrays))

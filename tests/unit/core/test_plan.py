"""Unit tests of kvstore.core.plan: how a call's keys become batches, whole pieces and chunks, and how the
replies to a pull are put back together."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import config as kvconfig
from kvstore.client.collective import CollectiveCalls, StoreLink
from kvstore.core.checkpoint import StateEntry
from kvstore.core.partition import Piece
from kvstore.core.plan import (
    BATCH_HEADER_BYTES,
    SMALL_BYTES,
    WHOLE_CHUNKS,
    Send,
    Span,
    chunk_elements,
    collect,
    init_body,
    pack,
    plan,
    unpack,
)
from kvstore.core.values import meta_of
from kvstore.errors import ProtocolError
from kvstore.net.protocol import Op

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def whole(server: int, size: int) -> list[Piece]:
    return [Piece(server, 0, size)]


def test_small_keys_of_one_server_and_dtype_share_a_message_in_call_order():
    """Small pieces for one server are packed together, keys in call order; other servers get their own."""
    entries = [(k, F32, whole(k % 2, 100)) for k in range(6)]
    sends = plan(entries, batch_bytes=1 << 20, chunk_bytes=4 << 20)
    assert [(s.server, [p.key for p in s.parts]) for s in sends] == [(0, [0, 2, 4]), (1, [1, 3, 5])]
    assert all(s.lo is None for s in sends)


def test_batching_off_sends_one_message_per_piece():
    """batch_bytes=0 is the unbatched client: one message per piece."""
    entries = [(k, F32, whole(0, 100)) for k in range(5)]
    sends = plan(entries, batch_bytes=0, chunk_bytes=4 << 20)
    assert [[p.key for p in s.parts] for s in sends] == [[k] for k in range(5)]


def test_dtypes_are_never_mixed_in_a_batch():
    """A batch holds one dtype, since its values travel as one array."""
    entries = [("a", F32, whole(0, 10)), ("b", F64, whole(0, 10)), ("c", F32, whole(0, 10))]
    sends = plan(entries, batch_bytes=1 << 20, chunk_bytes=4 << 20)
    assert [[p.key for p in s.parts] for s in sends] == [["a", "c"], ["b"]]


def test_batches_are_cut_at_batch_bytes():
    """Each batch holds at most batch_bytes of values (a single bigger piece still goes alone)."""
    entries = [(k, F32, whole(0, 1000)) for k in range(10)]  # 4000 bytes each
    sends = plan(entries, batch_bytes=9000, chunk_bytes=4 << 20)
    assert [len(s.parts) for s in sends] == [2, 2, 2, 2, 2]
    assert [p.key for s in sends for p in s.parts] == list(range(10))


def test_batches_are_cut_before_the_header_grows_too_big():
    """Long str keys end a batch before its header nears the protocol's limit."""
    key_bytes = 10_000
    entries = [("k" * key_bytes + str(i), F32, whole(0, 1)) for i in range(100)]
    sends = plan(entries, batch_bytes=1 << 20, chunk_bytes=4 << 20)
    assert len(sends) > 1
    for send in sends:
        assert sum(len(p.key) for p in send.parts) * 4 <= BATCH_HEADER_BYTES


def test_big_piece_is_chunked_with_offsets_in_its_slice():
    """A piece bigger than a chunk goes in chunk messages; lo is the offset in the server's slice."""
    size = 2_500_000
    pieces = [Piece(0, 0, 1_250_000), Piece(1, 1_250_000, size)]
    sends = plan([("w", F32, pieces)], batch_bytes=1 << 20, chunk_bytes=1 << 18)
    step = chunk_elements(1 << 18, F32)
    assert step == 65_536
    for server, piece in enumerate(pieces):
        mine = [s for s in sends if s.server == server]
        assert [s.lo for s in mine] == list(range(0, piece.stop - piece.start, step))
        assert [(s.parts[0].start, s.parts[0].stop) for s in mine] == [
            (piece.start + lo, min(piece.start + lo + step, piece.stop)) for lo in range(0, 1_250_000, step)]


def test_a_piece_of_up_to_whole_chunks_goes_whole():
    """A piece of WHOLE_CHUNKS chunks is one message; one element more and it is chunked."""
    step = chunk_elements(1 << 20, F32)
    assert len(plan([("w", F32, whole(0, WHOLE_CHUNKS * step))], 1 << 20, 1 << 20)) == 1
    sends = plan([("w", F32, whole(0, WHOLE_CHUNKS * step + 1))], 1 << 20, 1 << 20)
    assert [s.lo for s in sends] == [i * step for i in range(WHOLE_CHUNKS + 1)]


def test_chunking_off_and_pulls_send_big_pieces_whole():
    """chunk_bytes=0, or chunked=False (pulls), sends each big piece in one message."""
    pieces = [Piece(0, 0, 1 << 20)]
    for sends in (plan([("w", F32, pieces)], 1 << 20, 0), plan([("w", F32, pieces)], 1 << 20, 4096, False)):
        assert [(s.lo, s.parts) for s in sends] == [(None, [Span("w", 0, 1 << 20)])]


def test_init_chunks_carry_their_pieces_total():
    """INIT is planned like a push: a big slice goes in chunks, and each chunk's body also names the
    slice's element count (the server does not know the key yet); whole pieces and batches do not."""
    step = chunk_elements(1 << 18, F32)
    pieces = [Piece(0, 0, 10 * step + 3), Piece(1, 10 * step + 3, 12 * step)]
    sends = plan([("w", F32, pieces), ("s", F32, whole(0, 5)), ("t", F32, whole(0, 5))], 1 << 20, 1 << 18)
    chunks = [s for s in sends if s.lo is not None]
    assert [(s.server, s.lo) for s in chunks] == [(0, i * step) for i in range(11)]
    assert [init_body(s) for s in chunks][-1] == {"keys": ["w"], "sizes": [3], "lo": 10 * step,
                                                  "total": 10 * step + 3}
    assert all(init_body(s)["total"] == 10 * step + 3 for s in chunks)
    others = [s for s in sends if s.lo is None]
    assert [init_body(s) for s in others] == [{"keys": ["w"], "sizes": [2 * step - 3]},
                                              {"keys": ["s", "t"], "sizes": [5, 5]}]
    assert all("total" not in s.body() for s in sends)  # a push chunk does not carry it


@pytest.mark.parametrize("seed", range(20))
def test_every_planned_frame_fits_the_message_limit(seed):
    """Under any settings kvstore.config.check_message_limits accepts, no message a worker plans for a
    push or an INIT carries an array frame bigger than KVSTORE_MAX_MESSAGE_BYTES."""
    rng = np.random.default_rng(seed)
    limit = int(rng.integers(kvconfig.MIN_MESSAGE_BYTES, 20 << 20))
    chunk = int(rng.integers(limit // 64, limit // WHOLE_CHUNKS + 1))  # a few hundred chunks at most
    batch = int(rng.choice([0, rng.integers(1, limit + 1), limit]))
    kvconfig.check_message_limits(limit, chunk, batch)
    dtypes = [np.dtype(d) for d in ("float16", "float32", "float64", "int32")]
    entries = []
    for i in range(40):
        size = int(rng.choice([1, 1000, SMALL_BYTES // 2, rng.integers(1, 3 * limit // 8)]))
        cut = int(rng.integers(0, size + 1))
        pieces = [Piece(0, 0, cut), Piece(1, cut, size)] if cut else whole(0, size)
        entries.append((i, dtypes[i % 4], [p for p in pieces if p.stop > p.start]))
    sends = plan(entries, batch, chunk)
    itemsize = {i: dtype.itemsize for i, dtype, _ in entries}
    for send in sends:
        assert send.offsets()[-1] * itemsize[send.parts[0].key] <= limit, (limit, chunk, batch, send)
    assert any(s.lo is not None for s in sends)


def _state_messages(entry: StateEntry, pieces: list[Piece], chunk_bytes: int) -> list[tuple[int, object]]:
    """The (server, message) pairs CollectiveCalls sends to load ``entry``'s state."""
    sent = []
    link = StoreLink(run_collective=None, barrier=None, request_all=None, metas=None, pull=None,
                     submit=lambda server, msg, what: sent.append((server, msg)) or what,
                     pieces=lambda key: pieces, servers=["a", "b"], resume=None, chunk_bytes=chunk_bytes)
    assert len(CollectiveCalls(link)._send_state(entry)) == len(sent)
    return sent


def test_state_set_of_a_big_slice_goes_in_chunks_cut_by_the_widest_state():
    """STATE_SET is cut as a push of the slice would be, by its widest state dtype (a float16 weight's
    float32 master copy): every array frame stays within WHOLE_CHUNKS chunks, each chunk names its
    offset, and the chunks of each server put its slice of every state back together."""
    n, chunk = 100_000, 16 << 10
    rng = np.random.default_rng(3)
    arrays = {"mean": rng.standard_normal(n).astype(np.float16),
              "weight32": rng.standard_normal(n).astype(np.float32)}
    entry = StateEntry("w", (n,), np.dtype(np.float16), 7, arrays)
    pieces = [Piece(0, 0, 60_000), Piece(1, 60_000, n)]
    sent = _state_messages(entry, pieces, chunk)
    step = chunk_elements(chunk, F32)
    for server, piece in enumerate(pieces):
        mine = [msg for s, msg in sent if s == server]
        assert [m.body["lo"] for m in mine] == list(range(0, piece.stop - piece.start, step))
        for m in mine:
            assert m.op is Op.STATE_SET and (m.body["key"], m.body["count"]) == ("w", 7)
            assert m.body["names"] == ["mean", "weight32"]
            assert all(a.nbytes <= chunk for a in m.arrays)
        for i, name in enumerate(["mean", "weight32"]):
            joined = np.concatenate([m.arrays[i] for m in mine])
            np.testing.assert_array_equal(joined, arrays[name][piece.start:piece.stop])


def test_state_set_of_small_slices_and_without_chunking_goes_whole():
    """A slice of up to WHOLE_CHUNKS chunks, any slice with chunking off, and a state with no arrays
    go in one STATE_SET per server, with no offset."""
    arrays = {"mom": np.arange(1000, dtype=np.float32)}
    entry = StateEntry(5, (1000,), np.dtype(np.float32), 2, arrays)
    pieces = [Piece(0, 0, 400), Piece(1, 400, 1000)]
    for chunk_bytes in (1 << 20, 0):
        sent = _state_messages(entry, pieces, chunk_bytes)
        assert [(s, "lo" in m.body, m.arrays[0].size) for s, m in sent] == [(0, False, 400), (1, False, 600)]
    bare = StateEntry(5, (1000,), np.dtype(np.float32), 2, {})
    assert [(s, m.body, m.arrays) for s, m in _state_messages(bare, pieces, 64)] == [
        (0, {"key": 5, "count": 2, "names": []}, []), (1, {"key": 5, "count": 2, "names": []}, [])]


def test_a_piece_just_over_small_goes_alone_unchunked():
    """A piece over SMALL_BYTES but within a chunk is its own whole message."""
    n = SMALL_BYTES // 4 + 1
    entries = [("a", F32, whole(0, 10)), ("b", F32, whole(0, n)), ("c", F32, whole(0, 10))]
    sends = plan(entries, 1 << 20, 4 << 20)
    assert [([p.key for p in s.parts], s.lo) for s in sends] == [(["a", "c"], None), (["b"], None)]


def test_pack_and_unpack_round_trip():
    """pack concatenates the parts' elements; unpack gives one view per part; one part is not copied."""
    flats = {"a": np.arange(5, dtype=np.float32), "b": np.arange(10, 13, dtype=np.float32)}
    send = Send(0, [Span("a", 1, 4), Span("b", 0, 3)])
    packed = pack(send, flats)
    np.testing.assert_array_equal(packed, [1, 2, 3, 10, 11, 12])
    views = unpack(send, packed)
    np.testing.assert_array_equal(views[0], [1, 2, 3])
    np.testing.assert_array_equal(views[1], [10, 11, 12])
    single = Send(0, [Span("a", 2, 5)])
    assert np.shares_memory(pack(single, flats), flats["a"])
    assert send.body() == {"keys": ["a", "b"], "sizes": [3, 3]}
    assert Send(1, [Span("w", 8, 12)], lo=8).body() == {"keys": ["w"], "sizes": [4], "lo": 8}


def test_unpack_refuses_a_reply_of_the_wrong_size():
    """A reply that does not hold exactly the asked elements is a ValueError."""
    send = Send(0, [Span("a", 0, 3), Span("b", 0, 2)])
    with pytest.raises(ValueError, match="4 elements where 5"):
        unpack(send, np.zeros(4, np.float32))


def _pulled(values: dict, pieces: dict, batch_bytes: int = 1 << 20) -> tuple[list, list, list]:
    """The messages of a pull of ``values``' keys (placed as ``pieces``) and the frames a faithful
    server answers them with."""
    keys = list(values)
    sends = plan([(k, values[k].dtype, pieces[k]) for k in keys], batch_bytes, 0, chunked=False)
    flats = {k: v.reshape(-1) for k, v in values.items()}
    return keys, sends, [[pack(s, flats).copy()] for s in sends]


def test_collect_reassembles_batched_and_split_keys():
    """Keys batched together and a key split over two servers come back whole, in their shapes."""
    values = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.float32),
              "w": np.arange(20, dtype=np.float64).reshape(4, 5)}
    pieces = {"a": whole(0, 6), "b": whole(0, 4), "w": [Piece(0, 0, 8), Piece(1, 8, 20)]}
    keys, sends, frames = _pulled(values, pieces)
    got = collect(keys, [meta_of(values[k]) for k in keys], sends, frames)
    assert [g.shape for g in got] == [(2, 3), (4,), (4, 5)]
    for key, array in zip(keys, got):
        np.testing.assert_array_equal(array, values[key])


def test_collect_writes_into_contiguous_numpy_outs():
    """A C-contiguous numpy out is written in place and gets None; any other out gets a new value."""
    values = {"w": np.arange(20, dtype=np.float32).reshape(4, 5), "s": np.arange(3, dtype=np.float32)}
    pieces = {"w": [Piece(0, 0, 8), Piece(1, 8, 20)], "s": whole(1, 3)}
    keys, sends, frames = _pulled(values, pieces)
    outs = [np.zeros((4, 5), np.float32), np.zeros((3, 2), np.float32)[:, 0]]  # the second is strided
    got = collect(keys, [meta_of(values[k]) for k in keys], sends, frames, outs)
    assert got[0] is None
    np.testing.assert_array_equal(outs[0], values["w"])
    np.testing.assert_array_equal(got[1], values["s"])
    assert not outs[1].any()
    whole_out = [np.zeros(3, np.float32)]
    _, sends, frames = _pulled({"s": values["s"]}, pieces)
    assert collect(["s"], [meta_of(values["s"])], sends, frames, whole_out) == [None]
    np.testing.assert_array_equal(whole_out[0], values["s"])


def test_collect_refuses_replies_that_do_not_match_their_messages():
    """A reply without exactly one frame, or of the wrong length, is a ProtocolError naming the server."""
    values = {"a": np.arange(4, dtype=np.float32)}
    keys, sends, frames = _pulled(values, {"a": whole(2, 4)})
    metas = [meta_of(values["a"])]
    with pytest.raises(ProtocolError, match="server 2 answered a pull with 2 arrays"):
        collect(keys, metas, sends, [frames[0] * 2])
    with pytest.raises(ProtocolError, match="server 2: a reply holds 3 elements where 4"):
        collect(keys, metas, sends, [[frames[0][0][:3]]])

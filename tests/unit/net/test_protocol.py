"""Unit tests of kvstore.net.protocol: pure bytes in, bytes out, no sockets."""

from __future__ import annotations

import math
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.errors import ProtocolError
from kvstore.net.protocol import (
    MAX_DIMS,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    Message,
    Op,
    decode,
    encode,
    error_reply,
)

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
SHAPES = [(0,), (0, 3), (1,), (7,), (2, 3, 4)]

NESTED_BODY = {
    "key": 2**64 - 1,
    "small": 0,
    "negative": -5,
    "name": "weight:0",
    "nested": {"list": [1, "two", [3.5, None]], "flag": True, "off": False, "raw": b"\x00\xff"},
    "float": 0.25,
    "empty": {},
}


def wire(frames: list) -> list[bytes]:
    """Copy frames into immutable bytes, as a received zmq message would arrive."""
    return [bytes(f) for f in frames]


def roundtrip(msg: Message) -> Message:
    """Encode ``msg``, copy the frames to bytes, decode them."""
    return decode(wire(encode(msg)))


_DROP = object()  # a header field given this value is left out


def header(**fields) -> bytes:
    """A raw msgpack header with the standard fields, overridden by ``fields`` (_DROP deletes)."""
    base = {"v": PROTOCOL_VERSION, "op": int(Op.PUSH), "seq": 1, "sender": 0, "auth": None,
            "body": {}, "arrays": []}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not _DROP}, use_bin_type=True)


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct small values of ``dtype`` and ``shape`` (exact in float16)."""
    size = int(np.prod(shape, dtype=np.int64))
    return (np.arange(size) - size // 2).astype(dtype).reshape(shape)


# -- round trips ------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", list(Op))
def test_every_op_round_trips_with_body(op):
    """Every Op decodes back to the same op, body, seq, sender and auth."""
    msg = Message(op, body=dict(NESTED_BODY), seq=12345, sender=3, auth=["worker-1", 9, "server0"])
    out = roundtrip(msg)
    assert out.op is op
    assert out.body == NESTED_BODY
    assert out.seq == 12345
    assert out.sender == 3
    assert out.auth == ["worker-1", 9, "server0"]
    assert out.arrays == []


def test_largest_int_key_survives_exactly():
    """An int key of 2**64-1 comes back as that exact Python int."""
    out = roundtrip(Message(Op.PULL, {"key": 2**64 - 1}))
    assert out.body["key"] == 18446744073709551615
    assert type(out.body["key"]) is int


def test_str_and_int_keys_stay_distinct():
    """A str key "3" comes back as a str, an int key 3 as an int."""
    assert roundtrip(Message(Op.PULL, {"key": "3"})).body["key"] == "3"
    assert roundtrip(Message(Op.PULL, {"key": 3})).body["key"] == 3


def test_int_keyed_map_in_body_round_trips():
    """A body map with int keys (e.g. rank -> address) decodes with int keys."""
    body = {"servers": {0: ["10.0.0.1", 9000], 1: ["10.0.0.2", 9001]}}
    assert roundtrip(Message(Op.MAP, body)).body == body


def test_defaults_round_trip():
    """A bare message decodes with an empty body, seq 0, no sender and no auth."""
    out = roundtrip(Message(Op.OK))
    assert (out.op, out.body, out.arrays, out.seq, out.sender, out.auth) == (Op.OK, {}, [], 0, None, None)


def test_error_reply_round_trips():
    """error_reply builds an ERROR echoing the request seq with code and message in the body."""
    out = roundtrip(error_reply(77, "ShapeMismatchError", "bad shape", sender=2))
    assert out.op is Op.ERROR
    assert out.seq == 77
    assert out.sender == 2
    assert out.body == {"code": "ShapeMismatchError", "message": "bad shape"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_array_round_trips_every_dtype_and_shape(dtype, shape):
    """An array of each supported dtype and shape decodes to the same dtype, shape and values."""
    array = sample(dtype, shape)
    out = roundtrip(Message(Op.PUSH, {"key": 1}, arrays=[array]))
    [got] = out.arrays
    assert got.dtype == np.dtype(dtype)
    assert got.shape == shape
    np.testing.assert_array_equal(got, array)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_dim_array_keeps_its_shape(dtype):
    """A 0-d array decodes as a 0-d array with the same value."""
    array = np.array(7, dtype=dtype)
    [got] = roundtrip(Message(Op.PUSH, arrays=[array])).arrays
    assert got.shape == ()
    assert got.dtype == np.dtype(dtype)
    assert got == 7


def test_extreme_values_round_trip_bit_exact():
    """Extreme values (int64 min/max, inf, nan, float16 max) come back unchanged."""
    i64 = np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], dtype=np.int64)
    i32 = np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max], dtype=np.int32)
    f16 = np.array([65504, -65504, np.inf], dtype=np.float16)
    f64 = np.array([np.nan, -np.inf, 5e-324], dtype=np.float64)
    got = roundtrip(Message(Op.PUSH, arrays=[i64, i32, f16, f64])).arrays
    for sent, back in zip([i64, i32, f16, f64], got):
        assert back.tobytes() == sent.tobytes()


def test_several_arrays_keep_their_order():
    """Arrays of different dtypes and shapes in one message come back in order."""
    arrays = [np.full((2, 2), 1.5, np.float32), np.arange(3, dtype=np.int64), np.zeros(0, np.float16)]
    got = roundtrip(Message(Op.PUSHPULL, {"key": "w"}, arrays=arrays)).arrays
    assert [a.dtype for a in got] == [np.float32, np.int64, np.float16]
    assert [a.shape for a in got] == [(2, 2), (3,), (0,)]
    for sent, back in zip(arrays, got):
        np.testing.assert_array_equal(back, sent)


def test_non_contiguous_input_is_sent_in_c_order():
    """A strided view is sent as its logical C-ordered values, with its own shape."""
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[::2, 1::2]
    [got] = roundtrip(Message(Op.PUSH, arrays=[view])).arrays
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, [[1, 3, 5], [13, 15, 17]])


def test_fortran_ordered_input_is_sent_by_value():
    """A Fortran-ordered array decodes to the same logical values."""
    array = np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3))
    [got] = roundtrip(Message(Op.PUSH, arrays=[array])).arrays
    np.testing.assert_array_equal(got, [[0, 1, 2], [3, 4, 5]])


def test_transposed_3d_input_round_trips():
    """A transposed 3-d view keeps its (transposed) shape and values."""
    array = np.arange(24, dtype=np.float64).reshape(2, 3, 4).transpose(2, 0, 1)
    [got] = roundtrip(Message(Op.PUSH, arrays=[array])).arrays
    assert got.shape == (4, 2, 3)
    assert got[3, 1, 2] == 1 * 12 + 2 * 4 + 3


def test_non_native_byte_order_is_never_corrupted():
    """A big-endian array is either refused with ProtocolError or arrives with its values intact."""
    array = np.arange(6, dtype=">f4")
    try:
        frames = encode(Message(Op.PUSH, arrays=[array]))
    except ProtocolError:
        return
    [got] = decode(wire(frames)).arrays
    np.testing.assert_array_equal(got, [0, 1, 2, 3, 4, 5])


def test_encode_does_not_modify_the_message_arrays():
    """Encoding leaves the caller's arrays' values, shape and flags unchanged."""
    array = np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2]
    before = array.copy()
    encode(Message(Op.PUSH, arrays=[array]))
    assert array.shape == (2, 2)
    assert array.flags.writeable
    np.testing.assert_array_equal(array, before)


# -- zero copy --------------------------------------------------------------------------------------

def test_encode_frames_view_a_contiguous_array():
    """The frame of a C-contiguous array views its memory (no copy on send)."""
    array = np.zeros(4, dtype=np.float64)
    frames = encode(Message(Op.PUSH, arrays=[array]))
    array[1] = 42.0
    assert bytes(frames[1])[8:16] == np.float64(42.0).tobytes()


def test_decoded_array_shares_the_frame_memory():
    """A decoded array views its frame: changing the frame bytes changes the array."""
    frames = wire(encode(Message(Op.PUSH, arrays=[np.zeros(3, dtype=np.float32)])))
    buffer = bytearray(frames[1])
    [got] = decode([frames[0], buffer]).arrays
    buffer[4:8] = np.float32(9.5).tobytes()
    np.testing.assert_array_equal(got, [0.0, 9.5, 0.0])


def test_decoded_array_from_bytes_is_read_only():
    """An array decoded from an immutable frame is read-only, so it cannot be written by mistake."""
    [got] = roundtrip(Message(Op.PUSH, arrays=[np.ones((2, 2), np.int32)])).arrays
    assert not got.flags.writeable
    with pytest.raises(ValueError):
        got[0, 0] = 5


def test_decode_accepts_memoryview_frames():
    """Frames given as memoryviews (as zmq hands them out) decode like bytes."""
    frames = [memoryview(f) for f in wire(encode(Message(Op.PUSH, {"key": 9},
                                                          arrays=[np.arange(4, dtype=np.int64)])))]
    out = decode(frames)
    assert out.body == {"key": 9}
    np.testing.assert_array_equal(out.arrays[0], [0, 1, 2, 3])


# -- errors -----------------------------------------------------------------------------------------

def test_empty_message_is_a_protocol_error():
    """No frames at all raises ProtocolError."""
    with pytest.raises(ProtocolError):
        decode([])


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"\x93\x01", b"\x80\x80", b"\xff" * 16, b"not msgpack"],
                         ids=["empty", "reserved-byte", "truncated", "trailing-data", "ff", "text"])
def test_garbage_header_is_a_protocol_error(raw):
    """A header that is not exactly one msgpack object raises ProtocolError."""
    with pytest.raises(ProtocolError):
        decode([raw])


@pytest.mark.parametrize("value", [[1, 2, 3], 5, "header", None, b"\x01"], ids=repr)
def test_header_not_a_map_is_a_protocol_error(value):
    """A well-formed msgpack header that is not a map raises ProtocolError saying so."""
    with pytest.raises(ProtocolError, match="not a map"):
        decode([msgpack.packb(value, use_bin_type=True)])


@pytest.mark.parametrize("version", [PROTOCOL_VERSION + 1, 0, "1", _DROP],
                         ids=["next", "zero", "str", "missing"])
def test_wrong_version_is_a_protocol_error(version):
    """A header of another (or no) protocol version raises ProtocolError naming the version."""
    with pytest.raises(ProtocolError, match="version"):
        decode([header(v=version)])


@pytest.mark.parametrize("op", [99, 0, -1, "PUSH", _DROP], ids=["99", "zero", "negative", "name", "missing"])
def test_unknown_op_is_a_protocol_error(op):
    """An op number that is not an Op raises ProtocolError naming it as unknown."""
    with pytest.raises(ProtocolError, match="unknown op"):
        decode([header(op=op)])


@pytest.mark.parametrize("metas,extra", [([["float32", [2]]], 0), ([], 1), ([["int32", [1]]] * 2, 1)],
                         ids=["missing-frame", "extra-frame", "one-short"])
def test_frame_count_mismatch_is_a_protocol_error(metas, extra):
    """A header declaring a different number of arrays than frames follow raises ProtocolError."""
    frames = [header(arrays=metas)] + [np.zeros(2, np.float32).tobytes()] * extra
    with pytest.raises(ProtocolError, match="arrays but"):
        decode(frames)


@pytest.mark.parametrize("nbytes", [0, 8, 11, 13, 16])
def test_frame_size_mismatch_is_a_protocol_error(nbytes):
    """A frame whose byte count is not dtype size x elements (3 float32 = 12) raises ProtocolError."""
    with pytest.raises(ProtocolError, match="12"):
        decode([header(arrays=[["float32", [3]]]), b"\x00" * nbytes])


@pytest.mark.parametrize("meta", [
    "float32", ["float32"], ["float32", [2], "extra"], ["complex64", [2]], ["uint8", [8]],
    ["float32", [-2]], ["float32", "2"], ["float32", [2.0]], [None, [2]], {"dtype": "float32"},
], ids=repr)
def test_bad_array_meta_is_a_protocol_error(meta):
    """An array description that is not [supported dtype, [non-negative int dims]] raises ProtocolError."""
    with pytest.raises(ProtocolError, match="bad array description"):
        decode([header(arrays=[meta]), b"\x00" * 8])


@pytest.mark.parametrize("field,value", [("body", [1]), ("arrays", "x"), ("seq", "1"), ("sender", "0"),
                                         ("seq", 1.5)])
def test_wrongly_typed_header_field_is_a_protocol_error(field, value):
    """A header whose body/arrays/seq/sender field has the wrong type raises ProtocolError."""
    with pytest.raises(ProtocolError):
        decode([header(**{field: value})])


@pytest.mark.parametrize("dtype", ["bool", "complex64", "uint8", "int16", "uint64", "object"])
def test_unsupported_dtype_on_encode_is_a_protocol_error(dtype):
    """Encoding an array of an unsupported dtype raises ProtocolError naming the dtype."""
    array = np.zeros(2, dtype=dtype)
    with pytest.raises(ProtocolError, match=np.dtype(dtype).name):
        encode(Message(Op.PUSH, arrays=[array]))


def test_oversize_header_is_a_protocol_error():
    """A received header over MAX_HEADER_BYTES raises ProtocolError naming the limit, unread."""
    body = {"blob": "a" * MAX_HEADER_BYTES}
    header = msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.OK), "body": body})
    assert len(header) > MAX_HEADER_BYTES
    with pytest.raises(ProtocolError, match=str(MAX_HEADER_BYTES)):
        decode([header])


def test_oversize_header_is_refused_on_encode():
    """encode refuses a header over MAX_HEADER_BYTES, so a peer never has to drop it."""
    with pytest.raises(ProtocolError, match="exceeds the"):
        encode(Message(Op.PUSH, {"key": "k" * MAX_HEADER_BYTES}))


def test_header_just_under_the_limit_decodes():
    """A header a little under MAX_HEADER_BYTES still decodes."""
    blob = "a" * (MAX_HEADER_BYTES - 200)
    assert roundtrip(Message(Op.OK, {"blob": blob})).body["blob"] == blob


def test_op_values_are_stable():
    """The wire numbers of the ops never change (peers of one version must agree)."""
    assert {op.name: int(op) for op in Op} == {
        "REGISTER": 1, "MAP": 2, "BARRIER": 3, "LEAVE": 4, "SHUTDOWN": 5, "OK": 6, "ERROR": 7,
        "HEARTBEAT": 8, "STATUS": 9, "INIT": 10, "PUSH": 11, "PULL": 12, "PUSHPULL": 13,
        "OPTIMIZER_SET": 14, "OPTIMIZER_PARAMS": 15, "OPTIMIZER_INFO": 16, "STATE_GET": 17, "STATE_SET": 18,
        "HELLO": 20, "CHALLENGE": 21,
        "SPARSE_INIT": 22, "SPARSE_SET": 23, "SPARSE_PUSH": 24, "SPARSE_PULL": 25, "AWAY": 26, "REJOIN": 27,
        "PIPE_PUBLISH": 28, "PIPE_LOOKUP": 29, "PIPE_ACT": 30, "PIPE_GRAD": 31, "PIPE_ABORT": 32,
        "SHM_ATTACH": 33, "ALIGN": 34, "ROUND_ABORT": 35, "PIPE_SHM": 36, "LINK": 37}


# -- hostile array descriptions and headers: ProtocolError and nothing else ---------------------------

def decode_one(meta, frame: bytes = b"") -> Message:
    """Decode a PUSH header carrying the one array description ``meta`` and ``frame``."""
    return decode([header(arrays=[meta]), frame])


def test_max_dims_is_within_what_numpy_builds():
    """numpy (1.x: 32 dims, 2.x: 64) can make an array of MAX_DIMS dims; the wire allows no more."""
    assert MAX_DIMS == 32
    assert np.empty((1,) * MAX_DIMS).ndim == MAX_DIMS


@pytest.mark.parametrize("ndim", range(71))
def test_dims_count_up_to_max_dims_decodes_beyond_is_a_protocol_error(ndim):
    """0..MAX_DIMS dims decode to that shape; 33..70 dims (numpy 2 stops at 64) raise ProtocolError."""
    meta = ["float32", [1] * ndim]
    if ndim <= MAX_DIMS:
        assert decode_one(meta, b"\x00" * 4).arrays[0].shape == (1,) * ndim
    else:
        with pytest.raises(ProtocolError, match="bad array description.*at most 32 dims"):
            decode_one(meta, b"\x00" * 4)


@pytest.mark.parametrize("dims", [[2**63], [2**64 - 1], [0, 2**63], [0, 2**64 - 1], [2**63, 0], [1, 2**63],
                                  [0] * 31 + [2**64 - 1]], ids=str)
def test_dims_past_int64_are_protocol_errors(dims):
    """A dim of 2**63 or more (msgpack carries up to 2**64-1) raises ProtocolError, even beside a 0."""
    with pytest.raises(ProtocolError, match=r"bad array description.*\[0, 2\*\*63-1\]"):
        decode_one(["float32", dims])


@pytest.mark.parametrize("dtype,dims", [
    ("float32", [0, 2**63 - 1]), ("float32", [0, 2**32, 2**32]), ("float64", [0, 2**62, 2]),
    ("int64", [2**62, 2**62, 0]), ("float16", [0] + [2**40] * 5), ("float32", [0, sys.maxsize // 4 + 1]),
], ids=str)
def test_empty_arrays_numpy_cannot_shape_are_protocol_errors(dtype, dims):
    """A zero-size shape whose other dims times the itemsize pass sys.maxsize (numpy refuses it:
    "array is too big") raises ProtocolError before numpy is called."""
    with pytest.raises(ProtocolError, match="too big"):
        decode_one([dtype, dims])


@pytest.mark.parametrize("dtype", DTYPES)
def test_largest_empty_shape_numpy_accepts_decodes(dtype):
    """The limit is numpy's own: other dims times the itemsize up to sys.maxsize still decode."""
    itemsize = np.dtype(dtype).itemsize
    [got] = decode_one([dtype, [0, sys.maxsize // itemsize]]).arrays
    assert got.shape == (0, sys.maxsize // itemsize) and got.size == 0


@pytest.mark.parametrize("dims,nbytes", [([2**32, 2**32], 4), ([2**32, 2**32], 0), ([2**31, 2**31, 4], 16),
                                         ([3] * 32, 12), ([2**62, 2**62, 2**62], 8)], ids=str)
def test_products_past_int64_are_protocol_errors(dims, nbytes):
    """A product past int64 (computed exactly, in Python ints) never matches a frame: ProtocolError."""
    with pytest.raises(ProtocolError):
        decode_one(["float32", dims], b"\x00" * nbytes)


@pytest.mark.parametrize("dims", [[-1], [2, -3], [-2**63], [0, -1]], ids=str)
def test_negative_dims_are_protocol_errors(dims):
    """A negative dim raises ProtocolError."""
    with pytest.raises(ProtocolError, match="bad array description"):
        decode_one(["float32", dims])


@pytest.mark.parametrize("dims", [[True], [False], [True, True], [2, True], [False, 2]], ids=str)
def test_bool_dims_are_protocol_errors(dims):
    """A bool is not a dim (msgpack's true is not 1), even where the byte count would fit."""
    with pytest.raises(ProtocolError, match="bad array description"):
        decode_one(["int32", dims], b"\x00" * 8)


@pytest.mark.parametrize("shape", ["2", 2, None, {"0": 2}, 2.0, b"\x02", [2.0], [[2]], ["2"], [None]],
                         ids=repr)
def test_non_list_shapes_are_protocol_errors(shape):
    """A shape that is not a list of ints raises ProtocolError."""
    with pytest.raises(ProtocolError, match="bad array description"):
        decode_one(["float32", shape], b"\x00" * 8)


@pytest.mark.parametrize("dtype", ["uint8", "bool", "object", "O", "Float32", "float32 ", ">f4", "",
                                   b"float32", 7, 2.5, None, True, ["float32"], {"float32": 1}], ids=repr)
def test_unknown_dtypes_are_protocol_errors(dtype):
    """A dtype that is not one of the five names (unhashable ones included) raises ProtocolError."""
    with pytest.raises(ProtocolError, match="bad array description"):
        decode_one([dtype, [2]], b"\x00" * 8)


@pytest.mark.parametrize("metas,frames", [([["float32", [0]]], 10**5), ([["float32", [0]]] * 1000, 0),
                                          ([["float32", [0]]] * 3, 4), ([], 2)], ids=["1-of-1e5", "1000-of-0",
                                                                                   "3-of-4", "0-of-2"])
def test_many_frames_count_mismatch_is_a_protocol_error(metas, frames):
    """Declared arrays and frames that follow must be as many, however many (up to 10**5) there are."""
    with pytest.raises(ProtocolError, match="arrays but"):
        decode([header(arrays=metas)] + [b""] * frames)


@pytest.mark.parametrize("frames", [None, 5, "abc", b"abc", [5], [None], ["header"], [3.5],
                                    [memoryview(np.zeros(8, np.uint8)[::2])],
                                    [header(arrays=[["float32", [1]]]), 5],
                                    [header(arrays=[["float32", [1]]]), "four"],
                                    [header(arrays=[["int32", [2]]]), memoryview(np.zeros(4, np.int32)[::2])],
                                    ],
                         ids=["None", "int", "str", "bytes", "int-frame", "None-frame", "str-header",
                              "float-header", "strided-header", "int-array-frame", "str-array-frame",
                              "strided-frame"])
def test_frames_that_are_not_byte_buffers_are_protocol_errors(frames):
    """Frames that are not a list of contiguous byte buffers raise ProtocolError."""
    with pytest.raises(ProtocolError):
        decode(frames)


@pytest.mark.parametrize("field,value", [("op", True), ("op", 11.0), ("op", [11]), ("seq", True),
                                         ("seq", 1.0), ("seq", None), ("sender", True), ("sender", -1),
                                         ("sender", 0.0), ("body", None), ("body", 3), ("arrays", None),
                                         ("arrays", {}), ("v", True), ("v", 4.0)], ids=repr)
def test_header_fields_of_the_wrong_wire_type_are_protocol_errors(field, value):
    """Each header field must have its wire type exactly (no bools or floats passing as ints)."""
    with pytest.raises(ProtocolError):
        decode([header(**{field: value})])


@pytest.mark.parametrize("auth", [b"mac", "x", 5, ["a", 1], ["a", True, "b"], [1, 1, "b"], ["a", 1, 2],
                                  ["a", 1.0, "b"], ["a", 1, "b", "c"]], ids=repr)
def test_malformed_auth_field_is_a_protocol_error(auth):
    """``auth`` is nil or [label, n, to] of str, int, str (auth.py checks n > 0 and the names)."""
    with pytest.raises(ProtocolError, match="auth field"):
        decode([header(auth=auth)])


def test_error_messages_stay_short_whatever_was_sent():
    """Errors quote at most a little of a hostile field, so an ERROR reply to it always fits a header."""
    huge = [header(op="x" * (MAX_HEADER_BYTES - 200)),
            header(v="y" * (MAX_HEADER_BYTES - 200)),
            header(arrays=[["float32", [0] * 300_000]]),
            header(arrays=[["float32" * 100_000, [1]]]),
            header(auth=["a" * 500_000, 1, "b"])]
    for raw in huge:
        with pytest.raises(ProtocolError) as caught:
            decode([raw, b""])
        assert len(str(caught.value)) < 500
        encode(error_reply(0, "ProtocolError", str(caught.value)))


def test_encode_refuses_more_dims_than_the_wire_carries():
    """encode raises ProtocolError for an array of more than MAX_DIMS dims (numpy 2 can make them)."""
    try:
        array = np.zeros((1,) * (MAX_DIMS + 1), np.float32)
    except ValueError:
        pytest.skip("this numpy cannot make more than MAX_DIMS dims")
    with pytest.raises(ProtocolError, match="dims"):
        encode(Message(Op.PUSH, arrays=[array]))


def test_encode_writes_the_documented_header():
    """encode's header is exactly the documented map (validation added nothing to the wire)."""
    msg = Message(Op.PUSH, {"keys": ["w"], "sizes": [3]}, [np.arange(3, dtype=np.float32)], seq=4, sender=1,
                  auth=["worker-1", 2, "server0"])
    frames = encode(msg)
    documented = {"v": PROTOCOL_VERSION, "op": 11, "seq": 4, "sender": 1, "auth": ["worker-1", 2, "server0"],
                  "body": {"keys": ["w"], "sizes": [3]}, "arrays": [["float32", [3]]]}
    assert frames[0] == msgpack.packb(documented, use_bin_type=True)
    assert bytes(frames[1]) == np.arange(3, dtype=np.float32).tobytes()


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                     st.text(max_size=6), st.binary(max_size=6))
_wire_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=3), inner, max_size=4)), max_leaves=20)
_dim = st.one_of(st.sampled_from([0, 1, 2, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]),
                 st.integers(-2, 2**64 - 1), _wire_values)
_shapes = st.one_of(st.lists(_dim, max_size=70), st.lists(st.sampled_from([0, 1]), max_size=70), _wire_values)
_dtypes = st.one_of(st.sampled_from(DTYPES), _wire_values)
_metas = st.one_of(st.tuples(_dtypes, _shapes).map(list), _wire_values)
_headers = st.fixed_dictionaries({
    "v": st.one_of(st.just(PROTOCOL_VERSION), _wire_values),
    "op": st.one_of(st.sampled_from([int(op) for op in Op]), _wire_values),
    "arrays": st.one_of(st.lists(_metas, max_size=4), _wire_values),
}, optional={"seq": _wire_values, "sender": _wire_values, "auth": _wire_values, "body": _wire_values})
_array_frames = st.one_of(st.none(), st.lists(st.binary(max_size=16), max_size=5))


def _frames_for(metas: object) -> list[bytes]:
    """One frame per description, of the size it declares where that is small (else empty)."""
    frames = []
    for meta in metas if isinstance(metas, list) else []:
        try:
            size = math.prod(int(d) for d in meta[1]) * np.dtype(meta[0]).itemsize
        except Exception:  # not a description numpy understands: any frame will do
            size = 0
        frames.append(b"\0" * size if 0 <= size <= 64 else b"")
    return frames


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.one_of(st.lists(st.binary(max_size=64), max_size=5), st.tuples(_headers, _array_frames)))
def test_decode_raises_only_protocol_error_on_any_input(case):
    """Whatever the frames hold, decode returns a Message or raises ProtocolError, nothing else."""
    if isinstance(case, list):
        frames = case
    else:
        head, chosen = case
        frames = [msgpack.packb(head, use_bin_type=True), *(_frames_for(head["arrays"]) if chosen is None
                                                            else chosen)]
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg.op, Op) and isinstance(msg.body, dict) and len(msg.arrays) == len(frames) - 1


_hostile_dims = st.lists(st.one_of(st.sampled_from([0, 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]),
                                   st.integers(0, 2**64 - 1), st.integers(-2, 3), st.booleans()), max_size=70)
_hostile_metas = st.tuples(st.one_of(st.sampled_from(DTYPES), st.sampled_from(DTYPES), _wire_values),
                           st.one_of(_hostile_dims, st.lists(st.sampled_from([0, 1]), max_size=70),
                                     _hostile_dims.map(lambda dims: [0, *dims]), _wire_values)).map(list)


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(_hostile_metas, min_size=1, max_size=3), st.one_of(st.none(), st.none(), _array_frames))
def test_decode_raises_only_protocol_error_on_hostile_array_descriptions(metas, chosen):
    """Well-formed headers whose array descriptions hold 0-70 dims, dims up to 2**64-1 and products
    past int64 (with frames of the declared size) decode or raise ProtocolError, nothing else."""
    try:
        msg = decode([header(arrays=metas), *(_frames_for(metas) if chosen is None else chosen)])
    except ProtocolError:
        return
    for meta, array in zip(metas, msg.arrays):
        assert array.shape == tuple(meta[1]) and len(meta[1]) <= MAX_DIMS

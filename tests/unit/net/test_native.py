"""The compiled small-message path (kvstore/net/_hot.c) against the pure-Python one: the same bytes on the
wire (golden bytes), each opening the other's, the same refusals; and the fallback where it is not built."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from kvstore import config
from kvstore.errors import AuthenticationError, ConfigError, ProtocolError
from kvstore.net import compact
from kvstore.net.auth import MAC_BYTES, Channel, derive_key
from kvstore.net.protocol import Message, Op
from tests.helpers import REPO

KEY = derive_key("native-secret")
compiled_only = pytest.mark.skipif(compact.HOT is None, reason="kvstore.net._hot is not built here "
                                   "(or KVSTORE_PURE_PYTHON=1)")

GOLDEN = [  # every compact shape: the three requests, int and str keys, with and without a round, replies
    Message(Op.PUSH, {"keys": [7], "sizes": [3], "rounds": [4]}, [np.arange(3, dtype=np.float32)], seq=5,
            sender=1),
    Message(Op.PUSH, {"keys": ["w/0"], "sizes": [1024]}, [np.linspace(0, 1, 1024, dtype=np.float32)], seq=1,
            sender=0),
    Message(Op.PULL, {"keys": ["w/0"], "sizes": [2]}, seq=6, sender=0),
    Message(Op.PULL, {"keys": [0], "sizes": [0]}, seq=0, sender=None),
    Message(Op.PUSHPULL, {"keys": [2**64 - 1], "sizes": [2], "rounds": [0]}, [np.ones(2, np.float64)], seq=7,
            sender=3),
    Message(Op.PUSHPULL, {"keys": ["ключ-" + "x" * 200], "sizes": [5], "rounds": [2**63 - 1]},
            [np.arange(10, dtype=np.int64)[::2]], seq=2**64 - 1, sender=2**63 - 1),  # a strided array
    Message(Op.OK, seq=8, sender=0),
    Message(Op.OK, {}, [np.arange(4, dtype=np.int64)], seq=9, sender=None),
    Message(Op.OK, {}, [np.zeros(0, np.float16)], seq=10, sender=5),
    Message(Op.OK, {}, [np.full(16384, 3, np.int32)], seq=11, sender=1),  # 64 KiB: the largest compact array
]
GENERAL = [  # not compact: more frames (the header MAC only is compiled)
    Message(Op.PUSH, {"keys": [1, 2], "sizes": [2, 2], "rounds": [0, 0]}, [np.ones(4, np.float32)], seq=3),
    Message(Op.OK, {}, [np.ones(70000, np.float32)], seq=4, sender=0),
    Message(Op.INIT, {"keys": ["a"], "sizes": [3]}, [np.zeros(3, np.float16)], seq=5, sender=0),
    Message(Op.ERROR, {"code": "ProtocolError", "message": "x"}, seq=6),
]


def channel(label: str, compiled: bool, first: int = 1) -> Channel:
    """A channel of ``KEY`` and a fixed session whose next message is numbered ``first``."""
    out = Channel(KEY, label, session=b"native-session", compiled=compiled)
    out._counter = itertools.count(first)
    return out


def sealed(msg: Message, compiled: bool, n: int = 1) -> list:
    """The frames of ``msg`` sealed as message ``n`` of worker-a for server0, by one path."""
    return channel("worker-a", compiled, n).seal(Message(msg.op, dict(msg.body), list(msg.arrays), msg.seq,
                                                         msg.sender), "server0")


def same(a: Message, b: Message) -> bool:
    return (a.op, a.body, a.seq, a.sender, a.auth) == (b.op, b.body, b.seq, b.sender, b.auth) and \
        len(a.arrays) == len(b.arrays) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                               for x, y in zip(a.arrays, b.arrays))


@compiled_only
@pytest.mark.parametrize("msg", GOLDEN + GENERAL, ids=lambda m: m.op.name)
def test_both_paths_put_the_same_bytes_on_the_wire_and_open_each_others(msg: Message):
    """Compiled and pure sealing make identical frames; either path's receiver opens either's frames."""
    pure, fast = sealed(msg, False, 41), sealed(msg, True, 41)
    assert [bytes(f) for f in pure] == [bytes(f) for f in fast]
    assert (len(fast) == 1) == any(msg is m for m in GOLDEN)
    for frames, compiled in ((pure, True), (fast, False), (fast, True), (pure, False)):
        got = channel("server0", compiled).open([memoryview(bytes(f)) for f in frames])
        want = Message(msg.op, msg.body, [np.ascontiguousarray(a) for a in msg.arrays], msg.seq, msg.sender,
                       ["worker-a", 41, "server0"])
        assert same(got, want), (compiled, got)


@compiled_only
@pytest.mark.parametrize("extensions", [True, False], ids=["sha-extensions", "portable"])
def test_the_compiled_mac_is_hmac_sha256_of_the_frame_lengths_and_header(extensions: bool):
    """The compiled header MAC equals the pure one for any frame count, lengths and buffer layout, with
    the CPU's SHA extensions (where it has them) and with the portable compression."""
    was = compact.HOT.sha_extensions(extensions)
    try:
        check_macs()
        for n in (0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 1000, 4096, 100_003):  # padding edges
            data = random.Random(n).randbytes(n)
            assert channel("w", True)._mac([data, b"x"]) == channel("w", False)._mac([data, b"x"]), n
    finally:
        compact.HOT.sha_extensions(was)


def check_macs() -> None:
    pure, fast = channel("w", False), channel("w", True)
    rng = random.Random(7)
    for count in (1, 2, 3, 9, 20):
        frames = [rng.randbytes(rng.choice([0, 1, 55, 56, 63, 64, 65, 119, 120, 1000]))
                  for _ in range(count)]
        frames.append(np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2])  # a strided buffer: nbytes only
        frames[0] = memoryview(frames[0]) if count % 2 else bytearray(frames[0])
        assert fast._mac(frames) == pure._mac(frames)
    long_key = Channel(b"k" * 100, "w", compiled=True)  # an HMAC key over one block is hashed first
    assert long_key._mac([b"abc"]) == Channel(b"k" * 100, "w", compiled=False)._mac([b"abc"])


@compiled_only
def test_a_damaged_or_forged_compact_frame_fails_the_compiled_mac_check():
    """A flipped bit anywhere, a frame from another key and a truncated frame are refused by both paths."""
    frame = sealed(GOLDEN[0], True)[0]
    other = Channel(derive_key("other"), "worker-a", session=b"native-session").seal(GOLDEN[0], "server0")[0]
    for bad in [frame[:i] + bytes([frame[i] ^ 1]) + frame[i + 1:] for i in range(0, len(frame), 7)] + [other]:
        for compiled in (False, True):
            with pytest.raises((AuthenticationError, ProtocolError)):
                channel("server0", compiled).verify([bad])


def outcome(body: bytes, compiled: bool) -> tuple:
    """What unpacking ``body`` gives by one path: ("ok", fields) or ("refused", the message's text)."""
    try:
        msg = compact.unpack(memoryview(body), compiled)
    except ProtocolError as exc:
        return ("refused", str(exc))
    return ("ok", msg.op, msg.body, msg.seq, msg.sender, msg.auth,
            [(a.dtype.name, a.tobytes()) for a in msg.arrays])


@compiled_only
def test_the_compiled_decoder_accepts_and_refuses_exactly_what_the_pure_one_does():
    """Mutated, truncated and made-up compact bodies: both decoders return the same message or raise
    ProtocolError with the same text (and nothing else)."""
    rng = random.Random(39)
    bodies = [bytes(sealed(m, False)[0][MAC_BYTES:]) for m in GOLDEN]
    cases = list(bodies)
    for _ in range(3000):
        body = bytearray(rng.choice(bodies))
        for _ in range(rng.randint(1, 3)):
            what = rng.random()
            if what < 0.5 and body:
                body[rng.randrange(min(len(body), compact.FIELDS.size + 8))] = rng.randrange(256)
            elif what < 0.7:
                del body[rng.randrange(len(body) + 1):]
            elif what < 0.85:
                body += rng.randbytes(rng.randint(1, 9))
            else:
                if len(body) > 3:
                    body[3] = rng.randrange(4)  # the key's kind
        cases.append(bytes(body))
    cases += [b"", bytes(compact.FIELDS.size), bytes(compact.MAX_BYTES + 1)]
    refused = 0
    for body in cases:
        pure, fast = outcome(body, False), outcome(body, True)
        assert pure == fast, body
        refused += pure[0] == "refused"
    assert 0 < refused < len(cases)  # both kinds of outcome were exercised


@compiled_only
def test_channels_of_the_two_paths_talk_in_both_directions():
    """A compiled worker and a pure server (and the other way round) exchange requests and replies."""
    for worker_compiled in (True, False):
        worker = Channel(KEY, "worker-b", session=b"s", compiled=worker_compiled)
        server = Channel(KEY, "server0", session=b"s", compiled=not worker_compiled)
        for msg in GOLDEN[:6]:
            request = Message(msg.op, dict(msg.body), list(msg.arrays), msg.seq)
            got = server.open(worker.seal(request, "server0"))
            assert got.body == msg.body
            reply = worker.open(server.seal(Message(Op.OK, {}, got.arrays, got.seq, 0), "worker-b"))
            assert reply.seq == msg.seq and len(reply.arrays) == len(msg.arrays)


def test_pure_python_knob_is_read_by_config_only():
    """KVSTORE_PURE_PYTHON is 0 or 1 (default 0); anything else is a ConfigError naming it."""
    assert config.pure_python({}) is False
    assert config.pure_python({"KVSTORE_PURE_PYTHON": "1"}) is True
    with pytest.raises(ConfigError, match="KVSTORE_PURE_PYTHON"):
        config.pure_python({"KVSTORE_PURE_PYTHON": "2"})


PROBE = ("import logging, sys; "
         "logging.basicConfig(level=logging.INFO, format='LOG %(message)s', stream=sys.stdout); {block}"
         "from kvstore import config; from kvstore.net import compact; "
         "from kvstore.net.auth import Channel, channel_for, derive_key; "
         "from kvstore.net.protocol import Message, Op; import numpy as np; "
         "print('IMPORTED', flush=True); "
         "cfg = config.load({{'DMLC_ROLE': 'worker', 'KVSTORE_SECRET': 'x'}}); "
         "channel_for(cfg, 'w'); channel_for(cfg, 'v'); "
         "c = Channel(derive_key('x'), 'w', session=b's'); "
         "f = c.seal(Message(Op.PUSH, {{'keys': [1], 'sizes': [1]}}, [np.ones(1, np.float32)]), 'w'); "
         "print('HOT', compact.HOT is not None, len(f), c.open(f).body)")


@pytest.mark.parametrize("how", ["missing", "knob"])
def test_without_the_compiled_module_the_pure_path_runs_with_one_log_line(how: str):
    """Where _hot cannot be imported the pure path runs and one INFO line says so when the first node
    channel is made (not at import); KVSTORE_PURE_PYTHON=1 runs it without a word."""
    block = "sys.modules['kvstore.net._hot'] = None; " if how == "missing" else ""
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVSTORE_PURE_PYTHON": "1" if how == "knob" else "0"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(block=block)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HOT False 1 {'keys': [1], 'sizes': [1]}" in out.stdout
    lines = out.stdout.splitlines()
    logged = [i for i, line in enumerate(lines) if line.startswith("LOG ") and "_hot" in line]
    assert len(logged) == (1 if how == "missing" else 0), out.stdout
    if logged:  # said once a node channel is made, not at import (a command's --help stays quiet)
        assert "pure-Python" in lines[logged[0]] and logged[0] > lines.index("IMPORTED")


def test_a_stale_build_is_not_used(monkeypatch) -> None:
    """A compiled module built from an older source (its ABI is not the one native.py calls) is not used:
    the pure-Python path runs, and why is kept for the node's log line."""
    import types

    from kvstore.net import native

    stale = types.ModuleType("kvstore.net._hot")
    stale.ABI = native.ABI - 1
    monkeypatch.setitem(sys.modules, "kvstore.net._hot", stale)
    monkeypatch.setattr(sys.modules["kvstore.net"], "_hot", stale, raising=False)  # `from . import _hot`
    monkeypatch.setattr(native, "_missing", [])
    monkeypatch.delenv("KVSTORE_PURE_PYTHON", raising=False)
    native.module.cache_clear()
    try:
        assert native.module() is None
        assert "stale" in native._missing[0] and "rebuild" in native._missing[0]
    finally:
        native.module.cache_clear()  # the next caller imports the real one again

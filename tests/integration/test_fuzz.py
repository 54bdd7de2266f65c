"""Fuzzing a live server and scheduler with hypothesis: garbage, mutated and replayed messages,
well-sealed messages with nonsense inside (array descriptions of 0-70 dims, dims up to 2**64-1,
products past int64), messages of up to 10**5 frames, unsealed and sealed with the secret, and
well-formed SPARSE_* messages with one bad field or array each (every one must get an ERROR).

What must hold, whichever way a node answers bad input (an unsigned ERROR to every message, or a
sealed ERROR to authenticated ones and at most one reply per connection to unauthenticated junk):
any reply to a bad message is an ERROR, the node keeps serving (a sealed probe sent after each
message on the same connection is answered OK, so the message before it has been handled), no
process exits, and what the server stores does not change.  No reply to junk is required."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore
from kvstore.client.mux import SCHEDULER
from kvstore.core.dtypes import BY_NAME
from kvstore.net import compact, shm, transport
from kvstore.net.auth import MAC_BYTES, Channel, derive_key
from kvstore.net.auth import decode as open_frames
from kvstore.net.protocol import MAX_DIMS, PROTOCOL_VERSION, Message, Op
from kvstore.pipeline.link import StageLink, neighbour_routes

from .conftest import SECRET, Cluster, insider

EXAMPLES = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
BIG_EXAMPLES = settings(EXAMPLES, max_examples=4)  # messages of up to 10**5 frames: a few suffice
VALUE = np.arange(6, dtype=np.float32)
KEY = "fuzz-target"  # longer than any fuzzed str, so no fuzzed message can name it
PROBE_SEQS = 1_000_000
_probe_seqs = itertools.count(PROBE_SEQS)

WIRE_INTS = st.integers(-2**63, 2**64 - 1)  # what msgpack can carry
raw_frames = st.lists(st.binary(max_size=80), min_size=1, max_size=5)
mutations = st.tuples(st.sampled_from(["flip", "truncate", "append", "drop", "replay", "unsign"]),
                      st.integers(0, 10_000), st.integers(0, 255))

# -- array descriptions -------------------------------------------------------------------------------
BIG_DIMS = [2**31, 2**32, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
dims = st.one_of(st.integers(0, 4), st.integers(0, 2**64 - 1), st.sampled_from(BIG_DIMS),
                 st.integers(-2**63, -1), st.booleans())
shapes = st.one_of(st.lists(dims, max_size=70),
                   st.lists(st.sampled_from([0, 1]), max_size=70),  # many dims, small products
                   st.lists(st.sampled_from([0, 2**32, 2**62, 2**63 - 1]), min_size=2, max_size=6),
                   st.text(max_size=3), WIRE_INTS, st.none(), st.floats(),
                   st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
dtype_names = st.one_of(st.sampled_from(sorted(BY_NAME)),
                        st.sampled_from(["bogus", "uint8", "bool", "O", ""]), WIRE_INTS, st.none(),
                        st.lists(st.text(max_size=3), max_size=2))
any_meta = st.one_of(st.tuples(dtype_names, shapes).map(list), st.text(max_size=3), WIRE_INTS, st.none(),
                     st.lists(st.integers(0, 3), max_size=3))
# descriptions no node may accept: too many dims, a dim out of range, a product numpy cannot
# allocate, negative or bool dims, an unknown dtype, a shape that is not a list
bad_meta = st.one_of(
    st.integers(MAX_DIMS + 1, 70).map(lambda n: ["float32", [1] * n]),
    st.integers(2**63, 2**64 - 1).map(lambda d: ["float32", [0, d]]),
    st.lists(st.sampled_from([2**32, 2**61, 2**62, 2**63 - 1]), min_size=1, max_size=4).map(
        lambda big: ["float64", [0, 2**32, *big]]),
    st.integers(-2**63, -1).map(lambda d: ["int64", [2, d]]),
    st.just(["int32", [True, 2]]), st.just(["uint8", [4]]), st.just(["float32", "4"]),
    st.just(["float32", None]))
FATAL_METAS = [["float32", [0, 2**63]], ["float32", [1] * 65], ["float32", [1] * 70],
               ["float64", [0, 2**62, 2**62]], ["int64", [0, 2**64 - 1]], ["int32", [True]], ["int32", [-1]],
               [["float32"], [1]], ["float32", {"0": 1}]]


def _frame_for(meta: Any) -> bytes:
    """The frame a description would need when that is small (so decoding gets past the size check)."""
    try:
        size = math.prod(int(d) for d in meta[1]) * BY_NAME[meta[0]].itemsize
    except Exception:  # not a description at all: any frame will do
        return b""
    return b"\x00" * size if 0 <= size <= 64 else b""


def _frames(metas: Any, chosen: list[bytes] | None) -> list[bytes]:
    if chosen is not None or not isinstance(metas, list):
        return chosen or []
    return [_frame_for(m) for m in metas]


headers = st.fixed_dictionaries({
    "v": st.one_of(st.just(PROTOCOL_VERSION), st.integers(-2, 9), st.text(max_size=2)),
    "op": st.one_of(st.sampled_from([int(op) for op in Op]), st.integers(-5, 300), st.booleans(),
                    st.text(max_size=3)),
    "seq": st.one_of(st.integers(0, 2**31), WIRE_INTS, st.text(max_size=3), st.booleans()),
    "sender": st.one_of(st.none(), st.integers(-3, 5), st.just(2**62), st.booleans()),
    "body": st.one_of(st.dictionaries(st.sampled_from(["key", "keys", "sizes", "lo", "spec", "params",
                                                       "count", "names", "rank", "role", "shape", "dtype",
                                                       "hi", "init", "round", "last", "after", "state",
                                                       "reason"]),
                                      st.one_of(WIRE_INTS, st.text(max_size=5), st.none(), st.floats(),
                                                st.lists(WIRE_INTS, max_size=3)), max_size=4),
                      WIRE_INTS, st.text(max_size=4), st.none()),
    "arrays": st.one_of(st.lists(any_meta, max_size=3), any_meta),
}, optional={"auth": st.one_of(st.none(), WIRE_INTS, st.lists(st.one_of(st.text(max_size=4), WIRE_INTS),
                                                                 max_size=4))})
insider_payloads = st.tuples(
    headers, st.one_of(st.none(), st.lists(st.binary(max_size=40), max_size=4)), bad_meta, st.integers(0, 3),
    st.sampled_from(["sealed", "sealed-auth", "sealed-auth", "unsigned", "forged"]))

# compact one-frame bodies (kvstore/net/compact.py): fixed fields of any value, then any bytes
compact_fields = st.tuples(
    st.just(compact.MARKER), st.one_of(st.just(PROTOCOL_VERSION), st.integers(0, 255)),
    st.one_of(st.sampled_from([int(op) for op in (Op.PUSH, Op.PULL, Op.PUSHPULL, Op.OK)]),
              st.integers(0, 255)),
    st.integers(0, 3), st.one_of(st.integers(0, len(compact.DTYPE_NAMES)), st.just(255), st.integers(0, 255)),
    st.integers(0, 12), st.integers(0, 12), st.one_of(st.integers(0, 12), st.integers(0, 2**16 - 1)),
    st.integers(0, 2**64 - 1), st.integers(-2**63, 2**63 - 1), st.integers(0, 2**64 - 1),
    st.integers(-2**63, 2**63 - 1), st.integers(-2**63, 2**63 - 1))
compact_bodies = st.tuples(compact_fields, st.binary(max_size=64), st.booleans())


def sealed_compact(sealer: Channel, fields: tuple, rest: bytes, signed: bool) -> list[Any]:
    """One compact frame of ``fields`` and ``rest``, MAC'd by ``sealer`` (authentic whatever it holds)
    or with a forged MAC."""
    body = compact.FIELDS.pack(*fields) + rest
    return [(sealer._mac([body]) if signed else bytes(MAC_BYTES)) + body]


def sealed_raw(sealer: Channel, header: dict, frames: list[Any]) -> list[Any]:
    """``header`` (the version added unless given) and ``frames``, MAC'd by ``sealer``: authentic
    whatever nonsense they hold."""
    payload = [msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True), *frames]
    return [sealer._mac(payload), *payload]


def dealer(address: str) -> zmq.Socket:
    """A DEALER connected to ``address`` that drops unsent messages on close."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


class Target:
    """One live node under attack: a DEALER to it, its process, and a sealed probe that must be
    answered OK after every message (one connection is handled in order, so the probe's answer
    means the message before it was handled, and the node still serves)."""

    def __init__(self, address: str, proc: Any, sealer: Channel, to: str, probe: Message) -> None:
        self.sock, self.proc, self.sealer, self.to, self.probe = dealer(address), proc, sealer, to, probe

    @classmethod
    def server(cls, cluster: Cluster, sealer: Channel, rank: int = 0) -> Target:
        """Server ``rank`` of ``cluster``, probed with OPTIMIZER_INFO."""
        proc = next(p for name, p, _ in cluster.procs.procs if name == f"server {rank}")
        return cls(cluster.workers[0]._cluster.servers[rank], proc, sealer, f"server{rank}",
                   Message(Op.OPTIMIZER_INFO, {}, sender=0))

    @classmethod
    def scheduler(cls, cluster: Cluster, sealer: Channel) -> Target:
        """The scheduler of ``cluster``, probed with worker 0's HEARTBEAT."""
        proc = next(p for name, p, _ in cluster.procs.procs if name == "scheduler")
        return cls(cluster.cfg.root_address, proc, sealer, "scheduler",
                   Message(Op.HEARTBEAT, {"role": "worker", "rank": 0}, sender=0))

    def auth(self) -> list:
        """A valid, fresh ``auth`` field for a hand-made header sealed by the sealer."""
        return [self.sealer.label, next(self.sealer._counter), self.to]

    def answer(self, frames: list[Any], seq: int) -> Message:
        """Send ``frames``; return the OK reply with ``seq``. Any other reply must be an ERROR."""
        self.sock.send_multipart(frames)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.to} exited with status {self.proc.returncode}"
            if self.sock.poll(50):
                reply = open_frames(self.sock.recv_multipart())
                if reply.op is Op.OK and reply.seq == seq:
                    return reply
                if reply.op is Op.OK and PROBE_SEQS <= reply.seq < seq:
                    continue  # an earlier probe's answer, left unread by a failed example
                assert reply.op is Op.ERROR, f"{self.to} answered a bad message with {reply.op.name}"
        raise AssertionError(f"{self.to} did not answer a sealed {self.probe.op.name} within 10 s")

    def refuses(self, frames: list[Any]) -> Message:
        """Send a bad message, then the probe; return the probe's OK (the node lived, said no more
        than ERROR)."""
        self.sock.send_multipart(frames)
        self.probe.seq = next(_probe_seqs)
        return self.answer(self.sealer.seal(self.probe, self.to), self.probe.seq)

    def close(self) -> None:
        """Close the DEALER."""
        self.sock.close()


def _mutate(frames: list, how: str, where: int, byte: int) -> list:
    frames = [bytes(f) for f in frames]
    i = where % len(frames)
    if how == "flip" and frames[i]:
        f = bytearray(frames[i])
        f[where % len(f)] ^= byte or 1
        frames[i] = bytes(f)
    elif how == "truncate":
        frames[i] = frames[i][: where % (len(frames[i]) + 1)]
    elif how == "append":
        frames.append(bytes([byte]) * (where % 9))
    elif how == "drop" and len(frames) > 1:
        del frames[i]
    elif how == "unsign":
        frames[0] = b""
    return frames  # "replay" (or a no-op mutation): the frames as they were, sent again


def _insider_frames(target: Target, case: tuple) -> list[Any]:
    """A sealed (or unsigned, or forged) message from a fuzzed header.  "sealed-auth" ones carry a
    valid fresh auth field and at least one description no node may accept."""
    header, chosen, bad, where, how = case
    if how == "sealed-auth":
        metas = header["arrays"] if isinstance(header["arrays"], list) else []
        metas = [*metas[:where], bad, *metas[where:]]
        header = {**header, "v": PROTOCOL_VERSION, "auth": target.auth(), "arrays": metas}
    frames = sealed_raw(target.sealer, header, _frames(header["arrays"], chosen))
    if how == "unsigned":
        frames[0] = b""
    elif how == "forged":
        frames[0] = bytes(16)
    return frames


def _attack(target: Target, genuine: list[Any], case: Any) -> None:
    if isinstance(case[-1], bool):  # a compact body
        target.refuses(sealed_compact(target.sealer, *case))
    elif isinstance(case, list):
        target.refuses(case)
    elif isinstance(case[0], str):
        target.refuses(_mutate(genuine, *case))
    else:
        target.refuses(_insider_frames(target, case))


def _every_op_with_fatal_arrays(target: Target) -> None:
    """Each op, sealed with a fresh auth and unsigned, with each description numpy cannot build."""
    for op in Op:
        for meta in FATAL_METAS:
            header = {"op": int(op), "seq": 5, "sender": 0, "body": {"keys": [0], "sizes": [1]},
                      "arrays": [meta], "auth": target.auth()}
            frames = sealed_raw(target.sealer, header, [_frame_for(meta)])
            target.refuses(frames)
            target.refuses([b"", *frames[1:]])


def _many_frames(target: Target, count: int, sealed: bool, declared: str) -> list[Any]:
    """A message of ``count`` array frames; the header declares as many (or a bad one, or none)."""
    metas = {"all": [["float32", [0]]] * min(count, 4096), "bad": [["float32", [1] * 65]],
             "none": []}[declared]
    header = {"op": int(Op.PUSH), "seq": 3, "sender": 0, "body": {}, "arrays": metas, "auth": target.auth()}
    frames = sealed_raw(target.sealer, header, [b""] * count)
    return frames if sealed else [b"", *frames[1:]]


big_messages = st.tuples(st.one_of(st.sampled_from([1021, 1022, 10**5]), st.integers(1, 10**5)),
                         st.booleans(), st.sampled_from(["all", "bad", "none"]))


def _fuzz(target: Target, genuine: list[Any]) -> None:
    """Run every attack on ``target``: the op sweep, hypothesis' cases, and a few huge messages."""
    _every_op_with_fatal_arrays(target)

    @EXAMPLES
    @given(st.one_of(raw_frames, mutations, insider_payloads, compact_bodies))
    def attack(case) -> None:
        _attack(target, genuine, case)

    @BIG_EXAMPLES
    @given(big_messages)
    def flood(case) -> None:
        target.refuses(_many_frames(target, *case))

    attack()
    flood()


def test_fuzzed_frames_leave_a_live_server_serving_correct_values(make_cluster) -> None:
    """Garbage, mutations, replays, sealed nonsense and huge messages sent to a server change nothing
    it holds."""
    cluster: Cluster = make_cluster("dist_async", 1, 1)
    (kv,) = cluster.workers
    kv.init(KEY, VALUE)
    target = Target.server(cluster, insider(kv, "fuzzer"))
    pull = Message(Op.PULL, {"keys": [KEY], "sizes": [VALUE.size]}, seq=1, sender=0)
    genuine = target.sealer.seal(pull, "server0")
    try:
        target.answer(genuine, 1)  # the genuine pull, once: every later copy of it is a replay
        _fuzz(target, genuine)
        assert target.refuses([b"junk"]).body == {"spec": None, "num_update": 0}  # no optimizer was set
    finally:
        target.close()
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()
    np.testing.assert_array_equal(kv.pull(KEY), VALUE)
    kv.push(KEY, VALUE * 2)  # and it still serves the real worker
    np.testing.assert_array_equal(kv.pull(KEY), VALUE * 2)


def test_fuzzed_frames_leave_the_scheduler_running_the_cluster(make_cluster) -> None:
    """Garbage, mutated heartbeats, sealed nonsense and huge messages sent to the scheduler neither
    stop it nor count a worker out."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1)
    target = Target.scheduler(cluster, insider(cluster.workers[0], "fuzzer"))
    genuine = target.sealer.seal(Message(Op.HEARTBEAT, {"role": "worker", "rank": 0}, seq=1, sender=0),
                                 "scheduler")
    try:
        target.answer(genuine, 1)
        _fuzz(target, genuine)
    finally:
        target.close()
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()
    cluster.run(lambda kv: kv.init("after", VALUE))  # init's barrier still needs both workers
    cluster.run(lambda kv: kv.barrier())
    for out in cluster.run(lambda kv: kv.pull("after")):
        np.testing.assert_array_equal(out, VALUE)
    _, log = next((p, lg) for name, p, lg in cluster.procs.procs if name == "scheduler")
    assert "left" not in log.read_text() and "is lost" not in log.read_text()


# -- SHM_ATTACH (kvstore/net/shm.py): bodies, paths and descriptors a server must refuse, and live ---
ATTACH_KEY = "fuzz-shm-target"  # pushed through the genuine segment: KEY's value never changes
attach_values = st.one_of(WIRE_INTS, st.text(max_size=4), st.binary(max_size=20), st.none(), st.booleans(),
                          st.floats(), st.lists(WIRE_INTS, max_size=2))
attach_bodies = st.one_of(
    st.dictionaries(st.sampled_from(["pid", "fd", "nonce", "bytes", "x"]), attach_values, max_size=5),
    st.fixed_dictionaries({"pid": st.one_of(st.integers(-3, 2**22 + 9), WIRE_INTS),
                           "fd": st.one_of(st.integers(-2, 70), WIRE_INTS),
                           "nonce": st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=40)),
                           "bytes": st.one_of(st.integers(-1, 1 << 41), st.sampled_from([8192, 2 << 20,
                                                                                          1 << 40]))}),
    attach_values)
shm_fields = st.one_of(st.lists(st.one_of(WIRE_INTS, st.sampled_from([4096, 8192, 4095, 2 << 20]), st.none(),
                                          st.booleans(), st.text(max_size=2)), max_size=3), attach_values)
shm_pushes = st.tuples(shm_fields, st.lists(st.sampled_from([["float32", [1024]], ["float32", [2**20]],
                                                             ["float64", [2**40]], ["int32", [0]]]),
                                            max_size=2),
                       st.sampled_from([ATTACH_KEY, KEY, "unheld"]))


def _attach_reply(target: Target, body: Any) -> Message:
    """Send a sealed SHM_ATTACH of ``body`` (anything); its reply (OK or ERROR), the server alive."""
    seq = next(_bad_seqs)
    header = {"op": int(Op.SHM_ATTACH), "seq": seq, "sender": 0, "body": body, "arrays": [],
              "auth": target.auth()}
    target.sock.send_multipart(sealed_raw(target.sealer, header, []))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert target.proc.poll() is None, f"{target.to} exited with status {target.proc.returncode}"
        if target.sock.poll(50):
            reply = open_frames(target.sock.recv_multipart())
            if reply.seq == seq:
                assert reply.op in (Op.OK, Op.ERROR) and (reply.op is Op.ERROR or isinstance(
                    reply.body["attached"], bool) and isinstance(reply.body["why"], str)), reply
                return reply
    raise AssertionError(f"{target.to} did not answer SHM_ATTACH {body!r:.80} within 10 s")


def _refused_attach(target: Target, body: Any) -> str:
    """The reason the server gives for not mapping ``body``'s segment (an ERROR counts as a refusal)."""
    reply = _attach_reply(target, body)
    if reply.op is Op.ERROR:
        return reply.body["message"]
    assert reply.body["attached"] is False and reply.body["why"], (body, reply.body)
    return reply.body["why"]


def _bad_descriptors(stack: contextlib.ExitStack, tmp: Path, nonce: bytes) -> list[tuple[int, int]]:
    """(size, fd) of this process's descriptors no server may map, each with the nonce at its start
    where it can hold one: files, pipes, sockets, devices, a directory, memfds unsealed, read-only,
    of huge pages or of another size."""
    def fd(value: int) -> int:
        stack.callback(os.close, value)
        return value

    plain = fd(os.open(tmp / "plain", os.O_RDWR | os.O_CREAT))
    unsealed = fd(os.memfd_create("fuzz", os.MFD_CLOEXEC))
    sealed = shm.Segment(2 << 20)
    stack.callback(sealed.close_fd)
    found = [plain, unsealed, *(fd(end) for end in os.pipe()), *(fd(s.detach()) for s in socket.socketpair()),
             fd(os.open("/dev/null", os.O_RDWR)), fd(os.open(tmp, os.O_RDONLY)),
             fd(os.open(f"/proc/self/fd/{sealed.fd}", os.O_RDONLY)), fd(os.eventfd(0))]
    for each in (plain, unsealed):
        os.ftruncate(each, 2 << 20)
        os.pwrite(each, nonce, 0)
    with contextlib.suppress(OSError):  # where this kernel makes one
        huge = fd(os.memfd_create("fuzz-huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING))
        os.ftruncate(huge, 2 << 20)
        fcntl.fcntl(huge, fcntl.F_ADD_SEALS, shm.OFFERED_SEALS)
        found.append(huge)
    return [(2 << 20, each) for each in found] + [(4 << 20, sealed.fd)]


@pytest.mark.timeout(180)
def test_fuzzed_shm_attach_leaves_a_live_server_serving(make_cluster, tmp_path: Path) -> None:
    """SHM_ATTACH with malformed bodies, paths of other processes (pid 1, the server, the scheduler, none)
    and this process's descriptors that are not a sealed read-write memfd of the size offered is
    refused with a reason; pushes naming fuzzed ranges of a genuine segment get an answer; the server
    lives, and its values and the worker's own shared memory are intact."""
    cluster: Cluster = make_cluster("dist_async", 1, 1)
    (kv,) = cluster.workers
    kv.init(KEY, VALUE)
    kv.init(ATTACH_KEY, np.zeros(1024, np.float32))
    target = Target.server(cluster, insider(kv, "fuzzer"))
    pids = {name: proc.pid for name, proc, _ in cluster.procs.procs}
    nonce = bytes(shm.NONCE_BYTES)
    try:
        with contextlib.ExitStack() as stack:
            for size, fd in _bad_descriptors(stack, tmp_path, nonce):
                _refused_attach(target, {"pid": os.getpid(), "fd": fd, "nonce": nonce, "bytes": size})
        for pid, fds in ((1, range(4)), (pids["server 0"], range(40)), (pids["scheduler"], range(20)),
                         (2**22 + 7, range(2))):
            for fd in fds:
                _refused_attach(target, {"pid": pid, "fd": fd, "nonce": nonce, "bytes": 2 << 20})

        @EXAMPLES
        @given(attach_bodies)
        def attach(body) -> None:
            _refused_attach(target, body)

        attach()
        segment = shm.Segment(4 << 20)
        try:
            assert _attach_reply(target, segment.attach_body()).body == {"attached": True, "why": ""}

            @EXAMPLES
            @given(shm_pushes)
            def push(case) -> None:
                offsets, metas, key = case
                header = {"op": int(Op.PUSH), "seq": next(_bad_seqs), "sender": 0, "arrays": metas,
                          "body": {"keys": [key], "sizes": [1024]}, "shm": offsets, "auth": target.auth()}
                frames = sealed_raw(target.sealer, header, [b""] * len(metas))
                target.sock.send_multipart(frames)
                target.probe.seq = next(_probe_seqs)
                target.sock.send_multipart(target.sealer.seal(target.probe, target.to))
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    assert target.proc.poll() is None, f"the server exited with {target.proc.returncode}"
                    if target.sock.poll(50):
                        if open_frames(target.sock.recv_multipart()).seq == target.probe.seq:
                            return
                raise AssertionError("the server did not answer the probe within 10 s")

            push()
        finally:
            segment.close_fd()
    finally:
        target.close()
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()
    np.testing.assert_array_equal(kv.pull(KEY), VALUE)
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MB: through the worker's own segment
    kv.init("fuzz-shm-after", big)
    np.testing.assert_array_equal(kv.pull("fuzz-shm-after"), big)
    assert kv._io.lanes is not None and kv._io.lanes.received >= big.nbytes


# -- row-sparse ops ---------------------------------------------------------------------------------
SKEY, SSHAPE = "fuzz-sparse-table", (8, 3)
IDS, ROWS = np.array([1, 2], np.int64), np.ones((2, 3), np.float32)
INIT = {"key": "fz-new", "shape": [8, 3], "dtype": "float32", "lo": 0, "hi": 8, "init": "uniform"}
PUSH = {"key": SKEY, "round": 0, "last": True}
_bad_seqs = itertools.count(500_000)


def _bad_sparse() -> list[tuple[Op, dict, list[np.ndarray], Any]]:
    """SPARSE_* messages a server must refuse: ``(op, body, arrays, sender)``."""
    i32, f64 = IDS.astype(np.int32), ROWS.astype(np.float64)
    inits = [{"shape": [8]}, {"shape": [8, "3"]}, {"shape": [True, 3]}, {"shape": [8, 2.5]},
             {"shape": [2**64 - 1, 2]}, {"shape": [2, 2**62, 2**62], "hi": 2},
             {"shape": [2, 2**32, 2**32 + 1], "hi": 2}, {"shape": [2**40, 2**40], "hi": 2**40},
             {"shape": [2**33, 4], "hi": 2**33, "dtype": "float64"}, {"shape": "8,3"}, {"dtype": "int32"},
             {"dtype": ["float32"]}, {"dtype": None}, {"lo": -1}, {"hi": 0}, {"hi": 9}, {"lo": True},
             {"hi": 8.0}, {"init": "bogus"}, {"init": 5}, {"init": ["x"]},
             {"init": {"type": "normal", "sigma": "x"}}, {"init": {"type": "normal", "sigma": math.nan}},
             {"init": {"type": "uniform", "high": math.inf}}, {"init": {"type": "uniform", "seed": -1}},
             {"init": {"type": "zeros", "seed": 2**64 - 1}}, {"key": SKEY}, {"key": None}]
    cases: list[tuple[Op, dict, list[np.ndarray], Any]] = [(Op.SPARSE_INIT, {**INIT, **c}, [], 0)
                                                          for c in inits]
    cases += [(Op.SPARSE_INIT, INIT, [], s) for s in (None, 5, True, -1)]
    rows_cases = [[IDS.astype(np.float64), ROWS], [IDS.reshape(2, 1), ROWS], [np.array([1, 8]), ROWS],
                  [np.array([-1, 2]), ROWS], [i32, ROWS], [IDS, f64], [IDS, ROWS[:1]], [IDS, ROWS.T],
                  [IDS], [IDS, ROWS, ROWS], [], [IDS, ROWS.astype(np.int32)], [np.array([1, 2**62]), ROWS]]
    for op, body in ((Op.SPARSE_SET, {"key": SKEY}), (Op.SPARSE_PUSH, PUSH)):
        cases += [(op, body, arrays, 0) for arrays in rows_cases]
        cases += [(op, {**body, "key": "fz-none"}, [IDS, ROWS], 0), (op, body, [IDS, ROWS], 1)]
    cases += [(Op.SPARSE_SET, {"key": SKEY, "state": s, "count": 1}, [IDS, ROWS], 0)
              for s in ("mom", ["x"], 3)]
    cases += [(Op.SPARSE_PUSH, {**PUSH, **c}, [IDS, ROWS], 0)
              for c in ({"round": -1}, {"round": True}, {"round": 2**63}, {"round": 2}, {"round": None},
                        {"last": None}, {"last": 1}, {"key": [1]})]
    cases.append((Op.SPARSE_PUSH, PUSH, [np.arange(9, dtype=np.int64) % 8, np.ones((9, 3), np.float32)], 0))
    pull = {"key": SKEY, "after": 0}
    cases += [(Op.SPARSE_PULL, {**pull, **c}, arrays, 0)
              for c, arrays in (({"after": None}, [IDS]), ({"after": -1}, [IDS]), ({"after": 2**63}, [IDS]),
                                ({"after": True}, [IDS]), ({}, [i32]), ({}, [np.array([8])]), ({}, []),
                                ({}, [IDS, ROWS]), ({}, [IDS.reshape(1, 2)]), ({"key": "fz-none"}, [IDS]))]
    cases += [(Op.SPARSE_PULL, pull, [IDS], s) for s in (None, 1, True)]
    return cases


def _error_for(target: Target, msg: Message) -> Message:
    """Send ``msg`` sealed, then the probe; the ERROR that answers ``msg`` (the only reply before the
    probe's OK)."""
    msg.seq = next(_bad_seqs)
    target.sock.send_multipart(target.sealer.seal(msg, target.to))
    target.probe.seq = next(_probe_seqs)
    target.sock.send_multipart(target.sealer.seal(target.probe, target.to))
    replies: list[Message] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert target.proc.poll() is None, f"{target.to} exited with status {target.proc.returncode}"
        if target.sock.poll(50):
            reply = open_frames(target.sock.recv_multipart())
            if reply.seq == target.probe.seq and reply.op is Op.OK:
                assert [(r.op, r.seq) for r in replies] == [(Op.ERROR, msg.seq)], (msg, replies)
                return replies[0]
            replies.append(reply)
    raise AssertionError(f"{target.to} did not answer the probe within 10 s after {msg}")


@pytest.mark.timeout(120)
def test_malformed_sparse_messages_get_errors_and_change_nothing(make_cluster) -> None:
    """Every malformed SPARSE_INIT/SET/PUSH/PULL (bad types, dtypes, shapes, ids, rounds, senders,
    huge shapes, non-finite init params) gets an ERROR back; the server lives and its table and
    rounds are unchanged."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1)
    (kv,) = cluster.workers
    kv.init(SKEY, shape=SSHAPE, init="uniform")
    before = kv.row_sparse_pull(SKEY, row_ids=np.arange(SSHAPE[0])).rows
    target = Target.server(cluster, insider(kv, "fuzzer"))
    try:
        for op, body, arrays, sender in _bad_sparse():
            _error_for(target, Message(op, dict(body), list(arrays), sender=sender))
    finally:
        target.close()
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()
    np.testing.assert_array_equal(kv.row_sparse_pull(SKEY, row_ids=np.arange(SSHAPE[0])).rows, before)
    kv.push(SKEY, kvstore.RowSparse([3], np.full((1, 3), 5, np.float32), SSHAPE))  # round 0 still open
    np.testing.assert_array_equal(kv.row_sparse_pull(SKEY, row_ids=[3]).rows, np.full((1, 3), 5))
    target = Target.server(cluster, insider(kv, "fuzzer2"))
    try:  # no refused SPARSE_INIT made a table
        assert b"not initialised" in bytes(str(_error_for(target, Message(
            Op.SPARSE_PULL, {"key": "fz-new", "after": 0}, [IDS], sender=0)).body), "utf8")
    finally:
        target.close()


# -- pipeline ops (kvstore/pipeline/link.py, scheduler/pipes.py) ------------------------------------
PIPE_NAMES = {0: "stage 0 (worker 0)", 1: "stage 1 (worker 1)"}
ACT = np.arange(4, dtype=np.float32)


def _bad_pipe_messages() -> list[tuple[Op, dict, list[np.ndarray], Any]]:
    """Well-sealed PIPE_*/other messages to stage 1 of 2 (2 micro-batches, step 0), one bad thing each."""
    one = [ACT]
    cases = [(Op.PIPE_ACT, {"step": s, "mb": 0}, one, 0) for s in ("0", None, True, -1, 2, 2**64 - 1, 0.0)]
    cases += [(Op.PIPE_ACT, {"step": 0, "mb": m}, one, 0) for m in ("0", None, True, -1, 2, 2**63 - 1)]
    cases += [(Op.PIPE_ACT, {"step": 0, "mb": 0}, arrays, 0) for arrays in ([], one * 257)]  # 1..256 tensors
    cases += [(Op.PIPE_ACT, {"step": 0, "mb": 0, "part": p}, one, 0) for p in ("0", None, 1, -1)]
    cases += [(Op.PIPE_ACT, {"step": 0, "mb": 0, "name": n}, one, 0) for n in (0, None, "skip")]
    cases += [(Op.PIPE_ACT, {"step": 0, "mb": 0}, one, s) for s in (1, 5)]  # itself, a stranger
    cases += [(Op.PIPE_GRAD, {"step": 0, "mb": 0}, one, 0), (Op.PUSH, {"step": 0, "mb": 0}, one, 0)]
    cases += [(Op.PIPE_ABORT, body, arrays, sender) for body, arrays, sender in (
        ({}, [], 0), ({"step": True, "message": "x"}, [], 0), ({"step": 0, "message": 5}, [], 0),
        ({"step": 0, "message": "x"}, one, 0), ({"step": 0, "message": "x"}, [], 7))]
    return cases


def _fuzz_stage(kv: Any, link: Any) -> np.ndarray:
    """Send stage 1's socket every bad message and hypothesis' cases, then a sealed sentinel on the same
    connection: once the sentinel is received, everything before it was read without a raise."""
    sealer = insider(kv, "fuzzer")
    found = kv.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": 1}, "stage 1").body["address"]
    target = Target(f"tcp://{found[0]}:{found[1]}", None, sealer, "pipe-1", None)
    genuine = sealer.seal(Message(Op.PIPE_ACT, {"step": 0, "mb": 1}, [ACT], sender=0), "pipe-1")
    try:
        for op, body, arrays, sender in _bad_pipe_messages():
            target.sock.send_multipart(sealer.seal(Message(op, body, list(arrays), sender=sender), "pipe-1"))

        @EXAMPLES
        @given(st.one_of(raw_frames, mutations, insider_payloads, compact_bodies))
        def attack(case) -> None:
            if isinstance(case[-1], bool):  # a compact body
                frames = sealed_compact(sealer, *case)
            else:
                frames = case if isinstance(case, list) else (
                    _mutate(genuine, *case) if isinstance(case[0], str) else _insider_frames(target, case))
            target.sock.send_multipart(frames)

        attack()
        sentinel = Message(Op.PIPE_ACT, {"step": 0, "mb": 1}, [ACT + 1], sender=0)
        target.sock.send_multipart(sealer.seal(sentinel, "pipe-1"))
        link.receive(Op.PIPE_ACT, 0, 1)
    finally:
        target.close()
    kv.barrier()  # stage 0 sends its activation now
    (array,), _ = link.receive(Op.PIPE_ACT, 0, 0)
    assert link.inbox == {} and link.drops.totals["unexpected"] >= len(_bad_pipe_messages()) - 1
    return array


@pytest.mark.timeout(180)
def test_malformed_pipe_messages_leave_a_stage_receiving(make_cluster) -> None:
    """Garbage, mutated activations and well-sealed PIPE_* messages with one bad field, array, sender or
    op, sent to a pipeline stage, are dropped without a raise; it then receives its neighbour's activation."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1, connect=False)
    cluster.connect(request_timeout=60.0)

    def run(kv):
        link = StageLink(kv, neighbour_routes(None if kv.rank == 0 else 0, 1 if kv.rank == 0 else None),
                         PIPE_NAMES, chunks=2)
        try:
            if kv.rank == 1:
                array = _fuzz_stage(kv, link)
            else:
                kv.barrier()
                link.send(1, Op.PIPE_ACT, {"step": 0, "mb": 0}, [ACT])
                array = None
            kv.barrier()  # a closed DEALER drops what it has not sent yet
            return array
        finally:
            link.close()

    np.testing.assert_array_equal(cluster.run(run)[1], ACT)
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()


BAD_PIPE_REQUESTS = [(Op.PIPE_PUBLISH, {"host": "h", "port": 8}, [ACT]), (Op.PIPE_LOOKUP, {"rank": 0}, [ACT])]
BAD_PIPE_REQUESTS += [(Op.PIPE_PUBLISH, b, []) for b in (
    {}, {"host": 5, "port": 80}, {"host": "h", "port": True}, {"host": "h", "port": 70000},
    {"host": "h", "port": -1}, {"host": "h" * 300, "port": 1}, {"host": ["h"], "port": 1})]
BAD_PIPE_REQUESTS += [(Op.PIPE_LOOKUP, {"rank": r}, []) for r in (True, -1, 2, 2**64 - 1, "0", None, 0.0)]


@pytest.mark.timeout(120)
def test_malformed_pipe_requests_get_errors_and_record_nothing(make_cluster) -> None:
    """A PIPE_PUBLISH/PIPE_LOOKUP from a peer that is no registered worker, or with a bad field from one
    that is, gets an ERROR; the scheduler lives and its address book stays empty."""
    from kvstore.errors import KVStoreError

    cluster: Cluster = make_cluster("dist_sync", 2, 1)
    kv = cluster.workers[0]
    target = Target.scheduler(cluster, insider(kv, "fuzzer"))
    try:
        for op, body in ((Op.PIPE_PUBLISH, {"host": "127.0.0.1", "port": 80}), (Op.PIPE_LOOKUP, {"rank": 0})):
            assert b"registered worker" in bytes(str(_error_for(target, Message(op, body, sender=0)).body),
                                                 "utf8")
    finally:
        target.close()
    for op, body, arrays in BAD_PIPE_REQUESTS:
        with pytest.raises(KVStoreError):
            kv._path.wait([kv._io.submit(SCHEDULER, Message(op, body, arrays), "a malformed request")])
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()
    assert [w.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": r}, "lookup").body["address"]
            for r, w in enumerate(cluster.workers)] == [None, None]


def _stage_attacks(kv: Any, to: str) -> list[list[Any]]:
    """Messages to a stage's socket (``to``, e.g. "pipe-1") that must be dropped: bad seals of a
    well-formed activation claiming stage 0 (sealed for the other stage, with the secret but not the
    session, with another secret, a forged or cut MAC, the MAC of another message, a replay), junk, and
    messages of too many frames, sealed and not."""
    act = Message(Op.PIPE_ACT, {"step": 0, "mb": 0}, [ACT], sender=0)
    sealer = insider(kv, "fuzzer")
    good = sealer.seal(act, to)
    other = "pipe-0" if to == "pipe-1" else "pipe-1"
    bad = [sealer.seal(act, other), Channel(derive_key(SECRET), "fuzzer").seal(act, to),
           Channel(derive_key("another secret"), "fuzzer").seal(act, to)]
    bad += [[b"", *good[1:]], [bytes(MAC_BYTES), *good[1:]], [bytes(good[0])[:7], *good[1:]],
            [sealer.seal(Message(Op.PIPE_ACT, {"step": 0, "mb": 1}, [ACT], sender=0), to)[0], *good[1:]]]
    replayed = sealer.seal(Message(Op.PIPE_ACT, {"step": 99, "mb": 0}, [ACT], sender=0), to)  # dropped: step
    bad += [replayed, replayed, [b"junk"], [b"x"] * 3, [b"", b"\xc1", b""]]
    header = {"op": int(Op.PIPE_ACT), "seq": 0, "sender": 0, "body": {"step": 0, "mb": 0},
              "arrays": [["float32", [0]]] * 3, "auth": [sealer.label, next(sealer._counter), to]}
    many = sealed_raw(sealer, header, [b""] * (transport.MAX_FRAMES + 1))
    bad += [many, [b"", *many[1:]], [b""] * 100_000]
    return bad


@pytest.mark.timeout(120)
def test_bad_seals_oversized_and_overlong_messages_leave_stages_training(make_cluster) -> None:
    """While two stages train, each socket gets bad seals, junk, frames over the frame limit (zmq drops
    that connection) and messages of too many frames: no stage raises, every activation and gradient
    arrives intact, and what was sent is counted as dropped."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1, connect=False, KVSTORE_MAX_MESSAGE_BYTES=1 << 20,
                                    KVSTORE_CHUNK_BYTES=1 << 18)
    cluster.connect(request_timeout=30.0)
    done = threading.Event()
    sent: list[int] = []

    def attack() -> None:
        kv = cluster.workers[0]
        for rank in (1, 0):
            found = kv.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": rank}, "a stage").body["address"]
            sock, over = dealer(f"tcp://{found[0]}:{found[1]}"), dealer(f"tcp://{found[0]}:{found[1]}")
            try:
                for frames in _stage_attacks(kv, f"pipe-{rank}"):
                    sock.send_multipart(frames)
                over.send_multipart([b"m" * 16, b"h", bytes((1 << 20) + 1)])  # zmq drops that connection
                sent.append(rank)
            finally:
                sock.close(linger=20_000)  # what is not sent yet still goes (the stage drains as it trains)
                over.close()
        done.set()

    def train(kv) -> tuple[int, dict]:
        link = StageLink(kv, neighbour_routes(None if kv.rank == 0 else 0, 1 if kv.rank == 0 else None),
                         PIPE_NAMES, chunks=1)
        try:
            if kv.rank == 0:
                kv.barrier()  # both links are up
                threading.Thread(target=attack, daemon=True).start()
            else:
                kv.barrier()
            step, extra = 0, 20
            while extra:
                more = 1 if kv.rank == 1 or not done.is_set() else 0
                if kv.rank == 0:
                    extra -= 1 - more  # 20 steps after the attack is sent
                    link.send(1, Op.PIPE_ACT, {"step": step, "mb": 0, "extra": extra}, [ACT + step])
                    np.testing.assert_array_equal(link.receive(Op.PIPE_GRAD, step, 0)[0][0], ACT - step)
                else:
                    (act,), body = link.receive(Op.PIPE_ACT, step, 0)
                    np.testing.assert_array_equal(act, ACT + step)
                    link.send(0, Op.PIPE_GRAD, {"step": step, "mb": 0}, [ACT - step])
                    extra = body["extra"]
                step += 1
            kv.barrier()
            return step, dict(link.drops.totals)
        finally:
            link.close()

    (steps0, drops0), (steps1, drops1) = cluster.run(train)
    assert steps0 == steps1 >= 20 and sent == [1, 0]
    for drops in (drops0, drops1):
        assert drops == {"unreadable": 11, "unexpected": 1, "frames": 3}, drops
    assert all(proc.poll() is None for _, proc, _ in cluster.procs.procs), cluster.procs.output()

"""Fuzzing a live server and scheduler with hypothesis: garbage, mutated and replayed messages,
and well-sealed messages with nonsense inside.  Each must be refused (answered with an ERROR),
the process must keep serving, and what it stores must not change."""

from __future__ import annotations

import msgpack
import numpy as np
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.net.protocol import PROTOCOL_VERSION, Message, Op

from .conftest import Cluster, insider

EXAMPLES = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
VALUE = np.arange(6, dtype=np.float32)

WIRE_INTS = st.integers(-2**63, 2**64 - 1)  # what msgpack can carry
raw_frames = st.lists(st.binary(max_size=80), min_size=1, max_size=5)
mutations = st.tuples(st.sampled_from(["flip", "truncate", "append", "drop", "replay", "unsign"]),
                      st.integers(0, 10_000), st.integers(0, 255))
array_metas = st.lists(st.tuples(st.sampled_from(["float32", "float64", "int64", "bogus", 7]),
                                 st.lists(st.one_of(st.integers(0, 4), st.just(2**40), st.integers(-3, -1)),
                                          max_size=3)).map(list), max_size=2)
headers = st.fixed_dictionaries({
    "v": st.one_of(st.just(PROTOCOL_VERSION), st.integers(-2, 9)),
    "op": st.one_of(st.sampled_from([int(op) for op in Op]), st.integers(-5, 300)),
    "seq": st.one_of(st.integers(0, 2**31), st.text(max_size=3)),
    "sender": st.one_of(st.none(), st.integers(-3, 5), st.just(2**62)),
    "body": st.one_of(st.dictionaries(st.sampled_from(["key", "keys", "sizes", "lo", "spec", "params",
                                                       "count", "names", "rank"]),
                                      st.one_of(WIRE_INTS, st.text(max_size=5), st.none(), st.floats(),
                                                st.lists(WIRE_INTS, max_size=3)), max_size=4),
                      WIRE_INTS, st.text(max_size=4)),
    "arrays": array_metas,
})
insider_payloads = st.tuples(headers, st.lists(st.binary(max_size=40), max_size=3))


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


def _answered(sock: zmq.Socket, frames: list) -> None:
    """Send ``frames``; every message, good or bad, gets exactly one reply within 5 s."""
    sock.send_multipart(frames)
    assert sock.poll(5000), f"no answer to {frames!r:.200}"
    sock.recv_multipart()


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def test_fuzzed_frames_leave_a_live_server_serving_correct_values(make_cluster) -> None:
    """Garbage, mutations, replays and sealed nonsense sent to a server change nothing it holds."""
    cluster: Cluster = make_cluster("dist_async", 1, 1)
    (kv,) = cluster.workers
    kv.init("fz", VALUE)
    sealer = insider(kv, "fuzzer")
    pull = Message(Op.PULL, {"keys": ["fz"], "sizes": [VALUE.size]}, seq=1, sender=0)
    genuine = sealer.seal(pull, "server0")
    sock = _dealer(kv._servers[0])
    _answered(sock, genuine)  # the genuine pull, once: every later copy of it is a replay

    @EXAMPLES
    @given(st.one_of(raw_frames, mutations, insider_payloads))
    def attack(case) -> None:
        if isinstance(case, list):
            frames = case
        elif isinstance(case[0], str):
            frames = _mutate(genuine, *case)
        else:
            header, arrays = case
            payload = [msgpack.packb(header, use_bin_type=True), *arrays]
            frames = [sealer._mac(payload), *payload]  # authentic, but nonsense inside
        _answered(sock, frames)

    try:
        attack()
    finally:
        sock.close()
    server, _ = next((p, log) for name, p, log in cluster.procs.procs if name == "server 0")
    assert server.poll() is None, "the server died"
    np.testing.assert_array_equal(kv.pull("fz"), VALUE)
    kv.push("fz", VALUE * 2)  # and it still serves the real worker
    np.testing.assert_array_equal(kv.pull("fz"), VALUE * 2)


def test_fuzzed_frames_leave_the_scheduler_running_the_cluster(make_cluster) -> None:
    """Garbage and mutated heartbeats sent to the scheduler neither stop it nor count a worker out."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1)
    sealer = insider(cluster.workers[0], "fuzzer")
    genuine = sealer.seal(Message(Op.HEARTBEAT, {"role": "worker", "rank": 0}, sender=0), "scheduler")
    sock = _dealer(cluster.cfg.root_address)
    _answered(sock, genuine)

    @EXAMPLES
    @given(st.one_of(raw_frames, mutations))
    def attack(case) -> None:
        _answered(sock, case if isinstance(case, list) else _mutate(genuine, *case))

    try:
        attack()
    finally:
        sock.close()
    cluster.run(lambda kv: kv.init("after", VALUE))  # init's barrier still needs both workers
    cluster.run(lambda kv: kv.barrier())
    for out in cluster.run(lambda kv: kv.pull("after")):
        np.testing.assert_array_equal(out, VALUE)
    _, log = next((p, lg) for name, p, lg in cluster.procs.procs if name == "scheduler")
    assert "left" not in log.read_text() and "is lost" not in log.read_text()


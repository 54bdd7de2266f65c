"""What a stranger (no secret) can make a pipeline stage spend (kvstore/pipeline/link.py), measured on
two in-process stages of a real cluster with the stranger in a process of its own: memory it floods
in while the stage is not receiving, memory held after the flood drained, and the steps a stage loses
to small junk sent at full rate.  Each stage does a few ms of work a step (standing for its layers).

The short versions here fit the first tier (<= 10 s, <= 300 MB each); the full 1.5 GiB flood and a
longer full-rate junk run are marked ``flood`` (the second tier)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import heap
from kvstore.net.protocol import Op
from kvstore.pipeline.link import StageLink, neighbour_routes
from tests.helpers import Processes, poll_for, python

from .test_hardening_memory import rss_mb

MB = 1 << 20
NAMES = {0: "stage 0 (worker 0)", 1: "stage 1 (worker 1)"}
ACT = np.arange(1024, dtype=np.float32)
WORK = 0.004  # seconds of (busy) work per stage and step

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")

# A stranger speaking raw ZMTP 3 (NULL mechanism, as a DEALER) over one TCP connection: sends `total`
# bytes (0: until killed) of junk messages, each two small frames and, when `size` > 0, a frame of
# `size` bytes, as fast as TCP takes them (small ones 4096 to a write); prints BLOCKED when the stage
# has taken nothing for 0.3 s, SENT / DONE with the messages and bytes taken.
FLOODER = """
import select, socket, struct, sys
host, port, total, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def frame(n, more):
    return bytes([1 if more else 0, n]) if n < 256 else bytes([3 if more else 2]) + struct.pack(">Q", n)
def read(n):
    data = b""
    while len(data) < n:
        data += s.recv(n - len(data))
    return data
s = socket.create_connection((host, port))
s.sendall(b"\\xff" + bytes(8) + b"\\x7f" + b"\\x03\\x00" + b"NULL".ljust(20, b"\\0") + bytes(32))
read(64)
ready = b"\\x05READY" + b"\\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
s.sendall(bytes([4, len(ready)]) + ready)
flags = read(1)[0]
read(read(1)[0] if flags == 4 else struct.unpack(">Q", read(8))[0])
head = frame(16, True) + b"m" * 16 + frame(12, bool(size)) + b"not a header"
one = head + (frame(size, False) + bytes(size) if size else b"")
per = 1 if size else 4096
chunk = memoryview(one * per)
s.setblocking(False)
sent = count = off = 0
blocked = False
while not total or sent < total:
    if not select.select([], [s], [], 0.3)[1]:
        if not blocked:
            print("BLOCKED", count, sent + off, flush=True)
        blocked = True
        continue
    blocked = False
    off += s.send(chunk[off:])
    if off == len(chunk):
        sent, count, off = sent + len(chunk), count + per, 0
        print("SENT", count, sent, flush=True)
print("DONE", count, sent, flush=True)
s.close()
"""


class Flooder:
    """The stranger's process and what it printed."""

    def __init__(self, procs: Processes, address: list, total: int, size: int) -> None:
        argv = [python(), "-c", FLOODER, address[0], str(address[1]), str(total), str(size)]
        self.proc = procs.start(f"flooder-{size}", argv, {})
        self.log = procs.workdir / f"flooder-{size}.log"

    def said(self, word: str) -> bool:
        """Whether the flooder has printed ``word`` (BLOCKED, DONE)."""
        return self.log.exists() and f"{word} " in self.log.read_text()

    def sent(self) -> int:
        """The bytes the flooder has had accepted so far."""
        return self._last()[1]

    def count(self) -> int:
        """The whole messages the flooder has had accepted so far."""
        return self._last()[0]

    def _last(self) -> tuple[int, int]:
        text = self.log.read_text() if self.log.exists() else ""
        found = re.findall(r"(?:SENT|DONE|BLOCKED) (\d+) (\d+)", text)
        return (int(found[-1][0]), int(found[-1][1])) if found else (0, 0)

    def stop(self) -> None:
        """Kill the flooder and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def work(seconds: float = WORK) -> None:
    """Busy work standing for a stage's layers (holds the GIL, as torch's Python side does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def own_address(kv) -> list:
    """Where ``kv``'s pipeline socket listens (from the scheduler's book)."""
    return kv.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": kv.rank}, "own").body["address"]


def steps(kv, link: StageLink, first: int, until: Any) -> tuple[int, int]:
    """Train-like steps from step ``first``: stage 0 sends an activation, stage 1 answers a gradient,
    each with WORK of work, until stage 0's ``until()`` is true (it tells stage 1 with its last one).
    Every array is checked; returns (the next step, how many were done)."""
    step = first
    while True:
        if kv.rank == 0:
            more = not until()
            link.send(1, Op.PIPE_ACT, {"step": step, "mb": 0, "more": more}, [ACT + step])
            (grad,), _ = link.receive(Op.PIPE_GRAD, step, 0)
            np.testing.assert_array_equal(grad, (ACT + step) * 2)
            work()
        else:
            (act,), body = link.receive(Op.PIPE_ACT, step, 0)
            np.testing.assert_array_equal(act, ACT + step)
            work()
            link.send(0, Op.PIPE_GRAD, {"step": step, "mb": 0}, [act * 2])
            more = body["more"]
        step += 1
        if not more:
            return step, step - first


def run_stages(make_cluster, victim, attacker, timeout: float = 30.0) -> list[Any]:
    """A 2-stage link pair on a real cluster: stage 1 runs ``victim(kv, link)``, stage 0
    ``attacker(kv, link)`` (named for what stage 1 suffers); returns what each returns."""
    heap.tune()  # as kvstore.create does in a stage's process (what a refused message's drop relies on)
    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=timeout)

    def run(kv):
        routes = neighbour_routes(None if kv.rank == 0 else 0, 1 if kv.rank == 0 else None)
        link = StageLink(kv, routes, NAMES, chunks=1)
        try:
            return (attacker if kv.rank == 0 else victim)(kv, link)
        finally:
            link.close()

    return cluster.run(run)


def flood_then_drain(make_cluster, tmp_path: Path, total: int, size: int, peak_limit: float,
                     after_limit: float, within: float) -> None:
    """A stranger floods stage 1 with ``total`` bytes of junk messages of a ``size``-byte frame while it
    is not receiving: its RSS grows < ``peak_limit`` MiB.  The stages then train until the flood has
    drained and RSS is back within ``after_limit`` MiB of where it started (``within`` seconds)."""
    procs = Processes(tmp_path)
    shared: dict[str, Any] = {}

    def victim(kv, link: StageLink) -> tuple:
        steps(kv, link, 0, None)  # warm up: one step
        base = peak = rss_mb_self()
        flooder = shared["flooder"] = Flooder(procs, own_address(kv), total, size)

        def settled() -> bool:
            nonlocal peak
            peak = max(peak, rss_mb_self())
            return flooder.said("BLOCKED") or flooder.said("DONE")

        poll_for(settled, 30, "the flood to be held back or done")
        peak = max(peak, rss_mb_self())
        held = flooder.sent()
        shared["base"], shared["drops"] = base, link.drops.totals
        kv.barrier()  # stage 0 starts training
        _, done = steps(kv, link, 1, None)
        return base, peak, held, done, rss_mb_self(), link.drops.totals["unreadable"]

    def attacker(kv, link: StageLink) -> int:
        steps(kv, link, 0, lambda: True)
        kv.barrier()
        deadline = time.monotonic() + within
        flooder = shared["flooder"]

        def drained() -> bool:  # every junk message was read and dropped, and RSS came back
            return time.monotonic() > deadline or (
                flooder.said("DONE") and shared["drops"]["unreadable"] >= flooder.count()
                and rss_mb_self() - shared["base"] < after_limit)

        return steps(kv, link, 1, drained)[1]

    try:
        sent_steps, (base, peak, held, done, after, dropped) = run_stages(make_cluster, victim, attacker)
    finally:
        if "flooder" in shared:
            shared["flooder"].stop()
    flooder = shared["flooder"]
    print(f"\n{total / MB:.0f} MiB flood in {size / MB:.0f} MiB messages: {held / MB:.0f} MiB taken while "
          f"the stage was not receiving; RSS {base:.0f} -> peak {peak:.0f} -> {after:.0f} MiB after {done} "
          f"steps; {dropped} junk messages dropped")
    assert peak - base < peak_limit, f"the stage grew {peak - base:.0f} MiB under the flood"
    assert done == sent_steps, "a legitimate activation was lost"
    assert flooder.said("DONE"), f"the flood did not drain in {within} s ({flooder.sent() / MB:.0f} MiB sent)"
    assert dropped == flooder.count(), f"{dropped} of {flooder.count()} junk messages were dropped"
    assert after - base < after_limit, f"the stage held {after - base:.0f} MiB after the flood drained"


def rss_mb_self() -> float:
    """This process's resident memory in MiB (the stages are in-process)."""
    return rss_mb(os.getpid())


@pytest.mark.timeout(60)
def test_a_strangers_flood_is_held_back_and_the_memory_goes_back(make_cluster, tmp_path: Path) -> None:
    """A stranger floods 200 MiB in 4 MiB messages into a stage that is not receiving: the stage grows
    < 40 MiB (zmq stops reading that connection; it used to take all of it, and keep most after it
    drained), trains on, drops every junk message, and ends < 24 MiB above where it started."""
    flood_then_drain(make_cluster, tmp_path, 200 * MB, 4 * MB, peak_limit=40, after_limit=24, within=8)


def junk_during_training(make_cluster, tmp_path: Path, seconds: float, grow_limit: float
                         ) -> tuple[float, float]:
    """Stages train ``seconds`` alone, then ``seconds`` while a stranger sends small junk at full rate:
    the stage grows < ``grow_limit`` MiB, junk is dropped, and every legitimate array arrives (each is
    checked).  Returns the steps/s before and during the junk (what ``benchmarks/stage_junk.py``
    reports: a rate is a benchmark's figure, never a test's assertion)."""
    procs = Processes(tmp_path)
    shared: dict[str, Any] = {}

    def victim(kv, link: StageLink) -> tuple:
        shared["address"] = own_address(kv)
        kv.barrier()
        step, quiet = steps(kv, link, 0, None)
        base = shared["base"] = rss_mb_self()
        kv.barrier()  # the flooder runs
        _, flooded = steps(kv, link, step, None)
        return base, rss_mb_self(), quiet, flooded, link.drops.totals["unreadable"]

    def attacker(kv, link: StageLink) -> tuple:
        kv.barrier()
        end = time.monotonic() + seconds
        started = time.monotonic()
        step, _ = steps(kv, link, 0, lambda: time.monotonic() > end)
        quiet = time.monotonic() - started
        flooder = shared["flooder"] = Flooder(procs, shared["address"], 0, 0)
        poll_for(lambda: flooder.sent() > 0, 10, "the flooder to start")
        kv.barrier()
        started = time.monotonic()
        peak = [0.0]

        def over() -> bool:
            peak[0] = max(peak[0], rss_mb_self())
            grown = peak[0] - shared["base"]
            return time.monotonic() - started > seconds or grown > 2 * grow_limit  # ends early if it grows

        steps(kv, link, step, over)
        return quiet, time.monotonic() - started, peak[0]

    try:
        (quiet_s, flood_s, peak), (base, after, quiet, flooded, dropped) = run_stages(make_cluster, victim,
                                                                                     attacker)
    finally:
        if "flooder" in shared:
            shared["flooder"].stop()
    before_rate, during_rate = quiet / quiet_s, flooded / flood_s
    print(f"\nsmall junk at full rate: {before_rate:.1f} -> {during_rate:.1f} steps/s; "
          f"RSS {base:.0f} -> peak {peak:.0f} MiB; {dropped} junk messages dropped")
    assert peak - base < grow_limit, f"the stage grew {peak - base:.0f} MiB under the junk"
    assert dropped > 0
    return before_rate, during_rate


@pytest.mark.timeout(60)
def test_small_junk_at_full_rate_costs_a_stage_little(make_cluster, tmp_path: Path) -> None:
    """Small junk sent at full rate during 2 s of training: the stage grows < 24 MiB (it used to queue
    all of it, +50 MiB in 0.5 s), drops the junk, and trains on with every array arriving."""
    junk_during_training(make_cluster, tmp_path, 2.0, grow_limit=24)


@pytest.mark.flood
@pytest.mark.timeout(180)
def test_a_strangers_full_flood_at_the_frame_limit(make_cluster, tmp_path: Path) -> None:
    """A stranger floods 1.5 GiB in messages of one 16 MiB frame (the default frame limit) into a stage
    that is not receiving: the stage stays under its baseline + 100 MB (about 5 such messages: the 4
    zmq queues and the one it is reading), trains on, and ends < 8 MiB above its baseline (it kept 15
    or 31 MiB in 1 run of 3, the top of zmq's I/O thread's heap arena, before heap.trimming)."""
    flood_then_drain(make_cluster, tmp_path, 1536 * MB, 16 * MB, peak_limit=100, after_limit=8, within=45)


@pytest.mark.flood
@pytest.mark.timeout(120)
def test_small_junk_at_full_rate_for_10_s_holds_no_memory(make_cluster, tmp_path: Path) -> None:
    """Small junk sent at full rate during 10 s of training: the stage grows < 24 MiB (it used to queue
    all of it: 4.7 GB) and every array arrives.  The steps/s it keeps: benchmarks/stage_junk.py."""
    junk_during_training(make_cluster, tmp_path, 10.0, grow_limit=24)

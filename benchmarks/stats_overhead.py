"""What the worker's counters (issue 21) cost per call: small-key pushpull round trips with the
counters on, against the same store with them replaced by a do-nothing meter, in one cluster.

    python benchmarks/stats_overhead.py [--blocks 10] [--calls 2000]

Starts a real 1-worker 1-server cluster through ``launch.py``. The worker alternates blocks of
``--calls`` pushpulls of a 4-float key with the real meter and with the do-nothing one (ABAB..., so
both see the same load on this shared machine), and prints the median microseconds per call of
each and their ratio. The server's counters stay on in both (about 1 us of its time per request).
Last, the counters' own cost per call, timed alone in this process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class NullMeter:
    """The worker meter's interface, doing nothing."""

    def begin(self, name: str) -> float:
        return 0.0

    def end(self, name: str, started: float, blocked: str | None = None) -> None:
        return None

    def blocked_for(self, kind: str, seconds: float) -> None:
        return None

    def sent(self, nbytes: int) -> None:
        return None

    def received(self, nbytes: int) -> None:
        return None

    def snapshot(self, window_blocked_s: float) -> dict:
        return {}


def worker(blocks: int, calls: int) -> None:
    """Inside the cluster: time the blocks and print one line per meter."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    value, out = np.ones(4, np.float32), np.empty(4, np.float32)
    kv.init("w", value)
    meters = {"on": kv._meter, "off": NullMeter()}
    per_call: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(200):  # warm-up
        kv.pushpull("w", value, out=out)
    for block in range(2 * blocks):
        mode = "on" if block % 2 == 0 else "off"
        kv._meter = kv._path._meter = kv._fast.meter = meters[mode]  # the store, data path, fast path
        started = time.perf_counter()
        for _ in range(calls):
            kv.pushpull("w", value, out=out)
        per_call[mode].append((time.perf_counter() - started) / calls * 1e6)
    kv._meter = kv._path._meter = kv._fast.meter = meters["on"]
    on, off = statistics.median(per_call["on"]), statistics.median(per_call["off"])
    print(f"RESULT counters on {on:.1f} us/call, off {off:.1f} us/call, ratio {on / off:.3f} "
          f"(+{on - off:.1f} us)", flush=True)


def meter_cost_us(calls: int = 100_000) -> float:
    """The counters' own cost per pushpull (one op, one blocked span, one send, one receive), in us."""
    from kvstore.client.meter import WorkerMeter

    meter = WorkerMeter(0, "localhost")
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            began = meter.begin("pushpull")
            meter.sent(16)
            meter.blocked_for("pull", 0.0001)
            meter.received(16)
            meter.end("pushpull", began)
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def main() -> None:
    """Run the cluster and print the worker's result line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.blocks, args.calls)
    done = subprocess.run([sys.executable, "launch.py", "-n", "1", "-s", "1", __file__, "--worker",
                           "--blocks", str(args.blocks), "--calls", str(args.calls)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if "RESULT" in line]
    if done.returncode != 0 or not lines:
        sys.exit(f"the cluster failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    print(lines[0].split("RESULT ", 1)[1])
    print(f"the counters alone: {meter_cost_us():.2f} us per pushpull (best of 5 x 100,000)")


if __name__ == "__main__":
    main()

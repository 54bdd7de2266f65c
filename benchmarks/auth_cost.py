"""What ``KVSTORE_AUTH=full`` costs against the default (MACs over headers and frame lengths only).

    python benchmarks/auth_cost.py [--mb 64] [--iters 10]

Starts a real 1-worker 1-server cluster through ``launch.py`` once per mode (the
same secret, everything else equal); the worker times push+pull round trips of
one float32 key of ``--mb`` megabytes and prints the rate.  The default mode is
the baseline: the table gives each mode's rate and its ratio to it.  The raw
HMAC-SHA256 rate of this machine is printed too, as the floor of what full mode
adds per byte (each payload byte is MAC'd twice: sent and received, both ways).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(mb: int, iters: int) -> None:
    """Inside the cluster: time push+pull round trips and print ``RATE <MB/s>``."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    n = mb * 1024 * 1024 // 4
    value, out = np.ones(n, np.float32), np.empty(n, np.float32)
    kv.init("w", value)
    for _ in range(2):  # warm-up
        kv.pushpull("w", value, out=out)
    started = time.perf_counter()
    for _ in range(iters):
        kv.pushpull("w", value, out=out)
    seconds = time.perf_counter() - started
    print(f"RATE {2 * mb * iters / seconds:.1f}", flush=True)
    kv.close()


def run(mode: str, mb: int, iters: int) -> float:
    """Launch the cluster with ``KVSTORE_AUTH=mode``; return the worker's MB/s."""
    env = {**os.environ, "KVSTORE_AUTH": mode, "KVSTORE_SECRET": "benchmark-secret",
           "KVSTORE_BIGARRAY_BOUND": str(1 << 40)}
    done = subprocess.run([sys.executable, "launch.py", "-n", "1", "-s", "1", __file__, "--worker",
                           "--mb", str(mb), "--iters", str(iters)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    match = re.search(r"RATE ([\d.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"the {mode} run failed:\n{done.stdout}\n{done.stderr}")
    return float(match.group(1))


def hmac_rate(mb: int) -> float:
    """MB/s of HMAC-SHA256 over an ``mb``-megabyte buffer on this machine."""
    data = bytes(mb * 1024 * 1024)
    started = time.perf_counter()
    hmac.new(b"k" * 32, data, hashlib.sha256).digest()
    return mb / (time.perf_counter() - started)


def message_cost() -> tuple[float, float]:
    """Microseconds to seal and open one small PUSH, without a key (the baseline) and with one."""
    import timeit

    import numpy as np

    from kvstore.net.auth import Channel, derive_key
    from kvstore.net.protocol import Message, Op

    costs = []
    for key in (None, derive_key("benchmark-secret")):
        def round_trip(sender: Channel = Channel(key, "worker-x", session=b"s"),
                       receiver: Channel = Channel(key, "server0", session=b"s"),
                       value: np.ndarray = np.ones(1, np.float32)) -> None:
            receiver.open(sender.seal(Message(Op.PUSH, {"key": "w"}, [value], seq=1, sender=0), "server0"))

        costs.append(min(timeit.repeat(round_trip, number=20000, repeat=3)) / 20000 * 1e6)
    return costs[0], costs[1]


def main(argv: list[str] | None = None) -> int:
    """Run both modes and print the table; with ``--worker`` be the cluster's worker instead."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the key in megabytes")
    parser.add_argument("--iters", type=int, default=10, help="timed push+pull round trips")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.mb, args.iters)
        return 0
    plain, keyed = message_cost()
    print(f"seal+open of a small PUSH: {plain:.1f} us without a secret, {keyed:.1f} us with one "
          f"(ratio {keyed / plain:.2f})")
    print(f"push+pull of one {args.mb} MB key, 1 worker 1 server, {args.iters} round trips; "
          f"HMAC-SHA256 alone: {hmac_rate(args.mb):.0f} MB/s")
    base = run("header", args.mb, args.iters)
    print(f"{'KVSTORE_AUTH':>14} {'MB/s':>8} {'ratio':>6}")
    print(f"{'header':>14} {base:>8.1f} {1.0:>6.2f}")
    full = run("full", args.mb, args.iters)
    print(f"{'full':>14} {full:>8.1f} {full / base:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ``KVSTORE_AUTH=full`` costs against header-only MACs (``KVSTORE_AUTH=header``).

    python benchmarks/auth_cost.py [--mb 64] [--iters 10] [--rounds 3]

Starts a real 1-worker 1-server cluster through ``launch.py`` per mode and round (the
same secret, everything else equal; the modes alternate, so both see the same load); the
worker times push+pull round trips of one float32 key of ``--mb`` megabytes and prints
the rate.  Header mode is the baseline: the table gives each mode's median rate over the
rounds and its ratio to header's.  The raw rates of HMAC-SHA256 and Poly1305 on this
machine are printed too: full mode adds one Poly1305 pass per payload byte on each side
(``benchmarks/mac_cost.py`` compares more primitives).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import sys
import time

from rates import launch_rate, worker


def run(mode: str, mb: int, iters: int) -> float:
    """Launch the cluster with ``KVSTORE_AUTH=mode``; return the worker's MB/s."""
    return launch_rate(__file__, mode, {"KVSTORE_AUTH": mode}, mb, iters)


def primitive_rates(mb: int) -> tuple[float, float]:
    """MB/s of HMAC-SHA256 and of Poly1305 over an ``mb``-megabyte buffer on this machine."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    data = bytes(mb * 1024 * 1024)
    started = time.perf_counter()
    hmac.new(b"k" * 32, data, hashlib.sha256).digest()
    middle = time.perf_counter()
    Poly1305.generate_tag(b"k" * 32, data)
    return mb / (middle - started), mb / (time.perf_counter() - middle)


def message_cost() -> tuple[float, float, float]:
    """Microseconds to seal and open one small PUSH: without a key (the baseline), with one in header
    mode, with one in full mode."""
    import timeit

    import numpy as np

    from kvstore.net.auth import Channel, derive_key
    from kvstore.net.protocol import Message, Op

    costs = []
    for key, full in ((None, False), (derive_key("benchmark-secret"), False),
                      (derive_key("benchmark-secret"), True)):
        def round_trip(sender: Channel = Channel(key, "worker-x", full, b"s"),
                       receiver: Channel = Channel(key, "server0", full, b"s"),
                       value: np.ndarray = np.ones(1, np.float32)) -> None:
            receiver.open(sender.seal(Message(Op.PUSH, {"key": "w"}, [value], seq=1, sender=0), "server0"))

        costs.append(min(timeit.repeat(round_trip, number=20000, repeat=3)) / 20000 * 1e6)
    return costs[0], costs[1], costs[2]


def main(argv: list[str] | None = None) -> int:
    """Run both modes and print the table; with ``--worker`` be the cluster's worker instead."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the key in megabytes")
    parser.add_argument("--iters", type=int, default=10, help="timed push+pull round trips")
    parser.add_argument("--rounds", type=int, default=3, help="clusters per mode; the median is shown")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.mb, args.iters)
        return 0
    plain, keyed, full = message_cost()
    print(f"seal+open of a small PUSH: {plain:.1f} us without a secret, {keyed:.1f} us with one "
          f"(ratio {keyed / plain:.2f}), {full:.1f} us with KVSTORE_AUTH=full (ratio {full / plain:.2f})")
    sha, poly = primitive_rates(args.mb)
    print(f"push+pull of one {args.mb} MB key, 1 worker 1 server, {args.iters} round trips, median of "
          f"{args.rounds} clusters per mode; HMAC-SHA256 alone: {sha:.0f} MB/s, Poly1305: {poly:.0f} MB/s")
    rates: dict[str, list[float]] = {"header": [], "full": []}
    for _ in range(args.rounds):
        for mode, got in rates.items():
            got.append(run(mode, args.mb, args.iters))
    base = statistics.median(rates["header"])
    print(f"{'KVSTORE_AUTH':>14} {'MB/s':>8} {'ratio':>6}  each round (MB/s)")
    for mode, got in rates.items():
        median = statistics.median(got)
        print(f"{mode:>14} {median:>8.1f} {median / base:>6.2f}  {' '.join(f'{r:.0f}' for r in got)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

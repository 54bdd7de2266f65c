"""What ``KVSTORE_ENCRYPT=curve`` (ZeroMQ CURVE on every socket) costs against no encryption.

    python benchmarks/encryption_cost.py [--mb 64] [--iters 10] [--repeat 1]

Starts a real 1-worker 1-server cluster through ``launch.py`` once per mode and repeat (the same
secret, everything else equal); the worker times push+pull round trips of one float32 key of
``--mb`` megabytes and prints the rate.  Encryption off is the baseline: the table gives each run's
rate and the median of curve's over the median of off's.  The raw CURVE rate of one zmq socket pair
on this machine is printed too, as the ceiling of one encrypted stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from rates import launch_rate, worker


def run(mode: str, mb: int, iters: int) -> float:
    """Launch the cluster with ``KVSTORE_ENCRYPT=mode``; return the worker's MB/s."""
    return launch_rate(__file__, mode, {"KVSTORE_ENCRYPT": mode}, mb, iters, drop=("KVSTORE_CURVE_KEYS",))


def raw_curve_rate(mb: int, iters: int = 3) -> float:
    """MB/s of one ``mb``-megabyte message at a time over a bare CURVE DEALER -> ROUTER pair."""
    import zmq

    ctx = zmq.Context()
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.curve_server, router.curve_secretkey = True, server_secret
    dealer.curve_serverkey, dealer.curve_publickey = server_public, client_public
    dealer.curve_secretkey = client_secret
    dealer.connect(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
    data = bytes(mb * 1024 * 1024)
    dealer.send(b"warm-up")
    router.recv_multipart()
    started = time.perf_counter()
    for _ in range(iters):
        dealer.send(data, copy=False)
        router.recv_multipart(copy=False)
    rate = mb * iters / (time.perf_counter() - started)
    ctx.destroy(linger=0)
    return rate


def main(argv: list[str] | None = None) -> int:
    """Run both modes (alternating, ``--repeat`` times) and print the table; ``--worker``: be the worker."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="size of the key in megabytes")
    parser.add_argument("--iters", type=int, default=10, help="timed push+pull round trips")
    parser.add_argument("--repeat", type=int, default=1, help="clusters per mode")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.mb, args.iters)
        return 0
    print(f"push+pull of one {args.mb} MB key, 1 worker 1 server, {args.iters} round trips; "
          f"one bare CURVE stream: {raw_curve_rate(args.mb):.0f} MB/s")
    rates: dict[str, list[float]] = {"off": [], "curve": []}
    print(f"{'KVSTORE_ENCRYPT':>16} {'MB/s':>8}")
    for _ in range(args.repeat):
        for mode in rates:
            rates[mode].append(run(mode, args.mb, args.iters))
            print(f"{mode:>16} {rates[mode][-1]:>8.1f}", flush=True)
    off, curve = statistics.median(rates["off"]), statistics.median(rates["curve"])
    print(f"median: off {off:.1f} MB/s, curve {curve:.1f} MB/s, ratio {curve / off:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

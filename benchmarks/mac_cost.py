"""What a MAC over every payload byte costs per core, for the primitives ``KVSTORE_AUTH=full`` could use.

    python benchmarks/mac_cost.py [--mb 64] [--frame-mb 2] [--repeat 5]

Each primitive MACs ``--mb`` megabytes sent as messages of one ``--frame-mb`` frame (the data
path's chunk size), as a receiver does while frames stream in: a fresh MAC per message, one
``update`` per frame.  Poly1305 needs a one-time key per message, so its rate includes deriving
that key (one HMAC-SHA256 of 16 bytes, as ``kvstore.net.auth`` does).  A memcpy of the same bytes,
measured in the same run, is the baseline.  Each rate is the best of ``--repeat`` passes (this
machine is shared), in GB/s (10**9 bytes per second) on one core.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import sys
import time
from collections.abc import Callable

import numpy as np

KEY = bytes(range(32))
Mac = Callable[[list[memoryview], int], object]


def hmac_sha256(frames: list[memoryview], n: int) -> bytes:
    """HMAC-SHA256 of one message's frames."""
    mac = hmac.new(KEY, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(frame)
    return mac.digest()


def blake2b(frames: list[memoryview], n: int) -> bytes:
    """Keyed BLAKE2b (hashlib) of one message's frames, 16-byte tag."""
    mac = hashlib.blake2b(key=KEY, digest_size=16)
    for frame in frames:
        mac.update(frame)
    return mac.digest()


def blake3(frames: list[memoryview], n: int) -> bytes:
    """Keyed BLAKE3 (the ``blake3`` package, one thread) of one message's frames."""
    import blake3 as b3

    mac = b3.blake3(key=KEY)
    for frame in frames:
        mac.update(frame)
    return mac.digest(16)


def poly1305(frames: list[memoryview], n: int) -> bytes:
    """Poly1305 (``cryptography``) of one message's frames, under a one-time key derived per message."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    one_time = hmac.new(KEY, n.to_bytes(16, "big"), hashlib.sha256).digest()
    mac = Poly1305(one_time)
    for frame in frames:
        mac.update(frame)
    return mac.finalize()


def rate(fn: Mac, messages: list[list[memoryview]], total: int, repeat: int) -> float:
    """GB/s of ``fn`` over every message, the best of ``repeat`` passes."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for n, frames in enumerate(messages):
            fn(frames, n)
        best = min(best, time.perf_counter() - started)
    return total / best / 1e9


def memcpy_rate(messages: list[list[memoryview]], total: int, repeat: int) -> float:
    """GB/s of copying every frame into a destination buffer of the same total size."""
    dst = np.empty(total, np.uint8)
    views = [np.frombuffer(frames[0], np.uint8) for frames in messages]
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        offset = 0
        for view in views:
            np.copyto(dst[offset:offset + view.size], view)
            offset += view.size
        best = min(best, time.perf_counter() - started)
    return total / best / 1e9


def main(argv: list[str] | None = None) -> int:
    """Print each primitive's rate and its ratio to memcpy."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="megabytes MAC'd per pass")
    parser.add_argument("--frame-mb", type=float, default=2.0, help="megabytes per message (one frame)")
    parser.add_argument("--repeat", type=int, default=5, help="passes; the best is reported")
    args = parser.parse_args(argv)
    total = args.mb << 20
    frame = int(args.frame_mb * (1 << 20))
    data = memoryview(np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)).cast("B")
    messages = [[data[i:i + frame]] for i in range(0, total, frame)]
    base = memcpy_rate(messages, total, args.repeat)
    print(f"{args.mb} MB in messages of {args.frame_mb:g} MB, best of {args.repeat}; GB/s on one core")
    print(f"{'primitive':>14} {'GB/s':>6} {'x memcpy':>8}")
    print(f"{'memcpy':>14} {base:>6.2f} {1.0:>8.2f}")
    for name, fn in (("hmac-sha256", hmac_sha256), ("blake2b", blake2b), ("blake3", blake3),
                     ("poly1305", poly1305)):
        try:
            got = rate(fn, messages, total, args.repeat)
        except ImportError as exc:
            print(f"{name:>14}  skipped ({exc.name} is not installed)")
            continue
        print(f"{name:>14} {got:>6.2f} {got / base:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

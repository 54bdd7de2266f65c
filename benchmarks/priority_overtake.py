"""What ``priority`` buys (issue 39, target 6): a small key's push then pull issued right after a
64 MB push, at priority 10 against priority 0, through a real 1-worker 1-server ``dist_async``
cluster (shared memory on, as shipped).

    python benchmarks/priority_overtake.py [--mb 64] [--rounds 7] [--pace-mb 8]

Each round pushes the big key, then times the small key's ``push`` + ``pull`` (4 bytes) from the
moment it is issued until its pull returns, then pulls the big key (so every round starts with an
empty outbox); the priorities alternate round by round.  Printed: the median and each round's ms per
priority, and the big push + pull's own time.  ``--pace-mb`` sets the worker's
``kvstore.client.mux.PACE_BYTES`` (how much of a call's chunks it sends itself) for the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.integration.conftest import Clusters  # noqa: E402


def measure(kv, mb: int, rounds: int) -> dict[str, list[float]]:
    """Per priority (0, 10): the small key's push + pull ms behind a ``mb`` MB push, each round."""
    n = mb << 18  # float32 elements
    big, small = np.ones(n, np.float32), np.ones(1, np.float32)
    kv.init(["big", "small"], [np.zeros(n, np.float32), np.zeros(1, np.float32)])
    out = {"0": [], "10": [], "big": []}
    for r in range(2 * rounds + 2):  # two warm-up rounds
        priority = 10 if r % 2 else 0
        began = time.perf_counter()
        kv.push("big", big)
        issued = time.perf_counter()
        kv.push("small", small, priority=priority)
        kv.pull("small", priority=priority)
        small_ms = (time.perf_counter() - issued) * 1e3
        kv.pull("big")
        if r >= 2:
            out[str(priority)].append(small_ms)
            out["big"].append((time.perf_counter() - began) * 1e3)
    return out


def main() -> None:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pace-mb", type=float, help="the Mux's PACE_BYTES, in MiB (default: as shipped)")
    args = parser.parse_args()
    if args.pace_mb is not None:
        from kvstore.client import mux
        mux.PACE_BYTES = int(args.pace_mb * (1 << 20))  # read when the stores' Muxes are made
    with tempfile.TemporaryDirectory() as tmp:
        clusters = Clusters(Path(tmp))
        try:
            cluster = clusters.make("dist_async", 1, 1, bound=1 << 30)
            out = measure(cluster.workers[0], args.mb, args.rounds)
        finally:
            clusters.close()
    pace = "as shipped" if args.pace_mb is None else f"{args.pace_mb:g} MiB"
    print(f"1w1s dist_async, a 4-byte key's push + pull issued right after a {args.mb} MB push "
          f"({args.rounds} rounds per priority, alternated; pace {pace})")
    for name in ("10", "0"):
        figures = ", ".join(f"{ms:.1f}" for ms in out[name])
        print(f"priority {name:>2}: median {statistics.median(out[name]):7.2f} ms  ({figures})")
    print(f"the {args.mb} MB push + the small key + the big pull, per round: median "
          f"{statistics.median(out['big']):.1f} ms")


if __name__ == "__main__":
    main()

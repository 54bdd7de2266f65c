"""What a server's shard (KVSTORE_SNAPSHOT_EVERY) stops it for, against a memcpy of the same bytes.

    python benchmarks/shard_cost.py [--mb 256] [--keys 64] [--repeats 5]

A server stops serving only while it captures a shard (kvstore.core.shard_image.capture): no copy
of the values, a copy of the optimizer state (SGD with momentum: one array per key, the size of
the value), into the buffers of the shard before once that is written.  This times that capture
(and the first one, into fresh buffers) of ``--keys`` float32 keys of ``--mb`` megabytes in all, and,
as the baseline measured in the same run, one ``np.copyto`` of the same state bytes; it prints the
best of ``--repeats`` of each and their ratio.  The write itself (a thread of its own, the server
serving meanwhile) is timed too, to a temporary folder, for scale.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from kvstore.core.optimizer import create
from kvstore.core.shard import ShardState
from kvstore.core.shard_image import capture
from kvstore.server.shards import ShardWriter


def main() -> None:
    """Time a capture, a memcpy of the state bytes and one shard write; print them and the ratio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = args.mb * (1 << 20) // 4 // args.keys
    opt = create("sgd", learning_rate=0.1, momentum=0.9)
    shard = ShardState(1, sync=True)

    def update(key, total, stored):
        weight = stored.copy()
        opt.update(key, weight, total)
        return weight
    shard.updater = update
    for key in range(args.keys):
        shard.init(key, np.zeros(size, np.float32))
        shard.push(None, 0, key, np.ones(size, np.float32))  # one round: each key has its momentum
    states = [opt.get_state(key)[1]["mom"] for key in range(args.keys)]
    copies = [np.empty_like(s) for s in states]
    best_capture = best_first = best_copy = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        image = capture(shard, opt, set(), 0, 1)
        best_first = min(best_first, time.perf_counter() - started)
        started = time.perf_counter()
        capture(shard, opt, set(), 0, 2, spare=image.keys)
        best_capture = min(best_capture, time.perf_counter() - started)
        started = time.perf_counter()
        for src, dst in zip(states, copies):
            np.copyto(dst, src)
        best_copy = min(best_copy, time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as folder:
        writer = ShardWriter(folder, 0, rounds=1, clock=time.monotonic)
        time.sleep(0.1)  # past the writer's 50 ms between looks at the rounds (not a wait for a condition)
        started = time.perf_counter()
        writer.tick(shard, opt, set())
        writer.close(600)
        wrote = time.perf_counter() - started
    print(f"{args.keys} keys, {args.mb} MB of values and {args.mb} MB of momentum")
    print(f"first capture (fresh buffers): {best_first * 1e3:8.1f} ms")
    print(f"capture (the server's stop, the last shard's buffers reused): {best_capture * 1e3:8.1f} ms")
    print(f"memcpy of the state (baseline): {best_copy * 1e3:8.1f} ms   ratio {best_capture / best_copy:.2f}")
    print(f"write on its thread (values and state, for scale): {wrote * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()

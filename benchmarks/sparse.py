"""Row-sparse keys (issue 23): rows per second of push + row_sparse_pull of random rows of a big table,
against moving the same rows as a dense value, on real clusters started through ``launch.py``; and the
memory a server holds against the table's size.

    python benchmarks/sparse.py [--rows 1000000] [--width 64] [--batch 4096] [--steps 30]
    python benchmarks/sparse.py --configs 1x1            # one config only (workers x servers)

Per config (default ``1x1`` and ``4x2``) one cluster runs, in every worker, ``--steps`` steps of:

* **sparse**: ``push`` of a ``RowSparse`` of ``--batch`` random row ids (uniform over ``--rows``,
  repeats included) of ``--width`` float32, then ``row_sparse_pull`` of the same ids, into a
  ``--rows x --width`` table created on the servers (``init='normal'``) with plain sgd on the servers;
* **dense**: the baseline with the same bytes: ``push`` then ``pull`` of a dense ``--batch x --width``
  key (no ids, no gathering or scattering of rows), with the same optimizer.

Rank 0 prints rows/s of one worker (``batch * steps / seconds``), all workers' together, and the
sparse/dense ratio.  The servers' held bytes (``kv.stats(cluster=True)``: the table and the
optimizer's state) are printed against the table's size, and each server's peak RSS from its
shutdown line.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(rows: int, width: int, batch: int, steps: int) -> None:
    """Inside a cluster: time both loops; rank 0 prints RESULT lines."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    kv.init("table", shape=(rows, width), dtype="float32", init="normal")
    kv.init("dense", np.zeros((batch, width), np.float32))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.01))
    rng = np.random.default_rng(kv.rank)
    values = rng.standard_normal((batch, width)).astype(np.float32)
    batches = [rng.integers(0, rows, batch) for _ in range(steps + 1)]
    out = np.empty((batch, width), np.float32)
    rates = {}
    for kind in ("dense", "sparse"):
        for step in range(steps + 1):
            if step == 1:  # the first step warms up
                kv.barrier()
                started = time.perf_counter()
            if kind == "sparse":
                kv.push("table", kvstore.RowSparse(batches[step], values, (rows, width)))
                kv.row_sparse_pull("table", row_ids=batches[step])
            else:
                kv.push("dense", values)
                kv.pull("dense", out=out)
        kv.barrier()
        rates[kind] = batch * steps / (time.perf_counter() - started)
    held = _held(kv)
    if kv.rank == 0:
        print(f"RESULT {rates['sparse']:.0f} {rates['dense']:.0f} {held}", flush=True)


def _held(kv) -> int:
    """The servers' held bytes, summed, once every server's snapshot counts the table (polled)."""
    deadline = time.monotonic() + 10
    while True:
        nodes = kv.stats(cluster=True)["nodes"]
        held = [n.get("held_bytes", 0) for n in nodes if n.get("role") == "server"]
        if (len(held) == kv.num_servers and all(held)) or time.monotonic() > deadline:
            return sum(held)
        time.sleep(0.2)  # the servers' next heartbeat carries their gauges


def _launch(args: list[str], workers: int, servers: int) -> tuple[list[str], list[float]]:
    """Run this file as the worker of a cluster; return the RESULT fields and the servers' peak RSS."""
    done = subprocess.run([sys.executable, "launch.py", "-n", str(workers), "-s", str(servers), __file__,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "KVSTORE_LOG_LEVEL": "INFO"})
    output = done.stdout + done.stderr
    lines = [line for line in output.splitlines() if "RESULT" in line]
    if done.returncode != 0 or not lines:
        sys.exit(f"the cluster {args} failed (exit {done.returncode}):\n{output[-3000:]}")
    rss = [float(m) for m in re.findall(r"peak RSS ([\d.]+) MB", output)]
    return lines[0].split("RESULT ", 1)[1].split(), rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--configs", default="1x1,4x2", help="workers x servers, comma-separated")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [str(args.rows), str(args.width), str(args.batch), str(args.steps)]
    if args.worker:
        worker(args.rows, args.width, args.batch, args.steps)
        return
    table = args.rows * args.width * 4
    print(f"table {args.rows} x {args.width} float32 = {table / 2**20:.0f} MiB; {args.batch} random rows "
          f"per step, {args.steps} steps (+1 warm-up)")
    print(f"{'config':>7} {'sparse rows/s/worker':>21} {'dense rows/s/worker':>20} {'ratio':>6} "
          f"{'all workers sparse':>19} {'held / table':>13} {'server peak RSS MB':>19}")
    for config in args.configs.split(","):
        workers, servers = (int(n) for n in config.split("x"))
        fields, rss = _launch(["--worker", "--rows", *sizes[:1], "--width", sizes[1], "--batch", sizes[2],
                               "--steps", sizes[3]], workers, servers)
        sparse, dense, held = float(fields[0]), float(fields[1]), int(fields[2])
        print(f"{workers}w{servers}s".rjust(7), f"{sparse:21,.0f} {dense:20,.0f} {sparse / dense:6.2f} "
              f"{sparse * workers:19,.0f} {held / table:13.2f} {' '.join(f'{r:.0f}' for r in rss):>19}")


if __name__ == "__main__":
    main()

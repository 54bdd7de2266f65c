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

Dynamic tables (issue 46; ``--dynamic``), the same kinds of clusters (``--configs``, default ``1x1,4x2``)::

    python benchmarks/sparse.py --dynamic                           # about 5 minutes on 2 loaded cores
    python benchmarks/sparse.py --dynamic --stream-ids 50000000     # the full 50M-id memory stream

* **rows/s** of ``push`` and of ``row_sparse_pull`` (timed apart; per worker, adam on the servers), width
  ``--dyn-width`` (16) float32, at batches of 512 and 8192 ids, for: ``fixed``, today's
  ``--dyn-rows`` (1M) x width table, ids uniform over its rows; ``dyn1m``, a dynamic table holding those
  1M ids (made by a fill before the timing); ``dyn100m``, a dynamic table capped at 1M rows in all
  (``capacity = 1M / servers``), filled, then pushed and pulled ids uniform over 1e8 (nearly every
  pushed id is new: each push evicts).  The baseline in the same run: ``torch.nn.EmbeddingBag(1M,
  width, sparse=True)`` in this process, a lookup (``no_grad`` forward) against the pull, and a
  forward + backward + ``torch.optim.SparseAdam`` step against the push.
* **storage**: bytes per row of a dynamic table of 1M rows with adam's state, in a ``local`` store
  (``tracemalloc``), against the issue's bound ``1.5 x (width x itemsize + state) + 64``.
* **memory**: ``--stream-ids`` distinct ids (default 5M; the issue's run is 50M) pushed in batches of
  65,536 (at most a quarter of the capacity) through a table capped at 1M rows on one server: its RSS
  sampled (``/proc``) along the stream, and its eviction counter.
"""

from __future__ import annotations

import argparse
import os
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


# -- dynamic tables (issue 46) ---------------------------------------------------------------------
DYN_BATCHES = (512, 8192)
DYN_STEPS = {512: 40, 8192: 8}
ID_SPACE = 100_000_000
FILL = 65_536  # ids per push while filling a table


def _server_rss(kv) -> list[int]:
    """Each server's current RSS in bytes (its pid from the cluster's stats; same host)."""
    rss = []
    for node in kv.stats(cluster=True)["nodes"]:
        if node.get("role") == "server":
            try:
                status = Path(f"/proc/{node['pid']}/status").read_text()
                rss.append(int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024)
            except (OSError, AttributeError, KeyError):
                rss.append(0)
    return rss


def _dyn_counters(kv, key: str, want: str = "rows", at_least: int = 1) -> dict[str, int]:
    """A dynamic table's counters summed over the servers, once ``want`` reaches ``at_least`` (the
    snapshots are refreshed once a second; polled for 10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        total: dict[str, int] = {}
        for node in kv.stats(cluster=True)["nodes"]:
            for name, value in node.get("dynamic_tables", {}).get(key, {}).items():
                if isinstance(value, (int, float)) and name != "hit_rate":
                    total[name] = total.get(name, 0) + int(value)
        if total.get(want, 0) >= at_least or time.monotonic() > deadline:
            return total
        time.sleep(0.2)


def _fill(kv, key: str, ids, width: int) -> None:
    """Push this worker's share of ``ids`` (chunks of FILL; every worker pushes as many times)."""
    import numpy as np

    import kvstore

    mine = np.array_split(ids, kv.num_workers)[kv.rank]
    chunks = max(1, -(-len(ids) // (FILL * kv.num_workers)))
    for part in np.array_split(mine, chunks):
        kv.push(key, kvstore.RowSparse(part, np.zeros((len(part), width), np.float32), (0, width)))
    kv.barrier()


def dyn_worker(rows: int, width: int) -> None:
    """Inside a cluster: time push and row_sparse_pull of each table kind and batch; rank 0 prints
    DYN lines (kind, batch, push rows/s, pull rows/s of this worker) and the tables' counters."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    kv.init("fixed", shape=(rows, width), dtype="float32", init="normal")
    kv.init("dyn1m", width=width, dtype="float32", init="normal", dynamic=True)
    kv.init("dyn100m", width=width, dtype="float32", init="normal",
            dynamic={"capacity": rows // kv.num_servers})
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.01))
    began = time.perf_counter()
    _fill(kv, "dyn1m", np.arange(rows), width)
    _fill(kv, "dyn100m", np.random.default_rng(99).choice(ID_SPACE, rows, replace=False), width)
    if kv.rank == 0:
        print(f"DYNFILL {time.perf_counter() - began:.1f}", flush=True)
    rng = np.random.default_rng(kv.rank)
    for batch in DYN_BATCHES:
        steps = DYN_STEPS[batch]
        values = rng.standard_normal((batch, width)).astype(np.float32)
        for kind in ("fixed", "dyn1m", "dyn100m"):
            space = ID_SPACE if kind == "dyn100m" else rows
            ids = [rng.integers(0, space, batch) for _ in range(steps + 1)]
            shape = (rows, width) if kind == "fixed" else (0, width)
            rates = []
            for op in ("push", "pull"):
                for step in range(steps + 1):
                    if step == 1:  # the first step warms up
                        kv.barrier()
                        started = time.perf_counter()
                    if op == "push":
                        kv.push(kind, kvstore.RowSparse(ids[step], values, shape))
                    else:
                        kv.row_sparse_pull(kind, row_ids=ids[step])
                kv.barrier()  # a dist_sync push is acked when its round is applied
                rates.append(batch * steps / (time.perf_counter() - started))
            if kv.rank == 0:
                print(f"DYN {kind} {batch} {rates[0]:.0f} {rates[1]:.0f}", flush=True)
    if kv.rank == 0:
        for key in ("dyn1m", "dyn100m"):
            counters = _dyn_counters(kv, key)
            print(f"DYNSTATS {key} " + " ".join(f"{k}={v}" for k, v in sorted(counters.items())), flush=True)


def stream_worker(total: int, capacity: int, width: int) -> None:
    """Inside a 1w1s cluster: push ``total`` distinct ids (batches of FILL) through a table capped at
    ``capacity`` rows; print the server's RSS samples and the eviction count."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    kv.init("stream", width=width, dtype="float32", init="normal", dynamic={"capacity": capacity})
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.01))
    step = max(1, min(FILL, capacity // 4))  # a push with more new ids than room drops the rest
    grad = np.ones((step, width), np.float32)
    batches = -(-total // step)
    every = max(1, batches // 20)
    began = time.perf_counter()
    for i in range(batches):
        ids = np.arange(i * step, min((i + 1) * step, total), dtype=np.int64) * 7919 + 13  # distinct
        kv.push("stream", kvstore.RowSparse(ids, grad[:len(ids)], (0, width)))
        if i % every == every - 1 or i == batches - 1:
            kv.barrier()
            print(f"STREAM {min((i + 1) * step, total)} {_server_rss(kv)[0]} "
                  f"{time.perf_counter() - began:.1f}", flush=True)
    counters = _dyn_counters(kv, "stream", "evictions", total - capacity)
    print("STREAMSTATS " + " ".join(f"{k}={v}" for k, v in sorted(counters.items())), flush=True)


def storage_cost(rows: int, width: int) -> tuple[float, float]:
    """Bytes per row (tracemalloc) of a local dynamic table of ``rows`` random int64 ids with adam, and
    the issue's bound 1.5 x (width x 4 + adam's 2 x width x 4) + 64."""
    import tracemalloc

    import numpy as np

    import kvstore

    kv = kvstore.create("local")
    kv.init("t", width=width, dtype="float32", init="normal", dynamic=True)
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.01))
    ids = np.random.default_rng(0).integers(-(2**62), 2**62, rows)
    grad = np.ones((FILL, width), np.float32)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for start in range(0, rows, FILL):
        part = ids[start:start + FILL]
        kv.push("t", kvstore.RowSparse(part, grad[:len(part)], (0, width)))
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held / rows, 1.5 * (width * 4 + 2 * width * 4) + 64


def torch_baseline(rows: int, width: int) -> dict[tuple[str, int], float]:
    """rows/s in this process of torch.nn.EmbeddingBag(rows, width, sparse=True): a lookup (no_grad) and
    an update (forward, backward, SparseAdam step) of batches of random ids (bags of one)."""
    import torch

    torch.set_num_threads(1)  # one core, as one worker process has
    bag = torch.nn.EmbeddingBag(rows, width, mode="sum", sparse=True)
    opt = torch.optim.SparseAdam(bag.parameters(), lr=0.01)
    out = {}
    for batch in DYN_BATCHES:
        steps = DYN_STEPS[batch] * 4
        offsets = torch.arange(batch)
        ids = [torch.randint(0, rows, (batch,)) for _ in range(steps + 1)]
        for op in ("push", "pull"):
            for step in range(steps + 1):
                if step == 1:
                    started = time.perf_counter()
                if op == "pull":
                    with torch.no_grad():
                        bag(ids[step], offsets)
                else:
                    bag(ids[step], offsets).sum().backward()
                    opt.step()
                    opt.zero_grad()
            out[(op, batch)] = batch * steps / (time.perf_counter() - started)
    return out


def _launch_lines(args: list[str], workers: int, servers: int) -> tuple[list[str], list[float]]:
    """Run this file as the worker of a cluster; return its output lines and the servers' peak RSS."""
    done = subprocess.run([sys.executable, "launch.py", "-n", str(workers), "-s", str(servers), __file__,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KVSTORE_LOG_LEVEL": "INFO"})
    output = done.stdout + done.stderr
    if done.returncode != 0:
        sys.exit(f"the cluster {args} failed (exit {done.returncode}):\n{output[-3000:]}")
    rss = [float(m) for m in re.findall(r"peak RSS ([\d.]+) MB", output)]
    return [line.split("] ", 1)[-1] for line in output.splitlines()], rss


def dyn_main(args: argparse.Namespace) -> None:
    """The dynamic-table suite: clusters per config, the torch baseline, storage and memory."""
    rows, width = args.dyn_rows, args.dyn_width
    parts = set(args.parts.split(","))
    if "rates" in parts:
        _rates(args.configs, rows, width)
    if "storage" in parts:
        per_row, bound = storage_cost(rows, width)
        print(f"storage: {per_row:.0f} bytes per row at {rows:,} rows with adam (bound {bound:.0f}): "
              f"{per_row / bound:.2f} of the bound")
    if "stream" in parts:
        _stream(args.stream_ids, rows, width)


def _rates(configs: str, rows: int, width: int) -> None:
    """The rows/s table: clusters per config against the fixed table and torch's EmbeddingBag."""
    print(f"dynamic tables: width {width} float32, adam; {rows:,} rows (fixed, dyn1m); dyn100m: ids from "
          f"{ID_SPACE:,}, capacity {rows:,} rows in all; steps per timing {DYN_STEPS} (+1 warm-up)")
    print(f"{'config':>7} {'batch':>6} {'table':>8} {'push rows/s/w':>14} {'pull rows/s/w':>14} "
          f"{'push/fixed':>10} {'pull/fixed':>10} {'push/torch':>10} {'pull/torch':>10}")
    base = torch_baseline(rows, width)
    for config in configs.split(","):
        workers, servers = (int(n) for n in config.split("x"))
        lines, rss = _launch_lines(["--dyn-worker", "--dyn-rows", str(rows), "--dyn-width", str(width)],
                                   workers, servers)
        rates = {}
        for line in lines:
            if line.startswith("DYN "):
                _, kind, batch, push, pull = line.split()
                rates[(kind, int(batch))] = (float(push), float(pull))
        for (kind, batch), (push, pull) in rates.items():
            fixed = rates[("fixed", batch)]
            print(f"{workers}w{servers}s".rjust(7), f"{batch:6d} {kind:>8} {push:14,.0f} {pull:14,.0f} "
                  f"{push / fixed[0]:10.2f} {pull / fixed[1]:10.2f} {push / base[('push', batch)]:10.2f} "
                  f"{pull / base[('pull', batch)]:10.2f}")
        for line in lines:
            if line.startswith(("DYNSTATS", "DYNFILL")):
                print(f"{workers}w{servers}s".rjust(7), line)
        print(f"{workers}w{servers}s".rjust(7), f"servers' peak RSS MB: {' '.join(f'{r:.0f}' for r in rss)}")
    for batch in DYN_BATCHES:
        print(f"  torch EmbeddingBag(sparse=True) one process, batch {batch}: update (SparseAdam) "
              f"{base[('push', batch)]:,.0f} rows/s, lookup {base[('pull', batch)]:,.0f} rows/s")


def _stream(total: int, rows: int, width: int) -> None:
    """The memory part: ``total`` distinct ids through a table capped at ``rows`` on one server."""
    lines, rss = _launch_lines(["--stream-worker", "--stream-ids", str(total), "--dyn-rows",
                                str(rows), "--dyn-width", str(width)], 1, 1)
    samples = [line.split()[1:] for line in lines if line.startswith("STREAM ")]
    for ids, server_rss, seconds in samples:
        print(f"  stream: {int(ids):>11,} ids pushed, server RSS {int(server_rss) / 2**20:7.1f} MiB, "
              f"{seconds} s")
    full = [int(r) for ids, r, _ in samples if int(ids) >= 2 * rows]  # the table full for a while
    if full:
        print(f"stream of {total:,} ids through {rows:,} rows: server RSS after "
              f"{2 * rows:,} ids {min(full) / 2**20:.1f}-{max(full) / 2**20:.1f} MiB "
              f"(spread {(max(full) - min(full)) / 2**20:.1f} MiB); peak {max(rss, default=0):.0f} MB")
    for line in lines:
        if line.startswith("STREAMSTATS"):
            print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--configs", default="1x1,4x2", help="workers x servers, comma-separated")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dynamic", action="store_true", help="the dynamic-table suite (issue 46)")
    parser.add_argument("--dyn-rows", type=int, default=1_000_000, help="--dynamic: rows of the tables")
    parser.add_argument("--dyn-width", type=int, default=16, help="--dynamic: row width")
    parser.add_argument("--stream-ids", type=int, default=5_000_000, help="--dynamic: ids of the stream")
    parser.add_argument("--parts", default="rates,storage,stream", help="--dynamic: which parts to run")
    parser.add_argument("--dyn-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dyn_worker:
        dyn_worker(args.dyn_rows, args.dyn_width)
        return
    if args.stream_worker:
        stream_worker(args.stream_ids, args.dyn_rows, args.dyn_width)
        return
    if args.dynamic:
        dyn_main(args)
        return
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

"""Trainer step time (issue 24, target 4): our Trainer through real clusters against one process and
against torch DDP (gloo), the same model, the same per-worker batch, the same number of workers.

    python benchmarks/trainer_step.py [--models 670k,20m] [--workers 1,2,4] [--blocks 3] [--iters 10]
                                      [--rounds 2] [--json out.json] [--quick]

Every process of every side runs ``torch.set_num_threads(1)`` (and ``OMP_NUM_THREADS=1``), so on a
2-core machine no side gets more cores by threading.  A step is ``zero_grad``, forward, backward of the
mean cross-entropy of a batch of 64 random samples (per worker), and the update (SGD, momentum 0.9):

* ``1-proc``: the model with ``torch.optim.SGD`` in one process (this one, nothing else running);
* ``ddp``: ``W`` processes started with ``torch.multiprocessing``, ``DistributedDataParallel`` over a
  gloo process group (default 25 MB buckets, gradients averaged during backward), ``torch.optim.SGD``;
* ours: ``launch.py -n W -s 1`` (a scheduler, one server, ``W`` workers: the server counted in our
  processes, authentication on as shipped), a :class:`kvstore.Trainer` per variant:
  ``plain`` (update_on_kvstore=True, overlap=False: the Trainer before issue 24),
  ``overlap`` (update_on_kvstore=False: the overlap's default), ``overlap-kv`` (update_on_kvstore=True,
  overlap=True: the servers run SGD), ``plain-local`` (update_on_kvstore=False, overlap=False: the
  overlap's counterpart without hooks; only with ``--variants``); ``overlap-fifo`` and
  ``overlap-kv-fifo``: the overlap variants with every bucket at priority 0 (call order) instead of
  the first layers first (``kvstore.overlap.bucket_priority``), to say what ``priority`` changes in
  step time (only with ``--variants``).

Each figure is the best of ``--blocks`` timed blocks of ``--iters`` steps (after 3 warm-up steps), the
workers starting each block together; per side the mean over its workers; the whole comparison runs
``--rounds`` times in turn (1-proc, DDP, ours for each worker count) and each side keeps its best.
Output: a table of step ms and ratios (ours / 1-proc at 1 worker, ours / DDP at every count), and with
``--json`` every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUCKET_BYTES = 1 << 20  # kvstore.overlap's default (not imported: the parent runs without kvstore)
BATCH = 64
MODELS = {"670k": (784, 512, 512, 10), "20m": (784, 4096, 4096, 10)}  # 669,706 and 20,037,642 parameters
VARIANTS = {"overlap": (False, None), "plain": (True, False), "overlap-kv": (True, True),  # uok, overlap
            "plain-local": (False, False), "overlap-fifo": (False, None), "overlap-kv-fifo": (True, True)}


def model(name: str) -> Any:
    """The MLP ``name`` with seeded weights (the same on every side)."""
    import torch

    torch.manual_seed(0)
    sizes = MODELS[name]
    layers: list[Any] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(sizes) - 2 else [])
    return torch.nn.Sequential(*layers)


def batch(rank: int) -> tuple[Any, Any]:
    """This worker's batch (the same in every block: the step's cost does not depend on the values)."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    return (torch.randn(BATCH, MODELS["670k"][0], generator=generator),
            torch.randint(0, 10, (BATCH,), generator=generator))


def timed(net: Any, update: Any, rank: int, iters: int, blocks: int, barrier: Any) -> float:
    """The best block's mean step time in ms (3 warm-up steps; ``barrier()`` before each block)."""
    import torch

    x, y = batch(rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        net.zero_grad()
        loss_fn(net(x), y).backward()
        update()

    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(blocks):
        barrier()
        started = time.perf_counter()
        for _ in range(iters):
            step()
        best = min(best, (time.perf_counter() - started) / iters)
    return best * 1e3


def one_process(name: str, iters: int, blocks: int) -> float:
    """Step ms of ``name`` with torch's SGD in this process."""
    import torch

    torch.set_num_threads(1)
    net = model(name)
    sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    return timed(net, sgd.step, 0, iters, blocks, lambda: None)


def _ddp_rank(rank: int, world: int, port: int, name: str, iters: int, blocks: int, out: str) -> None:
    """One DDP process: gloo group, DDP-wrapped model, torch SGD; writes its step ms to ``out.rank``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        net = DistributedDataParallel(model(name))
        sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        ms = timed(net, sgd.step, rank, iters, blocks, dist.barrier)
        Path(f"{out}.{rank}").write_text(json.dumps({"rank": rank, "ms": ms}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A port nothing listens on now (bound to port 0, then released) for gloo's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ddp(name: str, world: int, iters: int, blocks: int) -> float:
    """Mean over the DDP processes of their step ms (``world`` processes by torch.multiprocessing)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ddp-") as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_ddp_rank, args=(world, free_port(), name, iters, blocks, out), nprocs=world, join=True)
        return sum(json.loads(Path(f"{out}.{r}").read_text())["ms"] for r in range(world)) / world


def worker(name: str, variants: list[str], iters: int, blocks: int, bucket_bytes: int) -> None:
    """Under launch.py: time each variant's Trainer on this worker's dist_sync store."""
    import torch

    import kvstore
    import kvstore.overlap

    torch.set_num_threads(1)
    kv = kvstore.create("dist_sync")
    for variant in sorted(variants, key=lambda v: VARIANTS[v][0]):  # update_on_kvstore=False first: the
        # servers hold no optimizer yet
        uok, overlap = VARIANTS[variant]
        net = model(name)
        prioritised = kvstore.overlap.bucket_priority
        if variant.endswith("-fifo"):  # every bucket at priority 0: call order
            kvstore.overlap.bucket_priority = lambda indexes: 0
        try:
            trainer = kvstore.Trainer(list(net.parameters()), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                                      kvstore=kv, update_on_kvstore=uok, overlap=overlap,
                                      bucket_bytes=bucket_bytes, key_prefix=f"{name}-{variant}")
        finally:
            kvstore.overlap.bucket_priority = prioritised
        ms = timed(net, lambda t=trainer: t.step(kv.num_workers), kv.rank, iters, blocks, kv.barrier)
        trainer.close()
        print("RESULT " + json.dumps({"variant": variant, "rank": kv.rank, "ms": ms}), flush=True)
        kv.barrier()
    kv.close()


def ours(name: str, workers: int, variants: list[str], iters: int, blocks: int,
         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """Launch ``workers`` workers and one server; return each variant's mean step ms."""
    argv = [sys.executable, "launch.py", "-n", str(workers), "-s", "1", __file__, "--worker", name,
            "--variants", ",".join(variants), "--iters", str(iters), "--blocks", str(blocks),
            "--bucket-bytes", str(bucket_bytes)]
    env = {**os.environ, "KVSTORE_REQUEST_TIMEOUT": "600", "OMP_NUM_THREADS": "1"}
    env.pop("KVSTORE_SECRET", None)  # the launcher makes one: authentication as shipped
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-6000:]}\n"
                         f"{done.stderr[-3000:]}")
    found: dict[str, list[float]] = {}
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            item = json.loads(line.split("RESULT ", 1)[1])
            found.setdefault(item["variant"], []).append(item["ms"])
    return {v: sum(ms) / len(ms) for v, ms in found.items()}


def run(models: list[str], counts: list[int], variants: list[str], iters: int, blocks: int,
        rounds: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Every model at every worker count: 1-proc, DDP and our variants, in the same run; ``rounds``
    times in turn (1-proc, DDP, ours), keeping each side's best, since a busy spell on a shared machine
    only ever slows a side down."""
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                       "date": time.strftime("%Y-%m-%d %H:%M")}, "rounds": rounds,
                           "iters": iters, "blocks": blocks, "batch_per_worker": BATCH,
                           "bucket_bytes": bucket_bytes, "models": {}}
    for name in models:
        rows: dict[str, Any] = {"params": sum(p.numel() for p in model(name).parameters()),
                                "one_process_ms": float("inf")}
        for r in range(rounds):
            for w in counts:
                _progress(f"{name}: round {r + 1}: {w} worker(s): 1-proc, DDP, then ours")
                rows["one_process_ms"] = min(rows["one_process_ms"], one_process(name, iters, blocks))
                found = {"ddp_ms": ddp(name, w, iters, blocks),
                         **ours(name, w, variants, iters, blocks, bucket_bytes)}
                row = rows.setdefault(f"{w}w", {})
                for side, ms in found.items():
                    row[side] = min(row.get(side, float("inf")), ms)
        out["models"][name] = rows
    return out


def _progress(text: str) -> None:
    print(f"[trainer_step {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def print_table(out: dict, variants: list[str]) -> None:
    """Step ms per side, ours over 1-proc (1 worker) and over DDP."""
    print(f"machine: {out['machine']['cpus']} CPUs, Python {out['machine']['python']}; batch "
          f"{out['batch_per_worker']} per worker; best of {out['rounds']} rounds x {out['blocks']} blocks "
          f"of {out['iters']} steps; "
          f"torch.set_num_threads(1) everywhere; ours: 1 server, bucket_bytes {out['bucket_bytes']}")
    head = f"{'model':>6} {'W':>2} {'1-proc':>7} {'ddp':>7} " + " ".join(f"{v:>10}" for v in variants)
    print(head + "  " + " ".join(f"{v + '/ddp':>14}" for v in variants) + f" {'best/1-proc':>11}")
    for name, rows in out["models"].items():
        one = rows["one_process_ms"]
        for key, row in rows.items():
            if not key.endswith("w"):
                continue
            figures = " ".join(f"{row.get(v, float('nan')):10.2f}" for v in variants)
            ratios = " ".join(f"{row.get(v, float('nan')) / row['ddp_ms']:14.2f}" for v in variants)
            best = min(row.get(v, float("inf")) for v in variants)
            print(f"{name:>6} {key[:-1]:>2} {one:7.2f} {row['ddp_ms']:7.2f} {figures}  {ratios} "
                  f"{best / one:11.2f}")


def compare(counts: list[int], quick: bool) -> dict:
    """Both models at each worker count of ``counts``, every variant; prints the table (for suite.py)."""
    variants = ["overlap", "plain", "overlap-kv"]
    out = run(list(MODELS), counts, variants, 3 if quick else 5, 3, 1 if quick else 2)
    print_table(out, variants)
    return out


def main() -> None:
    """Parse the command line; run the comparison (or a launched worker) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="670k,20m")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--variants", default="overlap,plain,overlap-kv")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="the whole comparison this many times, in turn")
    parser.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES, help="the Trainer's")
    parser.add_argument("--quick", action="store_true", help="3 blocks of 3 steps (a smoke run)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    variants = args.variants.split(",")
    iters = 3 if args.quick else args.iters
    if args.worker is not None:
        return worker(args.worker, variants, iters, args.blocks, args.bucket_bytes)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the DDP processes
    out = run(args.models.split(","), [int(w) for w in args.workers.split(",")], variants, iters, args.blocks,
              args.rounds, args.bucket_bytes)
    print_table(out, variants)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""Gradient compression (issue 22): bytes on the wire and push throughput per type against none, on
real clusters started through ``launch.py`` in one run; then the packing's own speed against the wire
time it saves.

    python benchmarks/compression.py [--elements 4194304] [--pushes 20] [--workers 1] [--servers 1]
    python benchmarks/compression.py --accuracy [--epochs 10] [--threshold 0.5]

For each type (none, 2bit, 1bit, fp16, bf16) one cluster runs ``--pushes`` pushes of one float32 key
of ``--elements`` elements from every worker (a barrier after them: every push applied) and prints
the worker's bytes sent per push (``kv.stats()['bytes_out']``) and pushes per second.  Last, in this
process, the quantiser's and dequantiser's GB/s (of float32 input) and, for a few link speeds, the
wire time one push of the key takes uncompressed, compressed, and what packing adds.

``--accuracy`` instead trains, per type, on a 2-worker 1-server cluster with the ``Trainer``'s
``compression_params``: examples/train_digits.py's MLP on the digits, and a model with a large fully
connected layer (256 -> 4096 -> 10) on a synthetic task (a fixed random teacher), and prints each final
test accuracy against none.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TYPES = ["none", "2bit", "1bit", "fp16", "bf16"]


def worker(kind: str, elements: int, pushes: int) -> None:
    """Inside a cluster: push the key ``pushes`` times and print one RESULT line."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    if kind != "none":
        kv.set_gradient_compression({"type": kind, "threshold": 0.5})
    rng = np.random.default_rng(kv.rank)
    grad = rng.standard_normal(elements).astype(np.float32)
    kv.init("w", np.zeros(elements, np.float32))
    kv.push("w", grad)  # warm-up
    kv.barrier()
    sent = kv.stats()["bytes_out"]
    started = time.perf_counter()
    for _ in range(pushes):
        kv.push("w", grad)
    kv.barrier()
    seconds = time.perf_counter() - started
    per_push = (kv.stats()["bytes_out"] - sent) / pushes
    if kv.rank == 0:
        print(f"RESULT {kind} {per_push:.0f} {pushes / seconds:.2f}", flush=True)


def _digits() -> tuple:
    sys.path.insert(0, str(REPO / "examples"))
    from train_digits import load_data

    return load_data()


def _wide() -> tuple:
    """A synthetic 10-class task from a fixed random teacher (256 features), 4000 train, 1000 test."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5000, 256, generator=gen)
    teacher = torch.randn(256, 10, generator=gen)
    y = (x @ teacher).argmax(dim=1)
    return x[:4000], y[:4000], x[4000:], y[4000:]


def train_worker(kind: str, task: str, epochs: int, threshold: float) -> None:
    """Inside a cluster: train ``task`` with compression ``kind``; rank 0 prints the test accuracy."""
    import torch
    from torch import nn

    import kvstore

    kv = kvstore.create("dist_sync")
    x_train, y_train, x_test, y_test = _digits() if task == "digits" else _wide()
    x_train, y_train = (kvstore.data.split(a, kv.num_workers, kv.rank) for a in (x_train, y_train))
    torch.manual_seed(0)
    hidden = 64 if task == "digits" else 4096
    model = nn.Sequential(nn.Linear(x_train.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, 10))
    params = None if kind == "none" else {"type": kind, "threshold": threshold}
    trainer = kvstore.Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                              kvstore=kv, compression_params=params)
    loss_fn, order = nn.CrossEntropyLoss(reduction="sum"), torch.Generator().manual_seed(kv.rank)
    for _ in range(epochs):
        for batch in torch.randperm(len(x_train), generator=order).split(32):
            model.zero_grad()
            loss_fn(model(x_train[batch]), y_train[batch]).backward()
            trainer.step(len(batch) * kv.num_workers)
    with torch.no_grad():
        acc = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    if kv.rank == 0:
        print(f"RESULT {kind} {task} {acc:.4f}", flush=True)


def _launch(args: list[str], workers: int, servers: int) -> str:
    """Run this file as the worker of a ``launch.py`` cluster; return the RESULT line's fields."""
    done = subprocess.run([sys.executable, "launch.py", "-n", str(workers), "-s", str(servers), __file__,
                           *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if "RESULT" in line]
    if done.returncode != 0 or not lines:
        sys.exit(f"the cluster {args} failed (exit {done.returncode}):\n{done.stdout[-2000:]}"
                 f"{done.stderr[-2000:]}")
    return lines[0].split("RESULT ", 1)[1]


def accuracy_table(epochs: int, threshold: float) -> None:
    """Final test accuracy per type and task, against none."""
    print(f"2 workers, 1 server, sgd lr 0.1 momentum 0.9, batch 32 per worker (loss summed), "
          f"{epochs} epochs, threshold {threshold}")
    for task in ("digits", "wide"):
        base = None
        for kind in TYPES:
            fields = _launch(["--train", task, "--worker", kind, "--epochs", str(epochs),
                              "--threshold", str(threshold)], 2, 1).split()
            acc = float(fields[2])
            base = acc if base is None else base
            print(f"{task:6} {kind:5} test accuracy {acc:.4f} ({acc - base:+.4f} vs none)", flush=True)


def packing(elements: int) -> dict[str, tuple[float, float]]:
    """(quantise GB/s, dequantise GB/s) of float32 input per type, numpy, best of 3."""
    import numpy as np

    from kvstore.core import compression as C

    grad = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
    out = {}
    for kind in TYPES[1:]:
        spec = C.parse({"type": kind, "error_feedback": False} if kind in C.CASTS else {"type": kind})
        residual = np.zeros(elements, np.float32)
        best_q = best_d = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            wire = C.compress(spec, grad, residual if spec.residual else None)
            t1 = time.perf_counter()
            C.decompress(kind, wire, elements, spec.threshold)
            t2 = time.perf_counter()
            best_q, best_d = min(best_q, t1 - t0), min(best_d, t2 - t1)
        out[kind] = (elements * 4 / best_q / 1e9, elements * 4 / best_d / 1e9)
    return out


def main() -> None:
    """Run one cluster per type, then time the packing; print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4 << 20)
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--accuracy", action="store_true", help="train per type and compare accuracies")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.5, help="2bit / 1bit threshold (--accuracy)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.train:
        return train_worker(args.worker, args.train, args.epochs, args.threshold)
    if args.worker:
        return worker(args.worker, args.elements, args.pushes)
    if args.accuracy:
        return accuracy_table(args.epochs, args.threshold)
    rows = {}
    for kind in TYPES:
        fields = _launch(["--worker", kind, "--elements", str(args.elements), "--pushes", str(args.pushes)],
                         args.workers, args.servers).split()
        rows[kind] = (float(fields[1]), float(fields[2]))
    base_bytes, base_rate = rows["none"]
    print(f"{args.workers} worker(s), {args.servers} server(s), key of {args.elements} float32 "
          f"({args.elements * 4 / 2**20:.0f} MiB), {args.pushes} pushes")
    print(f"{'type':6} {'bytes/push':>12} {'vs none':>8} {'pushes/s':>9} {'vs none':>8}")
    for kind, (nbytes, rate) in rows.items():
        print(f"{kind:6} {nbytes:12.0f} {nbytes / base_bytes:8.4f} {rate:9.2f} {rate / base_rate:8.2f}")
    print("\npacking (numpy, this machine): quantise / dequantise GB/s of float32, and one push's time")
    raw = args.elements * 4
    for kind, (q, d) in packing(args.elements).items():
        saved = raw - rows[kind][0]
        pack_ms = raw / q / 1e6 + raw / d / 1e6
        links = ", ".join(f"{gbit} Gbit/s saves {saved * 8 / gbit / 1e6:.1f} ms" for gbit in (1, 10, 100))
        print(f"{kind:6} {q:6.2f} / {d:6.2f} GB/s: packing + unpacking {pack_ms:.1f} ms; {links}")


if __name__ == "__main__":
    main()

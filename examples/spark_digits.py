"""Train the digits MLP of train_digits.py from a Spark DataFrame with ``kvstore.spark.run``.

On this machine (local[1 + S + W]: one Spark task for the scheduler, each server and each worker)::

    python examples/spark_digits.py                       # 2 workers, 2 servers
    python examples/spark_digits.py --workers 3 --servers 1 --epochs 10

On a cluster, with Python, torch and kvstore installed on every executor (docs/spark.md)::

    spark-submit --master yarn --num-executors 5 --executor-cores 1 \\
        --py-files examples/train_digits.py examples/spark_digits.py --workers 2 --servers 2

The training set becomes a DataFrame of ``(features, label)`` rows; ``kvstore.spark.run`` routes
its rows round robin to the workers, and each worker trains the same model as train_digits.py on its
share through the ``Trainer`` (dist_sync: the servers sum the gradients and run SGD with momentum).
Every worker runs the same number of steps per epoch (the larger share's batch count, cycling the
smaller shares), so the sync rounds line up.  Rank 0 returns its weights; the driver loads them into a
fresh model and prints the test accuracy, exiting with code 1 below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
from pyspark.sql import SparkSession
from torch import nn
from train_digits import SEED, accuracy, load_data  # examples/ is on sys.path: this script lives there

import kvstore
import kvstore.spark


def make_model() -> nn.Module:
    """train_digits.py's MLP, with the same initial weights on every worker."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(rows, epochs: int, batch_size: int, steps_per_epoch: int, lr: float) -> dict:
    """The train_fn: runs on each worker's Spark task with the DMLC_* of its rank set."""
    torch.set_num_threads(1)  # one core per task: the scheduler and servers share the machine
    rows = list(rows)
    x = torch.tensor(np.array([row.features for row in rows], np.float32))
    y = torch.tensor([row.label for row in rows])
    with kvstore.create("dist_sync") as kv:
        model = make_model()
        trainer = kvstore.Trainer(model.named_parameters(), "sgd", {"learning_rate": lr, "momentum": 0.9},
                                  kvstore=kv)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")  # summed: step() rescales by the global batch
        order = torch.Generator().manual_seed(SEED + kv.rank)
        losses = []
        for _ in range(epochs):
            batches = torch.randperm(len(x), generator=order).split(batch_size)
            total = 0.0
            for step in range(steps_per_epoch):
                batch = batches[step % len(batches)]
                model.zero_grad()
                loss = loss_fn(model(x[batch]), y[batch])
                loss.backward()
                total += loss.item()
                trainer.step(len(batch) * kv.num_workers)
            losses.append(total / (steps_per_epoch * batch_size))
        rank = kv.rank
    weights = {name: p.detach().numpy() for name, p in model.state_dict().items()} if rank == 0 else None
    return {"rank": rank, "samples": len(x), "losses": losses, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--master", default=None, help="Spark master (default: spark-submit's --master "
                        "under spark-submit, else local[1 + servers + workers])")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--min-accuracy", type=float, default=0.90)
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # local runs: the workers use this Python
    builder = SparkSession.builder.appName("kvstore-spark-digits").config("spark.ui.enabled", "false")
    if args.master is not None:
        builder = builder.master(args.master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit, which sets the master
        builder = builder.master(f"local[{1 + args.servers + args.workers}]")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        x_train, y_train, x_test, y_test = load_data()
        rows = [(features.tolist(), int(label)) for features, label in zip(x_train.numpy(), y_train)]
        df = spark.createDataFrame(rows, "features array<float>, label int")
        steps = math.ceil(math.ceil(len(x_train) / args.workers) / args.batch_size)
        print(f"{len(x_train)} training rows, {args.workers} worker(s), {args.servers} server(s), "
              f"{steps} steps per epoch", flush=True)
        started = time.perf_counter()
        results = kvstore.spark.run(spark, train, args.workers, args.servers, data=df,
                                    args=(args.epochs, args.batch_size, steps, args.lr),
                                    env={"KVSTORE_LOG_LEVEL": "WARNING"})
    finally:
        spark.stop()
    print(f"trained in {time.perf_counter() - started:.1f} s; rows per worker: "
          f"{[r['samples'] for r in results]}; rank 0's loss per epoch: "
          f"{' '.join(f'{loss:.3f}' for loss in results[0]['losses'])}", flush=True)
    model = make_model()
    model.load_state_dict({name: torch.from_numpy(w) for name, w in results[0]["weights"].items()})
    acc = accuracy(model, x_test, y_test)
    print(f"final test accuracy {acc:.3f}", flush=True)
    if acc < args.min_accuracy:
        raise SystemExit(f"final test accuracy {acc:.3f} is below --min-accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()

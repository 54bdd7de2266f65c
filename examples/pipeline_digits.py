"""Pipeline and data parallelism together: the digits MLP cut into 2 stages, each run by 2 replicas.

Run a cluster of 4 workers (2 stages x 2 replicas) and 1 server on this machine::

    python launch.py -n 4 -s 1 examples/pipeline_digits.py
    python launch.py -n 4 -s 1 examples/pipeline_digits.py --schedule gpipe --checkpoint never
    python launch.py -n 2 -s 1 examples/pipeline_digits.py --stages 2      # 1 replica per stage
    python launch.py -n 2 -s 1 examples/pipeline_digits.py --schedule pipedream   # 1 replica per stage

Worker r runs stage r % 2 of replica r // 2 (docs/pipeline.md).  Replica p trains on its
shard of the training set (``kvstore.data.split``): stage 0 of the replica reads the
images, stage 1 the labels.  Each step, ``pipe.step`` streams ``--chunks`` micro-batches
through the two stages under ``--schedule``, and ``trainer.step`` sums each stage's
gradients over its replicas through the store (``dist_sync``; each stage's keys in a worker set of
its replicas) and applies the optimizer.  A worker holds only its stage's layers (the others are
released when the Pipeline is made), so the test accuracy is measured through the pipeline:
``pipe.predict`` runs the test set forward only, and the last stage of replica 0 prints it.  Under
``--schedule pipedream`` (one replica per stage) each stage updates itself after every micro-batch
(SGD at ``--lr / --chunks``, momentum 0.9, the rate annealed to zero over the run with a cosine) and
no Trainer runs.  The exit code is 1 when the final test accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import kvstore
import kvstore.data
from kvstore.pipeline import Pipeline
from kvstore.trainer import Trainer

SEED = 0  # the train/test split's; --seed sets the model's initial weights and the batches' order


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "pipedream"))
    parser.add_argument("--checkpoint", default="except_last", choices=("always", "except_last", "never"))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per-replica batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="the initial weights' and the batch order's seed")
    parser.add_argument("--min-accuracy", type=float, default=0.0)
    return parser.parse_args()


def load() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits (64 features scaled to [0, 1]) with a fixed 75/25 split."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=SEED)
    return (torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32),
            torch.tensor(y_train), torch.tensor(y_test))


def model(seed: int = SEED) -> nn.Sequential:
    """A 4-layer MLP, the same on every worker (seeded with ``seed``)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def train(args: argparse.Namespace, kv: kvstore.KVStore) -> float | None:
    """Train this worker's stage of its replica; return the test accuracy of the whole model on the last
    stage (None on the others)."""
    x_train, x_test, y_train, y_test = load()
    net = model(args.seed)
    pipedream = args.schedule == "pipedream"  # an update per micro-batch: the rate per micro-batch
    optimizers: list[torch.optim.Optimizer] = []  # the stage's own under pipedream (built by the Pipeline)

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizers.append(torch.optim.SGD(params, lr=args.lr / args.chunks, momentum=0.9))
        return optimizers[-1]

    pipe = Pipeline(net, stages=args.stages, chunks=args.chunks, schedule=args.schedule,
                    checkpoint=args.checkpoint, kv=kv, optimizer=sgd if pipedream else None)
    trainer = None if pipedream else Trainer(pipe, "sgd", {"learning_rate": args.lr, "momentum": 0.9})
    x_train = kvstore.data.split(x_train, pipe.replicas, pipe.replica)
    y_train = kvstore.data.split(y_train, pipe.replicas, pipe.replica)
    order = torch.Generator().manual_seed(args.seed + pipe.replica)
    # PipeDream's forwards run on weights a few micro-batches old: its rate anneals to zero over the run
    # (cosine, stepped once per mini-batch), so the last steps' noise does not decide the final weights
    steps = args.epochs * -(-len(x_train) // args.batch_size)
    annealing = [torch.optim.lr_scheduler.CosineAnnealingLR(o, steps) for o in optimizers]
    accuracy = None
    if kv.rank == 0:
        print(f"{kv.num_workers} workers: {args.stages} stages x {pipe.replicas} replicas, balance "
              f"{pipe.balance}, {args.schedule}, checkpoint {args.checkpoint}", flush=True)
    try:
        for epoch in range(args.epochs):
            for batch in torch.randperm(len(x_train), generator=order).split(args.batch_size):
                pipe.module.zero_grad()
                pipe.step(x_train[batch] if pipe.is_first else None, y_train[batch] if pipe.is_last else None,
                          nn.functional.cross_entropy)
                for schedule in annealing:
                    schedule.step()
                if trainer is not None:
                    trainer.step(pipe.replicas)  # each replica's gradient is its batch's mean: average them
            logits = pipe.predict(x_test if pipe.is_first else None)  # forward only, through every stage
            if logits is not None:
                accuracy = float((logits.argmax(1) == y_test).float().mean())
                if pipe.replica == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
                    print(f"epoch {epoch:3d}  test accuracy {accuracy:.3f}", flush=True)
    finally:
        pipe.close()
    return accuracy


def main() -> None:
    args = parse_args()
    with kvstore.create("dist_sync") as kv:
        accuracy = train(args, kv)
    if accuracy is None:  # not a last stage
        return
    if kv.rank == args.stages - 1:
        print(f"final test accuracy {accuracy:.3f}", flush=True)
    if accuracy < args.min_accuracy:
        raise SystemExit(f"final test accuracy {accuracy:.3f} is below --min-accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()

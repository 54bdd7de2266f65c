"""Data-parallel training of an MLP on scikit-learn's breast cancer data with Adam and an lr schedule.

Run a cluster of 2 workers and 1 server on this machine::

    python launch.py -n 2 -s 1 examples/train_cancer.py
    python launch.py -n 2 -s 1 examples/train_cancer.py --lr-scheduler factor --optimizer sgd --lr 0.1
    python launch.py -n 2 -s 2 examples/train_cancer.py --kvstore dist_async --update-on-kvstore 1

or a single process with an in-process store::

    python examples/train_cancer.py --kvstore local

The 30 features of the 569 tumours (bundled with scikit-learn, nothing is
downloaded) are standardised with the training split's mean and standard
deviation; a 30-32-2 MLP learns benign vs malignant.  Every worker trains on its
own equal-size shard (``kvstore.data.split``) through ``kvstore.Trainer``:
with ``--update-on-kvstore 1`` (the default in dist modes, forced in
``dist_async``) the servers run the optimizer and its learning-rate schedule on
the gradients summed over the workers; with ``0`` every worker runs them on the
summed gradients itself.  ``--lr-scheduler`` picks one of
``kvstore.lr_scheduler``'s schedules, counted in optimizer updates:

* ``factor``: multiply the rate by ``--lr-factor`` every ``--lr-step`` updates;
* ``multifactor``: multiply it by ``--lr-factor`` after 1/2 and 3/4 of the updates;
* ``cosine``: cosine decay from ``--lr`` to 0 over the whole run.

Rank 0 prints the loss and test accuracy per epoch; the exit code is 1 when the
final test accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from torch import nn

import kvstore
import kvstore.config
import kvstore.data
import kvstore.lr_scheduler

SEED = 0
OPTIMIZERS = ("adam", "sgd", "nag", "adagrad", "rmsprop")
SCHEDULERS = ("none", "factor", "multifactor", "cosine")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvstore", default="dist_sync" if kvstore.config.in_cluster() else "local",
                        help="store type (default: dist_sync under launch.py, else local)")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="per-worker batch size")
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    parser.add_argument("--lr", type=float, default=0.01, help="(initial) learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="momentum of sgd and nag")
    parser.add_argument("--lr-scheduler", default="cosine", choices=SCHEDULERS)
    parser.add_argument("--lr-step", type=int, default=100, help="updates between factor steps")
    parser.add_argument("--lr-factor", type=float, default=0.5, help="factor of factor and multifactor")
    parser.add_argument("--update-on-kvstore", choices=("auto", "1", "0"), default="auto",
                        help="1: the servers run the optimizer; 0: every worker does (dist_sync and local "
                             "only); auto: the Trainer's default (1 in dist modes)")
    parser.add_argument("--min-accuracy", type=float, default=0.93,
                        help="exit with code 1 when the final test accuracy is lower")
    return parser.parse_args()


def make_scheduler(args: argparse.Namespace, updates: int):
    """The --lr-scheduler over a run of ``updates`` optimizer updates, or None."""
    if args.lr_scheduler == "factor":
        return kvstore.lr_scheduler.FactorScheduler(step=args.lr_step, factor=args.lr_factor, base_lr=args.lr)
    if args.lr_scheduler == "multifactor":
        return kvstore.lr_scheduler.MultiFactorScheduler(step=[updates // 2, updates * 3 // 4],
                                                         factor=args.lr_factor, base_lr=args.lr)
    if args.lr_scheduler == "cosine":
        return kvstore.lr_scheduler.CosineScheduler(max_update=updates, base_lr=args.lr, final_lr=0.0)
    return None


def update_on_kvstore(args: argparse.Namespace, kv: kvstore.KVStore) -> bool | None:
    """The --update-on-kvstore choice; dist_async always updates on the servers."""
    if "async" in kv.type:
        if args.update_on_kvstore == "0" and kv.rank == 0:
            print("dist_async updates on the servers: ignoring --update-on-kvstore 0", flush=True)
        return True
    return None if args.update_on_kvstore == "auto" else args.update_on_kvstore == "1"


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tumours with a fixed 75/25 stratified split, standardised by the training split's statistics."""
    data = load_breast_cancer()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data, data.target, test_size=0.25, random_state=SEED, stratify=data.target)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return (torch.tensor((x_train - mean) / std, dtype=torch.float32), torch.tensor(y_train),
            torch.tensor((x_test - mean) / std, dtype=torch.float32), torch.tensor(y_test))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(kv: kvstore.KVStore, args: argparse.Namespace) -> float:
    """Train on this worker's shard; return the final test accuracy of this worker's model."""
    rank, workers = kv.rank, kv.num_workers
    sync = "async" not in kv.type
    x_train, y_train, x_test, y_test = load_data()
    x_train = kvstore.data.split(x_train, workers, rank)  # equal contiguous shards, remainder dropped
    y_train = kvstore.data.split(y_train, workers, rank)
    shard = len(x_train)
    steps = args.epochs * -(-shard // args.batch_size)
    # dist_async applies every worker's push as one update; dist_sync one update per global step
    updates = steps if sync else steps * workers

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(x_train.shape[1], 32), nn.ReLU(), nn.Linear(32, 2))
    params: dict = {"learning_rate": args.lr}
    if args.optimizer in ("sgd", "nag"):
        params["momentum"] = args.momentum
    scheduler = make_scheduler(args, updates)
    if scheduler is not None:
        params["lr_scheduler"] = scheduler
    trainer = kvstore.Trainer(model.named_parameters(), args.optimizer, params, kvstore=kv,
                              update_on_kvstore=update_on_kvstore(args, kv))
    # The loss is the MEAN over this worker's batch and the Trainer sums the gradients over the workers,
    # so in dist_sync step(workers) rescales the sum to the mean over the workers (gluon's rule:
    # rescale_grad = 1 / batch_size, here counted in worker batches).  dist_async applies each worker's
    # push on arrival with the same scale, so one push from every worker adds up to one dist_sync step.
    loss_fn = nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(SEED + rank)
    if rank == 0:
        print(f"{kv.type}: {workers} worker(s), {kv.num_servers} server(s), {args.optimizer} lr {args.lr} "
              f"scheduler {args.lr_scheduler} over {updates} updates, {shard} training samples per worker, "
              f"{len(x_test)} test samples", flush=True)

    for epoch in range(1, args.epochs + 1):
        total, started = 0.0, time.perf_counter()
        for batch in torch.randperm(shard, generator=order).split(args.batch_size):
            model.zero_grad()
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            loss.backward()
            trainer.step(workers)
            total += loss.item() * len(batch)
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {total / shard:.4f}  lr {trainer.learning_rate:.5f}  "
                  f"test accuracy {accuracy(model, x_test, y_test):.3f}  "
                  f"({time.perf_counter() - started:.2f} s)", flush=True)
    return accuracy(model, x_test, y_test)


def main() -> None:
    args = parse_args()
    with kvstore.create(args.kvstore) as kv:
        rank = kv.rank
        acc = train(kv, args)
    if rank == 0:
        print(f"final test accuracy {acc:.3f}", flush=True)
        if acc < args.min_accuracy:
            raise SystemExit(f"final test accuracy {acc:.3f} is below --min-accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()

"""Data-parallel training of a small MLP on scikit-learn's digits with a plain torch.optim optimizer
wrapped in kvstore.DistributedOptimizer (Horovod's API over the kvstore).

    python launch.py -n 2 -s 1 examples/train_digits_torch_optim.py
    python launch.py -n 2 -s 1 examples/train_digits_torch_optim.py --optimizer adamw
    python examples/train_digits_torch_optim.py            # one process, a 'local' store

Every worker trains on its own equal shard of the training set.  Rank 0's initial weights and
optimizer state reach every worker through ``broadcast_parameters`` / ``broadcast_optimizer_state``.
Each step the loss is the mean over the worker's batch; ``opt.step()`` averages the gradients over
the workers through the servers (which only sum) and then runs torch's update on every worker, so
every worker keeps the same weights.  A StepLR schedule halves the learning rate every 10 epochs.
Rank 0 prints one line per 5 epochs and the final test accuracy; the exit code is 1 below
``--min-accuracy``.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import kvstore
import kvstore.config
import kvstore.data

SEED = 0
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    parser.add_argument("--min-accuracy", type=float, default=0.90)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    kv = kvstore.create("dist_sync" if kvstore.config.in_cluster() else "local")
    rank, workers = kv.rank, kv.num_workers
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target)
    x_train = kvstore.data.split(torch.tensor(x_train, dtype=torch.float32), workers, rank)
    y_train = kvstore.data.split(torch.tensor(y_train), workers, rank)
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)

    torch.manual_seed(SEED + rank)  # different on each worker: the broadcast makes them rank 0's
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = kvstore.DistributedOptimizer(OPTIMIZERS[args.optimizer](model.parameters()),
                                       named_parameters=model.named_parameters(), kv=kv)
    kvstore.broadcast_parameters(model.state_dict(), root_rank=0, kv=kv)
    kvstore.broadcast_optimizer_state(opt, root_rank=0, kv=kv)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(SEED + rank)
    for epoch in range(1, args.epochs + 1):
        for batch in torch.randperm(len(x_train), generator=order).split(args.batch_size):
            opt.zero_grad()
            loss_fn(model(x_train[batch]), y_train[batch]).backward()
            opt.step()
        sched.step()
        if rank == 0 and epoch % 5 == 0:
            with torch.no_grad():
                acc = (model(x_test).argmax(1) == y_test).float().mean().item()
            print(f"epoch {epoch:3d}  lr {sched.get_last_lr()[0]:.4f}  test accuracy {acc:.3f}", flush=True)
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    kv.close()
    if rank == 0:
        print(f"final test accuracy {acc:.3f}", flush=True)
        if acc < args.min_accuracy:
            raise SystemExit(f"final test accuracy {acc:.3f} is below --min-accuracy {args.min_accuracy}")


if __name__ == "__main__":
    main()

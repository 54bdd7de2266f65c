"""Data-parallel training of a small MLP on scikit-learn's digits through the kvstore.

Run a cluster of 4 workers and 2 servers on this machine::

    python launch.py -n 4 -s 2 examples/train_digits.py
    python launch.py -n 4 -s 2 examples/train_digits.py --kvstore dist_async

or a single process with an in-process store::

    python examples/train_digits.py --kvstore local

Every worker trains on its own equal-size shard of the training set, starting
from rank 0's initial weights (one key per parameter, named like the parameter).

* ``dist_sync`` (and ``local``): each step a worker pushes its gradients, pulls
  back their sum over all workers, divides by the number of workers and takes a
  momentum-SGD step.  Every worker applies the same update, so the replicas stay
  identical.
* ``dist_async``: a server keeps the latest value pushed to a key (there is no
  server-side optimizer yet), so the keys hold the shared weights instead: a
  worker takes a step with its own gradients, pushes its weights and pulls the
  freshest ones back.

Rank 0 prints the loss and test accuracy; the exit code is 1 when the final test
accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import time

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import kvstore
import kvstore.config

SEED = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvstore", default="dist_sync" if kvstore.config.in_cluster() else "local",
                        help="store type (default: dist_sync under launch.py, else local)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--min-accuracy", type=float, default=0.90,
                        help="exit with code 1 when the final test accuracy is lower")
    return parser.parse_args()


def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits (8x8 images: 64 features scaled to [0, 1]) with a fixed 75/25 split."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=SEED, stratify=digits.target)
    return (torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train),
            torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def sgd_step(weights: list[torch.Tensor], grads: list[torch.Tensor], velocity: list[torch.Tensor],
             lr: float, momentum: float) -> None:
    """Momentum SGD in place (as torch.optim.SGD does it, without that module's slow import)."""
    for w, g, v in zip(weights, grads, velocity):
        v.mul_(momentum).add_(g)
        w.sub_(v, alpha=lr)


def train(kv: kvstore.KVStore, args: argparse.Namespace) -> float:
    """Train on this worker's shard; return the final test accuracy of this worker's model."""
    rank, workers = kv.rank, kv.num_workers
    sync = "async" not in kv.type
    x_train, y_train, x_test, y_test = load_data()
    shard = len(x_train) // workers  # equal shards: every worker runs the same number of steps
    x_train = x_train[rank * shard:(rank + 1) * shard]
    y_train = y_train[rank * shard:(rank + 1) * shard]

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    names = [name for name, _ in model.named_parameters()]
    weights = [p.detach() for p in model.parameters()]  # views of the parameters
    kv.init(names, weights)      # collective: every worker calls it, rank 0's values are stored
    kv.pull(names, out=weights)  # so that every worker starts from rank 0's weights
    velocity = [torch.zeros_like(w) for w in weights]
    loss_fn = nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(SEED + rank)
    if rank == 0:
        print(f"{kv.type}: {workers} worker(s), {kv.num_servers} server(s), "
              f"{shard} training samples per worker, {len(x_test)} test samples", flush=True)

    for epoch in range(1, args.epochs + 1):
        total, started = 0.0, time.perf_counter()
        for batch in torch.randperm(shard, generator=order).split(args.batch_size):
            model.zero_grad()
            loss = loss_fn(model(x_train[batch]), y_train[batch])
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            if sync:
                kv.push(names, grads)      # push every gradient first (the values are copied) ...
                kv.pull(names, out=grads)  # ... then pull the sums over all workers back into .grad
                for g in grads:
                    g.div_(workers)
            sgd_step(weights, grads, velocity, args.lr, args.momentum)
            if not sync:
                kv.push(names, weights)      # share this worker's new weights ...
                kv.pull(names, out=weights)  # ... and continue from the latest ones on the servers
            total += loss.item() * len(batch)
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {total / shard:.4f}  "
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

"""A hashed-feature classifier whose embedding table the workers never hold whole (docs/sparse.md).

Each scikit-learn digit (8x8 pixels of 0..16) becomes a bag of hashed features: every lit pixel
``(position, value)`` and every pair of lit neighbours, hashed into a table of ``--rows`` rows of
``--dim`` floats.  The model sums the bag's rows and a linear layer classifies the sum.  The table is
a :class:`kvstore.SparseEmbedding`: it is created on the servers (``init='normal'``), each step a worker
pulls only the rows its batch uses (``trainer.prefetch``) and pushes only their gradient; the servers
run Adam on them lazily (only the rows present).

    python launch.py -n 2 -s 2 examples/train_sparse.py                      # 200k rows x 16
    python launch.py -n 2 -s 2 examples/train_sparse.py --kvstore dist_async
    python examples/train_sparse.py --kvstore local
    python launch.py -n 2 -s 2 examples/train_sparse.py --rows 10000000 --check-rss

With ``--check-rss`` each worker asserts its peak RSS stayed below the table's size (10M x 16 float32
is 640 MB; a worker holds a few thousand rows).  Rank 0 prints the test accuracy; the exit code is 1
below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import resource
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import kvstore
import kvstore.data

MULT = np.uint64(0x9E3779B97F4A7C15)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the hashed embedding table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--kvstore", default=None, help="default: dist_sync under launch.py, else local")
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    parser.add_argument("--check-rss", action="store_true", help="assert peak RSS < the table's bytes")
    return parser.parse_args()


def hashed_bags(images: np.ndarray, rows: int) -> np.ndarray:
    """Each image's bag of feature ids, ``(n, 64 + 56)``: pixel (position, value) and horizontal pairs
    of neighbours, hashed (splitmix-style) into ``[0, rows)``."""
    pix = images.astype(np.uint64)
    pos = np.arange(64, dtype=np.uint64)
    singles = pos * np.uint64(17) + pix                                  # (n, 64)
    grid = pix.reshape(-1, 8, 8)
    pairs = (grid[:, :, :-1] * np.uint64(17) + grid[:, :, 1:]).reshape(-1, 56)
    pairs = pairs + np.uint64(2000) + np.arange(56, dtype=np.uint64) * np.uint64(289)
    feats = np.concatenate([singles, pairs], axis=1)
    with np.errstate(over="ignore"):
        h = (feats + np.uint64(1)) * MULT
        h ^= h >> np.uint64(31)
        h *= MULT
    return (h % np.uint64(rows)).astype(np.int64)


def peak_rss() -> int:
    """This process's peak resident set size in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def main() -> int:
    args = parse_args()
    digits = load_digits()
    bags = hashed_bags(digits.data, args.rows)
    x_train, x_test, y_train, y_test = train_test_split(bags, digits.target, test_size=0.25, random_state=0)
    torch.manual_seed(0)
    emb = kvstore.SparseEmbedding(args.rows, args.dim, init={"type": "normal", "sigma": 0.01, "seed": 1},
                                  key="hashed")
    head = torch.nn.Linear(args.dim, 10)
    trainer = kvstore.SparseTrainer(head.named_parameters(), "adam", {"learning_rate": args.lr},
                                    embeddings=[emb], kvstore=args.kvstore)
    kv = trainer.kvstore
    x = torch.from_numpy(kvstore.data.split(x_train, kv.num_workers, kv.rank))
    y = torch.from_numpy(kvstore.data.split(y_train, kv.num_workers, kv.rank))
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    for epoch in range(args.epochs):
        total = 0.0
        for i in range(0, len(x) - args.batch + 1, args.batch):  # full batches: the same count everywhere
            ids, labels = x[i:i + args.batch], y[i:i + args.batch]
            trainer.prefetch(emb, ids)
            loss = loss_fn(head(emb(ids).sum(1)), labels)
            loss.backward()
            trainer.step(args.batch * kv.num_workers)
            head.zero_grad()
            total += loss.item()
        if kv.rank == 0:
            print(f"epoch {epoch}  loss {total / len(x):.3f}", flush=True)
    test = torch.from_numpy(x_test)
    trainer.prefetch(emb, test)  # the rows of the test set (a few thousand), never the whole table
    with torch.no_grad():
        accuracy = float((head(emb(test).sum(1)).argmax(1).numpy() == y_test).mean())
    table_bytes = args.rows * args.dim * 4
    rss = peak_rss()
    print(f"worker {kv.rank}: peak RSS {rss / 2**20:.0f} MiB, table {table_bytes / 2**20:.0f} MiB, "
          f"rows held {emb.ids.size}", flush=True)
    if kv.rank == 0:
        print(f"final test accuracy {accuracy:.4f}", flush=True)
    kv.close()
    if args.check_rss and rss >= table_bytes:
        print(f"worker peak RSS {rss} >= table bytes {table_bytes}", flush=True)
        return 1
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

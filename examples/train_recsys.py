"""A DLRM-style click model whose embedding tables are dynamic tables on the servers (docs/sparse.md).

The click log is synthetic, generated from ``--seed`` (nothing is downloaded): each impression has a
user, an item and a bag of 3 tags, drawn from Zipf distributions over their vocabularies and hashed
to 64-bit ids (splitmix64: any int64 value, as a recommender's hashed feature ids are), and 4 dense
features.  A hidden model decides the clicks: a bias per user, item and tag, a dot product of hidden
user and item factors (an interaction that a linear model over the same features cannot express) and
a linear term of the dense features.

The model is DLRM's: one **dynamic** ``kvstore.SparseEmbedding`` per feature (``num_rows=None``: ids
are unbounded and a row is made on the servers the first time its gradient is pushed), a bottom MLP
over the dense features, the pairwise dot products of the four vectors, and a top MLP.  Each step a
worker pulls only its batch's rows (``trainer.prefetch``) and pushes only their gradient; the servers
run Adam (lazily: only the rows present).  ``--batch`` is the global batch: each worker takes its
slice of every batch, so a run on any number of workers follows the one-process run step for step.

    python launch.py -n 2 -s 2 examples/train_recsys.py              # dist_sync, the default run
    python examples/train_recsys.py --kvstore local                  # the same training in one process
    python launch.py -n 2 -s 2 examples/train_recsys.py --capacity 1000   # tables that evict

Rank 0 prints the held-out AUC, and (unless ``--no-baseline``) the AUC of a logistic regression over
the same features (one weight per id and per dense feature, trained in one process); the exit code is
1 when the AUC is below ``--min-auc`` or less than ``--min-lift`` above the baseline.  ``--steps N``
stops after N steps and ``--dump FILE`` writes (rank 0) the dense weights and every row the training
touched, to compare runs.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import kvstore

# name, vocabulary, Zipf exponent, ids per impression (a bag, mean-pooled)
FEATURES = (("user", 4_000, 1.05, 1), ("item", 2_000, 1.05, 1), ("tag", 500, 0.9, 3))
DENSE = 4
FACTORS = 4  # the hidden user/item factors
MASK = (1 << 64) - 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000, help="impressions (a fifth held out)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512, help="the global batch (split over the workers)")
    parser.add_argument("--dim", type=int, default=8, help="embedding width")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--capacity", type=int, default=0, help="rows per server and table (0: no bound)")
    parser.add_argument("--seed", type=int, default=0, help="the click log's seed")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: every epoch)")
    parser.add_argument("--dump", default=None, help="rank 0 writes the weights and touched rows here (.npz)")
    parser.add_argument("--kvstore", default=None, help="default: dist_sync under launch.py, else local")
    parser.add_argument("--no-baseline", action="store_true", help="skip the logistic regression")
    parser.add_argument("--min-auc", type=float, default=0.70)
    parser.add_argument("--min-lift", type=float, default=0.02, help="AUC above the logistic regression")
    return parser.parse_args()


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of uint64 ``x``: a 64-bit hash, as a feature hasher makes ids."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def zipf(rng: np.random.Generator, vocab: int, exponent: float, size: tuple[int, ...]) -> np.ndarray:
    """Ranks in ``[0, vocab)`` with P(rank r) proportional to 1 / (r + 1) ** exponent."""
    p = 1.0 / np.arange(1, vocab + 1) ** exponent
    return rng.choice(vocab, size=size, p=p / p.sum())


def click_log(samples: int, seed: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The synthetic log: per feature an ``(n, bag)`` int64 array of hashed ids, the ``(n, DENSE)`` float32
    dense features and the ``(n,)`` float32 clicks drawn from the hidden model."""
    rng = np.random.default_rng(seed)
    ranks = [zipf(rng, vocab, s, (samples, bag)) for _, vocab, s, bag in FEATURES]
    dense = rng.standard_normal((samples, DENSE)).astype(np.float32)
    user_f = rng.standard_normal((FEATURES[0][1], FACTORS)) / np.sqrt(FACTORS) * 1.6
    item_f = rng.standard_normal((FEATURES[1][1], FACTORS)) / np.sqrt(FACTORS) * 1.6
    biases = [rng.normal(0, 0.5, vocab) for _, vocab, _, _ in FEATURES]
    logit = (user_f[ranks[0][:, 0]] * item_f[ranks[1][:, 0]]).sum(1) - 0.3
    logit += sum(b[r].mean(1) for b, r in zip(biases, ranks))
    logit += dense @ rng.normal(0, 0.4, DENSE)
    clicks = (rng.random(samples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    ids = [splitmix64(r.astype(np.uint64) + np.uint64(i << 40)).view(np.int64)
           for i, r in enumerate(ranks)]
    return ids, dense, clicks


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve (Mann-Whitney; ties of scores count half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # average ranks, 1-based
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class DLRM(torch.nn.Module):
    """DLRM's dense half: a bottom MLP over the dense features, the pairwise dot products of it and the
    pooled embeddings, and a top MLP over all of them to a click logit."""

    def __init__(self, dim: int, tables: int) -> None:
        super().__init__()
        self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE, dim), torch.nn.ReLU())
        vectors = tables + 1
        pairs = vectors * (vectors - 1) // 2
        self.top = torch.nn.Sequential(torch.nn.Linear(vectors * dim + pairs, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        vectors = torch.stack([self.bottom(dense), *pooled], 1)          # (n, tables + 1, dim)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.rows, self.cols]
        return self.top(torch.cat([vectors.flatten(1), dots], 1)).squeeze(1)


def logistic_regression(ids: list[np.ndarray], dense: np.ndarray, clicks: np.ndarray, test_ids: list,
                        test_dense: np.ndarray, epochs: int, batch: int) -> np.ndarray:
    """A logistic regression on the same features (a weight per id seen in training, mean-pooled per
    feature as the model pools them; ids not seen weigh 0; a weight per dense feature), trained in this
    process with Adam; returns its test scores."""
    torch.manual_seed(0)
    index, test_index, tables = [], [], []
    for train, test in zip(ids, test_ids):
        vocab = np.unique(train)
        index.append(torch.from_numpy(np.searchsorted(vocab, train)))
        found = np.searchsorted(vocab, test).clip(0, len(vocab) - 1)
        test_index.append(torch.from_numpy(np.where(vocab[found] == test, found, len(vocab))))
        tables.append(torch.nn.EmbeddingBag(len(vocab) + 1, 1, mode="mean", padding_idx=len(vocab)))
        torch.nn.init.zeros_(tables[-1].weight)
    linear = torch.nn.Linear(DENSE, 1)
    params = [p for t in tables for p in t.parameters()] + list(linear.parameters())
    opt = torch.optim.Adam(params, lr=0.01)
    x, y = torch.from_numpy(dense), torch.from_numpy(clicks)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for chunk in torch.randperm(len(y), generator=g).split(batch):
            logit = linear(x[chunk]).squeeze(1) + sum(t(i[chunk]).squeeze(1) for t, i in zip(tables, index))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y[chunk])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        logit = linear(torch.from_numpy(test_dense)).squeeze(1)
        logit += sum(t(i).squeeze(1) for t, i in zip(tables, test_index))
    return logit.numpy()


def main() -> int:
    args = parse_args()
    began = time.monotonic()
    torch.set_num_threads(1)  # small matrices: threads only contend with the servers for the cores
    ids, dense, clicks = click_log(args.samples, args.seed)
    n_train = args.samples * 4 // 5
    torch.manual_seed(0)
    spec = {"capacity": args.capacity} if args.capacity else True
    embeddings = [kvstore.SparseEmbedding(None, args.dim, init={"type": "normal", "sigma": 0.05, "seed": i},
                                          key=name, dynamic=spec)
                  for i, (name, _, _, _) in enumerate(FEATURES)]
    model = DLRM(args.dim, len(FEATURES))
    trainer = kvstore.SparseTrainer(model.named_parameters(), "adam", {"learning_rate": args.lr},
                                    embeddings=embeddings, kvstore=args.kvstore)
    kv = trainer.kvstore
    if args.batch % kv.num_workers:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {kv.num_workers} workers")
    part = args.batch // kv.num_workers
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    order_rng = np.random.default_rng(args.seed + 1)  # the same shuffles on every worker
    touched: list[list[np.ndarray]] = [[] for _ in FEATURES]
    step = 0
    for epoch in range(args.epochs):
        order = order_rng.permutation(n_train)
        total, seen = 0.0, 0
        for start in range(0, n_train - args.batch + 1, args.batch):  # full global batches only
            mine = order[start + kv.rank * part:start + (kv.rank + 1) * part]
            if args.dump:
                for t, f in zip(touched, ids):
                    t.append(f[order[start:start + args.batch]].ravel())
            pooled = []
            for emb, f in zip(embeddings, ids):
                batch_ids = torch.from_numpy(f[mine])
                trainer.prefetch(emb, batch_ids)
                pooled.append(emb(batch_ids).mean(1))
            logit = model(torch.from_numpy(dense[mine]), pooled)
            loss = loss_fn(logit, torch.from_numpy(clicks[mine]))
            loss.backward()
            trainer.step(args.batch)
            model.zero_grad()
            total, seen, step = total + loss.item(), seen + len(mine), step + 1
            if step == args.steps:
                break
        if kv.rank == 0:
            print(f"epoch {epoch}  loss {total / max(seen, 1):.4f} (this worker's slices)  "
                  f"({time.monotonic() - began:.1f} s)", flush=True)
        if step == args.steps:
            break
    test = slice(n_train, args.samples)
    scores = []
    with torch.no_grad():
        for chunk in np.array_split(np.arange(n_train, args.samples), 8):
            pooled = []
            for emb, f in zip(embeddings, ids):
                chunk_ids = torch.from_numpy(f[chunk])
                trainer.prefetch(emb, chunk_ids)  # ids never trained come back as their initial rows
                pooled.append(emb(chunk_ids).mean(1))
            scores.append(model(torch.from_numpy(dense[chunk]), pooled).numpy())
    model_auc = auc(np.concatenate(scores), clicks[test])
    if args.dump:
        arrays = {f"dense/{name}": p.detach().numpy() for name, p in model.named_parameters()}
        for emb, t in zip(embeddings, touched):
            pulled = kv.row_sparse_pull(emb.key, row_ids=np.concatenate(t))
            arrays[f"{emb.key}/ids"], arrays[f"{emb.key}/rows"] = pulled.indices, pulled.rows
        if kv.rank == 0:
            np.savez(args.dump, **arrays)
    code = 0
    if kv.rank == 0:
        print(f"steps {step}  final test AUC {model_auc:.4f}  ({time.monotonic() - began:.1f} s)", flush=True)
        if model_auc < args.min_auc:
            print(f"AUC {model_auc:.4f} < --min-auc {args.min_auc}", flush=True)
            code = 1
        if not args.no_baseline:
            lr_scores = logistic_regression([f[:n_train] for f in ids], dense[:n_train], clicks[:n_train],
                                            [f[test] for f in ids], dense[test], args.epochs, args.batch)
            lr_auc = auc(lr_scores, clicks[test])
            print(f"logistic regression AUC {lr_auc:.4f}  lift {model_auc - lr_auc:+.4f}", flush=True)
            if model_auc - lr_auc < args.min_lift:
                print(f"lift {model_auc - lr_auc:.4f} < --min-lift {args.min_lift}", flush=True)
                code = 1
    kv.close()
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Train a small MLP with the Trainer; rank 0 saves the final weights (tests/integration/test_trainer.py).

argv: OPTIMIZERS UPDATE_ON_KVSTORE(0|1) OUT [STEPS [GLOBAL_BATCH]]

OPTIMIZERS is a comma-separated list (``sgd,adam``): each trains a fresh model with a
Trainer of its own, one after the other on the same store; OUT gets every final
weight as ``OPTIMIZER/PARAMETER``.

Under the launcher it trains data-parallel in ``dist_sync`` (the Trainer's default
there); run directly, in one process with the ``local`` store.  Either way every
step covers the same global batch (a pure function of the seed and the step):
worker ``r`` of ``W`` takes the r-th contiguous share of it, the loss is summed,
and ``trainer.step(global_batch)`` turns the gradient summed over all workers into
the global batch's mean, so every run should end with the same weights.  The last
step takes half a batch, so rescale_grad also changes after the store is set up.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from kvstore import checkpoint
from kvstore.trainer import Trainer

SEED, SAMPLES, FEATURES, HIDDEN, CLASSES = 0, 480, 16, 40, 4
PARAMS = {"sgd": {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
          "adam": {"learning_rate": 0.01, "wd": 1e-4}}


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian points labelled by a fixed random linear teacher."""
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


def train(name: str, update_on_kvstore: bool, steps: int,
          global_batch: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Train; return this worker's rank and its final weights (by parameter name)."""
    x, y = make_data()
    torch.manual_seed(SEED + 1)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    trainer = Trainer(model.named_parameters(), name, PARAMS[name], update_on_kvstore=update_on_kvstore)
    kv = trainer.kvstore
    if global_batch % (2 * kv.num_workers):
        raise SystemExit(f"the global batch {global_batch} and its half do not split over "
                         f"{kv.num_workers} workers")
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    order = torch.Generator().manual_seed(SEED + 2)
    for step in range(steps):
        # the last step takes half a batch: rescale_grad changes after the first step
        batch = global_batch // 2 if step == steps - 1 and steps > 1 else global_batch
        share = batch // kv.num_workers
        rows = torch.randperm(SAMPLES, generator=order)[:batch]  # the same on every worker
        mine = rows[kv.rank * share:(kv.rank + 1) * share]
        model.zero_grad()
        loss_fn(model(x[mine]), y[mine]).backward()
        trainer.step(batch)
    if steps and trainer.learning_rate != PARAMS[name]["learning_rate"]:
        raise SystemExit(f"learning_rate is {trainer.learning_rate}")
    if trainer.update_on_kvstore != update_on_kvstore:
        raise SystemExit(f"update_on_kvstore is {trainer.update_on_kvstore}, asked for {update_on_kvstore}")
    print(f"rank {kv.rank} of {kv.num_workers} ({kv.type}): trained {steps} steps of {name}", flush=True)
    return kv.rank, {n: p.detach().clone() for n, p in model.named_parameters()}


def main(argv: list[str]) -> None:
    names, uok, out = argv[0].split(","), argv[1] == "1", argv[2]
    steps = int(argv[3]) if len(argv) > 3 else 6
    global_batch = int(argv[4]) if len(argv) > 4 else 24
    arrays = {}
    for name in names:
        rank, weights = train(name, uok, steps, global_batch)
        arrays.update({f"{name}/{n}": w.numpy() for n, w in weights.items()})
    if rank == 0:
        checkpoint.save_arrays(out, arrays)


if __name__ == "__main__":
    main(sys.argv[1:])

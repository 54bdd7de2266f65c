"""Save a data-parallel training run and resume it exactly, on a fresh cluster, through the Trainer.

The workflow (any number of servers each time; the workers, batch size and
seed must stay the same, because the data order depends on them)::

    # train 10 global steps, then write a checkpoint into ckpt/
    python launch.py -n 2 -s 1 examples/checkpoint_resume.py --steps 10 --save ckpt
    # later, on a new cluster: continue from step 10 for 10 more steps
    python launch.py -n 2 -s 2 examples/checkpoint_resume.py --steps 10 --resume ckpt --out resumed.arrays
    # the same 20 steps without a break end with exactly the same weights
    python launch.py -n 2 -s 2 examples/checkpoint_resume.py --steps 20 --out unbroken.arrays

A checkpoint directory holds three files:

* ``weights.arrays``: the model's parameters, written by rank 0 with
  ``kvstore.checkpoint.save_arrays`` (a zip of .npy files and a JSON manifest,
  no pickle); every worker's replica is the same in ``dist_sync`` (in
  ``dist_async`` the workers first pull the servers' final weights).
* ``trainer.states``: the optimizer's state (momentum, Adam's moments, the
  update count that drives Adam's bias correction and the lr schedule), written
  by ``trainer.save_states``, which every worker calls: with update on kvstore
  the states live on the servers and are gathered from them, otherwise every
  worker holds the same states and rank 0 writes its own.  The file has one
  format either way, so a run saved with ``--update-on-kvstore 1`` may resume
  with ``0`` and the other way round.
* ``meta.json``: the step count and the settings the data order depends on,
  written last, so a directory with it is a complete checkpoint.

Resuming mirrors it: build the model, copy the saved weights into it BEFORE the
Trainer's first use (the Trainer then broadcasts them, as rank 0's initial
weights, to the servers), call ``trainer.load_states`` on every worker, and
continue from the saved step.  The batch of every step is a pure function of
(seed, step, rank), so the resumed run replays exactly the batches the unbroken
run would have seen and, in ``dist_sync`` and ``local``, ends with bit-identical
weights.  (``dist_async`` resumes too, but its updates race, so no two runs are
identical.)

The data are synthetic (a fixed random teacher labels Gaussian points in 4
classes) and the model is a small MLP, so a run takes seconds.  ``--out FILE``
makes rank 0 write the final weights with ``save_arrays``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

import kvstore
import kvstore.checkpoint
import kvstore.config
import kvstore.data
import kvstore.lr_scheduler

OPTIMIZERS = ("sgd", "nag", "adam", "adagrad", "rmsprop")
SAMPLES, FEATURES, CLASSES, HIDDEN = 512, 16, 4, 32
WEIGHTS, STATES, META = "weights.arrays", "trainer.states", "meta.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvstore", default="dist_sync" if kvstore.config.in_cluster() else "local",
                        help="store type (default: dist_sync under launch.py, else local)")
    parser.add_argument("--steps", type=int, default=20, help="global steps to run in this invocation")
    parser.add_argument("--batch-size", type=int, default=16, help="per-worker batch size")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, the initial weights, the order")
    parser.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 0.1 for sgd and nag, 0.01 for the others)")
    parser.add_argument("--momentum", type=float, default=0.9, help="momentum of sgd and nag")
    parser.add_argument("--wd", type=float, default=0.0, help="weight decay")
    parser.add_argument("--lr-step", type=int, default=0,
                        help="halve the learning rate every this many updates (0: constant rate)")
    parser.add_argument("--update-on-kvstore", choices=("auto", "1", "0"), default="auto",
                        help="1: the servers run the optimizer and keep its states; 0: every worker does; "
                             "auto: the Trainer's default (1 in dist modes)")
    parser.add_argument("--save", type=Path, metavar="DIR", help="write a checkpoint into DIR at the end")
    parser.add_argument("--resume", type=Path, metavar="DIR", help="continue from the checkpoint in DIR")
    parser.add_argument("--out", type=Path, metavar="FILE", help="rank 0 writes the final weights to FILE")
    return parser.parse_args()


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SAMPLES Gaussian points labelled by a random linear teacher: a pure function of ``seed``."""
    rng = np.random.default_rng([seed, 0])
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    y = (x @ teacher + 0.1 * rng.standard_normal((SAMPLES, CLASSES))).argmax(axis=1)
    return torch.from_numpy(x), torch.from_numpy(y)


def batch_indices(seed: int, step: int, rank: int, shard: int, batch_size: int) -> torch.Tensor:
    """The rows of this worker's shard that global step ``step`` trains on: a pure function of its args.

    Each epoch walks a permutation of the shard seeded by (seed, epoch, rank);
    the last partial batch of an epoch is dropped so every step has the same size.
    """
    per_epoch = shard // batch_size
    epoch, position = divmod(step, per_epoch)
    order = np.random.default_rng([seed, 1, epoch, rank]).permutation(shard)
    return torch.from_numpy(order[position * batch_size:(position + 1) * batch_size])


def optimizer_params(args: argparse.Namespace) -> dict:
    """The optimizer's hyper-parameters (and lr schedule) from the command line."""
    lr = args.lr if args.lr is not None else 0.1 if args.optimizer in ("sgd", "nag") else 0.01
    params: dict = {"learning_rate": lr, "wd": args.wd}
    if args.optimizer in ("sgd", "nag"):
        params["momentum"] = args.momentum
    if args.lr_step:
        params["lr_scheduler"] = kvstore.lr_scheduler.FactorScheduler(step=args.lr_step, factor=0.5,
                                                                      base_lr=lr)
    return params


def settings(args: argparse.Namespace, kv: kvstore.KVStore) -> dict:
    """What a resumed run must share with the saved one to replay the same data order."""
    return {"seed": args.seed, "batch_size": args.batch_size, "num_workers": kv.num_workers,
            "optimizer": args.optimizer}


def load_weights(model: nn.Module, path: Path) -> None:
    """Copy the arrays saved in ``path`` into the model's parameters (names, shapes and dtypes must match)."""
    arrays = kvstore.checkpoint.load_arrays(path)
    params = dict(model.named_parameters())
    if sorted(arrays) != sorted(params):
        raise SystemExit(f"{path} holds {sorted(arrays)}, the model has {sorted(params)}")
    with torch.no_grad():
        for name, param in params.items():
            value = torch.from_numpy(arrays[name])
            if value.shape != param.shape or value.dtype != param.dtype:
                raise SystemExit(f"{path}: {name} is {value.dtype} {tuple(value.shape)}, "
                                 f"the model's is {param.dtype} {tuple(param.shape)}")
            param.copy_(value)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def save_checkpoint(directory: Path, model: nn.Module, trainer: kvstore.Trainer, kv: kvstore.KVStore,
                    meta: dict) -> None:
    """Every worker calls it: optimizer states (collective), then rank 0's weights and, last, meta.json."""
    if kv.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    kv.barrier()  # the directory exists before anyone writes into it
    trainer.save_states(str(directory / STATES))
    if kv.rank == 0:
        kvstore.checkpoint.save_arrays(directory / WEIGHTS, weights(model))
        tmp = directory / (META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, directory / META)
    kv.barrier()  # the checkpoint is complete when any worker returns


def train(kv: kvstore.KVStore, args: argparse.Namespace) -> None:
    rank, workers = kv.rank, kv.num_workers
    x, y = make_data(args.seed)
    x, y = kvstore.data.split(x, workers, rank), kvstore.data.split(y, workers, rank)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))

    start = 0
    if args.resume is not None:
        meta = json.loads((args.resume / META).read_text())
        expected = settings(args, kv)
        saved = {k: meta.get(k) for k in expected}
        if saved != expected:
            raise SystemExit(f"cannot replay {args.resume}: saved with {saved}, this run has {expected}")
        start = meta["step"]
        load_weights(model, args.resume / WEIGHTS)  # before the Trainer's first use: it broadcasts them

    uok = None if args.update_on_kvstore == "auto" else args.update_on_kvstore == "1"
    if "async" in kv.type:
        uok = True  # dist_async always updates on the servers
    trainer = kvstore.Trainer(model.named_parameters(), args.optimizer, optimizer_params(args),
                              kvstore=kv, update_on_kvstore=uok)
    if args.resume is not None:
        trainer.load_states(str(args.resume / STATES))  # every worker; after the weights are in the model

    # The loss is SUMMED over the batch and the Trainer sums the gradients over the workers, so
    # step(batch_size * workers) applies the mean gradient of the global batch (gluon's rule:
    # rescale_grad = 1 / batch_size).  dist_async applies each push on arrival with that scale.
    scale = args.batch_size * workers
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total = 0.0
    for step in range(start, start + args.steps):
        rows = batch_indices(args.seed, step, rank, len(x), args.batch_size)
        model.zero_grad()
        loss = loss_fn(model(x[rows]), y[rows])
        loss.backward()
        trainer.step(scale)
        total += loss.item()
    end = start + args.steps
    if "async" in kv.type:
        # a worker's last pull may predate the others' last pushes: once every worker has finished
        # (each step's pushpull returns after its push is applied), take the servers' final weights
        kv.barrier()
        kv.pull(trainer.keys, out=[p.detach() for p in model.parameters()])
    if rank == 0:
        print(f"{kv.type}: {workers} worker(s), {kv.num_servers} server(s), {args.optimizer}: steps {start} "
              f"to {end}, mean loss {total / max(1, args.steps * args.batch_size):.4f}", flush=True)

    if args.save is not None:
        save_checkpoint(args.save, model, trainer, kv, {"step": end, **settings(args, kv)})
        if rank == 0:
            print(f"saved the checkpoint of step {end} to {args.save}", flush=True)
    if args.out is not None and rank == 0:
        kvstore.checkpoint.save_arrays(args.out, weights(model))
        print(f"wrote the weights of step {end} to {args.out}", flush=True)


def main() -> None:
    args = parse_args()
    with kvstore.create(args.kvstore) as kv:
        train(kv, args)


if __name__ == "__main__":
    main()

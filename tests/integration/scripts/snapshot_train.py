"""Worker script for the snapshot tests: Trainer steps FIRST..LAST-1 of a tiny MLP on synthetic data.

argv: OPTIMIZER FIRST LAST [--save DIR] [--out FILE]
The batch of a step is a pure function of (step, rank), so a run resumed from a snapshot
(``launch.py --resume DIR``) at step FIRST replays what an unbroken run sees from there.
``--save`` snapshots the servers after the last step; ``--out`` makes rank 0 write the weights.
"""

import argparse

import torch
from torch import nn

import kvstore

parser = argparse.ArgumentParser()
parser.add_argument("optimizer")
parser.add_argument("first", type=int)
parser.add_argument("last", type=int)
parser.add_argument("--save")
parser.add_argument("--out")
args = parser.parse_args()

kv = kvstore.create("dist_sync")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
params = {"sgd": {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
          "adam": {"learning_rate": 0.01,
                   "lr_scheduler": kvstore.lr_scheduler.FactorScheduler(step=2, factor=0.7)}}[args.optimizer]
trainer = kvstore.Trainer(model.named_parameters(), args.optimizer, params, kvstore=kv, key_prefix="m")
trainer.init_kvstore()  # the weights come from the store (the snapshot's, when resumed) before step 1
loss_fn = nn.CrossEntropyLoss(reduction="sum")
for step in range(args.first, args.last):
    gen = torch.Generator().manual_seed(1000 * step + kv.rank)
    x = torch.randn(16, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    model.zero_grad()
    loss_fn(model(x), y).backward()
    trainer.step(16 * kv.num_workers)
if args.save:
    kv.save_checkpoint(args.save)
if args.out and kv.rank == 0:
    weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    kvstore.checkpoint.save_arrays(args.out, weights)
print(f"done steps {args.first}..{args.last} as rank {kv.rank}", flush=True)
kv.close()

"""Worker script for the restart tests: STEPS Trainer steps of a tiny MLP, resumable after a restart.

argv: STEPS OUT_PREFIX [--mode dist_sync|dist_async] [--raise-at STEP]
The batch of a step is a pure function of the step alone, the same on every worker: so a
dist_sync round that closes without a lost worker (scaled as a quorum of the rest) equals the
full round, and a run with a worker killed and restarted (``launch.py --max-restarts``) must end
with the weights of an unbroken run.  A restarted worker starts at ``kv.rejoined_at``, the step
the job has reached.  Every worker writes its final weights to OUT_PREFIX.RANK.
"""

import argparse

import torch
from torch import nn

import kvstore

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("out")
parser.add_argument("--mode", default="dist_sync")
parser.add_argument("--raise-at", type=int, help="worker 1's first incarnation raises before this step")
args = parser.parse_args()

kv = kvstore.create(args.mode)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
trainer = kvstore.Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                          kvstore=kv, key_prefix="m")
trainer.init_kvstore()  # a restarted worker: the job's current weights
first = kv.rejoined_at or 0
loss_fn = nn.CrossEntropyLoss(reduction="sum")
print(f"training from step {first} as rank {kv.rank}", flush=True)
for step in range(first, args.steps):
    if step == args.raise_at and kv.rank == 1 and kv.rejoined_at is None:
        raise RuntimeError(f"dying at step {step} (--raise-at)")
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    model.zero_grad()
    loss_fn(model(x), y).backward()
    trainer.step(16 * kv.num_workers)
weights = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
kvstore.checkpoint.save_arrays(f"{args.out}.{kv.rank}", weights)
print(f"done steps {first}..{args.steps} as rank {kv.rank}", flush=True)
kv.close()

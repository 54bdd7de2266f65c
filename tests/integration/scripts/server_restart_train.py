"""Worker script for the server restart test: STEPS rounds of pushes of ones under sgd (lr 1).

argv: STEPS OUT_PREFIX [MODE]  (MODE: dist_sync, the default, or dist_async)
Every worker pushes ones to three keys (one pushpull) each step, so after an unbroken run every
element is -workers x STEPS.  When a server is killed and restarted from its shard, the elements it
holds miss the rounds it lost (its log says how many) and nothing else: no round is applied twice.
In dist_async a retried push is applied at most once, so no element goes below -workers x STEPS.
Every worker writes its final values (pulled after a barrier) to OUT_PREFIX.RANK.
"""

import sys

import numpy as np

import kvstore

steps, out = int(sys.argv[1]), sys.argv[2]
kv = kvstore.create(sys.argv[3] if len(sys.argv) > 3 else "dist_sync")
shapes = {"a": (8,), "b": (300,), "c": (5,)}  # "b" is sliced over both servers (KVSTORE_BIGARRAY_BOUND)
kv.init(list(shapes), [np.zeros(s, np.float32) for s in shapes.values()])
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
outs = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
print(f"training as rank {kv.rank}", flush=True)
for _ in range(kv.rejoined_at or 0, steps):  # a restarted worker goes on from the job's step
    kv.push(["a", "b"], [np.ones(shapes["a"], np.float32), np.ones(shapes["b"], np.float32)])
    kv.pushpull("c", np.ones(shapes["c"], np.float32), out=outs["c"])
    kv.pull(["a", "b"], out=[outs["a"], outs["b"]])
kv.barrier()  # every push applied: the values every worker reads are final
kv.pull(list(shapes), out=list(outs.values()))
kvstore.checkpoint.save_arrays(f"{out}.{kv.rank}", outs)
print(f"done {steps} steps as rank {kv.rank}", flush=True)
kv.close()

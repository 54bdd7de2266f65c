"""Worker script for the server-shard tests: STEPS dist_sync pushpulls of known gradients.

argv: STEPS
Every worker pushes all-ones gradients of keys 'w' (200 elements: sliced over the servers when
KVSTORE_BIGARRAY_BOUND is below that) and 'b' (3) each step, under SGD with momentum on the servers,
so a key's value after r rounds is a function of r alone (the test computes it with the same optimizer).
"""

import sys

import numpy as np

import kvstore

steps = int(sys.argv[1])
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(200, np.float32))
kv.init("b", np.zeros(3, np.float32))
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.01, momentum=0.9))
w, b = np.zeros(200, np.float32), np.zeros(3, np.float32)
for _ in range(steps):
    kv.pushpull("w", np.ones(200, np.float32), out=w)
    kv.pushpull("b", np.ones(3, np.float32), out=b)
print(f"done {steps} steps as rank {kv.rank}: w[0] {w[0]:.6f}", flush=True)
kv.close()

"""Worker script for the TensorBoard and timeline tests: ``STEPS`` (argv[1], default 100) dist_sync
rounds of a tiny linear model, each after 20 ms of "work", with ``kvstore.log_scalar('loss', ...)``
each step.  With argv[2] (a rank) that worker works ``DELAY`` (argv[3], default 0.05) s more before
each push: a slowed worker, last in every round."""

import sys
import time

import numpy as np

import kvstore

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
slow_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
kv = kvstore.create("dist_sync")
rng = np.random.default_rng(kv.rank)
x = rng.normal(size=(64, 4)).astype(np.float32)
y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
kv.init("w", np.zeros(4, np.float32))
w = np.zeros(4, np.float32)
for step in range(steps):  # every worker the same number: each round gets every push
    time.sleep(0.02)  # the step's work (forward and backward of a real model)
    err = x @ w - y
    kvstore.log_scalar("loss", float(np.mean(err ** 2)), step)
    grad = (x.T @ err / len(x)).astype(np.float32)
    if kv.rank == slow_rank:
        time.sleep(delay)  # the slowed worker's extra work: it comes last in every round
    kv.push("w", -0.05 * grad)
    kv.pull("w", out=w)
kv.barrier()
kv.close()

"""Worker script for the elastic test: a dist_sync job that grows from 2 to 4 workers and shrinks to 3.

argv: OUT_PREFIX JOIN_AT
Every step each worker pushes 2**rank (every element of key 'w', sliced over the servers) and the
servers apply sgd with lr 1, so a step lowers 'w' by the sum of 2**r over the workers in that round:
the drop tells each worker exactly who was in it.  Worker 0 asks the launcher for two more workers
after step JOIN_AT (two lines 'join' in $KVSTORE_ELASTIC_CONTROL); they take slots 2 and 3, the
current weights and the step (``kv.rejoined_at``).  Once a round of all four has happened 5 times,
worker 3 leaves (``kv.close()``); the others stop after 5 rounds of {0, 1, 2}.  Every worker writes
``step members value`` per step, and its first pulled value, to OUT_PREFIX.RANK.PID.
"""

import os
import sys
import time

import numpy as np

import kvstore

out, join_at = sys.argv[1], int(sys.argv[2])
MAX_STEPS = 5000
kv = kvstore.create("dist_sync")
rank = kv.rank
kv.init("w", np.zeros(300))  # a joining worker: the shape only, the servers hold the value
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))  # a joining worker keeps theirs
w = np.empty(300)
kv.pull("w", out=w)  # a joining worker: the value after the round before its own
step = kv.rejoined_at or 0
record = open(f"{out}.{rank}.{os.getpid()}", "w")
record.write(f"start {step} {float(w[0])!r} {int(np.all(w == w[0]))}\n")
seen4 = seen3 = 0
while True:
    if step >= MAX_STEPS:
        raise RuntimeError(f"worker {rank} reached {MAX_STEPS} steps: the membership never settled")
    time.sleep(0.01)  # the step's compute
    kv.push("w", np.full(300, 2.0 ** rank))
    new = np.empty(300)
    kv.pull("w", out=new)
    drop = w - new
    members = int(drop[0])
    record.write(f"{step} {members} {float(new[0])!r} {int(np.all(drop == drop[0]))}\n")
    w, step = new, step + 1
    if rank == 0 and step == join_at:
        with open(os.environ["KVSTORE_ELASTIC_CONTROL"], "a") as control:
            control.write("join\njoin\n")
    seen4 += members == 0b1111
    seen3 += members == 0b0111 and seen4 > 0
    if (rank == 3 and seen4 >= 5) or seen3 >= 5:
        break
record.write(f"end {step}\n")
record.close()
kv.close()

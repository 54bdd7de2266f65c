"""Worker script for the elastic Ray test: a dist_sync job of 3 worker slots that grows from 2 to 3.

argv: OUT_PREFIX JOIN_AT
Every step each worker pushes 2**rank to key 'w' and the servers apply sgd with lr 1, so a step lowers
'w' by the sum of 2**r over the workers in that round: the drop tells each worker who was in it.  After
step JOIN_AT worker 0 appends two lines 'join' to $KVSTORE_ELASTIC_CONTROL: the first takes slot 2, the
second finds every slot held and is refused.  Every worker stops after 5 rounds of {0, 1, 2}, writing
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
kv.init("w", np.zeros(50))  # a joining worker: the shape only, the servers hold the value
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
w = np.empty(50)
kv.pull("w", out=w)  # a joining worker: the value after the round before its own
step = kv.rejoined_at or 0
record = open(f"{out}.{rank}.{os.getpid()}", "w")
record.write(f"start {step} {float(w[0])!r} {os.environ.get('KVSTORE_JOIN', '0')} "
             f"{os.environ.get('KVSTORE_INCARNATION', '0')} {kv.num_workers}\n")
seen3 = 0
while seen3 < 5:
    if step >= MAX_STEPS:
        raise RuntimeError(f"worker {rank} reached {MAX_STEPS} steps: the join never came")
    time.sleep(0.01)  # the step's compute
    kv.push("w", np.full(50, 2.0 ** rank))
    new = np.empty(50)
    kv.pull("w", out=new)
    members = int((w - new)[0])
    record.write(f"{step} {members} {float(new[0])!r}\n")
    w, step = new, step + 1
    if rank == 0 and step == join_at:
        with open(os.environ["KVSTORE_ELASTIC_CONTROL"], "a") as control:
            control.write("join\njoin\n")
    seen3 += members == 0b111
record.write(f"end {step}\n")
record.close()
kv.close()

"""Worker script for the elastic tests under --max-restarts: a dist_sync job whose joins, deaths and end
the test drives.

argv: OUT_PREFIX STOP_FILE [DIE_AFTER]
Every step each worker pushes 2**rank (every element of key 'w', sliced over the servers) and the
servers apply sgd with lr 1, so a step lowers 'w' by the sum of 2**r over the workers in that round (a
round closed while a worker is away is scaled as a quorum of the rest).  The test appends 'join' lines
to $KVSTORE_ELASTIC_CONTROL itself.  A worker started as a join (KVSTORE_JOIN) SIGKILLs itself after
DIE_AFTER steps of its own, once the step is recorded (so its pushes are exactly its recorded steps);
its restart (no KVSTORE_JOIN) does not.  Every worker stops at the step written in STOP_FILE once
that file exists.  Each process writes ``start STEP VALUE UNIFORM INCARNATION JOIN``, then
``step drop value uniform last_drop`` per step (``drop`` and ``value`` of element 0,
``last_drop`` of the last element, on the other server), then ``end STEP``, to OUT_PREFIX.RANK.PID.
"""

import os
import signal
import sys
import time

import numpy as np

import kvstore

out, stop_file = sys.argv[1], sys.argv[2]
die_after = int(sys.argv[3]) if len(sys.argv) > 3 else 0
joined = os.environ.get("KVSTORE_JOIN") == "1"
MAX_STEPS = 20000
kv = kvstore.create("dist_sync")
rank = kv.rank
kv.init("w", np.zeros(300))  # a joining or restarted worker: the shape only, the servers hold the value
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
w = np.empty(300)
kv.pull("w", out=w)  # a joining or restarted worker: the value after the round before its own
step = kv.rejoined_at or 0
record = open(f"{out}.{rank}.{os.getpid()}", "w", buffering=1)
incarnation = os.environ.get("KVSTORE_INCARNATION", "0")
record.write(f"start {step} {float(w[0])!r} {int(np.all(w == w[0]))} {incarnation} {int(joined)}\n")
own, stop_at = 0, None
while stop_at is None or step < stop_at:
    if step >= MAX_STEPS:
        raise RuntimeError(f"worker {rank} reached {MAX_STEPS} steps: the test never asked it to stop")
    time.sleep(0.01)  # the step's compute
    kv.push("w", np.full(300, 2.0 ** rank))
    new = np.empty(300)
    kv.pull("w", out=new)
    drop = w - new
    record.write(f"{step} {float(drop[0])!r} {float(new[0])!r} {int(np.all(drop == drop[0]))} "
                 f"{float(drop[-1])!r}\n")
    w, step, own = new, step + 1, own + 1
    if joined and own == die_after:
        record.close()
        os.kill(os.getpid(), signal.SIGKILL)
    if stop_at is None and os.path.exists(stop_file):
        with open(stop_file) as f:
            stop_at = int(f.read())
record.write(f"end {step}\n")
record.close()
kv.close()

"""Worker script for the optimizer-then-server-kill test: a big key, sgd (lr 1) set, then a pause for the
test to SIGKILL the server, then STEPS pushes of ones.

argv: STEPS ELEMENTS READY GO OUT.  After set_optimizer returns the worker writes READY and waits (with a
deadline) for GO; once its last pull is in it writes the key's final value to OUT.  With the optimizer
applied every element ends at -STEPS; a server that came back without it stores each push as it came (1).
"""

import sys
import time
from pathlib import Path

import numpy as np

import kvstore

steps, elements, ready, go, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), \
    sys.argv[5]
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(elements, np.float32))
kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
ready.write_text("set")
deadline = time.monotonic() + 60
while not go.exists():  # the test SIGKILLs the server meanwhile
    if time.monotonic() > deadline:
        raise TimeoutError(f"no {go} within 60 s")
    time.sleep(0.01)
value = np.empty(elements, np.float32)
for _ in range(steps):
    kv.push("w", np.ones(elements, np.float32))
    kv.pull("w", out=value)
kvstore.checkpoint.save_arrays(out, {"w": value})
kv.close()

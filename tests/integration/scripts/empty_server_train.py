"""Worker script for the out-of-the-box server restart tests: one small key, pushpulls until the test
creates GO_FILE (and at least STEPS of them), then a last round checked on every worker.

argv: STEPS GO_FILE.  The key's last element carries "I saw GO_FILE" (1 or 0): the round's sum tells
every worker at once, so all stop after the same round.  With 2 servers and KVSTORE_BIGARRAY_BOUND
above the key's size, one server holds the key and the other none.  Prints ``step N`` every 10 steps.
"""

import os
import sys
import time

import numpy as np

import kvstore

steps, go = int(sys.argv[1]), sys.argv[2]
kv = kvstore.create("dist_sync")
kv.init("a", np.zeros(5, np.float32))
out = np.zeros(5, np.float32)
deadline = time.monotonic() + 90
step = kv.rejoined_at or 0
while True:
    if time.monotonic() > deadline:
        raise SystemExit(f"{go} did not appear within 90 s")
    push = np.ones(5, np.float32)
    push[4] = float(os.path.exists(go))
    kv.pushpull("a", push, out=out)
    step += 1
    if step % 10 == 0:
        print(f"step {step}", flush=True)
    if step >= steps and out[4] > 0:
        break
kv.pushpull("a", np.full(5, kv.rank + 1.0, np.float32), out=out)
assert np.array_equal(out, np.full(5, 3.0, np.float32)), out  # worker 0's 1 + worker 1's 2
print(f"done as rank {kv.rank}", flush=True)
kv.close()

"""Worker script for the namespaced-hosts tests (tests/integration/test_hosts.py): dist_sync rounds.

argv: MODE SECONDS.  ``shm``: one round of a 256 KiB key (big enough for same-host shared memory),
checked, then ``LANES rank=R servers=[...] sent=N`` (the servers this worker's segment is mapped by,
and the bytes it moved through them).  ``rounds``: rounds of a small key for up to SECONDS, printing
``ROUNDS rank=R n=N`` every 10 rounds, so a test sees the job make progress.  ``steps``: SECONDS is
a count of steps instead, each a push of ``(step % 3 + 1) * (rank + 1)`` under sgd (lr 0.5) and a pull,
at least 10 ms apart, printing ``ROUNDS`` as ``rounds`` does, then ``FINAL rank=R w=W`` (every element
of the weight after a barrier: exact in float32, and what an unbroken run gives, see ``expected``).
"""

import sys
import time

import numpy as np

import kvstore

mode, seconds = sys.argv[1], float(sys.argv[2])
kv = kvstore.create("dist_sync")
if mode == "shm":
    n = 64 * 1024
    kv.init("big", np.zeros(n, np.float32))
    kv.push("big", np.full(n, kv.rank + 1, np.float32))
    out = kv.pull("big")
    expected = kv.num_workers * (kv.num_workers + 1) / 2
    assert (out == expected).all(), (out[:4], expected)
    lanes = kv._io.lanes  # the worker's same-host lanes (tests/integration/test_shm.py reads them too)
    segments = sorted(lanes.segments) if lanes is not None else []
    sent = lanes.sent if lanes is not None else 0
    print(f"LANES rank={kv.rank} servers={segments} sent={sent}", flush=True)
    kv.barrier()
elif mode == "steps":
    steps = int(seconds)
    kv.init("w", np.zeros(16, np.float32))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.5))
    out = np.zeros(16, np.float32)
    for step in range(steps):
        started = time.monotonic()
        kv.push("w", np.full(16, (step % 3 + 1) * (kv.rank + 1), np.float32))
        kv.pull("w", out=out)
        if (step + 1) % 10 == 0:
            print(f"ROUNDS rank={kv.rank} n={step + 1}", flush=True)
        time.sleep(max(0.0, 0.01 - (time.monotonic() - started)))  # pacing: the job spans a partition
    kv.barrier()
    kv.pull("w", out=out)
    assert (out == out[0]).all(), out
    print(f"FINAL rank={kv.rank} w={float(out[0])!r}", flush=True)
else:
    kv.init("w", np.zeros(16, np.float32))
    deadline, rounds = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        kv.push("w", np.ones(16, np.float32))
        kv.pull("w")
        rounds += 1
        if rounds % 10 == 0:
            print(f"ROUNDS rank={kv.rank} n={rounds}", flush=True)

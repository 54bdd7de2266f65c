"""Worker script for launcher tests: W workers push ones*(rank+1); everyone must pull W(W+1)/2.

argv: MODE [FAIL_RANK [EXIT_CODE]] -- FAIL_RANK raises (or exits with EXIT_CODE) after init, while
the others block in a dist_sync pull.
"""

import sys

import numpy as np

import kvstore
from kvstore.errors import ConfigError

mode = sys.argv[1]
fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
exit_code = int(sys.argv[3]) if len(sys.argv) > 3 else None

kv = kvstore.create(mode)
assert kvstore.create(mode) is kv, "create must return the process's existing store"
try:
    kvstore.create("dist_async" if mode == "dist_sync" else "dist_sync")
    raise AssertionError("a second mode in one process must be refused")
except ConfigError:
    pass
W = kv.num_workers
for key, size in ((5, 10), ("big", 2500)):  # the launcher test sets KVSTORE_BIGARRAY_BOUND=1000
    kv.init(key, np.zeros(size, np.float32))
if kv.rank == fail_rank:
    if exit_code is not None:
        sys.exit(exit_code)
    raise RuntimeError(f"worker {kv.rank} fails on purpose")
for key, size in ((5, 10), ("big", 2500)):
    kv.push(key, np.ones(size, np.float32) * (kv.rank + 1))
    out = kv.pull(key)
    assert (out == W * (W + 1) / 2).all(), (key, out[:5])
kv.barrier()
print(f"RESULT ok rank={kv.rank} of {W} servers={kv.num_servers}", flush=True)

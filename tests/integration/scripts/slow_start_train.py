"""A worker that starts slowly (as after a big import): waits for DIR/go, then joins, pushes, closes."""

import sys
import time
from pathlib import Path

import numpy as np

import kvstore

d = Path(sys.argv[1])
deadline = time.monotonic() + 60
while not (d / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
kv = kvstore.create("dist_sync")
kv.init("a", np.zeros(4, np.float32))
kv.push("a", np.ones(4, np.float32))
kv.barrier()
print(f"worker {kv.rank} done", flush=True)
kv.close()

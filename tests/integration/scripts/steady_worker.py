"""Worker script for kill tests: dist_sync push/pull rounds for up to 60 s; after the first round
each worker creates READY_DIR/rank<r> so the test knows the cluster is mid-training."""

import sys
import time
from pathlib import Path

import numpy as np

import kvstore

ready_dir = Path(sys.argv[1])
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(3000, np.float32))  # split over the servers (the test sets the bound)
deadline = time.monotonic() + 60
first = True
while time.monotonic() < deadline:
    kv.push("w", np.ones(3000, np.float32))
    kv.pull("w")
    if first:
        (ready_dir / f"rank{kv.rank}").touch()
        first = False

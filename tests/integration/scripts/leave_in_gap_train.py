"""Both workers init and pass a barrier, say so (DIR/ready.RANK), and wait for
DIR/go.  Worker 1 then closes at once (its LEAVE in the scheduler's gap); worker 0 keeps pushing for
8 s (through the gap and the rebuild) and closes.  argv: DIR"""

import sys
import time
from pathlib import Path

import numpy as np

import kvstore

d = Path(sys.argv[1])
kv = kvstore.create("dist_sync")
kv.init("a", np.zeros(4, np.float32))
kv.barrier()
(d / f"ready.{kv.rank}").write_text("1")
deadline = time.monotonic() + 60
while not (d / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.01)
if kv.rank == 1:
    kv.close()
    print("worker 1 closed", flush=True)
    sys.exit(0)
end = time.monotonic() + 8
while time.monotonic() < end:
    kv.push("a", np.ones(4, np.float32))
    time.sleep(0.05)
kv.barrier()  # worker 1 has left: released with worker 0 alone
print("worker 0 passed its barrier", flush=True)
kv.close()
print("worker 0 closed", flush=True)

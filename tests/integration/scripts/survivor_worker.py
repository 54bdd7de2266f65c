"""A worker for the traceback test: joins the cluster, initialises "w", says READY, then calls
barrier() with nothing around it, so the error of a peer's death ends the script with a traceback."""

import numpy as np

import kvstore

kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
print(f"READY rank={kv.rank}", flush=True)
kv.barrier()

"""A worker for failure tests: joins the cluster, initialises key "w", says READY, then
waits for ever (``wait``) to be killed, or raises (``raise``) to die of an exception."""

import sys
import threading

import numpy as np

import kvstore

kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
print(f"READY rank={kv.rank}", flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the lone worker fails on purpose")
threading.Event().wait()

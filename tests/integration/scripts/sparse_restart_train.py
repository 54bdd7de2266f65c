"""Worker script for the row-sparse server restart test: STEPS rounds of sgd with momentum on a dynamic
table and a fixed one.

argv: STEPS OUT_PREFIX GO_FILE [MODE]  (MODE: dist_sync, the default, with sgd momentum 0.9; or
dist_async, with plain sgd)
Before step PAUSE each worker waits (60 s at most) for GO_FILE to exist: the test makes it once a
server has written a shard of that step, so the restart has rows and momentum to come back with.
Each step every worker pushes the rows of :func:`batch` (the same rule the test's reference run uses) to
both tables and pulls them back; the gradients depend on the step and the rank only.  After a barrier
every worker pulls every row the job touched and writes them to OUT_PREFIX.RANK (arrays ``d_ids``,
``d_rows``, ``f_rows``).
"""

import os
import sys
import time

import numpy as np

import kvstore
from kvstore import RowSparse

WIDTH, FIXED_ROWS, IDS, PAUSE = 4, 40, 24, 8
DYNAMIC = {"type": "normal", "sigma": 0.1, "seed": 5}
FIXED = {"type": "uniform", "seed": 6}


def table_ids() -> np.ndarray:
    """The dynamic table's ids: 64-bit values spread over both servers."""
    with np.errstate(over="ignore"):
        return (np.arange(1, IDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(dynamic ids, their gradient rows, fixed ids, their rows)`` a worker pushes at ``step``."""
    ids = table_ids()
    pick = np.unique((np.arange(10) * (rank + 2) + step) % IDS)
    grads = np.full((pick.size, WIDTH), 0.125 * ((step % 5) + 1) * (rank + 1), np.float32)
    grads += np.arange(WIDTH, dtype=np.float32) * 0.0625
    fixed = np.unique((np.arange(12) * (rank + 3) + 2 * step) % FIXED_ROWS)
    frows = np.full((fixed.size, WIDTH), 0.25 * ((step % 3) + 1) * (rank + 1), np.float32)
    return ids[pick], grads, fixed.astype(np.int64), frows


def setup(kv, momentum: float = 0.9) -> None:
    """Both tables and the optimizer, as the test's reference store makes them."""
    kv.init("d", width=WIDTH, dtype="float32", init=DYNAMIC, dynamic=True)
    kv.init("f", shape=(FIXED_ROWS, WIDTH), dtype="float32", init=FIXED)
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.1, momentum=momentum))


def main() -> None:
    steps, out, go = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "dist_sync"
    kv = kvstore.create(mode)
    setup(kv, 0.9 if mode == "dist_sync" else 0.0)
    print(f"training as rank {kv.rank}", flush=True)
    for step in range(steps):
        if step == PAUSE:
            deadline = time.monotonic() + 60
            while not os.path.exists(go):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {go} within 60 s")
                time.sleep(0.05)
        ids, grads, fixed, frows = batch(step, kv.rank)
        kv.push("d", RowSparse(ids, grads, shape=(0, WIDTH)))
        kv.push("f", RowSparse(fixed, frows, shape=(FIXED_ROWS, WIDTH)))
        kv.row_sparse_pull("d", row_ids=ids)
        kv.row_sparse_pull("f", row_ids=fixed)
    kv.barrier()
    dynamic = kv.row_sparse_pull("d", row_ids=table_ids())
    fixed = kv.row_sparse_pull("f", row_ids=np.arange(FIXED_ROWS))
    kvstore.checkpoint.save_arrays(f"{out}.{kv.rank}", {"d_ids": dynamic.indices, "d_rows": dynamic.rows,
                                                       "f_rows": fixed.rows})
    print(f"done {steps} steps as rank {kv.rank}", flush=True)
    kv.close()


if __name__ == "__main__":
    main()

"""Worker script for the row-sparse worker restart test: STEPS steps of sgd with momentum on a dynamic
table, a fixed one and a dense key, resumable after a worker's restart (``launch.py --max-restarts``).

argv: STEPS OUT_PREFIX GO_FILE
Every worker pushes the same rows in a step (:func:`batch`, a function of the step alone): so a
dist_sync round that closes without a lost worker (scaled by workers / pushes) equals the full round,
and a run with a worker killed and restarted must end with an unbroken run's rows.  Each step
pushpulls the dense key 'w', then pushes both tables and pulls their rows back
(``KVSTORE_TEST_DIE_AT_ROUND=1:N`` counts the dense key's rounds: worker 1 dies before its tables'
round N-1, which the others' rounds then close without it).  A restarted worker starts at
``kv.rejoined_at``.  Before step PAUSE a first incarnation waits (60 s at most) for GO_FILE to exist:
the test makes it once worker 1 has rejoined, so the rejoin lands mid-training.  After a barrier every
worker pulls every row the job touched and writes them to OUT_PREFIX.RANK (arrays ``d_ids``, ``d_rows``,
``f_rows``, ``w``).
"""

import os
import sys
import time

import numpy as np

import kvstore
from kvstore import RowSparse

WIDTH, FIXED_ROWS, IDS, PAUSE = 4, 40, 24, 7
DYNAMIC = {"type": "normal", "sigma": 0.1, "seed": 5}
FIXED = {"type": "uniform", "seed": 6}


def table_ids() -> np.ndarray:
    """The dynamic table's ids: 64-bit values spread over both servers."""
    with np.errstate(over="ignore"):
        return (np.arange(1, IDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


def batch(step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(dynamic ids, their gradient rows, fixed ids, their rows, the dense gradient)`` of ``step``."""
    pick = np.unique((np.arange(10) * 3 + step) % IDS)
    grads = np.full((pick.size, WIDTH), 0.125 * ((step % 5) + 1), np.float32)
    grads += np.arange(WIDTH, dtype=np.float32) * 0.0625
    fixed = np.unique((np.arange(12) * 5 + 2 * step) % FIXED_ROWS)
    frows = np.full((fixed.size, WIDTH), 0.25 * ((step % 3) + 1), np.float32)
    dense = np.full(WIDTH, 0.5 * ((step % 4) + 1), np.float32)
    return table_ids()[pick], grads, fixed.astype(np.int64), frows, dense


def setup(kv) -> None:
    """Both tables, the dense key and the optimizer, as the test's reference store makes them."""
    kv.init("d", width=WIDTH, dtype="float32", init=DYNAMIC, dynamic=True)
    kv.init("f", shape=(FIXED_ROWS, WIDTH), dtype="float32", init=FIXED)
    kv.init("w", np.zeros(WIDTH, np.float32))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))


def main() -> None:
    steps, out, go = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    kv = kvstore.create("dist_sync")
    setup(kv)  # a restarted worker: the tables' and the key's metas only (the servers hold them)
    first = kv.rejoined_at or 0
    print(f"training from step {first} as rank {kv.rank}", flush=True)
    w = np.zeros(WIDTH, np.float32)
    for step in range(first, steps):
        if step == PAUSE and kv.rejoined_at is None:
            deadline = time.monotonic() + 60
            while not os.path.exists(go):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {go} within 60 s")
                time.sleep(0.05)
        ids, grads, fixed, frows, dense = batch(step)
        kv.pushpull("w", dense, out=w)  # a kill after round N comes here: before step N-1's tables
        kv.push("d", RowSparse(ids, grads, shape=(0, WIDTH)))
        kv.push("f", RowSparse(fixed, frows, shape=(FIXED_ROWS, WIDTH)))
        kv.row_sparse_pull("d", row_ids=ids)
        kv.row_sparse_pull("f", row_ids=fixed)
    kv.barrier()
    dynamic = kv.row_sparse_pull("d", row_ids=table_ids())
    fixed = kv.row_sparse_pull("f", row_ids=np.arange(FIXED_ROWS))
    kv.pull("w", out=w)
    kvstore.checkpoint.save_arrays(f"{out}.{kv.rank}", {"d_ids": dynamic.indices, "d_rows": dynamic.rows,
                                                       "f_rows": fixed.rows, "w": w})
    print(f"done steps {first}..{steps} as rank {kv.rank}", flush=True)
    kv.close()


if __name__ == "__main__":
    main()

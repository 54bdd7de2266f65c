"""A worker of test_sparse_restarts: sgd set first, then a fixed table initialised from a value, then STEPS
rounds pushing rows 0..3 only; writes every row to OUT.RANK (array ``f_rows``).

argv: STEPS OUT
"""

import sys

import numpy as np

import kvstore
from kvstore import RowSparse

ROWS, WIDTH = 4096, 4


def main() -> None:
    steps, out = int(sys.argv[1]), sys.argv[2]
    kv = kvstore.create("dist_sync")
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.1))
    value = np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH) + 1.0
    kv.init("f", value, stype="row_sparse")
    for _ in range(steps):
        ids = np.arange(4, dtype=np.int64)
        kv.push("f", RowSparse(ids, np.ones((4, WIDTH), np.float32), shape=(ROWS, WIDTH)))
        kv.row_sparse_pull("f", row_ids=ids)
    kv.barrier()
    rows = kv.row_sparse_pull("f", row_ids=np.arange(ROWS, dtype=np.int64)).rows
    kvstore.checkpoint.save_arrays(f"{out}.{kv.rank}", {"f_rows": rows})
    kv.close()


if __name__ == "__main__":
    main()

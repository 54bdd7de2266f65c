"""Loads of row-sparse tables stream (docs/sparse.md): load_optimizer_states and a resumed init read a
table's rows and state from the file a chunk at a time and send each chunk before reading the next,
so the loading worker's memory grows by about a chunk, not by the table."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

import kvstore
from kvstore import RowSparse

ROWS, W, DYNAMIC_ROWS = 120_000, 16, 60_000  # 7.3 MiB of fixed rows, 3.7 MiB of dynamic ones
CHUNK = 128 << 10  # the cluster's KVSTORE_CHUNK_BYTES
TABLE = ROWS * W * 4
BOUND = 16 * CHUNK + (1 << 20)  # a few chunks in flight, and what messages cost to build (measured: 1-1.5 MB)


def grown(fn: Callable[[], object]) -> int:
    """The most bytes allocated (tracemalloc: numpy's arrays too) above where it started while ``fn`` ran."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def train(kv) -> np.ndarray:
    """Both tables, adam, one step over every row; the dynamic table's ids."""
    kv.init("f", shape=(ROWS, W), init={"type": "uniform", "seed": 3})
    kv.init("d", width=W, dtype="float32", init={"type": "normal", "seed": 4}, dynamic=True)
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.01))
    ids = np.arange(DYNAMIC_ROWS, dtype=np.int64) * 7919 + 11
    grad = np.linspace(-1, 1, ROWS * W, dtype=np.float32).reshape(ROWS, W)
    kv.push(["f", "d"], [RowSparse(np.arange(ROWS), grad, (ROWS, W)),
                         RowSparse(ids, grad[:DYNAMIC_ROWS], (0, W))])
    kv.barrier()
    return ids


def states(path: Path) -> dict:
    """The saved states by key: (arrays, ids sorted with their rows)."""
    out = {}
    for entry in kvstore.checkpoint.read_states(str(path)).entries:
        out[entry.key] = (entry.arrays, entry.ids, entry.count)
    return out


def test_loads_stream_a_table_bigger_than_a_chunk(make_cluster, tmp_path: Path) -> None:
    """load_optimizer_states of a 7.3 MiB table's adam state (and a dynamic table's) and a --resume's
    init of the tables and their state grow the loading worker's memory by a few 128 KiB chunks (3 MiB
    at most; reading the file whole took 34 MB), and the servers then hold exactly what was saved."""
    cluster = make_cluster("dist_sync", 1, 2, KVSTORE_CHUNK_BYTES=CHUNK)
    (kv,) = cluster.workers
    ids = train(kv)
    kv.save_optimizer_states(str(tmp_path / "saved"))
    kv.save_checkpoint(str(tmp_path / "snap"))
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.01))  # fresh: no state
    assert grown(lambda: kv.load_optimizer_states(str(tmp_path / "saved"))) < BOUND  # whole: 34 MB
    kv.save_optimizer_states(str(tmp_path / "again"))
    saved, again = states(tmp_path / "saved"), states(tmp_path / "again")
    for key in ("f", "d"):
        assert saved[key][2] == again[key][2] == 1
        for name in ("mean", "var"):
            np.testing.assert_array_equal(saved[key][0][name], again[key][0][name], err_msg=f"{key} {name}")
    np.testing.assert_array_equal(saved["d"][1], again["d"][1])
    table = kv.row_sparse_pull("f", row_ids=np.arange(ROWS)).rows
    rows = kv.row_sparse_pull("d", row_ids=ids).rows

    resumed = make_cluster("dist_sync", 1, 2, KVSTORE_CHUNK_BYTES=CHUNK, connect=False)
    (kv2,) = resumed.connect(resume=str(tmp_path / "snap"))

    def resume() -> None:
        kv2.init("f", shape=(ROWS, W), init={"type": "uniform", "seed": 3})
        kv2.init("d", width=W, dtype="float32", init={"type": "normal", "seed": 4}, dynamic=True)
        kv2.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.01))
    assert grown(resume) < BOUND
    np.testing.assert_array_equal(kv2.row_sparse_pull("f", row_ids=np.arange(ROWS)).rows, table)
    np.testing.assert_array_equal(kv2.row_sparse_pull("d", row_ids=ids).rows, rows)
    kv2.save_optimizer_states(str(tmp_path / "resumed"))
    back = states(tmp_path / "resumed")
    for key in ("f", "d"):
        for name in ("mean", "var"):
            np.testing.assert_array_equal(saved[key][0][name], back[key][0][name], err_msg=f"{key} {name}")
    assert TABLE > 2 * BOUND

"""kvstore.spark.run(epochs=...) on a real local Spark (local[7]: 1 scheduler + 1 server + 4 workers in
the barrier stage, one slot for the feed's jobs): a DataFrame streamed for several epochs, and
kvstore.spark.predict.  One SparkSession for the module; the train_fns are module-level functions the
executors import by name."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("pyspark", reason="kvstore.spark needs pyspark (pip install -e .[spark])")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17: there is no java on PATH and JAVA_HOME is unset",
                allow_module_level=True)

from pyspark.sql import functions  # noqa: E402

import kvstore  # noqa: E402
import kvstore.spark as kvspark  # noqa: E402
from tests.integration.launch.spark_session import local_spark  # noqa: E402

SLOTS = 7
QUIET = {"KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_LOG_LEVEL": "WARNING"}
WIDTH = 8  # floats per row's array column


@pytest.fixture(scope="module")
def spark():
    """A local[7] SparkSession for the module."""
    with local_spark(SLOTS, "kvstore-spark-feed-tests") as session:
        yield session


def uneven_frame(spark, sizes: list[int]):
    """Rows ``id`` 0..sum(sizes)-1 in partitions of ``sizes`` rows, with ``x`` (an array of WIDTH floats
    that depend on id) and ``half`` (id / 2, a double)."""
    frames, start = [], 0
    for size in sizes:
        frames.append(spark.range(start, start + size, numPartitions=1))
        start += size
    df = frames[0]
    for frame in frames[1:]:
        df = df.union(frame)
    x = functions.array(*[(functions.col("id") * 0.001 + k).cast("float") for k in range(WIDTH)])
    return df.select("id", x.alias("x"), (functions.col("id") / 2).alias("half"))


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def epoch_ids(feed) -> dict:
    """The ids of every epoch in the order they came, the batch sizes, whether every batch's columns
    matched its ids, and (with clear_refs) this worker's peak memory growth while it streamed."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident size restarts from here
    except OSError:
        pass
    start = _vm_kib("VmRSS")
    ids, sizes, consistent = [], [], True
    for epoch in feed:
        seen, counts = [], []
        for batch in epoch:
            seen.append(batch["id"])
            counts.append(len(batch["id"]))
            expect_x = (batch["id"][:, None] * 0.001 + np.arange(WIDTH)).astype(np.float32)
            consistent &= batch["x"].shape == (len(batch["id"]), WIDTH)
            consistent &= bool(np.allclose(batch["x"], expect_x))
            consistent &= bool(np.array_equal(batch["half"], batch["id"] / 2))
        ids.append(np.concatenate(seen).tolist() if seen else [])
        sizes.append(counts)
    return {"rank": feed.rank, "ids": ids, "sizes": sizes, "consistent": consistent,
            "rows_seen": feed.rows_seen, "growth_kib": _vm_kib("VmHWM") - start}


def epoch_counts(feed, total: int) -> dict:
    """How often each id came per epoch (uint8 counts), the rows and first ids per epoch, and this
    worker's peak memory growth while it streamed (clear_refs restarts the peak).  The worker registers
    first, as a training function does: one that never creates its store fails the job once the
    scheduler's rendezvous deadline passes (KVSTORE_CONNECT_TIMEOUT; CI's 3 epochs took 89 s once)."""
    kv = kvstore.create("dist_sync")
    counts = [np.zeros(total, np.uint8) for _ in range(feed.epochs)]
    for bits in counts:
        bits[:] = 0  # touched before the peak restarts
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    start = _vm_kib("VmRSS")
    rows, heads = [], []
    for epoch, batches in enumerate(feed):
        seen, head = 0, None
        for batch in batches:
            np.add.at(counts[epoch], batch["id"], 1)
            seen += len(batch["id"])
            head = batch["id"][:20].tolist() if head is None else head
        rows.append(seen)
        heads.append(head)
    growth = _vm_kib("VmHWM") - start
    kv.close()
    return {"counts": counts, "rows": rows, "heads": heads, "growth_kib": growth}


def check_epochs(results: list[dict], total: int, epochs: int, batch_size: int) -> None:
    """Every row once per epoch across the workers, shares within one row, full batches but the last,
    and a new order each epoch."""
    assert [r["rank"] for r in results] == list(range(len(results)))
    for epoch in range(epochs):
        shares = [r["ids"][epoch] for r in results]
        assert sorted(i for share in shares for i in share) == list(range(total))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        for r in results:
            assert all(size == batch_size for size in r["sizes"][epoch][:-1]), r["sizes"][epoch]
    assert all(r["consistent"] for r in results)
    assert sum(r["rows_seen"] for r in results) == total * epochs
    assert results[0]["ids"][0] != results[0]["ids"][1]  # reshuffled
    assert results[0]["ids"][0] != sorted(results[0]["ids"][0])


def test_feed_streams_each_row_once_per_epoch_to_four_workers(spark):
    """10k rows in uneven partitions, 3 epochs, 4 workers: each epoch every row reaches exactly one
    worker, in batches of 256 (the last shorter), reshuffled per epoch; no worker hangs at an end."""
    total = 10_000
    df = uneven_frame(spark, [6000, 2500, 1000, 500])
    results = kvspark.run(spark, epoch_ids, 4, 1, data=df, epochs=3, batch_size=256, seed=5, env=QUIET)
    check_epochs(results, total, 3, 256)


def test_feed_arguments_are_checked_before_any_job(spark):
    """epochs= needs a DataFrame, counts >= 1, carried column types, and one slot beyond the barrier
    stage (NotEnoughSlotsError naming the feed task)."""
    df = spark.range(10)
    with pytest.raises(TypeError, match="streams a DataFrame"):
        kvspark.run(spark, epoch_ids, 1, 1, data=df.rdd, epochs=1)
    with pytest.raises(kvstore.ConfigError, match="batch_size"):
        kvspark.run(spark, epoch_ids, 1, 1, data=df, epochs=1, batch_size=0)
    with pytest.raises(kvstore.ConfigError, match="cannot carry column 'm'"):
        kvspark.run(spark, epoch_ids, 1, 1, data=df.select(functions.create_map("id", "id").alias("m")),
                    epochs=1)
    with pytest.raises(kvspark.NotEnoughSlotsError, match=r"needs 8 .*\+ 1 feed task"):
        kvspark.run(spark, epoch_ids, 5, 1, data=df, epochs=1)


def linear_model(weights: dict):
    """predict's model_fn: x @ w + b of the state dict's arrays."""
    w, b = np.asarray(weights["w"]), np.asarray(weights["b"])
    return lambda batch: batch @ w + b


def local_predictions(df, weights: dict) -> np.ndarray:
    """What one process computes from the same rows and weights (float32, as predict hands the model)."""
    x = np.array([row["x"] for row in df.orderBy("id").collect()], np.float32)
    return x @ weights["w"] + weights["b"]


def test_predict_from_a_checkpoint_equals_one_process(spark, tmp_path):
    """predict(model_fn, df, checkpoint=DIR) of 10k rows: one prediction per row, in df's order, equal to
    one process's predictions from the weights kv.save_checkpoint wrote (and to weights= given)."""
    weights = {"w": np.linspace(-1, 1, WIDTH).astype(np.float32), "b": np.float32(0.5)}
    with kvstore.create("local") as kv:
        for key, value in weights.items():
            kv.init(key, np.atleast_1d(value))
        kv.save_checkpoint(str(tmp_path / "ckpt"))
    df = uneven_frame(spark, [4000, 3000, 2000, 1000])
    out = kvspark.predict(linear_model, df, checkpoint=str(tmp_path / "ckpt"), input_cols="x")
    assert out.columns == ["id", "x", "half", "prediction"] and df.columns == ["id", "x", "half"]
    rows = out.collect()
    assert [row["id"] for row in rows] == list(range(10_000))  # df's order
    np.testing.assert_allclose([row["prediction"] for row in rows], local_predictions(df, weights), rtol=1e-5)
    given = kvspark.predict(linear_model, df, weights=weights, input_cols=["x"], output_col="y").collect()
    assert [row["y"] for row in given] == [row["prediction"] for row in rows]


@pytest.mark.bigfeed
@pytest.mark.timeout(1200)
def test_a_million_rows_for_three_epochs_keep_each_worker_bounded(spark):
    """1M rows (about 48 MB of numbers) for 3 epochs to 4 workers: every row once per epoch, and each
    worker's peak resident memory grows by far less than its 250k-row share while it streams."""
    total = 1_000_000
    df = uneven_frame(spark, [400_000, 300_000, 200_000, 100_000])
    results = kvspark.run(spark, epoch_counts, 4, 1, data=df, epochs=3, batch_size=1024, seed=1,
                          args=(total,), env=QUIET, feed_timeout=600)
    for epoch in range(3):
        assert (sum(r["counts"][epoch] for r in results) == 1).all()  # every row once, none twice
        assert max(r["rows"][epoch] for r in results) - min(r["rows"][epoch] for r in results) <= 1
    assert results[0]["heads"][0] != results[0]["heads"][1]  # reshuffled
    growth = [r["growth_kib"] for r in results]
    print(f"workers' peak memory growth while streaming 3 x 250k rows (KiB): {growth}")
    assert max(growth) < 32 * 1024, growth  # a share is ~12 MB of numbers per epoch, ~100 MB as Rows


@pytest.mark.bigfeed
@pytest.mark.timeout(600)
def test_predict_over_100k_rows_equals_one_process(spark):
    """predict of 100k rows with weights= equals one process's predictions, row for row, in order."""
    weights = {"w": np.linspace(-1, 1, WIDTH).astype(np.float32), "b": np.float32(-0.25)}
    df = uneven_frame(spark, [50_000, 30_000, 20_000])
    rows = kvspark.predict(linear_model, df, weights=weights, input_cols="x").collect()
    assert [row["id"] for row in rows] == list(range(100_000))
    np.testing.assert_allclose([row["prediction"] for row in rows], local_predictions(df, weights), rtol=1e-5)

"""kvstore.spark.run on a real local Spark (local[6]): the cluster in one barrier job, data feeding,
failures and the slot check.  One SparkSession for the whole module (starting one takes seconds).

The train_fns below run in Spark's Python workers, which import this module by name (the fixture puts
the repository on their PYTHONPATH), so they are plain module-level functions.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("pyspark", reason="kvstore.spark needs pyspark (pip install -e .[spark])")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("Spark needs Java 17: there is no java on PATH and JAVA_HOME is unset",
                allow_module_level=True)

import kvstore  # noqa: E402
import kvstore.spark as kvspark  # noqa: E402
from kvstore.errors import NotEnoughSlotsError, SparkJobFailed  # noqa: E402
from tests.helpers import poll_for, tagged_pids  # noqa: E402
from tests.integration.launch.spark_session import local_spark  # noqa: E402

SLOTS = 6
FAILURE_SECONDS = 30  # a failed job must be reported well before anything would time out
QUIET = {"KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_LOG_LEVEL": "WARNING"}


@pytest.fixture(scope="module")
def spark():
    """A local[6] SparkSession whose Python workers run this interpreter and can import the tests."""
    with local_spark(SLOTS, "kvstore-spark-tests") as session:
        yield session


# -- train_fns (run on the executors) ----------------------------------------------------------------

def sum_check(records, mode: str) -> dict:
    """tests/integration/scripts/sum_check.py as a train_fn: W workers push ones*(rank+1), everyone
    pulls W(W+1)/2; the 2500-element key is split over the servers (KVSTORE_BIGARRAY_BOUND=1000)."""
    kv = kvstore.create(mode)
    assert kvstore.create(mode) is kv
    workers = kv.num_workers
    for key, size in ((5, 10), ("big", 2500)):
        kv.init(key, np.zeros(size, np.float32))
    ok = []
    for key, size in ((5, 10), ("big", 2500)):
        kv.push(key, np.ones(size, np.float32) * (kv.rank + 1))
        ok.append(bool((kv.pull(key) == workers * (workers + 1) / 2).all()))
    kv.barrier()
    # no kv.close(): run() must leave the cluster for it
    return {"rank": kv.rank, "workers": workers, "servers": kv.num_servers, "ok": ok,
            "big_on": sorted({piece.server for piece in kv._path.pieces("big")}),
            "role": os.environ.get("DMLC_ROLE"), "worker_id": os.environ.get("DMLC_WORKER_ID"),
            "pid": os.getpid()}


def environment(_) -> tuple[int, dict]:
    """What a plain task's Python worker sees of the variables run() sets for its workers."""
    return os.getpid(), {name: os.environ[name] for name in ("DMLC_ROLE", "DMLC_WORKER_ID", "KVSTORE_SECRET",
                                                             "KVSTORE_BIGARRAY_BOUND") if name in os.environ}


def gpu_names(records) -> dict:
    """The GPU variables run(worker_gpus=...) gave this worker, after joining the cluster."""
    kv = kvstore.create("dist_sync")
    kv.barrier()
    return {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE",
                                                    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}


def seen_ids(records) -> list[int]:
    """Only reads its share (never joins the cluster)."""
    return [row["id"] for row in records]


def fit_linear(records, steps: int, learning_rate: float, total: int) -> dict:
    """Least squares on this worker's rows with dist_sync: push the gradient of the global mean loss,
    the servers sum over workers and run SGD, pull the weights back."""
    rows = list(records)
    x = np.array([row["x"] for row in rows], np.float32)
    y = np.array([row["y"] for row in rows], np.float32)
    kv = kvstore.create("dist_sync")
    kv.init("w", np.zeros(x.shape[1], np.float32))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=learning_rate))
    w = kv.pull("w")
    losses = []
    for _ in range(steps):
        err = x @ w - y
        losses.append(float(err @ err))  # this worker's part of the global sum of squares
        kv.push("w", (2.0 / total) * (x.T @ err))
        w = kv.pull("w")
    err = x @ w - y
    losses.append(float(err @ err))
    kv.close()
    return {"rank": kv.rank, "ids": sorted(row["id"] for row in rows), "losses": losses, "w": w.tolist()}


def fail_rank_1(records, tag: str) -> None:
    """Rank 1 raises once the cluster runs (saying how many tagged roles it sees); rank 0 then waits
    in a dist_sync pull that can only end by Spark killing it or by the scheduler reporting rank 1."""
    kv = kvstore.create("dist_sync")
    kv.init("k", np.zeros(4, np.float32))
    if kv.rank == 1:
        raise RuntimeError(f"worker fails on purpose; tagged roles alive: {len(tagged_pids(tag))}")
    kv.push("k", np.ones(4, np.float32))
    kv.pull("k")


def join_only(records, mode: str = "dist_sync") -> int:
    return kvstore.create(mode).rank


def resumable_train(records, snapshot: str, steps: int, fail: bool) -> tuple[int, list]:
    """Trainer steps of a tiny MLP on batches that depend on (step, rank) alone, from the servers'
    update count (the snapshot's, on a retried stage); a snapshot after every odd step.  With
    ``fail``, worker 1 raises at step 5 unless the stage was resumed.  Returns (first step, weights)."""
    import torch
    from torch import nn

    kv = kvstore.create("dist_sync")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    trainer = kvstore.Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                              kvstore=kv, key_prefix="m")
    trainer.init_kvstore()
    first = kv.get_optimizer().num_update
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for step in range(first, steps):
        if fail and step == 5 and kv.rank == 1 and "KVSTORE_RESUME" not in os.environ:
            raise RuntimeError("worker 1 fails on purpose at step 5")
        gen = torch.Generator().manual_seed(1000 * step + kv.rank)
        x = torch.randn(16, 8, generator=gen)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        model.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step(16 * kv.num_workers)
        if step % 2 == 1:
            kv.save_checkpoint(snapshot)
    return first, [p.detach().numpy().tolist() for p in model.parameters()]


def never_called(records) -> None:
    raise AssertionError("no job may start")


# -- tests ---------------------------------------------------------------------------------------------

def test_sum_check_two_workers_two_servers(spark):
    tag = f"kvtest-{uuid.uuid4().hex}"
    results = kvspark.run(spark, sum_check, 2, 2, args=("dist_sync",),
                          env={"KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_TEST_TAG": tag, **QUIET})
    poll_for(lambda: not tagged_pids(tag), 20, "the scheduler and servers to exit")
    assert [r["rank"] for r in results] == [0, 1]  # rank order
    for rank, result in enumerate(results):
        assert {k: v for k, v in result.items() if k != "pid"} == {
            "rank": rank, "workers": 2, "servers": 2, "ok": [True, True], "big_on": [0, 1], "role": "worker",
            "worker_id": str(rank)}
    assert spark.sparkContext.getLocalProperty("spark.jobGroup.id") is None  # run()'s job group is gone
    # Spark reuses its Python workers: what run() set in the workers' os.environ is gone again
    seen = spark.sparkContext.parallelize(range(2 * SLOTS), SLOTS).map(environment).collect()
    assert [env for _, env in seen] == [{}] * (2 * SLOTS)
    assert {r["pid"] for r in results} & {pid for pid, _ in seen}, "no worker process was reused"


def test_runs_again_in_reused_python_workers(spark):
    """Another cluster, of another mode, in the Python workers Spark reuses: run() forgot the last
    run's closed store (create() would refuse a second store or a second mode in one process)."""
    assert kvspark.run(spark, join_only, 2, 1, args=("dist_async",), env=QUIET) == [0, 1]


def test_worker_gpus_gives_each_worker_its_share_and_torchrun_names(spark):
    """worker_gpus=1 on an executor host said to have 2 GPUs (KVSTORE_HOST_GPUS, Spark schedules no
    GPUs here): worker i gets GPU i and LOCAL_RANK i; with too few GPUs the job fails saying so."""
    env = {**QUIET, "KVSTORE_HOST_GPUS": "2"}
    results = kvspark.run(spark, gpu_names, 2, 1, env=env, worker_gpus=1)
    assert results == [{"CUDA_VISIBLE_DEVICES": str(r), "RANK": str(r), "WORLD_SIZE": "2",
                        "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": None} for r in range(2)]
    too_few = r"worker_gpus=2: 2 worker\(s\) on one host need 4 GPU\(s\), and it has 2"
    with pytest.raises(SparkJobFailed, match=too_few):
        kvspark.run(spark, never_called, 2, 1, env=env, worker_gpus=2)
    with pytest.raises(kvstore.errors.ConfigError, match="CUDA_VISIBLE_DEVICES"):
        kvspark.run(spark, never_called, 2, 1, env={"CUDA_VISIBLE_DEVICES": "0"}, worker_gpus=1)


def test_dataframe_rows_reach_each_worker_once(spark):
    total = 203
    df = spark.range(0, total, numPartitions=3)
    shares = kvspark.run(spark, seen_ids, 3, 1, data=df, env=QUIET)
    assert len(shares) == 3
    everything = sorted(i for share in shares for i in share)
    assert everything == list(range(total))  # all N, each exactly once: shares are disjoint
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 3, sizes  # round robin: within the number of source partitions


def test_linear_model_trains_on_its_shares(spark):
    rng = np.random.default_rng(7)
    total, dim = 240, 5
    true_w = rng.normal(size=dim)
    x = rng.normal(size=(total, dim))
    y = x @ true_w + 0.01 * rng.normal(size=total)
    df = spark.createDataFrame([(i, x[i].tolist(), float(y[i])) for i in range(total)],
                               "id long, x array<double>, y double").repartition(4)
    results = kvspark.run(spark, fit_linear, 2, 1, data=df, args=(40, 0.2, total), env=QUIET)
    assert [r["rank"] for r in results] == [0, 1]
    assert sorted(results[0]["ids"] + results[1]["ids"]) == list(range(total))
    assert results[0]["w"] == results[1]["w"]  # both pulled the servers' weights
    loss = np.sum([r["losses"] for r in results], axis=0) / total  # the global mean squared error
    assert loss[-1] < 1e-3 * loss[0], loss
    np.testing.assert_allclose(results[0]["w"], true_w, atol=0.02)


def test_failing_worker_fails_run_and_leaves_no_role(spark):
    tag = f"kvtest-{uuid.uuid4().hex}"
    started = time.monotonic()
    with pytest.raises(SparkJobFailed) as info:
        kvspark.run(spark, fail_rank_1, 2, 1, args=(tag,), env={"KVSTORE_TEST_TAG": tag, **QUIET})
    assert time.monotonic() - started < FAILURE_SECONDS
    error = info.value
    assert isinstance(error, kvstore.KVStoreError) and error.__cause__ is not None
    # worker 1's own failure, or (if its heartbeat told worker 0 first) worker 0's NodeLostError naming it
    assert "train_fn raised RuntimeError: worker fails on purpose" in str(error)
    assert "tagged roles alive: 2" in error.detail  # the scheduler and the server carried the tag
    poll_for(lambda: not tagged_pids(tag), 20, "the scheduler and server to exit")


def test_failing_server_fails_run_with_its_output(spark):
    tag = f"kvtest-{uuid.uuid4().hex}"
    with socket.socket() as held:  # the server is told to bind this port, which is taken
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(SparkJobFailed) as info:
            kvspark.run(spark, join_only, 2, 1,
                        env={"KVSTORE_NODE_PORT": str(port), "KVSTORE_TEST_TAG": tag, **QUIET})
        elapsed = time.monotonic() - started
    assert elapsed < FAILURE_SECONDS  # not the workers' KVSTORE_CONNECT_TIMEOUT (60 s)
    message = str(info.value)
    assert "server 0 exited with code 1 while the workers were running" in message
    assert "Address already in use" in message  # its last output lines
    poll_for(lambda: not tagged_pids(tag), 20, "the scheduler to exit")


def test_a_failed_stage_is_retried_from_the_latest_snapshot(spark, tmp_path):
    """max_restarts=1: worker 1 raises at step 5, the barrier stage runs again on a fresh cluster that
    resumes from the snapshot of step 3 (the resume's exactness: test_snapshot.py) and finishes."""
    env = {**QUIET, "KVSTORE_BIGARRAY_BOUND": "100"}
    retried = kvspark.run(spark, resumable_train, 2, 1, args=(str(tmp_path / "b"), 8, True), env=env,
                          max_restarts=1, snapshot=str(tmp_path / "b"))
    assert [first for first, _ in retried] == [4, 4]  # the snapshot after step 3
    for mine, other in zip(retried[0][1], retried[1][1]):  # every worker ends with the same weights
        np.testing.assert_array_equal(np.array(mine), np.array(other))


def test_a_bad_max_restarts_is_refused(spark):
    """max_restarts must be an int >= 0 (ConfigError before any job); 0, the default, raises the first
    failure (test_failing_worker_fails_run_and_leaves_no_role)."""
    with pytest.raises(kvstore.ConfigError):
        kvspark.run(spark, never_called, 1, 1, max_restarts=-1)


def test_too_few_slots_is_refused_before_any_job(spark):
    started = time.monotonic()
    with pytest.raises(NotEnoughSlotsError) as info:
        kvspark.run(spark, never_called, 3, 3)
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert "needs 7 concurrent task slots (1 scheduler + 3 servers + 3 workers)" in message
    assert f"has {SLOTS}" in message and "local[7]" in message
    assert isinstance(info.value, kvstore.ConfigError)


def scalar_steps(records) -> int:
    """100 dist_sync steps (about 3 s), each logging the user's loss, and a Trainer's 6 steps of a small
    MLP (with KVSTORE_HISTOGRAM_EVERY: its histograms) (tensorboard=)."""
    import torch

    kv = kvstore.create("dist_sync")
    kv.init("w", np.zeros(4, np.float32))
    for step in range(100):
        time.sleep(0.02)  # the step's work
        kvstore.log_scalar("loss", 1.0 / (step + 1), step)
        kv.push("w", np.ones(4, np.float32))
        kv.pull("w")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    trainer = kvstore.Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    for _ in range(6):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        trainer.step(len(x))
    kv.barrier()
    kv.close()
    return kv.rank


def _logdir_processes(logdir: str) -> list[int]:
    """Pids of processes whose command line names ``logdir`` (a TensorBoard over it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as src:
                    if logdir.encode() in src.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.timeout(120)
def test_tensorboard_scalars_are_written_on_the_driver(spark, tmp_path, capfd):
    """tensorboard=DIR: the driver learns the scheduler's address from its task, writes every role's
    counters, the workers' loss and (KVSTORE_HISTOGRAM_EVERY=2) their Trainer's weight and gradient
    histograms under DIR, and stops TensorBoard when run() returns."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    logdir = str(tmp_path / "tb")
    env = {**QUIET, "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HISTOGRAM_EVERY": "2"}
    assert kvspark.run(spark, scalar_steps, 2, 1, env=env, tensorboard=logdir) == [0, 1]
    job = next((tmp_path / "tb").glob("job-*"))
    tags = {}
    for run in job.iterdir():
        tags[run.name] = {value.tag for path in run.glob("events*")
                          for event in EventFileLoader(str(path)).Load() for value in event.summary.value}
    assert {"scheduler", "server-0", "worker-0", "worker-1"} <= set(tags), tags
    assert {"loss", "ops/push"} <= tags["worker-0"] and "rounds_applied" in tags["server-0"]
    names = ("0.weight", "0.bias", "2.weight", "2.bias")
    for rank in (0, 1):
        events = EventAccumulator(str(job / f"worker-{rank}"), purge_orphaned_data=False)
        events.Reload()
        assert set(events.Tags()["histograms"]) == {f"{kind}/{name}" for kind in ("weights", "grads")
                                                    for name in names}, rank
    assert "TensorBoard at http://" in capfd.readouterr().err
    poll_for(lambda: not _logdir_processes(logdir), 20, "TensorBoard to be gone")


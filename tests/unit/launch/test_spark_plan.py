"""The pure parts of kvstore.spark: which partition runs which role, how records are routed, the slot
check, the environment of each role, and reading a task's error back out of Spark's text."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

pytest.importorskip("pyspark", reason="kvstore.spark needs pyspark (pip install -e .[spark])")

from kvstore import config as kvconfig  # noqa: E402
from kvstore.errors import (  # noqa: E402
    ConfigError,
    KVStoreError,
    NotEnoughSlotsError,
    SparkJobFailed,
    TaskFailed,
)
from kvstore.launch import envrules as roles  # noqa: E402
from kvstore.launch.spark_plan import (  # noqa: E402
    Layout,
    check_env,
    check_slots,
    role_env,
    route,
    target_partition,
    task_failure_detail,
)


def test_layout_roles_by_partition():
    layout = Layout(num_servers=2, num_workers=3)
    assert layout.num_tasks == 6
    assert [layout.role_of(p) for p in range(6)] == [
        ("scheduler", None), ("server", 0), ("server", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    assert [layout.worker_partition(r) for r in range(3)] == [3, 4, 5]
    for bad in (-1, 6):
        with pytest.raises(ValueError, match="not in"):
            layout.role_of(bad)
    with pytest.raises(ValueError):
        layout.worker_partition(3)


@pytest.mark.parametrize("servers, workers", [(0, 1), (1, 0), (1, True), (1.0, 2), ("2", 2)])
def test_layout_refuses_bad_counts(servers, workers):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        Layout(servers, workers)


@pytest.mark.parametrize("sizes", [[10], [7, 7, 7], [1, 0, 5, 3], [0, 0], [100, 1, 1, 1, 1]])
@pytest.mark.parametrize("servers, workers", [(1, 1), (2, 3), (3, 4)])
def test_route_gives_every_record_to_one_worker_evenly(sizes, servers, workers):
    layout = Layout(servers, workers)
    records = {}
    for partition, size in enumerate(sizes):
        for target, record in route(partition, [(partition, j) for j in range(size)], layout):
            assert layout.role_of(target_partition(target))[0] == "worker"
            assert record not in records
            records[record] = target
    assert len(records) == sum(sizes)  # every record, exactly once
    counts = Counter(records.values())
    shares = [counts.get(layout.worker_partition(r), 0) for r in range(workers)]
    assert max(shares) - min(shares) <= len(sizes)  # within the number of source partitions
    if len(sizes) == 1:
        assert max(shares) - min(shares) <= 1  # one source partition: plain round robin


def test_route_is_round_robin_offset_by_partition():
    layout = Layout(1, 3)  # workers on partitions 2, 3, 4
    assert [t for t, _ in route(0, "abcd", layout)] == [2, 3, 4, 2]
    assert [t for t, _ in route(1, "abcd", layout)] == [3, 4, 2, 3]
    assert list(route(5, iter(()), layout)) == []


def test_check_slots():
    check_slots(5, 2, 2)
    check_slots(64, 2, 2)
    with pytest.raises(NotEnoughSlotsError) as info:
        check_slots(4, 2, 2)
    message = str(info.value)
    assert "needs 5 concurrent task slots (1 scheduler + 2 servers + 2 workers)" in message
    assert "this Spark context has 4" in message and "local[5]" in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, KVStoreError)
    with pytest.raises(NotEnoughSlotsError, match=r"\(1 scheduler \+ 1 server \+ 1 worker\)"):
        check_slots(2, 1, 1)


def test_check_env():
    assert check_env(None) == {}
    assert check_env({"KVSTORE_BIGARRAY_BOUND": "1000", "MY_VAR": "x"}) == {
        "KVSTORE_BIGARRAY_BOUND": "1000", "MY_VAR": "x"}
    for name in sorted(roles.SET_BY_LAUNCHER):
        with pytest.raises(ConfigError, match=name):
            check_env({name: "1"})
    with pytest.raises(ConfigError, match="KVSTORE_BIGARRAY_BOUND"):
        check_env({"KVSTORE_BIGARRAY_BOUND": "many"})  # refused on the driver, before any job
    with pytest.raises(TypeError, match="str to str"):
        check_env({"KVSTORE_CONNECT_TIMEOUT": 30})


def test_role_env_per_role():
    layout = Layout(2, 3)
    common = dict(root_host="10.0.0.5", root_port=9000, secret="s" * 64)
    extra = {"KVSTORE_BIGARRAY_BOUND": "1000", "PYTHONUNBUFFERED": "0", "KVSTORE_SECRET": "from-env"}
    scheduler = role_env("scheduler", None, layout, node_host="10.0.0.5", extra=extra, **common)
    assert scheduler == {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "10.0.0.5",
                         "DMLC_PS_ROOT_PORT": "9000", "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3",
                         "KVSTORE_SECRET": "s" * 64,
                         "DMLC_NODE_HOST": "10.0.0.5", "KVSTORE_BIGARRAY_BOUND": "1000",
                         "PYTHONUNBUFFERED": "0"}  # extra may change PYTHONUNBUFFERED, not the secret
    server = role_env("server", 1, layout, node_host="10.0.0.6", **common)
    assert server["KVSTORE_SERVER_ID"] == "1" and "DMLC_WORKER_ID" not in server
    assert server["DMLC_NODE_HOST"] == "10.0.0.6" and server["PYTHONUNBUFFERED"] == "1"
    worker = role_env("worker", 2, layout, node_host="10.0.0.7", **common)
    assert worker["DMLC_WORKER_ID"] == "2" and "KVSTORE_SERVER_ID" not in worker
    cfg = kvconfig.load(worker)  # what the worker's kvstore.create reads
    assert (cfg.role, cfg.worker_id, cfg.num_workers, cfg.num_servers) == ("worker", 2, 3, 2)
    assert cfg.root_address == "tcp://10.0.0.5:9000" and cfg.node_host == "10.0.0.7"


SPARK_ERROR = """An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.
: org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover from a failed barrier \
ResultStage. Most recent failure reason: Stage failed because barrier task ResultTask(4, 3) finished \
unsuccessfully.
org.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] An exception was thrown from the Python \
worker: Traceback (most recent call last):
  File "/x/pyspark/worker.py", line 4327, in invoke_udf
    run_process()
RuntimeError: boom

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/kvstore/spark.py", line 380, in _worker_task
    raise TaskFailed(f"worker {rank}: train_fn raised {type(exc).__name__}: {exc}") from exc
kvstore.spark.TaskFailed: {message}
 SQLSTATE: 38000
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(PythonRunner.scala:10)
\tat org.apache.spark.api.python.PythonRunner$$anon$5.read(PythonRunner.scala:1642)
"""


def test_task_failure_detail_finds_the_tasks_message():
    one_line = str(TaskFailed("worker 1: train_fn raised RuntimeError: boom"))
    assert task_failure_detail(SPARK_ERROR.replace("{message}", one_line)) == (
        "worker 1: train_fn raised RuntimeError: boom")
    lines = str(TaskFailed("server 0 exited with code 1; its last output lines:\nERROR cannot bind\nbye"))
    assert task_failure_detail(SPARK_ERROR.replace("{message}", lines)) == (
        "server 0 exited with code 1; its last output lines:\nERROR cannot bind\nbye")


def test_task_failure_detail_falls_back_to_the_python_error():
    plain = SPARK_ERROR.split("\nThe above exception")[0] + "\n SQLSTATE: 38000\n\tat org.x.Y.z(Y.scala:1)\n"
    assert task_failure_detail(plain) == "RuntimeError: boom"
    assert task_failure_detail("org.apache.spark.SparkException: Job 3 cancelled") is None


def test_spark_job_failed_is_a_kvstore_error():
    error = SparkJobFailed("the kvstore Spark job failed: x", "x")
    assert isinstance(error, KVStoreError) and error.detail == "x"


def test_import_kvstore_does_not_import_pyspark():
    code = "import sys, kvstore; print('pyspark' in sys.modules, 'kvstore.spark' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]

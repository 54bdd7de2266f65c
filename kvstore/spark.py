"""``kvstore.spark.run``: train with a kvstore cluster inside one Spark job (as TensorFlowOnSpark does).

One Spark job in barrier mode runs ``1 + S + W`` tasks at once, one per role:
partition 0 runs the scheduler, partitions ``1..S`` the servers and partitions
``S+1..S+W`` the workers.  The scheduler task starts ``python -m kvstore.scheduler`` under
a tether (:mod:`kvstore.launch.tether`: the role dies with the task's Python process)
on a free port of its executor's address, and every task learns that
``host:port`` through ``BarrierTaskContext.allGather``.  Server tasks run
``python -m kvstore.server`` the same way; worker tasks call
``train_fn(records, *args)`` in the task's own Python process with the ``DMLC_*``
variables of their rank in the process environment, so ``kvstore.create('dist_sync')``
inside ``train_fn`` joins the cluster.  A second ``allGather`` after the workers
are done tells the scheduler and server tasks to wait for their roles to exit.

Records of ``data`` reach the workers through one shuffle: record ``j`` of source
partition ``i`` goes to worker ``(i + j) % W`` (see :func:`kvstore.launch.spark_plan.route`).

The parts: :mod:`kvstore.launch.spark_plan` (the layout, routing and environments, no Spark) and
:mod:`kvstore.launch.spark_tasks` (what the tasks do on the executors); here the driver's side.

Importing this module imports pyspark (the ``[spark]`` extra); ``import kvstore``
does not.  docs/spark.md has the whole story.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import secrets
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from pyspark import RDD, SparkContext
from pyspark.sql.types import StructType

from kvstore import config as kvconfig
from kvstore.core import snapshot as kvsnapshot
from kvstore.core import storage
from kvstore.errors import ConfigError, FeedError, NotEnoughSlotsError, SparkJobFailed
from kvstore.launch import spark_feed, spark_predict
from kvstore.launch import tensorboard as kvtensorboard
from kvstore.launch.gpus import GPU_NAMES
from kvstore.launch.spark_plan import (
    Layout,
    check_env,
    check_slots,
    route,
    target_partition,
    task_failure_detail,
)
from kvstore.launch.spark_tasks import JobSpec, run_task
from kvstore.net import transport

log = logging.getLogger("kvstore.launcher")


def _spark_context(sc_or_spark: Any) -> SparkContext:
    """The SparkContext of ``sc_or_spark`` (itself, or a classic SparkSession's).  Raises TypeError."""
    if isinstance(sc_or_spark, SparkContext):
        return sc_or_spark
    sc = getattr(sc_or_spark, "sparkContext", None)
    if isinstance(sc, SparkContext):
        return sc
    raise TypeError(f"kvstore.spark.run needs a SparkContext or a classic SparkSession, not "
                    f"{type(sc_or_spark).__name__} (Spark Connect sessions cannot run barrier RDD jobs)")


def _jvm_context(sc: SparkContext) -> Any:
    """The JVM SparkContext behind ``sc`` (through pyspark's py4j handle), or None where there is none.

    pyspark has no public count of the tasks a barrier stage can run at once: Spark's own
    (``maxNumConcurrentTasks``) is reachable only through its private ``SparkContext._jsc``.  This is
    the one place kvstore touches it, read with a default since a pyspark may lack it.
    """
    jsc = getattr(sc, "_jsc", None)
    return None if jsc is None else jsc.sc()


def available_slots(sc: SparkContext) -> int:
    """How many tasks ``sc`` can run at once now (Spark's own count for barrier stages, which
    accounts for spark.task.cpus; ``defaultParallelism`` where that cannot be read)."""
    try:
        jvm = _jvm_context(sc)
        if jvm is not None:
            return int(jvm.maxNumConcurrentTasks(jvm.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - a private JVM method: any failure means "use the public count"
        pass
    return sc.defaultParallelism


def _wait_for_slots(sc: SparkContext, layout: Layout, timeout: float, feed_tasks: int = 0) -> None:
    """Check the slots (the barrier stage's, and ``feed_tasks`` more for the feed); off local masters,
    wait up to ``timeout`` for executors to register."""
    local = sc.master == "local" or sc.master.startswith("local[")  # not local-cluster: executors come later
    deadline = time.monotonic() + (0.0 if local else timeout)
    while True:
        available = available_slots(sc)
        if available >= layout.num_tasks + feed_tasks or time.monotonic() >= deadline:
            check_slots(available, layout.num_servers, layout.num_workers, feed_tasks)
            return
        time.sleep(0.5)  # polling interval: executors register on their own time


def _input_rdd(sc: SparkContext, data: Any, layout: Layout) -> tuple[RDD, bool]:
    """The RDD the barrier stage maps: ``data`` routed to the workers, or one empty slot per task."""
    n = layout.num_tasks
    if data is None:
        return sc.parallelize(range(n), n), False
    rdd = data if isinstance(data, RDD) else getattr(data, "rdd", None)
    if not isinstance(rdd, RDD):
        raise TypeError(f"data must be an RDD or a DataFrame, not {type(data).__name__}")
    keyed = rdd.mapPartitionsWithIndex(functools.partial(route, layout=layout), preservesPartitioning=False)
    return keyed.partitionBy(n, target_partition), True


CHUNK_ROWS = 1024  # rows a feed task sends at once (at least batch_size)


@dataclasses.dataclass(frozen=True)
class _FeedPlan:
    """``epochs=``: what the driver's feed streams, checked before the first job."""

    frame: Any  # the DataFrame
    epochs: int
    batch_size: int
    seed: int
    timeout: float
    columns: tuple[spark_feed.Column, ...]
    partitions: int


def _feed_plan(data: Any, epochs: Any, batch_size: Any, seed: Any, timeout: Any) -> _FeedPlan:
    """The feed of ``data`` for ``epochs``.  Raises TypeError when ``data`` is not a DataFrame,
    ConfigError for a bad count or timeout or a column the feed cannot carry."""
    rdd = None if isinstance(data, RDD) else getattr(data, "rdd", None)
    if not isinstance(rdd, RDD) or not hasattr(data, "schema"):
        raise TypeError(f"epochs= streams a DataFrame; data is {type(data).__name__} (use "
                        "spark.createDataFrame(rdd) first, or epochs=None for an RDD's one pass)")
    for name, value in (("epochs", epochs), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be an int >= 1")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed={seed!r} must be an int")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"feed_timeout={timeout!r} must be a number of seconds > 0")
    return _FeedPlan(data, epochs, batch_size, seed, float(timeout), spark_feed.columns_of(data.schema),
                     max(1, data.rdd.getNumPartitions()))


def _shuffled(frame: Any, seed: int, partitions: int) -> Any:
    """``frame``'s rows in a random order of ``seed``: each row a random key, hash-partitioned on it
    into ``partitions`` partitions and sorted by it inside each (Spark's shuffle and external sort:
    nothing is held whole in one process)."""
    from pyspark.sql import functions

    key = "__kvstore_feed_order"
    keyed = frame.withColumn(key, functions.rand(seed))
    return keyed.repartition(partitions, key).sortWithinPartitions(key).drop(key)


class _EpochFeed:
    """The driver's side of one barrier attempt's feed: the hub (:class:`spark_feed.FeedHub`), and a
    thread that runs one Spark job per epoch in a job group of its own: the DataFrame shuffled with
    ``seed + epoch``, each partition streamed to the hub by a feed task."""

    def __init__(self, sc: SparkContext, plan: _FeedPlan, secret: str, num_workers: int) -> None:
        self.sc, self.plan, self.secret = sc, plan, secret
        self.hub = spark_feed.FeedHub(secret, num_workers, plan.epochs, plan.batch_size, plan.timeout)
        host = sc.getConf().get("spark.driver.host") or "127.0.0.1"
        self.spec = spark_feed.FeedSpec(host, self.hub.port, plan.epochs, plan.batch_size, plan.timeout,
                                        plan.columns, max(plan.batch_size, CHUNK_ROWS))
        self.group = f"kvstore-spark-feed-{uuid.uuid4().hex}"
        self.dealt: list[int] = []  # rows dealt per epoch
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvstore-spark-epochs", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        epoch = 0
        try:
            self.sc.setJobGroup(self.group, "kvstore.spark.run: the feed", interruptOnCancel=True)
            for epoch in range(self.plan.epochs):
                self.hub.begin_epoch(epoch)
                frame = _shuffled(self.plan.frame, self.plan.seed + epoch, self.plan.partitions)
                task = functools.partial(spark_feed.feed_partition, self.spec, self.secret, epoch)
                frame.rdd.mapPartitionsWithIndex(task).collect()  # each task returns once its rows are dealt
                if self._stopped.is_set():
                    return
                self.dealt.append(self.hub.end_epoch(epoch))
        except Exception as exc:  # noqa: BLE001 - every failure goes to the workers, as their FeedError
            if not self._stopped.is_set():
                text = str(exc)
                first = (text.strip().splitlines() or [type(exc).__name__])[0][:500]
                detail = task_failure_detail(text) or first
                log.warning("the feed of epoch %d failed: %s", epoch, detail)
                self.hub.fail(f"the feed of epoch {epoch} failed: {detail}")

    def stop(self, timeout: float) -> None:
        """Cancel the feed's job, close the hub, and wait up to ``timeout`` for the thread."""
        self._stopped.set()
        self.sc.cancelJobGroup(self.group)
        self.hub.close()
        self._thread.join(timeout)


def _wait_tasks_ended(sc: SparkContext, group: str, timeout: float) -> bool:
    """After a failure: wait until every task of the job group has ended (Spark kills the other
    barrier tasks, and with their Python workers the roles they tethered).  Returns whether they did."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + timeout
    while True:
        active = 0
        for job_id in tracker.getJobIdsForGroup(group):
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                active += stage.numActiveTasks if stage is not None else 0
        if not active:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)  # polling interval of a deadline-bounded wait


_JOB_PROPERTIES = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")


def run(sc_or_spark: Any, train_fn: Callable[..., Any], num_workers: int, num_servers: int, *,
        data: Any = None, args: tuple = (), env: Mapping[str, str] | None = None,
        slot_timeout: float = 60.0, worker_gpus: int | None = None,
        tensorboard: bool | str = False, tensorboard_keep: bool = False, max_restarts: int = 0,
        snapshot: str | None = None, epochs: int | None = None, batch_size: int = 256, seed: int = 0,
        feed_timeout: float = 300.0) -> list:
    """Run ``train_fn`` on ``num_workers`` workers of a kvstore cluster inside one Spark barrier job.

    The job has ``1 + num_servers + num_workers`` tasks, all running at once: the scheduler, the
    servers (each a process tethered to its task) and the workers, which call
    ``train_fn(records, *args)`` in the task's Python process with ``DMLC_*`` set in the process environment
    for the call (restored after), so ``kvstore.create('dist_sync')`` there joins the cluster.
    ``records`` iterates over the worker's share of ``data`` (an RDD, or a DataFrame's rows): record
    ``j`` of source partition ``i`` goes to worker ``(i + j) % num_workers``, in no defined order; it is
    empty when ``data`` is None.  Every worker must join the cluster, or none.  The store is closed
    after ``train_fn`` returns if it did not close it.  ``env`` is added to every role's environment
    and the workers' environment (its ``KVSTORE_SECRET``, if any, replaces the fresh random secret
    of each run).  ``train_fn``, ``args`` and the secret travel in the job's pickled task closure.
    ``worker_gpus=N`` gives each worker N GPUs (``CUDA_VISIBLE_DEVICES``: of those Spark assigned its
    task when Spark schedules GPUs, else its share of its host's) and torchrun's ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; servers and the scheduler then get
    ``CUDA_VISIBLE_DEVICES=""`` (docs/spark.md).  ``tensorboard=DIR`` (True: a temporary folder) runs
    TensorBoard and the scalar writer on the driver until run() returns (or on, ``tensorboard_keep``).
    ``max_restarts=K``: a failed barrier stage is run again, at most K times, on a fresh cluster that
    resumes from the newest generation under ``snapshot`` (``KVSTORE_RESUME``; the workers write it
    with ``kv.save_checkpoint(snapshot)``), from the start while there is none (docs/failures.md).
    ``epochs=E`` (``data`` a DataFrame) streams instead: ``train_fn`` gets a
    :class:`~kvstore.launch.spark_feed.WorkerFeed`, E iterators of its batches (``batch_size`` rows,
    column name to array), the DataFrame reshuffled per epoch with ``seed + epoch`` and dealt round
    robin, every row once per epoch; served by one Spark job per epoch through the driver, which needs
    one task slot beyond the barrier stage's.  ``feed_timeout`` bounds every wait of the feed.

    Returns the workers' return values, by rank.  Raises :class:`NotEnoughSlotsError` before any job
    starts when Spark cannot run every task at once (off local masters after waiting ``slot_timeout``
    seconds for executors); ConfigError for a bad ``env``, a negative ``worker_gpus`` or ``tensorboard``
    without its extra, bad feed arguments or columns; TypeError for bad ``sc_or_spark`` or ``data``;
    :class:`SparkJobFailed` (the Spark error chained) when a worker raises (or has too few GPUs), a role
    exits non-zero or Spark aborts the job, after Spark has ended every task of the job (and with their
    Python workers the tethered roles, which stop within ``KVSTORE_SHUTDOWN_TIMEOUT``).
    """
    sc = _spark_context(sc_or_spark)
    layout = Layout(num_servers, num_workers)
    extra = check_env(env)
    _check_counts(max_restarts, worker_gpus, extra)
    plan = None if epochs is None else _feed_plan(data, epochs, batch_size, seed, feed_timeout)
    secret = extra.pop("KVSTORE_SECRET", None) or secrets.token_hex(32)
    shutdown_timeout = kvconfig.load(extra).shutdown_timeout
    _wait_for_slots(sc, layout, slot_timeout, 0 if plan is None else 1)
    rdd, keyed = _input_rdd(sc, data if plan is None else None, layout)
    board, inbox = _start_board(sc, tensorboard, tensorboard_keep, {**extra, "KVSTORE_SECRET": secret})
    report_to = (sc.getConf().get("spark.driver.host") or "127.0.0.1", inbox.port) if inbox else None
    job = JobSpec(layout, secret, extra, train_fn, tuple(args), keyed, worker_gpus, report_to)
    retries = (max_restarts, snapshot)
    pairs = _run_with_board(sc, rdd, job, shutdown_timeout, board, inbox, retries, plan)
    return [value for _, value in sorted(pairs, key=lambda pair: pair[0])]


def _check_counts(max_restarts: Any, worker_gpus: Any, extra: Mapping[str, str]) -> None:
    """Raise ConfigError for a ``max_restarts`` that is not an int >= 0, a ``worker_gpus`` that is not
    one (or None), or GPU variables in ``extra`` that ``worker_gpus`` sets."""
    if not (isinstance(max_restarts, int) and max_restarts >= 0):
        raise ConfigError(f"max_restarts={max_restarts!r} must be an int >= 0")
    if worker_gpus is not None and (not isinstance(worker_gpus, int) or worker_gpus < 0):
        raise ConfigError(f"worker_gpus={worker_gpus!r} must be an int >= 0 (or None)")
    clash = [name for name in GPU_NAMES if name in extra and worker_gpus is not None]
    if clash:
        raise ConfigError(f"worker_gpus sets {', '.join(clash)} for each worker; do not give it in env")


def _run_with_board(sc: SparkContext, rdd: RDD, job: JobSpec, shutdown_timeout: float,
                    board: kvtensorboard.JobBoard | None, inbox: kvtensorboard.AddressInbox | None,
                    retries: tuple[int, str | None] = (0, None), plan: _FeedPlan | None = None) -> list:
    """:func:`_run_retried`, then the end of ``tensorboard=``'s inbox and board (if any)."""
    try:
        return _run_retried(sc, rdd, job, shutdown_timeout, *retries, plan=plan)
    finally:
        if inbox is not None:
            inbox.close()
        if board is not None:
            board.finish()


def _start_board(sc: SparkContext, tensorboard: bool | str, keep: bool, env: dict[str, str]
                 ) -> tuple[kvtensorboard.JobBoard | None, kvtensorboard.AddressInbox | None]:
    """``tensorboard=``: TensorBoard started on the driver, and the inbox where the scheduler task
    reports its address (which starts the writer); (None, None) without it.  Raises ConfigError
    without the extra or for a bad TENSORBOARD_PORT, OSError when TensorBoard cannot start."""
    if not tensorboard:
        return None, None
    logdir = tempfile.mkdtemp(prefix="kvstore-tensorboard-") if tensorboard is True else str(tensorboard)
    board = kvtensorboard.JobBoard(logdir, keep, kvconfig.child_environ(env), bind_all=sc.master != "local"
                                   and not str(sc.master).startswith("local["))
    settings = kvconfig.load(kvconfig.child_environ(env))
    board.start()
    inbox = kvtensorboard.AddressInbox(
        lambda host, port: board.attach(settings, transport.address(host, port)))
    return board, inbox


def _run_retried(sc: SparkContext, rdd: RDD, job: JobSpec, shutdown_timeout: float, retries: int,
                 snapshot: str | None, plan: _FeedPlan | None = None) -> list:
    """:func:`_run_barrier_job`; after a SparkJobFailed, again (``retries`` times at most) with
    ``KVSTORE_RESUME`` set to ``snapshot`` once it holds a generation.  Raises the last failure.
    With a feed ``plan``, every attempt has a feed of its own, from its first epoch."""
    while True:
        try:
            return _run_barrier_job(sc, rdd, job, shutdown_timeout, plan)
        except SparkJobFailed as exc:
            if retries <= 0:
                raise
            retries -= 1
            found = snapshot is not None and storage.exists(storage.join(snapshot, kvsnapshot.POINTER))
            if found:
                job = dataclasses.replace(job, env={**job.env, "KVSTORE_RESUME": storage.absolute(snapshot)})
            log.warning("%s; running the barrier stage again %s (%d more retries)", exc,
                        f"from the snapshot in {snapshot}" if found else "from the start", retries)


def _run_barrier_job(sc: SparkContext, rdd: RDD, job: JobSpec, shutdown_timeout: float,
                     plan: _FeedPlan | None = None) -> list:
    """Run ``job``'s barrier stage over ``rdd`` in a Spark job group of its own; return its ``(rank,
    result)`` pairs.  On an interrupt the group is cancelled; on a failure too, and SparkJobFailed is
    raised once its tasks have ended (see :func:`_job_failure`).  The caller's job properties are kept.
    With a feed ``plan``, the feed's epochs run beside it and stop when it ends."""
    layout = job.layout
    group = f"kvstore-spark-{uuid.uuid4().hex}"
    saved = {name: sc.getLocalProperty(name) for name in _JOB_PROPERTIES}
    feed = None if plan is None else _EpochFeed(sc, plan, job.secret, layout.num_workers)
    if feed is not None:
        job = dataclasses.replace(job, feed=feed.spec)
    sc.setJobGroup(group, f"kvstore.spark.run: 1 scheduler, {layout.num_servers} servers, "
                   f"{layout.num_workers} workers", interruptOnCancel=True)
    try:
        return rdd.barrier().mapPartitions(functools.partial(run_task, job)).collect()
    except KeyboardInterrupt:
        sc.cancelJobGroup(group)
        raise
    except Exception as exc:
        sc.cancelJobGroup(group)  # a no-op after an abort: Spark is already killing the other tasks
        raise _job_failure(sc, group, exc, shutdown_timeout) from exc
    finally:
        if feed is not None:
            feed.stop(shutdown_timeout + 30.0)
        for name, value in saved.items():
            sc.setLocalProperty(name, value)


def _job_failure(sc: SparkContext, group: str, exc: Exception, shutdown_timeout: float) -> SparkJobFailed:
    """The SparkJobFailed of the job group ``group`` that failed with ``exc``, once its tasks have ended
    (waiting up to ``shutdown_timeout`` + 30 s: the tethered roles stop within the first)."""
    ended = _wait_tasks_ended(sc, group, shutdown_timeout + 30.0)
    text = str(exc)
    detail = task_failure_detail(text)
    summary = detail or (text.strip().splitlines() or [type(exc).__name__])[0][:500]
    message = f"the kvstore Spark job failed: {summary}"
    if not ended:
        message += " (some of its tasks were still running when run() gave up waiting for them)"
    return SparkJobFailed(message, detail)


def predict(model_fn: Callable[[dict], Callable[[Any], Any]], df: Any, *, checkpoint: str | None = None,
            weights: Mapping[Any, Any] | None = None, input_cols: str | list[str] = "features",
            output_col: str = "prediction", output_type: str = "double", batch_size: int = 1024) -> Any:
    """A DataFrame of ``df``'s rows, each with its prediction appended as ``output_col`` (Spark type
    ``output_type``, e.g. ``"double"``, ``"long"`` or ``"array<float>"``), in ``df``'s order, computed
    on the executors: each task calls ``model_fn(weights)`` once (``weights``: the state dict given,
    broadcast; or the newest generation of ``checkpoint``, a ``kv.save_checkpoint`` folder the driver
    and every executor can read, as ``{key: array}``: chosen here, once, so every task loads the same)
    and calls what it returns on batches of ``batch_size`` rows, a 2-D float32 array (float64 if the
    columns are) of the ``input_cols`` side by side; it must return one prediction per row along the
    first axis.  Lazy, like any DataFrame.  Raises ValueError unless
    exactly one of ``checkpoint`` and ``weights`` is given or for a bad ``batch_size``, KeyError for an
    input column ``df`` lacks, FileNotFoundError or FormatError when ``checkpoint`` holds no readable
    generation; a task's failure surfaces when the result is computed."""
    if (checkpoint is None) == (weights is None):
        raise ValueError("predict needs exactly one of checkpoint= (a kv.save_checkpoint folder) and "
                         "weights=")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    names = [input_cols] if isinstance(input_cols, str) else list(input_cols)
    missing = [name for name in names if name not in df.columns]
    if missing or not names:
        raise KeyError(f"predict's input columns {missing or names} are not columns of the DataFrame "
                       f"({', '.join(df.columns)})")
    spark = df.sparkSession
    shared = None if weights is None else spark.sparkContext.broadcast(dict(weights))
    generation = None if checkpoint is None else kvsnapshot.newest(storage.absolute(checkpoint))
    positions = tuple(df.columns.index(name) for name in names)
    spec = spark_predict.PredictSpec(model_fn, shared, generation, positions, batch_size)
    schema = StructType(list(df.schema.fields)).add(output_col, output_type)  # df.schema itself is cached
    task = functools.partial(spark_predict.predict_partition, spec)
    rows = df.rdd.mapPartitions(task, preservesPartitioning=True)
    return spark.createDataFrame(rows, schema, verifySchema=False)


__all__ = ["run", "predict", "available_slots", "SparkJobFailed", "NotEnoughSlotsError", "FeedError"]

"""``kvstore.spark.run``: train with a kvstore cluster inside one Spark job (as TensorFlowOnSpark does).

One Spark job in barrier mode runs ``1 + S + W`` tasks at once, one per role:
partition 0 runs the scheduler, partitions ``1..S`` the servers and partitions
``S+1..S+W`` the workers.  The scheduler task starts ``python -m scheduler`` under
a tether (:mod:`kvstore.launch.tether`: the role dies with the task's Python process)
on a free port of its executor's address, and every task learns that
``host:port`` through ``BarrierTaskContext.allGather``.  Server tasks run
``python -m kvstore.server`` the same way; worker tasks call
``train_fn(records, *args)`` in the task's own Python process with the ``DMLC_*``
variables of their rank in the process environment, so ``kvstore.create('dist_sync')``
inside ``train_fn`` joins the cluster.  A second ``allGather`` after the workers
are done tells the scheduler and server tasks to wait for their roles to exit.

Records of ``data`` reach the workers through one shuffle: record ``j`` of source
partition ``i`` goes to worker ``(i + j) % W`` (see :func:`route`).

Importing this module imports pyspark (the ``[spark]`` extra); ``import kvstore``
does not.  docs/spark.md has the whole story.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark import RDD, BarrierTaskContext, SparkContext

from kvstore import config as kvconfig
from kvstore.client import store as dist
from kvstore.errors import ConfigError, KVStoreError
from kvstore.launch import envrules as roles
from kvstore.launch import tether
from kvstore.net import address

SCHEDULER_PARTITION = 0
#: Variables run() sets per role; ``env`` may not set them.
TAIL_LINES = 20  # how much of a failed role's output its error shows
_FAILED_MARK = "kvstore-spark-task-failed"  # TaskFailed's class name, found again in Spark's error text


class SparkJobFailed(KVStoreError):
    """The barrier job of :func:`run` failed: a worker's ``train_fn`` raised, a scheduler or server
    exited with a non-zero code, or Spark aborted the job.

    ``detail`` is the failed task's own message where it could be found in Spark's error (else the
    first line of that error); the Spark exception is the ``__cause__``.
    """

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class NotEnoughSlotsError(ConfigError):
    """The Spark application cannot run all ``1 + S + W`` barrier tasks at once."""


class TaskFailed(RuntimeError):
    """Raised inside a task (on an executor); its message reaches the driver in Spark's error text."""

    def __init__(self, message: str) -> None:
        super().__init__(f"[{_FAILED_MARK}] {message}")


# -- the plan: pure functions, tested without Spark -------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """Which partition of the barrier stage runs which role: 0 the scheduler, ``1..S`` the servers,
    ``S+1..S+W`` the workers."""

    num_servers: int
    num_workers: int

    def __post_init__(self) -> None:
        for name in ("num_servers", "num_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, not {value!r}")

    @property
    def num_tasks(self) -> int:
        """The number of barrier tasks (and of partitions): ``1 + S + W``."""
        return 1 + self.num_servers + self.num_workers

    def role_of(self, partition: int) -> tuple[str, int | None]:
        """``(role, rank)`` of ``partition``: ``('scheduler', None)``, ``('server', i)`` or
        ``('worker', i)``.  Raises ValueError for a partition outside the stage."""
        if not 0 <= partition < self.num_tasks:
            raise ValueError(f"partition {partition} is not in [0, {self.num_tasks})")
        if partition == SCHEDULER_PARTITION:
            return "scheduler", None
        if partition <= self.num_servers:
            return "server", partition - 1
        return "worker", partition - 1 - self.num_servers

    def worker_partition(self, rank: int) -> int:
        """The partition that runs worker ``rank``."""
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"worker rank {rank} is not in [0, {self.num_workers})")
        return 1 + self.num_servers + rank


def route(partition: int, records: Iterable[Any], layout: Layout) -> Iterator[tuple[int, Any]]:
    """Key each record of source partition ``partition`` by the barrier partition of its worker.

    Record ``j`` of source partition ``i`` goes to worker ``(i + j) % W``: round robin inside each
    source partition, started at a different worker per partition, so every worker gets about
    ``N / W`` records (within the number of source partitions of each other) however the source
    is partitioned.
    """
    workers, first = layout.num_workers, layout.worker_partition(0)
    for j, record in enumerate(records):
        yield first + (partition + j) % workers, record


def target_partition(key: int) -> int:
    """The partition function of the routing shuffle: a key already is its partition."""
    return key


def check_slots(available: int, num_servers: int, num_workers: int) -> None:
    """Raise :class:`NotEnoughSlotsError` when ``available`` concurrent task slots cannot hold the
    ``1 + num_servers + num_workers`` barrier tasks (Spark would otherwise wait and fail obscurely)."""
    needed = Layout(num_servers, num_workers).num_tasks
    if available < needed:
        raise NotEnoughSlotsError(
            f"kvstore.spark.run needs {needed} concurrent task slots (1 scheduler + {num_servers} "
            f"server{'s' * (num_servers != 1)} + {num_workers} worker{'s' * (num_workers != 1)}), all "
            f"at once in one barrier stage; this Spark context has {available}: use local[{needed}] or "
            "more, or more executors or cores (spark.executor.instances, spark.executor.cores; "
            "spark.task.cpus takes that many cores per task)")


def check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """Return ``env`` as a dict of str; raise ConfigError for a variable run() sets per role, or a
    ``KVSTORE_*``/``DMLC_*`` value kvstore would refuse; TypeError for a non-str name or value."""
    extra = dict(env or {})
    for name, value in extra.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"env must map str to str, not {name!r}: {value!r}")
    reserved = sorted(set(extra) & roles.SET_BY_LAUNCHER)
    if reserved:
        raise ConfigError(f"env sets {', '.join(reserved)}, which kvstore.spark.run sets itself for "
                          "each role (the scheduler's address, ranks, counts, each task's own host)")
    kvconfig.load(extra)  # a bad KVSTORE_* value fails here, on the driver, before any job starts
    return extra


def role_env(role: str, rank: int | None, layout: Layout, *, root_host: str, root_port: int, secret: str,
             node_host: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a role runs with: ``extra`` (run()'s ``env``), then the cluster's ``DMLC_*``,
    ``KVSTORE_SECRET`` and the role's own rank and host (which ``extra`` cannot override)."""
    env = {"PYTHONUNBUFFERED": "1", **(extra or {})}
    env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": root_host, "DMLC_PS_ROOT_PORT": str(root_port),
                "DMLC_NUM_SERVER": str(layout.num_servers), "DMLC_NUM_WORKER": str(layout.num_workers),
                "KVSTORE_SECRET": secret, "DMLC_NODE_HOST": node_host})
    if role == "server":
        env["KVSTORE_SERVER_ID"] = str(rank)
    elif role == "worker":
        env["DMLC_WORKER_ID"] = str(rank)
    return env


def task_failure_detail(text: str) -> str | None:
    """The message a task raised with :class:`TaskFailed`, found in Spark's error ``text``; else the
    last line of the first Python traceback in it; else None."""
    found = re.search(re.escape(f"[{_FAILED_MARK}] ") + r"(.*?)(?:\n SQLSTATE|\n\s*at [\w$.]+\(|\Z)", text,
                      re.DOTALL)
    if found:
        return found.group(1).rstrip()
    traceback = re.search(r"Traceback \(most recent call last\):\n(.*?)(?:\n SQLSTATE|\n\s*at [\w$.]+\(|\Z)",
                          text, re.DOTALL)
    if traceback:
        lines = [line for line in traceback.group(1).splitlines() if line.strip()]
        return lines[-1].strip() if lines else None
    return None


# -- on the executors ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Job:
    """Everything a task needs; Spark pickles it (the secret too) into the job's task closure."""

    layout: Layout
    secret: str
    env: dict[str, str]
    train_fn: Callable[..., Any]
    args: tuple
    keyed: bool  # records arrive as (partition, record) pairs from the routing shuffle


class _Role:
    """One scheduler or server process under a tether, its output copied to the task's stderr."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc = tether.spawn(argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._pump = threading.Thread(target=self._copy_output, daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.tail.append(line)
            print(f"[kvstore {self.name}] {line}", file=sys.stderr, flush=True)

    def failure(self, what: str) -> TaskFailed:
        """The error of a role that ``what`` (e.g. 'exited with code 1'), with its last output."""
        self._pump.join(2.0)  # the rest of its output, if the pipe closes
        lines = "\n".join(self.tail) or "(no output)"
        return TaskFailed(f"{self.name} {what}; its last output lines:\n{lines}")

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` from a thread of its own once the role has exited."""
        threading.Thread(target=lambda: (self.proc.wait(), callback()), daemon=True).start()

    def wait_port(self, path: str, timeout: float) -> int:
        """The port the scheduler wrote to ``path``; raises TaskFailed if it exits or times out."""
        deadline = time.monotonic() + timeout
        while True:
            port = roles.read_port_file(path)
            if port is not None:
                return port
            code = self.exit_code()
            if code is not None:
                raise self.failure(f"exited with code {code} before reporting its port")
            if time.monotonic() > deadline:
                raise self.failure(f"did not report its port within {timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")
            try:
                self.proc.wait(0.02)  # returns early when it exits
            except subprocess.TimeoutExpired:
                pass

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for the role to exit; its exit code, or None if it still runs."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float) -> None:
        """Close the tether's pipe (it stops the role: SIGTERM, then SIGKILL after ``grace``) and reap."""
        tether.release(self.proc)
        try:
            self.proc.wait(grace + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._pump.join(2.0)


def _task_host(ctx: BarrierTaskContext, partition: int, env: Mapping[str, str]) -> str:
    """The address this task's roles bind and advertise: that of ``DMLC_INTERFACE`` when the executor's
    environment or run()'s ``env`` names one, else the executor's host as Spark knows it."""
    interface = kvconfig.child_environ(env).get("DMLC_INTERFACE")
    if interface:
        return address.node_host(kvconfig.Config(interface=interface))
    return address.resolve_ip(ctx.getTaskInfos()[partition].address)


def _await_workers(ctx: BarrierTaskContext, proc: _Role) -> list[dict]:
    """The workers' reports from the second allGather (sent once all of them are done), while
    watching the role: a role that fails before then fails this task at once, with its output."""
    wake = threading.Event()
    gathered: dict[str, Any] = {}

    def gather() -> None:
        try:
            gathered["messages"] = ctx.allGather("")
        except BaseException as exc:  # noqa: BLE001 - handed to the task's thread
            gathered["error"] = exc
        wake.set()

    threading.Thread(target=gather, name="kvstore-spark-gather", daemon=True).start()
    proc.on_exit(wake.set)
    while True:
        wake.wait()
        if "messages" in gathered:
            return [json.loads(m) for m in gathered["messages"] if m]
        if "error" in gathered:
            raise gathered["error"]
        code = proc.exit_code()
        if code is not None and code != 0:
            raise proc.failure(f"exited with code {code} while the workers were running")
        wake.clear()  # it exited 0 (the scheduler may, once every worker left): wait for the reports
        if "messages" in gathered or "error" in gathered:
            wake.set()


def _role_task(job: _Job, ctx: BarrierTaskContext, role: str, rank: int | None, host: str) -> list:
    """Run the scheduler (and share its address) or a server, until the workers are done."""
    settings = kvconfig.load(kvconfig.child_environ({**job.env, "KVSTORE_SECRET": job.secret}))
    name = role if rank is None else f"{role} {rank}"
    proc: _Role | None = None
    try:
        if role == "scheduler":
            with tempfile.TemporaryDirectory(prefix="kvstore-spark-") as workdir:
                port_file = os.path.join(workdir, "scheduler.port")
                env = role_env(role, None, job.layout, root_host=host, root_port=0, secret=job.secret,
                               node_host=host, extra=job.env)
                env["KVSTORE_PORT_FILE"] = port_file
                proc = _Role(name, [sys.executable, "-m", "kvstore.scheduler"], env)
                try:
                    port = proc.wait_port(port_file, settings.connect_timeout)
                except TaskFailed:
                    ctx.allGather("")  # the others learn there is no scheduler and return
                    raise
            ctx.allGather(json.dumps({"host": host, "port": port}))
        else:
            root = ctx.allGather("")[SCHEDULER_PARTITION]
            if not root:
                return []  # the scheduler task failed; its error is the job's
            address = json.loads(root)
            env = role_env(role, rank, job.layout, root_host=address["host"], root_port=address["port"],
                           secret=job.secret, node_host=host, extra=job.env)
            proc = _Role(name, [sys.executable, "-m", "kvstore.server"], env)
        reports = _await_workers(ctx, proc)
        if not any(report["joined"] for report in reports):
            return []  # no worker used the cluster: stopped below
        code = proc.wait(settings.shutdown_timeout)
        if code is None:
            print(f"[kvstore {name}] still running {settings.shutdown_timeout:g} s after every worker "
                  "left (KVSTORE_SHUTDOWN_TIMEOUT); stopping it", file=sys.stderr, flush=True)
        elif code != 0:
            raise proc.failure(f"exited with code {code}")
        return []
    finally:
        if proc is not None and proc.exit_code() is None:
            proc.stop(settings.shutdown_timeout)


def _worker_task(job: _Job, ctx: BarrierTaskContext, rank: int, host: str, records: Iterator) -> list:
    """Call train_fn with this rank's environment; leave the cluster whatever it did."""
    root = ctx.allGather("")[SCHEDULER_PARTITION]
    if not root:
        return []  # the scheduler task failed; its error is the job's
    address = json.loads(root)
    env = role_env("worker", rank, job.layout, root_host=address["host"], root_port=address["port"],
                   secret=job.secret, node_host=host, extra=job.env)
    data = (record for _, record in records) if job.keyed else iter(())
    try:
        dist.release_process_store("its cluster is gone")  # left by an earlier task of this Python worker
    except KVStoreError:
        pass
    with kvconfig.process_environ(env):
        try:
            result = job.train_fn(data, *job.args)
        except BaseException as exc:
            try:
                dist.release_process_store(f"train_fn raised {type(exc).__name__}: {exc}")
            except KVStoreError:
                pass  # the train_fn's error is the one to report
            raise TaskFailed(f"worker {rank}: train_fn raised {type(exc).__name__}: {exc}") from exc
        try:
            joined = dist.release_process_store()
        except KVStoreError as exc:
            raise TaskFailed(f"worker {rank}: leaving the cluster failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    ctx.allGather(json.dumps({"rank": rank, "joined": joined}))
    return [(rank, result)]


def _task(job: _Job, records: Iterator) -> list:
    """One barrier task: the role of this partition (see :class:`Layout`)."""
    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    role, rank = job.layout.role_of(partition)
    host = _task_host(ctx, partition, job.env)
    if role == "worker":
        return _worker_task(job, ctx, rank, host, records)
    return _role_task(job, ctx, role, rank, host)


# -- on the driver ---------------------------------------------------------------------------------

def _spark_context(sc_or_spark: Any) -> SparkContext:
    if isinstance(sc_or_spark, SparkContext):
        return sc_or_spark
    sc = getattr(sc_or_spark, "sparkContext", None)
    if isinstance(sc, SparkContext):
        return sc
    raise TypeError(f"kvstore.spark.run needs a SparkContext or a classic SparkSession, not "
                    f"{type(sc_or_spark).__name__} (Spark Connect sessions cannot run barrier RDD jobs)")


def available_slots(sc: SparkContext) -> int:
    """How many tasks ``sc`` can run at once now (Spark's own count for barrier stages, which
    accounts for spark.task.cpus; ``defaultParallelism`` where that cannot be read)."""
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # noqa: BLE001 - a private JVM method: any failure means "use the public count"
        return sc.defaultParallelism


def _wait_for_slots(sc: SparkContext, layout: Layout, timeout: float) -> None:
    """Check the slots; off local masters, wait up to ``timeout`` for executors to register."""
    local = sc.master == "local" or sc.master.startswith("local[")  # not local-cluster: executors come later
    deadline = time.monotonic() + (0.0 if local else timeout)
    while True:
        available = available_slots(sc)
        if available >= layout.num_tasks or time.monotonic() >= deadline:
            check_slots(available, layout.num_servers, layout.num_workers)
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
        slot_timeout: float = 60.0) -> list:
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

    Returns the workers' return values, by rank.  Raises :class:`NotEnoughSlotsError` before any job
    starts when Spark cannot run every task at once (off local masters after waiting ``slot_timeout``
    seconds for executors); ConfigError for a bad ``env``; TypeError for bad ``sc_or_spark`` or
    ``data``; :class:`SparkJobFailed` (the Spark error chained) when a worker raises, a role exits
    non-zero or Spark aborts the job, after Spark has ended every task of the job (and with their
    Python workers the tethered roles, which stop within ``KVSTORE_SHUTDOWN_TIMEOUT``).
    """
    sc = _spark_context(sc_or_spark)
    layout = Layout(num_servers, num_workers)
    extra = check_env(env)
    secret = extra.pop("KVSTORE_SECRET", None) or secrets.token_hex(32)
    shutdown_timeout = kvconfig.load(extra).shutdown_timeout
    _wait_for_slots(sc, layout, slot_timeout)
    rdd, keyed = _input_rdd(sc, data, layout)
    job = _Job(layout, secret, extra, train_fn, tuple(args), keyed)
    group = f"kvstore-spark-{uuid.uuid4().hex}"
    saved = {name: sc.getLocalProperty(name) for name in _JOB_PROPERTIES}
    sc.setJobGroup(group, f"kvstore.spark.run: 1 scheduler, {num_servers} servers, {num_workers} workers",
                   interruptOnCancel=True)
    try:
        pairs = rdd.barrier().mapPartitions(functools.partial(_task, job)).collect()
    except KeyboardInterrupt:
        sc.cancelJobGroup(group)
        raise
    except Exception as exc:
        sc.cancelJobGroup(group)  # a no-op after an abort: Spark is already killing the other tasks
        ended = _wait_tasks_ended(sc, group, shutdown_timeout + 30.0)
        text = str(exc)
        detail = task_failure_detail(text)
        summary = detail or (text.strip().splitlines() or [type(exc).__name__])[0][:500]
        message = f"the kvstore Spark job failed: {summary}"
        if not ended:
            message += " (some of its tasks were still running when run() gave up waiting for them)"
        raise SparkJobFailed(message, detail) from exc
    finally:
        for name, value in saved.items():
            sc.setLocalProperty(name, value)
    return [value for _, value in sorted(pairs, key=lambda pair: pair[0])]


__all__ = ["run", "SparkJobFailed", "NotEnoughSlotsError", "Layout", "route", "check_slots", "check_env",
           "role_env", "available_slots"]

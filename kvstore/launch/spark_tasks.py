"""What the barrier tasks of ``kvstore.spark.run`` do on the executors: each runs the role of its
partition (see :class:`kvstore.launch.spark_plan.Layout`).

The scheduler task starts ``python -m kvstore.scheduler`` under a tether (:mod:`kvstore.launch.tether`:
the role dies with the task's Python process) on a free port of its executor's address, and every
task learns that ``host:port`` through ``BarrierTaskContext.allGather``.  Server tasks run
``python -m kvstore.server`` the same way; worker tasks call ``train_fn(records, *args)`` in the
task's own Python process with the ``DMLC_*`` variables of their rank in the process environment.
A second ``allGather`` after the workers are done tells the scheduler and server tasks to wait for
their roles to exit.  A tethered role is a :class:`~kvstore.launch.roleprocess.RoleProcess` (its
output copied to the task's stderr, prefixed ``[kvstore server 0]``).  Importing this module imports
pyspark.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark import BarrierTaskContext

from kvstore import config as kvconfig
from kvstore.client.instance import release_process_store
from kvstore.errors import ConfigError, FeedError, KVStoreError, TaskFailed
from kvstore.launch import gpus, tether
from kvstore.launch.roleprocess import RoleProcess, RoleSpec
from kvstore.launch.spark_feed import FeedSpec, WorkerFeed
from kvstore.launch.spark_plan import SCHEDULER_PARTITION, Layout, role_env
from kvstore.launch.tensorboard import report_address
from kvstore.net import address

TAIL_LINES = 20  # how much of a failed role's output its error shows
STOP_MARGIN = 5.0  # seconds past the tether's own grace before a stop kills the tether


@dataclass(frozen=True)
class JobSpec:
    """Everything a task needs; Spark pickles it (the secret too) into the job's task closure."""

    layout: Layout
    secret: str
    env: dict[str, str]
    train_fn: Callable[..., Any]
    args: tuple
    keyed: bool  # records arrive as (partition, record) pairs from the routing shuffle
    worker_gpus: int | None = None  # GPUs per worker (kvstore.launch.gpus); None: no GPU variables
    report_to: tuple[str, int] | None = None  # tensorboard=: the driver's AddressInbox (host, port)
    feed: FeedSpec | None = None  # epochs=: the driver's feed; train_fn gets a WorkerFeed


class _Output:
    """Where a tethered role's output goes: the task's stderr, each line prefixed ``[kvstore NAME]``;
    its last :data:`TAIL_LINES` lines are kept for its error."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def __call__(self, raw: bytes) -> None:
        """Copy one line of the role's output."""
        line = raw.decode(errors="replace").rstrip("\n")
        self.tail.append(line)
        print(f"[kvstore {self.name}] {line}", file=sys.stderr, flush=True)


def _start_tethered(spec: RoleSpec) -> subprocess.Popen:
    """Start ``spec`` under a tether (the role dies with this task's Python process), its output in one
    pipe.  Raises OSError."""
    return tether.spawn(spec.argv, spec.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _start_role(role: str, rank: int | None, argv: list[str], env: dict[str, str],
                grace: float) -> RoleProcess:
    """Start ``argv`` as ``role`` under a tether whose grace is ``grace``; a stop gives it that plus
    :data:`STOP_MARGIN`.  Raises OSError."""
    spec = RoleSpec(role, rank, argv, env)
    return RoleProcess(spec, _start_tethered, output=_Output(spec.name), tethered=True,
                       stop_wait=grace + STOP_MARGIN).start()


def _failure(proc: RoleProcess, what: str) -> TaskFailed:
    """The error of a role that ``what`` (e.g. 'exited with code 1'), with its last output."""
    proc.join(2.0)  # the rest of its output, if the pipe closes
    lines = "\n".join(proc.output.tail) or "(no output)"
    return TaskFailed(f"{proc.name} {what}; its last output lines:\n{lines}")


def _wait_port(proc: RoleProcess, path: str, timeout: float) -> int:
    """The port the scheduler wrote to ``path``; raises TaskFailed if it exits or times out."""
    port = proc.read_port(path, timeout, interval=0.02)
    if port is not None:
        return port
    if proc.exit_code is not None:
        raise _failure(proc, f"exited with code {proc.exit_code} before reporting its port")
    raise _failure(proc, f"did not report its port within {timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")


def _task_host(ctx: BarrierTaskContext, partition: int, env: Mapping[str, str]) -> str:
    """The address this task's roles bind and advertise: that of ``DMLC_INTERFACE`` when the executor's
    environment or run()'s ``env`` names one, else the executor's host as Spark knows it."""
    interface = kvconfig.child_environ(env).get("DMLC_INTERFACE")
    if interface:
        return address.node_host(kvconfig.Config(interface=interface))
    return address.resolve_ip(ctx.getTaskInfos()[partition].address)


def _await_workers(ctx: BarrierTaskContext, proc: RoleProcess) -> list[dict]:
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
    proc.on_exit(lambda _: wake.set())
    while True:
        wake.wait()
        if "messages" in gathered:
            return [json.loads(m) for m in gathered["messages"] if m]
        if "error" in gathered:
            raise gathered["error"]
        code = proc.exit_code
        if code is not None and code != 0:
            raise _failure(proc, f"exited with code {code} while the workers were running")
        wake.clear()  # it exited 0 (the scheduler may, once every worker left): wait for the reports
        if "messages" in gathered or "error" in gathered:
            wake.set()


def _report_scheduler(job: JobSpec, host: str, port: int) -> None:
    """Tell the driver where the scheduler listens (for its TensorBoard writer), if it asked; a
    driver that cannot be reached is reported on stderr and the job goes on without scalars."""
    if job.report_to is None:
        return
    try:
        report_address(job.report_to, host, port)
    except OSError as exc:
        print(f"[kvstore scheduler] cannot tell the driver at {job.report_to[0]}:{job.report_to[1]} "
              f"where the scheduler is (no TensorBoard scalars): {exc}", file=sys.stderr, flush=True)


def _role_task(job: JobSpec, ctx: BarrierTaskContext, role: str, rank: int | None, host: str) -> list:
    """Run the scheduler (and share its address) or a server, until the workers are done."""
    settings = kvconfig.load(kvconfig.child_environ({**job.env, "KVSTORE_SECRET": job.secret}))
    name = role if rank is None else f"{role} {rank}"
    grace = settings.shutdown_timeout
    proc: RoleProcess | None = None
    try:
        if role == "scheduler":
            with tempfile.TemporaryDirectory(prefix="kvstore-spark-") as workdir:
                port_file = os.path.join(workdir, "scheduler.port")
                env = role_env(role, None, job.layout, root_host=host, root_port=0, secret=job.secret,
                               node_host=host, extra=job.env)
                env.update(KVSTORE_PORT_FILE=port_file, **_no_gpu(job))
                proc = _start_role(role, rank, [sys.executable, "-m", "kvstore.scheduler"], env, grace)
                try:
                    port = _wait_port(proc, port_file, settings.connect_timeout)
                except TaskFailed:
                    ctx.allGather("")  # the others learn there is no scheduler and return
                    raise
            _report_scheduler(job, host, port)
            ctx.allGather(json.dumps({"host": host, "port": port}))
        else:
            root = ctx.allGather("")[SCHEDULER_PARTITION]
            if not root:
                return []  # the scheduler task failed; its error is the job's
            address = json.loads(root)
            env = role_env(role, rank, job.layout, root_host=address["host"], root_port=address["port"],
                           secret=job.secret, node_host=host, extra=job.env)
            env.update(_no_gpu(job))
            proc = _start_role(role, rank, [sys.executable, "-m", "kvstore.server"], env, grace)
        reports = _await_workers(ctx, proc)
        if not any(report["joined"] for report in reports):
            return []  # no worker used the cluster: stopped below
        code = proc.wait(time.monotonic() + settings.shutdown_timeout)
        if code is None:
            print(f"[kvstore {name}] still running {settings.shutdown_timeout:g} s after every worker "
                  "left (KVSTORE_SHUTDOWN_TIMEOUT); stopping it", file=sys.stderr, flush=True)
        elif code != 0:
            raise _failure(proc, f"exited with code {code}")
        return []
    finally:
        if proc is not None:  # one that exited is reaped already: this joins its output
            proc.stop(join_timeout=2.0)


def _worker_task(job: JobSpec, ctx: BarrierTaskContext, rank: int, host: str, records: Iterator) -> list:
    """Call train_fn with this rank's environment; leave the cluster whatever it did."""
    gpu_env = _worker_gpus(job, ctx, rank)  # too few GPUs: fails before the first barrier
    root = ctx.allGather("")[SCHEDULER_PARTITION]
    if not root:
        return []  # the scheduler task failed; its error is the job's
    address = json.loads(root)
    env = role_env("worker", rank, job.layout, root_host=address["host"], root_port=address["port"],
                   secret=job.secret, node_host=host, extra=job.env)
    env.update(gpu_env)
    try:
        release_process_store("its cluster is gone")  # left by an earlier task of this Python worker
    except KVStoreError:
        pass
    data = _worker_data(job, rank, records)
    try:
        result = _call_train_fn(job, rank, env, data)
    finally:
        if isinstance(data, WorkerFeed):
            data.close()
    ctx.allGather(json.dumps({"rank": rank, "joined": result[0]}))
    return [(rank, result[1])]


def _worker_data(job: JobSpec, rank: int, records: Iterator) -> Any:
    """What train_fn iterates: this worker's feed (``epochs=``), its routed records, or nothing.
    Raises TaskFailed when the driver's feed cannot be reached."""
    if job.feed is not None:
        try:
            return WorkerFeed(job.feed, job.secret, rank)
        except FeedError as exc:
            raise TaskFailed(f"worker {rank}: {exc}") from None
    return (record for _, record in records) if job.keyed else iter(())


def _call_train_fn(job: JobSpec, rank: int, env: dict[str, str], data: Any) -> tuple[bool, Any]:
    """``(joined, result)``: train_fn's result and whether it joined the cluster, which it leaves
    after.  Raises TaskFailed when train_fn raises or leaving fails."""
    with kvconfig.process_environ(env):
        try:
            result = job.train_fn(data, *job.args)
        except BaseException as exc:
            try:
                release_process_store(f"train_fn raised {type(exc).__name__}: {exc}")
            except KVStoreError:
                pass  # the train_fn's error is the one to report
            raise TaskFailed(f"worker {rank}: train_fn raised {type(exc).__name__}: {exc}") from exc
        try:
            joined = release_process_store()
        except KVStoreError as exc:
            raise TaskFailed(f"worker {rank}: leaving the cluster failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    return joined, result


def _no_gpu(job: JobSpec) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES=""`` for the scheduler and servers when ``worker_gpus`` is given."""
    return dict(gpus.NO_GPU) if job.worker_gpus is not None else {}


def _worker_gpus(job: JobSpec, ctx: BarrierTaskContext, rank: int) -> dict[str, str]:
    """Worker ``rank``'s GPU variables (:mod:`kvstore.launch.gpus`) when ``worker_gpus`` is given: from
    the GPU addresses Spark gave the task if it schedules GPUs, else the executor host's count (run()'s
    ``env`` over the executor's environment: its ``KVSTORE_HOST_GPUS`` counts); local
    ranks count the worker tasks on the same host.  Raises TaskFailed when there are too few GPUs."""
    if job.worker_gpus is None:
        return {}
    infos = ctx.getTaskInfos()
    layout = job.layout
    hosts = [infos[layout.worker_partition(r)].address.rpartition(":")[0] for r in range(layout.num_workers)]
    local, size = gpus.local_ranks(hosts)[rank]
    resource = ctx.resources().get("gpu")
    assigned = list(resource.addresses) if resource is not None and resource.addresses else None
    try:
        host = [] if assigned is not None else gpus.host_devices(kvconfig.child_environ(job.env))[0]
        return gpus.task_share(rank, layout.num_workers, local, size, assigned, host, job.worker_gpus)
    except ConfigError as exc:
        raise TaskFailed(f"worker {rank} on {hosts[rank]}: {exc}") from None


def run_task(job: JobSpec, records: Iterator) -> list:
    """One barrier task: the role of this partition (see :class:`Layout`)."""
    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    role, rank = job.layout.role_of(partition)
    host = _task_host(ctx, partition, job.env)
    if role == "worker":
        return _worker_task(job, ctx, rank, host, records)
    return _role_task(job, ctx, role, rank, host)

"""The plan of a kvstore job inside Spark, pure functions tested without Spark: which partition of the
barrier stage runs which role, how records are routed to the workers, the slot check, each role's
environment, and reading a task's error back out of Spark's text."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvstore import config as kvconfig
from kvstore.errors import ConfigError, NotEnoughSlotsError, TaskFailed
from kvstore.launch import envrules as roles

SCHEDULER_PARTITION = 0


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


def check_slots(available: int, num_servers: int, num_workers: int, feed_tasks: int = 0) -> None:
    """Raise :class:`NotEnoughSlotsError` when ``available`` concurrent task slots cannot hold the
    ``1 + num_servers + num_workers`` barrier tasks plus ``feed_tasks`` slots for the streaming feed's
    jobs beside them (Spark would otherwise wait and fail obscurely, or the feed would never run)."""
    needed = Layout(num_servers, num_workers).num_tasks + feed_tasks
    feed = f" + {feed_tasks} feed task{'s' * (feed_tasks != 1)} beside it" if feed_tasks else ""
    if available < needed:
        raise NotEnoughSlotsError(
            f"kvstore.spark.run needs {needed} concurrent task slots (1 scheduler + {num_servers} "
            f"server{'s' * (num_servers != 1)} + {num_workers} worker{'s' * (num_workers != 1)}), all "
            f"at once in one barrier stage{feed}; this Spark context has {available}: use local[{needed}] or "
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
    found = re.search(re.escape(f"[{TaskFailed.MARK}] ") + r"(.*?)(?:\n SQLSTATE|\n\s*at [\w$.]+\(|\Z)", text,
                      re.DOTALL)
    if found:
        return found.group(1).rstrip()
    traceback = re.search(r"Traceback \(most recent call last\):\n(.*?)(?:\n SQLSTATE|\n\s*at [\w$.]+\(|\Z)",
                          text, re.DOTALL)
    if traceback:
        lines = [line for line in traceback.group(1).splitlines() if line.strip()]
        return lines[-1].strip() if lines else None
    return None

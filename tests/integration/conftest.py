"""Real clusters for integration tests: a scheduler and servers as processes, workers in-process.

Each worker is a :class:`DistKVStore` made directly (``create`` allows one per
process), so many workers share this process and a test can drive them from
threads.  Everything runs over real zmq sockets on loopback, ports chosen by
binding port 0.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore import config as kvconfig
from kvstore.client.store import DistKVStore
from kvstore.net.auth import Channel, derive_key
from tests.helpers import Processes, poll_for, python, run_parallel, tagged_pids

_names = itertools.count()
SECRET = "integration-test-secret"  # every test cluster authenticates, as launched ones do


class Cluster:
    """A running scheduler and servers, plus ``num_workers`` connected worker stores."""

    def __init__(self, workdir: Path, mode: str, num_workers: int, num_servers: int,
                 bound: int = 1000, **settings: Any) -> None:
        self.mode, self.num_workers, self.num_servers = mode, num_workers, num_servers
        self.procs = Processes(workdir)
        self.env = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NUM_WORKER": str(num_workers),
                    "DMLC_NUM_SERVER": str(num_servers), "KVSTORE_CONNECT_TIMEOUT": "30",
                    "KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_LOG_LEVEL": "INFO",
                    "KVSTORE_SECRET": SECRET}
        self.env.update({k: str(v) for k, v in settings.items()})
        port_file = workdir / "scheduler.port"
        self.procs.start("scheduler", [python(), "-m", "kvstore.scheduler"],
                         {**self.env, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "0",
                          "KVSTORE_PORT_FILE": str(port_file)})
        poll_for(port_file.exists, 30, "the scheduler's port file")
        self.env["DMLC_PS_ROOT_PORT"] = port_file.read_text().strip()
        for rank in range(num_servers):
            self.procs.start(f"server {rank}", [python(), "-m", "kvstore.server"],
                             {**self.env, "DMLC_ROLE": "server"})
        self.cfg = dataclasses.replace(kvconfig.load({**self.env, "DMLC_ROLE": "worker"}),
                                       bigarray_bound=bound)
        self.workers: list[DistKVStore] = []

    def connect(self, count: int | None = None, **overrides: Any) -> list[DistKVStore]:
        """Create ``count`` (default: every) worker's store concurrently (registration waits for all
        workers, so the rest must be started elsewhere); return them by rank."""
        cfg = dataclasses.replace(self.cfg, **overrides)
        stores = run_parallel([lambda: DistKVStore(self.mode, cfg)] * (count or self.num_workers))
        self.workers = sorted(stores, key=lambda kv: kv.rank)
        return self.workers

    def run(self, fn: Callable[[DistKVStore], Any]) -> list[Any]:
        """Run ``fn(kv)`` on every worker in parallel threads; return the results by rank."""
        return run_parallel([lambda kv=kv: fn(kv) for kv in self.workers])

    def close(self) -> None:
        """Close every worker (they leave), then stop and reap every process."""
        try:
            run_parallel([kv.close for kv in self.workers if not kv._closed])
        finally:
            self.procs.stop(timeout=10)


def insider(kv: DistKVStore, label: str) -> Channel:
    """A channel holding the cluster's secret and session, as a node of the cluster would (tests
    use it to send well-sealed messages of their own making)."""
    channel = Channel(derive_key(SECRET), label)
    channel._session_key = kv._io.channel._session_key
    channel._hot_key = kv._io.channel._hot_key  # the same key compiled (kvstore.net._hot), or None
    return channel


def unique_key(prefix: str = "k") -> str:
    """A str key no other test uses."""
    return f"{prefix}{next(_names)}"


def unique_int_key() -> int:
    """An int key no other test uses."""
    return 1_000_000 + next(_names)


@pytest.fixture
def tag():
    """A unique environment tag (KVSTORE_TEST_TAG); every process carrying it is killed at teardown."""
    value = f"kvtest-{uuid.uuid4().hex}"
    yield value
    for pid in tagged_pids(value):
        os.kill(pid, signal.SIGKILL)


class Clusters:
    """Makes clusters in folders under ``root`` (``make``, the ``make_cluster`` fixture's factory) and
    tears them all down (``close``); a benchmark uses it outside pytest."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: list[Cluster] = []

    def make(self, mode: str = "dist_sync", num_workers: int = 2, num_servers: int = 1, connect: bool = True,
             **kwargs: Any) -> Cluster:
        """A new cluster (connected unless ``connect`` is False)."""
        workdir = self.root / f"cluster{len(self.made)}"
        workdir.mkdir()
        cluster = Cluster(workdir, mode, num_workers, num_servers, **kwargs)
        self.made.append(cluster)
        if connect:
            cluster.connect()
        return cluster

    def close(self) -> None:
        """Tear down every cluster made."""
        for cluster in self.made:
            cluster.close()


@pytest.fixture
def make_cluster(tmp_path: Path, request: pytest.FixtureRequest):
    """Factory for clusters that are torn down (and their logs printed on failure) after the test."""
    clusters = Clusters(tmp_path)
    yield clusters.make
    clusters.close()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for cluster in clusters.made:
            print(cluster.procs.output())


def _shared_cluster(tmp_path_factory: pytest.TempPathFactory, mode: str, workers: int,
                    servers: int, **env: Any):
    """A connected cluster for a module's tests (``env``: extra settings); its logs printed if it fails
    to come up."""
    cluster = Cluster(tmp_path_factory.mktemp(f"{mode}-{workers}w{servers}s"), mode, workers, servers, **env)
    try:
        cluster.connect()
    except BaseException:
        cluster.close()
        print(cluster.procs.output())
        raise
    return cluster


@pytest.fixture(scope="module", params=[("dist_sync", 3, 2), ("dist_sync", 2, 1), ("dist_sync", 4, 3)],
                ids=lambda p: f"{p[0]}-{p[1]}w{p[2]}s")
def sync_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A dist_sync cluster shared by a module's tests (they use unique keys)."""
    cluster = _shared_cluster(tmp_path_factory, *request.param)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module", params=[("dist_async", 3, 2), ("dist_async", 1, 1)],
                ids=lambda p: f"{p[0]}-{p[1]}w{p[2]}s")
def async_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A dist_async cluster shared by a module's tests."""
    cluster = _shared_cluster(tmp_path_factory, *request.param)
    yield cluster
    cluster.close()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Remember each phase's report on the item, so fixtures can print logs of failed tests."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)

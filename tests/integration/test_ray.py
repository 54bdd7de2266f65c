"""kvstore on Ray end to end: ``launch.py --launcher ray`` and ``kvstore.ray.run`` on a local Ray.

One Ray instance (2 CPUs) serves the module's Python-API tests; the launch.py tests start their own
or join that one with ``--ray-address``.  Every role carries a KVSTORE_TEST_TAG, so the tests can
check that nothing is left behind.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import finish, launch, poll_for, tagged_pids

ray = pytest.importorskip("ray", reason="needs the [ray] extra (pip install -e .[ray]): `import ray` failed")
kvray = pytest.importorskip("kvstore.ray")

SCRIPT = str(Path(__file__).parent / "scripts" / "sum_check.py")
ROLE_ENV = {"KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
            "KVSTORE_CONNECT_TIMEOUT": "30"}


def _launch(args: list[str], tag: str) -> object:
    env = {**os.environ, **ROLE_ENV, "KVSTORE_TEST_TAG": tag, "RAY_USAGE_STATS_ENABLED": "0"}
    return launch(["--launcher", "ray", "--env", f"KVSTORE_TEST_TAG={tag}", *args], env)


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray instance (2 CPUs) for the module; yields its address."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                           logging_level="WARNING")
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()


def _all_cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0.0) == ray.cluster_resources().get("CPU")


def _no_live_placement_groups() -> bool:
    return all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


# -- what the worker functions run (in the workers' actors) ------------------------------------------

def sum_check(scale: float) -> tuple[int, int, float, str]:
    """Push ones * (rank + 1) * scale to a small and a big key; return (rank, W, pulled, node host)."""
    import kvstore

    kv = kvstore.create("dist_sync")
    workers = kv.num_workers
    pulled = []
    for key, size in ((5, 10), ("big", 2500)):  # the bound is 1000: "big" is split over the servers
        kv.init(key, np.zeros(size, np.float32))
        kv.push(key, np.ones(size, np.float32) * (kv.rank + 1) * scale)
        out = kv.pull(key)
        assert (out == out[0]).all()
        pulled.append(float(out[0]))
    assert pulled[0] == pulled[1] == scale * workers * (workers + 1) / 2, pulled
    kv.barrier()
    print(f"hello from rank {kv.rank}", flush=True)
    return kv.rank, workers, pulled[0], os.environ["DMLC_NODE_HOST"]


def steady(ready_dir: str) -> None:
    """dist_sync rounds for up to 60 s; after the first, create READY_DIR/rank<r>."""
    import kvstore

    kv = kvstore.create("dist_sync")
    kv.init("w", np.zeros(3000, np.float32))
    deadline = time.monotonic() + 60
    first = True
    while time.monotonic() < deadline:
        kv.push("w", np.ones(3000, np.float32))
        kv.pull("w")
        if first:
            (Path(ready_dir) / f"rank{kv.rank}").touch()
            first = False


def raise_on_rank_1() -> None:
    import kvstore

    kv = kvstore.create("dist_sync")
    kv.init("x", np.zeros(3, np.float32))
    if kv.rank == 1:
        raise RuntimeError("worker function fails on purpose")
    kv.pull("x")  # blocks: the failed worker never pushes
    kv.push("x", np.ones(3, np.float32))
    kv.pull("x")


# -- the launcher -------------------------------------------------------------------------------------

def test_launch_on_a_local_ray_runs_every_role_and_leaves_nothing(tag: str) -> None:
    """launch.py -n 2 -s 2 --launcher ray starts its own Ray, sums right, prefixes output, exits 0 and
    leaves no process (roles, tethers, actors or Ray's own) behind."""
    rc, out = finish(_launch(["-n", "2", "-s", "2", SCRIPT, "dist_sync"], tag), timeout=90)
    assert rc == 0, out
    for rank in range(2):
        assert f"[worker {rank}] RESULT ok rank={rank} of 2 servers=2" in out, out
    assert "[scheduler]" in out and "[server 1]" in out and "all workers left; shut down" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 30, "every process of the job and its Ray to exit")


def test_launch_failing_worker_exits_1_naming_it(tag: str, ray_address: str) -> None:
    """A command worker that raises (sum_check.py dist_sync 1), on a joined Ray cluster: exit code 1,
    the message names worker 1, the other roles are stopped and the cluster is left running."""
    start = time.monotonic()
    rc, out = finish(_launch(["-n", "2", "-s", "1", "--ray-address", ray_address, SCRIPT, "dist_sync", "1"],
                             tag), timeout=90)
    assert rc == 1, out
    assert "worker 1 exited with code 1" in out, out
    assert "[worker 1] RuntimeError: worker 1 fails on purpose" in out, out
    assert time.monotonic() - start < 45, out  # the other worker was blocked in a pull with a 600 s deadline
    assert poll_for(lambda: not tagged_pids(tag), 20, "every role to exit")
    assert ray.is_initialized() and poll_for(_all_cpus_free, 20, "the job's CPUs to be released")


# -- the Python API -----------------------------------------------------------------------------------

def test_run_a_function_returns_results_in_rank_order(tag: str, ray_address: str) -> None:
    """run(fn, 3, 2) calls fn in 3 worker actors joined to 2 servers; results come back by rank, and
    the function's prints come back prefixed."""
    out = io.StringIO()
    results = kvray.run(sum_check, 3, 2, args=(2.0,), env={**ROLE_ENV, "KVSTORE_TEST_TAG": tag},
                        stdout=out, timeout=90)
    host = ray.util.get_node_ip_address()
    assert results == [(rank, 3, 12.0, host) for rank in range(3)], out.getvalue()
    for rank in range(3):
        assert f"[worker {rank}] hello from rank {rank}\n" in out.getvalue()
    assert "[scheduler]" in out.getvalue() and "[server 1]" in out.getvalue()
    assert poll_for(lambda: not tagged_pids(tag), 20, "every role and worker actor to exit")
    assert poll_for(_all_cpus_free, 20, "the job's CPUs to be released") and _no_live_placement_groups()


@pytest.mark.parametrize("role", ["worker", "server"])
def test_killing_a_role_actor_fails_the_run_naming_it(tag: str, ray_address: str, tmp_path: Path,
                                                      role: str) -> None:
    """ray.kill of worker 1's or server 1's actor mid-training: wait() raises RoleFailed naming it
    within seconds, and every role is stopped (a killed server actor's tether stops its process).
    Heartbeats are slowed down, so neither the failure nor the clean-up can come from them."""
    env = {**ROLE_ENV, "KVSTORE_TEST_TAG": tag, "KVSTORE_HEARTBEAT_TIMEOUT": "60"}
    job = kvray.start(steady, 3, 2, args=(str(tmp_path),), env=env, stdout=io.StringIO())
    with job:
        poll_for(lambda: len(list(tmp_path.iterdir())) == 3, 60, "every worker to finish a round")
        killed = time.monotonic()
        ray.kill(job.actor(role, 1))
        with pytest.raises(kvray.RoleFailed) as info:
            job.wait(timeout=60)
    assert time.monotonic() - killed < 20
    assert (info.value.role, info.value.rank, info.value.exit_code) == (role, 1, None)
    assert f"{role} 1 died" in str(info.value) and "ray.kill" in str(info.value), str(info.value)
    assert poll_for(lambda: not tagged_pids(tag), 15, "every role and worker actor to exit")
    assert poll_for(_all_cpus_free, 20, "the job's CPUs to be released")


def test_sigterm_to_the_launcher_exits_143_and_stops_everything(tag: str, ray_address: str) -> None:
    """SIGTERM to launch.py --launcher ray while the workers are blocked: exit 143, nothing left."""
    proc = _launch(["-n", "2", "-s", "1", "--ray-address", ray_address, sys.executable, "-c",
                    "import kvstore, numpy as np; kv = kvstore.create('dist_sync'); "
                    "kv.init(1, np.zeros(1)); print('READY', flush=True); "
                    "kv.push(1, np.ones(1)) or kv.pull(1) if kv.rank == 0 else kv.barrier()"], tag)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[worker 1] READY"):
            break
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc, timeout=60)
    assert rc == 143, "".join(lines) + out
    assert "interrupted; stopping every process" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 20, "every role to exit")


def test_a_raising_function_fails_the_run_with_its_traceback(tag: str, ray_address: str) -> None:
    """A worker function that raises: RoleFailed names the worker, carries the traceback, exit code 1."""
    out = io.StringIO()
    with pytest.raises(kvray.RoleFailed) as info:
        kvray.run(raise_on_rank_1, 2, 1, env={**ROLE_ENV, "KVSTORE_TEST_TAG": tag}, stdout=out, timeout=60)
    assert (info.value.role, info.value.rank, info.value.exit_code) == ("worker", 1, 1)
    message = str(info.value)
    assert "worker 1's function raised" in message, message
    assert "RuntimeError: worker function fails on purpose" in message, message
    assert "Traceback" in message and "[worker 1] Traceback" in out.getvalue()
    assert poll_for(lambda: not tagged_pids(tag), 20, "every role and worker actor to exit")


def test_a_job_that_cannot_be_placed_fails_fast_naming_cpus(ray_address: str) -> None:
    """worker_cpus=64 on a 2-CPU Ray: PlacementError within the placement timeout, saying what was
    asked and what there is; the placement group is removed."""
    start = time.monotonic()
    with pytest.raises(kvray.PlacementError) as info:
        kvray.run(sum_check, 2, 1, args=(1.0,), worker_cpus=64, placement_timeout=2)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "2 workers x 64 CPU" in message and "1 scheduler x 0.05 CPU" in message, message
    assert "2 CPU in all" in message, message
    assert poll_for(_no_live_placement_groups, 10, "the placement group to be removed")
    assert poll_for(_all_cpus_free, 10, "every CPU to be free")


def test_launch_that_cannot_be_placed_exits_1_naming_the_cpus(tag: str, ray_address: str) -> None:
    """launch.py --ray-worker-cpus 64 on a 2-CPU Ray: exit 1 with the placement error, nothing started."""
    rc, out = finish(_launch(["-n", "2", "-s", "1", "--ray-address", ray_address, "--ray-worker-cpus", "64",
                              "--ray-placement-timeout", "2", SCRIPT, "dist_sync"], tag), timeout=90)
    assert rc == 1, out
    assert "could not place the job within 2 s" in out and "2 workers x 64 CPU" in out, out
    assert "[worker" not in out, out
    assert poll_for(_no_live_placement_groups, 10, "the placement group to be removed")

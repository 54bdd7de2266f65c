"""``launch.py --launcher mpi`` with the real Open MPI mpirun, and ``--gpus-per-worker`` on a real local
cluster (the GPU count injected with KVSTORE_HOST_GPUS: the workers only print what they got)."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from tests.helpers import finish, launch, poll_for, tagged_pids

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "sum_check.py")
# A worker that prints what --gpus-per-worker and --env-worker gave it, then sums one key with the others.
WORKER = """\
import os, numpy as np, kvstore
names = ('CUDA_VISIBLE_DEVICES', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'KV_MPI_W',
         'MASTER_ADDR')
kv = kvstore.create('dist_sync')
kv.init('w', np.zeros(3, np.float32))
kv.push('w', np.ones(3, np.float32))
total = kv.pull('w')[0]
print('GOT', kv.rank, total, *[repr(os.environ.get(name)) for name in names], flush=True)
"""
# Variables of the test runner's own environment that must not reach the cluster.
MASKED = ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER", "DMLC_NUM_WORKER",
          "CUDA_VISIBLE_DEVICES", "KVSTORE_HOST_GPUS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cluster_env(tag: str, **extra: str) -> dict[str, str]:
    """The launcher's environment: the runner's, masked, with root allowed for mpirun and ``tag``."""
    env = {name: value for name, value in os.environ.items() if name not in MASKED}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", KVSTORE_TEST_TAG=tag,
               KVSTORE_BIGARRAY_BOUND="1000", KVSTORE_CONNECT_TIMEOUT="30", KVSTORE_SHUTDOWN_TIMEOUT="5",
               **extra)
    return env


def run_launch(args: list[str], env: dict[str, str], tag: str) -> tuple[int, str]:
    """Run launch.py to its end (45 s at most); then check every process of the cluster is gone,
    killing any that is left (and failing)."""
    proc = launch(args, env)
    try:
        return finish(proc, 45)
    finally:
        try:
            poll_for(lambda: not tagged_pids(tag), 10, "every process of the cluster to exit")
        finally:
            for pid in tagged_pids(tag):
                os.kill(pid, signal.SIGKILL)


def needs_mpirun() -> None:
    """Skip the test without Open MPI's mpirun."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun (Debian's openmpi-bin)")


@pytest.mark.timeout(60)
def test_mpi_launcher_runs_a_training_script(tmp_path: Path) -> None:
    """-n 2 -s 1: one mpirun of 4 ranks; each worker sums with the other, gets its --env-worker variable
    and, under --gpus-per-worker 0, no GPU and torchrun's RANK / WORLD_SIZE (never MASTER_ADDR)."""
    needs_mpirun()
    tag = f"mpilaunch-{uuid.uuid4().hex}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    code, out = run_launch(["--launcher", "mpi", "-n", "2", "-s", "1", "--env-worker", "KV_MPI_W=w",
                            "--gpus-per-worker", "0", str(script)], cluster_env(tag), tag)
    assert code == 0, out
    for rank in (0, 1):
        assert f"[worker {rank}] GOT {rank} 2.0 '' '{rank}' '2' '{rank}' '2' 'w' None" in out, out
    assert "[scheduler] kvstore.node: mpi rank 0 of 4 -> scheduler" in out, out


@pytest.mark.timeout(60)
def test_mpi_launcher_reports_the_failed_worker(tmp_path: Path) -> None:
    """A worker that raises: the launcher exits non-zero, and its last line names a failed role and,
    for the worker, its exception."""
    needs_mpirun()
    tag = f"mpifail-{uuid.uuid4().hex}"
    code, out = run_launch(["--launcher", "mpi", "-n", "2", "-s", "1", SCRIPT, "dist_sync", "1"],
                           cluster_env(tag), tag)
    assert code == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("launch.py: ") and " failed first (exit 1)" in last, out
    assert "[worker 1] RuntimeError: worker 1 fails on purpose" in out, out


@pytest.mark.timeout(60)
def test_local_launcher_gives_each_worker_its_gpus(tmp_path: Path) -> None:
    """--gpus-per-worker 2 on a host said to have 4 GPUs: workers get 0,1 and 2,3 and the torchrun names."""
    tag = f"gpus-{uuid.uuid4().hex}"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    code, out = run_launch(["-n", "2", "-s", "1", "--gpus-per-worker", "2", str(script)],
                           cluster_env(tag, KVSTORE_HOST_GPUS="4"), tag)
    assert code == 0, out
    assert "[worker 0] GOT 0 2.0 '0,1' '0' '2' '0' '2' None None" in out, out
    assert "[worker 1] GOT 1 2.0 '2,3' '1' '2' '1' '2' None None" in out, out

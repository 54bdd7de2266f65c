"""``python -m kvstore.node --gpus-per-worker N``: a role's GPU variables from its manager's ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstore.errors import ConfigError
from kvstore.launch import managers
from kvstore.launch.node_gpus import node_gpu_env, worker_local_rank
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(60)


def torchrun_rank(rank: int, nproc: int = 3) -> dict[str, str]:
    """What torchrun gives rank ``rank`` of 2 nodes x ``nproc``, with the DMLC_* kvstore.node derives
    for S=1 (ranks 0 and 1 the scheduler and server, the rest workers)."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank % nproc), "LOCAL_WORLD_SIZE": str(nproc),
           "WORLD_SIZE": str(2 * nproc), "MASTER_ADDR": "h0", "MASTER_PORT": "29500", "DMLC_NUM_SERVER": "1"}
    return {**env, **managers.derive(env)}


def test_workers_count_per_host_past_the_scheduler_and_servers() -> None:
    """2 nodes x 3 (S=1, W=4): node 0 has the scheduler, server 0 and worker 0; node 1 workers 1..3."""
    envs = [torchrun_rank(r) for r in range(2, 6)]
    placed = [worker_local_rank(env, int(env["DMLC_WORKER_ID"]), 1) for env in envs]
    assert placed == [(0, 1), (0, 3), (1, 3), (2, 3)]
    env = node_gpu_env(torchrun_rank(4), 2, count=lambda: 8)
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "3"}


def test_open_mpi_ranks_and_a_worker_alone() -> None:
    """Open MPI's local rank variables place a worker; without any, a worker is alone on its host."""
    mpi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert worker_local_rank(mpi, 1, 1) == (1, 2)
    by_hand = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "5", "DMLC_NUM_WORKER": "8", "DMLC_NUM_SERVER": "1"}
    assert node_gpu_env(by_hand, 1, count=lambda: 1)["CUDA_VISIBLE_DEVICES"] == "0"
    assert node_gpu_env({**by_hand, "DMLC_ROLE": "server"}, 1) == {"CUDA_VISIBLE_DEVICES": ""}
    assert node_gpu_env(by_hand, None) == {}


def test_too_few_gpus_say_how_they_were_counted() -> None:
    """A worker on a host without GPUs: ConfigError naming the count's source and the override."""
    by_hand = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"}
    with pytest.raises(ConfigError, match=r"has 0 \(counted from KVSTORE_HOST_GPUS; set KVSTORE_HOST_GPUS"):
        node_gpu_env({**by_hand, "KVSTORE_HOST_GPUS": "0"}, 1)


def node(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """Run ``python -m kvstore.node ARGV`` with ``env`` over a clean role environment."""
    base = {name: value for name, value in os.environ.items()
            if not name.startswith(("DMLC_", "OMPI_", "PMI", "SLURM_")) and name not in (
                "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "JOB_COMPLETION_INDEX",
                "CUDA_VISIBLE_DEVICES", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "kvstore.node", *argv], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=30)


def test_the_node_sets_a_workers_gpus_before_it_execs_the_command() -> None:
    """DMLC_ROLE=worker and --gpus-per-worker 2 on a host said to have 3 GPUs: the command sees 0,1;
    with 1 GPU the node exits 2 before starting it; a bad value is a usage error."""
    role = {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0", "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1"}
    show = ["sh", "-c", "echo GOT $CUDA_VISIBLE_DEVICES $RANK $LOCAL_RANK"]
    ok = node(["--gpus-per-worker", "2", *show], KVSTORE_HOST_GPUS="3", **role)
    assert ok.returncode == 0 and ok.stdout.strip() == "GOT 0,1 0 0", ok.stderr
    short = node(["--gpus-per-worker=2", *show], KVSTORE_HOST_GPUS="1", **role)
    assert short.returncode == 2 and "GOT" not in short.stdout
    assert ("kvstore.node: --gpus-per-worker 2: 1 worker(s) on one host need 2 GPU(s), and it has 1"
            in short.stderr)
    bad = node(["--gpus-per-worker", "-1", *show], **role)
    assert bad.returncode == 2 and "must be >= 0" in bad.stderr

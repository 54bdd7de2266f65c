"""``python -m kvstore.node --gpus-per-worker N CMD``: the GPU variables of this node's role, once its
role is known (from ``DMLC_ROLE`` or a cluster manager), placed by :mod:`kvstore.launch.gpus`.

A worker's local rank counts the workers on its host.  A cluster manager tells each process its
global rank, its local rank and how many processes share its host; its host then runs the global
ranks ``rank - local .. rank - local + size - 1`` (one block, as torchrun always places them and
mpirun and Slurm do by default), of which those at or past ``1 + S`` are workers (the role plan).
Without such variables (``DMLC_ROLE`` set by hand, a Kubernetes pod) the worker is alone on its host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.launch import gpus

# (global rank, local rank, processes on the host) of each manager that tells them, in detect order.
LOCAL_VARS = (("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun
              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
              ("PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Hydra
              ("SLURM_PROCID", "SLURM_LOCALID", "KVSTORE_TASKS_ON_NODE"))  # Slurm: see slurm_tasks_on_node


def slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """How many tasks of the step share this node: ``SLURM_NTASKS_PER_NODE`` when uniform, else None."""
    text = kvconfig.env_text(env, "SLURM_NTASKS_PER_NODE") or ""
    return int(text) if text.isdigit() else None


def host_block(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """``(global rank, local rank, processes on this host)`` from the manager's variables (with
    ``KVSTORE_RANK_OFFSET`` added to the rank), or None when no manager tells them."""
    offset = kvconfig.env_int(env, "KVSTORE_RANK_OFFSET", minimum=0, default=0) or 0
    for rank_var, local_var, size_var in LOCAL_VARS:
        rank, local = kvconfig.env_text(env, rank_var), kvconfig.env_text(env, local_var)
        size = (slurm_tasks_on_node(env) if size_var == "KVSTORE_TASKS_ON_NODE"
                else kvconfig.env_int(env, size_var, minimum=1))
        if rank is not None and local is not None and size is not None and rank.isdigit() and local.isdigit():
            return int(rank) + offset, int(local), size
    return None


def worker_local_rank(env: Mapping[str, str], worker_rank: int, num_servers: int) -> tuple[int, int]:
    """``(local rank, workers on this host)`` of worker ``worker_rank`` (see the module docstring)."""
    block = host_block(env)
    if block is None:
        return 0, 1
    rank, local, size = block
    first_worker = 1 + num_servers
    start = rank - local
    workers = [r for r in range(start, start + size) if r >= first_worker]
    mine = first_worker + worker_rank
    return (workers.index(mine), len(workers)) if mine in workers else (0, 1)


def node_gpu_env(env: Mapping[str, str], gpus_per_worker: int | None,
                 count: Callable[[], int | None] = gpus.nvidia_smi_count) -> dict[str, str]:
    """The variables ``--gpus-per-worker`` adds to the role of ``env`` (its ``DMLC_*`` known): a
    worker's GPUs and torchrun names, ``CUDA_VISIBLE_DEVICES=""`` for the others, nothing without the
    flag.  Raises ConfigError when this host has too few GPUs for its workers."""
    if gpus_per_worker is None:
        return {}
    cfg = kvconfig.load(env)
    if cfg.role != "worker":
        return dict(gpus.NO_GPU)
    rank = kvconfig.env_int(env, "DMLC_WORKER_ID", minimum=0)
    if rank is None or cfg.num_workers is None or cfg.num_servers is None:
        raise ConfigError("--gpus-per-worker needs DMLC_WORKER_ID, DMLC_NUM_WORKER and DMLC_NUM_SERVER "
                          "for a worker (a cluster manager's kvstore.node derives them)")
    local, size = worker_local_rank(env, rank, cfg.num_servers)
    devices, how = gpus.host_devices(env, count)
    try:
        return gpus.share(rank, cfg.num_workers, local, size, devices, gpus_per_worker)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (counted from {how}; set {gpus.HOST_GPUS} to override)") from None

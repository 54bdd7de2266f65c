"""GPUs per worker (``--gpus-per-worker N``, ``kvstore.spark.run(worker_gpus=N)``): which of a host's
GPUs each worker gets, and the torchrun-style names every launcher sets for a worker.

Pure but for :func:`nvidia_smi_count`: the launchers (:mod:`kvstore.launch.local` for ``local`` and
``ssh``, :mod:`kvstore.launch.mpirun`, :mod:`kvstore.launch.spark_tasks`) count a host's GPUs with
:func:`host_devices` and place every worker with :func:`plan` (or :func:`share` for one worker).

A worker with ``N`` GPUs gets ``CUDA_VISIBLE_DEVICES`` (its ``N`` of the host's, in order: the worker
with local rank ``i`` gets devices ``i*N .. i*N+N-1``), ``RANK`` (its ``kv.rank``), ``WORLD_SIZE``
(the number of workers), ``LOCAL_RANK`` (its index among the workers on its host) and
``LOCAL_WORLD_SIZE`` (the workers on its host).  Servers and the scheduler get
``CUDA_VISIBLE_DEVICES=""`` (:data:`NO_GPU`): they run on the CPU.  ``MASTER_ADDR`` and
``MASTER_PORT`` are never set (with them, ``python -m kvstore.node`` would take the job for torchrun's).
See docs/devices.md.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

from kvstore.errors import ConfigError

HOST_GPUS = "KVSTORE_HOST_GPUS"  # override of a host's GPUs: a count N (0..N-1) or a list of ids
TORCHRUN_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
GPU_NAMES = ("CUDA_VISIBLE_DEVICES", *TORCHRUN_NAMES)  # what --gpus-per-worker sets for a worker
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the scheduler and servers under --gpus-per-worker
NVIDIA_SMI_TIMEOUT = 20.0  # seconds nvidia-smi -L may take

H = TypeVar("H", bound=Hashable)


def parse_devices(text: str, name: str = HOST_GPUS) -> list[str]:
    """The GPU ids of ``text``: a count ``N`` (ids ``0..N-1``; only for :data:`HOST_GPUS`) or a comma
    list as ``CUDA_VISIBLE_DEVICES`` takes it (CUDA stops at the first invalid id, e.g. ``-1``).
    Raises ConfigError for a negative count."""
    text = text.strip()
    if name == HOST_GPUS and text.lstrip("-").isdigit():
        if int(text) < 0:
            raise ConfigError(f"{HOST_GPUS}={text} must be a count >= 0 or a list of GPU ids")
        return [str(i) for i in range(int(text))]
    devices: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item or item.startswith("-"):
            break
        devices.append(item)
    return devices


def nvidia_smi_count() -> int | None:
    """How many GPUs ``nvidia-smi -L`` lists (one ``GPU i: ...`` line each), or None without a working
    nvidia-smi.  Raises nothing."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def host_devices(environ: Mapping[str, str], count: Callable[[], int | None] = nvidia_smi_count
                 ) -> tuple[list[str], str]:
    """This host's GPU ids a launcher may hand out, and how they were found: :data:`HOST_GPUS` if set,
    else ``CUDA_VISIBLE_DEVICES`` if set (even empty), else ``0..n-1`` for the ``n`` GPUs ``count``
    finds (nvidia-smi; none without it).  Raises ConfigError for a bad :data:`HOST_GPUS`."""
    override = environ.get(HOST_GPUS)
    if override is not None and override.strip():
        return parse_devices(override), HOST_GPUS
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return parse_devices(visible, "CUDA_VISIBLE_DEVICES"), "CUDA_VISIBLE_DEVICES"
    found = count()
    if found is None:
        return [], "nvidia-smi -L (not found or failed)"
    return [str(i) for i in range(found)], "nvidia-smi -L"


def devices_for(environ: Mapping[str, str], remote: bool,
                count: Callable[[], int | None] = nvidia_smi_count) -> tuple[list[str], str]:
    """A host's GPU ids as :func:`host_devices` finds them on this machine; for a ``remote`` host
    (ssh, mpirun -H) only :data:`HOST_GPUS` can tell.  Raises ConfigError when it is not set then."""
    if remote and not (environ.get(HOST_GPUS) or "").strip():
        raise ConfigError(f"--gpus-per-worker with remote hosts: the launcher cannot count another host's "
                          f"GPUs; set {HOST_GPUS} to the GPUs every host has (a count, or a list of ids)")
    return host_devices(environ, count)


def share(rank: int, num_workers: int, local_rank: int, local_size: int, devices: Sequence[str],
          gpus_per_worker: int, flag: str = "--gpus-per-worker {n}") -> dict[str, str]:
    """The variables of worker ``rank`` (``local_rank`` of ``local_size`` workers on a host with
    ``devices``): its GPUs and the torchrun names.  Raises ConfigError when the host has too few."""
    need = local_size * gpus_per_worker
    if len(devices) < need:
        raise ConfigError(f"{flag.format(n=gpus_per_worker)}: {local_size} worker(s) on one host need "
                          f"{need} GPU(s), and it has {len(devices)}")
    mine = devices[local_rank * gpus_per_worker:(local_rank + 1) * gpus_per_worker]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine), "RANK": str(rank), "WORLD_SIZE": str(num_workers),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size)}


def task_share(rank: int, num_workers: int, local_rank: int, local_size: int, assigned: Sequence[str] | None,
               host: Sequence[str], gpus_per_worker: int) -> dict[str, str]:
    """A Spark worker task's variables: its first ``gpus_per_worker`` of the GPU addresses Spark
    ``assigned`` to the task (when Spark schedules GPUs), else its share of the ``host``'s GPUs.
    Raises ConfigError when there are too few."""
    if assigned is None:
        return share(rank, num_workers, local_rank, local_size, host, gpus_per_worker, "worker_gpus={n}")
    if len(assigned) < gpus_per_worker:
        raise ConfigError(f"worker_gpus={gpus_per_worker}: Spark gave worker {rank}'s task {len(assigned)} "
                          "GPU(s) (spark.task.resource.gpu.amount)")
    env = share(rank, num_workers, 0, 1, assigned, gpus_per_worker)
    env.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size))
    return env


def local_ranks(worker_hosts: Sequence[H]) -> list[tuple[int, int]]:
    """``(local_rank, local_size)`` of every worker, by rank, where ``worker_hosts[rank]`` is its host:
    workers count per host in rank order.  Raises nothing."""
    sizes = Counter(worker_hosts)
    seen: Counter = Counter()
    out = []
    for host in worker_hosts:
        out.append((seen[host], sizes[host]))
        seen[host] += 1
    return out


def plan(worker_hosts: Sequence[H], gpus_per_worker: int,
         devices_of: Callable[[H], tuple[list[str], str]], label: Callable[[H], str] = str
         ) -> list[dict[str, str]]:
    """The GPU variables of every worker, by rank (``worker_hosts[rank]`` its host), the hosts'
    GPUs from ``devices_of`` (ids and how they were counted).  Raises ConfigError, naming the host,
    before anything starts when a host has fewer GPUs than its workers need."""
    if gpus_per_worker < 0:
        raise ConfigError(f"--gpus-per-worker {gpus_per_worker} must be >= 0")
    counted = {host: devices_of(host) for host in dict.fromkeys(worker_hosts)}
    sizes = Counter(worker_hosts)
    for host, (devices, how) in counted.items():
        need = sizes[host] * gpus_per_worker
        if len(devices) < need:
            raise ConfigError(
                f"--gpus-per-worker {gpus_per_worker}: host {label(host)} runs {sizes[host]} worker(s), "
                f"which need {need} GPU(s), and it has {len(devices)} (counted from {how}; set "
                f"{HOST_GPUS} to a count or a list of ids to override)")
    return [share(rank, len(worker_hosts), local, size, counted[host][0], gpus_per_worker)
            for rank, (host, (local, size)) in enumerate(zip(worker_hosts, local_ranks(worker_hosts)))]

"""torchrun: the ``DMLC_*`` variables from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``,
and where rank 0 publishes the scheduler's port in torchrun's agent store (:func:`torch_store`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.launch.managers import tfconfig
from kvstore.launch.managers.common import (
    Adapter,
    Derivation,
    Job,
    has,
    place_rank,
    rank_and_size,
    read_int,
    read_text,
    require_int,
    root_port,
)

# torchrun (torch >= 2.4) tells its processes that its agent's TCPStore, at MASTER_ADDR:MASTER_PORT, is
# shared with them by TORCHELASTIC_USE_AGENT_STORE=True; rank 0 publishes the scheduler's port there.
TORCH_STORE_FLAG = "TORCHELASTIC_USE_AGENT_STORE"
# The key names one rendezvous round as far as torchrun tells its processes (it exports no round number):
# TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, GROUP_WORLD_SIZE (nodes) and WORLD_SIZE; see torch_store.
TORCH_PORT_KEY = "kvstore/scheduler_port/{run}/restart{restart}/nodes{nodes}/world{world}"


@dataclass(frozen=True)
class TorchStore:
    """torchrun's agent store, through which rank 0 tells the other ranks the scheduler's port."""

    host: str  # MASTER_ADDR
    port: int  # MASTER_PORT
    key: str  # TORCH_PORT_KEY, filled in from this process's environment
    publishes: bool  # this process is rank 0, the scheduler: it publishes the port; the others read it


def _torchrun_detected(environ: Mapping[str, str]) -> bool:
    """Whether torchrun is the manager ``kvstore.launch.managers.detect`` picks: its variables are set
    and ``TF_CONFIG``'s, the one manager tried before it, are not.  Raises nothing."""
    return ADAPTER.matches(environ) and not tfconfig.ADAPTER.matches(environ)


def torch_store(environ: Mapping[str, str]) -> TorchStore | None:
    """Where this torchrun process publishes (rank 0) or reads (every other rank) the scheduler's port.

    None, and the port is ``MASTER_PORT`` + 1, unless torchrun is the manager
    ``kvstore.launch.managers.detect`` picks, its agent shares its store with its processes
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torch >= 2.4 unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), ``DMLC_PS_ROOT_PORT`` is unset and
    no ``KVSTORE_RANK_OFFSET`` is set (so rank 0, the scheduler, is in this job).
    The agent's store outlives the worker group, and torchrun tells its processes
    no rendezvous round, so the key (:data:`TORCH_PORT_KEY`) carries what does tell
    rounds apart: ``TORCHELASTIC_RUN_ID`` (jobs sharing one rendezvous endpoint),
    ``TORCHELASTIC_RESTART_COUNT`` (raised by a restart after a failure, not by one
    for a node that joins), ``GROUP_WORLD_SIZE`` and ``WORLD_SIZE`` (a node that
    joins a healthy job adds itself to the next round: more nodes and processes).
    The key is then new unless a restart without a failure gives a round of as
    many nodes and processes as the last (a node left while another joined): a
    rank may then read the previous scheduler's port, which torchrun stopped, and
    fails at its ``KVSTORE_CONNECT_TIMEOUT`` (docs/cluster-managers.md).  Raises ConfigError for a
    bad ``RANK``, ``MASTER_PORT``, restart count or world size.
    """
    if (not _torchrun_detected(environ) or read_text(environ, TORCH_STORE_FLAG) != "True"
            or read_text(environ, "DMLC_PS_ROOT_PORT") is not None
            or read_text(environ, "KVSTORE_RANK_OFFSET") is not None):
        return None
    rank = require_int(environ, "RANK", "torchrun sets it")
    port = require_int(environ, "MASTER_PORT", "torchrun sets it", minimum=1, maximum=65535)
    key = TORCH_PORT_KEY.format(run=read_text(environ, "TORCHELASTIC_RUN_ID") or "none",
                                restart=read_int(environ, "TORCHELASTIC_RESTART_COUNT") or 0,
                                nodes=read_int(environ, "GROUP_WORLD_SIZE") or 1,
                                world=require_int(environ, "WORLD_SIZE", "torchrun sets it"))
    return TorchStore(read_text(environ, "MASTER_ADDR") or "", port, key, rank == 0)


def _explain_torchrun(env: Mapping[str, str]) -> Derivation:
    """Derive a torchrun rank's variables, as :func:`torchrun` says.  Raises ConfigError."""
    job = Job("torchrun", "rank", "processes", "WORLD_SIZE",
              "torchrun --nproc-per-node={n} on one node, or --nnodes x --nproc-per-node = {n}")
    rank, size = rank_and_size(env, "RANK", "WORLD_SIZE", job)
    host = read_text(env, "MASTER_ADDR") or ""
    port = root_port(env)
    store = torch_store(env) if port is None else None
    if store is not None:
        if not store.publishes:
            raise ConfigError(
                f"torchrun rank {rank}: rank 0 publishes the scheduler's port in torchrun's store at "
                f"{host}:{store.port} (key {store.key}), which kvstore.node reads; or set "
                "DMLC_PS_ROOT_PORT to one port for every rank")
        port = 0  # the scheduler binds any free port; rank 0's kvstore.node publishes it
    elif port is None:
        master = require_int(env, "MASTER_PORT", "torchrun sets it", minimum=1, maximum=65535)
        if master == 65535:
            raise ConfigError("MASTER_PORT=65535 leaves no port above it for the scheduler; "
                              "set DMLC_PS_ROOT_PORT")
        port = master + 1  # torchrun's agent (its TCPStore) already listens on MASTER_PORT
    return place_rank(env, job, rank, size, host, port)


def torchrun(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a process's variables from torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and port.

    The scheduler (rank 0) is at ``MASTER_ADDR``.  Its port is ``DMLC_PS_ROOT_PORT``;
    else, when torchrun shares its store (:func:`torch_store`), 0 for rank 0 (any
    free port, which kvstore.node publishes in the store) while every other rank
    needs the published port as ``DMLC_PS_ROOT_PORT`` (kvstore.node reads it, a
    ConfigError here); else ``MASTER_PORT + 1``.  Raises ConfigError when the plan
    does not fit ``WORLD_SIZE`` or ``DMLC_PS_ROOT_PORT`` is not in [1, 65535].
    """
    return _explain_torchrun(environ).env


ADAPTER = Adapter("torchrun", ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", TORCH_STORE_FLAG,
                               "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE"),
                  has("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), _explain_torchrun)
"""torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set."""

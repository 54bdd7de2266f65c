"""The store types and ``create``: the registry that maps each kvstore type name to the store that
serves it (``kvstore.local`` in one process, ``kvstore.client`` for the ``dist_*`` modes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore import config as kvconfig
from kvstore.base import KVStore
from kvstore.errors import ConfigError, UnknownModeError

KNOWN_TYPES: Sequence[str] = ("local", "device", "local_allreduce_cpu", "local_allreduce_device",
                              "local_update_cpu", "dist_sync", "dist_async", "dist_sync_device",
                              "dist_async_device", "dist_device_sync", "dist_device_async")


def _registry() -> dict[str, Callable[[str], KVStore]]:
    """Each known type name -> what makes its store (imported on first use: ``import kvstore`` stays
    free of sockets)."""
    from kvstore.client.instance import create_dist
    from kvstore.local import LocalKVStore

    return {"local": LocalKVStore, "device": LocalKVStore, "local_allreduce_cpu": LocalKVStore,
            "local_allreduce_device": LocalKVStore, "local_update_cpu": LocalKVStore,
            "dist_sync": create_dist, "dist_async": create_dist,
            "dist_sync_device": create_dist, "dist_async_device": create_dist,
            "dist_device_sync": create_dist, "dist_device_async": create_dist}


def create(name: str = "local", quorum: int | None = None) -> KVStore:
    """Create a store: ``'local'`` (default), ``'device'``, ``'dist_sync'``, ``'dist_async'``, ...

    In the device modes (``'device'``, ``'dist_sync_device'``, ``'dist_async_device'`` and
    MXNet's aliases) values on CUDA devices are summed on a GPU (docs/devices.md); with
    numpy arrays and CPU tensors they act exactly as their CPU twins.
    A dist store is one per process: the same mode returns the existing store.
    ``quorum`` (dist_sync only) is asked for when this worker registers: the cluster's quorum is the
    one its workers ask for (all that ask must agree), else the scheduler's ``KVSTORE_SYNC_QUORUM``
    (docs/failures.md, "Stragglers").
    Raises :class:`UnknownModeError` (listing the known names) for an unknown
    name, :class:`ConfigError` when a dist mode lacks the ``DMLC_*`` variables or ``quorum`` is
    given for another mode or is not an int >= 1.
    """
    if not isinstance(name, str) or name not in KNOWN_TYPES:
        raise UnknownModeError(f"unknown kvstore type {name!r}; known types: {', '.join(KNOWN_TYPES)}")
    if quorum is None:
        return _registry()[name](name)
    if not name.startswith("dist") or "async" in name:
        raise ConfigError(f"quorum={quorum!r} is for dist_sync stores (backup workers), not {name!r}")
    if type(quorum) is not int or quorum < 1:
        raise ConfigError(f"quorum={quorum!r} must be an int >= 1 (KVSTORE_SYNC_QUORUM)")
    with kvconfig.process_environ({"KVSTORE_SYNC_QUORUM": str(quorum)}):
        return _registry()[name](name)

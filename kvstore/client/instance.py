"""The one dist store per process: made by ``kvstore.create('dist_*')`` (:func:`create_dist`), closed
at interpreter exit, and released with :func:`release_process_store` (the way to leave the cluster
early, e.g. a Spark or Ray task's reused Python worker before its next job).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from kvstore import config as kvconfig
from kvstore import heap
from kvstore.base import DEVICE_TYPES
from kvstore.client.store import DistKVStore, mode_of
from kvstore.errors import ConfigError, KVStoreError, NodeLostError, StoreClosedError

log = logging.getLogger("kvstore.dist")

_instance: DistKVStore | None = None
_instance_lock = threading.Lock()


def _close_at_exit(store: DistKVStore) -> None:
    """At interpreter exit: leave the cluster, or report this worker failed if an exception killed it."""
    if os.getpid() != store._pid:
        return  # a forked child never touches its parent's sockets
    died_of = getattr(sys, "last_value", None)  # set when an unhandled exception ends the program
    failure = None if died_of is None else f"its process died of {type(died_of).__name__}: {died_of}"
    if isinstance(died_of, NodeLostError):
        failure = None  # it died of another node's loss, which is already reported: it just leaves
    try:
        store._close(failure)
    except KVStoreError as exc:
        log.error("closing the store at exit: %s", exc)


def process_store() -> DistKVStore | None:
    """This process's dist store (made by ``kvstore.create('dist_*')``), or None."""
    store = _instance
    return store if store is not None and store._pid == os.getpid() else None


def release_process_store(failure: str | None = None) -> bool:
    """Close this process's dist store, if it has one, and forget it, so the process may join another
    cluster later (a Spark task's Python worker is reused for the next job).

    ``failure``, when given, is reported to the scheduler as this worker's failure,
    which fails the other workers' waits.  Returns whether there was a store;
    raises what :meth:`DistKVStore.close` raises (the store is forgotten anyway).
    """
    global _instance
    store = process_store()
    if store is None:
        return False
    try:
        if store._closed:
            pass
        elif failure is None:
            store.close()
        else:
            store._close(failure)
    finally:
        with _instance_lock:
            if _instance is store:
                _instance = None
        atexit.unregister(_close_at_exit)
    return True


def create_dist(name: str) -> DistKVStore:
    """Return this process's dist store, joining the cluster on first use.

    A ``*_device`` name turns on GPU sums for the store it returns (the results are
    the same; only where CUDA values are summed changes).  Raises :class:`ConfigError`
    when the process already has a store of another mode, or lacks the ``DMLC_*``
    environment; :class:`StoreClosedError` when its store was closed (a process
    joins its cluster once).
    """
    global _instance
    with _instance_lock:
        if _instance is not None and os.getpid() == _instance._pid:
            if _instance._closed:
                raise StoreClosedError("this process's dist store was closed; a process joins its "
                                       "cluster once")
            if mode_of(_instance.type) != mode_of(name):
                raise ConfigError(f"this process already has a {_instance.type} store; one "
                                  f"process joins one cluster, so {name!r} cannot be created")
            if name in DEVICE_TYPES:  # asking for a device name turns GPU sums on for the shared store
                _instance._device_mode = True
            return _instance
        cfg = kvconfig.load()
        heap.tune(cfg.malloc_tune)
        store = DistKVStore(name, cfg)
        _instance = store
    atexit.register(_close_at_exit, store)
    return store

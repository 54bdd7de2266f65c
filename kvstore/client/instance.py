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
from kvstore.client.store import DistKVStore, Owner, mode_of
from kvstore.errors import ConfigError, KVStoreError, NodeLostError, StoreClosedError

log = logging.getLogger("kvstore.dist")


class _Held:
    """This process's store, the :class:`Owner` it is bound to, and the process that made it."""

    def __init__(self, store: DistKVStore, owner: Owner) -> None:
        self.store, self.owner, self.pid = store, owner, os.getpid()

    def mine(self) -> bool:
        """Whether this process made the store (a forked child never touches its parent's)."""
        return self.pid == os.getpid()


_held: _Held | None = None
_instance_lock = threading.Lock()


def _close_at_exit(held: _Held) -> None:
    """At interpreter exit: leave the cluster, or report this worker failed if an exception killed it."""
    if not held.mine():
        return  # a forked child never touches its parent's sockets
    died_of = getattr(sys, "last_value", None)  # set when an unhandled exception ends the program
    failure = None if died_of is None else f"its process died of {type(died_of).__name__}: {died_of}"
    if isinstance(died_of, NodeLostError):
        failure = None  # it died of another node's loss, which is already reported: it just leaves
    try:
        held.owner.close(failure)
    except KVStoreError as exc:
        log.error("closing the store at exit: %s", exc)


def process_store() -> DistKVStore | None:
    """This process's dist store (made by ``kvstore.create('dist_*')``), or None."""
    held = _held
    return held.store if held is not None and held.mine() else None


def release_process_store(failure: str | None = None) -> bool:
    """Close this process's dist store, if it has one, and forget it, so the process may join another
    cluster later (a Spark task's Python worker is reused for the next job).

    ``failure``, when given, is reported to the scheduler as this worker's failure,
    which fails the other workers' waits.  Returns whether there was a store;
    raises what :meth:`DistKVStore.close` raises (the store is forgotten anyway).
    """
    global _held
    held = _held
    if held is None or not held.mine():
        return False
    try:
        held.owner.close(failure)  # nothing when the store is closed already
    finally:
        with _instance_lock:
            if _held is held:
                _held = None
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
    global _held
    with _instance_lock:
        held = _held
        if held is not None and held.mine():
            try:
                held.store.check_alive()
            except StoreClosedError:
                raise StoreClosedError("this process's dist store was closed; a process joins its "
                                       "cluster once") from None
            except KVStoreError:
                pass  # a lost peer: the store is returned, and its calls raise the loss
            if mode_of(held.store.type) != mode_of(name):
                raise ConfigError(f"this process already has a {held.store.type} store; one "
                                  f"process joins one cluster, so {name!r} cannot be created")
            if name in DEVICE_TYPES:  # asking for a device name turns GPU sums on for the shared store
                held.owner.device_on()
            return held.store
        cfg = kvconfig.load()
        heap.tune(cfg.malloc_tune)
        owner = Owner()
        held = _held = _Held(DistKVStore(name, cfg, owner=owner), owner)
    atexit.register(_close_at_exit, held)
    return held.store

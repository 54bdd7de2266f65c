"""The KVStore interface and the argument handling shared by every store.

A subclass implements the ``_init``, ``_push`` (of checked ``(key, meta, values)``
groups, which it sums with ``_sum``), ``_pull`` and ``barrier`` primitives
(``_pushpull`` has a default); this class turns MXNet-style arguments (single keys
or lists, one value or a list of values per key, ``out``) into those calls and
raises user errors before anything is sent.
"""

from __future__ import annotations

import abc
import threading
import weakref
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.core import compression as C
from kvstore.core import values as V
from kvstore.core import xp
from kvstore.core.membership import Membership, check_tag
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key, check_key
from kvstore.core.worker_sets import WorkerSet, worker_set
from kvstore.errors import (
    ConfigError,
    DuplicateInitError,
    KeyNotInitializedError,
    NotAMemberError,
    StoreClosedError,
    UnsupportedError,
    public,
)
from kvstore.sparse import SparseCalls, SparseMeta

if TYPE_CHECKING:
    from kvstore.device import DeviceComm

Pushed = tuple[Key, V.Meta, list[Any]]  # a key, its meta and its pushed values, checked
DEVICE_TYPES = frozenset({"device", "local_allreduce_device", "dist_sync_device", "dist_async_device",
                          "dist_device_sync", "dist_device_async"})  # the types that sum CUDA values on a GPU


def once_each(keys: list[Any]) -> None:
    """Raise ValueError when a pushpull's list of keys names a key twice (TypeError for a bad key)."""
    if len(set(map(check_key, keys))) != len(keys):
        raise ValueError("pushpull takes each key once; sum repeated values into one list entry")


def _as_list(obj: Any) -> list[Any]:
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def known_key(key: Any, known: Container[Any]) -> Key:
    """``key`` as :func:`check_key` returns it; a plain int or str in ``known`` (keys that passed it when
    initialised) is taken as it is.  Raises KeyTypeError for a bad key."""
    if (type(key) is int or type(key) is str) and key in known:
        return key
    return check_key(key)


def group(key: Any, value: Any, known: Container[Any] = ()) -> list[tuple[Key, list[Any]]]:
    """Pair keys with their values: ``[(key, [v, ...])]`` in first-seen order, repeats merged.

    ``key`` is one key or a list; ``value`` is one value, a list of values for a
    single key, or a list (one entry per key) of values or lists of values;
    ``known`` as :func:`known_key` takes it.  Raises ValueError when the lengths do not match.
    """
    if isinstance(key, (list, tuple)):
        vals = _as_list(value)
        if len(vals) != len(key):
            raise ValueError(f"{len(key)} keys but {len(vals)} values")
        pairs = [(known_key(k, known), [v] if type(v) is np.ndarray else _as_list(v))
                 for k, v in zip(key, vals)]
    else:
        pairs = [(known_key(key, known), _as_list(value))]
    merged: dict[Key, list[Any]] = {}
    for k, vs in pairs:
        for v in vs:
            if type(v) is not np.ndarray and not V.is_value(v):
                raise TypeError(f"values of key {k!r} must be numpy arrays or torch tensors")
        if not vs:
            raise TypeError(f"values of key {k!r} must be numpy arrays or torch tensors")
        if k in merged:
            merged[k].extend(vs)
        else:
            merged[k] = vs
    return list(merged.items())


def _plain(value: Any) -> bool:
    """Whether ``value`` is a numpy array or a list of them: never a row-sparse value."""
    return type(value) is np.ndarray or (type(value) is list and all(type(v) is np.ndarray for v in value))


class LayerCalls:
    """The calls the library's own layers make on a store beyond its public API: ``collective``
    (the Trainer's states file: an action run once for all workers, its failure raised on every
    worker), ``pushpull_begin`` (the Trainer's overlap: a pushpull sent now, collected later) and
    ``agree`` (the torch layer's broadcasts: every worker's arguments compared first).
    :func:`layer_calls` gives a store's; it holds the store weakly."""

    def __init__(self, collective: Callable[[str, Callable[[], Any]], None],
                 pushpull_begin: Callable[[list, list, list, int], Callable[[bool], None]],
                 agree: Callable[[str, str], None]) -> None:
        self._collective = weakref.WeakMethod(collective)  # type: ignore[arg-type]
        self._begin = weakref.WeakMethod(pushpull_begin)  # type: ignore[arg-type]
        self._agree = weakref.WeakMethod(agree)  # type: ignore[arg-type]

    def agree(self, what: str, digest: str) -> None:
        """Meet every worker with ``digest`` (``kvstore.core.agreement.digest`` of this worker's
        arguments to the collective ``what``); raise CollectiveMismatchError on every worker when the
        digests differ.  One barrier in dist modes; nothing with one worker."""
        self._agree()(what, digest)  # type: ignore[misc]

    def collective(self, what: str, action: Callable[[], Any]) -> None:
        """Run ``action()`` once for all workers (on the leader) and raise its failure on every worker."""
        self._collective()(what, action)  # type: ignore[misc]

    def pushpull_begin(self, keys: list[Key], values: list[Any], outs: list[Any],
                       priority: int = 0) -> Callable[[bool], None]:
        """Start a pushpull of ``keys`` (one value and one out each) at ``priority``; return
        ``finish(write=True)``, which completes it (see :meth:`KVStore._pushpull_begin`)."""
        return self._begin()(keys, values, outs, priority)  # type: ignore[misc]


_LAYERS: weakref.WeakKeyDictionary[KVStore, LayerCalls] = weakref.WeakKeyDictionary()


def layer_calls(store: KVStore) -> LayerCalls:
    """``store``'s :class:`LayerCalls` (kvstore.trainer, kvstore.overlap)."""
    return _LAYERS[store]


class KVStore(abc.ABC):
    """A key-value store of arrays, with MXNet's KVStore semantics (see docs/api.md)."""

    def __init__(self, name: str) -> None:
        self._type = name
        self._meta: dict[Key, V.Meta] = {}
        self._sets: dict[Key, WorkerSet] = {}  # keys of a worker set (docs/worker-sets.md) -> the set
        self._foreign: dict[Key, WorkerSet] = {}  # keys this worker is not a member of (its init said so)
        self._lock = threading.RLock()
        self._closed = False
        self._device_mode = name in DEVICE_TYPES
        self._comm: DeviceComm | None = None  # made when a device mode meets CUDA
        self._compression: C.Spec | None = None  # set_gradient_compression's setting
        self._pushed = False  # a push or pushpull has been made (compression can no longer be set)
        # row-sparse keys (kvstore/sparse.py, docs/sparse.md)
        self._sparse = SparseCalls(self._meta, self._rows_init, self._rows_push, self._rows_pull)
        _LAYERS[self] = LayerCalls(self._collective, self._pushpull_begin, self._agree)

    # -- properties ---------------------------------------------------------------------------
    @property
    def type(self) -> str:
        """The name this store was created with (e.g. ``'dist_sync'``)."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank in ``[0, num_workers)``."""
        return 0

    @property
    def num_workers(self) -> int:
        """Number of workers in the cluster."""
        return 1

    @property
    def num_servers(self) -> int:
        """Number of servers in the cluster (0 for a local store)."""
        return 0

    @property
    def view(self) -> Membership:
        """The membership the last barrier this worker passed agreed, without asking anyone (a local
        store: itself alone).  :meth:`membership` agrees a new one."""
        return Membership(0, tuple(range(self.num_workers)), self.num_workers)

    @property
    def num_present(self) -> int:
        """The workers present as :attr:`view` says: ``num_workers`` but in an elastic job, where
        ``num_workers`` is MXNet's count of worker slots, some of them absent (docs/elastic.md)."""
        return self.view.size

    def membership(self, tag: Sequence[int] = ()) -> Membership:
        """Collective (a barrier): the workers present now, the same view on every worker, numbered by
        the barriers passed; ``tag`` (at most 8 ints) travels with it and is kept as the job's last view's
        (a worker that joins later reads it in :attr:`view`).  Raises TypeError or ValueError for a bad
        tag; in a dist store what a barrier raises, and TooFewWorkersError below ``--min-workers``."""
        ints = check_tag(tag)
        self.barrier()
        return Membership(self.view.number, self.view.ranks, self.view.slots, ints)

    def is_capable(self, capability: str) -> bool:
        """Whether the store supports ``capability``: only ``'optimizer'`` (updates run in the store)."""
        return capability == "optimizer"

    # -- MXNet methods kvstore will never have (docs/api.md#mxnet-methods-that-are-not-here) -----
    def _set_updater(self, updater: Any) -> None:
        """MXNet's worker-side update function; only local stores have one (LocalKVStore overrides
        this).  Raises :class:`UnsupportedError`."""
        raise UnsupportedError(f"_set_updater is not available on a {self._type} store: the updates run "
                               "on the servers, which take no Python functions; use "
                               "set_optimizer(kvstore.optimizer.create(...)) instead")

    def _send_command_to_servers(self, head: int, body: str) -> None:
        """MXNet's raw command channel to its servers.  Raises :class:`UnsupportedError`."""
        raise UnsupportedError("_send_command_to_servers is not supported: kvstore's servers take no raw "
                               "commands (MXNet sent a pickled optimizer this way); use set_optimizer "
                               "and set_optimizer_params instead")

    @staticmethod
    def register(klass: type) -> type:
        """MXNet 2's registry of store classes for ``create``.  Raises :class:`UnsupportedError`."""
        raise UnsupportedError("KVStore.register is not supported: kvstore.create() makes only the types "
                               "in kvstore.KNOWN_TYPES; construct your KVStore subclass directly instead")

    # -- primitives ---------------------------------------------------------------------------
    @abc.abstractmethod
    def _init(self, items: list[tuple[Key, np.ndarray]], members: WorkerSet | None = None) -> None: ...

    def _init_value(self, value: Any) -> np.ndarray:
        """A key's initial value as :meth:`_init` takes it: a C-contiguous numpy copy, which the store
        may keep."""
        return xp.to_numpy(value)

    @abc.abstractmethod
    def _push(self, groups: list[Pushed], priority: int) -> None:
        """Sum (:meth:`_sum`) and push each checked ``(key, meta, values)`` group."""

    @abc.abstractmethod
    def _pull(self, keys: list[Key], priority: int, outs: list[list[Any]] | None = None) -> list[Any]:
        """The values of ``keys``; a store may write a key's value straight into its ``outs`` entry
        (checked, one per key) and give None for that key."""

    def _pushpull(self, groups: list[Pushed], priority: int,
                  outs: list[list[Any]] | None = None) -> list[Any]:
        self._push(groups, priority)
        return self._pull([k for k, _, _ in groups], priority, outs)

    def _pushpull_begin(self, keys: list[Key], values: list[Any], outs: list[Any],
                        priority: int = 0) -> Callable[[bool], None]:
        """Start a pushpull of ``keys`` (one value and one out each) at ``priority``; return
        ``finish(write=True)``, which completes it (``write=False``: its result is not wanted).  Here
        all of it runs in ``finish``; a dist store sends at once.  Part of the store's API for the
        library's own layers: the Trainer's overlap calls it through :func:`layer_calls`."""
        once_each(keys)

        def finish(write: bool = True) -> None:
            if write:
                self.pushpull(keys, values, out=outs, priority=priority)
        return finish

    def _agree(self, what: str, digest: str) -> None:
        """:meth:`LayerCalls.agree`: one worker always agrees with itself; a dist store compares."""
        return None

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every worker has called ``barrier``."""

    @public
    def _barrier(self) -> None:
        """MXNet's name for :meth:`barrier`."""
        self.barrier()

    @abc.abstractmethod
    def _set_optimizer(self, optimizer: Optimizer) -> None: ...

    @abc.abstractmethod
    def _set_optimizer_params(self, params: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def _save_states(self, fname: str, dump_optimizer: bool, collective: bool = True) -> None: ...

    @abc.abstractmethod
    def _load_states(self, fname: str) -> None: ...

    @abc.abstractmethod
    def _save_checkpoint(self, directory: str) -> None: ...

    def _collective(self, what: str, action: Callable[[], Any]) -> None:
        """Run ``action()`` once for all workers (on rank 0) and raise its failure on every worker.

        In one process that is just ``action()``; the dist store adds the barrier.  Part of the store's
        API for the library's own layers: the Trainer calls it through :func:`layer_calls`.
        """
        action()

    @abc.abstractmethod
    def get_optimizer(self) -> Optimizer | None:
        """The optimizer in effect, or None (in dist modes: a copy of the servers', without state)."""

    def close(self) -> None:
        """Release the store's resources; later calls raise :class:`StoreClosedError`."""
        self._closed = True

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the {self._type} store is closed")

    def _meta_of(self, key: Key) -> V.Meta:
        try:
            return self._meta[key]
        except KeyError:
            if key in self._foreign:
                raise self._not_member(key, self._foreign[key], "push or pull") from None
            if key in self._sparse.metas:
                raise TypeError(f"key {key!r} is row_sparse: push row-sparse values to it and read it with "
                                "row_sparse_pull (or pull, below kvstore.sparse.WHOLE_PULL_BYTES)") from None
            raise KeyNotInitializedError(f"key {key!r} has not been initialised; call "
                                         "kv.init(key, value) on every worker first") from None

    @public
    def init(self, key: Any, value: Any = None, stype: str = "default", shape: Any = None, dtype: Any = None,
             init: Any = None, dynamic: Any = None, width: Any = None, workers: Any = None) -> None:
        """Initialise one key or a list of keys (collective in dist modes: every worker calls it).

        Only rank 0's value is stored.  ``stype='row_sparse'``, or no value with ``shape``, ``dtype``
        and ``init`` (``'zeros'``, ``'uniform'``, ``'normal'``), makes row-sparse tables
        (docs/sparse.md); ``dynamic=True`` (or a dict: capacity, policy, admit_after, ttl) with ``width``
        makes dynamic tables, whose ids are any 64-bit value (docs/sparse.md, "Dynamic tables").
        ``workers`` (worker ranks or a :class:`WorkerSet`) makes the keys a worker set's
        (docs/worker-sets.md): only its members call init (the lowest present member's value is
        stored), push and pull them, and a dist_sync round sums the members' pushes.
        Raises :class:`DuplicateInitError` for a key that exists, :class:`KeyTypeError` for a bad key,
        TypeError for a bad value, :class:`NotAMemberError` on a worker outside ``workers``,
        :class:`ConfigError` for a worker set of row-sparse keys (or under a quorum or staleness bound).
        """
        self._check_open()
        members = worker_set(workers, self.num_workers)
        if members is not None and (self._sparse.wants_init(value, stype, dynamic) or stype != "default"):
            raise ConfigError("worker sets hold dense keys only: a row-sparse or dynamic table belongs to "
                              "every worker (init it without workers=)")
        if self._sparse.wants_init(value, stype, dynamic):
            self._sparse.init(key, value, stype, shape, dtype, init, dynamic, width)
            return
        pairs = group(key, value)
        if members is not None and self.rank not in members:
            with self._lock:
                for k, _ in pairs:
                    self._foreign[k] = members
            raise self._not_member(pairs[0][0], members, "init")
        with self._lock:
            for k, _ in pairs:
                if k in self._meta or k in self._sparse.metas:
                    raise DuplicateInitError(f"key {k!r} is already initialised")
        metas = {k: V.meta_of(vs[0]) for k, vs in pairs}
        items = [(k, self._init_value(vs[0])) for k, vs in pairs]
        self._init(items, members)  # not under the lock: in dist modes it waits for every worker
        with self._lock:
            self._meta.update(metas)
            if members is not None:
                self._sets.update(dict.fromkeys(metas, members))
        self._initialised(list(metas))

    def _not_member(self, key: Key, members: WorkerSet, what: str) -> NotAMemberError:
        """The error refusing this worker's ``what`` of ``key``, a key of the worker set ``members``."""
        return NotAMemberError(f"worker {self.rank} is not in worker set {members} of key {key!r}: only "
                               f"its members may {what} it (docs/worker-sets.md)")

    def _initialised(self, keys: list[Key]) -> None:
        """Called after ``keys`` were initialised (a dist store restores their snapshot state)."""
        return None

    def _device(self) -> DeviceComm:
        """This store's :class:`kvstore.device.DeviceComm`, made on first use (device modes only)."""
        with self._lock:
            if self._comm is None:
                from kvstore.device import DeviceComm

                self._comm = DeviceComm()
            return self._comm

    def _groups(self, key: Any, value: Any) -> list[Pushed]:
        """Each key with its meta and values, every value checked (nothing summed yet); the caller has
        checked that the store is open."""
        out = []
        for k, vs in group(key, value, self._meta):
            meta = self._meta_of(k)
            for v in vs:
                if not (type(v) is np.ndarray and v.shape == meta.shape and v.dtype == meta.dtype):
                    V.check(k, meta, v, "pushed value")
            out.append((k, meta, vs))
        return out

    def _sum(self, key: Key, meta: V.Meta, values: list[Any], out: np.ndarray | None = None,
             host: bool = False) -> Any:
        """The sum of one key's checked values: numpy (written into ``out`` when given), or in a device
        mode with CUDA values a tensor on the key's merge GPU (with ``host``: copied to pinned numpy)."""
        if self._device_mode and any(xp.is_cuda(v) for v in values):
            total = self._device().reduce(key, meta, values)
            return self._device().to_host(total) if host else total
        return V.summed(key, meta, values, out=out)

    @public
    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Push values; a list of values for one key is summed first.  Returns without waiting.

        The pushed values are never written to.  Raises on a user error before
        anything is sent; a failure on the server is raised by a later call.
        """
        self._check_open()
        groups = self._push_args(key, value)
        if groups is not None:
            self._push(groups, priority)

    def _push_args(self, key: Any, value: Any) -> list[Pushed] | None:
        """A push's checked groups (the store marked as pushed); None when it was a row-sparse push,
        which is sent already.  The caller has checked that the store is open."""
        if not (not self._sparse.metas and _plain(value)) and self._sparse.handles_push(key, value):
            self._sparse.push(key, value)
            return None
        groups = self._groups(key, value)
        self._pushed = True
        return groups

    def _outs(self, keys: list[Key], out: Any, single: bool) -> list[list[Any]]:
        outs = ([_as_list(out)] if single else
                [[o] if type(o) is np.ndarray else _as_list(o) for o in _as_list(out)])
        if len(outs) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(outs)} outs")
        for k, targets in zip(keys, outs):
            for o in targets:
                V.check_out(k, self._meta_of(k), o)
        return outs

    def _deliver(self, keys: list[Key], arrays: list[Any], outs: list[list[Any]] | None,
                 single: bool) -> Any:
        if outs is None:
            results = [V.new_value(self._meta[k], a) for k, a in zip(keys, arrays)]
            return results[0] if single else results
        for targets, array in zip(outs, arrays):
            if array is None:
                continue  # written into its out already
            if self._device_mode and any(xp.is_cuda(o) for o in targets):
                self._device().deliver(array, targets)
            else:
                for o in targets:
                    V.write(o, array)
        return None

    @public
    def pull(self, key: Any, out: Any = None, priority: int = 0) -> Any:
        """Pull the current value of one key or a list of keys.

        With ``out`` (per key: an array/tensor, or a list of them that each get a
        copy) the values are written in place and ``out`` is returned; without
        it, new arrays are returned (tensors for keys initialised with tensors).
        Waits for this worker's earlier pushes to those keys (read-your-writes).
        """
        self._check_open()
        single = not isinstance(key, (list, tuple))
        keys = [known_key(k, self._meta) for k in _as_list(key)]
        if self._sparse.owns(keys):
            return self._sparse.pull_whole(key, out)
        outs = self._pull_outs(keys, out, single)
        result = self._deliver(keys, self._pull(keys, priority, outs), outs, single)
        return result if out is None else out

    def _pull_outs(self, keys: list[Key], out: Any, single: bool) -> list[list[Any]] | None:
        """A pull's checked outs (None without ``out``); raises for a key not initialised, or a bad out."""
        for k in keys:
            self._meta_of(k)
        return None if out is None else self._outs(keys, out, single)

    @public
    def row_sparse_pull(self, key: Any, out: Any = None, priority: int = 0, row_ids: Any = None,
                        admit: bool = False) -> Any:
        """Pull the rows ``row_ids`` of row-sparse keys (MXNet's semantics, docs/sparse.md): ids unsorted
        and repeated as you like, one array or one per out; a dense ``out`` gets those rows and zeros
        elsewhere; without ``out`` a :class:`kvstore.RowSparse` of the distinct ids is returned.
        A dynamic table answers ids it does not hold with their initial rows, stored only with ``admit``.
        Raises ShapeMismatchError for an id out of range, TypeError for a dense key."""
        self._check_open()
        return self._sparse.row_sparse_pull(key, out, row_ids, admit)

    def _rows_init(self, items: list[tuple]) -> None:
        raise UnsupportedError(f"row_sparse keys are not supported by a {self._type} store")

    def _rows_push(self, items: list[tuple]) -> None:
        raise UnsupportedError(f"row_sparse keys are not supported by a {self._type} store")

    def _rows_pull(self, key: Key, meta: SparseMeta, ids: np.ndarray, admit: bool = False) -> np.ndarray:
        raise UnsupportedError(f"row_sparse keys are not supported by a {self._type} store")

    @public
    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> Any:
        """Push ``value`` then pull the result in one round trip; return what was written.

        Without ``out`` the result is written back into ``value`` in place.
        """
        single = not isinstance(key, (list, tuple))
        if not single:
            once_each(key)
        self._check_open()
        target = value if out is None else out
        groups, keys, outs = self._pushpull_args(key, value, target, single)
        self._deliver(keys, self._pushpull(groups, priority, outs), outs, single)
        return target

    def _pushpull_args(self, key: Any, value: Any, target: Any,
                       single: bool) -> tuple[list[Pushed], list[Key], list[list[Any]]]:
        """An open store's pushpull: its checked groups, their keys, and the outs of ``target`` per key
        (the store marked as pushed).  Raises what pushpull raises for bad values or outs."""
        groups = self._groups(key, value)
        keys = [k for k, _, _ in groups]
        outs = self._outs(keys, target, single)
        self._pushed = True
        return groups, keys, outs

    @public
    def set_gradient_compression(self, compression_params: dict[str, Any]) -> None:
        """Compress pushed gradients: ``{'type': '2bit' | '1bit' | 'fp16' | 'bf16', 'threshold': 0.5}``
        (docs/compression.md).  Collective in dist modes; only before the first push; raises
        :class:`UnsupportedError` on ``local``, TypeError / ValueError for bad parameters."""
        self._check_open()
        self._set_compression(compression_params)

    @public
    def get_gradient_compression(self) -> dict[str, Any] | None:
        """The compression parameters in effect, or None."""
        spec = self._compression
        return None if spec is None else spec.params()

    def _set_compression(self, params: Any) -> None:
        """Check and install ``params`` (the dist store makes it collective)."""
        self._compression = self._check_compression(params)

    def _check_compression(self, params: Any) -> C.Spec:
        """The checked setting of ``params``; raises when this store cannot take it now."""
        if "device" not in self._type and "dist" not in self._type:
            raise UnsupportedError(f"gradient compression is not supported for a {self._type} store "
                                   "(MXNet's rule): use 'device' or a dist type")
        spec = C.parse(params)
        if self._pushed:
            raise ConfigError("set_gradient_compression must be called before the first push of any "
                              f"key; this {self._type} store has pushed already")
        return spec

    @public
    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Apply every later push through ``optimizer`` (collective in dist modes, like ``init``).

        In dist modes every worker calls it; pushes made before it are applied
        without it, pushes made after it with it, and rank 0 ships it to every
        server as a (name, params) spec (never pickled).  A second call
        replaces the optimizer and drops its state.  Raises TypeError for
        anything but a :class:`kvstore.optimizer.Optimizer`.
        """
        self._check_open()
        if not isinstance(optimizer, Optimizer):
            raise TypeError("set_optimizer takes an optimizer from kvstore.optimizer.create, not "
                            f"{type(optimizer).__name__}")
        self._set_optimizer(optimizer)

    @public
    def set_optimizer_params(self, **params: Any) -> None:
        """Change hyper-parameters of the optimizer in effect, keeping its state.

        Accepts ``learning_rate``, ``wd``, ``rescale_grad``, ``clip_gradient``,
        ``lr_mult`` and ``wd_mult``.  In dist modes the change is sent to every
        server and is in effect there for every update made after this call
        returns; it is not collective (any worker may call it).  Raises
        :class:`OptimizerError` without an optimizer or for a bad value.
        """
        self._check_open()
        self._set_optimizer_params(params)

    @public
    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False, *,
                              collective: bool = True) -> None:
        """Write the optimizer's state of every key to ``fname`` (docs/formats.md).

        Collective in dist modes: every worker calls it, the states are
        gathered whole from every server and rank 0 writes the file.  With
        ``collective=False`` only this worker calls it: it gathers the states
        the servers hold now and writes the file itself, with no barrier (in
        ``dist_sync``, between two of its steps, every key's state is at the
        last round it pushed to).  With ``dump_optimizer`` the optimizer's spec
        is saved too.  Raises :class:`OptimizerError` when no optimizer is set.
        """
        self._check_open()
        self._save_states(str(fname), dump_optimizer, collective)

    @public
    def load_optimizer_states(self, fname: str) -> None:
        """Restore the states saved by :meth:`save_optimizer_states` (and the optimizer, if dumped).

        Collective in dist modes: rank 0 reads the file and scatters the states
        to the servers, however many there are now.  Keys without state in the
        file start afresh.  Everything is checked before anything changes:
        raises :class:`FormatError` for a damaged file, :class:`OptimizerError`
        when the states do not fit the optimizer (or none is set and the file
        has none), a key, shape or dtype error when they do not fit the keys.
        """
        self._check_open()
        self._load_states(str(fname))

    @public
    def save_checkpoint(self, directory: str) -> None:
        """Snapshot every key's value and the optimizer's state into ``directory``.

        Collective in dist modes: every worker calls it; it waits until every worker's pushes are
        applied (no round is open), then rank 0 gathers the values and states from the servers and
        writes a new generation (docs/failures.md).  A crash while writing leaves the previous
        generation in effect.  ``launch.py --resume directory`` starts a cluster from it.  Raises
        OSError from the file system (on every worker in dist modes).
        """
        self._check_open()
        self._save_checkpoint(str(directory))

    @public
    def broadcast(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> Any:
        """Initialise ``key`` with rank 0's ``value``, then pull it (into ``out`` if given)."""
        self.init(key, value)
        return self.pull(key, out=out, priority=priority)

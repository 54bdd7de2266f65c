"""A gluon-like Trainer over torch parameters: data-parallel steps through a KVStore::

    trainer = Trainer(model.named_parameters(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    loss_fn(model(x), y).backward()     # loss SUMMED over the batch
    trainer.step(len(x))                # rescale_grad = 1 / batch_size, as in gluon

Each trainable parameter is one key, ``f"{key_prefix}/{name or index}"``.  Gradients
are summed over the workers (never divided by ``num_workers``): in ``dist_sync``
pass the global batch size to :meth:`Trainer.step`.

**Collective calls.**  In dist modes the Trainer's first use (``step``,
``allreduce_grads``, ``update``, ``save_states`` or ``load_states``) initialises
the keys with rank 0's weights and copies them into every worker's parameters,
and ``save_states``/``load_states`` are collective too: every worker must create
its Trainers in the same order (the default key prefix counts them) and make the
same calls in the same order.  The servers hold one optimizer for all keys, so
Trainers sharing a dist store must not mix update_on_kvstore True and False.

**Several devices.**  ``params`` may be a list of parameter collections, one per
device (model replicas with the same names, shapes and dtypes, e.g. copies of one
model on ``cuda:0`` and ``cuda:1``).  Each step sums every replica's gradient (on a
GPU in the device modes) and every replica ends the step with the same weights:
with update_on_kvstore the store's result is copied to each replica; without it
the summed gradient is copied to each replica and each updates its own weights
with its own optimizer state (MXNet's one updater per device); saved states are
the first replica's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, overload

from kvstore import config as kvconfig
from kvstore.base import KVStore, layer_calls
from kvstore.client.meter import HistogramRecorder, trainer_step
from kvstore.core import checkpoint, storage, xp
from kvstore.core import optimizer as kvoptimizer
from kvstore.core.dtypes import BY_NAME, dtype_name
from kvstore.core.optimizer import Optimizer
from kvstore.errors import ConfigError
from kvstore.overlap import DEFAULT_BUCKET_BYTES, Overlap
from kvstore.pipeline.pipe import trainer_args
from kvstore.stores import create

Tensor = Any  # a torch.Tensor; torch is not imported when this module loads
_trainers = itertools.count()


def resolve_update_on_kvstore(requested: bool | None, store_type: str,
                              environ: Mapping[str, str] | None = None) -> bool:
    """Whether updates run in the store (MXNet's rule) for a store of type ``store_type``.

    An explicit True/False is honoured, except False with an async store, which
    raises ValueError (its updates can only run on the servers).  None means True
    for async stores, ``KVSTORE_UPDATE_ON_KVSTORE`` (else ``MXNET_UPDATE_ON_KVSTORE``,
    default 1) for the other dist stores, and False for local stores.
    """
    if "async" in store_type:
        if requested is False:
            raise ValueError(f"update_on_kvstore=False is not supported with a {store_type!r} store: "
                             "asynchronous updates run on the servers")
        return True
    if requested is not None:
        return bool(requested)
    if store_type.startswith("dist"):
        return kvconfig.load(environ).update_on_kvstore
    return False


def _is_pair(item: Any, torch: Any) -> bool:
    return (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and torch is not None and isinstance(item[1], torch.Tensor))


def _replica_sets(params: Any) -> list[list[tuple[str, Tensor]]]:
    """One ``[(name, tensor)]`` list per device: several for a list of collections, else one.

    Raises TypeError for bad params, ValueError for replicas that do not match the first.
    """
    torch = sys.modules.get("torch")
    if isinstance(params, (list, tuple)) and params and not any(
            (torch is not None and isinstance(p, torch.Tensor)) or _is_pair(p, torch) for p in params):
        sets = [_named_params(p) for p in params]
    else:
        return [_named_params(params)]
    first = sets[0]
    for i, other in enumerate(sets[1:], 1):
        if [n for n, _ in other] != [n for n, _ in first]:
            raise ValueError(f"replica {i} has parameters {[n for n, _ in other][:5]}..., replica 0 "
                             f"{[n for n, _ in first][:5]}...: replicas must have the same names in order")
        for (name, a), (_, b) in zip(first, other):
            if a.shape != b.shape or a.dtype != b.dtype or a.requires_grad != b.requires_grad:
                raise ValueError(f"parameter {name!r} of replica {i} is {b.dtype}{tuple(b.shape)}, in "
                                 f"replica 0 {a.dtype}{tuple(a.shape)}: replicas must match")
    return sets


def _named_params(params: Any) -> list[tuple[str, Tensor]]:
    """(name, tensor) pairs from tensors (named by index), (name, tensor) pairs or a dict."""
    torch = sys.modules.get("torch")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    named = []
    for i, item in enumerate(items):
        if torch is not None and isinstance(item, torch.Tensor):
            named.append((str(i), item))
        elif _is_pair(item, torch):
            named.append(item)
        else:
            raise TypeError("params must be torch tensors, (name, tensor) pairs or a dict name -> tensor; "
                            f"got {type(item).__name__} at position {i}")
    return named


def next_key_prefix() -> str:
    """The next default key prefix, ``f"trainer{i}"``: i counts the Trainers (and SparseTrainers
    without dense parameters) made without a key_prefix in this process."""
    return f"trainer{next(_trainers)}"


class ServerRescale:
    """The ``rescale_grad`` of a dist store's servers when they run the optimizer, and each step's
    gradient factor against it (the Trainer's and the SparseTrainer's one rule, docs/trainer.md).

    The servers keep one value, agreed at the first step (rank 0's, in a collective), whatever the
    batch size later; a step of another batch size multiplies the gradients it pushes by its own
    rescale over the servers' (exact: the rescale multiplies the gradient first).  Sending each change
    to the servers instead would apply it to every push around it (in dist_async one worker's last
    batch of 1 sample made another's full batches 32 times too big)."""

    def __init__(self, kv: KVStore) -> None:
        self.kv = kv
        self.agreed: float | None = None  # the servers' rescale_grad once agreed

    def factor(self, rescale: float) -> float:
        """What a step whose rescale is ``rescale`` multiplies its gradients by (the first call, on every
        worker at once, agrees on the servers' value; a restarted or joined worker's reads the value the
        others agreed on long ago, unless it joined before the job's first step: ``joined_at_start``).
        Raises what the collective raises."""
        if self.agreed is None:
            kv = self.kv  # a restarted or joined worker: the others agreed (not yet, for one in at the start)
            if getattr(kv, "rejoined_at", None) is None or getattr(kv, "joined_at_start", False):
                layer_calls(self.kv).collective("the servers' rescale_grad",
                                                lambda: self.kv.set_optimizer_params(rescale_grad=rescale))
            servers = self.kv.get_optimizer()
            self.agreed = rescale if servers is None else float(servers.rescale_grad)
        return rescale / self.agreed

    def reset(self) -> None:
        """The servers' optimizer was replaced (loaded states): agree again at the next step."""
        self.agreed = None


CALL_BYTES = 64 << 20  # the most parameter bytes of one step's pushpull call (Trainer._pushpull)


class Trainer:
    """Applies an optimizer to torch parameters, with gradients summed through a KVStore.

    ``params``: an iterable of tensors (keys named by position), of (name, tensor)
    pairs (``model.named_parameters()``) or a dict name -> tensor; tensors that do
    not require grad are skipped.  A list of such collections, one per device,
    trains model replicas (see the module's docstring).  ``optimizer``: a name with ``optimizer_params``,
    or an :class:`Optimizer` (then ``optimizer_params`` must be None);
    ``optimizer_params['rescale_grad']`` is the Trainer's scale (default 1.0).
    ``kvstore``: a store, a mode name, or None ('dist_sync' under the launcher,
    else 'local').  ``update_on_kvstore``: see :func:`resolve_update_on_kvstore`.
    ``key_prefix``: defaults to ``f"trainer{i}"``, i counting (from 0) the Trainers
    made without one in this process; pass the same prefix to load states saved by
    a Trainer that was made in another order.  ``compression_params``: gluon's (``set_gradient_compression``).
    ``overlap``: push gradients during backward, in buckets of ``bucket_bytes`` (:mod:`kvstore.overlap`);
    None (the default) means on for a dist store with update_on_kvstore=False and one replica.
    ``extra_weights``: with update_on_kvstore=False, the weights (key -> numpy array) of keys outside
    ``params`` that this Trainer's optimizer also updates (a SparseTrainer's tables): their states are
    saved and loaded with the Trainer's.  ``workers``: the worker set of this Trainer's keys (docs/api.md,
    "Worker sets"), or a mapping from each parameter's name to its key's set: only those workers make and
    step it, and its rounds wait for them alone; a Pipeline as ``params`` gives its stage's replicas (and
    for a tied module's parameters every stage holding it).
    Raises ValueError when no parameter requires grad, for a tensor given twice, for replicas that do
    not match, for ``optimizer_params`` with an Optimizer, for update_on_kvstore=False with an async
    store; TypeError for bad ``params``.
    """

    def __init__(self, params: Iterable[Any] | Mapping[str, Any], optimizer: str | Optimizer,
                 optimizer_params: Mapping[str, Any] | None = None, kvstore: KVStore | str | None = None,
                 update_on_kvstore: bool | None = None, key_prefix: str | None = None,
                 compression_params: Mapping[str, Any] | None = None, overlap: bool | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 extra_weights: Callable[[], Mapping[str, Any]] | None = None,
                 workers: Iterable[int] | Mapping[str, Iterable[int]] | None = None) -> None:
        # a Pipeline as params: docs/pipeline.md
        params, kvstore, overlap, workers = trainer_args(params, kvstore, overlap, workers)
        replicas = [[(n, p) for n, p in named if p.requires_grad] for named in _replica_sets(params)]
        named = replicas[0]
        if not named:
            raise ValueError("no parameter requires grad: nothing to train")
        seen: dict[int, str] = {}
        for r, replica in enumerate(replicas):
            for name, p in replica:
                label = name if len(replicas) == 1 else f"{name} of replica {r}"
                if id(p) in seen:
                    raise ValueError(f"parameter {label!r} is the same tensor as {seen[id(p)]!r}; "
                                     "pass each once")
                seen[id(p)] = label
        if len({n for n, _ in named}) != len(named):
            raise ValueError("parameter names must be unique")
        if isinstance(optimizer, Optimizer):
            if optimizer_params is not None:
                raise ValueError("optimizer_params must be None when optimizer is an Optimizer object; "
                                 "set its parameters when creating it")
            self._optimizer, self._scale = optimizer, float(optimizer.rescale_grad)
        else:
            opt_params = dict(optimizer_params or {})
            self._scale = float(opt_params.get("rescale_grad", 1.0))
            self._optimizer = kvoptimizer.create(optimizer, **opt_params)
        if kvstore is None:
            kvstore = "dist_sync" if kvconfig.in_cluster() else "local"
        store_type = kvstore if isinstance(kvstore, str) else kvstore.type
        self._update_on_kvstore = resolve_update_on_kvstore(update_on_kvstore, store_type)
        self._kv = create(kvstore) if isinstance(kvstore, str) else kvstore
        prefix = next_key_prefix() if key_prefix is None else key_prefix
        self._prefix, self._names = prefix, [name for name, _ in named]
        self._stable = [f"{prefix}/{name}" for name in self._names]  # the keys' names in state files
        self._keys = list(self._stable)  # the store's keys: new ones after weights were loaded
        self._generation = 0  # how many times loaded weights replaced the store's (see _reload)
        self._versions: list[list[int]] = []  # [device][parameter] tensor versions the store last set
        self._steps_since_reload = 0  # steps since the last _reload (a reload at each step is warned of)
        self._params = [p for _, p in named]
        self._replicas = [[p for _, p in replica] for replica in replicas]  # [device][parameter]
        self._histograms = HistogramRecorder.from_env(self._names, self._params)  # KVSTORE_HISTOGRAM_EVERY
        # Per-device optimizer state for replicas 1.. (states, counts), swapped in by _update.
        self._replica_states: list[tuple[dict, dict]] = [({}, {}) for _ in replicas[1:]]
        self._initialized = False
        self._rescales = ServerRescale(self._kv)  # servers' rescale_grad (dist, update_on_kvstore)
        self._compression_params = None if compression_params is None else dict(compression_params)
        self._warned: set[str] = set()
        self._shares = itertools.count()  # numbers the state_dict broadcasts (their keys)
        if overlap is None:
            overlap = self._kv.type.startswith("dist") and not self._update_on_kvstore and len(replicas) == 1
        self._bucket_bytes = bucket_bytes
        self._extra_weights = extra_weights
        self._workers = _worker_sets(workers, self._names)  # each key's worker set (None: all workers)
        self._overlap = Overlap(self._kv, self._keys, self._params, self._update_on_kvstore,
                                bucket_bytes) if overlap and len(replicas) == 1 else None

    def close(self) -> None:
        """Remove the overlap's hooks (the store stays open), collecting what they sent since a step."""
        if self._overlap is not None:
            self._overlap.close()

    def no_sync(self) -> Any:
        """A context in which backward only accumulates gradients (DDP's ``no_sync``): nothing is pushed
        until the backward after it.  Needed for accumulation only with update_on_kvstore and overlap."""
        return self._overlap.no_sync() if self._overlap is not None else contextlib.nullcontext()

    # -- properties ---------------------------------------------------------------------------
    @property
    def optimizer(self) -> Optimizer:
        """This Trainer's optimizer (with update_on_kvstore in dist modes: without the servers' state)."""
        return self._optimizer

    @property
    def kvstore(self) -> KVStore:
        """The store the gradients go through."""
        return self._kv

    @property
    def update_on_kvstore(self) -> bool:
        """Whether the optimizer runs in the store (servers) rather than in this process."""
        return self._update_on_kvstore

    def named_parameters(self) -> list[tuple[str, Tensor]]:
        """The trainable parameters by name (the first replica's), in parameter order: what a
        checkpoint of the model holds (``kvstore.Session`` saves and loads them)."""
        return list(zip(self._names, self._params))

    @property
    def keys(self) -> list[str]:
        """The store keys, one per trainable parameter, in parameter order."""
        return list(self._keys)

    @property
    def key_prefix(self) -> str:
        """The prefix of this Trainer's keys (``key_prefix``, or the ``trainer{i}`` it was given)."""
        return self._prefix

    @property
    def learning_rate(self) -> float:
        """The current learning rate (asked of the store when it runs the optimizer)."""
        if self._update_on_kvstore and self._initialized:
            remote = self._kv.get_optimizer()
            if remote is not None:
                return remote.learning_rate
        return self._optimizer.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate here and, with update_on_kvstore, in the store.

        Raises :class:`OptimizerError` when the optimizer has an lr_scheduler.
        """
        self._optimizer.set_learning_rate(lr)
        if self._update_on_kvstore and self._initialized:
            self._kv.set_optimizer_params(learning_rate=lr)

    def init_kvstore(self) -> None:
        """Do the first use's work now (collective; later calls do nothing).

        Stores rank 0's weights (under ``launch.py --resume``: the snapshot's), copies them
        into every worker's parameters (every replica), and with update_on_kvstore sets the
        optimizer in the store (under ``--resume`` with the snapshot's state).  Call it before
        the first forward pass when the weights must come from the store, as after a resume.
        """
        self._init_kvstore()

    # -- internals ----------------------------------------------------------------------------
    def _init_kvstore(self) -> None:
        """Collective: store rank 0's weights, copy them into every worker, set the optimizer; later,
        with update_on_kvstore, store the weights again when they were loaded since (:meth:`_reload`)."""
        if self._initialized:
            if self._update_on_kvstore and self._weights_loaded():
                self._reload()
            return
        if self._compression_params:  # gluon's compression_params (docs/compression.md)
            self._kv.set_gradient_compression(self._compression_params)
        self._init_keys()
        self._pull_weights()
        if self._update_on_kvstore:
            self._kv.set_optimizer(self._optimizer)
        self._initialized = True
        self._mark_weights()

    def _init_keys(self) -> None:
        """Collective over the keys' workers: make the keys with the lowest one's weights, a call per
        run (:meth:`_runs`)."""
        if self._workers is None:
            for run in self._runs():
                self._kv.init(self._keys[run], self._params[run])
            return
        groups: dict[tuple[int, ...], list[int]] = {}
        for index, members in enumerate(self._workers):
            groups.setdefault(members, []).append(index)
        # Every worker inits its sets in one global order (a set's members each make the same calls):
        # no two workers wait for each other in opposite orders.
        for members in sorted(groups):  # and each set's keys by name: its members list them alike
            for run in self._runs(sorted(groups[members], key=self._keys.__getitem__)):
                self._kv.init([self._keys[i] for i in run], [self._params[i] for i in run],
                              workers=list(members))

    def _mark_weights(self) -> None:
        """Remember the parameters' versions now that the store has set their weights."""
        self._versions = [[p._version for p in replica] for replica in self._replicas]  # noqa: SLF001

    def _weights_loaded(self) -> bool:
        """Whether something outside the Trainer wrote a parameter in place since the store last set it
        (``load_state_dict``, ``copy_`` under no_grad: torch counts in-place writes per tensor)."""
        return any(p._version != seen for replica, versions in zip(self._replicas, self._versions)  # noqa: SLF001
                   for p, seen in zip(replica, versions))

    def _reload(self) -> None:
        """Collective: the weights were loaded into the model: store rank 0's under new keys (the
        store keeps a key's first value; MXNet resets its store) and copy them into every worker.
        The optimizer's state starts afresh for them, as in MXNet; state files keep the first names."""
        if self._generation and self._steps_since_reload <= 1 and "reload" not in self._warned:
            self._warned.add("reload")
            written = [n for n, p, seen in zip(self._names, self._params, self._versions[0])
                       if p._version != seen]  # noqa: SLF001
            warnings.warn(f"parameter(s) {written[:4]} were written in place between consecutive steps "
                          "(nn.Embedding(max_norm=...), clamping, ...): with update_on_kvstore each such "
                          "write is a load of new weights, which re-creates the keys (their optimizer "
                          "state restarts; the servers keep every earlier copy); use "
                          "update_on_kvstore=False for a model that writes its own weights",
                          RuntimeWarning, stacklevel=4)
        self._steps_since_reload = 0
        self._generation += 1
        self._keys = [f"{self._prefix}@{self._generation}/{name}" for name in self._names]
        self._init_keys()
        self._pull_weights()
        if self._overlap is not None:  # its hooks push to the keys: new ones from now on
            self._overlap.close()
            self._overlap = Overlap(self._kv, self._keys, self._params, self._update_on_kvstore,
                                    self._bucket_bytes)
        self._mark_weights()

    def _set_rescale(self, batch_size: float) -> None:
        """gluon's rule: rescale_grad = scale / batch_size, set when it changes; sent to a local store,
        not to servers, which keep an agreed one (see :meth:`gradient_factor`)."""
        if not batch_size > 0:
            raise ValueError(f"batch_size must be positive, got {batch_size!r}")
        rescale = self._scale / batch_size
        if rescale == self._optimizer.rescale_grad or (self._initialized and self._servers_keep_rescale()):
            return  # servers keep theirs: gradient_factor
        self._optimizer.rescale_grad = rescale
        if self._update_on_kvstore and self._initialized:
            self._kv.set_optimizer_params(rescale_grad=rescale)

    def _servers_keep_rescale(self) -> bool:
        """Whether servers run the optimizer with the rescale_grad of the first use whatever the batch
        size (a dist store with update_on_kvstore, without the overlap, whose hooks push before the
        batch size is known: docs/trainer.md)."""
        return self._update_on_kvstore and self._overlap is None and self._kv.type.startswith("dist")

    def gradient_factor(self, batch_size: float) -> float:
        """What a step of ``batch_size`` multiplies the gradients it pushes by: 1.0, but where servers
        run the optimizer of a dist store (without the overlap), its rescale over theirs
        (:class:`ServerRescale`; the first call after the first use agrees on theirs, on every worker
        at once).  A SparseTrainer scales its rows by it.  Raises ValueError for a batch_size <= 0."""
        if not batch_size > 0:
            raise ValueError(f"batch_size must be positive, got {batch_size!r}")
        if not (self._initialized and self._servers_keep_rescale()):
            return 1.0
        return self._rescales.factor(self._scale / batch_size)

    @overload
    def _runs(self) -> list[slice]: ...
    @overload
    def _runs(self, among: list[int]) -> list[list[int]]: ...

    def _runs(self, among: list[int] | None = None) -> list[slice] | list[list[int]]:
        """The keys in runs of consecutive keys of at most ``CALL_BYTES`` of parameters each (a bigger key
        alone): one store call per run keeps what is in flight at once, and so the transport's buffers
        (shared memory segments, received frames), bounded for a model of any size; a model smaller than
        that is one run.  Slices of every key, or lists of the indices ``among``."""
        order = list(range(len(self._params))) if among is None else among
        runs, start, total = [], 0, 0
        for at, index in enumerate(order):
            size = self._params[index].numel() * self._params[index].element_size()
            if at > start and total + size > CALL_BYTES:
                runs.append((start, at))
                start, total = at, 0
            total += size
        runs.append((start, len(order)))
        if among is None:
            return [slice(a, b) for a, b in runs]
        return [order[a:b] for a, b in runs]

    def _pushpull(self, values: list[list[Any]], outs: list[list[Any]] | None) -> None:
        """Pushpull every key's ``values`` (into ``outs``, or into the values), a call per run."""
        for run in self._runs():
            self._kv.pushpull(self._keys[run], values[run], out=None if outs is None else outs[run])

    def _pull_weights(self) -> None:
        """Pull every key into every replica's parameters, a call per run."""
        outs = self._per_key(self._replicas)
        for run in self._runs():
            self._kv.pull(self._keys[run], out=outs[run])

    def _per_key(self, by_device: list[list[Any]]) -> list[list[Any]]:
        """``[device][parameter]`` lists regrouped as ``[parameter][device]``, as the store takes them."""
        return [list(column) for column in zip(*by_device)]

    def _grads(self, warn: bool = True) -> list[list[Tensor]]:
        """``[device][parameter]`` gradients; zeros (and a warning, once per key) where one is None."""
        import torch

        grads = []
        for replica in self._replicas:
            row = []
            for key, p in zip(self._keys, replica):
                if p.grad is None:
                    if warn and key not in self._warned:
                        self._warned.add(key)
                        warnings.warn(f"parameter {key!r} has no gradient; pushing zeros for it",
                                      stacklevel=4)
                    row.append(torch.zeros_like(p, memory_format=torch.contiguous_format))
                else:
                    row.append(p.grad)
            grads.append(row)
        return grads

    def _require_local(self, what: str) -> None:
        if self._update_on_kvstore:
            raise RuntimeError(f"{what} is not available when the store runs the optimizer; create the "
                               "Trainer with update_on_kvstore=False to call it")

    # -- training -----------------------------------------------------------------------------
    def step(self, batch_size: float, ignore_stale_grad: bool = False) -> None:
        """One optimisation step: rescale by ``scale / batch_size``, sum gradients over workers, update.

        With update_on_kvstore, the gradients go to the store in one pushpull and
        the updated weights come back into the parameters; otherwise
        :meth:`allreduce_grads` then :meth:`update`.  A parameter without a
        gradient pushes zeros (a warning names it once, unless
        ``ignore_stale_grad``).  Raises ValueError for a batch_size <= 0.
        """
        began = time.perf_counter()  # for the step time and samples/s (docs/observability.md)
        self._set_rescale(batch_size)
        self._init_kvstore()
        if self._update_on_kvstore:
            if not self._overlapped(not ignore_stale_grad):
                grads = self._grads(not ignore_stale_grad)
                factor = self.gradient_factor(batch_size)
                if factor != 1.0:  # a batch size other than the first use's
                    grads = [[g * factor for g in row] for row in grads]
                self._pushpull(self._per_key(grads), self._per_key(self._replicas))
            self._mark_weights()
            self._steps_since_reload += 1
        else:
            self._allreduce(not ignore_stale_grad)
            self._update()
        trainer_step(began, batch_size)
        self._histograms.step()

    def step_without_data(self) -> None:
        """A step in which this worker has no batch: push zero gradients for every parameter (a
        ``dist_sync`` round waits for every present worker, docs/elastic.md) and take the updated
        weights, adding nothing to the sum and leaving the parameters' ``.grad`` alone; a first step
        meets the others' agreement of the servers' rescale_grad as :meth:`step` does.  Needs
        update_on_kvstore (with local updates the batch size the others scale by is unknown here):
        RuntimeError otherwise."""
        import torch

        if not self._update_on_kvstore:
            raise RuntimeError("step_without_data needs update_on_kvstore=True: with local updates this "
                               "worker cannot scale the others' gradient sum as they do")
        self._init_kvstore()
        if self._servers_keep_rescale():  # meet the others' first-step agreement of the servers' rescale_grad
            self._rescales.factor(self._optimizer.rescale_grad)
        zeros = [[torch.zeros_like(p, memory_format=torch.contiguous_format) for p in replica]
                 for replica in self._replicas]
        self._pushpull(self._per_key(zeros), self._per_key(self._replicas))
        self._mark_weights()
        self._steps_since_reload += 1

    def allreduce_grads(self) -> None:
        """Sum every parameter's gradient over the workers, in place (update_on_kvstore=False only).

        A parameter whose ``.grad`` is None receives the reduced gradient.
        Raises RuntimeError when update_on_kvstore is True.
        """
        self._require_local("allreduce_grads")
        self._init_kvstore()
        self._allreduce(True)

    def _overlapped(self, warn: bool) -> bool:
        """Whether the overlap finished this step's communication (:meth:`Overlap.reduce`)."""
        return self._overlap is not None and self._overlap.reduce(
            lambda: self._grads(warn)[0], self._optimizer.rescale_grad)

    def _allreduce(self, warn: bool) -> None:
        if self._overlapped(warn):
            return
        grads = self._grads(warn)
        self._pushpull(self._per_key(grads), None)  # the sum lands in every replica's grad
        for replica, row in zip(self._replicas, grads):
            for p, g in zip(replica, row):
                if p.grad is None:
                    p.grad = g

    def update(self, batch_size: float) -> None:
        """Apply the optimizer to every parameter with its (already reduced) gradient.

        Uses ``rescale_grad = scale / batch_size``.  Raises RuntimeError when
        update_on_kvstore is True, ValueError for a batch_size <= 0.
        """
        self._require_local("update")
        self._set_rescale(batch_size)
        self._init_kvstore()
        self._update()

    def _update(self) -> None:
        """Each replica updates its own weights, replica r > 0 with its own optimizer state."""
        opt = self._optimizer
        own = (opt.states, opt.counts)
        try:
            for r, (replica, row) in enumerate(zip(self._replicas, self._grads())):
                if r:
                    opt.states, opt.counts = self._replica_states[r - 1]
                for key, p, g in zip(self._keys, replica, row):
                    weight = _weight_view(p)
                    grad = g.detach()
                    grad = grad.cpu().numpy() if xp.is_numpy(weight) else grad.to(p.device)
                    opt.update(key, weight, grad)
        finally:
            opt.states, opt.counts = own

    def _mirror_states(self) -> None:
        """Give replicas 1.. copies of the first replica's optimizer state, on their devices."""
        opt = self._optimizer
        index = {k: i for i, k in enumerate(self._keys)}
        for r, replica in enumerate(self._replicas[1:]):
            states = {k: {n: xp.like(_weight_view(replica[index[k]]), xp.to_numpy(a)) for n, a in st.items()}
                      for k, st in opt.states.items() if k in index}
            self._replica_states[r] = (states, dict(opt.counts))

    # -- checkpoints --------------------------------------------------------------------------
    def _weights(self) -> dict[str, Any]:
        """The first replica's weights as the optimizer updates them (see :func:`_weight_view`), and
        the ``extra_weights``."""
        weights = {k: _weight_view(p) for k, p in zip(self._keys, self._params)}
        if self._extra_weights is not None:
            weights.update(self._extra_weights())
        return weights

    def save_states(self, fname: str, *, collective: bool = True) -> None:
        """Write the optimizer and its states to ``fname`` (call it on every worker).

        With update_on_kvstore the store saves them (collective: gathered from
        the servers, rank 0 writes); otherwise rank 0 writes its own, which every
        worker shares in dist_sync.  Either way a failure is raised on every worker.
        With ``collective=False`` only this worker calls it (after its first use)
        and writes the file itself, with no barrier: the servers' states as they
        are now, or its own (what ``kvstore.Session`` does on rank 0).
        """
        self._check_states_kept("save_states")
        if collective:
            self._init_kvstore()
        elif not self._initialized:
            raise RuntimeError("save_states(collective=False) before the Trainer's first use: "
                               "call init_kvstore() or step() on every worker first")
        writer = collective is False or self._kv.rank == 0  # who writes the file
        if self._update_on_kvstore:
            self._kv.save_optimizer_states(str(fname), dump_optimizer=True, collective=collective)
            if self._generation and writer and storage.exists(str(fname)):
                checkpoint.write_states(str(fname), self._renamed(checkpoint.read_states(str(fname)), True))
            return

        def write() -> None:
            states = checkpoint.optimizer_states(self._optimizer, self._weights(), True)
            checkpoint.write_states(str(fname), states)

        if collective:
            layer_calls(self._kv).collective("Trainer.save_states", write)
        else:
            write()

    def load_states(self, fname: str) -> None:
        """Restore the optimizer and its states from ``fname`` (call it on every worker).

        Put the model's weights in place first: the Trainer's first use broadcasts
        rank 0's weights.  The keys in the file must be this Trainer's (same
        key_prefix).  Raises :class:`FormatError` for a damaged file and
        :class:`OptimizerError` (or a key/shape error) for states that do not fit.
        """
        self._check_states_kept("load_states")
        self._init_kvstore()
        if self._update_on_kvstore:
            with tempfile.TemporaryDirectory(prefix="kvstore-states-") as tmp:
                path = str(fname)
                if self._generation and self._kv.rank == 0:  # rank 0 reads it: the store's names now
                    try:
                        renamed = self._renamed(checkpoint.read_states(path), False)
                        path = os.path.join(tmp, "states.kvs")
                        checkpoint.write_states(path, renamed)
                    except Exception:  # noqa: BLE001 - the collective load below raises it on every worker
                        path = str(fname)
                self._kv.load_optimizer_states(path)
            remote = self._kv.get_optimizer()  # the loaded optimizer (a stateless copy in dist modes)
            if remote is not None:
                self._optimizer = remote
            self._rescales.reset()  # the file's rescale_grad is the servers' now
        else:
            states = checkpoint.read_states(str(fname))
            self._optimizer = checkpoint.restore_optimizer(states, self._optimizer, self._weights())
            self._mirror_states()

    def _check_states_kept(self, what: str) -> None:
        """Raise ConfigError for ``what`` (a save or load of optimizer states) on a worker-set Trainer:
        the writing worker holds its own set's keys only, so the file would miss the other sets'."""
        if self._workers is not None:
            ranks = sorted({rank for members in self._workers for rank in members})
            raise ConfigError(f"Trainer.{what}: the optimizer states of a Trainer whose keys are in a "
                              f"worker set ({ranks}, a pipeline stage's) cannot be saved or loaded "
                              "yet: each worker holds its own set's keys only (docs/worker-sets.md, 'Not "
                              "done'); save the weights (Pipeline.save) instead")

    def _renamed(self, states: checkpoint.StatesFile, to_file: bool) -> checkpoint.StatesFile:
        """``states`` with this Trainer's keys as state files name them (``to_file``: the store's
        current keys become the first names, and the keys of the weights loaded before are left out)
        or as the store names them now (the reverse)."""
        if to_file:
            names, stale = dict(zip(self._keys, self._stable)), set(self._stable)
        else:
            names, stale = dict(zip(self._stable, self._keys)), set()
        entries = [dataclasses.replace(e, key=names[e.key]) if e.key in names else e for e in states.entries
                   if e.key in names or not (e.key in stale or str(e.key).startswith(f"{self._prefix}@"))]
        return dataclasses.replace(states, entries=entries)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's spec, ``num_update`` and per-key states as a dict of plain values and CPU
        tensors, for ``torch.save`` (call it on every worker: collective in dist modes).

        With update_on_kvstore the states are gathered from the servers (rank 0 writes them to a
        temporary file, reads them and broadcasts them through the store), so every worker returns
        the same dict.  Raises OptimizerError when the store holds no optimizer.
        """
        self._check_states_kept("state_dict")
        self._init_kvstore()
        if not self._update_on_kvstore:
            return _states_to_dict(checkpoint.optimizer_states(self._optimizer, self._weights(), True))
        with tempfile.TemporaryDirectory(prefix="kvstore-states-") as tmp:
            path = os.path.join(tmp, "states.kvs")
            self.save_states(path)
            states = checkpoint.read_states(path) if storage.exists(path) else None
        if self._kv.num_workers > 1:
            states = self._share(states)
        return _states_to_dict(states)

    def _share(self, states: checkpoint.StatesFile | None) -> checkpoint.StatesFile:
        """Rank 0's states on every worker, through ``kv.broadcast``: the counts (and num_update) as
        one array, then each state array; names, shapes and dtypes derive from the optimizer's spec."""
        import numpy as np

        n, index = next(self._shares), {k: i for i, k in enumerate(self._stable)}
        counts = np.full(len(self._keys) + 1, -1, np.int64)
        entries = {e.key: e for e in states.entries} if states is not None else {}
        if states is not None:
            counts[-1] = states.num_update
            for key, entry in entries.items():
                counts[index[key]] = entry.count
        self._kv.broadcast(f"__states{n}/{self._keys[0]}/counts", counts, out=counts)
        spec = self._kv.get_optimizer().spec()
        template = kvoptimizer.from_spec(spec)
        out, names, arrays = [], [], []
        for key, p, count in zip(self._stable, self._params, counts[:-1].tolist()):
            if count < 0:
                continue
            weight = _weight_view(p)
            like = {a: xp.to_numpy(v) for a, v in template.create_state(key, xp.to_numpy(weight)).items()}
            saved = entries[key].arrays if key in entries else {}
            mine = {a: np.ascontiguousarray(saved[a]).reshape(v.shape) if a in saved else v
                    for a, v in like.items()}
            names += [f"__states{n}/{key}/{a}" for a in mine]
            arrays += list(mine.values())
            out.append(checkpoint.StateEntry(key, tuple(p.shape), xp.dtype_of(weight), int(count), mine))
        if arrays:
            self._kv.broadcast(names, arrays, out=arrays)
        return checkpoint.StatesFile(spec, int(counts[-1]), out)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (call it on every worker with the same dict).

        As :meth:`load_states`: the optimizer is rebuilt from the dict's spec with its states; with
        update_on_kvstore they go to the servers (collective).  Raises ValueError for a dict that is
        not a state dict, and what :meth:`load_states` raises for states that do not fit.
        """
        self._check_states_kept("load_state_dict")
        states = _states_from_dict(state)
        self._init_kvstore()
        if self._update_on_kvstore:
            with tempfile.TemporaryDirectory(prefix="kvstore-states-") as tmp:
                path = os.path.join(tmp, "states.kvs")
                checkpoint.write_states(path, states)
                self.load_states(path)
        else:
            self._optimizer = checkpoint.restore_optimizer(states, self._optimizer, self._weights())
            self._mirror_states()


def _weight_view(p: Tensor) -> Any:
    """What the optimizer updates in place for ``p``: a numpy view of a contiguous CPU tensor
    (the numpy rules, as on the servers), else the tensor itself (the rules run on its device;
    bfloat16 ones through a float32 master copy)."""
    if p.device.type == "cpu" and p.is_contiguous() and p.dtype != sys.modules["torch"].bfloat16:
        return p.detach().numpy()
    return p.detach()


# -- the states as a dict (Trainer.state_dict / load_state_dict) --------------------------------------

def _states_to_dict(states: checkpoint.StatesFile) -> dict[str, Any]:
    """A StatesFile as plain values and CPU tensors (what torch.load(weights_only=True) reads back)."""
    import torch

    def tensors(arrays: Mapping[str, Any]) -> dict[str, Tensor]:
        return {n: torch.from_numpy(xp.to_numpy(a).copy()) for n, a in arrays.items()}

    return {"optimizer": states.optimizer, "num_update": int(states.num_update),
            "states": {e.key: {"count": int(e.count), "shape": [int(d) for d in e.shape],
                               "dtype": dtype_name(e.dtype), "arrays": tensors(e.arrays)}
                       for e in states.entries}}


def _states_from_dict(state: Mapping[str, Any]) -> checkpoint.StatesFile:
    """The StatesFile of a :meth:`Trainer.state_dict` dict; ValueError when it is not one."""
    try:
        entries = [checkpoint.StateEntry(key, tuple(e["shape"]), BY_NAME[e["dtype"]], int(e["count"]),
                                         {n: xp.to_numpy(a.detach().cpu()) for n, a in e["arrays"].items()})
                   for key, e in state["states"].items()]
        return checkpoint.StatesFile(state["optimizer"], int(state["num_update"]), entries)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a Trainer state dict ({type(exc).__name__}: {exc})") from None


def _worker_sets(workers: Iterable[int] | Mapping[str, Iterable[int]] | None,
                 names: list[str]) -> list[tuple[int, ...]] | None:
    """Each key's worker set (sorted ranks) from a Trainer's ``workers``: one set for every key, or a
    mapping from parameter name to set; None for all workers.  Raises ValueError for a name missing."""
    if workers is None:
        return None
    if isinstance(workers, Mapping):
        missing = [n for n in names if n not in workers]
        if missing:
            raise ValueError(f"workers has no worker set for parameter(s) {missing[:4]}")
        return [tuple(sorted(workers[n])) for n in names]
    members = tuple(sorted(workers))
    return [members] * len(names)

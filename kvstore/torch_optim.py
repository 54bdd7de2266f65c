"""Horovod-style data parallelism over any ``torch.optim`` optimizer, through a KVStore::

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = kvstore.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    kvstore.broadcast_parameters(model.state_dict(), root_rank=0)
    kvstore.broadcast_optimizer_state(opt, root_rank=0)
    loss_fn(model(x), y).backward()     # loss averaged over this worker's batch
    opt.step()                          # gradients averaged over the workers, then torch's step

The servers only sum (no optimizer is set on them); every worker runs the torch optimizer on the
reduced gradients, so every worker holds the same weights and the same optimizer state.
``op='average'`` (the default, as Horovod and DDP) divides the sum by the number of workers;
``op='sum'`` keeps MXNet's convention (the :class:`kvstore.Trainer` sums).

Every function here is collective in dist modes: every worker calls it, in the same order.
Broadcasts send tensors only; the layout of an optimizer's state dict (names, shapes, dtypes, step
counts, hyper-parameters) travels as JSON text in a uint8 array, never pickled.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from kvstore import config as kvconfig
from kvstore.base import KVStore, layer_calls
from kvstore.client.instance import process_store
from kvstore.client.meter import HistogramRecorder
from kvstore.core import agreement
from kvstore.core.worker_sets import WorkerSet, worker_set
from kvstore.errors import ConfigError, NotAMemberError
from kvstore.sparse_reduce import SparseGrads
from kvstore.stores import create

Tensor = Any  # a torch.Tensor; torch is not imported when this module loads
OPS = ("average", "sum")
_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> {what: next number}
_counters_lock = threading.Lock()
_WIRE = {"float16", "float32", "float64", "int32", "int64"}  # torch dtype names the store carries


def _store(kv: KVStore | str | None, need: bool = True) -> KVStore | None:
    """``kv`` as a store: a mode name is created; None means this process's dist store, else
    'dist_sync' under the launcher, else 'local' (None then, unless ``need``)."""
    if isinstance(kv, str):
        return create(kv)
    if kv is not None:
        return kv
    existing = process_store()
    if existing is not None:
        return existing
    if kvconfig.in_cluster():
        return create("dist_sync")
    return create("local") if need else None


def _next(kv: KVStore, what: str) -> int:
    """The next number of ``what`` on ``kv`` (from 0): each store counts its own, so every worker,
    making the same calls in the same order, names the same keys."""
    with _counters_lock:
        counts = _counters.setdefault(kv, {})
        counts[what] = counts.get(what, -1) + 1
        return counts[what]


def _no_store_optimizer(kv: KVStore, what: str) -> None:
    """Raise ConfigError when ``kv`` runs an optimizer: it would update what is pushed instead of summing."""
    if kv.get_optimizer() is not None:
        raise ConfigError(f"{what} needs a store that only sums, but this {kv.type} store runs an "
                           "optimizer (a Trainer with update_on_kvstore, or kv.set_optimizer, set one); "
                           "use another store, or a Trainer with update_on_kvstore=False")


def _wire_copy(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` in a dtype the store carries (exact: bool/int8/int16/uint8 -> int32,
    bfloat16 -> float32).  TypeError for complex tensors."""
    import torch

    if t.is_complex():
        raise TypeError(f"cannot broadcast a complex tensor ({t.dtype})")
    name = str(t.dtype).removeprefix("torch.")
    if name in _WIRE:
        return t.detach().clone(memory_format=torch.contiguous_format)
    return t.detach().to(torch.float32 if t.is_floating_point() else torch.int32).contiguous()


def _agree(kv: KVStore, what: str, named: list[tuple[str, Tensor]], root_rank: int) -> None:
    """Meet every worker with this one's ``root_rank`` and the names, shapes and dtypes of ``named``
    (one barrier); CollectiveMismatchError on every worker when any of them differ, before anything
    is sent (so no value is ever converted into another worker's dtype)."""
    digest = agreement.digest(((name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                               for name, t in named), root=root_rank)
    layer_calls(kv).agree(what, digest)


def _broadcast_tensors(kv: KVStore, names: list[str], tensors: list[Tensor], root_rank: int) -> None:
    """Overwrite every tensor (in place) with the root's; keys ``__bcast{n}/{name}`` are new each call.
    The workers must have agreed on names, shapes and dtypes (:func:`_agree`): each tensor goes as
    its exact wire copy (:func:`_wire_copy`) and comes back into its own dtype."""
    if not tensors:
        return
    if not 0 <= root_rank < kv.num_workers:
        raise ValueError(f"root_rank {root_rank} is not a rank of {kv.num_workers} worker(s)")
    n = _next(kv, "broadcast")
    keys = [f"__bcast{n}/{name}" for name in names]
    flat = [_wire_copy(t).reshape(-1) for t in tensors]
    if root_rank == 0:
        kv.broadcast(keys, flat, out=flat)
    else:  # the sum of the root's values and everyone else's zeros is the root's values, exactly
        _no_store_optimizer(kv, f"a broadcast from root_rank {root_rank}")
        kv.init(keys, [f.clone().zero_() for f in flat])
        for f in flat:
            if kv.rank != root_rank:
                f.zero_()
        kv.pushpull(keys, flat)
    for t, f in zip(tensors, flat):
        t.data.copy_(f.reshape(t.shape))


def _named(params: Any) -> list[tuple[str, Tensor]]:
    """(name, tensor) pairs of a state dict, of named pairs, or of tensors (named by position)."""
    torch = sys.modules.get("torch")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    named = []
    for i, item in enumerate(items):
        if torch is not None and isinstance(item, torch.Tensor):
            named.append((str(i), item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            named.append(item)
        else:
            raise TypeError("params must be a state dict, (name, tensor) pairs or tensors; "
                            f"got {type(item).__name__} at position {i}")
    return named


def broadcast_parameters(params: Mapping[str, Tensor] | Iterable[Any], root_rank: int = 0,
                         kv: KVStore | str | None = None) -> None:
    """Copy the root worker's tensors into every worker's, in place (collective).

    ``params``: ``model.state_dict()`` (parameters and buffers), ``model.named_parameters()`` or
    tensors; non-tensor entries of a state dict are skipped.  Every worker must pass the same names,
    in the same order, with the same shapes and dtypes, and the same ``root_rank``: the workers
    compare them first (one barrier) and, where any differ, every worker raises
    CollectiveMismatchError naming the ranks and what differs (nothing is sent or converted; the
    store stays usable).  Without a dist store (one process) nothing happens.  Raises ValueError for
    a bad ``root_rank``, TypeError for bad ``params``.
    """
    torch = sys.modules.get("torch")
    named = [(n, t) for n, t in _named(params) if not isinstance(params, Mapping)
             or (torch is not None and isinstance(t, torch.Tensor))]
    store = _store(kv, need=False)
    if store is None or store.num_workers == 1:
        if root_rank != 0:
            raise ValueError(f"root_rank {root_rank} is not a rank of 1 worker")
        return
    _agree(store, "broadcast_parameters", named, root_rank)
    _broadcast_tensors(store, [n for n, _ in named], [t for _, t in named], root_rank)


def _json_array(text: str | None, kv: KVStore, root_rank: int) -> str:
    """The root's text, broadcast as UTF-8 bytes (its length first)."""
    import torch

    data = (text or "").encode()
    length = torch.tensor([len(data)], dtype=torch.int64)
    _broadcast_tensors(kv, ["layout_length"], [length], root_rank)
    buf = torch.zeros(int(length.item()), dtype=torch.int32)
    if kv.rank == root_rank:
        buf.copy_(torch.from_numpy(np.frombuffer(data, np.uint8).astype(np.int32)))
    _broadcast_tensors(kv, ["layout"], [buf], root_rank)
    return bytes(buf.numpy().astype(np.uint8).tolist()).decode()


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data (tuples become lists); 0-d tensors become numbers.  TypeError otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise TypeError(f"{where}: a {type(value).__name__} cannot be broadcast (numbers, bools, strings, "
                    "None, lists of them and tensors can)")


def _layout(state_dict: dict[str, Any]) -> str:
    """JSON text of an optimizer state dict: hyper-parameters, and per state entry a number or a
    tensor's [dtype, shape]."""
    torch = sys.modules["torch"]
    state = {}
    for index, entries in state_dict["state"].items():
        state[str(index)] = {
            name: {"tensor": [str(v.dtype).removeprefix("torch."), list(v.shape)]}
            if isinstance(v, torch.Tensor) else {"value": _plain(v, f"state[{index}][{name!r}]")}
            for name, v in entries.items()}
    groups = [{k: _plain(v, f"param_groups[{i}][{k!r}]") for k, v in g.items()}
              for i, g in enumerate(state_dict["param_groups"])]
    return json.dumps({"state": state, "param_groups": groups})


def _rebuild(layout: dict[str, Any], mine: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[Tensor]]:
    """A state dict of the root's layout (zero tensors to be filled) and its tensors by name."""
    import torch

    state, names, tensors = {}, [], []
    for index, entries in layout["state"].items():
        state[int(index)] = {}
        for name, spec in entries.items():
            if "tensor" in spec:
                dtype, shape = spec["tensor"]
                value = torch.zeros(shape, dtype=getattr(torch, dtype))
                names.append(f"state/{index}/{name}")
                tensors.append(value)
            else:
                value = spec["value"]
            state[int(index)][name] = value
    groups = []
    for group, local in zip(layout["param_groups"], mine["param_groups"]):
        groups.append({k: tuple(v) if isinstance(local.get(k), tuple) else v for k, v in group.items()})
    return {"state": state, "param_groups": groups}, names, tensors


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0, kv: KVStore | str | None = None) -> None:
    """Give every worker's torch optimizer the root's state and hyper-parameters (collective).

    The root's ``optimizer.state_dict()`` travels as its tensors plus its layout (names, dtypes,
    shapes, step counts, ``param_groups``' hyper-parameters) as JSON text in an array; every worker
    then calls ``optimizer.load_state_dict`` with it, so state missing on a worker (no step yet) is
    created.  The optimizers must have the same parameter groups (the same parameters' shapes and
    dtypes, in order) and every worker the same ``root_rank``: the workers compare them first (one
    barrier) and, where any differ, every worker raises CollectiveMismatchError naming the ranks and
    what differs.  Without a dist store nothing happens.  Raises ValueError for a bad
    ``root_rank``, TypeError for state or hyper-parameters that are neither tensors nor JSON-like
    numbers, bools, strings or None.
    """
    store = _store(kv, need=False)
    if store is None or store.num_workers == 1:
        if root_rank != 0:
            raise ValueError(f"root_rank {root_rank} is not a rank of 1 worker")
        return
    params = [(f"param_groups[{g}][{i}]", p) for g, group in enumerate(optimizer.param_groups)
              for i, p in enumerate(group["params"])]
    _agree(store, "broadcast_optimizer_state", params, root_rank)
    mine = optimizer.state_dict()
    text = _layout(mine) if store.rank == root_rank else None
    layout = json.loads(_json_array(text, store, root_rank))
    if len(layout["param_groups"]) != len(mine["param_groups"]):
        raise ValueError(f"the root's optimizer has {len(layout['param_groups'])} parameter groups, "
                         f"this worker's {len(mine['param_groups'])}")
    state_dict, names, tensors = _rebuild(layout, mine)
    if store.rank == root_rank:
        for name, t in zip(names, tensors):
            _, index, entry = name.split("/", 2)
            t.copy_(mine["state"][int(index)][entry])
    _broadcast_tensors(store, names, tensors, root_rank)
    optimizer.load_state_dict(state_dict)


class _Distributed:
    """The methods a DistributedOptimizer adds to (or puts in front of) its torch optimizer's class."""

    _kv: KVStore
    _kv_op: str
    _kv_keys: list[str]
    _kv_present: str  # the key of the per-parameter "had a gradient" flags
    _kv_params: list[Tensor]
    _kv_ready: bool
    _kv_passes: _Passes  # backward passes since the last step, against backward_passes_per_step
    _kv_synced: bool  # synchronize() ran since the last step
    _kv_skip: bool  # inside skip_synchronize()
    _kv_skipped: list[tuple[str, Tensor]]  # float parameters that took no gradient when wrapped
    _kv_sparse: SparseGrads  # the parameters whose sparse gradients go through row-sparse keys
    _kv_histograms: HistogramRecorder  # KVSTORE_HISTOGRAM_EVERY's weight and gradient histograms
    _kv_set: WorkerSet | None  # process_set: the workers its keys belong to (None: every worker)

    def __init__(self, optimizer: Any, kv: KVStore, op: str, prefix: str,
                 ordered: list[tuple[str, Tensor]], passes: int, sparse_as_dense: bool = False,
                 process_set: WorkerSet | None = None) -> None:
        """Share ``optimizer``'s state (its ``__init__`` is not run again) and reduce over ``kv``: keys
        ``f"{prefix}/grad/{name}"`` of the ``ordered`` named parameters, whose backward passes are
        counted against ``passes`` (backward_passes_per_step); sparse gradients are made dense first
        with ``sparse_as_dense``, else they go through row-sparse keys (:class:`SparseGrads`); the keys
        belong to ``process_set`` when given (docs/worker-sets.md)."""
        self.__dict__.update(optimizer.__dict__)
        self._kv, self._kv_op, self._kv_set = kv, op, process_set
        self._kv_keys = [f"{prefix}/grad/{name}" for name, _ in ordered]
        self._kv_present = f"{prefix}/present"
        self._kv_params = [p for _, p in ordered]
        self._kv_sparse = SparseGrads(kv, prefix, [name for name, _ in ordered], sparse_as_dense)
        self._kv_ready = False
        self._kv_passes = _Passes(passes)
        self._kv_histograms = HistogramRecorder.from_env([name for name, _ in ordered], self._kv_params)
        self._kv_synced = self._kv_skip = False
        for name, p in ordered:
            p.register_post_accumulate_grad_hook(self._kv_passes.hook(name))
        reduced = {id(p) for p in self._kv_params}
        self._kv_skipped = [(f"{g}.{i} {tuple(p.shape)}", p) for g, group in enumerate(self.param_groups)
                            for i, p in enumerate(group["params"])
                            if p.is_floating_point() and id(p) not in reduced]

    @property
    def kvstore(self) -> KVStore:
        """The store the gradients go through."""
        return self._kv

    @property
    def op(self) -> str:
        """'average' or 'sum': how gradients are reduced over the workers."""
        return self._kv_op

    @property
    def backward_passes_per_step(self) -> int:
        """How many backward passes may accumulate into the gradients before each step."""
        return self._kv_passes.limit

    def synchronize(self) -> None:
        """Reduce every parameter's gradient over the workers, in place (collective).

        A parameter whose ``.grad`` is None contributes zeros; it receives the reduced gradient when
        another worker had one, and keeps None when no worker did (DDP's rule), so the optimizer
        skips it everywhere.  Then ``step()`` inside :meth:`skip_synchronize` steps on them as they are
        (to clip them first, for instance).  RuntimeError, before any reduction, when a parameter
        skipped as frozen at wrapping has a gradient (it would step unreduced).
        """
        import torch

        late = [name for name, p in self._kv_skipped if p.grad is not None]
        if late:
            raise RuntimeError(f"parameters that took no gradient when the optimizer was wrapped have one "
                               f"now (param_groups index and shape): {late[:5]}; they would step unreduced: "
                               "wrap the optimizer again after changing requires_grad")
        params, sparse = self._kv_params, self._kv_sparse
        if not self._kv_ready:
            _no_store_optimizer(self._kv, "DistributedOptimizer.step")
            mine = ((key, tuple(p.shape), str(p.dtype).removeprefix("torch."))
                    for key, p in zip(self._kv_keys, params))
            if self._kv_set is None:  # a process set's members compare them at its keys' init
                layer_calls(self._kv).agree("DistributedOptimizer's first step", agreement.digest(mine))
            sparse.decide(params)  # collective, once: which parameters have sparse gradients
        dense = [i for i in range(len(params)) if i not in sparse.chosen]
        grads = [_dense_grad(params[i]) for i in dense]
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        keys = [self._kv_keys[i] for i in dense]
        if not self._kv_ready:
            self._kv.init([*keys, self._kv_present],
                          [torch.zeros_like(g) for g in grads] + [torch.zeros_like(present)],
                          workers=self._kv_set)
            sparse.init(params)
            self._kv_ready = True
        sparse.push(params)  # returns at once: the rows are summed while the pushpull runs
        self._kv.pushpull([*keys, self._kv_present], [*grads, present])
        workers = self._kv.num_workers if self._kv_set is None else len(self._kv_set)
        scale = 1.0 / workers if self._kv_op == "average" else 1.0
        for i, g in zip(dense, grads):
            if scale != 1.0:
                g.mul_(scale)
            if present[i] > 0 and (params[i].grad is None or params[i].grad.is_sparse):
                params[i].grad = g  # a worker without one, or a sparse one made dense (sparse_as_dense)
        sparse.pull(params, present, scale)
        self._kv_synced = True
        self._kv_passes.counts.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The torch optimizer's ``zero_grad``; the gradients it discards no longer count as backward
        passes against ``backward_passes_per_step``."""
        self._kv_passes.counts.clear()
        super().zero_grad(set_to_none)  # type: ignore[misc]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within it, ``step()`` does not reduce: use it after :meth:`synchronize` (Horovod's
        ``optimizer.skip_synchronize()``)."""
        self._kv_skip = True
        try:
            yield
        finally:
            self._kv_skip = False

    def step(self, closure: Any = None) -> Any:
        """Reduce the gradients over the workers, then take the torch optimizer's step (collective).

        A ``closure`` is evaluated once, first (under ``torch.enable_grad``), so its backward's
        gradients are the ones reduced; its loss is returned.  Optimizers that evaluate the closure
        themselves, several times (LBFGS), are not supported.  Inside :meth:`skip_synchronize` the
        gradients are stepped on as they are; after :meth:`synchronize` outside it they are not reduced
        a second time, with a warning.
        """
        import torch

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._kv_skip:
            if not self._kv_synced:
                warnings.warn("DistributedOptimizer.step() inside skip_synchronize() without synchronize() "
                              "first: the gradients are not reduced over the workers", stacklevel=2)
        elif self._kv_synced:
            warnings.warn("DistributedOptimizer.step() after synchronize() outside skip_synchronize(): the "
                          "gradients were reduced already and are not reduced again; wrap step() in "
                          "`with optimizer.skip_synchronize():`", stacklevel=2)
        else:
            self.synchronize()
        self._kv_synced = False
        self._kv_passes.counts.clear()
        super().step()  # type: ignore[misc]
        self._kv_histograms.step()
        return loss

    # torch's Optimizer.__setstate__ (load_state_dict) wraps a class's step with the step hooks unless it
    # is marked: the base class's step, called above, already runs them once
    step.hooked = True  # type: ignore[attr-defined]


class _Passes:
    """Backward passes into each parameter since its wrapper's last step, held to ``limit``
    (backward_passes_per_step).  Each parameter's hook holds this weakly: a wrapper let go (and its
    counts with it) stops counting."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counts: dict[int, int] = {}  # id(param) -> passes since the last step

    def hook(self, name: str) -> Any:
        """The post-accumulate-grad hook of parameter ``name``: it raises RuntimeError (out of
        ``backward()``) on the pass after ``limit`` with no step between."""
        ref = weakref.ref(self)

        def count(p: Tensor) -> None:
            passes = ref()
            if passes is not None:
                passes.count(p, name)
        return count

    def count(self, p: Tensor, name: str) -> None:
        """One more pass into ``p``; RuntimeError when it is one too many."""
        seen = self.counts.get(id(p), 0) + 1
        if seen > self.limit:
            raise RuntimeError(
                f"parameter {name!r} got a gradient from {seen} backward passes before step() "
                f"(backward_passes_per_step={self.limit}): call step() or synchronize() every "
                f"{self.limit} backward passes, or raise backward_passes_per_step to accumulate")
        self.counts[id(p)] = seen


def _dense_grad(p: Tensor) -> Tensor:
    """``p``'s gradient as a dense tensor to reduce in place: zeros for None, a dense copy of a sparse
    one (sparse_as_dense), else ``p.grad`` itself."""
    import torch

    if p.grad is None:
        return torch.zeros_like(p, memory_format=torch.contiguous_format)
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def _takes_grad(p: Tensor) -> bool:
    """Whether ``p`` gets gradients: a floating-point tensor with ``requires_grad`` (no integer one can)."""
    return p.requires_grad and p.is_floating_point()


def _check_params(optimizer: Any, named: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """The optimizer's parameters that take gradients (:func:`_takes_grad`; the others are skipped, as
    Horovod does), in ``param_groups`` order with their names ("group.index" when none is named).
    ValueError for a named tensor the optimizer lacks, parameters left unnamed when some are named, a
    parameter given twice, a duplicate name or no parameter at all."""
    names = {id(t): n for n, t in named}
    if len(set(names.values())) != len(named) or len(names) != len(named):
        raise ValueError("named_parameters must give each parameter once, under unique names")
    ordered, seen, unnamed = [], set(), []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                raise ValueError("a parameter appears twice in the optimizer's param_groups")
            seen.add(id(p))
            if not _takes_grad(p):
                continue
            if named and id(p) not in names:
                unnamed.append(f"{g}.{i} {tuple(p.shape)}")
            ordered.append((names.get(id(p), f"{g}.{i}") if named else f"{g}.{i}", p))
    unknown = sorted(n for n, t in named if id(t) not in seen and t.requires_grad)
    if unknown:
        raise ValueError(f"named_parameters has tensors the optimizer does not update: {unknown[:5]}")
    for name, p in ordered:
        if str(p.dtype).removeprefix("torch.") not in ("float16", "float32", "float64"):
            raise TypeError(f"parameter {name!r} is {p.dtype}; gradients go through the store as "
                            "float16, float32 or float64")
    if unnamed:
        raise ValueError(f"named_parameters leaves {len(unnamed)} of the optimizer's parameters unnamed "
                         f"(param_groups index and shape): {unnamed[:5]}; name them all, or none")
    if not ordered:
        raise ValueError("the optimizer has no parameter that takes a gradient")
    return ordered


def DistributedOptimizer(optimizer: Any, named_parameters: Iterable[tuple[str, Tensor]] | None = None,
                         kv: KVStore | str | None = None, op: str = "average",
                         key_prefix: str | None = None, backward_passes_per_step: int = 1,
                         compression: str | dict[str, Any] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: WorkerSet | Iterable[int] | None = None) -> Any:
    """Wrap a ``torch.optim.Optimizer`` so that ``step()`` first reduces gradients over the workers.

    Returns an instance of a subclass of ``type(optimizer)`` sharing its ``param_groups``, ``state``
    and hooks (use it instead of ``optimizer`` from then on): ``zero_grad``, ``state_dict``,
    ``load_state_dict``, ``param_groups`` and ``torch.optim.lr_scheduler`` schedulers work unchanged.
    ``named_parameters`` names the keys (``f"{key_prefix}/grad/{name}"``; unnamed parameters are
    ``"group.index"``), ``kv`` is a store, a mode name or None (this process's dist store, or
    'dist_sync' under the launcher, else 'local'), ``op`` 'average' (Horovod's, DDP's) or 'sum'
    (MXNet's).  ``key_prefix`` defaults to ``f"distopt{i}"``, i counting the wrappers made without
    one on this store.  ``backward_passes_per_step``: backward passes that may accumulate into the
    gradients before each ``step()`` (one more raises RuntimeError out of ``backward()``).  Parameters
    that take no gradient (``requires_grad=False``, integer dtypes) are skipped.  ``compression``: the
    store's gradient compression ('fp16', 'bf16', '2bit', '1bit' or the dict of
    ``set_gradient_compression``), set on ``kv`` now (collective; before the store's first push).
    Sparse gradients (``nn.Embedding(sparse=True)``) go through row-sparse keys and stay sparse (for
    ``torch.optim.SparseAdam``), or are made dense first with ``sparse_as_dense``.  Raises ValueError for
    a bad ``op``, ``backward_passes_per_step`` or parameters, TypeError for something that is no torch
    optimizer or a parameter dtype the store does not carry.

    ``process_set`` (worker ranks or a :class:`kvstore.WorkerSet`, Horovod's name) reduces over those
    workers only: its keys are that worker set's (docs/worker-sets.md), only its members construct and
    step it, 'average' divides by its size, and sparse gradients are made dense.  Give members a
    ``key_prefix`` unless every member makes the same wrappers in the same order.  Raises
    :class:`NotAMemberError` on a worker outside it, ValueError with ``compression`` (set the store's
    compression on every worker instead).
    """
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, not {op!r}")
    if type(backward_passes_per_step) is not int or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, not {backward_passes_per_step!r}")
    named = _named(named_parameters) if named_parameters is not None else []
    ordered = _check_params(optimizer, named)
    base = type(optimizer)
    if isinstance(optimizer, _Distributed):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    cls = type(f"Distributed{base.__name__}", (_Distributed, base), {"__module__": __name__})
    store = _store(kv)
    members = worker_set(process_set, store.num_workers)
    if members is not None:
        if store.rank not in members:
            raise NotAMemberError(f"worker {store.rank} is not in process set {members}: only its members "
                                  "construct and step its DistributedOptimizer (docs/worker-sets.md)")
        if compression not in (None, "none"):
            raise ValueError("compression is the store's, set by every worker: call "
                             "kv.set_gradient_compression on every worker instead of passing it with a "
                             "process_set")
        sparse_as_dense = True  # row-sparse keys belong to every worker
    if compression not in (None, "none"):
        store.set_gradient_compression({"type": compression} if isinstance(compression, str) else compression)
    prefix = f"distopt{_next(store, 'optimizer')}" if key_prefix is None else key_prefix
    return cls(optimizer, store, op, prefix, ordered, backward_passes_per_step, bool(sparse_as_dense),
               members)

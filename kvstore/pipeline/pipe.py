"""``Pipeline``: a model's layers cut into stages run by the workers of a cluster.

Rank r runs stage r % K of replica r // K (``schedule.stage_of``); a stage runs one part of the
model, or ``virtual`` non-adjacent parts under the interleaved schedule (``topology.Topology``).
``step`` cuts the first stage's batch into micro-batches, streams activations forward and
gradients backward between the parts (the main boundary, a tensor or a tuple of tensors, and skip
connections straight to the part that uses them; ``link.StageLink``) in the order of the chosen
schedule (``schedule.ops``), and leaves each stage's gradients in its parameters' ``.grad``: the
gradients of ``loss_fn`` over the whole batch, as one process would get them when ``loss_fn``
averages over the batch.  docs/pipeline.md.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvstore.base import KVStore
from kvstore.client.store import DistKVStore
from kvstore.errors import ConfigError, DTypeMismatchError, ShapeMismatchError
from kvstore.net.protocol import Op
from kvstore.pipeline import batchnorm
from kvstore.pipeline import device as device_
from kvstore.pipeline import layers as layers_
from kvstore.pipeline import schedule as plan_
from kvstore.pipeline.link import MAX_ARRAYS, StageLink
from kvstore.pipeline.memory import SavedBytes
from kvstore.pipeline.stash import WeightStash
from kvstore.pipeline.topology import Topology


def trainer_args(params: Any, kvstore: KVStore | str | None, overlap: bool | None,
                 workers: Any) -> tuple[Any, KVStore | str | None, bool | None, Any]:
    """A Trainer's (params, kvstore, overlap, workers) with a Pipeline as params: its stage's parameters,
    the Pipeline's store, no overlap, each key's worker set (the stage's replicas; a tied module's, every
    stage holding it); else unchanged.  Raises ConfigError for a stage without trainable parameters."""
    if not isinstance(params, Pipeline):
        return params, kvstore, overlap, workers
    named = list(params.named_parameters())
    if not any(p.requires_grad for _, p in named):  # its Trainer would miss the others' collectives
        raise ConfigError(f"{params.names[params.kv.rank]} holds no trainable parameter (balance "
                          f"{params.balance}): a Trainer over a Pipeline needs one in every stage")
    store = params.kv if kvstore is None else kvstore
    # The stage's own keys first, in model order, then the tied ones by name: every stage that holds a
    # tied key calls the store for it in the same order, so no two stages wait for each other's calls
    # in opposite orders (a model of several runs makes a store call per run).
    tied = {name for name, members in params.key_workers().items() if members != params.stage_ranks}
    named = [(n, p) for n, p in named if n not in tied] + sorted((n, p) for n, p in named if n in tied)
    return named, store, False, params.key_workers() if workers is None else workers


def part_name(stage: int, stages: int) -> str:
    """The file name of stage ``stage``'s part of a checkpoint of a ``stages``-stage Pipeline."""
    return f"stage-{stage}-of-{stages}"


def load_state_dict(directory: str) -> dict[str, Any]:
    """The whole model's state dict from a checkpoint :meth:`Pipeline.save` wrote, in one process (to
    evaluate or export the model: ``nn.Sequential(...).load_state_dict(load_state_dict(d))``).  Raises
    FileNotFoundError when a part is missing, FormatError for a damaged one."""
    import torch

    from kvstore.core import storage
    from kvstore.core.checkpoint import load_arrays

    parts = sorted(name for name in storage.listdir(directory) if name.startswith("stage-"))
    if not parts:
        raise FileNotFoundError(f"{directory} holds no pipeline checkpoint (stage-<i>-of-<K> files)")
    stages = int(parts[0].rsplit("-", 1)[1])
    state: dict[str, Any] = {}
    for stage in range(stages):
        arrays = load_arrays(storage.join(directory, part_name(stage, stages)))
        state.update({name: torch.from_numpy(array) for name, array in arrays.items()})
    return state


def _cut(balance: Sequence[int] | str | None, entries: list[Any], parts: int) -> list[int]:
    """Layers per part: ``balance`` checked, or by parameter count when None."""
    if balance is None:
        return plan_.balance_by_weight([layers_.parameter_count(e, i) for i, e in enumerate(entries)], parts)
    if isinstance(balance, str):
        raise ConfigError(f"balance {balance!r} is not known")
    return plan_.check_balance(balance, len(entries), parts)


# Pipelines made on each store in this process: every rank makes the same ones in the same order
_MADE: weakref.WeakKeyDictionary[DistKVStore, Iterator[int]] = weakref.WeakKeyDictionary()


def _default_store() -> DistKVStore:
    from kvstore.client.instance import process_store

    kv = process_store()
    if kv is None:
        raise ConfigError("a Pipeline needs a dist store: call kvstore.create('dist_sync') first or pass kv=")
    return kv


class Pipeline:
    """Stage ``rank % stages`` of ``module`` on this worker, built and held by this rank alone; ``step``
    trains one mini-batch through every stage (call it on every rank).  Raises :class:`ConfigError` for
    a bad argument."""

    def __init__(self, module: Any, stages: int, balance: Sequence[int] | str | None = None, chunks: int = 1,
                 schedule: str = "gpipe", checkpoint: str = "except_last", kv: KVStore | None = None,
                 deferred_batch_norm: bool = False,
                 optimizer: Callable[[Iterable[Any]], Any] | None = None, seed: int = 0,
                 virtual: int = 1, sample: Any = None, device: Any = None) -> None:
        import torch

        entries = layers_.described(module)
        roles = layers_.Roles(entries)
        if type(virtual) is not int or virtual < 1:
            raise ConfigError(f"virtual must be an int >= 1 (model parts per stage), not {virtual!r}")
        plan_.ops(schedule, max(stages, 1), max(chunks, 1), 0, virtual)  # checks the name and virtual
        plan_.checkpointed(checkpoint, 0, 1)
        if type(chunks) is not int or chunks < 1:
            raise ConfigError(f"chunks must be an int >= 1, not {chunks!r}")
        if type(seed) is not int or seed < 0:
            raise ConfigError(f"seed must be an int >= 0, not {seed!r}")
        store = kv if kv is not None else _default_store()
        if not isinstance(store, DistKVStore):
            raise ConfigError(f"a Pipeline needs a dist store (dist_sync), not {store.type!r}")
        self.kv = store
        self.ident = next(_MADE.setdefault(store, itertools.count()))  # names this Pipeline's own keys
        self.stages, self.chunks, self.schedule, self.checkpoint = stages, chunks, schedule, checkpoint
        self.virtual = virtual
        self.replicas = plan_.check_workers(self.kv.num_workers, stages)
        self.stage, self.replica = plan_.stage_of(self.kv.rank, stages)
        self.device = device_.stage_device(device, self.stage)
        parts = stages * virtual
        cut = _cut(balance, entries, parts)
        self.topology = Topology(stages, virtual, self.replicas, cut, roles)
        self.balance = self.topology.balance  # layers per part (per stage when virtual == 1)
        self.local = self.topology.local_parts(self.stage)  # the parts this rank runs, in chunk order
        self.offset = self.topology.offsets[self.local[0]]  # the index of this stage's first layer
        if schedule == "pipedream" and any(len(held) > 1 for held in self.topology.tied_stages().values()):
            raise ConfigError("schedule 'pipedream' updates each stage on its own: a Tied module cannot be "
                              "shared across its stages")
        self._shared: dict[str, Any] = {}  # tied key -> the module a place on this stage built
        self.parts = [layers_.Part(*self._own_layers(module, entries, roles, part, seed, deferred_batch_norm))
                      for part in self.local]
        self.module = self.parts[0] if virtual == 1 else torch.nn.ModuleList(self.parts)
        self.deferred = batchnorm.deferred_in(self.module)  # their running stats move once per step
        self.stash = self._stash(optimizer)  # before the link opens: a ConfigError leaves no socket
        self._release_others(entries)  # once nothing can fail: a refused Pipeline leaves the model whole
        rank = self.kv.rank
        self.names = {r: f"stage {r % stages} (worker {r})" for r in range(self.kv.num_workers)}
        self.prev = rank - 1 if self.stage > 0 else None
        self.next = rank + 1 if self.stage < stages - 1 else None
        self.link = StageLink(self.kv, self.topology.routes(self.stage, self.replica), self.names,
                              chunks=self.chunks)
        self.mover = device_.Mover(self.device, self.link.send, self.link.timeout, self.names[rank])
        self.steps = 0
        self.max_held = 0  # the most micro-batches whose activations this stage held at once (last step)
        self._averaged = False  # whether average_replicas has made its keys
        self._tied_keys = False  # whether sum_tied_grads has made its keys
        self.saved = SavedBytes(self._weights)  # measured bytes saved for backward (peak_saved_bytes)
        self.signatures: dict[tuple[int, str], list[tuple[str, int]]] = {}  # channel -> (dtype, ndim) each

    def _own_layers(self, module: Any, entries: list[Any], roles: layers_.Roles, part: int, seed: int,
                    deferred: bool) -> list[Any]:
        """Part ``part``'s layers, built or materialised here (a tied place under its first place's seed,
        sharing the module of a place built before on this stage; deferred batch norms converted, written
        back into a caller's ``nn.Sequential``)."""
        import torch

        own = []
        shared = self._shared
        for index in self.topology.layer_range(part):
            entry = entries[index]
            layer = layers_.materialise(entry, roles.seed_index(index), seed)
            if index in roles.tied:
                key = roles.tied[index]
                if key in shared and layer.module is not shared[key]:
                    layer = layers_.TiedLayer(key, shared[key], layer.apply)
                shared.setdefault(key, layer.module)
            if deferred:
                layer = batchnorm.convert(layer)
            layer = layer.to(self.device)  # in place: a caller's module moves with it
            if isinstance(module, torch.nn.Sequential) and layer is not entry:
                module[index] = layer  # the caller's model holds what the stage trains
            own.append(layer)
        return own

    def _release_others(self, entries: list[Any]) -> None:
        """Move the other stages' built layers to ``meta`` in place, freeing their storage (a layer that
        shares a tensor with this stage's, a tied place, is left as it is)."""
        import torch

        mine = {index for part in self.local for index in self.topology.layer_range(part)}
        kept = {id(t) for t in self._tensors(self.module)}
        for index, entry in enumerate(entries):
            if index not in mine and isinstance(entry, torch.nn.Module):
                if not any(id(t) in kept for t in self._tensors(entry)):
                    layers_.release(entry)

    @staticmethod
    def _tensors(module: Any) -> Iterable[Any]:
        yield from module.parameters()
        yield from module.buffers()

    def _weights(self) -> Iterable[Any]:
        """This stage's weights, and under 'pipedream' the snapshots of them its forwards run on."""
        yield from self.module.parameters()
        if self.stash is not None:
            yield from self.stash.weights()

    @property
    def peak_saved_bytes(self) -> int:
        """The most bytes of tensors autograd held for this stage's backwards at once during the last
        step (measured with saved-tensor hooks; weights not counted)."""
        return self.saved.peak

    def _stash(self, optimizer: Callable[[Iterable[Any]], Any] | None) -> WeightStash | None:
        """The weight stash of schedule 'pipedream' (None for the synchronous schedules); ConfigError
        for a missing optimizer."""
        if self.schedule != "pipedream":
            return None
        return WeightStash(self.module, optimizer)

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first stage (it feeds the inputs)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self.stage == self.stages - 1

    def parameters(self) -> Iterable[Any]:
        """This stage's parameters (a module shared by tied places once)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterable[tuple[str, Any]]:
        """This stage's parameters, named as in the whole model's ``nn.Sequential`` (e.g. ``2.weight``
        for the stage that holds layer 2; a tied module's by its first place, as torch names a shared
        module's): what a Trainer over a Pipeline keeps in the store."""
        seen: set[int] = set()
        roles = self.topology.roles
        for part, layers in zip(self.local, self.parts):
            for index, layer in zip(self.topology.layer_range(part), layers):
                for name, p in layer.named_parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield f"{roles.seed_index(index)}.{name}", p

    def key_workers(self) -> dict[str, list[int]]:
        """The worker set of each of :meth:`named_parameters`' names: the stage's replicas, and for a tied
        module's parameters every replica of every stage that holds a place of it."""
        tied = self.topology.tied_stages()
        roles = self.topology.roles
        out: dict[str, list[int]] = {}
        for name, _ in self.named_parameters():
            index = int(name.split(".", 1)[0])
            stages = tied[roles.tied[index]] if index in roles.tied else [self.stage]
            out[name] = sorted(r * self.stages + s for s in stages for r in range(self.replicas))
        return out

    def _layers(self) -> Iterable[tuple[int, Any]]:
        """(index in the whole model, layer) of every layer this stage runs."""
        for part, layers in zip(self.local, self.parts):
            yield from zip(self.topology.layer_range(part), layers)

    def state_dict(self) -> dict[str, Any]:
        """This stage's parameters and buffers, named as in the whole model (``2.weight``; each place of
        a tied module under its own index, as ``nn.Sequential.state_dict`` names them)."""
        return {f"{index}.{name}": value for index, layer in self._layers()
                for name, value in layer.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load this stage's entries of ``state`` (the whole model's or this stage's, named as in
        :meth:`state_dict`; other stages' entries are ignored).  Raises KeyError (``strict``) when one of
        this stage's entries is missing, and torch's errors for a wrong shape."""
        for index, layer in self._layers():
            prefix = f"{index}."
            mine = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
            wanted = set(layer.state_dict())
            if strict and not wanted <= set(mine):
                missing = sorted(prefix + name for name in wanted - set(mine))
                raise KeyError(f"{self.names[self.kv.rank]}: the state has no {missing[:4]}")
            layer.load_state_dict(mine, strict=strict)

    def stage_parameters(self) -> set[int]:
        """``id()`` of each parameter this rank's stage holds."""
        return {id(p) for p in self.module.parameters()}

    @property
    def stage_ranks(self) -> list[int]:
        """The workers running this stage (one per replica): the worker set of the stage's keys."""
        return [replica * self.stages + self.stage for replica in range(self.replicas)]

    def average_replicas(self) -> None:
        """Collective over this stage's replicas: each ends with the mean of their weights, through the
        store's keys ``pipeline.<i>.<name>`` in the stage's worker set (i numbers the Pipelines made on
        the store) (made at the first call; no other
        stage's keys are touched).  'pipedream' calls it after each step when a stage has replicas.  The
        store must have no optimizer (a round stores the sum of the members' pushes); raises the store's
        errors."""
        named = list(self.named_parameters())
        if not named:
            return
        keys = [f"pipeline.{self.ident}.{name}" for name, _ in named]
        if not self._averaged:
            self.kv.init(keys, [p.detach() for _, p in named], workers=self.stage_ranks)
            self._averaged = True
        self.kv.push(keys, [p.detach() / self.replicas for _, p in named])
        self.kv.pull(keys, out=[p.data for _, p in named])

    def sum_tied_grads(self) -> None:
        """Collective over the stages that hold a place of a tied module (one replica: without a Trainer,
        which sums them itself): each place's ``.grad`` becomes the sum of every place's, through the
        store's keys ``pipeline.<i>.tied.<replica>.<name>`` (made at the first call) in a worker set of the
        replica's ranks holding it.  The store must have no optimizer; raises the store's errors."""
        import torch

        tied = self.topology.tied_stages()
        roles = self.topology.roles
        for key in sorted(tied):
            if len(tied[key]) < 2 or self.stage not in tied[key]:
                continue
            named = [(n, p) for n, p in self.named_parameters()
                     if int(n.split(".", 1)[0]) in roles.tied and roles.tied[int(n.split(".", 1)[0])] == key]
            keys = [f"pipeline.{self.ident}.tied.{self.replica}.{n}" for n, _ in named]
            members = [self.replica * self.stages + s for s in tied[key]]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in named]
            if not self._tied_keys:
                self.kv.init(keys, [torch.zeros_like(g) for g in grads], workers=members)
            self.kv.pushpull(keys, [g.detach() for g in grads], out=[g for g in grads])
            for (_, p), g in zip(named, grads):
                p.grad = g
        self._tied_keys = True

    def save(self, directory: str) -> None:
        """Collective: write this model's checkpoint to ``directory`` (a path or storage URL), one file
        per stage (``stage-<i>-of-<K>``, :func:`kvstore.checkpoint.save_arrays`'s format) written by the
        stage's first replica, then a barrier, so every part exists when any rank returns.  Raises
        OSError, DTypeMismatchError for a dtype the format does not hold, and the barrier's errors."""
        from kvstore.core import storage
        from kvstore.core.checkpoint import save_arrays

        if self.replica == 0:
            storage.makedirs(directory)
            save_arrays(storage.join(directory, part_name(self.stage, self.stages)), self.state_dict())
        self.kv.barrier()

    def load(self, directory: str) -> None:
        """Load this stage's part of a checkpoint :meth:`save` wrote (any rank, any time; a model cut
        at the same balance).  Raises FileNotFoundError, FormatError, KeyError as
        :meth:`load_state_dict`."""
        import torch

        from kvstore.core import storage
        from kvstore.core.checkpoint import load_arrays

        arrays = load_arrays(storage.join(directory, part_name(self.stage, self.stages)))
        self.load_state_dict({name: torch.from_numpy(array) for name, array in arrays.items()})

    def close(self) -> None:
        """Close this stage's sockets."""
        self.link.close()

    def step(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], Any], scale_grads: bool = True,
             return_outputs: bool = False) -> Any:
        """Forward and backward one mini-batch through the pipeline; gradients accumulate in this
        stage's ``.grad`` (no other parameter exists here).  The first stage passes ``x`` (a tensor or a
        tuple of tensors, cut along dim 0), the last ``y`` (others may pass None).  ``scale_grads``: each
        micro-batch's loss is weighted by its share of the batch, so a ``loss_fn`` that averages gives the
        whole batch's mean and its gradients; False sums the micro-batches' losses as they are (a
        ``loss_fn`` with ``reduction='sum'`` then gives the batch's sum).  Returns the mini-batch's loss on
        the last stage, None elsewhere; with ``return_outputs`` a pair ``(loss, outputs)``, the last
        stage's outputs of the whole batch (detached; None elsewhere).  Under 'pipedream' with stage
        replicas, each stage's weights are then averaged over its replicas (:meth:`average_replicas`; the
        store must have no optimizer).

        Raises ConfigError (a missing x or y), ShapeMismatchError / DTypeMismatchError naming both
        stages, DeadlineExceededError naming the stage waited for, NodeLostError, and RemoteError
        when another stage failed the step (every peer is told, so no stage hangs).
        """
        self.steps += 1
        try:
            loss, outputs = _Run(self, x, y, loss_fn, scale_grads, return_outputs).go()
            for norm in self.deferred:
                norm.commit()
            if self.stash is not None and self.replicas > 1:  # 'pipedream' replicas: averaged weights
                self.average_replicas()
            return (loss, outputs) if return_outputs else loss
        except BaseException as exc:
            for norm in self.deferred:
                norm.commit(apply=False)
            self.mover.pending.clear()  # a failed step's outputs go nowhere
            self.link.abort(f"{self.names[self.kv.rank]}: {type(exc).__name__}: {exc}", self.steps)
            raise

    def predict(self, x: Any) -> Any:
        """Forward only, for evaluation (call it on every rank of the replica): the first stage passes the
        inputs ``x`` (others None), cut into ``chunks`` micro-batches; every stage runs in eval mode
        under ``torch.no_grad`` (no autograd graph, nothing saved, the live weights under 'pipedream').
        Returns the whole batch's output on the last stage, None elsewhere.  Raises as :meth:`step`."""
        import torch

        self.steps += 1
        modes = [m.training for m in self.module.modules()]
        self.module.eval()
        try:
            with torch.no_grad():
                return _Run(self, x, None, None).predict()
        except BaseException as exc:
            self.mover.pending.clear()
            self.link.abort(f"{self.names[self.kv.rank]}: {type(exc).__name__}: {exc}", self.steps)
            raise
        finally:
            for module, mode in zip(self.module.modules(), modes):
                module.training = mode


class _Held:
    """What one (micro-batch, part) forward left for its backward: the tensors received (per channel
    name, "" the main boundary), and the outputs sent or the loss (per channel name)."""

    def __init__(self, inputs: dict[str, list[Any]], outputs: dict[str, list[Any]]) -> None:
        self.inputs, self.outputs = inputs, outputs


class _Run:
    """One ``step`` (or ``predict``) of one stage: its micro-batches, what it holds, the ops it runs."""

    def __init__(self, pipe: Pipeline, x: Any, y: Any, loss_fn: Callable[[Any, Any], Any] | None,
                 scale_grads: bool = True, return_outputs: bool = False) -> None:
        self.pipe, self.link, self.loss_fn, self.step = pipe, pipe.link, loss_fn, pipe.steps
        self.top = pipe.topology
        self.me = pipe.names[pipe.kv.rank]
        if pipe.is_first and x is None:
            raise ConfigError(f"{self.me} is the first stage: its step needs the inputs x")
        if pipe.is_last and y is None and loss_fn is not None:
            raise ConfigError(f"{self.me} is the last stage: its step needs the targets y")
        self.x, self.y = x, y
        self.scale, self.return_outputs = scale_grads, return_outputs
        self.sizes: list[int] = plan_.split_sizes(_batch(x, self.me), pipe.chunks) if pipe.is_first else []
        # the caller's x: a boundary tensor that is a view of it is copied before it is sent (zmq sends
        # big frames without a copy, after the call that queued them has returned)
        self.callers = {t.untyped_storage().data_ptr() for t in _elements(x)} if pipe.is_first else set()
        self.first: dict[str, list[Any]] | None = None  # micro-batch 0's inputs of the first part
        self.held: dict[tuple[int, int], _Held] = {}  # (mb, chunk) -> what its backward needs
        self.outputs: list[Any] = []  # the last part's outputs, when asked for
        self.forms: dict[tuple[int, str], int | None] = {}  # channel -> None (a tensor) or tuple length
        self.shapes: dict[tuple[int, str], list[tuple]] = {}  # channel -> trailing shapes this step
        self.loss = 0.0
        self.peak = 0

    def _begin(self) -> int:
        """Learn the number of micro-batches: the first stage from x, the others from micro-batch 0's
        activation (every schedule's first op is micro-batch 0's forward of the stage's first part)."""
        if not self.pipe.is_first:
            self.first = self._inputs(0, self.pipe.local[0])
        return len(self.sizes)

    def go(self) -> tuple[float | None, Any]:
        pipe = self.pipe
        if pipe.stash is not None:
            pipe.stash.begin_step()
        pipe.saved.begin_step()
        chunks = self._begin()
        if pipe.is_last and _batch(self.y, self.me) != sum(self.sizes):
            raise ShapeMismatchError(f"{self.me} got {_batch(self.y, self.me)} targets for a batch of "
                                     f"{sum(self.sizes)}")
        for kind, mb, c in plan_.ops(pipe.schedule, pipe.stages, chunks, pipe.stage, pipe.virtual):
            for norm in pipe.deferred:
                norm.begin(mb)  # a checkpointed forward recomputed in B mb is not counted again
            self._forward(mb, c) if kind == "F" else self._backward(mb, c)
        pipe.mover.flush(wait=True)
        pipe.max_held = self.peak
        if not pipe.is_last:
            return None, None
        return self.loss, (_cat(self.outputs) if self.return_outputs else None)

    def predict(self) -> Any:
        """Every micro-batch's forward on the live weights (the caller holds ``torch.no_grad``), the
        stage's parts in turn; the outputs concatenated on the last stage, else None."""
        chunks = self._begin()
        outputs = []
        for mb in range(chunks):
            for part, layers in zip(self.pipe.local, self.pipe.parts):
                inputs = self._take_first(mb, part)
                main = inputs.pop("")
                out, kept = layers(main[0] if len(main) == 1 and self._lone(part) else tuple(main),
                                   {name: _value(v, self._form(part, name)) for name, v in inputs.items()})
                if part == self.top.parts - 1:
                    outputs.append(out)
                else:
                    self._send_outputs(mb, part, out, kept)
        self.pipe.mover.flush(wait=True)
        return _cat(outputs) if self.pipe.is_last else None

    # -- inputs -------------------------------------------------------------------------------
    def _take_first(self, mb: int, part: int) -> dict[str, list[Any]]:
        if mb == 0 and part == self.pipe.local[0] and self.first is not None:
            first, self.first = self.first, None
            return first
        return self._inputs(mb, part)

    def _inputs(self, mb: int, part: int) -> dict[str, list[Any]]:
        """Micro-batch ``mb``'s inputs of ``part``, per channel name ("" the main boundary): slices of x,
        or tensors received (checked), each a leaf that requires grad when it is floating point."""
        import torch

        if part == 0:
            start = sum(self.sizes[:mb])
            inputs = {"": [self.pipe.mover.place(t[start:start + self.sizes[mb]]) for t in _elements(self.x)]}
            self.forms[(0, "")] = None if isinstance(self.x, torch.Tensor) else len(inputs[""])
        else:
            inputs = {"": self._receive_activation(mb, part, "")}
        for name in self.top.skips_in(part):
            inputs[name] = self._receive_activation(mb, part, name)
        return inputs

    def _receive(self, op: Op, mb: int, part: int, name: str) -> tuple[list[Any], dict]:
        """A message of this step from the link; what this stage's GPU copies hold back is sent first
        when it has to wait (the peer may be waiting for it)."""
        if (op, self.step, mb, part, name) not in self.link.inbox:
            self.pipe.mover.flush(wait=True)
        return self.link.receive(op, self.step, mb, part, name)

    def _receive_activation(self, mb: int, part: int, name: str) -> list[Any]:
        import torch

        arrays, body = self._receive(Op.PIPE_ACT, mb, part, name)
        frm = self.pipe.names[self.link.routes[(Op.PIPE_ACT, part, name)]]
        if mb == 0 and name == "" and not self.sizes:
            self.sizes = _sizes(body.get("sizes"), self.me, frm)
            if len(self.sizes) > self.pipe.chunks:
                raise ConfigError(f"{self.me} was made with chunks={self.pipe.chunks}, and {frm} cut its "
                                  f"batch into {len(self.sizes)} micro-batches: every stage needs the same "
                                  "chunks")
        form = body.get("tuple")
        if not (form is None and len(arrays) == 1) and not (type(form) is int and form == len(arrays)):
            raise ShapeMismatchError(f"{self.me} received from {frm} a malformed boundary of micro-batch "
                                     f"{mb}")
        self.forms[(part, name)] = form
        self._check_activation(arrays, mb, part, name, frm)
        tensors = self.pipe.mover.arrive(arrays)
        grad = torch.is_grad_enabled()
        return [t.requires_grad_(grad and t.is_floating_point()) for t in tensors]

    def _lone(self, part: int) -> bool:
        return self._form(part, "") is None

    def _form(self, part: int, name: str) -> int | None:
        return self.forms.get((part, name))

    def _check_activation(self, arrays: list[Any], mb: int, part: int, name: str, frm: str) -> None:
        """Raise ShapeMismatchError / DTypeMismatchError naming both stages when a received boundary does
        not fit: a float dtype other than the part's layers', a first dimension other than the micro-batch
        size (the main boundary's first tensor), another width than the first Linear's, or another number
        of tensors, dtypes or ranks than the channel's first micro-batch had."""
        what = "an activation" + (f" (skip {name!r})" if name else "")
        layers = self.pipe.parts[self.pipe.local.index(part)]
        params = [p for p in layers.parameters() if p.is_floating_point()]
        want = _dtype(params[0]) if params else None
        for array in arrays:
            if want is not None and array.dtype.kind == "f" and str(array.dtype) != want:
                raise DTypeMismatchError(f"{self.me} received from {frm} {what} of dtype {array.dtype} "
                                         f"for micro-batch {mb}; its layers take {want}")
        signature = [(str(a.dtype), a.ndim) for a in arrays]
        seen = self.pipe.signatures.setdefault((part, name), signature)
        if signature != seen:
            raise ShapeMismatchError(f"{self.me} received from {frm} {what} for micro-batch {mb} of "
                                     f"{_describe(arrays)}; it expects {len(seen)} tensor(s) of "
                                     f"(dtype, rank) {seen}, as its first micro-batch had")
        trailing = [tuple(a.shape[1:]) for a in arrays]
        step_seen = self.shapes.setdefault((part, name), trailing)
        if trailing != step_seen:
            raise ShapeMismatchError(f"{self.me} received from {frm} {what} for micro-batch {mb} of "
                                     f"{_describe(arrays)}; the step's first micro-batch had trailing "
                                     f"shapes {step_seen}")
        if name:
            return
        first = next((layer for layer in layers if not isinstance(layer, layers_.Save)), None)
        features = getattr(first, "in_features", None) if len(arrays) == 1 else None
        shape = tuple(arrays[0].shape)
        if not shape or shape[0] != self.sizes[mb] or (features is not None and shape[-1] != features):
            expected = f"({self.sizes[mb]}, ..., {features})" if features else f"({self.sizes[mb]}, ...)"
            raise ShapeMismatchError(f"{self.me} received from {frm} an activation of shape {shape} for "
                                     f"micro-batch {mb}; it expects {expected}")

    # -- forward ------------------------------------------------------------------------------
    def _forward(self, mb: int, c: int) -> None:
        pipe, part = self.pipe, self.pipe.local[c]
        inputs = self._take_first(mb, part)
        main = inputs[""]
        arg = main[0] if len(main) == 1 and self._lone(part) else tuple(main)
        skips = {name: _value(v, self._form(part, name)) for name, v in inputs.items() if name}
        last = part == self.top.parts - 1
        with pipe.saved.forward((mb, c)):
            out, kept = self._run(pipe.parts[c], arg, skips, mb, c)
            if last:
                outputs = {"": [self._loss(mb, out)]}
        if last:
            if self.return_outputs:
                self.outputs.append(_detached(out))
        else:
            outputs = self._send_outputs(mb, part, out, kept)
        self.held[(mb, c)] = _Held(inputs, outputs)
        self.peak = max(self.peak, len(self.held))

    def _run(self, layers: Any, arg: Any, skips: dict[str, Any], mb: int, c: int) -> tuple[Any, dict]:
        """The part's output and the skips it keeps for micro-batch ``mb`` (on its stashed weights under
        'pipedream'), under a checkpoint when the mode says so."""
        def run(fn: Callable[..., Any], *args: Any) -> Any:
            if plan_.checkpointed(self.pipe.checkpoint, mb, len(self.sizes)):
                from torch.utils.checkpoint import checkpoint

                return checkpoint(fn, *args, use_reentrant=False)
            return fn(*args)

        if self.pipe.stash is not None:
            return self.pipe.stash.forward(mb, (arg, skips), run)
        return run(layers, arg, skips)

    def _loss(self, mb: int, out: Any) -> Any:
        """Micro-batch ``mb``'s loss (weighted by its share of the batch when the loss is averaged and the
        stage updates once per batch); adds it to the step's."""
        start = sum(self.sizes[:mb])
        target = self.pipe.mover.place(_slice(self.y, start, self.sizes[mb]))
        share = self.sizes[mb] / sum(self.sizes) if self.scale else 1.0
        loss = self.loss_fn(out, target)
        if self.pipe.stash is None:  # one update per batch: the batch's loss; else per micro-batch
            loss = loss * share
            self.loss += float(loss.detach())
        else:
            self.loss += float(loss.detach()) * share
        return loss

    def _send_outputs(self, mb: int, part: int, out: Any, kept: dict[str, Any]) -> dict[str, list[Any]]:
        """Send micro-batch ``mb``'s main output to the next part and each kept skip to the part that uses
        it (with the micro-batch sizes at micro-batch 0); the tensors sent, per channel name."""
        import torch

        sent: dict[str, list[Any]] = {}
        for name, value, dest in [("", out, part + 1)] + [
                (n, kept[n], self.top.skips[n][1]) for n in self.top.skips_out(part)]:
            tensors = _tensors(value, f"{self.me}'s output" + (f" for skip {name!r}" if name else ""))
            body: dict[str, Any] = {"step": self.step, "mb": mb, "part": dest, "name": name}
            if not isinstance(value, torch.Tensor):
                body["tuple"] = len(tensors)
            if mb == 0 and name == "":
                body["sizes"] = self.sizes
            owned = [t.clone() if t.untyped_storage().data_ptr() in self.callers else t for t in tensors]
            self.pipe.mover.post(self.top.rank(dest, self.pipe.replica), Op.PIPE_ACT, body, owned)
            sent[name] = tensors
        return sent

    # -- backward -----------------------------------------------------------------------------
    def _backward(self, mb: int, c: int) -> None:
        import torch

        pipe, part = self.pipe, self.pipe.local[c]
        held = self.held.pop((mb, c))
        outs: list[Any] = []
        grads: list[Any] = []
        if part == self.top.parts - 1:
            outs, grads = held.outputs[""], [None]
        else:
            for name, tensors in held.outputs.items():
                for index, grad in self._receive_gradient(mb, part, name, tensors):
                    outs.append(tensors[index])
                    grads.append(grad)
        leaves = [t for name in held.inputs for t in held.inputs[name]]
        if pipe.stash is not None:
            got = pipe.stash.backward(mb, outs, grads, leaves)
        else:
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            got = [t.grad if t.requires_grad else None for t in leaves]
        pipe.saved.release((mb, c))
        at = 0
        for name, tensors in held.inputs.items():
            mine = got[at:at + len(tensors)]
            at += len(tensors)
            if name == "" and part == 0:
                continue  # the inputs x need no gradient
            dest = part - 1 if name == "" else self.top.skips[name][0]
            present = [i for i, g in enumerate(mine) if g is not None]
            pipe.mover.post(self.top.rank(dest, pipe.replica), Op.PIPE_GRAD,
                            {"step": self.step, "mb": mb, "part": dest, "name": name, "present": present},
                            [mine[i] for i in present])

    def _receive_gradient(self, mb: int, part: int, name: str, outs: list[Any]) -> list[tuple[int, Any]]:
        """The gradients the part that took ``name`` (or the next part) sent for ``outs``: (index, grad)
        of each output that has one; ShapeMismatchError naming both stages for a wrong one."""
        arrays, body = self._receive(Op.PIPE_GRAD, mb, part, name)
        frm = self.pipe.names[self.link.routes[(Op.PIPE_GRAD, part, name)]]
        present = body.get("present", [0] if len(arrays) == 1 and len(outs) == 1 else None)
        if (not isinstance(present, list) or len(present) != len(arrays) or len(set(present)) != len(present)
                or not all(type(i) is int and 0 <= i < len(outs) for i in present)):
            raise ShapeMismatchError(f"{self.me} received from {frm} a malformed gradient of micro-batch "
                                     f"{mb}")
        for index, array in zip(present, arrays):
            out = outs[index]
            if tuple(array.shape) != tuple(out.shape) or str(array.dtype) != _dtype(out):
                raise ShapeMismatchError(f"{self.me} received from {frm} a gradient of {array.dtype} "
                                         f"{tuple(array.shape)} for micro-batch {mb}; its output was "
                                         f"{out.dtype} {tuple(out.shape)}")
        return list(zip(present, self.pipe.mover.arrive(arrays)))


def _elements(value: Any) -> list[Any]:
    """A boundary value's tensors: itself, or a tuple's or list's elements."""
    import torch

    return [value] if isinstance(value, torch.Tensor) else list(value)


def _tensors(value: Any, what: str) -> list[Any]:
    """The tensors of a value sent across a boundary; ConfigError for anything but a tensor or a tuple
    (or list) of tensors."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        if len(value) > MAX_ARRAYS:
            raise ConfigError(f"{what} is a tuple of {len(value)} tensors: a stage boundary carries at most "
                              f"{MAX_ARRAYS} (stack them)")
        return list(value)
    raise ConfigError(f"{what} crosses a stage boundary: it must be a tensor or a tuple of tensors, not "
                      f"{type(value).__name__}")


def _value(tensors: list[Any], form: int | None) -> Any:
    """Received tensors as the value they were: one tensor, or a tuple."""
    return tensors[0] if form is None and len(tensors) == 1 else tuple(tensors)


def _batch(value: Any, me: str) -> int:
    """The batch size of x or y (a tensor, or a tuple of tensors cut alike)."""
    elements = _elements(value)
    sizes = {len(e) for e in elements}
    if len(sizes) != 1:
        raise ShapeMismatchError(f"{me}: the tensors of one batch have different first dimensions {sizes}")
    return sizes.pop()


def _slice(value: Any, start: int, size: int) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value[start:start + size]
    return type(value)(v[start:start + size] for v in value)


def _detached(value: Any) -> Any:
    import torch

    return value.detach() if isinstance(value, torch.Tensor) else tuple(v.detach() for v in value)


def _cat(outputs: list[Any]) -> Any:
    """Micro-batches' outputs as one batch's: concatenated (element-wise for tuples)."""
    import torch

    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs))


def _describe(arrays: list[Any]) -> str:
    return ", ".join(f"{a.dtype} {tuple(a.shape)}" for a in arrays)


def _sizes(value: Any, me: str, frm: str) -> list[int]:
    """The micro-batch sizes the first stage announced; ProtocolError-free check, ShapeMismatchError."""
    if not (isinstance(value, list) and 0 < len(value) <= 1 << 16
            and all(type(v) is int and v > 0 for v in value)):
        raise ShapeMismatchError(f"{me} received from {frm} a first micro-batch without valid sizes")
    return value


def _dtype(tensor: Any) -> str:
    """A tensor's dtype as numpy names it (``float64``)."""
    return str(tensor.dtype).replace("torch.", "")

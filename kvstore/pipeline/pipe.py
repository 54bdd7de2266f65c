"""``Pipeline``: an ``nn.Sequential`` cut into stages run by the workers of a cluster.

Rank r runs stage r % K of replica r // K (``schedule.stage_of``).  ``step`` cuts the
first stage's batch into micro-batches, streams activations forward and gradients
backward between neighbouring stages (``link.StageLink``) in the order of the chosen
schedule (``schedule.plan``), and leaves each stage's gradients in its parameters'
``.grad``: the gradients of ``loss_fn`` over the whole batch, as one process would get
them when ``loss_fn`` averages over the batch.  docs/pipeline.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvstore.base import KVStore
from kvstore.client.store import DistKVStore
from kvstore.errors import ConfigError, DTypeMismatchError, ShapeMismatchError
from kvstore.net.protocol import Op
from kvstore.pipeline import batchnorm
from kvstore.pipeline import layers as layers_
from kvstore.pipeline import schedule as plan_
from kvstore.pipeline.link import StageLink
from kvstore.pipeline.memory import SavedBytes
from kvstore.pipeline.stash import WeightStash


def trainer_args(params: Any, kvstore: KVStore | str | None, overlap: bool | None,
                 workers: Any) -> tuple[Any, KVStore | str | None, bool | None, Any]:
    """A Trainer's (params, kvstore, overlap, workers) with a Pipeline as params: its stage's parameters,
    the Pipeline's store, no overlap, the stage's replicas as the keys' worker set; else unchanged.
    Raises ConfigError for a stage without trainable parameters."""
    if not isinstance(params, Pipeline):
        return params, kvstore, overlap, workers
    named = list(params.named_parameters())
    if not any(p.requires_grad for _, p in named):  # its Trainer would miss the others' collectives
        raise ConfigError(f"{params.names[params.kv.rank]} holds no trainable parameter (balance "
                          f"{params.balance}): a Trainer over a Pipeline needs one in every stage")
    store = params.kv if kvstore is None else kvstore
    return named, store, False, params.stage_ranks if workers is None else workers


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

    def __init__(self, module: Any, stages: int, balance: Sequence[int] | None = None, chunks: int = 1,
                 schedule: str = "gpipe", checkpoint: str = "except_last", kv: KVStore | None = None,
                 deferred_batch_norm: bool = False,
                 optimizer: Callable[[Iterable[Any]], Any] | None = None, seed: int = 0) -> None:
        import torch

        entries = layers_.described(module)
        plan_.plan(schedule, max(stages, 1), max(chunks, 1), 0)  # checks the name
        plan_.checkpointed(checkpoint, 0, 1)
        if type(chunks) is not int or chunks < 1:
            raise ConfigError(f"chunks must be an int >= 1, not {chunks!r}")
        if type(seed) is not int or seed < 0:
            raise ConfigError(f"seed must be an int >= 0, not {seed!r}")
        store = kv if kv is not None else _default_store()
        if not isinstance(store, DistKVStore):
            raise ConfigError(f"a Pipeline needs a dist store (dist_sync), not {store.type!r}")
        self.kv = store
        self.stages, self.chunks, self.schedule, self.checkpoint = stages, chunks, schedule, checkpoint
        self.replicas = plan_.check_workers(self.kv.num_workers, stages)
        self.stage, self.replica = plan_.stage_of(self.kv.rank, stages)
        self.balance = (plan_.check_balance(balance, len(entries), stages) if balance is not None
                        else plan_.balance_by_weight([layers_.parameter_count(e, i) for i, e in
                                                      enumerate(entries)], stages))
        self.offset = sum(self.balance[:self.stage])  # the index of this stage's first layer in the model
        self.module = torch.nn.Sequential(*self._own_layers(module, entries, seed, deferred_batch_norm))
        self.deferred = batchnorm.deferred_in(self.module)  # their running stats move once per step
        self.stash = self._stash(optimizer)  # before the link opens: a ConfigError leaves no socket
        self._release_others(entries)  # once nothing can fail: a refused Pipeline leaves the model whole
        rank = self.kv.rank
        self.names = {r: f"stage {r % stages} (worker {r})" for r in range(self.kv.num_workers)}
        self.prev = rank - 1 if self.stage > 0 else None
        self.next = rank + 1 if self.stage < stages - 1 else None
        self.link = StageLink(self.kv, self.prev, self.next, self.names, chunks=self.chunks)
        self.steps = 0
        self.max_held = 0  # the most micro-batches whose activations this stage held at once (last step)
        self._averaged = False  # whether average_replicas has made its keys
        self.saved = SavedBytes(self._weights)  # measured bytes saved for backward (peak_saved_bytes)

    def _own_layers(self, module: Any, entries: list[Any], seed: int, deferred: bool) -> list[Any]:
        """This stage's layers, built or materialised here (deferred batch norms converted, written back
        into a caller's ``nn.Sequential``)."""
        import torch

        own = []
        for index in range(self.offset, self.offset + self.balance[self.stage]):
            entry = entries[index]
            layer = layers_.materialise(entry, index, seed)
            if deferred:
                layer = batchnorm.convert(layer)
            if isinstance(module, torch.nn.Sequential) and layer is not entry:
                module[index] = layer  # the caller's model holds what the stage trains
            own.append(layer)
        return own

    def _release_others(self, entries: list[Any]) -> None:
        """Move the other stages' built layers to ``meta`` in place, freeing their storage."""
        import torch

        for index, entry in enumerate(entries):
            if not self.offset <= index < self.offset + self.balance[self.stage] and isinstance(
                    entry, torch.nn.Module):
                layers_.release(entry)

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
        """This stage's parameters."""
        return self.module.parameters()

    def named_parameters(self) -> Iterable[tuple[str, Any]]:
        """This stage's parameters, named as in the whole model's ``nn.Sequential`` (e.g. ``2.weight``
        for the stage that holds layer 2): what a Trainer over a Pipeline keeps in the store."""
        for index, layer in enumerate(self.module):
            for name, p in layer.named_parameters():
                yield f"{self.offset + index}.{name}", p

    def state_dict(self) -> dict[str, Any]:
        """This stage's parameters and buffers, named as in the whole model (``2.weight``)."""
        return {f"{self.offset + index}.{name}": value for index, layer in enumerate(self.module)
                for name, value in layer.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load this stage's entries of ``state`` (the whole model's or this stage's, named as in
        :meth:`state_dict`; other stages' entries are ignored).  Raises KeyError (``strict``) when one of
        this stage's entries is missing, and torch's errors for a wrong shape."""
        for index, layer in enumerate(self.module):
            prefix = f"{self.offset + index}."
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
        store's keys ``pipeline.<name>`` in the stage's worker set (made at the first call; no other
        stage's keys are touched).  'pipedream' calls it after each step when a stage has replicas.  The
        store must have no optimizer (a round stores the sum of the members' pushes); raises the store's
        errors."""
        named = list(self.named_parameters())
        if not named:
            return
        keys = [f"pipeline.{name}" for name, _ in named]
        if not self._averaged:
            self.kv.init(keys, [p.detach() for _, p in named], workers=self.stage_ranks)
            self._averaged = True
        self.kv.push(keys, [p.detach() / self.replicas for _, p in named])
        self.kv.pull(keys, out=[p.data for _, p in named])

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

    def step(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], Any]) -> float | None:
        """Forward and backward one mini-batch through the pipeline; gradients accumulate in this
        stage's ``.grad`` (no other parameter exists here).  The first stage passes ``x``, the last
        ``y`` (others may pass None).  Returns the mini-batch's loss on the last stage, None elsewhere.
        Under 'pipedream' with stage replicas, each stage's weights are then averaged over its replicas
        (:meth:`average_replicas`; the store must have no optimizer).

        Raises ConfigError (a missing x or y), ShapeMismatchError / DTypeMismatchError naming both
        stages, DeadlineExceededError naming the stage waited for, NodeLostError, and RemoteError
        when another stage failed the step (every neighbour is told, so no stage hangs).
        """
        self.steps += 1
        try:
            loss = _Run(self, x, y, loss_fn).go()
            for norm in self.deferred:
                norm.commit()
            if self.stash is not None and self.replicas > 1:  # 'pipedream' replicas: averaged weights
                self.average_replicas()
            return loss
        except BaseException as exc:
            for norm in self.deferred:
                norm.commit(apply=False)
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
            self.link.abort(f"{self.names[self.kv.rank]}: {type(exc).__name__}: {exc}", self.steps)
            raise
        finally:
            for module, mode in zip(self.module.modules(), modes):
                module.training = mode


class _Run:
    """One ``step`` of one stage: its micro-batches, the activations it holds, the ops it runs."""

    def __init__(self, pipe: Pipeline, x: Any, y: Any, loss_fn: Callable[[Any, Any], Any] | None) -> None:
        self.pipe, self.link, self.loss_fn, self.step = pipe, pipe.link, loss_fn, pipe.steps
        self.me = pipe.names[pipe.kv.rank]
        if pipe.is_first and x is None:
            raise ConfigError(f"{self.me} is the first stage: its step needs the inputs x")
        if pipe.is_last and y is None and loss_fn is not None:
            raise ConfigError(f"{self.me} is the last stage: its step needs the targets y")
        self.x, self.y = x, y
        self.sizes: list[int] = plan_.split_sizes(len(x), pipe.chunks) if pipe.is_first else []
        self.inputs: dict[int, Any] = {}
        self.held: dict[int, tuple[Any, Any]] = {}  # mb -> (its input, its output or scaled loss)
        self.loss = 0.0
        self.peak = 0

    def go(self) -> float | None:
        if self.pipe.stash is not None:
            self.pipe.stash.begin_step()
        self.pipe.saved.begin_step()
        first = self._input(0)  # every schedule begins with micro-batch 0's forward
        self.inputs[0] = first
        if self.pipe.is_last and len(self.y) != sum(self.sizes):
            raise ShapeMismatchError(f"{self.me} got {len(self.y)} targets for a batch of {sum(self.sizes)}")
        for kind, mb in plan_.plan(self.pipe.schedule, self.pipe.stages, len(self.sizes), self.pipe.stage):
            for norm in self.pipe.deferred:
                norm.begin(mb)  # a checkpointed forward recomputed in B mb is not counted again
            self._forward(mb) if kind == "F" else self._backward(mb)
        self.pipe.max_held = self.peak
        return self.loss if self.pipe.is_last else None

    def predict(self) -> Any:
        """Every micro-batch's forward on the live weights (the caller holds ``torch.no_grad``); the
        outputs concatenated on the last stage, else None."""
        import torch

        outputs = []
        mb = 0
        while True:
            inp = self._input(mb)  # the first stage knows the sizes; the others learn them from mb 0
            out = self.pipe.module(inp)
            if self.pipe.is_last:
                outputs.append(out)
            else:
                self._send_activation(mb, out)
            mb += 1
            if mb == len(self.sizes):
                return torch.cat(outputs) if self.pipe.is_last else None

    def _input(self, mb: int) -> Any:
        """Micro-batch ``mb``'s input: a slice of x, or the previous stage's activation (checked)."""
        import torch

        if self.pipe.is_first:
            start = sum(self.sizes[:mb])
            return self.x[start:start + self.sizes[mb]]
        array, body = self.link.receive(Op.PIPE_ACT, self.step, mb)
        if mb == 0:
            self.sizes = _sizes(body.get("sizes"), self.me, self.pipe.names[self.pipe.prev])
        self._check_activation(array, mb)
        with warnings.catch_warnings():  # a read-only frame: autograd never writes to its input
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        return tensor.requires_grad_(tensor.is_floating_point())

    def _check_activation(self, array: Any, mb: int) -> None:
        frm = self.pipe.names[self.pipe.prev]
        params = [p for p in self.pipe.module.parameters() if p.is_floating_point()]
        want = _dtype(params[0]) if params else None
        if want is not None and str(array.dtype) != want:
            raise DTypeMismatchError(f"{self.me} received from {frm} an activation of dtype {array.dtype} "
                                     f"for micro-batch {mb}; its layers take {want}")
        features = getattr(self.pipe.module[0], "in_features", None)
        shape = tuple(array.shape)
        if not shape or shape[0] != self.sizes[mb] or (features is not None and shape[-1] != features):
            expected = f"({self.sizes[mb]}, ..., {features})" if features else f"({self.sizes[mb]}, ...)"
            raise ShapeMismatchError(f"{self.me} received from {frm} an activation of shape {shape} for "
                                     f"micro-batch {mb}; it expects {expected}")

    def _run(self, inp: Any, mb: int) -> Any:
        """The stage's output for micro-batch ``mb`` (on its stashed weights under 'pipedream')."""
        def run(fn: Callable[[Any], Any], x: Any) -> Any:
            if plan_.checkpointed(self.pipe.checkpoint, mb, len(self.sizes)):
                from torch.utils.checkpoint import checkpoint

                return checkpoint(fn, x, use_reentrant=False)
            return fn(x)

        if self.pipe.stash is not None:
            return self.pipe.stash.forward(mb, inp, run)
        return run(self.pipe.module, inp)

    def _forward(self, mb: int) -> None:
        inp = self.inputs.pop(mb) if mb in self.inputs else self._input(mb)
        with self.pipe.saved.forward(mb):
            out = self._run(inp, mb)
            if self.pipe.is_last:
                start = sum(self.sizes[:mb])
                target = self.y[start:start + self.sizes[mb]]
                share = self.sizes[mb] / sum(self.sizes)
                out = self.loss_fn(out, target)
                if self.pipe.stash is None:  # one update per batch: the batch's loss; else per micro-batch
                    out = out * share
        if self.pipe.is_last:
            self.loss += float(out.detach()) * (1 if self.pipe.stash is None else share)
        else:
            self._send_activation(mb, out.detach())
        self.held[mb] = (inp, out)
        self.peak = max(self.peak, len(self.held))

    def _send_activation(self, mb: int, out: Any) -> None:
        """Send micro-batch ``mb``'s output to the next stage (with the micro-batch sizes on the first)."""
        body = {"step": self.step, "mb": mb}
        if mb == 0:
            body["sizes"] = self.sizes
        self.link.send(self.pipe.next, Op.PIPE_ACT, body, [out.contiguous().numpy()])

    def _backward(self, mb: int) -> None:
        import torch

        inp, out = self.held.pop(mb)
        if self.pipe.is_last:
            grad = self._apply(mb, inp, out, None)
        else:
            array, _ = self.link.receive(Op.PIPE_GRAD, self.step, mb)
            frm = self.pipe.names[self.pipe.next]
            if tuple(array.shape) != tuple(out.shape) or str(array.dtype) != _dtype(out):
                raise ShapeMismatchError(f"{self.me} received from {frm} a gradient of {array.dtype} "
                                         f"{tuple(array.shape)} for micro-batch {mb}; its output was "
                                         f"{out.dtype} {tuple(out.shape)}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                grad = self._apply(mb, inp, out, torch.from_numpy(array))
        self.pipe.saved.release(mb)
        if not self.pipe.is_first:
            grad = grad if grad is not None else torch.zeros_like(inp)
            self.link.send(self.pipe.prev, Op.PIPE_GRAD, {"step": self.step, "mb": mb},
                           [grad.contiguous().numpy()])


    def _apply(self, mb: int, inp: Any, out: Any, grad: Any) -> Any:
        """Backward ``out`` (with ``grad`` unless it is the loss); the gradient of ``inp`` or None.
        Under 'pipedream' the stash computes it on the forward's weights and updates the stage."""
        if self.pipe.stash is not None:
            return self.pipe.stash.backward(mb, out, grad, inp)
        out.backward(grad)
        return inp.grad


def _sizes(value: Any, me: str, frm: str) -> list[int]:
    """The micro-batch sizes the first stage announced; ProtocolError-free check, ShapeMismatchError."""
    if not (isinstance(value, list) and 0 < len(value) <= 1 << 16
            and all(type(v) is int and v > 0 for v in value)):
        raise ShapeMismatchError(f"{me} received from {frm} a first micro-batch without valid sizes")
    return value


def _dtype(tensor: Any) -> str:
    """A tensor's dtype as numpy names it (``float64``)."""
    return str(tensor.dtype).replace("torch.", "")

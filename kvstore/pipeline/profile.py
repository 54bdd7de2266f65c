"""Balance a pipeline by measured cost: each layer's forward+backward time, or its memory, on a sample.

:func:`layer_costs` builds the layers one at a time (never the whole model: no rank may be able to hold
it), runs the sample forward through them in order and measures each layer alone: its input is detached
(``requires_grad`` on float tensors, as a stage receives an activation; the first layer gets the sample
as given), so its backward stops at its own input.  ``'time'`` is the median time of a forward and a
backward after a warm-up, on a timer (wall time by default; the idea of torchgpipe's
``balance_by_time``); ``'memory'`` is the bytes a training stage holds for the layer: its parameters,
their gradients and ``optimizer_states`` copies of them (1 for momentum SGD, 2 for Adam), its buffers,
and the activations autograd saves for its backward on the sample (counted with saved-tensor hooks as
:mod:`kvstore.pipeline.memory` does: each storage once, weights not counted).

:func:`agreed_costs` gives every worker worker 0's measurement through the store, so that every rank cuts
the model the same way, and :func:`choose` is the ``balance`` argument of a Pipeline turned into layers
per stage (the measured modes cut with a slack of :data:`SLACK`).  docs/pipeline.md, "Balance by
measured cost"; tests/unit/test_pipeline_profile.py, tests/integration/test_pipeline_balance.py.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore.base import KVStore
from kvstore.errors import ConfigError, DeadlineExceededError, RemoteError
from kvstore.pipeline import layers as layers_
from kvstore.pipeline import schedule as plan_
from kvstore.pipeline.memory import SavedBytes

MODES = ("parameters", "time", "memory")  # what ``balance=`` may name (or a list of layers per stage)
MEASURED = ("time", "memory")  # the modes measured on a sample
REPEATS = 5  # timed runs of each layer (their median is its time), after WARMUP untimed ones
WARMUP = 1
SLACK = 0.05  # a measured cut's costliest stage may cost this much more than least, for a more even cut
Timer = Callable[[], float]  # seconds, e.g. time.perf_counter (wall) or time.thread_time (this thread's CPU)

_calls: weakref.WeakKeyDictionary[KVStore, int] = weakref.WeakKeyDictionary()  # agreed_costs calls per store
_calls_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class _How:
    """How layers are measured: ``repeats`` timed runs after ``warmup`` (on ``timer``), the optimizer
    states per trainable parameter that ``'memory'`` counts, and the ``device`` layers run on (None:
    where they are built).  Raises ConfigError for a bad count."""

    repeats: int
    optimizer_states: int
    warmup: int
    timer: Timer
    device: Any = None

    def __post_init__(self) -> None:
        for name, least in (("repeats", 1), ("optimizer_states", 0), ("warmup", 0)):
            count = getattr(self, name)
            if type(count) is not int or count < least:
                raise ConfigError(f"{name} must be an int >= {least}, not {count!r}")
        if not callable(self.timer):
            raise ConfigError(f"timer must be a callable returning seconds, not {self.timer!r}")


def layer_costs(entries: Sequence[Any], sample: Any, mode: str, seed: int = 0, repeats: int = REPEATS,
                optimizer_states: int = 1, *, warmup: int = WARMUP, timer: Timer = time.perf_counter,
                device: Any = None) -> list[float]:
    """One cost per layer of ``entries`` (as a Pipeline takes them: modules, meta modules, factories),
    measured on ``sample`` (a micro-batch for the first layer): seconds of forward+backward on ``timer``
    (``'time'``; wall time by default, ``time.thread_time`` counts this thread's CPU only, which a shared
    machine's load hardly moves when torch runs on one thread) or bytes (``'memory'``).  Layers are built
    one at a time under a Pipeline's per-layer seeds and dropped after; a built module is measured as it
    is and left unchanged (no ``.grad``, buffers restored).  With a ``device`` (a stage's, e.g.
    ``'cuda:0'``) the sample and each layer run there: a built module elsewhere is measured on a copy
    moved there, one layer at a time.  Raises ConfigError for an unknown mode or device, a missing sample
    or a bad count, and whatever a layer raises on its input."""
    how = _How(repeats, optimizer_states, warmup, timer, device)
    return list(_each_cost(list(entries), sample, mode, seed, how))


def agreed_costs(kv: KVStore, entries: Sequence[Any], sample: Any, mode: str, seed: int = 0,
                 repeats: int = REPEATS, optimizer_states: int = 1, *, warmup: int = WARMUP,
                 timer: Timer = time.perf_counter, device: Any = None) -> list[float]:
    """Worker 0's :func:`layer_costs`, on every worker (collective: every worker calls it, with the same
    entries; only worker 0 builds and runs any layer, and only worker 0 needs ``sample``).  The costs travel
    through ``kv.broadcast`` under a key of their own per call (``pipeline.costs.<n>``, n counting this
    store's calls).  The other workers wait for worker 0 at the store's init barrier, whose deadline is
    ``KVSTORE_REQUEST_TIMEOUT``: when the measurement takes longer, they raise DeadlineExceededError, and
    so does worker 0 when it comes to the barrier they left.  Raises ConfigError for an unknown mode or a
    bad count (on every worker); when worker 0's measurement fails, worker 0 raises its error and the
    others RemoteError naming the layer, without waiting out a deadline."""
    import numpy as np

    entries = list(entries)
    _check_mode(mode, MEASURED)
    how = _How(repeats, optimizer_states, warmup, timer, device)
    with _calls_lock:
        n = _calls.get(kv, 0)
        _calls[kv] = n + 1
    # the costs, then the index of the layer whose measurement failed (-1: none), so that no worker waits
    # for costs that will not come; every worker sends the same shape, as init's agreement check wants
    value = np.zeros(len(entries) + 1, np.float64)
    error: Exception | None = None
    if kv.rank == 0:
        value[-1], index = -1.0, 0
        try:
            for cost in _each_cost(entries, sample, mode, seed, how):
                value[index], index = cost, index + 1
        except Exception as exc:  # told to the others first, then raised here
            value[-1], error = float(index), exc
    out = np.zeros_like(value)
    try:
        kv.broadcast(f"pipeline.costs.{n}", value, out=out)
    except DeadlineExceededError as exc:
        raise DeadlineExceededError(
            f"{exc}, while worker 0 measured the layers' {mode} for balance={mode!r}: a measurement longer "
            "than KVSTORE_REQUEST_TIMEOUT needs a higher one, or a balance given as a list (measured once "
            "with kvstore.pipeline.profile.layer_costs)") from exc
    if error is not None:
        raise error
    if out[-1] >= 0:
        raise RemoteError(f"worker 0 failed to measure the {mode} of layer {int(out[-1])} on its sample (its "
                          "own error says why), so no balance by measured cost was agreed")
    return [float(c) for c in out[:-1]]


def choose(balance: str | Sequence[int] | None, entries: Sequence[Any], parts: int, kv: KVStore | None,
           sample: Any, seed: int = 0, repeats: int = REPEATS, optimizer_states: int = 1, *,
           warmup: int = WARMUP, timer: Timer = time.perf_counter, device: Any = None) -> list[int]:
    """Layers per stage for a Pipeline's ``balance``: None or ``'parameters'`` (the contiguous cut whose
    heaviest stage holds the fewest parameters, counted without allocating), ``'time'`` or ``'memory'``
    (of the contiguous cuts of the costs :func:`agreed_costs` measures on ``sample`` whose costliest
    stage costs at most ``1 + SLACK`` times the least it can, the one whose cheapest stage costs most;
    collective, needs ``kv``), or a list of ``parts`` positive ints summing to the number of layers.
    Raises ConfigError for anything else, and as :func:`agreed_costs`."""
    entries = list(entries)
    if balance is None or balance == "parameters":
        return plan_.balance_by_weight([layers_.parameter_count(e, i) for i, e in enumerate(entries)], parts)
    if isinstance(balance, str):
        _check_mode(balance, MODES)
        if kv is None:
            raise ConfigError(f"balance={balance!r} is measured on worker 0 and shared through a store: "
                              "pass kv=")
        if parts < 1 or len(entries) < parts:  # before anyone measures, on every worker alike
            raise ConfigError(f"cannot cut {len(entries)} layers into {parts} stages (each stage needs a "
                              "layer)")
        costs = agreed_costs(kv, entries, sample, balance, seed, repeats, optimizer_states, warmup=warmup,
                             timer=timer, device=device)
        return plan_.balance_by_weight(costs, parts, slack=SLACK)
    if isinstance(balance, Sequence):
        return plan_.check_balance(balance, len(entries), parts)
    raise ConfigError(f"balance must be None, one of {', '.join(map(repr, MODES))}, or a list of layers per "
                      f"stage, not {balance!r}")


def _check_mode(mode: Any, allowed: Sequence[str]) -> None:
    if not isinstance(mode, str) or mode not in allowed:
        raise ConfigError(f"balance mode {mode!r} is not one of {', '.join(map(repr, allowed))}")


def _each_cost(entries: list[Any], sample: Any, mode: str, seed: int, how: _How) -> Iterator[float]:
    """Each layer's cost in turn (see :func:`layer_costs`); checks its arguments before the first."""
    import torch

    _check_mode(mode, MEASURED)
    if sample is None:
        raise ConfigError(f"balance={mode!r} measures the layers on a sample batch: pass sample= (a "
                          "micro-batch of the first stage's input)")
    roles = layers_.Roles(entries)
    device = _device(how.device)
    x, skips = _detached(_moved(sample, device), grad=False), {}
    with torch.random.fork_rng(devices=[]):  # dropout & co. draw here: the caller's generator stays put
        for index, entry in enumerate(entries):
            with _built(entry, roles.seed_index(index), seed, device) as layer:
                if mode == "time":
                    cost, x, skips = _timed(layer, x, skips, how)
                else:
                    cost, x, skips = _sized(layer, x, skips, how.optimizer_states)
                x, skips = _detached(x), {k: _detached(v) for k, v in skips.items()}  # its graph goes
            del layer  # freed before the next layer is built
            yield cost


@contextlib.contextmanager
def _built(entry: Any, index: int, seed: int, device: Any) -> Iterator[Any]:
    """Layer ``index`` built for measuring on ``device`` (None: where it is built): a factory's or a meta
    module's copy's, or a copy of a built module elsewhere (dropped after), or a built module as it is,
    whose buffers (batch norm's running statistics) are restored after."""
    import torch

    if isinstance(entry, torch.nn.Module) and not layers_.on_meta(entry) and not _on(entry, device):
        yield copy.deepcopy(entry).to(device)  # the caller's module stays where it is
        return
    if isinstance(entry, torch.nn.Module) and not layers_.on_meta(entry):
        kept = [(b, b.detach().clone()) for b in entry.buffers()]
        try:
            yield entry
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)
        return
    if isinstance(entry, torch.nn.Module):  # on meta: the caller's module stays there for the Pipeline
        entry = copy.deepcopy(entry)
    layer = layers_.materialise(entry, index, seed)
    yield layer if device is None else layer.to(device)


def _device(device: Any) -> Any:
    """``device`` as a torch device (None stays None; a CUDA device without an index gets the current
    one); ConfigError when torch does not know it."""
    import torch

    if device is None:
        return None
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {device!r} is not a torch device: {exc}") from None
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def _on(module: Any, device: Any) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device`` (None: wherever it is)."""
    tensors = [*module.parameters(), *module.buffers()]
    return device is None or all(t.device == device for t in tensors)


def _moved(value: Any, device: Any) -> Any:
    """``value`` with each tensor (in tuples and lists too) on ``device`` (None: as it is)."""
    import torch

    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(item, device) for item in value)
    return value


def _timed(layer: Any, x: Any, skips: dict[str, Any], how: _How) -> tuple[float, Any, dict[str, Any]]:
    """The median seconds of ``layer``'s forward+backward on ``x`` over ``how.repeats`` runs after its
    warm-up ones; its output and the skips after it (the last run's)."""
    times: list[float] = []
    seeds: list[Any] | None = None  # the output gradients, made once: a stage receives them, never makes them
    for run in range(how.warmup + how.repeats):
        trial = dict(skips)  # a Take pops its skip: each run starts from the same ones
        timed = run >= how.warmup
        start = how.timer() if timed else 0.0
        out = layers_.run([layer], x, trial)
        seeds = _backward(layer, out, [x, *skips.values()], seeds)
        _synchronise(out)
        if timed:
            times.append(how.timer() - start)
    return statistics.median(times), out, trial


def _sized(layer: Any, x: Any, skips: dict[str, Any], states: int) -> tuple[float, Any, dict[str, Any]]:
    """The bytes a training stage holds for ``layer``: parameters, and for each trainable one its gradient
    and ``states`` optimizer copies, buffers, and the activations autograd saves for its backward on ``x``
    (each storage once, weights not counted); its output and the skips after it."""
    params = {id(p): p for p in layer.parameters()}.values()  # a module shared by two places: once
    held = sum(_nbytes(p) * (2 + states if p.requires_grad else 1) for p in params)
    held += sum(_nbytes(b) for b in layer.buffers())
    saved = SavedBytes(lambda: iter(params))
    trial = dict(skips)
    with saved.forward(0):
        out = layers_.run([layer], x, trial)
    return float(held + saved.total), out, trial


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def _tensors(value: Any) -> Iterator[Any]:
    """The tensors of ``value`` (a tensor, or tuples and lists of them, nested)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _detached(value: Any, grad: bool = True) -> Any:
    """``value`` cut from its graph: each tensor detached, float ones requiring grad (``grad``; else as
    they were), as a stage receives its input; tuples and lists keep their shape, anything else is kept."""
    import torch

    if isinstance(value, torch.Tensor):
        wants = value.is_floating_point() and (grad or value.requires_grad)
        return value.detach().requires_grad_(wants)
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(item, grad) for item in value)
    return value


def _backward(layer: Any, out: Any, inputs: list[Any], seeds: list[Any] | None) -> list[Any] | None:
    """The backward of ``layer``'s ``out`` to its inputs and parameters with ``torch.autograd.grad``
    (nothing is accumulated into any ``.grad``), from ``seeds``, or from a gradient of ones per float
    output that has a graph when None; returns the gradients it started from."""
    import torch

    outs = [t for t in _tensors(out) if t.grad_fn is not None]
    if not outs:
        return seeds
    if seeds is None:
        seeds = [torch.ones_like(t) for t in outs]
    leaves = {id(t): t for t in _tensors(inputs) if t.requires_grad}
    leaves.update({id(p): p for p in layer.parameters() if p.requires_grad})
    torch.autograd.grad(outs, list(leaves.values()), seeds, allow_unused=True)
    return seeds


def _synchronise(out: Any) -> None:
    """Wait for a GPU's queued work when ``out`` lives on one (its time would be the launch's otherwise)."""
    import torch

    if any(t.is_cuda for t in _tensors(out)):
        torch.cuda.synchronize()

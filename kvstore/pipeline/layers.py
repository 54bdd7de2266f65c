"""A pipeline's layers described without being built, and each built by the one stage that runs it.

A Pipeline takes its layers in one of three forms (docs/pipeline.md, "Stage-local models"):

- built modules (an ``nn.Sequential`` or a list): every rank has them; a rank keeps its stage's and
  moves the others to torch's ``meta`` device (:func:`release`), which frees their storage;
- modules on the ``meta`` device (``with torch.device("meta"): model = nn.Sequential(...)``): a rank
  materialises only its stage's (``to_empty`` then each submodule's ``reset_parameters()``);
- factories: a :class:`LayerSpec` (``LayerSpec(nn.Linear, 64, 64)``) or any callable that returns a
  module: a rank calls only its stage's.

Layers built here (factories and meta modules) are initialised under a seed of their own, derived
from the Pipeline's ``seed`` and the layer's index (:func:`seeded`), so the weights do not depend on
which rank builds a layer or what it built before: :func:`build` makes the same whole model in one
process, the reference a stage-local run is compared with.

Three kinds of layer carry more than one tensor from layer to layer (docs/pipeline.md, "Real models"):
:class:`Save` and :class:`Take` make a skip connection (a tensor kept by one layer and used by a later
one, on the same stage or another), and :class:`Tied` shares one module between several places of the
model (an embedding and the output projection).  :func:`run` runs a list of layers with them; a layer
may also return a tuple, which the next layer receives as its one argument (as ``nn.Sequential``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

from kvstore.errors import ConfigError


class LayerSpec:
    """A layer described, not built: ``LayerSpec(nn.Linear, 64, 64)()`` builds ``nn.Linear(64, 64)``
    (DeepSpeed's ``LayerSpec``).  The stage that runs the layer builds it; the others never do."""

    def __init__(self, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if not callable(factory):
            raise ConfigError(f"a LayerSpec needs a module class or factory, not {factory!r}")
        self.factory, self.args, self.kwargs = factory, args, kwargs

    def __call__(self) -> Any:
        return self.factory(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        name = getattr(self.factory, "__name__", repr(self.factory))
        args = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"LayerSpec({name}, {', '.join(args)})" if args else f"LayerSpec({name})"


@functools.cache
def modules() -> SimpleNamespace:
    """The torch module classes of this file, :class:`Save`, :class:`Take`, :class:`TiedLayer` and
    :class:`Part`, made at their first use (kvstore never imports torch when a module loads);
    ``kvstore.pipeline.Save`` and the others are these."""
    import torch

    class Save(torch.nn.Module):
        """The identity, which also keeps its input under ``name`` for the later :class:`Take` of that name
        (a skip connection; the input may be a tensor or a tuple of tensors)."""

        def __init__(self, name: str) -> None:
            super().__init__()
            if not isinstance(name, str) or not name:
                raise ConfigError(f"a skip connection needs a non-empty str name, not {name!r}")
            self.name = name

        def forward(self, x: Any) -> Any:
            return x

        def extra_repr(self) -> str:
            return repr(self.name)


    class Take(torch.nn.Module):
        """Combines its input with what the :class:`Save` of ``name`` kept: ``combine(x, saved)``, by default
        ``x + saved`` (a residual).  ``combine`` may be a module (its parameters are this layer's) or any
        callable."""

        def __init__(self, name: str, combine: Callable[[Any, Any], Any] | None = None) -> None:
            super().__init__()
            if not isinstance(name, str) or not name:
                raise ConfigError(f"a skip connection needs a non-empty str name, not {name!r}")
            if combine is not None and not callable(combine):
                raise ConfigError(f"Take({name!r})'s combine must be callable, not {combine!r}")
            self.name = name
            self.combine = combine  # a module assigned here is registered as a submodule

        def forward(self, x: Any, saved: Any) -> Any:  # noqa: D102
            return x + saved if self.combine is None else self.combine(x, saved)

        def extra_repr(self) -> str:
            return repr(self.name)


    class TiedLayer(torch.nn.Module):
        """One place of a module shared under ``key``: ``forward(module, x)``, or ``module(x)``."""

        def __init__(self, key: str, module: Any, forward: Callable[[Any, Any], Any] | None = None) -> None:
            super().__init__()
            self.key, self.module, self.apply = key, module, forward

        def forward(self, x: Any) -> Any:
            return self.module(x) if self.apply is None else self.apply(self.module, x)

        def extra_repr(self) -> str:
            return repr(self.key)

    class Part(torch.nn.Sequential):
        """A run of a model's layers: a stage, or one of the parts an interleaved stage holds.  ``part(x)``
        runs them as ``nn.Sequential`` does; ``part(x, skips)`` also takes the skips earlier parts kept and
        returns ``(output, the skips kept here for later parts)`` (``skips`` is not changed: a checkpoint's
        recomputation calls it again with the same dict)."""

        def forward(self, x: Any, skips: dict[str, Any] | None = None) -> Any:  # noqa: D102
            if skips is None:
                return run(self, x, {})
            kept = dict(skips)
            return run(self, x, kept), kept

    for cls in (Save, Take, TiedLayer, Part):
        cls.__qualname__ = cls.__name__
    return SimpleNamespace(Save=Save, Take=Take, TiedLayer=TiedLayer, Part=Part)


LAZY = ("Save", "Take", "TiedLayer", "Part")


def __getattr__(name: str) -> Any:
    """``layers.Save`` and the other torch classes of :func:`modules`, made at first use."""
    if name in LAZY:
        return getattr(modules(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Tied:
    """A layer whose module is shared with every other ``Tied`` of the same ``key`` (DeepSpeed's
    TiedLayerSpec): ``factory()`` builds the module once (the first place's), each place runs
    ``forward(module, x)`` (``module(x)`` when None).  On a pipeline, each stage that holds a place
    builds the module under the first place's seed, and the places' gradients are summed through the
    store (the Trainer's key of the first place's name, in a worker set of the stages that hold it)."""

    def __init__(self, key: str, factory: Callable[[], Any],
                 forward: Callable[[Any, Any], Any] | None = None) -> None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"a tied layer needs a non-empty str key, not {key!r}")
        if not callable(factory) or (forward is not None and not callable(forward)):
            raise ConfigError(f"Tied({key!r}) needs a module factory and a callable forward (or None)")
        self.key, self.factory, self.forward = key, factory, forward

    def __call__(self) -> Any:
        return modules().TiedLayer(self.key, self.factory(), self.forward)

    def __repr__(self) -> str:
        return f"Tied({self.key!r}, {self.factory!r})"


def run(layers: Iterable[Any], x: Any, skips: dict[str, Any]) -> Any:
    """Run ``layers`` in order on ``x``: a :class:`Save` keeps its input in ``skips``, a :class:`Take`
    pops its name from ``skips`` (a KeyError names a skip that was not kept), any other layer takes the
    previous output as its one argument.  Returns the last output."""
    kinds = modules()
    for layer in layers:
        if isinstance(layer, kinds.Save):
            skips[layer.name] = x
        elif isinstance(layer, kinds.Take):
            if layer.name not in skips:
                raise KeyError(f"Take({layer.name!r}) runs before its Save")
            x = layer(x, skips.pop(layer.name))
        else:
            x = layer(x)
    return x


class Roles:
    """What each layer of a model is, read without building it: the skip names each layer keeps
    (``saves``) and uses (``takes``), and the key of each tied layer (``tied``).  Raises ConfigError for
    a skip kept or used twice, used before it is kept, or never used."""

    def __init__(self, entries: list[Any]) -> None:
        self.saves: dict[str, int] = {}  # skip name -> the index of the layer that keeps it
        self.takes: dict[str, int] = {}  # skip name -> the index of the layer that uses it
        self.tied: dict[int, str] = {}  # layer index -> its tied key
        self.first: dict[str, int] = {}  # tied key -> the index of its first place
        kinds = modules()
        for index, entry in enumerate(entries):
            layer = _peek(entry, index)
            if isinstance(layer, (kinds.Save, kinds.Take)):
                book = self.saves if isinstance(layer, kinds.Save) else self.takes
                if layer.name in book:
                    raise ConfigError(f"skip {layer.name!r} is {'kept' if book is self.saves else 'used'} "
                                      f"twice (layers {book[layer.name]} and {index})")
                if isinstance(layer, kinds.Take) and layer.name not in self.saves:
                    raise ConfigError(f"layer {index} uses skip {layer.name!r} before any layer keeps it")
                book[layer.name] = index
            key = layer.key if isinstance(layer, kinds.TiedLayer) else None
            if key is not None:
                self.tied[index] = key
                self.first.setdefault(key, index)
        self.count = len(entries)
        unused = sorted(set(self.saves) - set(self.takes))
        if unused:
            raise ConfigError(f"skip(s) {unused} kept but never used (a Take of each name must follow)")

    def seed_index(self, index: int) -> int:
        """The index whose seed layer ``index`` is built under: a tied layer's first place."""
        return self.first[self.tied[index]] if index in self.tied else index


def _peek(entry: Any, index: int) -> Any:
    """The module ``entry`` is or builds (a factory is built on the ``meta`` device: no memory)."""
    import torch

    if isinstance(entry, torch.nn.Module):
        return entry
    if isinstance(entry, LayerSpec) and entry.factory in (modules().Save, modules().Take):
        return entry()  # no parameters to allocate
    with torch.device("meta"):
        return _called(entry, index)


def described(model: Any) -> list[Any]:
    """The entries of ``model`` (an ``nn.Sequential`` or a list of modules and factories), each a module
    or a callable that builds one.  Raises ConfigError for anything else or an empty model."""
    import torch

    if isinstance(model, torch.nn.Sequential):
        entries = list(model)
    elif isinstance(model, (list, tuple)) and all(
            isinstance(e, torch.nn.Module) or callable(e) for e in model):
        entries = list(model)
    else:
        raise ConfigError("a Pipeline needs an nn.Sequential or a list of modules or layer factories "
                          f"(LayerSpec), not {type(model).__name__}")
    if not entries:
        raise ConfigError("a Pipeline needs at least one layer")
    return entries


def on_meta(module: Any) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the ``meta`` device (not allocated)."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def parameter_count(entry: Any, index: int) -> int:
    """The number of parameter elements of layer ``index``; a factory is built on the ``meta`` device to
    count them (no memory).  Raises ConfigError when a factory returns something other than a module."""
    import torch

    if isinstance(entry, torch.nn.Module):
        return sum(p.numel() for p in entry.parameters())
    with torch.device("meta"):
        layer = _called(entry, index)
    return sum(p.numel() for p in layer.parameters())


def layer_seed(seed: int, index: int) -> int:
    """The torch seed layer ``index`` is built under (a Pipeline's ``seed``; the same in one process)."""
    return (seed * 1_000_003 + index) % (1 << 63)


_SEEDING = threading.Lock()  # torch's generator is the process's: stages run as threads (tests) take turns


@contextlib.contextmanager
def seeded(seed: int, index: int) -> Iterator[None]:
    """Run the block with torch's CPU generator seeded for layer ``index``, then restore the caller's
    generator state (the stage's other random draws do not move).  One block at a time per process:
    stages that run as threads of one process would otherwise draw from each other's seeds (a thread
    that draws from torch's generator outside a build while another builds still moves it: torch has
    one generator per process; draw from a ``torch.Generator`` of your own there)."""
    import torch

    with _SEEDING, torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(layer_seed(seed, index))  # the CPU's only: CUDA's untouched
        yield


def materialise(entry: Any, index: int, seed: int) -> Any:
    """Layer ``index`` built for use: a built module as it is, a meta module allocated on the CPU and
    reset under its seed, a factory called under its seed.  Raises ConfigError for a meta module that
    holds parameters no ``reset_parameters()`` initialises or that another Pipeline released, or a
    factory that returns no module."""
    import torch

    if isinstance(entry, torch.nn.Module):
        if not on_meta(entry):
            return entry
        if getattr(entry, RELEASED, False):
            raise ConfigError(f"layer {index} was released to the meta device by another Pipeline made "
                              "from the same model object (its weights are gone): give each Pipeline its "
                              "own copy of a built model")
        with seeded(seed, index):
            entry.to_empty(device="cpu")
            _reset(entry, index)
        return entry
    with seeded(seed, index):
        return _called(entry, index)


RELEASED = "_kvstore_released_by_pipeline"  # set on a layer release() moved to meta


def release(layer: Any) -> None:
    """Free a built layer's storage: its parameters and buffers move to the ``meta`` device in place
    (the caller's model keeps the module and its shapes, with no memory behind them); the layer is
    marked, so that no Pipeline mistakes it for a meta layer to initialise afresh."""
    if not on_meta(layer):
        layer.to("meta")
        setattr(layer, RELEASED, True)


def build(model: Any, seed: int = 0) -> Any:
    """The whole model as one process gets it: a :class:`Part` (an ``nn.Sequential`` that runs skip
    connections) of every layer, built (factories) or materialised (meta modules) under the same
    per-layer seeds as a Pipeline's stages, tied places sharing one module.  Raises as
    :func:`materialise`."""
    entries = described(model)
    roles = Roles(entries)
    built: dict[str, Any] = {}  # tied key -> the module its first place built
    layers = []
    for index, entry in enumerate(entries):
        layer = materialise(entry, roles.seed_index(index), seed)
        if index in roles.tied:
            key = roles.tied[index]
            if key in built and layer.module is not built[key]:
                layer = modules().TiedLayer(key, built[key], layer.apply)  # the places share one module
            built.setdefault(key, layer.module)
        layers.append(layer)
    return modules().Part(*layers)


def _called(factory: Callable[[], Any], index: int) -> Any:
    import torch

    layer = factory()
    if not isinstance(layer, torch.nn.Module):
        raise ConfigError(f"layer {index}'s factory {factory!r} returned {type(layer).__name__}, not an "
                          "nn.Module")
    return layer


def _reset(module: Any, index: int) -> None:
    """Initialise a module just allocated by ``to_empty``: every submodule that owns parameters or
    buffers must have ``reset_parameters()`` (torch's ``_reset_parameters()`` of attention, or
    ``reset_running_stats()`` for buffers only).  Children are reset before their parent, as their
    constructors ran before the parent's (attention's reset zeroes its output projection's bias)."""
    for name, sub in _children_first(module):
        owns = (any(True for _ in sub.parameters(recurse=False))
                or any(True for _ in sub.buffers(recurse=False)))
        if not owns:
            continue
        reset = (getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
                 or getattr(sub, "reset_running_stats", None))
        if reset is None:
            where = f"{type(sub).__name__} at {name!r}" if name else type(sub).__name__
            raise ConfigError(f"layer {index} was built on the meta device, but its {where} has no "
                              "reset_parameters() to initialise it: build that layer with a LayerSpec "
                              "instead")
        reset()


def _children_first(module: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    """``(name, submodule)`` of ``module`` and everything under it, each child before its parent."""
    for child_name, child in module.named_children():
        yield from _children_first(child, f"{name}.{child_name}" if name else child_name)
    yield name, module

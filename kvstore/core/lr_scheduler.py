"""MXNet 1.x learning-rate schedulers as pure functions of the update count.

Users import it as ``kvstore.lr_scheduler`` (``kvstore/__init__.py`` binds that name to this module).

MXNet's schedulers keep hidden counters and decay ``base_lr`` in place as they
are called with growing ``num_update``.  Ours compute the same value from
``num_update`` and the constructor parameters alone, so a scheduler rebuilt from
its :meth:`~LRScheduler.spec` on a server, or asked about an earlier step, gives
the value MXNet's object gives when called with ``1, 2, 3, ...`` up to that step.

``base_lr`` is a public attribute: an optimizer given a scheduler sets it to its
own ``learning_rate``, as MXNet's does.  The warm-up's target and every schedule
follow the current ``base_lr``; MXNet's warm-up target and ``CosineScheduler``
keep the ``base_lr`` given to the constructor, silently ignoring the optimizer's
``learning_rate``.  Bad parameters raise :class:`~kvstore.errors.OptimizerError`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

import numpy as np

from kvstore.errors import OptimizerError

__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "CosineScheduler", "SCHEDULERS",
           "WARMUP_MODES", "from_spec"]

WARMUP_MODES = ("linear", "constant")


def real_param(name: str, value: Any, low: float | None = None, low_open: bool = False,
               high: float | None = None, high_open: bool = False) -> float:
    """Return ``value`` as a finite float in the given bounds; raise OptimizerError otherwise.

    Bools, NaN, infinities and non-numbers are refused.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise OptimizerError(f"{name} must be a real number, not {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        raise OptimizerError(f"{name} must be a finite real number, got {value!r}") from None
    if not math.isfinite(number):
        raise OptimizerError(f"{name} must be finite, got {number}")
    if low is not None and (number < low or (low_open and number == low)):
        raise OptimizerError(f"{name} must be {'>' if low_open else '>='} {low}, got {number}")
    if high is not None and (number > high or (high_open and number == high)):
        raise OptimizerError(f"{name} must be {'<' if high_open else '<='} {high}, got {number}")
    return number


def int_param(name: str, value: Any, low: int = 0, high: int = 2**63 - 1) -> int:
    """Return ``value`` as a plain int in ``[low, high]``; raise OptimizerError otherwise (bools refused)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
        raise OptimizerError(f"{name} must be an int, not {type(value).__name__} {value!r}")
    number = int(value)
    if not low <= number <= high:
        raise OptimizerError(f"{name} must be in [{low}, {high}], got {number}")
    return number


class LRScheduler:
    """Base class: the learning rate as a function of ``num_update`` (MXNet's ``LRScheduler``).

    For ``num_update < warmup_steps`` the rate warms up from ``warmup_begin_lr``:
    ``'linear'`` rises in equal steps towards ``base_lr``, ``'constant'`` stays at
    ``warmup_begin_lr``.  Subclasses define the rate after the warm-up.
    """

    name: ClassVar[str] = ""
    PARAMS: ClassVar[tuple[str, ...]] = ("base_lr", "warmup_steps", "warmup_begin_lr", "warmup_mode")

    def __init__(self, base_lr: float = 0.01, warmup_steps: int = 0, warmup_begin_lr: float = 0.0,
                 warmup_mode: str = "linear") -> None:
        """Check and keep the warm-up parameters; raise OptimizerError for a bad one."""
        self.warmup_steps = int_param("warmup_steps", warmup_steps)
        self.warmup_begin_lr = real_param("warmup_begin_lr", warmup_begin_lr, low=0.0)
        if not isinstance(warmup_mode, str) or warmup_mode not in WARMUP_MODES:
            raise OptimizerError(f"warmup_mode must be one of {WARMUP_MODES}, got {warmup_mode!r}")
        self.warmup_mode = warmup_mode
        self.base_lr = base_lr

    @property
    def base_lr(self) -> float:
        """The rate the warm-up reaches and the schedule decays from."""
        return self._base_lr

    @base_lr.setter
    def base_lr(self, value: float) -> None:
        """Set ``base_lr``; OptimizerError unless it is finite and ``>= warmup_begin_lr``."""
        value = real_param("base_lr", value, low=0.0)
        if value < self.warmup_begin_lr:
            raise OptimizerError(f"base_lr ({value}) must be >= warmup_begin_lr ({self.warmup_begin_lr})")
        self._base_lr = value

    def get_warmup_lr(self, num_update: int) -> float:
        """The rate at step ``num_update < warmup_steps``."""
        if self.warmup_mode == "constant":
            return self.warmup_begin_lr
        increase = (self.base_lr - self.warmup_begin_lr) * float(num_update) / float(self.warmup_steps)
        return self.warmup_begin_lr + increase

    def __call__(self, num_update: int) -> float:
        """The learning rate after ``num_update`` updates; OptimizerError for a negative or non-int count."""
        if type(num_update) is not int:
            num_update = int_param("num_update", num_update)
        elif num_update < 0:
            raise OptimizerError(f"num_update must be >= 0, got {num_update}")
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        return self._scheduled(num_update)

    def _scheduled(self, num_update: int) -> float:
        raise NotImplementedError("an LRScheduler subclass defines the rate after the warm-up")

    def spec(self) -> dict[str, Any]:
        """``{"name": ..., "params": {...}}`` with every constructor parameter, JSON- and msgpack-safe."""
        if not self.name:
            raise OptimizerError(f"{type(self).__name__} has no registered name and cannot be sent")
        return {"name": self.name, "params": {p: _plain(getattr(self, p)) for p in self.PARAMS}}

    def __repr__(self) -> str:
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in self.PARAMS)
        return f"{type(self).__name__}({args})"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _factor(value: Any) -> float:
    return real_param("factor", value, low=0.0, high=1.0)


class FactorScheduler(LRScheduler):
    """Multiply the rate by ``factor`` every ``step`` updates, never below ``stop_factor_lr``.

    After the warm-up the rate is ``base_lr`` decayed ``k = max(0, ceil(num_update / step) - 1)``
    times (MXNet counts from update 0, warm-up included, so the first rate after a warm-up
    longer than ``step`` is already decayed), each decay one multiplication raised to
    ``stop_factor_lr`` when below it, as in MXNet's loop, so the values are bit-identical.
    The last answer is memoised, so growing ``num_update`` costs O(1) per call.
    """

    name = "factor"
    PARAMS = ("step", "factor", "stop_factor_lr", *LRScheduler.PARAMS)

    def __init__(self, step: int, factor: float = 1.0, stop_factor_lr: float = 1e-8, base_lr: float = 0.01,
                 warmup_steps: int = 0, warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        """Raise OptimizerError unless ``step >= 1``, ``0 <= factor <= 1`` and ``stop_factor_lr >= 0``."""
        self.step = int_param("step", step, low=1)
        self.factor = _factor(factor)
        self.stop_factor_lr = real_param("stop_factor_lr", stop_factor_lr, low=0.0)
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self._memo: tuple[float, int, float] = (math.nan, 0, math.nan)  # (base_lr, decays, rate)

    def _scheduled(self, num_update: int) -> float:
        decays = max(0, -(-num_update // self.step) - 1)
        base, done, rate = self._memo  # resume from the last answer when it lies on the way
        if base != self.base_lr or done > decays:
            base, done, rate = self.base_lr, 0, self.base_lr
        while done < decays:  # MXNet's loop, one decay at a time
            new = rate * self.factor
            if new < self.stop_factor_lr:
                new = self.stop_factor_lr
            done = decays if new == rate else done + 1  # a fixed point: later decays change nothing
            rate = new
        self._memo = (base, done, rate)
        return rate


class MultiFactorScheduler(LRScheduler):
    """Multiply the rate by ``factor`` once for each ``s`` in ``step`` with ``num_update > s``."""

    name = "multifactor"
    PARAMS = ("step", "factor", *LRScheduler.PARAMS)

    def __init__(self, step: list[int], factor: float = 1.0, base_lr: float = 0.01, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        """Raise OptimizerError unless ``step`` is a non-empty strictly increasing list of ints >= 1."""
        if not isinstance(step, (list, tuple)) or not step:
            raise OptimizerError(f"step must be a non-empty list of ints, got {step!r}")
        steps = [int_param("step", s, low=1) for s in step]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise OptimizerError(f"step must be strictly increasing, got {steps}")
        self.step = steps
        self.factor = _factor(factor)
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)

    def _scheduled(self, num_update: int) -> float:
        rate = self.base_lr
        for s in self.step:
            if num_update <= s:
                break
            rate *= self.factor
        return rate


class CosineScheduler(LRScheduler):
    """Cosine decay from ``base_lr`` (at the warm-up's end) to ``final_lr`` (at ``max_update``).

    ``final_lr + (base_lr - final_lr) * (1 + cos(pi * (n - warmup_steps) / (max_update - warmup_steps))) / 2``
    for ``warmup_steps <= n <= max_update``, ``final_lr`` after.
    """

    name = "cosine"
    PARAMS = ("max_update", "base_lr", "final_lr", "warmup_steps", "warmup_begin_lr", "warmup_mode")

    def __init__(self, max_update: int, base_lr: float = 0.01, final_lr: float = 0.0, warmup_steps: int = 0,
                 warmup_begin_lr: float = 0.0, warmup_mode: str = "linear") -> None:
        """Raise OptimizerError unless ``max_update > warmup_steps`` and ``final_lr >= 0``."""
        self.max_update = int_param("max_update", max_update, low=1)
        self.final_lr = real_param("final_lr", final_lr, low=0.0)
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        if self.warmup_steps >= self.max_update:
            raise OptimizerError(f"max_update ({self.max_update}) must exceed warmup_steps "
                                 f"({self.warmup_steps})")

    def _scheduled(self, num_update: int) -> float:
        if num_update > self.max_update:
            return self.final_lr
        span = self.max_update - self.warmup_steps
        return self.final_lr + (self.base_lr - self.final_lr) * (
            1 + math.cos(math.pi * (num_update - self.warmup_steps) / span)) / 2


SCHEDULERS: dict[str, type[LRScheduler]] = {
    cls.name: cls for cls in (FactorScheduler, MultiFactorScheduler, CosineScheduler)
}


def parse_spec(spec: Any, registry: dict[str, type], params_of: Any, what: str) -> tuple[type, dict]:
    """Check the shape of a ``{"name": ..., "params": {...}}`` spec; return ``(class, params)``.

    ``params_of(cls)`` names every parameter the spec must hold.  Raises OptimizerError
    for a non-dict, other top-level keys, an unknown name, unknown or missing params.
    """
    if not isinstance(spec, dict) or set(spec) != {"name", "params"}:
        raise OptimizerError(f"an {what} spec is a dict with keys 'name' and 'params', got {spec!r:.200}")
    name, params = spec["name"], spec["params"]
    if not isinstance(name, str) or name not in registry:
        raise OptimizerError(f"unknown {what} {name!r:.100}; known: {sorted(registry)}")
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise OptimizerError(f"the params of {what} {name!r} must be a dict with str keys")
    expected = set(params_of(registry[name]))
    unknown, missing = sorted(set(params) - expected), sorted(expected - set(params))
    if unknown or missing:
        raise OptimizerError(f"{what} {name!r}: unknown params {unknown}, missing params {missing}")
    return registry[name], dict(params)


def build(cls: type, params: dict, what: str) -> Any:
    """``cls(**params)`` with any TypeError, ValueError or ArithmeticError raised as OptimizerError."""
    try:
        return cls(**params)
    except OptimizerError:
        raise
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise OptimizerError(f"bad parameters for {what} {getattr(cls, 'name', cls)!r}: {exc}") from None


def from_spec(spec: Any) -> LRScheduler:
    """Build the scheduler a :meth:`LRScheduler.spec` describes.

    Raises OptimizerError, and nothing else, for anything malformed: not a dict,
    an unknown name, unknown or missing parameters, or a bad value.
    """
    cls, params = parse_spec(spec, SCHEDULERS, lambda c: c.PARAMS, "lr_scheduler")
    return build(cls, params, "lr_scheduler")

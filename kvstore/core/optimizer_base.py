"""The optimizer base class: hyper-parameters and their checks, per-key state and update counts,
learning-rate and weight-decay multipliers, the update driver and the spec.

A rule (:mod:`kvstore.core.update_rules`) subclasses :class:`Optimizer` and defines ``_step``;
:mod:`kvstore.core.optimizer` holds the registry of rules by name.  Arithmetic is in the weight's
dtype; with ``multi_precision`` a float16 weight is updated through a float32 master copy (state
``"weight32"``), and a bfloat16 weight (a torch tensor) always is.  An optimizer travels as its
:meth:`Optimizer.spec` (a plain dict), never pickled.
:meth:`Optimizer.update` runs on numpy arrays or on torch tensors on any device (through
:mod:`kvstore.core.xp`), with the same arithmetic in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from kvstore.core import xp
from kvstore.core.dtypes import BF16, dtype_name
from kvstore.core.lr_scheduler import LRScheduler, int_param, real_param
from kvstore.core.partition import Key, check_key
from kvstore.errors import DTypeMismatchError, KeyTypeError, OptimizerError, ShapeMismatchError

STEP_PIECE = 1 << 17  # elements of a big numpy key stepped at once (Optimizer._pieces)

BASE_PARAMS = ("learning_rate", "wd", "rescale_grad", "clip_gradient", "lr_scheduler", "multi_precision",
               "lr_mult", "wd_mult", "begin_num_update")


def positive_or_none(name: str, value: Any) -> float | None:
    """``value`` as a float > 0, or None for None; OptimizerError otherwise."""
    return None if value is None else real_param(name, value, low=0.0, low_open=True)


def flag_param(name: str, value: Any) -> bool:
    """``value`` as a bool; OptimizerError for anything but a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise OptimizerError(f"{name} must be a bool, not {type(value).__name__} {value!r}")
    return bool(value)


def unit_param(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1); OptimizerError otherwise."""
    return real_param(name, value, low=0.0, high=1.0, high_open=True)


def _mults(name: str, value: Any) -> dict[Key, float]:
    """A dict or a ``[[key, mult], ...]`` list as ``{key: float}``; OptimizerError if malformed."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
            raise OptimizerError(f"{name} must be a dict or a list of [key, mult] pairs")
        pairs = [tuple(p) for p in value]
    else:
        raise OptimizerError(f"{name} must be a dict or a list of [key, mult] pairs, "
                             f"not {type(value).__name__}")
    out: dict[Key, float] = {}
    for key, mult in pairs:
        try:
            key = check_key(key)
        except KeyTypeError as exc:
            raise OptimizerError(f"{name}: {exc}") from None
        out[key] = real_param(f"{name}[{key!r}]", mult, low=0.0)
    return out


def _mult_pairs(mults: Mapping[Key, float]) -> list[list[Any]]:
    """Canonical spec form: pairs sorted ints first, then strs."""
    return [[k, float(v)] for k, v in sorted(mults.items(), key=lambda kv: (isinstance(kv[0], str), kv[0]))]


class Optimizer:
    """Base class: per-key state, update counts, learning-rate and weight-decay multipliers.

    ``learning_rate=None`` means the scheduler's ``base_lr`` when ``lr_scheduler`` is
    given, else the class default (``DEFAULT_LR``); a given ``learning_rate`` overwrites
    the scheduler's ``base_lr``, as in MXNet.  Every bad parameter raises OptimizerError.
    """

    name: ClassVar[str] = ""
    # True, in a rule class's own body, when its _step is elementwise and deterministic: a big numpy
    # key then steps in pieces of STEP_PIECE elements (Optimizer.update); a subclass must say it again
    ELEMENTWISE: ClassVar[bool] = False
    DEFAULT_LR: ClassVar[float] = 0.01
    OWN_PARAMS: ClassVar[tuple[str, ...]] = ()
    SETTABLE: ClassVar[tuple[str, ...]] = ("learning_rate", "wd", "rescale_grad", "clip_gradient",
                                           "lr_mult", "wd_mult")

    def __init__(self, learning_rate: float | None = None, wd: float = 0.0, rescale_grad: float = 1.0,
                 clip_gradient: float | None = None, lr_scheduler: LRScheduler | None = None,
                 multi_precision: bool = False, lr_mult: Mapping[Key, float] | None = None,
                 wd_mult: Mapping[Key, float] | None = None, begin_num_update: int = 0) -> None:
        if lr_scheduler is not None and not isinstance(lr_scheduler, LRScheduler):
            raise OptimizerError(f"lr_scheduler must be a kvstore.lr_scheduler.LRScheduler or None, "
                                 f"not {type(lr_scheduler).__name__}")
        if learning_rate is None:
            learning_rate = lr_scheduler.base_lr if lr_scheduler is not None else self.DEFAULT_LR
        self.lr = real_param("learning_rate", learning_rate, low=0.0)
        self.wd = real_param("wd", wd, low=0.0)
        self.rescale_grad = real_param("rescale_grad", rescale_grad)
        self.clip_gradient = positive_or_none("clip_gradient", clip_gradient)
        self.multi_precision = flag_param("multi_precision", multi_precision)
        self.lr_mult = _mults("lr_mult", lr_mult)
        self.wd_mult = _mults("wd_mult", wd_mult)
        self.begin_num_update = int_param("begin_num_update", begin_num_update)
        if lr_scheduler is not None:
            lr_scheduler.base_lr = self.lr  # checked against its warm-up (OptimizerError)
        self.lr_scheduler = lr_scheduler
        self.num_update = self.begin_num_update
        self.states: dict[Key, dict[str, np.ndarray]] = {}
        self.counts: dict[Key, int] = {}
        self.params_version = 0  # counts set_params calls (a server's shard is due after one)

    # -- learning rate and multipliers ------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The current rate: ``lr_scheduler(num_update)`` with a scheduler, else ``lr``."""
        return self.lr_scheduler(self.num_update) if self.lr_scheduler is not None else self.lr

    def set_learning_rate(self, lr: float) -> None:
        """Set ``lr``; OptimizerError with an lr_scheduler (as MXNet) or for a bad value."""
        if self.lr_scheduler is not None:
            raise OptimizerError("set_learning_rate: this optimizer's lr_scheduler sets its learning rate")
        self.lr = real_param("learning_rate", lr, low=0.0)

    def set_lr_mult(self, mults: Mapping[Key, float]) -> None:
        """Replace the per-key learning-rate multipliers; OptimizerError if malformed."""
        self.lr_mult = _mults("lr_mult", mults)

    def set_wd_mult(self, mults: Mapping[Key, float]) -> None:
        """Replace the per-key weight-decay multipliers; OptimizerError if malformed."""
        self.wd_mult = _mults("wd_mult", mults)

    def set_params(self, **changes: Any) -> None:
        """Change hyper-parameters named in ``SETTABLE``, keeping the state.

        Every value is checked before any is applied; OptimizerError for an unknown
        or unsettable name, a bad value, or ``learning_rate`` with an lr_scheduler set.
        """
        unknown = sorted(set(changes) - set(self.SETTABLE))
        if unknown:
            raise OptimizerError(f"cannot set {unknown}: only {list(self.SETTABLE)} can be changed")
        new: dict[str, Any] = {}
        for key, value in changes.items():
            if key == "learning_rate":
                if self.lr_scheduler is not None:
                    raise OptimizerError("learning_rate cannot be set: an lr_scheduler sets it")
                new["lr"] = real_param(key, value, low=0.0)
            elif key in ("wd", "rescale_grad"):
                new[key] = real_param(key, value, low=0.0 if key == "wd" else None)
            elif key == "clip_gradient":
                new[key] = positive_or_none(key, value)
            else:
                new[key] = _mults(key, value)
        for attr, value in new.items():
            setattr(self, attr, value)
        self.params_version += 1

    # -- state ------------------------------------------------------------------------------------
    def _state_names(self) -> tuple[str, ...]:
        return ()

    def state_names(self, dtype: Any) -> tuple[str, ...]:
        """Names of the per-key state arrays of a weight of ``dtype`` (``"weight32"`` first when mixed)."""
        inner = self._state_names()
        return ("weight32", *inner) if self._mixed(np.dtype(dtype)) else inner

    def _mixed(self, dtype: np.dtype) -> bool:
        """True when a weight of ``dtype`` is updated through a float32 master copy: float16 with
        ``multi_precision``, bfloat16 always (its 8-bit mantissa cannot take small steps)."""
        return dtype == BF16 or (self.multi_precision and dtype == np.float16)

    def create_state(self, key: Key, weight: Any) -> dict[str, Any]:
        """Fresh state arrays for ``weight`` (a numpy array or a torch tensor; the states are of the
        same kind, on the same device): zeros of its shape and dtype (float32 and a float32 copy
        ``"weight32"`` for a float16 weight with ``multi_precision``).  DTypeMismatchError for a
        weight that is not floating-point."""
        dtype = _check_float(key, weight)
        if self._mixed(dtype):
            state = {"weight32": xp.cast_copy(weight, np.dtype(np.float32))}
            state.update((n, xp.zeros(weight, np.dtype(np.float32))) for n in self._state_names())
            return state
        return {n: xp.zeros(weight, dtype) for n in self._state_names()}

    def get_state(self, key: Key) -> tuple[int, dict[str, np.ndarray]] | None:
        """``(update count, numpy copies of the state arrays)`` of ``key``, or None if it has no state yet."""
        state = self.states.get(key)
        if state is None:
            return None
        return self.counts.get(key, self.begin_num_update), {n: xp.to_numpy(a) for n, a in state.items()}

    def set_state(self, key: Key, weight: Any, count: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Install saved state for ``key`` (whose current value is ``weight``) and its update count.

        The arrays (numpy) must have exactly the names of ``create_state(key, weight)``, each of
        the same size and dtype (any shape); copies reshaped to ``weight``'s shape, on ``weight``'s
        side and device, are kept and ``num_update`` rises to ``count``.  OptimizerError on any
        mismatch, with nothing changed.
        """
        try:
            key = check_key(key)
        except KeyTypeError as exc:
            raise OptimizerError(str(exc)) from None
        count = int_param("count", count)
        try:
            template = self.create_state(key, weight)
        except (TypeError, DTypeMismatchError):
            raise OptimizerError(f"key {key!r}: optimizer state needs a floating-point weight") from None
        if not isinstance(arrays, Mapping) or set(arrays) != set(template):
            got = sorted(map(str, arrays)) if isinstance(arrays, Mapping) else type(arrays).__name__
            raise OptimizerError(f"key {key!r}: {self.name} state needs arrays {sorted(template)}, got {got}")
        state: dict[str, Any] = {}
        for name, like in template.items():
            array, dtype, size = arrays[name], xp.dtype_of(like), _size(like)
            if not isinstance(array, np.ndarray) or array.size != size or array.dtype != dtype:
                got = (f"{array.dtype}[{array.size}]" if isinstance(array, np.ndarray)
                       else type(array).__name__)
                raise OptimizerError(f"key {key!r}: state {name!r} must be {dtype}[{size}], got {got}")
            state[name] = xp.like(weight, array.reshape(tuple(weight.shape)))
        self.states[key] = state
        self.counts[key] = count
        self.num_update = max(self.num_update, count)

    def reset_states(self) -> None:
        """Drop every key's state and count; ``num_update`` goes back to ``begin_num_update``."""
        self.states.clear()
        self.counts.clear()
        self.num_update = self.begin_num_update

    # -- update -----------------------------------------------------------------------------------
    def update(self, key: Key, weight: Any, grad: Any) -> None:
        """Apply one step to ``weight`` in place with gradient ``grad`` (never written to).

        ``weight`` and ``grad`` are numpy arrays, or torch tensors on one device (the step then
        runs there).  Creates the key's state on first use, counts the update (``num_update`` is
        the largest count), then applies the rule with ``learning_rate * lr_mult[key]`` and
        ``wd * wd_mult[key]``.  Raises, before changing anything, KeyTypeError for a bad key,
        DTypeMismatchError for a non-floating weight or a grad of another dtype,
        ShapeMismatchError for a grad of another shape or state of another shape, TypeError for
        a grad that is not on the weight's side or device, ValueError for a read-only weight.
        """
        key = check_key(key)
        dtype = _check_float(key, weight)
        if not xp.same_place(weight, grad):
            raise TypeError(f"key {key!r}: grad must be on the weight's side ({xp.place(weight)}), "
                            f"not {type(grad).__name__}" + ("" if xp.is_numpy(grad) or not xp.is_tensor(grad)
                                                            else f" on {grad.device}"))
        if tuple(grad.shape) != tuple(weight.shape):
            raise ShapeMismatchError(f"key {key!r}: grad shape {tuple(grad.shape)} != weight shape "
                                     f"{tuple(weight.shape)}")
        if xp.dtype_of(grad) != dtype:
            raise DTypeMismatchError(f"key {key!r}: grad dtype {xp.dtype_of(grad)} != weight dtype {dtype}")
        if xp.is_numpy(weight) and not weight.flags.writeable:
            raise ValueError(f"key {key!r}: the weight array is read-only")
        if xp.is_tensor(weight):  # a parameter that requires grad is updated through its data
            weight, grad = weight.detach(), grad.detach()
        mixed = self._mixed(dtype)
        state = self.states.get(key)
        if state is not None and not _fits(state, weight, dtype, mixed):
            raise ShapeMismatchError(f"key {key!r}: its optimizer state fits no {dtype}{tuple(weight.shape)} "
                                     f"({xp.place(weight)})")
        if state is None:
            if dtype == np.float16 and not mixed:
                warnings.warn(f"key {key!r}: {self.name} updates a float16 weight in float16, where small "
                              "steps and small state values round to zero (Adam's update becomes NaN); pass "
                              "multi_precision=True to update it through a float32 master copy", stacklevel=2)
            state = self.states[key] = self.create_state(key, weight)
        count = self.counts[key] = self.counts.get(key, self.begin_num_update) + 1
        self.num_update = max(self.num_update, count)
        lr = float(self.learning_rate) * float(self.lr_mult.get(key, 1.0))
        wd = float(self.wd) * float(self.wd_mult.get(key, 1.0))
        w = weight
        if weight.ndim == 0:  # numpy gives scalars for 0-d results: step on 1-element views
            w, grad, state = weight.reshape(1), grad.reshape(1), {n: a.reshape(1) for n, a in state.items()}
        scratch = np.dtype(np.float32) if mixed else dtype  # the rule's g: rescale_grad * grad
        pieces = self._pieces(w, grad, state)
        if pieces is None:
            g = xp.empty(w, scratch)
            xp.scale_into(g, grad, float(self.rescale_grad))
            self._step(state["weight32"] if mixed else w, g, state, lr, wd, count)
        else:
            flat_w, flat_grad, flat_state = pieces
            for lo in range(0, flat_w.size, STEP_PIECE):
                hi = min(lo + STEP_PIECE, flat_w.size)
                piece = {n: a[lo:hi] for n, a in flat_state.items()}
                g = np.empty(hi - lo, scratch)
                xp.scale_into(g, flat_grad[lo:hi], float(self.rescale_grad))
                self._step(piece["weight32"] if mixed else flat_w[lo:hi], g, piece, lr, wd, count)
        if mixed:
            xp.assign(w, state["weight32"])

    def _pieces(self, w: Any, grad: Any, state: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]] | None:
        """Flat views of ``w``, ``grad`` and ``state`` when this rule steps a key in pieces, else None:
        a numpy key of at least ``4 * STEP_PIECE`` elements, every array C-contiguous, and a rule
        class that declares itself ``ELEMENTWISE``.  Each piece's arrays stay in cache across the
        rule's passes (a 64 MB key took about 1.5x the CPU time whole, issue 39); every element
        gets the same operations in the same order, so the result is the same, bit for bit."""
        declared = type(self).__dict__.get("ELEMENTWISE", False)
        if not (declared and xp.is_numpy(w) and w.size >= 4 * STEP_PIECE):
            return None
        arrays = [w, grad, *state.values()]
        if not all(type(a) is np.ndarray and a.flags.c_contiguous and a.size == w.size for a in arrays):
            return None
        return w.reshape(-1), grad.reshape(-1), {n: a.reshape(-1) for n, a in state.items()}

    def update_rows(self, key: Key, weight: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """One lazy step of ``key`` on the rows ``ids`` only (a row-sparse push, MXNet's
        ``lazy_update=True``): ``weight`` (a numpy ``(rows, width)`` table, updated in place) and the
        state's rows ``ids`` (sorted, distinct) are gathered, stepped with gradient rows ``rows`` and the
        key's learning rate, weight decay and count, and written back.  No rows: the step is counted."""
        state = self.states.get(key)
        if ids.size and (state is None or any(a.shape != weight.shape for a in state.values())):
            state = self.states[key] = self.create_state(key, weight)
        count = self.counts[key] = self.counts.get(key, self.begin_num_update) + 1
        self.num_update = max(self.num_update, count)
        if state is None or not ids.size:
            return
        lr = float(self.learning_rate) * float(self.lr_mult.get(key, 1.0))
        wd = float(self.wd) * float(self.wd_mult.get(key, 1.0))
        mixed = self._mixed(weight.dtype)
        sub: dict[str, Any] = {name: array[ids] for name, array in state.items()}
        w = weight[ids]
        g = np.multiply(rows, self.rescale_grad, dtype=np.float32 if mixed else weight.dtype)
        self._step(sub["weight32"] if mixed else w, g, sub, lr, wd, count)
        if mixed:
            w[...] = sub["weight32"]
        weight[ids] = w
        for name, array in state.items():
            array[ids] = sub[name]

    def _clip(self, g: Any) -> Any:
        if self.clip_gradient is not None:
            xp.clip_(g, float(self.clip_gradient))
        return g

    def _step(self, w: Any, g: Any, state: dict[str, Any], lr: float, wd: float, t: int) -> None:
        """The rule: update ``w`` in place; ``g`` is ``rescale_grad * grad``, a scratch array."""
        raise NotImplementedError(f"{type(self).__name__} defines no update rule")

    # -- spec -------------------------------------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        """``{"name": ..., "params": {...}}`` with every constructor parameter, JSON- and msgpack-safe."""
        params: dict[str, Any] = {
            "learning_rate": float(self.lr), "wd": float(self.wd), "rescale_grad": float(self.rescale_grad),
            "clip_gradient": None if self.clip_gradient is None else float(self.clip_gradient),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.spec(),
            "multi_precision": bool(self.multi_precision), "lr_mult": _mult_pairs(self.lr_mult),
            "wd_mult": _mult_pairs(self.wd_mult), "begin_num_update": int(self.begin_num_update)}
        for name in self.OWN_PARAMS:
            value = getattr(self, name)
            params[name] = value if value is None or isinstance(value, bool) else float(value)
        return {"name": self.name, "params": params}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.spec()["params"].items())
        return f"{type(self).__name__}({params})"


def _check_float(key: Key, weight: Any) -> np.dtype:
    """``weight``'s (numpy) dtype; TypeError for no array or tensor, DTypeMismatchError if not float."""
    if not (xp.is_numpy(weight) or xp.is_tensor(weight)):
        raise TypeError(f"key {key!r}: weight must be a numpy array or a torch tensor, "
                        f"not {type(weight).__name__}")
    dtype = xp.dtype_of(weight)
    if dtype == BF16 and xp.is_tensor(weight):
        return dtype  # updated through a float32 master copy (_mixed)
    if dtype.kind != "f":
        raise DTypeMismatchError(f"key {key!r} holds {dtype_name(dtype) or dtype}; optimizers update "
                                 "floating-point weights only (bfloat16 ones as torch tensors)")
    return dtype


def _size(a: Any) -> int:
    return int(a.size) if xp.is_numpy(a) else int(a.numel())


def _fits(state: dict[str, Any], weight: Any, dtype: np.dtype, mixed: bool) -> bool:
    want = np.dtype(np.float32) if mixed else dtype
    return all(tuple(a.shape) == tuple(weight.shape) and xp.dtype_of(a) == want and xp.same_place(a, weight)
               for a in state.values()) and (("weight32" in state) == mixed)

"""MXNet 1.x's update rules (SGD, NAG, Adam, AdaGrad, RMSProp), with its names, defaults and formulas,
and AdamW with torch.optim.AdamW's formula.

Where MXNet's Python docstrings and its C++ kernels (``optimizer_op-inl.h``)
disagree, the kernel ran and is followed.  ``g = rescale_grad * grad``, ``clip(x)``
is ``np.clip(x, -clip_gradient, clip_gradient)`` when ``clip_gradient`` is set,
``lr`` and ``wd`` are the key's values, ``t`` the key's update count::

    sgd      w = (1 - lr*wd)*w - lr*clip(g)
             momentum: m = momentum*m - lr*wd*w - lr*clip(g); w += m
    nag      d = lr*(clip(g) + wd*w); m = momentum*m - d; w += momentum*m - d   (no momentum: sgd)
    adam     c = clip(g + wd*w); mean = b1*mean + (1-b1)*c; var = b2*var + (1-b2)*c*c
             w -= lr*sqrt(1-b2**t)/(1-b1**t) * mean/(sqrt(var) + epsilon)
    adagrad  c = clip(g); history += c*c; w += (c/sqrt(history + eps) + wd*w) * -lr
    rmsprop  c = clip(g + wd*w); n = (1-gamma1)*c*c + gamma1*n; w -= lr*c/sqrt(n + epsilon)
             centered: gbar = (1-gamma1)*c + gamma1*gbar
                       delta = gamma2*delta - lr*c/sqrt(n - gbar*gbar + epsilon); w += delta
             then w = clip(w, +-clip_weights) when clip_weights is set
    adamw    (torch.optim.AdamW: decoupled weight decay, bias corrections as torch applies them)
             w *= 1 - lr*wd; c = clip(g); mean = b1*mean + (1-b1)*c; var = b2*var + (1-b2)*c*c
             w -= lr/(1-b1**t) * mean/(sqrt(var)/sqrt(1-b2**t) + epsilon)

The rules are written once, with Python's in-place operators and the few
functions of :mod:`kvstore.core.xp`, so :meth:`Optimizer.update` runs them on numpy
arrays or on torch tensors on any device (the ``device`` store and the Trainer
update on the GPU that way), with the same arithmetic in the same order.
:mod:`kvstore.core.optimizer` registers them by name.
"""

from __future__ import annotations

import math
from typing import Any

from kvstore.core import xp
from kvstore.core.lr_scheduler import real_param
from kvstore.core.optimizer_base import Optimizer, flag_param, positive_or_none, unit_param


class SGD(Optimizer):
    """SGD with optional momentum (MXNet's ``sgd_update`` / ``sgd_mom_update`` kernels)."""

    ELEMENTWISE = True  # Optimizer._pieces
    name = "sgd"
    OWN_PARAMS = ("momentum", "lazy_update")

    def __init__(self, learning_rate: float | None = None, momentum: float = 0.0, lazy_update: bool = True,
                 **kwargs: Any) -> None:
        self.momentum = unit_param("momentum", momentum)
        self.lazy_update = flag_param("lazy_update", lazy_update)  # row-sparse pushes (docs/sparse.md)
        super().__init__(learning_rate, **kwargs)

    def _state_names(self) -> tuple[str, ...]:
        return ("mom",) if self.momentum > 0 else ()

    def _step(self, w, g, state, lr, wd, t):
        self._clip(g)
        mom = state.get("mom")
        if mom is None:
            if wd:
                w *= 1.0 - lr * wd
            g *= lr
            w -= g
            return
        g *= lr
        mom *= self.momentum
        if wd:
            mom -= w * (lr * wd)
        mom -= g
        w += mom


class NAG(SGD):
    """Nesterov momentum (MXNet's ``nag_mom_update`` kernel; plain ``sgd_update`` without momentum)."""

    ELEMENTWISE = True  # Optimizer._pieces
    name = "nag"

    def _step(self, w, g, state, lr, wd, t):
        mom = state.get("mom")
        if mom is None:
            return super()._step(w, g, state, lr, wd, t)
        self._clip(g)
        if wd:
            g += w * wd
        g *= lr
        mom *= self.momentum
        mom -= g
        w -= g
        w += mom * self.momentum


class Adam(Optimizer):
    """Adam with the bias correction folded into the learning rate (MXNet's ``adam_update``)."""

    ELEMENTWISE = True  # Optimizer._pieces
    name = "adam"
    DEFAULT_LR = 0.001
    OWN_PARAMS = ("beta1", "beta2", "epsilon", "lazy_update")

    def __init__(self, learning_rate: float | None = None, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, lazy_update: bool = True, **kwargs: Any) -> None:
        self.beta1, self.beta2 = unit_param("beta1", beta1), unit_param("beta2", beta2)
        self.lazy_update = flag_param("lazy_update", lazy_update)  # row-sparse pushes (docs/sparse.md)
        self.epsilon = real_param("epsilon", epsilon, low=0.0, low_open=True)
        super().__init__(learning_rate, **kwargs)

    def _state_names(self) -> tuple[str, ...]:
        return ("mean", "var")

    def _moments(self, g: Any, state: dict[str, Any]) -> tuple[Any, Any]:
        """Update the first and second moments in ``state`` with ``g`` (which is left squared and
        scaled: callers overwrite it); return them."""
        mean, var = state["mean"], state["var"]
        mean *= self.beta1
        mean += g * (1.0 - self.beta1)
        var *= self.beta2
        g *= g
        g *= 1.0 - self.beta2
        var += g
        return mean, var

    def _step(self, w, g, state, lr, wd, t):
        lr_t = lr * math.sqrt(1.0 - self.beta2 ** t) / (1.0 - self.beta1 ** t)
        if wd:
            g += w * wd
        self._clip(g)
        mean, var = self._moments(g, state)
        xp.scale_into(g, mean, lr_t)
        denom = xp.sqrt(var)
        denom += self.epsilon
        g /= denom
        w -= g


class AdaGrad(Optimizer):
    """AdaGrad (MXNet 1.x's dense Python path); ``eps`` keeps the root away from 0."""

    ELEMENTWISE = True  # Optimizer._pieces
    name = "adagrad"
    OWN_PARAMS = ("eps",)

    def __init__(self, learning_rate: float | None = None, eps: float = 1e-7, **kwargs: Any) -> None:
        self.eps = real_param("eps", eps, low=0.0, low_open=True)
        super().__init__(learning_rate, **kwargs)

    def _state_names(self) -> tuple[str, ...]:
        return ("history",)

    def _step(self, w, g, state, lr, wd, t):
        self._clip(g)
        history = state["history"]
        history += g * g
        denom = history + self.eps
        g /= xp.sqrt_(denom)
        if wd:
            g += w * wd
        g *= -lr
        w += g


class RMSProp(Optimizer):
    """RMSProp: Tieleman & Hinton, or Graves's centered version (``rmsprop_update`` /
    ``rmspropalex_update``); ``clip_weights`` clips the updated weights."""

    ELEMENTWISE = True  # Optimizer._pieces
    name = "rmsprop"
    DEFAULT_LR = 0.001
    OWN_PARAMS = ("gamma1", "gamma2", "epsilon", "centered", "clip_weights")

    def __init__(self, learning_rate: float | None = None, gamma1: float = 0.9, gamma2: float = 0.9,
                 epsilon: float = 1e-8, centered: bool = False, clip_weights: float | None = None,
                 **kwargs: Any) -> None:
        self.gamma1, self.gamma2 = unit_param("gamma1", gamma1), unit_param("gamma2", gamma2)
        self.epsilon = real_param("epsilon", epsilon, low=0.0, low_open=True)
        self.centered = flag_param("centered", centered)
        self.clip_weights = positive_or_none("clip_weights", clip_weights)
        super().__init__(learning_rate, **kwargs)

    def _state_names(self) -> tuple[str, ...]:
        return ("n", "g", "delta") if self.centered else ("n",)

    def _step(self, w, g, state, lr, wd, t):
        if wd:
            g += w * wd
        self._clip(g)
        n = state["n"]
        n *= self.gamma1
        n += (g * g) * (1.0 - self.gamma1)
        if self.centered:
            gbar = state["g"]
            gbar *= self.gamma1
            gbar += g * (1.0 - self.gamma1)
            denom = n - gbar * gbar
        else:
            denom = xp.copy(n)
        denom += self.epsilon
        g /= xp.sqrt_(denom)
        g *= lr
        if self.centered:
            delta = state["delta"]
            delta *= self.gamma2
            delta -= g
            w += delta
        else:
            w -= g
        if self.clip_weights is not None:
            xp.clip_(w, self.clip_weights)


class AdamW(Adam):
    """Adam with decoupled weight decay, as ``torch.optim.AdamW`` computes it (default ``wd`` 0.01).

    ``wd`` is torch's ``weight_decay`` and multiplies the weights by ``1 - lr*wd`` before the
    moments are updated; ``epsilon`` is added after the root of the bias-corrected ``var``.
    """

    ELEMENTWISE = True  # Optimizer._pieces
    name = "adamw"

    def __init__(self, learning_rate: float | None = None, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, wd: float = 0.01, **kwargs: Any) -> None:
        super().__init__(learning_rate, beta1=beta1, beta2=beta2, epsilon=epsilon, wd=wd, **kwargs)

    def _step(self, w, g, state, lr, wd, t):
        if wd:
            w *= 1.0 - lr * wd
        self._clip(g)
        mean, var = self._moments(g, state)
        denom = xp.sqrt(var)
        denom /= math.sqrt(1.0 - self.beta2 ** t)
        denom += self.epsilon
        xp.scale_into(g, mean, lr / (1.0 - self.beta1 ** t))
        g /= denom
        w -= g

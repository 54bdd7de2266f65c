"""Optimizers by name: the registry of update rules, :func:`create` and :func:`from_spec`.

The base class lives in :mod:`kvstore.core.optimizer_base` and MXNet 1.x's rules (``sgd``, ``nag``,
``adam``, ``adagrad``, ``rmsprop``) and torch's ``adamw`` in :mod:`kvstore.core.update_rules`; both are
re-exported here, so this module is the one to import.  Users import it as ``kvstore.optimizer``
(MXNet's name: ``kvstore/__init__.py`` binds that name to this module): ``kvstore.optimizer.create('sgd',
learning_rate=0.1, momentum=0.9)`` builds one for ``set_optimizer`` or the ``Trainer``; subclass
:class:`Optimizer` and :func:`register` it to add a rule.
"""

from __future__ import annotations

from typing import Any

from kvstore.core import lr_scheduler as lrs
from kvstore.core.optimizer_base import BASE_PARAMS, Optimizer
from kvstore.core.update_rules import NAG, SGD, AdaGrad, Adam, AdamW, RMSProp
from kvstore.errors import OptimizerError

__all__ = ["BASE_PARAMS", "OPTIMIZERS", "NAG", "SGD", "AdaGrad", "Adam", "AdamW", "Optimizer", "RMSProp",
           "create",
           "from_spec", "register"]

OPTIMIZERS: dict[str, type[Optimizer]] = {}


def register(cls: type[Optimizer]) -> type[Optimizer]:
    """Add an Optimizer subclass to ``OPTIMIZERS`` under its lower-case ``name`` (replacing any)."""
    if not (isinstance(cls, type) and issubclass(cls, Optimizer) and cls.name):
        raise TypeError(f"register takes an Optimizer subclass with a name, not {cls!r}")
    OPTIMIZERS[cls.name.lower()] = cls
    return cls


for _rule in (SGD, NAG, Adam, AdamW, AdaGrad, RMSProp):
    register(_rule)


def create(name: str | Optimizer, **params: Any) -> Optimizer:
    """An optimizer by (case-insensitive) name with ``params``, or ``name`` itself if it is one.

    Raises OptimizerError for an unknown name (listing the known ones), params given
    with an Optimizer instance, or params the optimizer does not take or accept.
    """
    if isinstance(name, Optimizer):
        if params:
            raise OptimizerError(f"parameters {sorted(params)} given with an Optimizer instance")
        return name
    if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
        raise OptimizerError(f"unknown optimizer {name!r:.100}; known: {sorted(OPTIMIZERS)}")
    return lrs.build(OPTIMIZERS[name.lower()], params, "optimizer")


def from_spec(spec: Any) -> Optimizer:
    """Build the optimizer an :meth:`Optimizer.spec` describes (it may come from the network).

    Raises OptimizerError, and nothing else, for anything malformed: not a dict, an
    unknown name, unknown or missing params, or a value of a bad type or range.
    """
    cls, params = lrs.parse_spec(spec, OPTIMIZERS, lambda c: BASE_PARAMS + c.OWN_PARAMS, "optimizer")
    if params["lr_scheduler"] is not None:
        params["lr_scheduler"] = lrs.from_spec(params["lr_scheduler"])
    if not (isinstance(params["lr_mult"], list) and isinstance(params["wd_mult"], list)):
        raise OptimizerError("an optimizer spec's lr_mult and wd_mult are lists of [key, mult] pairs")
    return lrs.build(cls, params, "optimizer")

"""The update rules (public face of :mod:`kvstore.core.optimizer`).

``kvstore.optimizer.create('sgd', learning_rate=0.1, momentum=0.9)`` builds one for ``set_optimizer``
or the ``Trainer``; subclass :class:`Optimizer` and :func:`register` it to add a rule.
"""

from kvstore.core.optimizer import (
    BASE_PARAMS,
    NAG,
    OPTIMIZERS,
    SGD,
    AdaGrad,
    Adam,
    AdamW,
    Optimizer,
    RMSProp,
    create,
    from_spec,
    register,
)

__all__ = ["BASE_PARAMS", "Optimizer", "SGD", "NAG", "Adam", "AdamW", "AdaGrad", "RMSProp", "OPTIMIZERS",
           "create", "from_spec", "register"]

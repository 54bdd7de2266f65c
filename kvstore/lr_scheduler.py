"""Learning-rate schedules (public face of :mod:`kvstore.core.lr_scheduler`)."""

from kvstore.core.lr_scheduler import (
    SCHEDULERS,
    CosineScheduler,
    FactorScheduler,
    LRScheduler,
    MultiFactorScheduler,
    from_spec,
)

__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "CosineScheduler", "SCHEDULERS",
           "from_spec"]

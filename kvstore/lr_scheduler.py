"""Learning-rate schedules (public face of :mod:`kvstore.core.lr_scheduler`)."""

from kvstore.core.lr_scheduler import (
    SCHEDULERS,
    WARMUP_MODES,
    CosineScheduler,
    FactorScheduler,
    LRScheduler,
    MultiFactorScheduler,
    from_spec,
)

__all__ = ["LRScheduler", "FactorScheduler", "MultiFactorScheduler", "CosineScheduler", "SCHEDULERS",
           "WARMUP_MODES", "from_spec"]

"""Pipeline parallelism (GPipe, 1F1B, PipeDream) across the workers of a cluster: docs/pipeline.md."""

from kvstore.pipeline.pipe import Pipeline

__all__ = ["Pipeline"]

"""Pipeline parallelism (GPipe, 1F1B, PipeDream) across the workers of a cluster: docs/pipeline.md."""

from kvstore.pipeline.layers import LayerSpec, build
from kvstore.pipeline.pipe import Pipeline, load_state_dict

__all__ = ["LayerSpec", "Pipeline", "build", "load_state_dict"]

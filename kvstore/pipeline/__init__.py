"""Pipeline parallelism (GPipe, 1F1B, PipeDream) across the workers of a cluster: docs/pipeline.md."""

from kvstore.pipeline.layers import LayerSpec, Save, Take, Tied, build
from kvstore.pipeline.pipe import Pipeline, load_state_dict

__all__ = ["LayerSpec", "Pipeline", "Save", "Take", "Tied", "build", "load_state_dict"]

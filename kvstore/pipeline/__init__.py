"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, PipeDream) across the workers of a cluster:
docs/pipeline.md."""

from typing import Any

from kvstore.pipeline import layers as _layers
from kvstore.pipeline.layers import LayerSpec, Tied, build
from kvstore.pipeline.pipe import Pipeline, load_state_dict

__all__ = ["LayerSpec", "Pipeline", "Save", "Take", "Tied", "build", "load_state_dict"]


def __getattr__(name: str) -> Any:
    """``Save`` and ``Take``: torch modules, made at first use (importing kvstore never imports torch)."""
    if name in ("Save", "Take"):
        return getattr(_layers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

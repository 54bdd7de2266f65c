"""Deferred batch norm for pipelines: micro-batch normalisation, mini-batch running statistics.

In training, a stage normalises each micro-batch with that micro-batch's statistics (as plain
batch norm does) but does not touch the running statistics then; it sums each channel's values,
squares and count over the step's micro-batches, and the Pipeline updates the running mean and
variance once per step from those sums: the update one process makes from the whole mini-batch.
A checkpointed micro-batch's recomputation in backward is not counted twice.  docs/pipeline.md.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import ConfigError


def _batch_norm_base() -> type:
    """torch's batch norm base class: what :func:`convert` replaces (BatchNorm1d-3d, their lazy forms,
    SyncBatchNorm, and any class built on the base itself, such as apex's SyncBatchNorm).  torch names
    no public base, so it is imported from its module (an import, not another object's private member)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return _BatchNorm


def deferred_class() -> Any:
    """The ``DeferredBatchNorm`` class (made on first use: torch is imported lazily)."""
    global _DEFERRED
    if _DEFERRED is None:
        _DEFERRED = _make_class()
    return _DEFERRED


_DEFERRED: Any = None


def _make_class() -> Any:
    import torch
    import torch.nn.functional as F

    class DeferredBatchNorm(torch.nn.BatchNorm1d):
        """Batch norm whose running statistics are updated once per pipeline step (:meth:`commit`).

        Of any number of dims (batch, channels, ...): its input check replaces BatchNorm1d's, the only
        thing BatchNorm1d adds to torch's batch norm base (which is private)."""

        def _check_input_dim(self, x: Any) -> None:
            if x.dim() < 2:
                raise ValueError(f"expected at least 2 dims (batch, channels, ...), got {x.dim()}")

        def begin(self, mb: int) -> None:
            """The next forward is micro-batch ``mb``'s (its recomputation adds nothing)."""
            self._mb = mb

        def forward(self, x: Any) -> Any:
            if not self.training or not self.track_running_stats:
                return super().forward(x)
            self._check_input_dim(x)
            counted = self.__dict__.setdefault("_counted", set())
            mb = self.__dict__.get("_mb")
            if mb not in counted:
                counted.add(mb)
                dims = [d for d in range(x.dim()) if d != 1]
                flat = x.detach()
                sums = self.__dict__["_sums"] = self.__dict__.get("_sums") or [0.0, 0.0, 0]
                sums[0] = sums[0] + flat.sum(dims)
                sums[1] = sums[1] + (flat * flat).sum(dims)
                sums[2] += flat.numel() // flat.shape[1]
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

        def commit(self, apply: bool = True) -> None:
            """Update the running statistics from this step's micro-batches, once (unless ``apply`` is
            False: a failed step's are dropped); forget them."""
            sums, self.__dict__["_sums"], self.__dict__["_counted"] = self.__dict__.get("_sums"), None, set()
            if not apply or not sums or not sums[2]:
                return
            total, squares, count = sums
            mean = total / count
            var = (squares / count - mean * mean) * (count / max(count - 1, 1))
            self.num_batches_tracked.add_(1)
            momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(var.to(self.running_var.dtype), alpha=momentum)

    return DeferredBatchNorm


def convert(module: Any) -> Any:
    """``module`` with every batch norm (itself or inside it) replaced by a DeferredBatchNorm holding
    the same parameters and buffers; raises ConfigError for a batch norm without running statistics."""
    deferred = deferred_class()
    if isinstance(module, _batch_norm_base()) and not isinstance(module, deferred):
        if not module.track_running_stats:
            raise ConfigError("deferred batch norm needs track_running_stats=True")
        new = deferred(module.num_features, module.eps, module.momentum, module.affine, True)
        new.to(device=module.running_mean.device, dtype=module.running_mean.dtype)
        new.load_state_dict(module.state_dict())
        return new.train(module.training)
    for name, child in module.named_children():
        replaced = convert(child)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


def deferred_in(module: Any) -> list[Any]:
    """Every DeferredBatchNorm in ``module``."""
    deferred = deferred_class()
    return [m for m in module.modules() if isinstance(m, deferred)]

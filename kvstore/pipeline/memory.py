"""Measured activation memory of a stage: the bytes autograd saves for backward, per micro-batch.

``SavedBytes`` wraps each micro-batch's forward in ``torch.autograd.graph.saved_tensors_hooks``
and counts the bytes of every tensor autograd saves for that micro-batch's backward (each
storage once per micro-batch; the stage's weights, which autograd saves too, are not counted:
they are held whatever the schedule).  A micro-batch's bytes are released after its backward,
so ``peak`` is the most bytes of saved activations the stage held at once during the step.
A forward under ``torch.utils.checkpoint`` saves through checkpoint's own hooks, which
replace these: a checkpointed micro-batch counts only what it saves outside the checkpoint
(its loss, on the last stage).  docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class SavedBytes:
    """Bytes of saved tensors held per in-flight micro-batch, and their peak over a step."""

    def __init__(self, weights: Callable[[], Iterator[Any]]) -> None:
        """``weights()`` yields the tensors not to count (the stage's parameters and snapshots)."""
        self.weights = weights
        self.held: dict[int, dict[tuple[int, int], int]] = {}  # mb -> {(data_ptr, nbytes): nbytes}
        self.total = 0
        self.peak = 0

    def begin_step(self) -> None:
        """Forget the previous step (a failed step's micro-batches included)."""
        self.held, self.total, self.peak = {}, 0, 0

    @contextmanager
    def forward(self, mb: int) -> Iterator[None]:
        """Count what autograd saves for micro-batch ``mb`` inside this block."""
        import torch

        skip: set[int] = set()  # filled at the first save: a pipedream snapshot is made inside the block
        seen = self.held.setdefault(mb, {})

        def pack(tensor: Any) -> Any:
            if not skip:
                skip.update([-1, *(w.data_ptr() for w in self.weights())])
            ptr = tensor.data_ptr()
            if ptr not in skip and tensor.numel():
                key = (ptr, tensor.numel() * tensor.element_size())
                if key not in seen:
                    seen[key] = key[1]
                    self.total += key[1]
                    self.peak = max(self.peak, self.total)
            return tensor.detach()  # the data only: keeping an op's output with its grad_fn makes a cycle

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    def release(self, mb: int) -> None:
        """Micro-batch ``mb``'s backward is done: its saved tensors are no longer held."""
        self.total -= sum(self.held.pop(mb, {}).values())

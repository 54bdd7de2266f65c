"""PipeDream's weight stashing: each in-flight micro-batch's backward uses its forward's weights.

Under ``schedule='pipedream'`` a stage updates its weights after every micro-batch's
backward, while other micro-batches are still in flight.  ``WeightStash`` runs each
forward on a snapshot of the weights of the current version (one snapshot per version,
shared by the forwards that ran on it, dropped when its last micro-batch's backward is
done) and computes the backward on that snapshot, so a micro-batch's gradient is the
gradient of the function its forward computed.  The snapshot's gradient then updates the
live weights through the stage's optimizer and the version counter moves on.  At most
``K - i`` versions are held at stage i (its in-flight count under 1F1B).  docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvstore.errors import ConfigError


class WeightStash:
    """The versions of one stage's weights that its in-flight micro-batches still need."""

    def __init__(self, module: Any, optimizer: Callable[[Iterable[Any]], Any] | None) -> None:
        """``optimizer`` builds the stage's optimizer from its parameters (e.g.
        ``lambda ps: torch.optim.SGD(ps, lr=0.05)``); ConfigError when it is missing."""
        if optimizer is None or not callable(optimizer):
            raise ConfigError("schedule 'pipedream' updates each stage after every micro-batch: pass "
                              "optimizer=, a callable building an optimizer from the stage's parameters")
        self.module = module
        self.live = dict(module.named_parameters())
        self.optimizer = optimizer(list(self.live.values())) if self.live else None  # a stage of ReLUs
        self.version = 0  # how many updates the live weights have had
        self.snapshots: dict[int, tuple[dict[str, Any], int]] = {}  # version -> (weights, users)
        self.stamps: dict[int, int] = {}  # id() of each snapshot tensor held -> the version it copies
        self.forward_version: dict[int, int] = {}  # in-flight micro-batch -> version of its forward
        self.log: list[tuple[int, int, int, int]] = []  # (mb, forward, backward, live) versions, one step
        self.peak = 0  # the most versions held at once

    def forward(self, mb: int, args: tuple[Any, ...], run: Callable[..., Any]) -> Any:
        """Micro-batch ``mb``'s output, computed by ``run(fn, *args)`` with ``fn`` the stage on the
        current version's snapshot."""
        from torch.func import functional_call

        if self.version not in self.snapshots:
            weights = {k: p.detach().clone().requires_grad_(p.requires_grad) for k, p in self.live.items()}
            for w in weights.values():
                self.stamps[id(w)] = self.version  # read back by the backward that uses it
            self.snapshots[self.version] = (weights, 0)
        weights, users = self.snapshots[self.version]
        self.snapshots[self.version] = (weights, users + 1)
        self.forward_version[mb] = self.version
        self.peak = max(self.peak, len(self.snapshots))
        return run(lambda *a: functional_call(self.module, weights, a), *args)

    def backward(self, mb: int, outs: list[Any], grads: list[Any], inputs: list[Any]) -> list[Any]:
        """Backward micro-batch ``mb``'s ``outs`` (with ``grads``; None for a loss) on its forward's
        snapshot, update the live weights with that gradient (one optimizer step), and return the
        gradient of each of ``inputs`` (None where it needs none)."""
        import torch

        version = self.forward_version.pop(mb)
        weights, users = self.snapshots[version]
        names = [k for k, w in weights.items() if w.requires_grad]
        wanted = [t for t in inputs if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        wrt = [weights[k] for k in names] + wanted
        if pairs and wrt:
            grads_ = torch.autograd.grad([o for o, _ in pairs], wrt, grad_outputs=[g for _, g in pairs],
                                         allow_unused=True)
        else:
            grads_ = (None,) * len(wrt)
        used = self.stamps[id(weights[names[0]])] if names else version
        self.log.append((mb, version, used, self.version))
        for name, g in zip(names, grads_):
            p = self.live[name]
            p.grad = torch.zeros_like(p) if g is None else g
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        if users == 1:
            del self.snapshots[version]
            for w in weights.values():
                del self.stamps[id(w)]
        else:
            self.snapshots[version] = (weights, users - 1)
        by_input = iter(grads_[len(names):])
        return [next(by_input) if t.requires_grad else None for t in inputs]

    def weights(self) -> Iterator[Any]:
        """Every snapshot tensor held now."""
        for weights, _ in self.snapshots.values():
            yield from weights.values()

    def begin_step(self) -> None:
        """Forget the previous step's log (it stays bounded by one step's micro-batches)."""
        self.log = []

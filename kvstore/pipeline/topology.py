"""Where each part of a pipelined model runs, and the channels that join the parts (pure, no I/O).

A model of L layers is cut into ``S = stages * virtual`` contiguous parts (``balance``: layers per
part).  Part s runs on stage ``s % stages`` as that stage's local chunk ``s // stages`` (with
``virtual == 1`` a stage holds one part, part s = stage s); worker ``replica * stages + stage`` runs
a stage of a replica.  The main boundary joins part s to part s + 1 (activations forward, gradients
back); a skip connection joins the part of its :class:`~kvstore.pipeline.layers.Save` to the part of its
:class:`~kvstore.pipeline.layers.Take` directly, whatever lies between them.  docs/pipeline.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import ConfigError
from kvstore.net.protocol import Op
from kvstore.pipeline.layers import Roles
from kvstore.pipeline.link import Channel


class Topology:
    """The parts of a model of ``len(roles)`` layers cut by ``balance`` (layers per part) over ``stages``
    stages of ``virtual`` parts each, and ``replicas`` replicas; raises ConfigError for a balance that
    does not give each part a layer."""

    def __init__(self, stages: int, virtual: int, replicas: int, balance: Sequence[int],
                 roles: Roles) -> None:
        if type(virtual) is not int or virtual < 1:
            raise ConfigError(f"virtual must be an int >= 1 (parts per stage), not {virtual!r}")
        self.stages, self.virtual, self.replicas = stages, virtual, replicas
        self.parts = stages * virtual
        if len(balance) != self.parts:
            raise ConfigError(f"balance {list(balance)} must have {self.parts} entries (stages x virtual)")
        self.balance = list(balance)
        self.offsets = [sum(self.balance[:s]) for s in range(self.parts)]  # each part's first layer
        self.layers = sum(self.balance)
        self.roles = roles
        # skip name -> (the part that keeps it, the part that uses it), for skips that cross parts
        self.skips = {name: (self.part_of(kept), self.part_of(roles.takes[name]))
                      for name, kept in roles.saves.items()
                      if self.part_of(kept) != self.part_of(roles.takes[name])}

    def part_of(self, layer: int) -> int:
        """The part that runs layer ``layer``."""
        for part in range(self.parts - 1, -1, -1):
            if layer >= self.offsets[part]:
                return part
        raise ConfigError(f"layer {layer} is not in the model")

    def layer_range(self, part: int) -> range:
        """The indices of part ``part``'s layers."""
        return range(self.offsets[part], self.offsets[part] + self.balance[part])

    def stage_of_part(self, part: int) -> int:
        """The stage that runs part ``part``."""
        return part % self.stages

    def local_parts(self, stage: int) -> list[int]:
        """The parts stage ``stage`` runs, in chunk order (its chunk c is part ``stage + c * stages``)."""
        return [stage + c * self.stages for c in range(self.virtual)]

    def rank(self, part: int, replica: int) -> int:
        """The worker that runs part ``part`` of replica ``replica``."""
        return replica * self.stages + self.stage_of_part(part)

    def skips_in(self, part: int) -> list[str]:
        """The skips part ``part`` uses that another part kept, in name order."""
        return sorted(name for name, (_, taker) in self.skips.items() if taker == part)

    def skips_out(self, part: int) -> list[str]:
        """The skips part ``part`` keeps for a later part, in name order."""
        return sorted(name for name, (keeper, _) in self.skips.items() if keeper == part)

    def routes(self, stage: int, replica: int) -> dict[Channel, int]:
        """Each channel worker (stage, replica) receives on, and the rank that sends on it."""
        routes: dict[Channel, int] = {}
        for part in self.local_parts(stage):
            if part > 0:
                routes[(Op.PIPE_ACT, part, "")] = self.rank(part - 1, replica)
            if part < self.parts - 1:
                routes[(Op.PIPE_GRAD, part, "")] = self.rank(part + 1, replica)
            for name in self.skips_in(part):
                routes[(Op.PIPE_ACT, part, name)] = self.rank(self.skips[name][0], replica)
            for name in self.skips_out(part):
                routes[(Op.PIPE_GRAD, part, name)] = self.rank(self.skips[name][1], replica)
        return routes

    def peers(self, stage: int, replica: int) -> set[int]:
        """The ranks worker (stage, replica) sends to or receives from (itself excluded)."""
        me = self.rank(stage, replica)
        return set(self.routes(stage, replica).values()) - {me}

    def tied_stages(self) -> dict[str, list[int]]:
        """Each tied key and the stages that hold a place of it."""
        held: dict[str, set[int]] = {}
        for index, key in self.roles.tied.items():
            held.setdefault(key, set()).add(self.stage_of_part(self.part_of(index)))
        return {key: sorted(stages) for key, stages in held.items()}

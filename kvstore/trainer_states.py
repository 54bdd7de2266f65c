"""The Trainer's optimizer states as a dict of plain values and CPU tensors (``Trainer.state_dict``),
and back (``Trainer.load_state_dict``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstore.core import checkpoint, xp
from kvstore.core.dtypes import BY_NAME, dtype_name

Tensor = Any  # a torch.Tensor; torch is imported lazily


def states_to_dict(states: checkpoint.StatesFile) -> dict[str, Any]:
    """A StatesFile as plain values and CPU tensors (what torch.load(weights_only=True) reads back)."""
    import torch

    def tensors(arrays: Mapping[str, Any]) -> dict[str, Tensor]:
        return {n: torch.from_numpy(xp.to_numpy(a).copy()) for n, a in arrays.items()}

    return {"optimizer": states.optimizer, "num_update": int(states.num_update),
            "states": {e.key: {"count": int(e.count), "shape": [int(d) for d in e.shape],
                               "dtype": dtype_name(e.dtype), "arrays": tensors(e.arrays)}
                       for e in states.entries}}


def states_from_dict(state: Mapping[str, Any]) -> checkpoint.StatesFile:
    """The StatesFile of a :meth:`Trainer.state_dict` dict; ValueError when it is not one."""
    try:
        entries = [checkpoint.StateEntry(key, tuple(e["shape"]), BY_NAME[e["dtype"]], int(e["count"]),
                                         {n: xp.to_numpy(a.detach().cpu()) for n, a in e["arrays"].items()})
                   for key, e in state["states"].items()]
        return checkpoint.StatesFile(state["optimizer"], int(state["num_update"]), entries)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a Trainer state dict ({type(exc).__name__}: {exc})") from None

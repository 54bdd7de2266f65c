"""Updates of a row-sparse table by a row-sparse gradient, pure: assignment without an optimizer, the
optimizer's lazy update (only the rows present, MXNet's ``lazy_update=True``), or its standard one (as
if the gradient were dense, ``lazy_update=False``).

``weight`` is a ``(rows, width)`` array of a table (a server's row range, or a local store's whole
table), updated in place; ``ids`` are sorted distinct row numbers into it and ``rows`` their summed
gradient rows.  The optimizer keeps a state as large as ``weight`` (its rows sharded with it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key


def is_lazy(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` updates only the rows present: its ``lazy_update`` (True by default for
    sgd and adam, as MXNet); rules without one update every row."""
    return bool(getattr(optimizer, "lazy_update", False))


def apply_rows(optimizer: Optimizer | None, key: Key, weight: np.ndarray, ids: np.ndarray,
               rows: np.ndarray) -> None:
    """Apply one summed row-sparse push of ``key`` to ``weight`` in place: the rows assigned without
    an optimizer, else one update (lazy or standard, :func:`is_lazy`).  Raises what
    :meth:`Optimizer.update` raises, before anything changes."""
    if optimizer is None:
        weight[ids] = rows
    elif not is_lazy(optimizer):
        grad = np.zeros_like(weight)
        grad[ids] = rows
        optimizer.update(key, weight, grad)
    elif ids.size:
        lazy_update(optimizer, key, weight, ids, rows)
    else:
        _count(optimizer, key)  # a step with no rows: counted, nothing to update


def _count(optimizer: Optimizer, key: Key) -> int:
    count = optimizer.counts[key] = optimizer.counts.get(key, optimizer.begin_num_update) + 1
    optimizer.num_update = max(optimizer.num_update, count)
    return count


def lazy_update(optimizer: Optimizer, key: Key, weight: np.ndarray, ids: np.ndarray,
                rows: np.ndarray) -> None:
    """The optimizer's rule on the rows ``ids`` only: their weights and state rows are gathered, stepped
    with the key's learning rate, weight decay and update count, and written back (weight decay and
    adam's moments touch those rows only)."""
    state = optimizer.states.get(key)
    if state is None or any(a.shape != weight.shape for a in state.values()):
        state = optimizer.states[key] = optimizer.create_state(key, weight)
    count = _count(optimizer, key)
    lr = float(optimizer.learning_rate) * float(optimizer.lr_mult.get(key, 1.0))
    wd = float(optimizer.wd) * float(optimizer.wd_mult.get(key, 1.0))
    mixed = optimizer._mixed(weight.dtype)
    sub: dict[str, Any] = {name: array[ids] for name, array in state.items()}
    w = weight[ids]
    g = np.multiply(rows, optimizer.rescale_grad, dtype=np.float32 if mixed else weight.dtype)
    optimizer._step(sub["weight32"] if mixed else w, g, sub, lr, wd, count)
    if mixed:
        w[...] = sub["weight32"]
    weight[ids] = w
    for name, array in state.items():
        array[ids] = sub[name]

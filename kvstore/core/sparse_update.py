"""Updates of a row-sparse table by a row-sparse gradient, pure: assignment without an optimizer, the
optimizer's lazy update (only the rows present, MXNet's ``lazy_update=True``), or its standard one (as
if the gradient were dense, ``lazy_update=False``).

``weight`` is a ``(rows, width)`` array of a table (a server's row range, or a local store's whole
table), updated in place; ``ids`` are sorted distinct row numbers into it and ``rows`` their summed
gradient rows.  The optimizer keeps a state as large as ``weight`` (its rows sharded with it).
"""

from __future__ import annotations

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
    else:
        optimizer.update_rows(key, weight, ids, rows)  # a step with no rows: counted, nothing updated

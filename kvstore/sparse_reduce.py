"""Sparse gradients summed over the workers through row-sparse keys, so that only the rows a step touched
travel (docs/sparse.md): what :func:`kvstore.DistributedOptimizer` does with ``nn.Embedding(sparse=True)``
gradients.

torch is imported only when these are used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.base import KVStore
from kvstore.core.rowsparse import RowSparse

Tensor = Any  # a torch.Tensor; torch is not imported when this module loads


class SparseGrads:
    """The parameters of a DistributedOptimizer whose gradients are sparse (``nn.Embedding(sparse=True)``)
    and that the optimizer needs sparse (``torch.optim.SparseAdam``): reduced through a row-sparse key
    each, ``f"{prefix}/rows/{name}"``, so only the rows a step touched travel.

    Which parameters: decided at the first step, over every worker (a gradient sparse on any worker),
    and kept.  Each step, every worker pushes its rows (none when it has no gradient: a dist_sync
    round counts every worker), sends with the dense pushpull a float32 flag per table row that it
    touched, and then pulls the summed rows of every row some worker touched: the reduced gradient,
    sparse, on every worker alike."""

    def __init__(self, kv: KVStore, prefix: str, names: list[str], as_dense: bool) -> None:
        self.kv, self.prefix, self.names, self.as_dense = kv, prefix, names, as_dense
        self.chosen: list[int] = []  # indices into the wrapper's parameters
        self.flag_keys: list[str] = []

    def decide(self, params: list[Tensor]) -> None:
        """Choose the parameters whose gradient is sparse on some worker (collective: one small
        pushpull, the first step only; nothing with ``sparse_as_dense``)."""
        import torch

        if self.as_dense:
            return
        kinds = torch.tensor([p.grad is not None and p.grad.is_sparse for p in params], dtype=torch.float32)
        key = f"{self.prefix}/sparse"
        self.kv.init(key, torch.zeros_like(kinds))
        self.kv.pushpull(key, kinds)
        self.chosen = [i for i, seen in enumerate(kinds.tolist()) if seen > 0]
        self.flag_keys = [f"{self.prefix}/touched/{self.names[i]}" for i in self.chosen]

    def init(self, params: list[Tensor]) -> None:
        """Make each chosen parameter's row-sparse key (zeros, on the servers) and its row flags."""
        import torch

        for i, flags in zip(self.chosen, self.flag_keys):
            p = params[i]
            self.kv.init(self._key(i), shape=tuple(p.shape), dtype=str(p.dtype).removeprefix("torch."))
            self.kv.init(flags, torch.zeros(p.shape[0], dtype=torch.float32))

    def _key(self, i: int) -> str:
        return f"{self.prefix}/rows/{self.names[i]}"

    def push(self, params: list[Tensor]) -> list[Tensor]:
        """Push each chosen parameter's rows; return the row flags to reduce with the pushpull."""
        import torch

        flags = []
        for i in self.chosen:
            p = params[i]
            touched = torch.zeros(p.shape[0], dtype=torch.float32)
            if p.grad is None:
                none = np.zeros((0, *p.shape[1:]), _np_dtype(p))
                value: Any = RowSparse(np.zeros(0, np.int64), none, p.shape)
            elif p.grad.is_sparse:
                value = p.grad.coalesce()
                touched[value.indices()[0]] = 1.0
            else:  # a dense gradient for a table: every row
                value = p.grad
                touched.fill_(1.0)
            self.kv.push(self._key(i), value)
            flags.append(touched)
        return flags

    def pull(self, params: list[Tensor], flags: list[Tensor], present: Tensor, scale: float) -> None:
        """Give each chosen parameter the summed rows of every row some worker touched (times
        ``scale``), as a sparse gradient; None where no worker had a gradient."""
        import torch

        for i, touched in zip(self.chosen, flags):
            p = params[i]
            if present[i] == 0:
                p.grad = None
                continue
            ids = torch.nonzero(touched > 0).reshape(-1)
            got = self.kv.row_sparse_pull(self._key(i), row_ids=ids.numpy())
            rows = torch.as_tensor(np.asarray(got.rows), dtype=p.dtype).reshape(len(ids), *p.shape[1:])
            if scale != 1.0:
                rows = rows * scale
            p.grad = torch.sparse_coo_tensor(ids.reshape(1, -1), rows, tuple(p.shape), is_coalesced=True,
                                             check_invariants=False)  # ids: sorted, distinct, in range


def _np_dtype(p: Tensor) -> np.dtype:
    """The numpy dtype of a float tensor ``p``."""
    return np.dtype(str(p.dtype).removeprefix("torch."))

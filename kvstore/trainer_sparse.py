"""Training with embedding tables held on the servers as row-sparse keys (docs/sparse.md): a worker pulls
only the rows a batch needs and pushes only the rows its gradient has.

* :class:`SparseEmbedding` is a table of ``num_rows x dim`` that lives in the store; the worker holds the
  rows of the current batch only (``prefetch``), as a small dense parameter that autograd fills.
* ``torch.nn.Embedding(sparse=True)`` modules work too: their sparse gradient is pushed, and
  ``prefetch`` writes the pulled rows into the module's weight (the module holds a full-size table;
  only the rows prefetched are current).
* :class:`SparseTrainer` wraps a :class:`kvstore.Trainer` for the dense parameters (the optimizer runs
  in the store, for both) and adds the embeddings: ``prefetch(embedding, row_ids)`` before the forward
  pass, ``step(batch_size)`` after the backward pass.

torch is imported only when these are used.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvstore import config as kvconfig
from kvstore.base import KVStore
from kvstore.core import optimizer as kvoptimizer
from kvstore.core.optimizer import Optimizer
from kvstore.core.rowsparse import RowSparse
from kvstore.stores import create
from kvstore.trainer import Trainer, next_key_prefix

TorchEmbedding = Any  # a torch.nn.Embedding; torch is not imported when this module loads

_tables = itertools.count()
# embedding -> the SparseTrainer that updates it: a second one over it is refused (as gluon refuses a
# second Trainer for a row_sparse Parameter); the trainer's entry goes with it
_owners: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()


class SparseEmbedding:
    """An embedding table of ``num_rows x dim`` held in a store; only prefetched rows are on the worker.

    Call it on a tensor of row ids (after :meth:`prefetch` of them, or it prefetches them itself) to
    get their vectors; after ``backward()``, :meth:`gradient` is the batch's row-sparse gradient.
    """

    def __init__(self, num_rows: int, dim: int, init: Any = "normal", dtype: str = "float32",
                 key: str | None = None) -> None:
        self.num_rows, self.dim, self.init, self.dtype = int(num_rows), int(dim), init, np.dtype(dtype)
        self.key = f"embedding{next(_tables)}" if key is None else key
        self.ids = np.zeros(0, np.int64)  # the rows held now, sorted
        self.weight: Any = None  # a (len(ids), dim) leaf tensor that requires grad

    @property
    def shape(self) -> tuple[int, int]:
        """The table's shape."""
        return (self.num_rows, self.dim)

    def create(self, kv: KVStore) -> None:
        """Create the table in ``kv`` (collective; on the servers in dist modes)."""
        kv.init(self.key, shape=self.shape, dtype=self.dtype, init=self.init)

    def prefetch(self, kv: KVStore, row_ids: Any) -> None:
        """Pull the rows ``row_ids`` (any ints, any order, repeats allowed) from ``kv``; they replace the
        rows held.  Raises what ``row_sparse_pull`` raises."""
        import torch

        pulled = kv.row_sparse_pull(self.key, row_ids=row_ids)
        self.ids = pulled.indices
        self.weight = torch.from_numpy(np.ascontiguousarray(pulled.rows)).requires_grad_(True)

    def __call__(self, row_ids: Any) -> Any:
        """The vectors of ``row_ids`` (a tensor of ints), from the rows prefetched; KeyError for an id
        that was not prefetched."""
        import torch

        flat = row_ids.reshape(-1).cpu().numpy().astype(np.int64)
        local = np.searchsorted(self.ids, flat)
        if flat.size and (local.max() >= self.ids.size or not np.array_equal(self.ids[local], flat)):
            raise KeyError(f"{self.key}: some row ids were not prefetched; call trainer.prefetch(embedding, "
                           "row_ids) with every id of the batch first")
        index = torch.from_numpy(local).reshape(row_ids.shape)
        return torch.nn.functional.embedding(index, self.weight)

    def gradient(self) -> RowSparse:
        """The gradient of the rows held (none when the batch did not use the table)."""
        grad = None if self.weight is None else self.weight.grad
        if grad is None:
            return RowSparse(np.zeros(0, np.int64), np.zeros((0, self.dim), self.dtype), self.shape)
        return RowSparse(self.ids, grad.detach().cpu().numpy(), self.shape)


class SparseTrainer:
    """A :class:`kvstore.Trainer` over the dense ``params`` (None or empty: no dense parameter) plus
    row-sparse ``embeddings``, updated by one optimizer in the store (``update_on_kvstore``).
    ``embeddings`` holds :class:`SparseEmbedding` objects and ``torch.nn.Embedding(sparse=True)``
    modules (whose weights are left out of ``params``).  Raises ValueError for an ``nn.Embedding``
    without ``sparse=True``, for an embedding given twice or that another live SparseTrainer updates
    (naming it), and for neither a parameter nor an embedding to train."""

    def __init__(self, params: Iterable[Any] | Mapping[str, Any] | None, optimizer: Any,
                 optimizer_params: Mapping[str, Any] | None = None, embeddings: Sequence[Any] = (),
                 kvstore: KVStore | str | None = None, key_prefix: str | None = None) -> None:
        import torch

        self.embeddings = list(embeddings)
        tables = {id(e.weight) for e in self.embeddings if isinstance(e, torch.nn.Embedding)}
        for e in self.embeddings:
            if isinstance(e, torch.nn.Embedding) and not e.sparse:
                raise ValueError("an nn.Embedding given to SparseTrainer needs sparse=True")
        items = () if params is None else params.items() if isinstance(params, Mapping) else params
        dense = [p for p in items if id(p[1] if isinstance(p, tuple) else p) not in tables]
        dense = [p for p in dense if (p[1] if isinstance(p, tuple) else p).requires_grad]
        if not dense and not self.embeddings:
            raise ValueError("no parameter requires grad and no embedding: nothing to train")
        self.trainer: Trainer | None = None
        if dense:
            self.trainer = Trainer(dense, optimizer, optimizer_params, kvstore=kvstore,
                                   update_on_kvstore=True, key_prefix=key_prefix)
            prefix = self.trainer.keys[0].rsplit("/", 1)[0]
            self._kv, self._optimizer = self.trainer.kvstore, self.trainer.optimizer
            self._scale = 1.0
        else:  # the embeddings alone: the store and its optimizer are this object's
            prefix = next_key_prefix() if key_prefix is None else key_prefix
            if isinstance(optimizer, Optimizer):
                if optimizer_params is not None:
                    raise ValueError("optimizer_params must be None when optimizer is an Optimizer object")
                self._optimizer = optimizer
            else:
                self._optimizer = kvoptimizer.create(optimizer, **dict(optimizer_params or {}))
            self._scale = float(self._optimizer.rescale_grad)
            if kvstore is None:
                kvstore = "dist_sync" if kvconfig.in_cluster() else "local"
            self._kv = create(kvstore) if isinstance(kvstore, str) else kvstore
        self._keys = [e.key if isinstance(e, SparseEmbedding) else f"{prefix}/embedding{i}"
                      for i, e in enumerate(self.embeddings)]
        self._claim()
        self._created = False

    def _claim(self) -> None:
        """Become the one SparseTrainer of each embedding; ValueError naming one that has another."""
        for i, (key, e) in enumerate(zip(self._keys, self.embeddings)):
            if any(other is e for other in self.embeddings[:i]):
                raise ValueError(f"embedding {key!r} is given twice; pass each once")
            owner = _owners.get(e)
            if owner is not None and owner() is not None:
                raise ValueError(f"embedding {key!r} is already updated by another SparseTrainer: one "
                                 "trainer per embedding (its rows' optimizer state is on the servers)")
        for e in self.embeddings:
            _owners[e] = weakref.ref(self)

    @property
    def kvstore(self) -> KVStore:
        """The store."""
        return self._kv

    def _create(self) -> None:
        """Collective, once: the dense keys and the optimizer, then every embedding's table."""
        if self._created:
            return
        if self.trainer is not None:
            self.trainer.init_kvstore()
        else:
            self._kv.set_optimizer(self._optimizer)
        kv = self.kvstore
        for key, e in zip(self._keys, self.embeddings):
            if isinstance(e, SparseEmbedding):
                e.create(kv)
            else:
                kv.init(key, e.weight.detach(), stype="row_sparse")  # rank 0's table
        self._created = True

    def prefetch(self, embedding: SparseEmbedding | TorchEmbedding, row_ids: Any) -> None:
        """Pull the rows ``row_ids`` of ``embedding`` (one of this trainer's) for the next batch."""
        self._create()
        i = self.embeddings.index(embedding)
        if isinstance(embedding, SparseEmbedding):
            embedding.prefetch(self.kvstore, row_ids)
            return
        import torch

        pulled = self.kvstore.row_sparse_pull(self._keys[i], row_ids=row_ids)
        with torch.no_grad():
            embedding.weight[torch.from_numpy(pulled.indices)] = torch.from_numpy(pulled.rows)

    def step(self, batch_size: float) -> None:
        """One step: the dense parameters as ``Trainer.step``, then every embedding's row gradient
        pushed (an empty one when the batch did not use it: dist_sync rounds count every worker)."""
        self._create()
        if self.trainer is not None:
            self.trainer.step(batch_size)
        else:  # gluon's rule, as Trainer.step: rescale_grad = scale / batch_size
            if not batch_size > 0:
                raise ValueError(f"batch_size must be positive, got {batch_size!r}")
            rescale = self._scale / batch_size
            if rescale != self._optimizer.rescale_grad:
                self._optimizer.rescale_grad = rescale
                self._kv.set_optimizer_params(rescale_grad=rescale)
        for key, e in zip(self._keys, self.embeddings):
            if isinstance(e, SparseEmbedding):
                grad = e.gradient()
            elif e.weight.grad is None:
                grad = RowSparse(np.zeros(0, np.int64), np.zeros((0, e.embedding_dim), np.float32),
                                 tuple(e.weight.shape))
            else:
                grad = e.weight.grad
            self.kvstore.push(key, grad)
            if not isinstance(e, SparseEmbedding):
                e.weight.grad = None

    def save_states(self, fname: str) -> None:
        """Write the optimizer and the states of every key, dense and row-sparse, to ``fname`` (call it
        on every worker: collective; gathered from the servers, rank 0 writes)."""
        self._create()
        if self.trainer is not None:
            self.trainer.save_states(fname)
        else:
            self._kv.save_optimizer_states(str(fname), dump_optimizer=True)

    def load_states(self, fname: str) -> None:
        """Restore what :meth:`save_states` wrote (call it on every worker: collective).  Raises what
        ``load_optimizer_states`` raises for a file that does not fit."""
        self._create()
        if self.trainer is not None:
            self.trainer.load_states(fname)
        else:
            self._kv.load_optimizer_states(str(fname))

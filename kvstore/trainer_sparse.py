"""Training with embedding tables held on the servers as row-sparse keys (docs/sparse.md): a worker pulls
only the rows a batch needs and pushes only the rows its gradient has.

* :class:`SparseEmbedding` is a table of ``num_rows x dim`` that lives in the store; the worker holds the
  rows of the current batch only (``prefetch``), as a small dense parameter that autograd fills.
* ``torch.nn.Embedding(sparse=True)`` modules work too: their sparse gradient is pushed, and
  ``prefetch`` writes the pulled rows into the module's weight (the module holds a full-size table;
  only the rows prefetched are current).
* :class:`SparseTrainer` wraps a :class:`kvstore.Trainer` for the dense parameters (the optimizer runs
  in the store, for both) and adds the embeddings: ``prefetch(embedding, row_ids)`` before the forward
  pass, ``step(batch_size)`` after the backward pass.  With ``update_on_kvstore=False`` every worker
  holds its ``nn.Embedding`` tables whole and runs the optimizer itself: the dense gradients are summed
  as by ``Trainer(update_on_kvstore=False)``, each table's rows by a
  :class:`kvstore.sparse_reduce.RowReducer`, and the optimizer updates the touched rows only.

torch is imported only when these are used.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvstore import config as kvconfig
from kvstore.base import KVStore, layer_calls
from kvstore.core import checkpoint
from kvstore.core import optimizer as kvoptimizer
from kvstore.core.optimizer import Optimizer
from kvstore.core.rowsparse import RowSparse
from kvstore.core.sparse_update import apply_rows
from kvstore.sparse_reduce import RowReducer
from kvstore.stores import create
from kvstore.trainer import ServerRescale, Trainer, next_key_prefix, resolve_update_on_kvstore

TorchEmbedding = Any  # a torch.nn.Embedding; torch is not imported when this module loads

_tables = itertools.count()
# embedding -> the SparseTrainer that updates it: a second one over it is refused (as gluon refuses a
# second Trainer for a row_sparse Parameter); the trainer's entry goes with it
_owners: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()


class SparseEmbedding:
    """An embedding table of ``num_rows x dim`` held in a store; only prefetched rows are on the worker.

    Call it on a tensor of row ids (after :meth:`prefetch` of them, or it prefetches them itself) to
    get their vectors; after ``backward()``, :meth:`gradient` is the batch's row-sparse gradient.
    With ``dynamic`` (True or a dict of capacity, policy, admit_after, ttl: docs/sparse.md, "Dynamic
    tables") the table is a dynamic one: ids are any int64 (or uint64 bits) value, ``num_rows`` is None,
    and a row is made on the servers when its gradient is first pushed.  Raises ValueError for
    ``num_rows`` given with ``dynamic`` or missing without it.
    """

    def __init__(self, num_rows: int | None, dim: int, init: Any = "normal", dtype: str = "float32",
                 key: str | None = None, dynamic: Any = None) -> None:
        if (num_rows is None) == (dynamic is None or dynamic is False):
            raise ValueError("SparseEmbedding takes num_rows for a fixed table, or num_rows=None and "
                             "dynamic= for a dynamic one")
        self.dynamic = None if dynamic is False else dynamic
        self.num_rows = 0 if num_rows is None else int(num_rows)  # 0: a dynamic table's ids are unbounded
        self.dim, self.init, self.dtype = int(dim), init, np.dtype(dtype)
        self.key = f"embedding{next(_tables)}" if key is None else key
        self.ids = np.zeros(0, np.int64)  # the rows held now, sorted
        self.weight: Any = None  # a (len(ids), dim) leaf tensor that requires grad

    @property
    def shape(self) -> tuple[int, int]:
        """The table's shape (a dynamic table's first dim is 0: its ids are not bounded)."""
        return (self.num_rows, self.dim)

    def create(self, kv: KVStore) -> None:
        """Create the table in ``kv`` (collective; on the servers in dist modes)."""
        if self.dynamic is not None:
            kv.init(self.key, width=self.dim, dtype=self.dtype, init=self.init, dynamic=self.dynamic)
        else:
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
    row-sparse ``embeddings``, updated by one optimizer.
    ``embeddings`` holds :class:`SparseEmbedding` objects and ``torch.nn.Embedding(sparse=True)``
    modules (whose weights are left out of ``params``).  ``update_on_kvstore``: True or None (the
    default), the store runs the optimizer and holds the tables; False, every worker holds its
    ``nn.Embedding`` tables whole and runs the optimizer itself on the summed gradients, a table's on
    the rows some worker touched only (docs/sparse.md).  Raises ValueError for an ``nn.Embedding``
    without ``sparse=True``, for an embedding given twice or that another live SparseTrainer updates
    (naming it), for neither a parameter nor an embedding to train, and with update_on_kvstore=False
    for an async store, a :class:`SparseEmbedding` or a table that is not a CPU tensor."""

    def __init__(self, params: Iterable[Any] | Mapping[str, Any] | None, optimizer: Any,
                 optimizer_params: Mapping[str, Any] | None = None, embeddings: Sequence[Any] = (),
                 kvstore: KVStore | str | None = None, key_prefix: str | None = None,
                 update_on_kvstore: bool | None = None) -> None:
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
        if kvstore is None:
            kvstore = "dist_sync" if kvconfig.in_cluster() else "local"
        store_type = kvstore if isinstance(kvstore, str) else kvstore.type
        self._on_store = update_on_kvstore is not False or resolve_update_on_kvstore(False, store_type)
        if not self._on_store:
            _check_local_tables(self.embeddings)
        self.trainer: Trainer | None = None
        views: list[tuple[str, Any]] = []  # (key, table weight), filled below: no cycle through a method
        if dense:
            self.trainer = Trainer(dense, optimizer, optimizer_params, kvstore=kvstore,
                                   update_on_kvstore=self._on_store, key_prefix=key_prefix,
                                   extra_weights=None if self._on_store else lambda: _numpy_views(views))
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
            self._kv = create(kvstore) if isinstance(kvstore, str) else kvstore
        self._rescales = ServerRescale(self._kv)  # the embeddings alone on a dist store's servers
        self._keys = [e.key if isinstance(e, SparseEmbedding) else f"{prefix}/embedding{i}"
                      for i, e in enumerate(self.embeddings)]
        views += [(key, e.weight) for key, e in zip(self._keys, self.embeddings)]
        self._reducer = None if self._on_store else RowReducer(
            self._kv, f"{prefix}/rowsum", [(f"embedding{i}", tuple(e.weight.shape), _np_dtype(e.weight))
                                           for i, e in enumerate(self.embeddings)])
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

    @property
    def update_on_kvstore(self) -> bool:
        """Whether the store runs the optimizer and holds the tables (else every worker does)."""
        return self._on_store

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer; with update_on_kvstore=False it holds every key's state, the tables' rows
        included (with update_on_kvstore in dist modes: without the servers' state)."""
        return self.trainer.optimizer if self.trainer is not None else self._optimizer

    def _table_weights(self) -> dict[str, np.ndarray]:
        """The tables as the local optimizer updates them: numpy views of their weights, by key."""
        return _numpy_views((key, e.weight) for key, e in zip(self._keys, self.embeddings))

    def _create(self) -> None:
        """Collective, once: the dense keys and the optimizer, then every embedding's table (with
        update_on_kvstore=False: rank 0's tables copied into every worker's)."""
        if self._created:
            return
        if self.trainer is not None:
            self.trainer.init_kvstore()
        elif self._on_store:
            self._kv.set_optimizer(self._optimizer)
        kv = self.kvstore
        if self._reducer is not None:
            import torch

            self._reducer.init([e.weight.detach() for e in self.embeddings])
            for i, e in enumerate(self.embeddings):
                with torch.no_grad():
                    e.weight.copy_(torch.from_numpy(self._reducer.initial(i)))
            self._created = True
            return
        for key, e in zip(self._keys, self.embeddings):
            if isinstance(e, SparseEmbedding):
                e.create(kv)
            else:
                kv.init(key, e.weight.detach(), stype="row_sparse")  # rank 0's table
        self._created = True

    def prefetch(self, embedding: SparseEmbedding | TorchEmbedding, row_ids: Any) -> None:
        """Pull the rows ``row_ids`` of ``embedding`` (one of this trainer's) for the next batch; with
        update_on_kvstore=False the worker's table is current already and nothing is pulled."""
        self._create()
        i = self.embeddings.index(embedding)
        if self._reducer is not None:
            return
        if isinstance(embedding, SparseEmbedding):
            embedding.prefetch(self.kvstore, row_ids)
            return
        import torch

        pulled = self.kvstore.row_sparse_pull(self._keys[i], row_ids=row_ids)
        with torch.no_grad():
            embedding.weight[torch.from_numpy(pulled.indices)] = torch.from_numpy(pulled.rows)

    def _gradient_factor(self, batch_size: float) -> float:
        """gluon's rule, as ``Trainer.step``: rescale_grad = scale / batch_size.  Returns what this
        step's rows are multiplied by before they are pushed: with a Trainer for the dense parameters,
        its :meth:`Trainer.gradient_factor`; for the embeddings alone on a dist store's servers, this
        step's rescale over the servers' agreed one (:class:`ServerRescale`); elsewhere 1.0, the
        rescale set on the (local) optimizer.  ValueError for a batch_size <= 0."""
        if self.trainer is not None:
            return self.trainer.gradient_factor(batch_size)
        if not batch_size > 0:
            raise ValueError(f"batch_size must be positive, got {batch_size!r}")
        rescale = self._scale / batch_size
        if self._on_store and self._kv.type.startswith("dist"):
            return self._rescales.factor(rescale)
        if rescale != self._optimizer.rescale_grad:
            self._optimizer.rescale_grad = rescale
            if self._on_store:
                self._kv.set_optimizer_params(rescale_grad=rescale)
        return 1.0

    def _gradients(self) -> list[Any]:
        """Every embedding's row gradient of this step (an empty one when the batch did not use it);
        an ``nn.Embedding``'s ``.grad`` is reset to None."""
        grads = []
        for e in self.embeddings:
            if isinstance(e, SparseEmbedding):
                grads.append(e.gradient())
                continue
            grad = e.weight.grad
            if grad is None:
                grads.append(RowSparse(np.zeros(0, np.int64), np.zeros((0, e.embedding_dim),
                                                                        _np_dtype(e.weight)),
                                       tuple(e.weight.shape)))
            elif self._on_store:
                grads.append(grad)  # the store takes a sparse (or dense) tensor as it is
            elif grad.is_sparse:
                grad = grad.detach().coalesce()
                grads.append(RowSparse(grad.indices()[0], grad.values(), tuple(e.weight.shape)))
            else:  # a dense gradient for a table: every row
                grads.append(RowSparse(np.arange(grad.shape[0]), grad.detach(), tuple(e.weight.shape)))
            e.weight.grad = None
        return grads

    def step(self, batch_size: float) -> None:
        """One step: the dense parameters as ``Trainer.step``, and every embedding's row gradient
        pushed (an empty one when the batch did not use it: dist_sync rounds count every worker).
        With update_on_kvstore=False the summed rows of every row some worker touched come back and
        the local optimizer updates those rows (lazily: other rows and their state stay)."""
        self._create()
        grads = self._gradients()
        if self._reducer is not None:
            self._reducer.push(grads)  # summed on the servers while the dense step runs
        if self.trainer is not None:
            self.trainer.step(batch_size)
        if self._reducer is None:
            factor = self._gradient_factor(batch_size)
            for key, grad in zip(self._keys, grads):
                self.kvstore.push(key, grad if factor == 1.0 else _scaled(grad, factor))
            return
        if self.trainer is None:
            self._gradient_factor(batch_size)  # the local optimizer's rescale_grad
        opt = self.optimizer
        for key, e, summed in zip(self._keys, self.embeddings, self._reducer.pull()):
            apply_rows(opt, key, e.weight.detach().numpy(), summed.indices, np.ascontiguousarray(summed.rows))

    def save_states(self, fname: str) -> None:
        """Write the optimizer and the states of every key, dense and row-sparse, to ``fname`` (call it
        on every worker: collective; gathered from the servers, or this worker's own with
        update_on_kvstore=False; rank 0 writes)."""
        self._create()
        if self.trainer is not None:
            self.trainer.save_states(fname)
        elif self._on_store:
            self._kv.save_optimizer_states(str(fname), dump_optimizer=True)
        else:
            def write() -> None:
                states = checkpoint.optimizer_states(self._optimizer, self._table_weights(), True)
                checkpoint.write_states(str(fname), states)

            layer_calls(self._kv).collective("SparseTrainer.save_states", write)

    def load_states(self, fname: str) -> None:
        """Restore what :meth:`save_states` wrote (call it on every worker: collective).  Raises what
        ``load_optimizer_states`` raises for a file that does not fit."""
        self._create()
        if self.trainer is not None:
            self.trainer.load_states(fname)
        elif self._on_store:
            self._kv.load_optimizer_states(str(fname))
            self._rescales.reset()  # the file's rescale_grad is the servers' now
        else:
            states = checkpoint.read_states(str(fname))
            self._optimizer = checkpoint.restore_optimizer(states, self._optimizer, self._table_weights())


def _scaled(grad: Any, factor: float) -> Any:
    """A row gradient (a RowSparse or a torch tensor, sparse or dense) times ``factor``, its dtype kept."""
    if isinstance(grad, RowSparse):
        rows = np.asarray(grad.rows)
        return RowSparse(grad.indices, rows * rows.dtype.type(factor), grad.shape)
    return grad * factor


def _numpy_views(weights: Iterable[tuple[str, Any]]) -> dict[str, np.ndarray]:
    """Numpy views of CPU tensors, by key: what the local optimizer updates in place."""
    return {key: w.detach().numpy() for key, w in weights}


def _np_dtype(t: Any) -> np.dtype:
    """The numpy dtype of a float tensor ``t``."""
    return np.dtype(str(t.dtype).removeprefix("torch."))


def _check_local_tables(embeddings: Sequence[Any]) -> None:
    """With update_on_kvstore=False every worker holds and updates its tables: ValueError for a
    SparseEmbedding (its table lives in the store only) or a table that is not a contiguous CPU tensor
    of float16, float32 or float64."""
    for i, e in enumerate(embeddings):
        if isinstance(e, SparseEmbedding):
            raise ValueError(f"SparseEmbedding {e.key!r} keeps its table in the store; with "
                             "update_on_kvstore=False every worker holds its tables whole: use "
                             "nn.Embedding(sparse=True), or update_on_kvstore=True")
        w = e.weight
        if w.device.type != "cpu" or not w.is_contiguous() or str(w.dtype).removeprefix("torch.") not in (
                "float16", "float32", "float64"):
            raise ValueError(f"embedding {i}'s table is {w.dtype} on {w.device}: with "
                             "update_on_kvstore=False a table is a contiguous float16, float32 or float64 "
                             "CPU tensor")

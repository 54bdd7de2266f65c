"""kvstore: Apache MXNet's distributed KVStore for PyTorch and NumPy users.

>>> import kvstore, numpy as np
>>> kv = kvstore.create('local')
>>> kv.init(3, np.ones((2, 3), np.float32))
>>> kv.push(3, [np.ones((2, 3), np.float32)] * 2)
>>> kv.pull(3)[0, 0]
np.float32(2.0)

Submodules: ``kvstore.optimizer`` (server-side update rules), ``kvstore.lr_scheduler``,
``kvstore.checkpoint`` (the file format), ``kvstore.snapshot`` (server snapshots on disk),
``kvstore.data`` (sharding helpers), ``kvstore.sparse`` (row-sparse keys, ``RowSparse``).
Importing kvstore never imports torch.
"""

import sys as _sys

from kvstore import data as data
from kvstore import sparse as sparse
from kvstore.base import KVStore
from kvstore.client.meter import log_scalar
from kvstore.core import checkpoint as checkpoint
from kvstore.core import lr_scheduler as lr_scheduler
from kvstore.core import optimizer as optimizer
from kvstore.core import snapshot as snapshot
from kvstore.core.worker_sets import WorkerSet
from kvstore.errors import (
    AuthenticationError,
    ChildFailed,
    CollectiveMismatchError,
    ConfigError,
    DeadlineExceededError,
    DTypeMismatchError,
    DuplicateInitError,
    FeedError,
    FormatError,
    IntegrityError,
    KeyNotInitializedError,
    KeyTypeError,
    KVStoreError,
    NodeLostError,
    NotAMemberError,
    NotEnoughSlotsError,
    OptimizerError,
    PlacementError,
    ProtocolError,
    RemoteError,
    RoleFailed,
    SchedulerRebuildingError,
    ShapeMismatchError,
    SparkJobFailed,
    StallError,
    StartFailed,
    StoreClosedError,
    SyncFailed,
    TaskFailed,
    TooFewWorkersError,
    UnknownModeError,
    UnsupportedError,
)
from kvstore.session import Session
from kvstore.sparse import RowSparse
from kvstore.stores import KNOWN_TYPES, create
from kvstore.torch_optim import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from kvstore.trainer import Trainer
from kvstore.trainer_sparse import SparseEmbedding, SparseTrainer

# MXNet's module names (``import kvstore.optimizer``, ``from kvstore.lr_scheduler import ...``) are the
# pure-logic modules of kvstore.core themselves, bound under the public name as ``os.path`` is bound to
# ``posixpath``: one module, two names, no re-export file to keep in step.  (``kvstore.scheduler`` is the
# repository's top-level scheduler/ folder through the link kvstore/scheduler, see docs/architecture.md.)
for _module in (checkpoint, lr_scheduler, optimizer, snapshot):
    _sys.modules[f"kvstore.{_module.__name__.rpartition('.')[2]}"] = _module

__version__ = "0.1.0"

__all__ = [
    "KNOWN_TYPES", "KVStore", "create", "Trainer", "Session", "__version__", "log_scalar", "RowSparse",
    "SparseEmbedding", "SparseTrainer",
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "KVStoreError", "ConfigError", "UnknownModeError", "KeyNotInitializedError",
    "DuplicateInitError", "ShapeMismatchError", "DTypeMismatchError", "KeyTypeError",
    "DeadlineExceededError", "NodeLostError", "ProtocolError", "AuthenticationError",
    "RemoteError", "StoreClosedError", "OptimizerError", "FormatError",
    "UnsupportedError", "StallError", "IntegrityError", "CollectiveMismatchError", "TooFewWorkersError",
    "NotAMemberError", "SchedulerRebuildingError", "WorkerSet",
    # the launchers' (launch.py, kvstore.ray.run, kvstore.spark.run)
    "ChildFailed", "StartFailed", "SyncFailed", "PlacementError", "RoleFailed", "SparkJobFailed",
    "NotEnoughSlotsError", "TaskFailed", "FeedError",
]

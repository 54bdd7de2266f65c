"""The one exception tree of kvstore.

Every error about keys, values, the store or the cluster is a
:class:`KVStoreError`; where a built-in exception means the same thing, the
error subclasses it too, so ``except KeyError`` or ``except TimeoutError`` in
user code keeps working.  Plain argument mistakes (a list where an array is
due, a number of values that does not match the number of keys, a read-only
``out``) raise plain ``TypeError``/``ValueError``, as any Python function would::

    KVStoreError
     +-- ConfigError(ValueError)           bad or missing DMLC_* / KVSTORE_* setting
     +-- UnknownModeError(ValueError)      create() got a name it does not know
     +-- KeyNotInitializedError(KeyError)  push/pull of a key that was never init'ed
     +-- DuplicateInitError                init of a key that already exists
     +-- ShapeMismatchError(ValueError)    value or out has the wrong shape
     +-- DTypeMismatchError(ValueError)    value or out has the wrong dtype
     +-- KeyTypeError(TypeError)           key is not an int in [0, 2**64) or a str
     +-- DeadlineExceededError(TimeoutError) a wait ran past its deadline
     |    +-- StallError(TimeoutError)       KVSTORE_STALL_ABORT: a barrier or round waited too long for
     |                                       late workers (the message names them)
     +-- NodeLostError(ConnectionError)    a peer process went away
     +-- ProtocolError                     a message could not be decoded
     +-- AuthenticationError(PermissionError) a peer failed to prove the secret
     |    +-- IntegrityError(PermissionError) KVSTORE_AUTH=full: a message's array bytes were damaged
     +-- RemoteError                       a peer reported a failure we cannot type
     +-- StoreClosedError                  the store was closed (or belongs to another process)
     +-- OptimizerError(ValueError)        a bad optimizer spec or setting, no optimizer where one
     |                                     is needed, or optimizer states that do not fit
     +-- FormatError(ValueError)           a file is not in kvstore's format, is of a newer
     |                                     version, or is damaged
     +-- UnsupportedError(NotImplementedError) an MXNet KVStore method kvstore will never have
     +-- CollectiveMismatchError(ValueError) the workers called a collective with arguments that
                                           differ (shapes, dtypes, root rank, keys); raised on every
                                           worker, naming the ranks and what differs
     +-- TooFewWorkersError                an elastic job shrank below launch.py --min-workers: the
     |                                     first barrier after it fails on every worker
     +-- NotAMemberError(PermissionError)  init, push or pull of a key of a worker set (docs/worker-sets.md)
                                           by a worker outside that set; the message names the key,
                                           the set and the worker

The launchers' errors are KVStoreErrors too, defined here as well (this module imports neither Ray
nor Spark; ``kvstore.ray`` and ``kvstore.spark`` re-export theirs)::

    ChildFailed           launch.py: a process exited when it should not have
    StartFailed           launch.py: a process could not be started
    SyncFailed            launch.py: rsync of --sync-dst-dir to a host failed
    PlacementError        Ray could not place every role within the placement timeout
    RoleFailed            a role on Ray exited non-zero, raised, or its actor died
    SparkJobFailed        the Spark barrier job failed
    TaskFailed            (also a RuntimeError) raised inside a Spark task; its text reaches the driver
    NotEnoughSlotsError   (a ConfigError) fewer concurrent Spark task slots than 1 + S + W
    FeedError             the streaming feed of kvstore.spark.run(epochs=...) failed or timed out

Errors cross the wire as ``(code, message)`` pairs; :func:`error_code` and
:func:`error_from_code` translate between the two so a server-side
``ShapeMismatchError`` is raised as a ``ShapeMismatchError`` on the worker.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable
from typing import Any, TypeVar


class KVStoreError(Exception):
    """Base class of every error raised by kvstore."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is missing or invalid; the message says how to fix it."""


class UnknownModeError(KVStoreError, ValueError):
    """``create()`` was given a store type it does not know."""


class KeyNotInitializedError(KVStoreError, KeyError):
    """A key was used before ``init``."""

    def __str__(self) -> str:
        # KeyError.__str__ quotes its argument; a sentence reads better.
        return str(self.args[0]) if self.args else ""


class DuplicateInitError(KVStoreError):
    """``init`` was called for a key that is already initialised."""


class ShapeMismatchError(KVStoreError, ValueError):
    """A value's shape differs from the shape the key was initialised with."""


class DTypeMismatchError(KVStoreError, ValueError):
    """A value's dtype differs from the dtype the key was initialised with."""


class KeyTypeError(KVStoreError, TypeError):
    """A key is neither an int in ``[0, 2**64)`` nor a str."""


class DeadlineExceededError(KVStoreError, TimeoutError):
    """A blocking wait ran past its deadline; the message names what it waited for."""


class StallError(DeadlineExceededError):
    """``KVSTORE_STALL_ABORT``: a barrier or sync round waited longer than that for late workers; the
    message names them and what each last did."""


class NodeLostError(KVStoreError, ConnectionError):
    """A peer (scheduler, server or worker) went away.

    Attributes ``role``, ``rank`` and ``host`` name the lost node where known.
    """

    def __init__(self, message: str, role: str | None = None, rank: int | None = None,
                 host: str | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.host = host


class ProtocolError(KVStoreError):
    """A message was malformed, of another protocol version, or of an unknown op."""


class SchedulerRebuildingError(ProtocolError):
    """A scheduler restarted under ``--max-restarts`` is still rebuilding the cluster from its nodes'
    re-registrations: a new registration (a join, a restarted worker) is refused for now, and
    registration asks again until ``KVSTORE_CONNECT_TIMEOUT`` (kvstore/net/handshake.py)."""


class AuthenticationError(KVStoreError, PermissionError):
    """A peer could not prove it holds the cluster secret."""


class IntegrityError(AuthenticationError):
    """``KVSTORE_AUTH=full``: a message's header authenticated but its array bytes failed the payload
    tag (damaged in transit); the receiver applied nothing of it."""


class RemoteError(KVStoreError):
    """A peer reported a failure that has no more specific type here."""


class StoreClosedError(KVStoreError):
    """The store is closed, or was created in another process (e.g. before a fork)."""


class OptimizerError(KVStoreError, ValueError):
    """An optimizer spec or setting is invalid, none is set where one is needed, or states do not fit."""


class FormatError(KVStoreError, ValueError):
    """A file is not in kvstore's format, is of a newer format version, or is damaged."""


class UnsupportedError(KVStoreError, NotImplementedError):
    """An MXNet KVStore method that kvstore does not have and never will; the message says what to
    use instead (docs/api.md lists them)."""


class CollectiveMismatchError(KVStoreError, ValueError):
    """The workers called one collective (an init, a broadcast, a sync round of a key) with arguments
    that differ: a shape, a dtype, the root rank, or the set or order of keys.  Every worker raises it;
    the message names the ranks that disagree and what differs, and ``ranks`` lists those that differ
    from the lowest rank of the largest group that agrees (empty where unknown, as after the wire).
    Nothing was changed: the store stays usable."""

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])


class TooFewWorkersError(KVStoreError):
    """An elastic job has fewer workers present than ``launch.py --min-workers`` (``KVSTORE_MIN_WORKERS``):
    the first barrier after it shrank (a Session's next epoch, ``kv.membership()``, ``kv.barrier()``, a
    collective) fails with it on every worker, naming the present workers and the minimum."""


class ChildFailed(KVStoreError):
    """A process ``launch.py`` started exited when it should not have (or with a non-zero code).

    ``code`` is the launcher's exit code for it (never 0: a failed launch does not exit 0);
    ``child`` is the launcher's record of the process, where there is one.
    """

    def __init__(self, message: str, code: int, child: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.child = child


class StartFailed(KVStoreError):
    """A process could not be started (the command does not exist or cannot be executed)."""


class SyncFailed(KVStoreError):
    """rsync of the working directory to a host failed; ``code`` is rsync's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class PlacementError(KVStoreError):
    """The Ray cluster could not place the job's roles within the placement timeout."""


class RoleFailed(KVStoreError):
    """A role on Ray exited non-zero, its function raised, or its Ray actor died.

    ``role`` is ``'scheduler'``, ``'server'`` or ``'worker'``; ``rank`` is None
    for the scheduler; ``exit_code`` is the role's exit code (128 + signal when a
    signal ended it, 1 for a function that raised), or None when its actor died.
    """

    def __init__(self, message: str, role: str, rank: int | None, exit_code: int | None) -> None:
        super().__init__(message)
        self.role, self.rank, self.exit_code = role, rank, exit_code


class SparkJobFailed(KVStoreError):
    """The barrier job of ``kvstore.spark.run`` failed: a worker's ``train_fn`` raised, a scheduler or
    server exited with a non-zero code, or Spark aborted the job.

    ``detail`` is the failed task's own message where it could be found in Spark's error (else the
    first line of that error); the Spark exception is the ``__cause__``.
    """

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail


class NotEnoughSlotsError(ConfigError):
    """The Spark application cannot run all ``1 + S + W`` barrier tasks at once."""


class TaskFailed(KVStoreError, RuntimeError):
    """Raised inside a Spark task (on an executor); its message, marked with :attr:`MARK`, reaches
    the driver in Spark's error text, where ``task_failure_detail`` finds it again."""

    MARK = "kvstore-spark-task-failed"

    def __init__(self, message: str) -> None:
        super().__init__(f"[{self.MARK}] {message}")


class NotAMemberError(KVStoreError, PermissionError):
    """A worker outside a key's worker set (``kv.init(..., workers=...)``, docs/worker-sets.md) called
    init, push or pull of that key; the message names the key, the set and the worker.  Nothing was
    changed: a server refuses such a request too, leaving the key as it was."""


class FeedError(KVStoreError):
    """The streaming feed of ``kvstore.spark.run(data=df, epochs=E)`` failed: its Spark job failed, a
    batch did not come within ``feed_timeout``, or a connection to the driver's feed closed; the
    message names what it waited for."""


_CODES: dict[str, type[KVStoreError]] = {
    cls.__name__: cls
    for cls in (ConfigError, UnknownModeError, KeyNotInitializedError, DuplicateInitError,
                ShapeMismatchError, DTypeMismatchError, KeyTypeError, DeadlineExceededError, StallError,
                NodeLostError, ProtocolError, AuthenticationError, IntegrityError, RemoteError,
                StoreClosedError, OptimizerError, FormatError, UnsupportedError, CollectiveMismatchError,
                TooFewWorkersError, NotAMemberError, SchedulerRebuildingError)
}


def error_code(exc: BaseException) -> str:
    """Return the wire code of ``exc``: its class name when it is ours, else ``RemoteError``."""
    name = type(exc).__name__
    return name if name in _CODES else "RemoteError"


def error_from_code(code: str, message: str, node: Any = None) -> KVStoreError:
    """Build the exception a wire ``(code, message)`` pair stands for (``RemoteError`` if unknown).

    ``node``, a ``[role, rank, host]`` list sent with a NodeLostError, fills in its attributes.
    """
    cls = _CODES.get(code, RemoteError)
    if cls is NodeLostError and isinstance(node, list) and len(node) == 3:
        role, rank, host = node
        return NodeLostError(message, role=role if isinstance(role, str) else None,
                             rank=rank if isinstance(rank, int) else None,
                             host=host if isinstance(host, str) else None)
    return cls(message)


def error_node(exc: BaseException) -> list | None:
    """``[role, rank, host]`` of a NodeLostError that names its node, for the wire; else None."""
    if isinstance(exc, NodeLostError) and exc.role is not None:
        return [exc.role, exc.rank, exc.host]
    return None


_FROM_CLUSTER: weakref.WeakSet[BaseException] = weakref.WeakSet()  # what from_cluster made


def from_cluster(exc: KVStoreError) -> KVStoreError:
    """A fresh copy of a cluster's ``exc`` (same type, message and attributes; no traceback, cause
    or context), marked so that the public store call raising it drops kvstore's internal frames
    (:func:`is_from_cluster`).
    """
    try:
        fresh = copy.copy(exc)
    except Exception:  # an error class whose constructor does not take its own args
        fresh = exc.with_traceback(None)
    _FROM_CLUSTER.add(fresh)
    return fresh


def is_from_cluster(exc: BaseException) -> bool:
    """Whether ``exc`` was made by :func:`from_cluster` (a public store call re-raises it bare)."""
    return exc in _FROM_CLUSTER


F = TypeVar("F", bound=Callable[..., Any])


def public(method: F) -> F:
    """Mark a public store call, the boundary where errors reach the user: an error from the cluster
    (:func:`is_from_cluster`) raised inside it is re-raised without kvstore's frames or chain; others
    unchanged."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except KVStoreError as exc:
            if not is_from_cluster(exc):
                raise
            raise exc.with_traceback(None) from None
    return call  # type: ignore[return-value]

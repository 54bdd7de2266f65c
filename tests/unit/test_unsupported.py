"""MXNet KVStore methods kvstore will never have raise UnsupportedError saying what to use instead;
cluster errors are raised from the user's call without kvstore's internal frames."""

from __future__ import annotations

import traceback

import numpy as np
import pytest

import kvstore
from kvstore.base import KVStore
from kvstore.errors import (
    KVStoreError,
    NodeLostError,
    ShapeMismatchError,
    UnsupportedError,
    from_cluster,
    public,
)


def test_send_command_to_servers_is_unsupported() -> None:
    """_send_command_to_servers raises UnsupportedError naming set_optimizer instead."""
    kv = kvstore.create("local")
    with pytest.raises(UnsupportedError, match=r"_send_command_to_servers is not supported.*"
                                               r"use set_optimizer and set_optimizer_params"):
        kv._send_command_to_servers(0, "body")


def test_register_is_unsupported() -> None:
    """KVStore.register (MXNet 2's store registry) raises UnsupportedError naming the alternative."""
    with pytest.raises(UnsupportedError, match=r"KVStore.register is not supported.*KNOWN_TYPES.*"
                                               r"construct your KVStore subclass directly"):
        KVStore.register(KVStore)
    with pytest.raises(UnsupportedError):
        kvstore.create("local").register(KVStore)


def test_set_updater_is_unsupported_where_a_store_has_none() -> None:
    """A store without its own _set_updater (the dist store) raises UnsupportedError naming
    set_optimizer; local stores keep theirs."""
    class Bare(KVStore):  # the dist store's case: no override of _set_updater
        _init = _push = _pull = barrier = _set_optimizer = _set_optimizer_params = None  # type: ignore
        _save_states = _load_states = _save_checkpoint = get_optimizer = None  # type: ignore

    with pytest.raises(UnsupportedError, match=r"_set_updater is not available on a dist_sync store.*"
                                               r"use set_optimizer\(kvstore.optimizer.create"):
        Bare("dist_sync")._set_updater(lambda key, pushed, stored: None)
    kv = kvstore.create("local")
    kv._set_updater(lambda key, pushed, stored: np.add(stored, pushed, out=stored))
    kv.init(1, np.ones(2, np.float32))
    kv.push(1, np.ones(2, np.float32))
    assert kv.pull(1).tolist() == [2.0, 2.0]


def test_unsupported_error_is_a_not_implemented_error() -> None:
    """UnsupportedError is a KVStoreError and a NotImplementedError, exported from kvstore."""
    assert issubclass(UnsupportedError, KVStoreError)
    assert issubclass(UnsupportedError, NotImplementedError)
    assert kvstore.UnsupportedError is UnsupportedError


def test_row_sparse_pull_is_there_now() -> None:
    """row_sparse_pull exists since issue 23 (docs/sparse.md) and refuses a dense key clearly."""
    kv = kvstore.create("local")
    kv.init(1, np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="dense"):
        kv.row_sparse_pull(1, row_ids=[0])


def test_from_cluster_copies_type_message_and_node() -> None:
    """from_cluster gives a fresh error of the same type, message and attributes, without traceback."""
    try:
        raise NodeLostError("worker 1 on h is lost: died of ValueError: boom", "worker", 1, "h")
    except NodeLostError as exc:
        original = exc
    fresh = from_cluster(original)
    assert fresh is not original and type(fresh) is NodeLostError
    assert str(fresh) == str(original)
    assert (fresh.role, fresh.rank, fresh.host) == ("worker", 1, "h")
    assert fresh.__traceback__ is None and fresh.__cause__ is None and fresh.__context__ is None


def _deep_internal_raise(error: BaseException) -> None:
    try:
        raise RuntimeError("an internal failure")
    except RuntimeError:
        raise error  # noqa: B904 -- the chained case public() must cut


@public
def _public_call(error: BaseException) -> None:
    _deep_internal_raise(error)


def test_public_drops_internal_frames_of_cluster_errors_only() -> None:
    """A public call re-raises a cluster error with only its own frame and no chain; any other
    error keeps its traceback."""
    with pytest.raises(NodeLostError) as info:
        _public_call(from_cluster(NodeLostError("worker 1 is lost")))
    text = "".join(traceback.format_exception(info.value))
    assert "_deep_internal_raise" not in text and "During handling" not in text
    assert info.value.__suppress_context__
    with pytest.raises(ShapeMismatchError) as info:
        _public_call(ShapeMismatchError("bad shape"))
    assert "_deep_internal_raise" in "".join(traceback.format_exception(info.value))

"""Dynamic row-sparse tables in the 'local' store (docs/sparse.md, "Dynamic tables"): the API's
arguments, uint64 ids, what is refused, and the counters."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore import RowSparse
from kvstore.errors import ShapeMismatchError

W = 3


def _store(**spec):
    kv = kvstore.create("local")
    kv.init("d", width=W, dtype="float32", init={"type": "uniform", "seed": 2}, dynamic=spec or True)
    return kv


def test_uint64_ids_are_their_int64_bits_and_rows_come_back_sorted() -> None:
    """A uint64 id past 2**63 is the int64 of its bits: pushed as one, pulled as the other."""
    kv = _store()
    big = np.array([2**64 - 1, 5], np.uint64)
    kv.push("d", RowSparse(big, np.ones((2, W), np.float32), (0, W)))
    got = kv.row_sparse_pull("d", row_ids=np.array([-1, 5], np.int64))
    assert list(got.indices) == [-1, 5] and got.shape[1:] == (W,)
    np.testing.assert_array_equal(got.rows, 1.0)
    assert kv.stats()["dynamic_tables"]["d"]["rows"] == 2


def test_a_row_sparse_pull_stores_rows_only_when_admitted() -> None:
    """Pulls of ids never pushed store nothing; admit=True stores them; hits are counted."""
    kv = _store(capacity=10)
    first = kv.row_sparse_pull("d", row_ids=[4, 8])
    again = kv.row_sparse_pull("d", row_ids=[4, 8], admit=True)
    np.testing.assert_array_equal(first.rows, again.rows)
    kv.row_sparse_pull("d", row_ids=[4])
    stats = kv.stats()["dynamic_tables"]["d"]
    assert stats["rows"] == 2 and stats["pull_hits"] == 1 and stats["pull_rows"] == 5
    assert stats["admissions"] == 2


def test_what_a_dynamic_table_refuses() -> None:
    """A dense push, a dense out, a whole pull, admit on a fixed table, a value or shape at init and a
    save are refused, naming why; the table is unchanged."""
    kv = _store()
    with pytest.raises(ShapeMismatchError, match="dynamic"):
        kv.push("d", np.ones((4, W), np.float32))
    with pytest.raises(ValueError, match="takes no out"):
        kv.row_sparse_pull("d", out=np.zeros((4, W), np.float32), row_ids=[1])
    with pytest.raises(ValueError, match="row_sparse_pull"):
        kv.pull("d")
    kv.init("f", shape=(4, W))
    with pytest.raises(ValueError, match="admit"):
        kv.row_sparse_pull("f", row_ids=[1], admit=True)
    with pytest.raises(ValueError, match="width"):
        kv.init("g", shape=(4, W), dynamic=True)
    with pytest.raises(ValueError, match="dynamic"):
        kv.init("h", width=W, dynamic={"policy": "fifo"})
    with pytest.raises(ValueError, match="dynamic=True"):
        kv.init("i", width=W)
    kv.set_optimizer(kvstore.optimizer.create("sgd"))
    assert kv.stats()["dynamic_tables"]["d"]["rows"] == 0


def test_rows_of_several_dims_and_a_sparse_tensor_push() -> None:
    """A table of (2, 2) rows takes an nn.Embedding-style sparse COO gradient of any first dim."""
    torch = pytest.importorskip("torch")
    kv = kvstore.create("local")
    kv.init("d", width=(2, 2), dtype="float32", dynamic=True)
    grad = torch.sparse_coo_tensor(torch.tensor([[7, 2**40, 7]]), torch.ones(3, 2, 2), (2**41, 2, 2),
                                   check_invariants=True)
    kv.push("d", grad)
    got = kv.row_sparse_pull("d", row_ids=[7, 2**40])
    assert got.rows.shape == (2, 2, 2)
    np.testing.assert_array_equal(got.rows[0], 2.0)


def _trained(opt, dtype: str = "float32", **spec):
    kv = kvstore.create("local")
    kv.init("d", width=W, dtype=dtype, init="zeros", dynamic=spec)
    kv.set_optimizer(opt)
    return kv


def _push_all(kv, ids, value, dtype=np.float32) -> None:
    ids = np.array(ids, np.int64)
    kv.push("d", RowSparse(ids, np.full((ids.size, W), value, dtype), (0, W)))


def test_a_row_made_by_an_admitting_pull_starts_with_fresh_momentum() -> None:
    """A pull with admit=True that evicts a row and reuses its slot gives the new row fresh momentum:
    a zero gradient then leaves it where it was made."""
    kv = _trained(kvstore.optimizer.create("sgd", learning_rate=1.0, momentum=0.9), capacity=1)
    for _ in range(3):
        _push_all(kv, [1], 1.0)  # id 1 builds momentum in slot 0
    kv.row_sparse_pull("d", row_ids=[2], admit=True)  # evicts 1, makes 2 in slot 0
    _push_all(kv, [2], 0.0)
    np.testing.assert_array_equal(kv.row_sparse_pull("d", row_ids=[2]).rows, 0.0)


def test_a_float16_row_made_by_an_admitting_pull_does_not_take_the_evicted_rows_master_copy() -> None:
    """multi_precision: a slot reused by an admitting pull gets a float32 master copy of its new row,
    not the evicted row's (the next push would write that row's value into the new id)."""
    opt = kvstore.optimizer.create("sgd", learning_rate=1.0, multi_precision=True)
    kv = _trained(opt, dtype="float16", capacity=1)
    _push_all(kv, [1], -5.0, np.float16)  # id 1: 0 - 1.0 * -5 = 5
    kv.row_sparse_pull("d", row_ids=[2], admit=True)  # slot 0 -> id 2 (initial 0)
    _push_all(kv, [2], 0.0, np.float16)
    np.testing.assert_array_equal(kv.row_sparse_pull("d", row_ids=[2]).rows, 0.0)


def test_a_local_int_key_and_its_str_keep_their_own_counters() -> None:
    """stats() labels dynamic tables 3 and '3' apart: 'int:3' and '3'."""
    kv = kvstore.create("local")
    kv.init(3, width=W, dynamic={"capacity": 2})
    kv.init("3", width=W, dynamic={"capacity": 5})
    tables = kv.stats()["dynamic_tables"]
    assert tables["int:3"]["capacity"] == 2 and tables["3"]["capacity"] == 5


def test_a_refused_admitting_pull_of_several_keys_stores_nothing() -> None:
    """row_sparse_pull([dynamic, fixed], admit=True) is refused (admit on a fixed table) before the
    dynamic table stores any id."""
    kv = kvstore.create("local")
    kv.init("d", width=W, dtype="float32", init="zeros", dynamic={"capacity": 4})
    kv.init("f", shape=(4, W), stype="row_sparse")
    with pytest.raises(ValueError, match="admit"):
        kv.row_sparse_pull(["d", "f"], out=[None, None], row_ids=[[7], [1]], admit=True)
    assert kv.stats()["dynamic_tables"]["d"]["rows"] == 0
    assert kv.stats()["dynamic_tables"]["d"]["pull_rows"] == 0


def test_a_numpy_int_width_is_a_width() -> None:
    """width= takes a numpy int as it takes a Python int (docs: 'an int')."""
    kv = kvstore.create("local")
    kv.init("d", width=np.int64(W), dynamic=True)
    assert kv.row_sparse_pull("d", row_ids=[1]).rows.shape == (1, W)


def test_optimizer_states_of_a_dynamic_table_save_and_load_by_row_id(tmp_path) -> None:
    """save_optimizer_states writes a dynamic table's adam state per held row with its ids; after more
    steps, load_optimizer_states brings back exactly those rows' state and count, so the next step
    equals the one taken right after the save; a fixed table's state in place of it is refused."""
    def store() -> kvstore.KVStore:
        kv = kvstore.create("local")
        kv.init("d", width=W, dtype="float32", init={"type": "normal", "seed": 3}, dynamic=True)
        kv.init("f", shape=(4, W))
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
        return kv

    ids = np.array([2**40, -9, 5], np.int64)
    grad = RowSparse(ids, np.arange(3 * W, dtype=np.float32).reshape(3, W), (0, W))
    kv, twin = store(), store()
    for k in (kv, twin):
        k.push("d", grad)
    kv.save_optimizer_states(str(tmp_path / "s"))
    kv.push("d", grad)  # moves the state on; the load takes it back
    kv.load_optimizer_states(str(tmp_path / "s"))
    for k in (kv, twin):
        k.push("d", grad)
    # the rows were stepped once more in kv (before the load), so compare the state, then the update
    a, b = kv._optimizer.get_state("d")[1], twin._optimizer.get_state("d")[1]
    ka, kb = kv._dynamic["d"], twin._dynamic["d"]
    for name in ("mean", "var"):
        np.testing.assert_allclose(a[name][ka.map.get(ids)], b[name][kb.map.get(ids)], rtol=1e-6)
    assert kv._optimizer.counts["d"] == twin._optimizer.counts["d"] == 2
    other = kvstore.create("local")
    other.init("d", shape=(3, W))  # a fixed table named like the dynamic one, of as many rows
    other.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
    with pytest.raises(ShapeMismatchError, match="dynamic"):
        other.load_optimizer_states(str(tmp_path / "s"))


def test_save_checkpoint_writes_a_dynamic_tables_rows_by_id_and_their_state(tmp_path) -> None:
    """save_checkpoint of a local store writes a dynamic table as a RowSparse of the rows it holds
    (sorted ids, their current rows) and their sgd momentum by id; a fixed table stays whole."""
    kv = kvstore.create("local")
    kv.init("d", width=W, dtype="float32", init={"type": "normal", "seed": 3}, dynamic=True)
    kv.init("f", shape=(4, W))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))
    ids = np.array([2**40, -9, 5], np.int64)
    kv.push("d", RowSparse(ids, np.ones((3, W), np.float32), (0, W)))
    kv.save_checkpoint(str(tmp_path / "snap"))
    values, states = kvstore.snapshot.read(str(tmp_path / "snap"))
    table = values["d"]
    assert isinstance(table, RowSparse) and list(table.indices) == [-9, 5, 2**40]
    np.testing.assert_array_equal(table.rows, kv.row_sparse_pull("d", row_ids=ids).rows)
    assert values["f"].shape == (4, W)
    (entry,) = [e for e in states.entries if e.key == "d"]
    assert list(entry.ids) == [-9, 5, 2**40]
    np.testing.assert_allclose(entry.arrays["mom"], np.full((3, W), -0.1, np.float32), rtol=1e-6)


def test_state_loaded_into_rows_a_store_does_not_hold_survives_their_next_push(tmp_path) -> None:
    """load_optimizer_states into a fresh store makes the saved rows (initial values) with their loaded
    adam state; their next push steps from that state (mean and var as after two pushes), not from a
    state reset as for a row made by a pull."""
    ids = np.array([2**40, -9, 5], np.int64)
    grad = RowSparse(ids, np.arange(3 * W, dtype=np.float32).reshape(3, W), (0, W))

    def store() -> kvstore.KVStore:
        kv = kvstore.create("local")
        kv.init("d", width=W, dtype="float32", dynamic=True)
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
        return kv

    saved, fresh = store(), store()
    saved.push("d", grad)
    saved.save_optimizer_states(str(tmp_path / "s"))
    saved.push("d", grad)
    fresh.load_optimizer_states(str(tmp_path / "s"))
    fresh.push("d", grad)
    a, b = saved._optimizer.get_state("d")[1], fresh._optimizer.get_state("d")[1]
    ka, kb = saved._dynamic["d"], fresh._dynamic["d"]
    for name in ("mean", "var"):
        np.testing.assert_allclose(b[name][kb.map.get(ids)], a[name][ka.map.get(ids)], rtol=1e-6)

"""Row-sparse keys in dist_sync and dist_async clusters (docs/sparse.md): tables made on the servers,
pushes of rows only, row_sparse_pull, lazy and standard optimizer updates against dense references."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvstore
from kvstore import RowSparse
from kvstore.core import rowsparse as R
from kvstore.errors import ConfigError, DTypeMismatchError, ShapeMismatchError
from tests.integration.conftest import _shared_cluster, unique_key

pytestmark = pytest.mark.timeout(90)
SHAPE = (50, 4)


@pytest.fixture(scope="module")
def sync2(tmp_path_factory):
    """A dist_sync cluster of 2 workers and 2 servers shared by this module's tests."""
    cluster = _shared_cluster(tmp_path_factory, "dist_sync", 2, 2)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def sums2(tmp_path_factory):
    """A dist_sync cluster of 2 workers and 2 servers on which no test sets an optimizer."""
    cluster = _shared_cluster(tmp_path_factory, "dist_sync", 2, 2)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def async2(tmp_path_factory):
    """A dist_async cluster of 2 workers and 3 servers shared by this module's tests."""
    cluster = _shared_cluster(tmp_path_factory, "dist_async", 2, 3)
    yield cluster
    cluster.close()


def _grad(rank: int, step: int, ids: list[int]) -> RowSparse:
    rows = np.stack([np.full(SHAPE[1], (rank + 1) * 0.5 + step + i * 0.1, np.float32)
                     for i in range(len(ids))]) if ids else np.zeros((0, SHAPE[1]), np.float32)
    return RowSparse(np.array(ids, np.int64), rows, SHAPE)


def test_sync_table_generated_on_servers_matches_one_process_and_push_sums_workers(sync2) -> None:
    """A table made from shape/init is the one a single process generates; a round's rows are the
    sum of every worker's (unsorted, repeated ids summed; a worker with no rows still pushes)."""
    key = unique_key("rs")

    def work(kv):
        kv.init(key, shape=SHAPE, dtype="float32", init={"type": "normal", "sigma": 1.0, "seed": 7})
        before = kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0]))
        ids = [9, 3, 9, 49] if kv.rank == 0 else []
        kv.push(key, _grad(kv.rank, 0, ids))
        after = kv.row_sparse_pull(key, row_ids=np.array([49, 3, 3, 9, 0]))
        dense = np.empty(SHAPE, np.float32)
        kv.row_sparse_pull(key, out=dense, row_ids=[3, 9])
        return before, after, dense

    reference = R.generate(R.parse_init(key, {"type": "normal", "sigma": 1.0, "seed": 7}), 0, SHAPE[0],
                           SHAPE[1], np.dtype(np.float32))
    for before, after, dense in sync2.run(work):
        np.testing.assert_array_equal(before.rows, reference)
        assert list(after.indices) == [0, 3, 9, 49]
        np.testing.assert_allclose(after.rows[0], reference[0])
        np.testing.assert_allclose(after.rows[1], np.full(4, 0.6, np.float32))  # id 3: step 0, i=1
        np.testing.assert_allclose(after.rows[2], np.full(4, 0.5 + 0.7, np.float32))  # id 9 twice
        np.testing.assert_allclose(after.rows[3], np.full(4, 0.8, np.float32))
        assert np.count_nonzero(dense.any(axis=1)) == 2 and np.allclose(dense[9], 1.2)


def test_sync_both_workers_rows_are_summed_each_round(sync2) -> None:
    """dist_sync: rows pushed by both workers in a round are summed, and each round is applied once."""
    key = unique_key("rs")

    def work(kv):
        kv.init(key, np.zeros(SHAPE, np.float32), stype="row_sparse")
        for step in range(3):
            kv.push(key, _grad(kv.rank, step, [5, 20 + kv.rank]))
        return kv.row_sparse_pull(key, row_ids=[5, 20, 21])

    for got in sync2.run(work):
        np.testing.assert_allclose(got.rows[0], np.full(4, 0.5 + 2 + 1.0 + 2))  # both workers, step 2
        np.testing.assert_allclose(got.rows[1], np.full(4, 0.5 + 2 + 0.1))
        np.testing.assert_allclose(got.rows[2], np.full(4, 1.0 + 2 + 0.1))


def test_bad_sparse_pushes_raise_and_leave_the_table(sync2) -> None:
    """A sparse push to a dense key, a row id out of range and a wrong row width raise before
    anything is sent; the table is unchanged and later rounds still close."""
    key, dense_key = unique_key("rs"), unique_key("dense")

    def work(kv):
        kv.init(key, shape=SHAPE, init="uniform")
        kv.init(dense_key, np.zeros(3, np.float32))
        start = kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])).rows
        with pytest.raises(TypeError, match="dense"):
            kv.push(dense_key, _grad(0, 0, [1]))
        with pytest.raises(ShapeMismatchError, match="out of range"):
            kv.push(key, _grad(0, 0, [50]))
        with pytest.raises(ShapeMismatchError, match="wide"):
            kv.push(key, RowSparse([1], np.ones((1, 5), np.float32), (50, 5)))
        with pytest.raises(ShapeMismatchError, match="out of range"):
            kv.row_sparse_pull(key, row_ids=[-1])
        with pytest.raises(TypeError, match="row_sparse"):
            kv.pushpull(key, np.zeros(SHAPE, np.float32))
        unchanged = kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])).rows
        kv.push(key, _grad(kv.rank, 0, [2]))
        return start, unchanged, kv.row_sparse_pull(key, row_ids=[2]).rows

    for start, unchanged, row in sync2.run(work):
        np.testing.assert_array_equal(start, unchanged)
        np.testing.assert_allclose(row, np.full((1, 4), 0.5 + 1.0))


def test_whole_pull_below_the_limit_and_refused_above(sync2, monkeypatch) -> None:
    """pull of a whole row-sparse key gives the dense table below kvstore.sparse.WHOLE_PULL_BYTES and a
    clear error above it."""
    key = unique_key("rs")
    value = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)

    def work(kv):
        kv.init(key, value, stype="row_sparse")
        whole = kv.pull(key)
        kv.barrier()
        return whole

    for whole in sync2.run(work):
        np.testing.assert_array_equal(whole, value)
    monkeypatch.setattr(kvstore.sparse, "WHOLE_PULL_BYTES", 100)
    with pytest.raises(ValueError, match="row_sparse_pull"):
        sync2.workers[0].pull(key)


def _steps(rank: int) -> list[list[int]]:
    return [[1, 7, 7, 30], [7, 40], [2, 30, 49]] if rank == 0 else [[7, 11], [], [30, 3]]


def _dense_reference(opt_args: dict, grads: list[np.ndarray], start: np.ndarray) -> np.ndarray:
    kv = kvstore.create("local")
    kv.init(0, start.copy())
    kv.set_optimizer(kvstore.optimizer.create(**opt_args))
    for g in grads:
        kv.push(0, g)
    return kv.pull(0)


@pytest.mark.parametrize("opt_args", [
    {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "lazy_update": False},
    {"name": "adam", "learning_rate": 0.05, "wd": 0.01, "lazy_update": False}], ids=["sgd", "adam"])
def test_standard_update_matches_dense_optimizer(sync2, opt_args) -> None:
    """lazy_update=False: every row is updated as if the summed gradient were dense (sgd with momentum
    and adam against a dense key's optimizer)."""
    key = unique_key("rs")
    init = {"type": "uniform", "seed": 3}
    start = R.generate(R.parse_init(key, init), 0, SHAPE[0], SHAPE[1], np.dtype(np.float32))

    def work(kv):
        kv.init(key, shape=SHAPE, init=init)
        kv.set_optimizer(kvstore.optimizer.create(**opt_args))
        for step, ids in enumerate(_steps(kv.rank)):
            kv.push(key, _grad(kv.rank, step, ids))
        return kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])).rows

    grads = [_grad(0, s, a).todense() + _grad(1, s, b).todense() for s, (a, b) in
             enumerate(zip(_steps(0), _steps(1)))]
    want = _dense_reference(opt_args, grads, start)
    for got in sync2.run(work):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_args", [
    {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "wd": 0.1},
    {"name": "adam", "learning_rate": 0.05, "wd": 0.1}], ids=["sgd", "adam"])
def test_lazy_update_touches_only_the_rows_present(async2, opt_args) -> None:
    """lazy_update (the default): the rows pushed are updated as a dense key of only those rows would
    be (weight decay and moments included); the other rows keep their values (dist_async, one pusher)."""
    key = unique_key("rs")
    rows = [4, 17, 33]
    start = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)

    def work(kv):
        kv.init(key, start, stype="row_sparse")
        kv.set_optimizer(kvstore.optimizer.create(**opt_args))
        if kv.rank == 0:
            for step in range(3):
                kv.push(key, _grad(0, step, rows))
        kv.barrier()
        return kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])).rows

    want = _dense_reference(opt_args, [_grad(0, s, rows).rows for s in range(3)], start[rows])
    for got in async2.run(work):
        np.testing.assert_allclose(got[rows], want, rtol=1e-5, atol=1e-6)
        others = np.setdiff1d(np.arange(SHAPE[0]), rows)
        np.testing.assert_array_equal(got[others], start[others])


def test_async_pushes_apply_on_arrival_and_sum(async2) -> None:
    """dist_async: each worker's push is applied as it arrives; with plain sgd the result is the sum of
    both workers' steps whatever their order, and a table of 3 servers equals one process's."""
    key = unique_key("rs")

    def work(kv):
        kv.init(key, shape=SHAPE, init="zeros")
        kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
        kv.push(key, [_grad(kv.rank, 0, [0, 49]), _grad(kv.rank, 1, [0])])
        kv.barrier()
        return kv.row_sparse_pull(key, row_ids=[0, 49, 25])

    for got in async2.run(work):
        np.testing.assert_allclose(got.rows[0], -np.full(4, 0.5 + 1.5 + 1.0 + 2.0), rtol=1e-6)
        assert list(got.indices) == [0, 25, 49]  # sorted, distinct
        np.testing.assert_array_equal(got.rows[1], np.zeros(4))
        np.testing.assert_allclose(got.rows[2], -np.full(4, 0.6 + 1.1), rtol=1e-6)


def test_chunked_pushes_and_pulls_and_a_leaver_does_not_stall_rounds(make_cluster) -> None:
    """Rows travel in messages of at most KVSTORE_CHUNK_BYTES (a round's last chunk closes it), pulls
    too; once a worker has left, rounds close without it."""
    cluster = make_cluster("dist_sync", num_workers=2, num_servers=2, KVSTORE_CHUNK_BYTES=1024)
    shape = (400, 4)
    ids = np.arange(0, 400, 2)  # 200 rows: several messages to each server

    def work(kv):
        kv.init("big", shape=shape, init="uniform")
        start = kv.row_sparse_pull("big", row_ids=np.arange(400)).rows
        kv.push("big", RowSparse(ids, np.full((ids.size, 4), kv.rank + 1.0, np.float32), shape))
        return start, kv.row_sparse_pull("big", row_ids=np.arange(400)).rows

    for start, after in cluster.run(work):
        np.testing.assert_array_equal(after[ids], np.full((200, 4), 3.0))
        np.testing.assert_array_equal(after[1::2], start[1::2])
    cluster.workers[1].close()
    kv = cluster.workers[0]
    kv.push("big", RowSparse([7], np.ones((1, 4), np.float32), shape))
    assert kv.row_sparse_pull("big", row_ids=[7]).rows[0, 0] == 1.0


def test_optimizer_states_of_row_sparse_keys_save_and_load(sync2, tmp_path) -> None:
    """save_optimizer_states gathers a row-sparse key's adam state from its servers' row ranges into
    the file a local store writes; loading it after the state was dropped continues training exactly."""
    key = unique_key("rs")
    start = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
    fname = str(tmp_path / "states.kvs")

    def work(kv):
        kv.init(key, start, stype="row_sparse")
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
        for step in range(2):
            kv.push(key, _grad(kv.rank, step, _steps(kv.rank)[step]))
        kv.save_optimizer_states(fname)
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))  # drops every state
        kv.load_optimizer_states(fname)
        kv.push(key, _grad(kv.rank, 2, _steps(kv.rank)[2]))
        return kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])).rows

    results = sync2.run(work)
    local = kvstore.create("local")
    local.init(key, start, stype="row_sparse")
    local.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
    for step in range(3):
        local.push(key, [_grad(0, step, _steps(0)[step]), _grad(1, step, _steps(1)[step])])
        if step == 1:
            local.save_optimizer_states(str(tmp_path / "local.kvs"))
    saved = {e.key: e for e in kvstore.checkpoint.read_states(fname).entries}[key]
    want = {e.key: e for e in kvstore.checkpoint.read_states(str(tmp_path / "local.kvs")).entries}[key]
    assert saved.count == want.count == 2
    for name in ("mean", "var"):
        np.testing.assert_allclose(saved.arrays[name].reshape(SHAPE), want.arrays[name].reshape(SHAPE),
                                   rtol=1e-6)
    for got in results:
        np.testing.assert_allclose(got, local.pull(key), rtol=1e-5, atol=1e-6)


def test_states_save_when_a_server_range_never_got_a_row(sync2, tmp_path) -> None:
    """save_optimizer_states of a lazily updated key whose rows all fell on one server (the other's
    range got empty pushes only) writes the state a local store writes: zeros for those rows."""
    key = unique_key("rs")
    fname = str(tmp_path / "states.kvs")

    def work(kv):
        kv.init(key, shape=SHAPE, init="uniform")
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
        kv.push(key, _grad(kv.rank, 0, [1, 7]))  # rows of server 0's range only
        kv.save_optimizer_states(fname)

    sync2.run(work)
    local = kvstore.create("local")
    local.init(key, shape=SHAPE, init="uniform")
    local.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
    local.push(key, [_grad(0, 0, [1, 7]), _grad(1, 0, [1, 7])])
    local.save_optimizer_states(str(tmp_path / "local.kvs"))
    saved = {e.key: e for e in kvstore.checkpoint.read_states(fname).entries}[key]
    want = {e.key: e for e in kvstore.checkpoint.read_states(str(tmp_path / "local.kvs")).entries}[key]
    assert saved.count == want.count == 1
    for name in ("mean", "var"):
        assert not saved.arrays[name].reshape(SHAPE)[25:].any()
        np.testing.assert_allclose(saved.arrays[name], want.arrays[name], rtol=1e-6)


def test_a_states_file_of_another_dtype_is_refused_before_anything_changes(sync2, tmp_path) -> None:
    """load_optimizer_states of a file whose row-sparse state arrays have another dtype raises
    DTypeMismatchError on every worker before any server is touched: the state saved after it is
    the state saved before it."""
    key = unique_key("rs")
    good, bad, after = (str(tmp_path / f"{n}.kvs") for n in ("good", "bad", "after"))

    def work(kv):
        kv.init(key, shape=SHAPE, init="uniform")
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
        kv.push(key, _grad(kv.rank, 0, [1, 7]))
        kv.save_optimizer_states(good)
        kv.barrier()
        if kv.rank == 0:
            states = kvstore.checkpoint.read_states(good)
            for entry in states.entries:
                entry.arrays = {n: a.astype(np.float64) for n, a in entry.arrays.items()}
            kvstore.checkpoint.write_states(bad, states)
        kv.barrier()
        with pytest.raises(DTypeMismatchError, match="state"):
            kv.load_optimizer_states(bad)
        kv.save_optimizer_states(after)

    sync2.run(work)
    before = {e.key: e for e in kvstore.checkpoint.read_states(good).entries}[key]
    now = {e.key: e for e in kvstore.checkpoint.read_states(after).entries}[key]
    assert now.count == before.count == 1
    for name in ("mean", "var"):
        np.testing.assert_array_equal(now.arrays[name], before.arrays[name])


def test_snapshot_holds_row_sparse_tables_and_resumes_on_other_servers(make_cluster, tmp_path) -> None:
    """save_checkpoint writes a row-sparse table and its adam state; a resumed cluster with another
    server count (the table initialised before or after set_optimizer) continues the unbroken run."""
    import dataclasses

    from kvstore.client.store import DistKVStore

    def grad(step: int) -> RowSparse:
        return _grad(0, step, [3, 40, 41])

    first = make_cluster("dist_sync", 1, 1)
    (kv,) = first.workers
    kv.init(["t", "u"], shape=SHAPE, init="uniform")
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
    kv.push(["t", "u"], [grad(0), grad(0)])
    kv.save_checkpoint(tmp_path / "snap")
    kv.push(["t", "u"], [grad(1), grad(1)])
    want = {key: kv.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])).rows for key in ("t", "u")}
    assert not np.array_equal(want["t"], want["u"])  # each key's default seed is its own

    second = make_cluster("dist_sync", 1, 2, connect=False)
    cfg = dataclasses.replace(second.cfg, resume=str(tmp_path / "snap"))
    resumed = DistKVStore("dist_sync", cfg)
    second.workers = [resumed]
    resumed.init("t", shape=SHAPE, init="zeros")  # the snapshot's table wins
    resumed.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
    resumed.init("u", shape=SHAPE, init="zeros")  # after set_optimizer: its state comes back too
    resumed.push(["t", "u"], [grad(1), grad(1)])
    for key in ("t", "u"):
        got = resumed.row_sparse_pull(key, row_ids=np.arange(SHAPE[0])).rows
        np.testing.assert_allclose(got, want[key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("sizes", [(6, 6, 6), (6, 3, 5)], ids=["one-batch-size", "changing-batch-size"])
def test_sparse_trainer_in_dist_sync_matches_torch_on_the_joint_batch(sync2, sizes: tuple[int, ...]) -> None:
    """Two workers train nn.Embedding(sparse=True) + a head with SparseTrainer; the table and head equal
    torch's SGD on both workers' batches together (the servers summed every worker's rows), also when
    the batch size changes between steps (the servers keep one rescale_grad: the rows are scaled too)."""
    torch = pytest.importorskip("torch")
    rows, dim, prefix = 300, 4, unique_key("st")
    gen = torch.Generator().manual_seed(4)
    data = [[(torch.randint(0, rows, (batch, 2), generator=gen), torch.randn(batch, 1, generator=gen))
             for batch in sizes] for _ in range(2)]
    torch.manual_seed(0)
    start_emb, start_head = torch.nn.Embedding(rows, dim, sparse=True), torch.nn.Linear(dim, 1)

    def work(kv):
        emb, head = torch.nn.Embedding(rows, dim, sparse=True), torch.nn.Linear(dim, 1)
        emb.load_state_dict(start_emb.state_dict())
        head.load_state_dict(start_head.state_dict())
        model = torch.nn.ModuleDict({"emb": emb, "head": head})
        trainer = kvstore.SparseTrainer(model.named_parameters(), "sgd", {"learning_rate": 0.3},
                                        embeddings=[emb], kvstore=kv, key_prefix=prefix)
        for ids, y in data[kv.rank]:
            trainer.prefetch(emb, ids)
            ((head(emb(ids).sum(1)) - y) ** 2).sum().backward()
            trainer.step(2 * len(ids))
            head.zero_grad()
        trainer.prefetch(emb, torch.arange(rows))
        return emb.weight.detach().clone(), head.weight.detach().clone()

    results = sync2.run(work)
    emb, head = start_emb, start_head
    opt = torch.optim.SGD([emb.weight, *head.parameters()], lr=0.3)
    for (ids0, y0), (ids1, y1) in zip(*data):
        opt.zero_grad()
        ids, y = torch.cat([ids0, ids1]), torch.cat([y0, y1])
        (((head(emb(ids).sum(1)) - y) ** 2).sum() / len(ids)).backward()
        opt.step()
    for table, weight in results:
        torch.testing.assert_close(table, emb.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weight, head.weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_table_bigger_than_a_server_is_refused_and_the_cluster_goes_on(sync2) -> None:
    """init of a table whose range exceeds a server's memory fails on every worker (ConfigError from the
    server, nothing allocated); the cluster keeps serving."""
    key, other = unique_key("huge"), unique_key("rs")

    def work(kv):
        with pytest.raises(ConfigError, match="memory"):
            kv.init(key, shape=(2**40, 1024), init="normal")
        kv.init(other, shape=SHAPE)
        return kv.row_sparse_pull(other, row_ids=[1]).rows

    for rows in sync2.run(work):
        assert rows.shape == (1, 4) and not rows.any()


@pytest.mark.parametrize("name,params", [("sgd", {"learning_rate": 0.2, "momentum": 0.9}),
                                         ("adam", {"learning_rate": 0.05})])
def test_sparse_trainer_updating_locally_matches_one_process_and_is_lazy(sums2, name, params) -> None:
    """SparseTrainer(update_on_kvstore=False) on 2 workers, each touching its own rows each step: both
    workers' tables and heads are equal, equal one process's store-run training on the joint batches
    (1e-6), and rows no worker touched since a step keep that step's weights and optimizer state."""
    torch = pytest.importorskip("torch")
    rows, dim, batch, prefix = 100, 4, 5, unique_key("local")
    gen = torch.Generator().manual_seed(9)
    # step s, rank r: ids in [20 s + 10 r, 20 s + 10 r + 10): rows 0-19 only at step 0, 60-99 never
    data = [[(torch.randint(20 * s + 10 * r, 20 * s + 10 * r + 10, (batch, 2), generator=gen),
              torch.randn(batch, 1, generator=gen)) for s in range(3)] for r in range(2)]

    made = threading.Lock()

    def model() -> tuple:
        with made:  # the workers are threads of this process: torch's global generator is shared
            torch.manual_seed(0)
            emb, head = torch.nn.Embedding(rows, dim, sparse=True), torch.nn.Linear(dim, 1)
        return emb, head, torch.nn.ModuleDict({"emb": emb, "head": head})

    def work(kv):
        emb, head, net = model()
        trainer = kvstore.SparseTrainer(net.named_parameters(), name, params, embeddings=[emb], kvstore=kv,
                                        key_prefix=prefix, update_on_kvstore=False)
        for step, (ids, y) in enumerate(data[kv.rank]):
            trainer.prefetch(emb, ids)
            ((head(emb(ids).sum(1)) - y) ** 2).sum().backward()
            trainer.step(2 * len(ids))
            head.zero_grad()
            if step == 0:
                first = emb.weight.detach().clone(), {
                    n: a.copy() for n, a in trainer.optimizer.states[f"{prefix}/embedding0"].items()}
        state = trainer.optimizer.states[f"{prefix}/embedding0"]
        return emb.weight.detach().clone(), head.weight.detach().clone(), first, state

    results = sums2.run(work)
    emb, head, net = model()
    start = emb.weight.detach().clone()
    one = kvstore.SparseTrainer(net.named_parameters(), name, params, embeddings=[emb], kvstore="local")
    for (ids0, y0), (ids1, y1) in zip(*data):
        ids, y = torch.cat([ids0, ids1]), torch.cat([y0, y1])
        one.prefetch(emb, ids)
        ((head(emb(ids).sum(1)) - y) ** 2).sum().backward()
        one.step(2 * batch)
        head.zero_grad()
    one.prefetch(emb, torch.arange(rows))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for table, weight, (after_first, state_first), state in results:
        torch.testing.assert_close(table, emb.weight.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(weight, head.weight.detach(), rtol=0, atol=1e-6)
        assert torch.equal(table[60:], start[60:]) and torch.equal(table[:20], after_first[:20])
        for n, a in state.items():
            assert not a[60:].any() and np.array_equal(a[:20], state_first[n][:20]) and a[20:60].any()


def test_sparse_trainer_updating_locally_moves_the_touched_rows_not_the_table(sums2) -> None:
    """With a 100k-row table and update_on_kvstore=False, a step's bytes sent and received by a worker
    grow with the rows touched (16 vs 256 rows) and stay far below the table's 3.2 MB."""
    torch = pytest.importorskip("torch")
    rows, dim, prefix = 100_000, 8, unique_key("traffic")

    def work(kv):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(rows, dim, sparse=True)
        trainer = kvstore.SparseTrainer(None, "adam", {"learning_rate": 0.01}, embeddings=[emb], kvstore=kv,
                                        key_prefix=prefix, update_on_kvstore=False)
        trainer.prefetch(emb, torch.zeros(1, dtype=torch.long))  # the first use: the table copied once
        moved = []
        for touched in (16, 256):
            ids = torch.arange(touched) * 300 + kv.rank  # distinct rows on each worker, all over the table
            before = kv.stats()
            emb(ids).sum().backward()
            trainer.step(touched)
            after = kv.stats()
            moved.append((after["bytes_out"] - before["bytes_out"], after["bytes_in"] - before["bytes_in"]))
        return moved

    table_bytes = rows * dim * 4
    for (out_small, in_small), (out_big, in_big) in sums2.run(work):
        row = dim * 4  # a row's values; its id travels with it
        assert out_small < 16 * row * 4 and in_small < 2 * 16 * row * 4  # sent: own rows; received: union
        assert out_big < 256 * row * 4 and in_big < 2 * 256 * row * 4
        assert out_big > 8 * out_small / 2 and in_big < table_bytes / 50


@pytest.mark.parametrize("bad", [SHAPE[0], -1])
def test_a_bad_row_id_on_one_worker_fails_the_reduction_on_every_worker_at_once(sums2, bad) -> None:
    """RowReducer: worker 1's row id outside the table raises on it and, within seconds (not the
    request deadline), on worker 0 naming worker 1 and the id; the next step sums right on both."""
    import time

    from kvstore.sparse_reduce import RowReducer

    prefix = unique_key("poison")

    def work(kv):
        reducer = RowReducer(kv, prefix, [("t", SHAPE, np.float32)])
        reducer.init()
        start = time.monotonic()
        ids = np.array([3, bad] if kv.rank == 1 else [3])
        with pytest.raises(ValueError) as caught:
            reducer.reduce([RowSparse(ids, np.ones((len(ids), SHAPE[1]), np.float32), SHAPE)])
        took = time.monotonic() - start
        (got,) = reducer.reduce([RowSparse(np.array([kv.rank]), np.ones((1, SHAPE[1]), np.float32), SHAPE)])
        return str(caught.value), took, got.indices.tolist(), got.rows[:, 0].tolist()
    for rank, (text, took, ids, rows) in enumerate(sums2.run(work)):
        assert took < 10.0, (rank, took, text)
        assert f"row id {bad}" in text and "'t'" in text, text
        assert rank == 1 or "worker 1" in text, text
        assert (ids, rows) == ([0, 1], [1.0, 1.0])

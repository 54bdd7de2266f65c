"""Dynamic row-sparse tables (docs/sparse.md, "Dynamic tables") in dist_sync and dist_async clusters:
the same rows as the 'local' store, ids of any 64-bit value, servers held at their capacity with their
counters in ``stats(cluster=True)``."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore
from kvstore import RowSparse
from kvstore.core import rowsparse as R
from tests.helpers import poll_for
from tests.integration.conftest import Cluster, _shared_cluster, unique_key

pytestmark = pytest.mark.timeout(90)
W = 4
INIT = {"type": "normal", "sigma": 0.5, "seed": 11}


def _cluster(tmp_path_factory, mode: str) -> Cluster:
    return _shared_cluster(tmp_path_factory, mode, 2, 2, KVSTORE_HEARTBEAT_INTERVAL=0.2)


@pytest.fixture(scope="module")
def sync2(tmp_path_factory):
    """A dist_sync cluster of 2 workers and 2 servers, heartbeats every 0.2 s (stats)."""
    cluster = _cluster(tmp_path_factory, "dist_sync")
    yield cluster
    cluster.close()


def _step_ids(rank: int, step: int) -> np.ndarray:
    """A worker's ids of one step: any 64-bit values (negative, huge), some shared, some repeated."""
    rng = np.random.default_rng(100 * step + rank)
    ids = rng.integers(-(2**63), 2**63 - 1, size=6, dtype=np.int64)
    return np.concatenate([ids, [7, 7, 2**40 + step]]).astype(np.int64)


def _grad(rank: int, step: int) -> RowSparse:
    ids = _step_ids(rank, step)
    rows = np.random.default_rng(7 + 10 * step + rank).normal(size=(ids.size, W)).astype(np.float32)
    return RowSparse(ids, rows, (0, W))


def _servers(kv) -> list[dict]:
    return [n for n in kv.stats(cluster=True)["nodes"] if n["role"] == "server"]


def test_sync_2w2s_equals_the_local_store_and_unseen_pulls_store_nothing(sync2) -> None:
    """dist_sync with adam over 2 servers gives the 'local' store's rows (same pushes, summed per
    round) to 1e-6; ids never pushed read as their initial rows and are not stored (admit=True
    stores them); every server holds some rows and the rows held add up."""
    key = unique_key("dyn")
    steps = 3
    asked = np.concatenate([_step_ids(r, s) for r in range(2) for s in range(steps)])
    unseen = np.array([123456789, -5, 2**62], np.int64)

    def work(kv):
        kv.init(key, width=W, dtype="float32", init=INIT, dynamic=True)
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.05))
        for step in range(steps):
            kv.push(key, _grad(kv.rank, step))
        got = kv.row_sparse_pull(key, row_ids=asked)
        fresh = kv.row_sparse_pull(key, row_ids=unseen)
        kv.barrier()
        return got, fresh

    results = sync2.run(work)
    local = kvstore.create("local")
    local.init(key, width=W, dtype="float32", init=INIT, dynamic=True)
    local.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.05))
    for step in range(steps):
        local.push(key, [_grad(0, step), _grad(1, step)])
    want = local.row_sparse_pull(key, row_ids=asked)
    initial = R.generate_ids(R.parse_init(key, INIT), np.sort(unseen), W, np.dtype(np.float32))
    for got, fresh in results:
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_allclose(got.rows, want.rows, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(fresh.rows, initial)
    held = np.unique(asked).size

    def counted():
        tables = [s.get("dynamic_tables", {}).get(key) for s in _servers(sync2.workers[0])]
        return tables if all(tables) and sum(t["rows"] for t in tables) == held else None

    tables = poll_for(counted, 10, "both servers' counters of the dynamic table")
    assert all(t["rows"] > 0 for t in tables)
    sync2.run(lambda kv: kv.row_sparse_pull(key, row_ids=unseen[:1], admit=kv.rank == 0))
    poll_for(lambda: sum(s["dynamic_tables"][key]["rows"] for s in _servers(sync2.workers[0])) == held + 1,
             10, "the admitted row counted")


def test_an_eviction_heavy_stream_keeps_each_server_at_its_capacity(sync2) -> None:
    """Far more distinct ids than 2 servers x 40 rows: each server holds 40 rows, counts its
    evictions, and its bytes held stay those of 40 rows (pool and adam's state)."""
    key = unique_key("dyn")
    capacity, steps, per_step = 40, 15, 60

    def init(kv):
        kv.init(key, width=W, dtype="float32", init=INIT, dynamic={"capacity": capacity, "policy": "lfu"})
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.05))

    def work(kv):
        for step in range(steps):
            ids = np.arange(per_step, dtype=np.int64) + (step * 2 + kv.rank) * per_step
            kv.push(key, RowSparse(ids * 977, np.ones((per_step, W), np.float32), (0, W)))
        kv.barrier()

    sync2.run(init)

    def made():
        servers = _servers(sync2.workers[0])
        return servers if all(key in n.get("dynamic_tables", {}) for n in servers) else None

    before = poll_for(made, 10, "the servers' snapshots with the new table")
    sync2.run(work)
    distinct = 2 * steps * per_step

    def settled():
        tables = [s.get("dynamic_tables", {}).get(key) for s in _servers(sync2.workers[0])]
        if not all(tables):
            return None
        done = sum(t["admissions"] + t["dropped_updates"] for t in tables) == distinct
        return tables if done else None

    tables = poll_for(settled, 10, "the servers' counters after the stream")
    for table in tables:
        assert table["rows"] == capacity and table["capacity"] == capacity
        assert table["evictions"] == table["admissions"] - capacity
    per_row = W * 4 * 3 + 8 + 1 + 8 + 8 + 8 + 1  # the row, adam's mean and var, the slot's id and
    # counters (the last byte: its optimizer state still to be reset, review 46 #1)
    after = {n["rank"]: n["held_bytes"] for n in _servers(sync2.workers[0])}
    for server in before:
        assert after[server["rank"]] - server["held_bytes"] <= capacity * per_row


@pytest.fixture(scope="module")
def async2(tmp_path_factory):
    """A dist_async cluster of 2 workers and 2 servers."""
    cluster = _cluster(tmp_path_factory, "dist_async")
    yield cluster
    cluster.close()


def test_dist_async_pushes_apply_as_in_the_local_store(async2) -> None:
    """dist_async: both workers' pushes (plain sgd: their order does not matter) leave the rows a
    'local' store gets from the same pushes, over ids of any 64-bit value."""
    key = unique_key("dyn")
    steps = 4
    asked = np.concatenate([_step_ids(r, s) for r in range(2) for s in range(steps)])

    def work(kv):
        kv.init(key, width=W, dtype="float32", init=INIT, dynamic=True)
        kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.25))
        for step in range(steps):
            kv.push(key, _grad(kv.rank, step))
        kv.barrier()
        return kv.row_sparse_pull(key, row_ids=asked)

    results = async2.run(work)
    local = kvstore.create("local")
    local.init(key, width=W, dtype="float32", init=INIT, dynamic=True)
    local.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=0.25))
    for step in range(steps):
        for rank in range(2):
            local.push(key, _grad(rank, step))
    want = local.row_sparse_pull(key, row_ids=asked)
    for got in results:
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_allclose(got.rows, want.rows, rtol=1e-6, atol=1e-6)


def test_optimizer_states_of_a_dynamic_table_save_and_load_as_in_the_local_store(sync2, tmp_path,
                                                                                monkeypatch) -> None:
    """save_optimizer_states walks each server's rows a few at a time (2 per message here) and writes
    the 'local' store's entry (ids sorted, adam's rows, count); load_optimizer_states after another
    step sends each row's state back to its server, so the next step gives the local store's rows."""
    from kvstore.client.sparse import DistRows
    from kvstore.core import checkpoint

    monkeypatch.setattr(DistRows, "rows_per_message", lambda self, meta: 8)  # 2 rows a reply, 8 a set
    key = unique_key("dyn")
    asked = np.concatenate([_step_ids(r, s) for r in range(2) for s in range(4)])
    path = str(tmp_path / "states")

    def sequence(kv, pushes) -> None:
        kv.init(key, width=W, dtype="float32", init=INIT, dynamic=True)
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.05))
        for step in range(2):
            pushes(kv, step)
        kv.save_optimizer_states(path + f".{kv.type}")
        pushes(kv, 2)
        kv.load_optimizer_states(path + f".{kv.type}")
        pushes(kv, 3)

    def work(kv):
        sequence(kv, lambda k, step: k.push(key, _grad(k.rank, step)))
        return kv.row_sparse_pull(key, row_ids=asked)

    results = sync2.run(work)
    local = kvstore.create("local")
    sequence(local, lambda k, step: k.push(key, [_grad(0, step), _grad(1, step)]))
    want = local.row_sparse_pull(key, row_ids=asked)
    (saved,) = checkpoint.read_states(path + ".dist_sync").entries
    (expected,) = checkpoint.read_states(path + ".local").entries
    np.testing.assert_array_equal(saved.ids, expected.ids)
    assert saved.count == expected.count == 2 and saved.shape == expected.shape
    for name in ("mean", "var"):
        np.testing.assert_allclose(saved.arrays[name], expected.arrays[name], rtol=1e-6, atol=1e-7)
    for got in results:
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_allclose(got.rows, want.rows, rtol=1e-6, atol=1e-6)


def test_a_snapshot_holds_a_dynamic_table_and_resumes_on_another_server_count(make_cluster, tmp_path,
                                                                               monkeypatch) -> None:
    """save_checkpoint writes a dynamic table's held rows by id (walked 2 per reply) and their adam
    state; a resumed cluster of 2 servers instead of 1 (the table initialised before or after
    set_optimizer) continues the unbroken run: same rows after one more step."""
    import dataclasses

    from kvstore.client.sparse import DistRows
    from kvstore.client.store import DistKVStore

    monkeypatch.setattr(DistRows, "rows_per_message", lambda self, meta: 8)
    asked = np.concatenate([_step_ids(0, s) for s in range(3)])
    keys = [unique_key("dyn"), unique_key("dyn")]
    first = make_cluster("dist_sync", 1, 1)
    (kv,) = first.workers
    for key in keys:
        kv.init(key, width=W, dtype="float32", init=INIT, dynamic=True)
    kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
    for step in range(2):
        kv.push(keys, [_grad(0, step), _grad(0, step)])
    kv.save_checkpoint(tmp_path / "snap")
    kv.push(keys, [_grad(0, 2), _grad(0, 2)])
    want = {key: kv.row_sparse_pull(key, row_ids=asked) for key in keys}

    saved, _ = kvstore.snapshot.read(str(tmp_path / "snap"))
    held = np.unique(np.concatenate([_step_ids(0, s) for s in range(2)]))
    np.testing.assert_array_equal(saved[keys[0]].indices, held)

    second = make_cluster("dist_sync", 1, 2, connect=False)
    cfg = dataclasses.replace(second.cfg, resume=str(tmp_path / "snap"))
    resumed = DistKVStore("dist_sync", cfg)
    second.workers = [resumed]
    resumed.init(keys[0], width=W, dtype="float32", init=INIT, dynamic=True)  # the snapshot's rows
    resumed.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.1))
    resumed.init(keys[1], width=W, dtype="float32", init=INIT, dynamic=True)  # state comes back too
    resumed.push(keys, [_grad(0, 2), _grad(0, 2)])
    for key in keys:
        got = resumed.row_sparse_pull(key, row_ids=asked)
        np.testing.assert_array_equal(got.indices, want[key].indices)
        np.testing.assert_allclose(got.rows, want[key].rows, rtol=1e-6, atol=1e-7, err_msg=key)


def test_saves_stream_tables_bigger_than_a_chunk_server_by_server(sync2, tmp_path, monkeypatch) -> None:
    """With 8 rows a message, save_checkpoint and save_optimizer_states of a 200-row fixed table and a
    dynamic table of ~70 rows never ask a server for more than 8 fixed rows or 2 dynamic rows at a
    time, and the files hold every row and its adam state as the servers do."""
    from kvstore.client import sparse_states
    from kvstore.client.sparse import DistRows

    monkeypatch.setattr(DistRows, "rows_per_message", lambda self, meta: 8)
    asked: list[int] = []
    pull, walk = DistRows.pull, sparse_states.walk_dynamic

    def spy_pull(self, key, meta, ids, admit=False):
        asked.append(ids.size)
        return pull(self, key, meta, ids, admit)

    def spy_walk(*args, **kwargs):
        for server, reply in walk(*args, **kwargs):
            asked.append(reply.arrays[0].size)
            yield server, reply

    fixed, dyn = unique_key("fix"), unique_key("dyn")
    ids = np.concatenate([_step_ids(r, s) for r in range(2) for s in range(8)])

    def work(kv):
        kv.init(fixed, shape=(200, W), init={"type": "uniform", "seed": 2})
        kv.init(dyn, width=W, dtype="float32", init=INIT, dynamic=True)
        kv.set_optimizer(kvstore.optimizer.create("adam", learning_rate=0.05))
        for step in range(8):
            touched = np.arange(step, 200, 7)
            fixed_grad = RowSparse(touched, np.ones((touched.size, W), np.float32), (200, W))
            kv.push([fixed, dyn], [fixed_grad, _grad(kv.rank, step)])
        kv.barrier()
        if kv.rank == 0:  # the writer: only its pulls are watched
            monkeypatch.setattr(DistRows, "pull", spy_pull)
            monkeypatch.setattr(sparse_states, "walk_dynamic", spy_walk)
        kv.save_checkpoint(str(tmp_path / "snap"))
        kv.save_optimizer_states(str(tmp_path / "states"))
        kv.barrier()
        if kv.rank == 0:
            monkeypatch.setattr(DistRows, "pull", pull)
        return kv.row_sparse_pull(fixed, row_ids=np.arange(200)).rows, kv.row_sparse_pull(dyn, row_ids=ids)

    (table, rows), _ = sync2.run(work)
    assert len(asked) >= 200 // 8 and max(asked) <= 8, asked
    values, states = kvstore.snapshot.read(str(tmp_path / "snap"))
    np.testing.assert_array_equal(values[fixed], table)
    np.testing.assert_array_equal(values[dyn].indices, rows.indices)
    np.testing.assert_array_equal(values[dyn].rows, rows.rows)
    saved = {e.key: e for e in kvstore.checkpoint.read_states(str(tmp_path / "states")).entries}
    assert saved[fixed].count == saved[dyn].count == 8 and saved[fixed].arrays["mean"].shape == (200, W)
    np.testing.assert_array_equal(saved[dyn].ids, rows.indices)
    in_snapshot = {e.key: e for e in states.entries}
    for name in ("mean", "var"):
        np.testing.assert_array_equal(saved[dyn].arrays[name], in_snapshot[dyn].arrays[name])
        np.testing.assert_array_equal(saved[fixed].arrays[name], in_snapshot[fixed].arrays[name])
    assert np.abs(saved[fixed].arrays["mean"]).sum() > 0


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_half_precision_compression_casts_the_rows_a_push_carries(make_cluster, kind) -> None:
    """Under fp16/bf16 compression a push's rows travel cast (then float32 again on the servers), for a
    fixed and a dynamic table: the stored rows are the cast values, not the float32 ones."""
    from kvstore.core import compression as C

    cluster = make_cluster("dist_sync", 1, 2)
    (kv,) = cluster.workers
    kv.set_gradient_compression({"type": kind})
    kv.init("f", shape=(50, W))
    kv.init("d", width=W, dtype="float32", dynamic=True)
    ids = np.array([3, 17, 41], np.int64)
    rows = (1 + np.arange(3 * W, dtype=np.float32).reshape(3, W) * 1e-3) / 3
    kv.push(["f", "d"], [RowSparse(ids, rows, (50, W)), RowSparse(ids * 2**33, rows, (0, W))])
    cast = C.from_half(kind, C.to_half(kind, rows.reshape(-1), None)).reshape(3, W)
    assert not np.array_equal(cast, rows)
    np.testing.assert_array_equal(kv.row_sparse_pull("f", row_ids=ids).rows, cast)
    np.testing.assert_array_equal(kv.row_sparse_pull("d", row_ids=ids * 2**33).rows, cast)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_half_precision_error_feedback_carries_each_rows_cast_error(make_cluster, kind) -> None:
    """fp16/bf16 with error_feedback on rows: a row's second push casts the row plus what its first cast
    lost (kept per row id on the worker), for a fixed and a dynamic table over 2 servers; the stored
    rows (no optimizer: the last push's) are exactly that cast."""
    from kvstore.core import compression as C

    cluster = make_cluster("dist_sync", 1, 2)
    (kv,) = cluster.workers
    kv.set_gradient_compression({"type": kind, "error_feedback": True})
    kv.init("f", shape=(50, W))
    kv.init("d", width=W, dtype="float32", dynamic=True)
    ids = np.array([3, 17, 41], np.int64)
    rows = (1 + np.arange(3 * W, dtype=np.float32).reshape(3, W) * 1e-3) / 3
    residual = np.zeros(3 * W, np.float32)
    for _ in range(2):
        expected = C.from_half(kind, C.to_half(kind, rows.reshape(-1), residual)).reshape(3, W)
        kv.push(["f", "d"], [RowSparse(ids, rows, (50, W)), RowSparse(ids * 2**33, rows, (0, W))])
        np.testing.assert_array_equal(kv.row_sparse_pull("f", row_ids=ids).rows, expected)
        np.testing.assert_array_equal(kv.row_sparse_pull("d", row_ids=ids * 2**33).rows, expected)
    plain = C.from_half(kind, C.to_half(kind, rows.reshape(-1), None)).reshape(3, W)
    assert not np.array_equal(expected, plain)  # the second cast carried the first one's error


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_quantised_compression_codes_the_rows_and_carries_each_rows_residual(make_cluster, kind) -> None:
    """Under 2bit/1bit a push's rows arrive quantised (the stored rows, with no optimizer, are the
    dequantised ones) for a fixed and a dynamic table over 2 servers, and each row's residual carries
    to that row's next push: 0.3 twice under 2bit (t 0.5) stores 0, then 0.5."""
    from kvstore.core import compression as C

    cluster = make_cluster("dist_sync", 1, 2)
    (kv,) = cluster.workers
    kv.set_gradient_compression({"type": kind, "threshold": 0.5 if kind == "2bit" else 0.0})
    kv.init("f", shape=(50, W))
    kv.init("d", width=W, dtype="float32", dynamic=True)
    ids = np.array([3, 17, 41], np.int64)
    rows = np.full((3, W), 0.3, np.float32)
    rows[1] = -0.7
    residual = np.zeros(3 * W, np.float32)
    spec = C.parse({"type": kind, "threshold": 0.5 if kind == "2bit" else 0.0})
    for step in range(2):
        kv.push(["f", "d"], [RowSparse(ids, rows, (50, W)), RowSparse(ids * 2**33, rows, (0, W))])
        packed = C.quantise(spec.type, rows.reshape(-1), residual, spec.threshold)
        want = C.dequantise(spec.type, packed, 3 * W, spec.threshold).reshape(3, W)
        np.testing.assert_array_equal(kv.row_sparse_pull("f", row_ids=ids).rows, want)
        np.testing.assert_array_equal(kv.row_sparse_pull("d", row_ids=ids * 2**33).rows, want)
        if kind == "2bit":
            assert want[0, 0] == (0.0 if step == 0 else 0.5) and want[1, 0] == -0.5


@pytest.mark.parametrize("kind", ["2bit", "1bit"])
def test_rows_past_the_residual_bound_arrive_exactly_and_the_others_quantised(make_cluster, kind) -> None:
    """With the worker's row residuals bounded at 4 rows, a push of 12 rows (fixed and dynamic tables,
    2 servers) sends its first 4 ids quantised with their residuals and the other 8 uncompressed, in
    the same round: the servers store those 8 rows exactly as pushed, push after push."""
    from kvstore.client.compress import RowResiduals
    from kvstore.core import compression as C

    cluster = make_cluster("dist_sync", 1, 2)
    (kv,) = cluster.workers
    threshold = 0.5 if kind == "2bit" else 0.0
    kv.set_gradient_compression({"type": kind, "threshold": threshold})
    kv._compress.rows.budget = 4 * RowResiduals.row_bytes(W)
    kv.init("f", shape=(50, W))
    kv.init("d", width=W, dtype="float32", dynamic=True)
    ids = np.arange(12, dtype=np.int64) * 4 + 1
    rows = np.full((12, W), 0.3, np.float32)
    rows[5] = -0.7
    residual = np.zeros(4 * W, np.float32)
    for step in range(3):
        kv.push(["f", "d"], [RowSparse(ids, rows, (50, W)), RowSparse(ids * 2**33, rows, (0, W))])
        want = rows.copy()
        packed = C.quantise(kind, rows[:4].reshape(-1), residual, threshold)
        want[:4] = C.dequantise(kind, packed, 4 * W, threshold).reshape(4, W)
        np.testing.assert_array_equal(kv.row_sparse_pull("f", row_ids=ids).rows, want)
        np.testing.assert_array_equal(kv.row_sparse_pull("d", row_ids=ids * 2**33).rows, want)
        if kind == "2bit":
            assert want[0, 0] == (0.5 if step == 1 else 0.0)


def test_staleness_holds_a_fast_worker_within_s_pushes_of_the_slowest(make_cluster) -> None:
    """dist_async, s=2: worker 0 pushes a dynamic table 4 times as fast as it can, worker 1 only when
    the test says; worker 0 never gets more than 2 pushes past worker 1 (its window waits)."""
    import threading

    steps = 4
    cluster = make_cluster("dist_async", num_workers=2, num_servers=1, KVSTORE_STALENESS=2)
    kv0, kv1 = cluster.workers
    key = unique_key("dyn")
    cluster.run(lambda kv: kv.init(key, width=W, dtype="float32", dynamic=True))
    sent = [0]

    def run() -> None:
        for step in range(steps):
            kv0.push(key, _grad(0, step))
            sent[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    for slow in range(steps + 1):
        expect = min(steps, slow + 2)
        poll_for(lambda e=expect: sent[0] == e and (e == steps or kv0._window.waiting), 15,
                 f"worker 0 to stop at {expect} pushes")
        assert sent[0] == expect  # held: no further push got out
        if slow < steps:
            kv1.push(key, _grad(1, slow))
    thread.join(15)
    cluster.run(lambda kv: kv.barrier())


def test_stall_abort_answers_a_pull_waiting_on_a_row_sparse_round(make_cluster) -> None:
    """KVSTORE_STALL_ABORT=2: a pull waiting on a dynamic table's round that worker 1 never joins gets
    StallError naming worker 1; worker 1's push then closes the round with both pushes."""
    import time

    from kvstore.errors import StallError

    cluster = make_cluster("dist_sync", num_workers=2, num_servers=1, KVSTORE_STALL_WARN=1,
                           KVSTORE_STALL_ABORT=2)
    kv0, kv1 = cluster.workers
    key = unique_key("dyn")
    cluster.run(lambda kv: kv.init(key, width=W, dtype="float32", dynamic=True))
    ids = np.array([5], np.int64)
    kv0.push(key, RowSparse(ids, np.ones((1, W), np.float32), (0, W)))
    started = time.monotonic()
    with pytest.raises(StallError, match=r"worker 1 .*KVSTORE_STALL_ABORT=2"):
        kv0.row_sparse_pull(key, row_ids=ids)
    assert time.monotonic() - started < 10
    kv1.push(key, RowSparse(ids, np.ones((1, W), np.float32), (0, W)))
    np.testing.assert_array_equal(kv1.row_sparse_pull(key, row_ids=ids).rows, np.full((1, W), 2.0))


def test_a_quorum_closes_row_sparse_rounds_without_the_backup_worker(make_cluster) -> None:
    """KVSTORE_SYNC_QUORUM=2 of 3: workers 0 and 1's pushes of a fixed and a dynamic table close the
    round, summed and scaled by 3/2; worker 2's push of that round comes late: acked, dropped, and its
    pull reads the round the others made."""
    cluster = make_cluster("dist_sync", num_workers=3, num_servers=1, KVSTORE_SYNC_QUORUM=2)
    kv0, kv1, kv2 = cluster.workers
    fixed, dyn = unique_key("fix"), unique_key("dyn")
    cluster.run(lambda kv: (kv.init(fixed, shape=(20, W)),
                            kv.init(dyn, width=W, dtype="float32", dynamic=True)))
    ids = np.array([2, 13], np.int64)

    def grads(value: float) -> list[RowSparse]:
        rows = np.full((2, W), value, np.float32)
        return [RowSparse(ids, rows, (20, W)), RowSparse(ids * 2**35, rows, (0, W))]

    for kv, value in ((kv0, 1.0), (kv1, 3.0)):
        kv.push([fixed, dyn], grads(value))
    want = np.full((2, W), 6.0, np.float32)  # (1 + 3) * 3/2
    for kv in (kv0, kv1):
        np.testing.assert_array_equal(kv.row_sparse_pull(fixed, row_ids=ids).rows, want)
        np.testing.assert_array_equal(kv.row_sparse_pull(dyn, row_ids=ids * 2**35).rows, want)
    kv2.push([fixed, dyn], grads(100.0))  # late: dropped
    np.testing.assert_array_equal(kv2.row_sparse_pull(fixed, row_ids=ids).rows, want)
    np.testing.assert_array_equal(kv2.row_sparse_pull(dyn, row_ids=ids * 2**35).rows, want)

"""Server-side optimizers and optimizer-state save/load through real scheduler and server processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstore.core import optimizer as kvopt
from kvstore.core.values import Meta
from kvstore.errors import DTypeMismatchError, FormatError, OptimizerError, RemoteError, ShapeMismatchError
from kvstore.net.protocol import Message, Op

from .conftest import Cluster

BOUND = 1000
SHAPES = {"small": (3, 4), "split": (2, 700)}  # the second has >= BOUND elements: one slice per server


def _grad(step: int, rank: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal(shape).astype(np.float32)


def _init_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _reference(name: str, params: dict, steps: range, num_workers: int,
               weights: dict[str, np.ndarray] | None = None,
               opt: kvopt.Optimizer | None = None) -> tuple[dict[str, np.ndarray], kvopt.Optimizer]:
    """The same training in one process: each step applies the rank-ordered sum of every worker's grad."""
    opt = opt or kvopt.create(name, **params)
    weights = {k: v.copy() for k, v in (weights or _init_weights()).items()}
    for step in steps:
        for key, w in weights.items():
            grads = [_grad(step, r, w.shape) for r in range(num_workers)]
            total = grads[0].copy()
            for g in grads[1:]:
                total += g
            opt.update(key, w, total)
    return weights, opt


def _train(kv, steps: range, init: bool = True, name: str = "sgd", params: dict | None = None) -> dict:
    keys = list(SHAPES)
    if init:
        kv.init(keys, [_init_weights()[k] for k in keys])
        kv.set_optimizer(kvopt.create(name, **(params or {})))
    for step in steps:
        kv.push(keys, [_grad(step, kv.rank, SHAPES[k]) for k in keys])
    return dict(zip(keys, kv.pull(keys)))


@pytest.mark.parametrize("name,params", [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "rescale_grad": 0.5}),
    ("adam", {"learning_rate": 0.01, "clip_gradient": 1.0}),
    ("nag", {"learning_rate": 0.05, "momentum": 0.8}),
    ("adagrad", {"learning_rate": 0.1}),
    ("rmsprop", {"learning_rate": 0.01, "centered": True}),
])
def test_sync_servers_apply_optimizer_like_one_process(make_cluster, name: str, params: dict) -> None:
    """dist_sync with 3 workers and 2 servers ends bit-identical to one process applying the summed grads
    (in rank order: KVSTORE_SUM_ORDER=rank)."""
    cluster: Cluster = make_cluster("dist_sync", 3, 2, bound=BOUND, KVSTORE_SUM_ORDER="rank")
    results = cluster.run(lambda kv: _train(kv, range(4), name=name, params=params))
    expected, _ = _reference(name, params, range(4), 3)
    for got in results:
        for key in SHAPES:
            np.testing.assert_array_equal(got[key], expected[key])


def test_async_single_worker_matches_local_optimizer(make_cluster) -> None:
    """dist_async applies each push on arrival through the optimizer, like the local rule."""
    cluster: Cluster = make_cluster("dist_async", 1, 2, bound=BOUND)
    params = {"learning_rate": 0.01, "wd": 0.001}
    (got,) = cluster.run(lambda kv: _train(kv, range(5), name="adam", params=params))
    expected, _ = _reference("adam", params, range(5), 1)
    for key in SHAPES:
        np.testing.assert_array_equal(got[key], expected[key])


def test_set_optimizer_again_resets_state_and_get_optimizer_reports(make_cluster) -> None:
    """A second set_optimizer replaces the rule and drops momentum; get_optimizer shows spec and count."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=BOUND)
    params = {"learning_rate": 0.1, "momentum": 0.9}

    def work(kv):
        _train(kv, range(3), params=params)
        before = kv.get_optimizer()
        kv.set_optimizer(kvopt.create("sgd", **params))
        after_reset = kv.get_optimizer()
        return before, after_reset, _train(kv, range(3, 5), init=False)

    results = cluster.run(work)
    weights, _ = _reference("sgd", params, range(3), 2)
    expected, _ = _reference("sgd", params, range(3, 5), 2, weights=weights)  # a fresh optimizer
    for before, after_reset, got in results:
        assert before.spec() == kvopt.create("sgd", **params).spec() and before.num_update == 3
        assert after_reset.num_update == 0 and after_reset.states == {}
        for key in SHAPES:
            np.testing.assert_array_equal(got[key], expected[key])


def test_set_optimizer_params_reaches_every_server(make_cluster) -> None:
    """A learning-rate change by one worker is in effect on every server for the next round."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=BOUND)

    def work(kv):
        _train(kv, range(2), params={"learning_rate": 0.1})
        if kv.rank == 1:
            kv.set_optimizer_params(learning_rate=0.01, wd=0.5)
        kv.barrier()
        return kv.get_optimizer().learning_rate, _train(kv, range(2, 4), init=False)

    results = cluster.run(work)
    weights, opt = _reference("sgd", {"learning_rate": 0.1}, range(2), 2)
    opt.set_params(learning_rate=0.01, wd=0.5)
    expected, _ = _reference("sgd", {}, range(2, 4), 2, weights=weights, opt=opt)
    for lr, got in results:
        assert lr == 0.01
        for key in SHAPES:
            np.testing.assert_array_equal(got[key], expected[key])


def test_optimizer_errors_are_typed_and_change_nothing(make_cluster) -> None:
    """No optimizer, bad params and int keys raise typed errors; training then goes on unharmed."""
    cluster: Cluster = make_cluster("dist_sync", 1, 2, bound=BOUND)
    (kv,) = cluster.workers
    with pytest.raises(OptimizerError, match="no optimizer"):
        kv.set_optimizer_params(learning_rate=0.5)
    assert kv.get_optimizer() is None
    kv.init("ints", np.arange(4, dtype=np.int32))
    got = _train(kv, range(2), params={"learning_rate": 0.1})
    with pytest.raises(OptimizerError):
        kv.set_optimizer_params(learning_rate=-1.0)
    with pytest.raises(OptimizerError):
        kv.set_optimizer_params(momentum=0.5)  # not a settable parameter
    with pytest.raises(DTypeMismatchError, match="floating-point"):
        kv.pushpull("ints", np.ones(4, np.int32))
    with pytest.raises(TypeError):
        kv.set_optimizer({"name": "sgd"})
    expected, _ = _reference("sgd", {"learning_rate": 0.1}, range(2), 1)
    for key in SHAPES:
        np.testing.assert_array_equal(got[key], expected[key])
    np.testing.assert_array_equal(kv.pull("ints"), np.arange(4))


def test_bad_state_message_is_refused_and_leaves_state(make_cluster) -> None:
    """A STATE_SET whose arrays do not fit gets OptimizerError back; the server's state is untouched."""
    cluster: Cluster = make_cluster("dist_sync", 1, 1, bound=BOUND)
    (kv,) = cluster.workers
    params = {"learning_rate": 0.1, "momentum": 0.9}
    _train(kv, range(2), params=params)
    bad = Message(Op.STATE_SET, {"key": "small", "count": 1, "names": ["mom"]},
                  [np.zeros(5, np.float32)])
    request = kv._io.submit(0, bad, "bad state")
    with pytest.raises(OptimizerError):
        kv._path.wait([request])
    got = _train(kv, range(2, 4), init=False)
    expected, _ = _reference("sgd", params, range(4), 1)
    for key in SHAPES:
        np.testing.assert_array_equal(got[key], expected[key])


@pytest.mark.parametrize("dump", [True, False])
def test_states_survive_a_fresh_cluster_with_other_server_count(make_cluster, tmp_path: Path,
                                                                dump: bool) -> None:
    """Save on 2 servers, load on 3: training continues bit-identical to an unbroken run."""
    params = {"learning_rate": 0.01, "wd": 0.01}
    fname = tmp_path / "states.kvs"
    first: Cluster = make_cluster("dist_sync", 2, 2, bound=BOUND)

    def save(kv):
        weights = _train(kv, range(3), name="adam", params=params)
        kv.save_optimizer_states(fname, dump_optimizer=dump)
        return weights

    saved = first.run(save)[0]
    first.close()
    second: Cluster = make_cluster("dist_sync", 2, 3, bound=BOUND)

    def resume(kv):
        keys = list(SHAPES)
        kv.init(keys, [saved[k] for k in keys])
        if not dump:
            kv.set_optimizer(kvopt.create("adam", **params))
        kv.load_optimizer_states(fname)
        return kv.get_optimizer().num_update, _train(kv, range(3, 6), init=False)

    expected, _ = _reference("adam", params, range(6), 2)
    for num_update, got in second.run(resume):
        assert num_update == 3
        for key in SHAPES:
            np.testing.assert_array_equal(got[key], expected[key])


def test_load_failures_reach_every_worker(make_cluster, tmp_path: Path) -> None:
    """A bad file fails load on every worker with one error type; the servers keep their state."""
    cluster: Cluster = make_cluster("dist_sync", 2, 2, bound=BOUND)
    params = {"learning_rate": 0.1, "momentum": 0.9}
    garbage = tmp_path / "garbage.kvs"
    garbage.write_bytes(b"not a zip at all")
    other = tmp_path / "other.kvs"

    def work(kv):
        _train(kv, range(2), params=params)
        errors = []
        for fname in (garbage, tmp_path / "missing.kvs"):
            try:
                kv.load_optimizer_states(fname)
            except Exception as exc:  # noqa: BLE001 - the test inspects the type below
                errors.append(exc)
        kv.save_optimizer_states(other)
        return errors, _train(kv, range(2, 4), init=False)

    results = cluster.run(work)
    expected, _ = _reference("sgd", params, range(4), 2)
    for rank, (errors, got) in enumerate(results):
        assert isinstance(errors[0], FormatError)
        assert isinstance(errors[1], FileNotFoundError if rank == 0 else RemoteError)
        if rank:
            assert "worker 0" in str(errors[0]) and "worker 0" in str(errors[1])
        for key in SHAPES:
            np.testing.assert_array_equal(got[key], expected[key])
    assert other.exists()


def test_load_into_keys_of_another_shape_is_refused(make_cluster, tmp_path: Path) -> None:
    """States saved for one shape do not load into a key of another; nothing changes on the servers."""
    fname = tmp_path / "states.kvs"
    first: Cluster = make_cluster("dist_sync", 1, 1, bound=BOUND)
    first.run(lambda kv: (_train(kv, range(1), params={"momentum": 0.5}),
                          kv.save_optimizer_states(fname, dump_optimizer=True)))
    first.close()
    second: Cluster = make_cluster("dist_sync", 1, 1, bound=BOUND)
    (kv,) = second.workers
    kv.init(["small", "split"], [np.zeros((4, 3), np.float32), np.zeros((2, 700), np.float32)])
    kv.set_optimizer(kvopt.create("sgd", learning_rate=0.1))
    with pytest.raises(ShapeMismatchError):
        kv.load_optimizer_states(fname)
    assert kv.get_optimizer().spec() == kvopt.create("sgd", learning_rate=0.1).spec()


def test_save_needs_an_optimizer_and_a_writable_place(make_cluster, tmp_path: Path) -> None:
    """Saving without an optimizer raises OptimizerError everywhere; an unwritable path fails on all."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1, bound=BOUND)

    def work(kv):
        errors = []
        kv.init("w", np.zeros(3, np.float32))
        for action in (lambda: kv.save_optimizer_states(tmp_path / "x.kvs"),
                       lambda: kv.set_optimizer(kvopt.create("sgd")),
                       lambda: kv.save_optimizer_states(tmp_path / "no" / "such" / "dir.kvs")):
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - the test inspects the type below
                errors.append(exc)
        return errors

    rank0, rank1 = cluster.run(work)
    assert isinstance(rank0[0], OptimizerError) and isinstance(rank1[0], OptimizerError)
    assert isinstance(rank0[1], FileNotFoundError) and isinstance(rank1[1], RemoteError)
    assert len(rank0) == len(rank1) == 2


def test_get_optimizer_counts_updates_on_any_server(make_cluster) -> None:
    """get_optimizer's num_update is the highest of all servers, even when server 0 holds no key."""
    from kvstore.core.partition import placement

    cluster: Cluster = make_cluster("dist_sync", 1, 3, bound=BOUND)
    (kv,) = cluster.workers
    seed = kv._cluster.seed
    key = next(f"k{i}" for i in range(100) if placement(f"k{i}", 3, 3, seed, BOUND)[0].server != 0)
    kv.init(key, np.zeros(3, np.float32))
    kv.set_optimizer(kvopt.create("sgd"))
    for _ in range(4):
        kv.push(key, np.ones(3, np.float32))
    kv.pull(key)
    assert kv.get_optimizer().num_update == 4


def test_set_optimizer_params_takes_numpy_scalars_and_key_maps(make_cluster) -> None:
    """numpy scalars and a {key: mult} map (int and str keys) reach the servers as plain values."""
    cluster: Cluster = make_cluster("dist_sync", 1, 2, bound=BOUND)
    (kv,) = cluster.workers
    _train(kv, range(1), params={"learning_rate": 0.1})
    kv.set_optimizer_params(learning_rate=np.float32(0.25), lr_mult={"small": np.float64(0.5), 3: 2.0})
    opt = kv.get_optimizer()
    assert opt.learning_rate == 0.25 and opt.lr_mult == {"small": 0.5, 3: 2.0}


def test_collective_after_a_failed_push_still_meets_every_worker(make_cluster) -> None:
    """A worker whose earlier push failed raises that failure, but only after set_optimizer completed."""
    cluster: Cluster = make_cluster("dist_sync", 2, 1, bound=BOUND, KVSTORE_REQUEST_TIMEOUT=20)

    def work(kv):
        kv.init("w", np.zeros(3, np.float32))
        if kv.rank == 1:  # bypass the client's checks (a group that lies about the dtype): the server refuses
            kv._push([("w", Meta((3,), np.dtype(np.float64), False, 3), [np.zeros(3, np.float64)])], 0)
        try:
            kv.set_optimizer(kvopt.create("sgd"))
        except DTypeMismatchError as exc:
            return exc
        return kv.get_optimizer().spec()["name"]

    rank0, rank1 = cluster.run(work)
    assert rank0 == "sgd"
    assert isinstance(rank1, DTypeMismatchError)

"""Unit tests of the 'local' store (kvstore/local.py through kvstore/base.py and kvstore.create)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import kvstore
from kvstore import (
    DTypeMismatchError,
    DuplicateInitError,
    KeyNotInitializedError,
    KeyTypeError,
    ShapeMismatchError,
    StoreClosedError,
    UnknownModeError,
)

SHAPE = (2, 3)


def full(value, dtype=np.float32, shape=SHAPE) -> np.ndarray:
    """An array of ``shape`` filled with ``value``."""
    return np.full(shape, value, dtype=dtype)


@pytest.fixture
def kv():
    """A fresh local store with keys 1 (=1), 2 (=2) and 'w' (=10), all float32 of SHAPE."""
    store = kvstore.create("local")
    store.init([1, 2, "w"], [full(1), full(2), full(10)])
    yield store
    store.close()


def snapshot(kv, keys=(1, 2, "w")) -> dict:
    """The current value of each of ``keys``."""
    return {k: kv.pull(k) for k in keys}


def assert_unchanged(kv, before: dict) -> None:
    """Every key in ``before`` still holds the same value."""
    for key, value in before.items():
        np.testing.assert_array_equal(kv.pull(key), value)


# -- basics -----------------------------------------------------------------------------------------

def test_create_local_properties():
    """A local store has type 'local', rank 0, one worker and no servers."""
    with kvstore.create("local") as store:
        assert (store.type, store.rank, store.num_workers, store.num_servers) == ("local", 0, 1, 0)
        assert isinstance(store, kvstore.KVStore)
        assert store.is_capable("optimizer") is True
        assert store.is_capable("row_sparse") is False


def test_create_defaults_to_local():
    """create() without a name gives a local store."""
    assert kvstore.create().type == "local"


def test_pull_returns_a_new_array_each_time(kv):
    """pull without out returns a fresh array; changing it does not change the store."""
    first = kv.pull(1)
    np.testing.assert_array_equal(first, full(1))
    assert first.dtype == np.float32 and first.shape == SHAPE
    first[:] = 99
    np.testing.assert_array_equal(kv.pull(1), full(1))


def test_init_copies_the_value():
    """Changing the init value afterwards does not change the store."""
    kv = kvstore.create("local")
    value = full(3)
    kv.init(0, value)
    value[:] = -1
    np.testing.assert_array_equal(kv.pull(0), full(3))


def test_push_assigns_without_updater(kv):
    """Without an updater each push replaces the stored value (no accumulation)."""
    kv.push(1, full(5))
    kv.push(1, full(7))
    np.testing.assert_array_equal(kv.pull(1), full(7))


def test_list_of_values_is_summed(kv):
    """A list of values for one key is summed before it is stored."""
    kv.push(1, [full(1), full(2), full(4)])
    np.testing.assert_array_equal(kv.pull(1), full(7))


def test_list_of_keys(kv):
    """A list of keys with one value (or list of values) each updates each key."""
    kv.push([1, 2], [full(3), [full(4), full(5)]])
    pulled = kv.pull([1, 2])
    assert isinstance(pulled, list) and len(pulled) == 2
    np.testing.assert_array_equal(pulled[0], full(3))
    np.testing.assert_array_equal(pulled[1], full(9))


def test_repeated_key_in_one_call_is_summed(kv):
    """A key listed twice in one push contributes the sum of its values."""
    kv.push([2, "w", 2], [full(1), full(0), [full(10), full(100)]])
    np.testing.assert_array_equal(kv.pull(2), full(111))
    np.testing.assert_array_equal(kv.pull("w"), full(0))


def test_int_and_str_keys_do_not_collide():
    """Key 3 and key "3" are separate entries."""
    kv = kvstore.create("local")
    kv.init([3, "3"], [full(1), full(2)])
    kv.push(3, full(5))
    np.testing.assert_array_equal(kv.pull("3"), full(2))


def test_numpy_integer_and_large_keys():
    """Numpy ints and keys up to 2**64-1 work as keys (np.int64(4) is the same key as 4)."""
    kv = kvstore.create("local")
    kv.init([np.int64(4), 2**64 - 1], [full(1), full(2)])
    np.testing.assert_array_equal(kv.pull(4), full(1))
    np.testing.assert_array_equal(kv.pull(2**64 - 1), full(2))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_every_supported_dtype(dtype):
    """Keys of each supported dtype keep their dtype through push and pull."""
    kv = kvstore.create("local")
    kv.init("k", np.zeros(4, dtype))
    kv.push("k", [np.arange(4, dtype=dtype)] * 2)
    pulled = kv.pull("k")
    assert pulled.dtype == dtype
    np.testing.assert_array_equal(pulled, [0, 2, 4, 6])


# -- out --------------------------------------------------------------------------------------------

def test_pull_into_out_returns_out(kv):
    """pull(key, out=x) writes into x and returns x itself."""
    out = np.zeros(SHAPE, np.float32)
    assert kv.pull("w", out=out) is out
    np.testing.assert_array_equal(out, full(10))


def test_pull_into_list_of_outs_copies_into_each(kv):
    """A list out for one key gets a copy of the value in each entry."""
    outs = [np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32)]
    kv.pull(2, out=outs)
    for out in outs:
        np.testing.assert_array_equal(out, full(2))
    assert not np.shares_memory(outs[0], outs[1])


def test_pull_list_of_keys_into_outs(kv):
    """pull([k1, k2], out=[o1, [o2a, o2b]]) fills each key's outs."""
    o1, o2a, o2b = (np.zeros(SHAPE, np.float32) for _ in range(3))
    kv.pull([1, "w"], out=[o1, [o2a, o2b]])
    np.testing.assert_array_equal(o1, full(1))
    np.testing.assert_array_equal(o2a, full(10))
    np.testing.assert_array_equal(o2b, full(10))


def test_pull_into_strided_out(kv):
    """A non-contiguous out is filled element by element, its neighbours untouched."""
    big = np.zeros((2, 6), np.float32)
    kv.pull(2, out=big[:, ::2])
    np.testing.assert_array_equal(big, [[2, 0, 2, 0, 2, 0]] * 2)


def test_non_contiguous_values_are_pushed_by_value(kv):
    """Strided and transposed values are summed by their logical values."""
    strided = np.arange(12, dtype=np.float32).reshape(2, 6)[:, ::2]
    transposed = np.arange(6, dtype=np.float32).reshape(3, 2).T
    kv.push(1, [strided, transposed])
    np.testing.assert_array_equal(kv.pull(1), strided + transposed)


# -- torch ------------------------------------------------------------------------------------------

def test_tensor_keys_pull_tensors():
    """A key initialised with a tensor pulls tensors of its dtype and shape."""
    kv = kvstore.create("local")
    kv.init("t", torch.ones(SHAPE, dtype=torch.float64))
    kv.push("t", [torch.full(SHAPE, 2.0, dtype=torch.float64), torch.full(SHAPE, 3.0, dtype=torch.float64)])
    pulled = kv.pull("t")
    assert isinstance(pulled, torch.Tensor) and pulled.dtype == torch.float64
    assert torch.equal(pulled, torch.full(SHAPE, 5.0, dtype=torch.float64))


def test_array_keys_pull_arrays_even_with_torch_loaded(kv):
    """A key initialised with a numpy array pulls numpy arrays, also after tensors were pushed."""
    kv.push(1, torch.full(SHAPE, 4.0))
    pulled = kv.pull(1)
    assert isinstance(pulled, np.ndarray)
    np.testing.assert_array_equal(pulled, full(4))


def test_pull_into_tensor_out(kv):
    """A tensor out (even non-contiguous) is filled in place."""
    out = torch.zeros(3, 2).t()
    assert kv.pull("w", out=out) is out
    assert torch.equal(out, torch.full(SHAPE, 10.0))


def test_pushed_tensor_is_not_written():
    """A pushed tensor (with requires_grad) keeps its values through later updates."""
    kv = kvstore.create("local")
    kv.init("t", torch.zeros(3))
    grad = torch.ones(3, requires_grad=True)
    kv.push("t", grad)
    kv._set_updater(lambda key, pushed, stored: stored.add_(pushed))
    kv.push("t", torch.ones(3))
    assert torch.equal(grad.detach(), torch.ones(3))
    assert torch.equal(kv.pull("t"), torch.full((3,), 2.0))


# -- values are never written -----------------------------------------------------------------------

def test_pushed_values_are_never_written(kv):
    """Arrays given to push keep their values even when an updater changes the stored value in place."""
    a, b = full(1), full(2)
    kv.push(1, a)
    kv._set_updater(lambda key, pushed, stored: np.multiply(stored, 10, out=stored))
    kv.push(1, [b, b])
    np.testing.assert_array_equal(a, full(1))
    np.testing.assert_array_equal(b, full(2))
    np.testing.assert_array_equal(kv.pull(1), full(10))


def test_read_only_values_can_be_pushed(kv):
    """Read-only values are accepted by push (they are only read)."""
    value = full(3)
    value.setflags(write=False)
    kv.push(2, [value, value])
    np.testing.assert_array_equal(kv.pull(2), full(6))


# -- pushpull and broadcast -------------------------------------------------------------------------

def test_pushpull_without_out_writes_back_into_value(kv):
    """pushpull(key, value) writes the updated value into value itself and returns it."""
    kv._set_updater(lambda key, pushed, stored: np.add(stored, pushed, out=stored))
    value = full(5)
    assert kv.pushpull(1, value) is value
    np.testing.assert_array_equal(value, full(6))  # 1 stored + 5 pushed


def test_pushpull_of_value_list_writes_each(kv):
    """pushpull(key, [a, b]) pushes a+b and writes the result into both a and b."""
    a, b = full(1), full(2)
    kv.pushpull(2, [a, b])
    np.testing.assert_array_equal(a, full(3))
    np.testing.assert_array_equal(b, full(3))


def test_pushpull_with_out_leaves_value_alone(kv):
    """pushpull with out writes out only; the pushed value is unchanged."""
    kv._set_updater(lambda key, pushed, stored: np.add(stored, pushed, out=stored))
    value, out = full(4), np.zeros(SHAPE, np.float32)
    assert kv.pushpull("w", value, out=out) is out
    np.testing.assert_array_equal(out, full(14))
    np.testing.assert_array_equal(value, full(4))


def test_pushpull_of_tensor_in_place():
    """pushpull of a tensor without out writes the result into that tensor."""
    kv = kvstore.create("local")
    kv.init("t", torch.ones(4))
    kv._set_updater(lambda key, pushed, stored: stored.sub_(pushed))
    grad = torch.full((4,), 0.25)
    kv.pushpull("t", grad)
    assert torch.equal(grad, torch.full((4,), 0.75))


def test_broadcast_inits_and_returns_the_value():
    """broadcast stores the value and returns a copy of it (or fills out)."""
    kv = kvstore.create("local")
    value = full(8)
    pulled = kv.broadcast("b", value)
    np.testing.assert_array_equal(pulled, full(8))
    assert pulled is not value
    out = np.zeros(SHAPE, np.float32)
    assert kv.broadcast("c", full(9), out=out) is out
    np.testing.assert_array_equal(out, full(9))
    with pytest.raises(DuplicateInitError):
        kv.broadcast("b", value)


def test_barrier_returns_at_once(kv):
    """barrier (and MXNet's _barrier) return immediately in a single process."""
    assert kv.barrier() is None
    assert kv._barrier() is None


# -- updater ----------------------------------------------------------------------------------------

def test_updater_gets_key_pushed_sum_and_stored(kv):
    """_set_updater's function is called with (key, summed push, stored value) and updates in place."""
    calls = []

    def updater(key, pushed, stored):
        calls.append((key, pushed.copy(), stored.copy()))
        stored -= 0.5 * pushed

    kv._set_updater(updater)
    kv.push("w", [full(1), full(3)])
    assert len(calls) == 1
    key, pushed, stored = calls[0]
    assert key == "w"
    np.testing.assert_array_equal(pushed, full(4))
    np.testing.assert_array_equal(stored, full(10))
    np.testing.assert_array_equal(kv.pull("w"), full(8))


def test_updater_is_called_once_per_key(kv):
    """A multi-key push calls the updater once per distinct key with that key's sum."""
    seen = {}
    kv._set_updater(lambda key, pushed, stored: seen.__setitem__(key, float(pushed[0, 0])))
    kv.push([1, 2, 1], [full(1), full(2), full(3)])
    assert seen == {1: 4.0, 2: 2.0}


def test_updater_gets_tensors_for_tensor_keys():
    """For a key initialised with a tensor the updater receives tensors that alias the store."""
    kv = kvstore.create("local")
    kv.init("t", torch.zeros(2))
    kinds = []

    def updater(key, pushed, stored):
        kinds.append((type(pushed), type(stored)))
        stored.add_(pushed * 2)

    kv._set_updater(updater)
    kv.push("t", torch.ones(2))
    assert kinds == [(torch.Tensor, torch.Tensor)]
    assert torch.equal(kv.pull("t"), torch.full((2,), 2.0))


# -- user errors, raised before any change ----------------------------------------------------------

def test_unknown_key_raises_before_any_change(kv):
    """A push naming an uninitialised key raises KeyNotInitializedError and stores nothing."""
    before = snapshot(kv)
    with pytest.raises(KeyNotInitializedError):
        kv.push([1, 99], [full(5), full(5)])
    with pytest.raises(KeyNotInitializedError):
        kv.pull(99)
    with pytest.raises(KeyNotInitializedError):
        kv.pushpull([2, "nope"], [full(5), full(5)])
    assert_unchanged(kv, before)


def test_key_not_initialized_is_a_key_error(kv):
    """An uninitialised key can be caught as KeyError."""
    with pytest.raises(KeyError):
        kv.pull("missing")


def test_duplicate_init_raises_before_any_change(kv):
    """init of an existing key among new ones raises DuplicateInitError and creates none of them."""
    before = snapshot(kv)
    with pytest.raises(DuplicateInitError):
        kv.init([50, 1], [full(0), full(0)])
    with pytest.raises(KeyNotInitializedError):
        kv.pull(50)
    assert_unchanged(kv, before)


def test_shape_mismatch_raises_before_any_change(kv):
    """A wrong-shaped value for one key raises ShapeMismatchError and no key is updated."""
    before = snapshot(kv)
    with pytest.raises(ShapeMismatchError):
        kv.push([1, 2], [full(5), full(5, shape=(3, 2))])
    with pytest.raises(ShapeMismatchError):
        kv.push(1, [full(5), full(5, shape=(6,))])
    assert_unchanged(kv, before)


def test_dtype_mismatch_raises_before_any_change(kv):
    """A value of another dtype raises DTypeMismatchError and no key is updated."""
    before = snapshot(kv)
    with pytest.raises(DTypeMismatchError):
        kv.push([1, 2], [full(5), full(5, dtype=np.float64)])
    with pytest.raises(DTypeMismatchError):
        kv.pushpull("w", torch.full(SHAPE, 1.0, dtype=torch.float64))
    assert_unchanged(kv, before)


@pytest.mark.parametrize("bad_key", [2.5, None, -1, True, 2**64, b"w"], ids=repr)
def test_bad_key_raises_before_any_change(kv, bad_key):
    """A key that is not an int in [0, 2**64) or a str raises KeyTypeError before anything is stored."""
    before = snapshot(kv)
    with pytest.raises(KeyTypeError):
        kv.push([1, bad_key], [full(5), full(5)])
    with pytest.raises(KeyTypeError):
        kv.init(bad_key, full(5))
    with pytest.raises(KeyTypeError):
        kv.pull(bad_key)
    assert_unchanged(kv, before)


@pytest.mark.parametrize("value", [np.zeros(SHAPE, bool), np.zeros(SHAPE, np.complex64),
                                   np.zeros(SHAPE, np.uint8)], ids=lambda v: str(v.dtype))
def test_unsupported_dtype_is_refused(kv, value):
    """init or push of an unsupported dtype raises DTypeMismatchError and changes nothing."""
    before = snapshot(kv)
    with pytest.raises(DTypeMismatchError):
        kv.init([60, 61], [full(0), value])
    with pytest.raises(KeyNotInitializedError):
        kv.pull(60)
    with pytest.raises(DTypeMismatchError):
        kv.push(1, value)
    assert_unchanged(kv, before)


def test_non_value_is_a_type_error(kv):
    """Lists of numbers and other non-arrays are refused with TypeError."""
    before = snapshot(kv)
    with pytest.raises(TypeError):
        kv.push(1, [1.0, 2.0])
    with pytest.raises(TypeError):
        kv.init(70, "zeros")
    assert_unchanged(kv, before)


def test_wrong_out_shape_raises_before_any_change(kv):
    """A wrong-shaped out raises ShapeMismatchError; no out is written and pushpull pushes nothing."""
    good, bad = np.zeros(SHAPE, np.float32), np.zeros((3, 2), np.float32)
    with pytest.raises(ShapeMismatchError):
        kv.pull([1, 2], out=[good, bad])
    np.testing.assert_array_equal(good, np.zeros(SHAPE))
    before = snapshot(kv)
    with pytest.raises(ShapeMismatchError):
        kv.pushpull(1, full(50), out=bad)
    assert_unchanged(kv, before)


def test_read_only_out_raises_before_any_change(kv):
    """A read-only out (or in-place pushpull value) raises ValueError and nothing is pushed."""
    frozen = full(50)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        kv.pull(1, out=frozen)
    before = snapshot(kv)
    with pytest.raises(ValueError, match="read-only"):
        kv.pushpull(1, frozen)
    assert_unchanged(kv, before)
    np.testing.assert_array_equal(frozen, full(50))


def test_count_mismatch_raises_before_any_change(kv):
    """Different numbers of keys and values (or outs) raise ValueError and change nothing."""
    before = snapshot(kv)
    with pytest.raises(ValueError):
        kv.push([1, 2], [full(5)])
    with pytest.raises(ValueError):
        kv.init([80, 81], [full(0)])
    with pytest.raises(ValueError):
        kv.pull([1, 2], out=[np.zeros(SHAPE, np.float32)])
    with pytest.raises(ValueError):
        kv.pushpull([1, 2], [full(5), full(5)], out=[np.zeros(SHAPE, np.float32)])
    with pytest.raises(KeyNotInitializedError):
        kv.pull(80)
    assert_unchanged(kv, before)


# -- closing ----------------------------------------------------------------------------------------

def test_closed_store_raises_store_closed_error():
    """After close every operation raises StoreClosedError."""
    kv = kvstore.create("local")
    kv.init(1, full(1))
    kv.close()
    calls = [lambda: kv.init(2, full(1)), lambda: kv.push(1, full(1)), lambda: kv.pull(1),
             lambda: kv.pull(1, out=full(0)), lambda: kv.pushpull(1, full(1)),
             lambda: kv.broadcast(3, full(1)), kv.barrier]
    for call in calls:
        with pytest.raises(StoreClosedError):
            call()


def test_context_manager_closes_the_store():
    """Leaving a with-block closes the store; closing twice is harmless."""
    with kvstore.create("local") as kv:
        kv.init(1, full(1))
    with pytest.raises(StoreClosedError):
        kv.pull(1)
    kv.close()


# -- create -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["nope", "Local", "dist", "", "dist_sync "])
def test_unknown_mode_lists_known_names(name):
    """create() of an unknown name raises UnknownModeError (a ValueError) listing every known name."""
    with pytest.raises(UnknownModeError) as info:
        kvstore.create(name)
    assert isinstance(info.value, ValueError)
    for known in ("local", "device", "dist_sync", "dist_async", "dist_sync_device", "dist_async_device"):
        assert known in str(info.value)
    for known in kvstore.KNOWN_TYPES:
        assert known in str(info.value)


@pytest.mark.parametrize("name", [None, 3, b"local"], ids=repr)
def test_non_str_mode_is_unknown(name):
    """A name that is not a str raises UnknownModeError."""
    with pytest.raises(UnknownModeError):
        kvstore.create(name)


@pytest.mark.parametrize("name", ["device", "local_allreduce_cpu", "local_allreduce_device",
                                  "local_update_cpu"])
def test_device_names_and_aliases_work_like_local(name):
    """The device store and MXNet's local aliases behave as the local store, keeping their names."""
    kv = kvstore.create(name)
    assert kv.type == name
    assert (kv.rank, kv.num_workers) == (0, 1)
    kv.init("k", torch.zeros(3))
    kv.push("k", [torch.ones(3), torch.full((3,), 2.0)])
    assert torch.equal(kv.pull("k"), torch.full((3,), 3.0))


def test_every_create_returns_a_new_local_store():
    """Two local stores are independent."""
    a, b = kvstore.create("local"), kvstore.create("local")
    a.init(1, full(1))
    with pytest.raises(KeyNotInitializedError):
        b.pull(1)


def test_import_kvstore_does_not_import_torch():
    """`import kvstore` (and creating a local store) leaves torch unimported."""
    code = ("import sys, kvstore, numpy as np; kv = kvstore.create('local'); kv.init(1, np.zeros(2)); "
            "kv.pull(1); assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- optimizer in the local store ------------------------------------------------------------------

def _sgd_store(**params):
    from kvstore.core import optimizer as kvopt
    store = kvstore.create("local")
    store.init(["a", 7], [np.ones((2, 3), np.float32), np.zeros(4, np.float64)])
    store.set_optimizer(kvopt.create("sgd", **params))
    return store


def test_local_optimizer_applies_the_summed_push():
    """With sgd the stored value becomes w - lr * rescale * sum(pushed), on numpy and float64 keys."""
    store = _sgd_store(learning_rate=0.5, rescale_grad=0.25)
    store.push("a", [np.full((2, 3), 2.0, np.float32), np.full((2, 3), 6.0, np.float32)])
    store.push(7, np.arange(4.0))
    np.testing.assert_array_equal(store.pull("a"), np.full((2, 3), 1.0 - 0.5 * 0.25 * 8.0, np.float32))
    np.testing.assert_array_equal(store.pull(7), -0.5 * 0.25 * np.arange(4.0))


def test_local_optimizer_refuses_int_keys_and_changes_nothing():
    """A push of an int key under an optimizer raises DTypeMismatchError before any key is updated."""
    store = _sgd_store(learning_rate=1.0)
    store.init("i", np.arange(3, dtype=np.int64))
    with pytest.raises(kvstore.DTypeMismatchError, match="floating-point"):
        store.push(["a", "i"], [np.ones((2, 3), np.float32), np.ones(3, np.int64)])
    np.testing.assert_array_equal(store.pull("a"), np.ones((2, 3), np.float32))


def test_local_set_optimizer_params_and_errors():
    """set_optimizer_params changes the live optimizer; without one it raises OptimizerError."""
    bare = kvstore.create("local")
    with pytest.raises(kvstore.OptimizerError, match="no optimizer"):
        bare.set_optimizer_params(learning_rate=0.1)
    with pytest.raises(kvstore.OptimizerError, match="no optimizer"):
        bare.save_optimizer_states("unused")
    with pytest.raises(TypeError):
        bare.set_optimizer("sgd")
    assert bare.get_optimizer() is None
    store = _sgd_store(learning_rate=1.0)
    store.set_optimizer_params(learning_rate=0.1)
    assert store.get_optimizer().learning_rate == 0.1
    store.push("a", np.ones((2, 3), np.float32))
    np.testing.assert_allclose(store.pull("a"), np.full((2, 3), 0.9, np.float32))


def test_local_states_round_trip_continues_identically(tmp_path):
    """Save momentum states, load them into a fresh store: the next updates are bit-identical."""
    from kvstore.core import optimizer as kvopt
    grads = [np.random.default_rng(i).standard_normal((2, 3)).astype(np.float32) for i in range(6)]
    store = _sgd_store(learning_rate=0.1, momentum=0.9)
    for g in grads[:3]:
        store.push("a", g)
    store.save_optimizer_states(tmp_path / "s.kvs", dump_optimizer=True)
    fresh = kvstore.create("local")
    fresh.init(["a", 7], [store.pull("a"), np.zeros(4, np.float64)])
    fresh.set_optimizer(kvopt.create("adam"))  # replaced by the dumped sgd
    fresh.load_optimizer_states(tmp_path / "s.kvs")
    assert fresh.get_optimizer().spec() == store.get_optimizer().spec()
    for g in grads[3:]:
        store.push("a", g)
        fresh.push("a", g)
    assert store.pull("a").tobytes() == fresh.pull("a").tobytes()


def test_local_set_updater_replaces_the_optimizer():
    """_set_updater after set_optimizer wins: pushes go to the updater, not the optimizer."""
    store = _sgd_store(learning_rate=1.0)
    store._set_updater(lambda key, pushed, stored: stored.__iadd__(pushed))
    store.push("a", np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(store.pull("a"), np.full((2, 3), 2.0, np.float32))
    assert store.get_optimizer() is None

"""Unit tests of kvstore.optimizer: MXNet 1.x's update rules, counts, state, specs and validation."""

from __future__ import annotations

import json
import warnings

import msgpack
import numpy as np
import pytest

from kvstore.core import optimizer as kvopt
from kvstore.core.lr_scheduler import CosineScheduler, FactorScheduler, MultiFactorScheduler
from kvstore.errors import DTypeMismatchError, OptimizerError, ShapeMismatchError

SHAPE = (3, 4)
STEPS = 5


def grads(n: int = STEPS, seed: int = 0, dtype=np.float64) -> list[np.ndarray]:
    """n reproducible gradients of SHAPE, some beyond the clip bound 0.8 used below."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(dtype) for _ in range(n)]


def start(dtype=np.float64) -> np.ndarray:
    return np.random.default_rng(99).standard_normal(SHAPE).astype(dtype)


def clip(x: np.ndarray, c: float | None) -> np.ndarray:
    return x if c is None else np.clip(x, -c, c)


def run(opt: kvopt.Optimizer, key, w: np.ndarray, gs: list[np.ndarray]) -> np.ndarray:
    for g in gs:
        opt.update(key, w, g)
    return w


# -- closed forms, written out independently of the module ----------------------------------------

def ref_sgd(w, gs, lr, wd, rescale, c, momentum):
    m = np.zeros_like(w)
    for g in gs:
        g = clip(rescale * g, c)
        if momentum:
            m = momentum * m - lr * wd * w - lr * g
            w = w + m
        else:
            w = (1 - lr * wd) * w - lr * g
    return w


def ref_nag(w, gs, lr, wd, rescale, c, momentum):
    m = np.zeros_like(w)
    for g in gs:
        d = lr * (clip(rescale * g, c) + wd * w)
        m = momentum * m - d
        w = w + momentum * m - d
    return w


def ref_adam(w, gs, lr, wd, rescale, c, beta1=0.9, beta2=0.999, epsilon=1e-8):
    mean, var = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(gs, start=1):
        g = clip(rescale * g + wd * w, c)
        mean = beta1 * mean + (1 - beta1) * g
        var = beta2 * var + (1 - beta2) * g * g
        w = w - lr * np.sqrt(1 - beta2**t) / (1 - beta1**t) * mean / (np.sqrt(var) + epsilon)
    return w


def ref_adagrad(w, gs, lr, wd, rescale, c, eps=1e-7):
    history = np.zeros_like(w)
    for g in gs:
        g = clip(rescale * g, c)
        history = history + g * g
        w = w - lr * (g / np.sqrt(history + eps) + wd * w)
    return w


def ref_rmsprop(w, gs, lr, wd, rescale, c, gamma1=0.9, gamma2=0.9, epsilon=1e-8, centered=False,
                clip_weights=None):
    n, gbar, delta = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    for g in gs:
        g = clip(rescale * g + wd * w, c)
        n = (1 - gamma1) * g * g + gamma1 * n
        if centered:
            gbar = (1 - gamma1) * g + gamma1 * gbar
            delta = gamma2 * delta - lr * g / np.sqrt(n - gbar * gbar + epsilon)
            w = w + delta
        else:
            w = w - lr * g / np.sqrt(n + epsilon)
        w = clip(w, clip_weights)
    return w


RULES = [
    ("sgd", ref_sgd, {"momentum": 0.0}),
    ("sgd", ref_sgd, {"momentum": 0.9}),
    ("nag", ref_nag, {"momentum": 0.85}),
    ("adam", ref_adam, {}),
    ("adam", ref_adam, {"beta1": 0.5, "beta2": 0.9, "epsilon": 1e-6}),
    ("adagrad", ref_adagrad, {}),
    ("adagrad", ref_adagrad, {"eps": 1e-3}),
    ("rmsprop", ref_rmsprop, {}),
    ("rmsprop", ref_rmsprop, {"gamma1": 0.8, "centered": True, "clip_weights": 1.1}),
]
RULE_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(RULES)]


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-10), (np.float32, 2e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("hyper", [
    dict(lr=0.1, wd=0.0, rescale=1.0, c=None),
    dict(lr=0.05, wd=0.01, rescale=0.5, c=0.8),
], ids=["plain", "wd-rescale-clip"])
@pytest.mark.parametrize("name,ref,own", RULES, ids=RULE_IDS)
def test_rule_matches_its_closed_form(name, ref, own, hyper, dtype, rtol):
    """Several steps of each rule (with wd, rescale_grad, clip_gradient) equal MXNet's formula."""
    opt = kvopt.create(name, learning_rate=hyper["lr"], wd=hyper["wd"], rescale_grad=hyper["rescale"],
                       clip_gradient=hyper["c"], **own)
    gs = grads(dtype=dtype)
    w = run(opt, 7, start(dtype), gs)
    expected = ref(start(), grads(), hyper["lr"], hyper["wd"], hyper["rescale"], hyper["c"], **own)
    assert w.dtype == dtype and all(a.dtype == dtype for a in opt.states[7].values())
    np.testing.assert_allclose(w, expected, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("name,ref,own", RULES, ids=RULE_IDS)
def test_lr_mult_and_wd_mult_apply_per_key(name, ref, own):
    """lr_mult and wd_mult scale lr and wd of the keys they name (int or str), others keep 1."""
    opt = kvopt.create(name, learning_rate=0.05, wd=0.1, lr_mult={3: 2.0, "b": 0.5}, wd_mult={"b": 0.0},
                       **own)
    for key, lr, wd in ((3, 0.1, 0.1), ("b", 0.025, 0.0), ("3", 0.05, 0.1)):
        w = run(opt, key, start(), grads())
        np.testing.assert_allclose(w, ref(start(), grads(), lr, wd, 1.0, None, **own), rtol=1e-10)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_matches_torch(momentum):
    """sgd with constant lr and wd equals torch.optim.SGD (MXNet's momentum holds lr*velocity)."""
    torch = pytest.importorskip("torch")
    param = torch.tensor(start(), requires_grad=True)
    reference = torch.optim.SGD([param], lr=0.1, momentum=momentum, weight_decay=0.01)
    opt = kvopt.create("sgd", learning_rate=0.1, momentum=momentum, wd=0.01)
    w = start()
    for g in grads(8):
        param.grad = torch.tensor(g)
        reference.step()
        opt.update(0, w, g)
    np.testing.assert_allclose(w, param.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_nag_matches_torch_nesterov():
    """nag with constant lr and wd equals torch.optim.SGD(nesterov=True)."""
    torch = pytest.importorskip("torch")
    param = torch.tensor(start(), requires_grad=True)
    reference = torch.optim.SGD([param], lr=0.05, momentum=0.9, weight_decay=0.02, nesterov=True)
    opt = kvopt.create("nag", learning_rate=0.05, momentum=0.9, wd=0.02)
    w = start()
    for g in grads(8):
        param.grad = torch.tensor(g)
        reference.step()
        opt.update("w", w, g)
    np.testing.assert_allclose(w, param.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_nag_without_momentum_is_sgd():
    """nag with momentum 0 keeps no state and steps exactly like sgd."""
    nag, sgd = kvopt.create("nag", wd=0.1), kvopt.create("sgd", wd=0.1)
    assert nag.state_names(np.float32) == ()
    np.testing.assert_array_equal(run(nag, 0, start(), grads()), run(sgd, 0, start(), grads()))


# -- counts, num_update, learning rate -------------------------------------------------------------

def test_adam_bias_correction_uses_each_keys_own_count():
    """Adam's first step on a key is about lr*sign(g) whatever other keys did (t is per key)."""
    opt = kvopt.create("adam", learning_rate=0.01)
    run(opt, "a", start(), grads(6))
    w = np.full(SHAPE, 1.0)
    g = np.full(SHAPE, 3.0)
    opt.update("b", w, g)
    assert opt.counts == {"a": 6, "b": 1}
    np.testing.assert_allclose(w, 1.0 - 0.01 * 3.0 / (3.0 + 1e-8 / np.sqrt(1 - 0.999)), rtol=1e-12)


def test_counts_per_key_and_num_update_is_the_max():
    """counts[key] counts that key's updates; num_update is the largest count so far."""
    opt = kvopt.create("sgd")
    run(opt, 1, start(), grads(3))
    run(opt, "x", start(), grads(2))
    assert opt.counts == {1: 3, "x": 2} and opt.num_update == 3
    run(opt, "x", start(), grads(2))
    assert opt.counts == {1: 3, "x": 4} and opt.num_update == 4


def test_lr_scheduler_is_driven_by_num_update_after_the_count():
    """Each step uses lr_scheduler(num_update) counted with that step, shared by all keys."""
    opt = kvopt.create("sgd", learning_rate=1.0, lr_scheduler=FactorScheduler(step=2, factor=0.5))
    steps = []
    for key in (0, 0, 0, 1, 0):
        w = np.zeros(2)
        opt.update(key, w, np.ones(2))
        steps.append(-w[0])
    # num_update after each: 1, 2, 3, 3 (key 1's first update), 4
    assert steps == [1.0, 1.0, 0.5, 0.5, 0.5]
    assert opt.learning_rate == opt.lr_scheduler(4) == 0.5


def test_begin_num_update_starts_every_count():
    """Counts start at begin_num_update: the scheduler and Adam's t see it; reset_states returns to it."""
    opt = kvopt.create("adam", learning_rate=0.1, begin_num_update=10,
                       lr_scheduler=MultiFactorScheduler(step=[10], factor=0.1))
    assert opt.num_update == 10 and opt.learning_rate == pytest.approx(0.1)
    w = run(opt, 5, start(), grads(1))
    assert opt.counts == {5: 11} and opt.num_update == 11
    lr_t = 0.01 * np.sqrt(1 - 0.999**11) / (1 - 0.9**11)
    g = grads(1)[0]
    expected = start() - lr_t * (0.1 * g) / (np.sqrt(0.001 * g * g) + 1e-8)
    np.testing.assert_allclose(w, expected, rtol=1e-10)
    opt.reset_states()
    assert opt.states == {} and opt.counts == {} and opt.num_update == 10


def test_learning_rate_and_scheduler_base_lr():
    """A given learning_rate overwrites the scheduler's base_lr (MXNet); None takes it; defaults per class."""
    sched = CosineScheduler(max_update=10, base_lr=0.3)
    assert kvopt.create("sgd", lr_scheduler=sched).lr == 0.3
    opt = kvopt.create("adam", learning_rate=0.2, lr_scheduler=sched)
    assert sched.base_lr == 0.2 and opt.learning_rate == 0.2
    defaults = {n: kvopt.create(n).learning_rate for n in kvopt.OPTIMIZERS}
    assert defaults == {"sgd": 0.01, "nag": 0.01, "adam": 0.001, "adamw": 0.001, "adagrad": 0.01,
                        "rmsprop": 0.001}
    with pytest.raises(OptimizerError):  # the scheduler's warm-up starts above this rate
        kvopt.create("sgd", learning_rate=0.01, lr_scheduler=FactorScheduler(step=2, warmup_begin_lr=0.05,
                                                                             base_lr=0.1))


def test_set_learning_rate():
    """set_learning_rate changes lr; it raises with an lr_scheduler (as MXNet) or for a bad value."""
    opt = kvopt.create("sgd")
    opt.set_learning_rate(0.5)
    assert opt.learning_rate == 0.5
    for bad in (-1.0, float("nan"), "0.1", True):
        with pytest.raises(OptimizerError):
            opt.set_learning_rate(bad)
    assert opt.learning_rate == 0.5
    with pytest.raises(OptimizerError, match="lr_scheduler"):
        kvopt.create("sgd", lr_scheduler=FactorScheduler(step=3)).set_learning_rate(0.1)


# -- precision --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,ref,own", RULES, ids=RULE_IDS)
def test_multi_precision_float16_follows_a_float32_master_copy(name, ref, own):
    """With multi_precision a float16 weight is the float32 run cast down; weight32 and state are float32."""
    opt = kvopt.create(name, multi_precision=True, learning_rate=0.05, wd=0.01, clip_gradient=0.8, **own)
    twin = kvopt.create(name, learning_rate=0.05, wd=0.01, clip_gradient=0.8, **own)
    w16, w32 = start(np.float16), start(np.float16).astype(np.float32)
    for g in grads(dtype=np.float16):
        opt.update(0, w16, g)
        twin.update(0, w32, g.astype(np.float32))
    state = opt.states[0]
    assert list(state) == list(opt.state_names(np.float16)) == ["weight32", *twin.state_names(np.float32)]
    assert all(a.dtype == np.float32 for a in state.values())
    np.testing.assert_array_equal(state["weight32"], w32)
    np.testing.assert_array_equal(w16, w32.astype(np.float16))
    assert opt.state_names(np.float32) == twin.state_names(np.float32)  # only float16 goes through a copy


@pytest.mark.filterwarnings("ignore:key .* updates a float16 weight in float16")  # asked for
@pytest.mark.parametrize("name,ref,own", RULES, ids=RULE_IDS)
def test_float16_without_multi_precision_works_in_float16(name, ref, own):
    """Without multi_precision a float16 weight is updated in float16 with float16 state."""
    opt = kvopt.create(name, learning_rate=0.05, **own)
    w = start(np.float16)
    for g in grads(dtype=np.float16):
        opt.update(0, w, g + np.float16(0.25))  # no exact zeros: adam's epsilon is 0 in float16
    assert w.dtype == np.float16 and "weight32" not in opt.states[0]
    assert all(a.dtype == np.float16 for a in opt.states[0].values())
    expected = ref(start(np.float16).astype(np.float64), [g.astype(np.float64) + 0.25
                                                          for g in grads(dtype=np.float16)],
                   0.05, 0.0, 1.0, None, **own)
    np.testing.assert_allclose(w, expected, rtol=2e-2, atol=2e-2)


def test_any_shape_and_the_grad_is_never_written():
    """0-d and 3-d weights update in place; the gradient array is left as it was."""
    for shape in ((), (2, 3, 4)):
        opt = kvopt.create("rmsprop", wd=0.1, clip_gradient=0.1, centered=True)
        w, g = np.ones(shape), np.full(shape, 2.0)
        g.flags.writeable = False
        opt.update(0, w, g)
        assert w.shape == shape and np.all(w != 1.0) and np.all(g == 2.0)


# -- specs ------------------------------------------------------------------------------------------

MULTS = {0: 0.5, 2**64 - 1: 2.0, "w": 1.5, "0": 3.0}


@pytest.mark.parametrize("name,ref,own", RULES, ids=RULE_IDS)
def test_spec_round_trip_keeps_every_parameter_and_the_updates(name, ref, own):
    """spec() is JSON/msgpack-safe; from_spec gives the same spec and bit-identical updates."""
    def make():
        return kvopt.create(name, learning_rate=0.2, wd=0.01, rescale_grad=0.5, clip_gradient=0.8,
                            begin_num_update=2, lr_scheduler=FactorScheduler(step=2, factor=0.5),
                            lr_mult=MULTS, wd_mult={"w": 0.0}, **own)

    spec = make().spec()
    assert set(spec["params"]) == set(kvopt.BASE_PARAMS) | set(type(make()).OWN_PARAMS)
    assert spec["params"]["lr_mult"] == [[0, 0.5], [2**64 - 1, 2.0], ["0", 3.0], ["w", 1.5]]
    for wire in (json.loads(json.dumps(spec)), msgpack.unpackb(msgpack.packb(spec))):
        again, original = kvopt.from_spec(wire), make()
        assert type(again) is type(original) and again.spec() == spec
        assert again.lr_mult == original.lr_mult and 0 in again.lr_mult and "0" in again.lr_mult
        for key in (0, "0", 2**64 - 1, "w", "other"):
            np.testing.assert_array_equal(run(again, key, start(), grads()),
                                          run(original, key, start(), grads()))


def test_spec_of_defaults_and_round_trip_of_set_params():
    """A default optimizer's spec lists MXNet's defaults; set_params changes show in the spec."""
    params = kvopt.create("rmsprop").spec()["params"]
    assert params == {"learning_rate": 0.001, "wd": 0.0, "rescale_grad": 1.0, "clip_gradient": None,
                      "lr_scheduler": None, "multi_precision": False, "lr_mult": [], "wd_mult": [],
                      "begin_num_update": 0, "gamma1": 0.9, "gamma2": 0.9, "epsilon": 1e-8,
                      "centered": False, "clip_weights": None}
    opt = kvopt.create("sgd", momentum=0.9)
    opt.set_params(learning_rate=0.3, lr_mult=[[1, 2.0]], clip_gradient=5)
    assert kvopt.from_spec(opt.spec()).spec() == opt.spec()
    assert opt.spec()["params"]["lr_mult"] == [[1, 2.0]] and opt.spec()["params"]["clip_gradient"] == 5.0


GOOD = kvopt.create("adam", lr_scheduler=CosineScheduler(max_update=9)).spec()


def with_params(**changes):
    return {"name": GOOD["name"], "params": {**GOOD["params"], **changes}}


GARBAGE = [
    None, [], (), "adam", 1, {}, {"name": "adam"}, {"params": GOOD["params"]}, {**GOOD, "extra": 1},
    {"name": "Adam", "params": GOOD["params"]}, {"name": "nope", "params": GOOD["params"]},
    {"name": None, "params": GOOD["params"]}, {"name": "adam", "params": None},
    {"name": "adam", "params": list(GOOD["params"].items())}, {"name": "adam", "params": {1: 2}},
    with_params(momentum=0.9), {"name": "sgd", "params": GOOD["params"]},
    {"name": "adam", "params": {k: v for k, v in GOOD["params"].items() if k != "beta1"}},
    with_params(learning_rate=float("nan")), with_params(learning_rate=float("inf")),
    with_params(learning_rate=-0.1), with_params(learning_rate="0.1"), with_params(learning_rate=[0.1]),
    with_params(wd=True), with_params(wd=10**400), with_params(rescale_grad=None),
    with_params(rescale_grad=float("-inf")), with_params(clip_gradient=0.0), with_params(clip_gradient="1"),
    with_params(beta1=1.0), with_params(beta2=-0.5), with_params(epsilon=0.0), with_params(epsilon=None),
    with_params(multi_precision=1), with_params(multi_precision="yes"), with_params(begin_num_update=1.0),
    with_params(begin_num_update=-1), with_params(begin_num_update=False),
    with_params(begin_num_update=2**64),
    with_params(lr_mult={"a": 1.0}), with_params(lr_mult=[[1]]), with_params(lr_mult=[[1, 2, 3]]),
    with_params(lr_mult=[[-1, 1.0]]), with_params(lr_mult=[[2**64, 1.0]]), with_params(lr_mult=[[1.5, 1.0]]),
    with_params(lr_mult=[[True, 1.0]]), with_params(lr_mult=[[None, 1.0]]), with_params(lr_mult=[[1, "x"]]),
    with_params(lr_mult=[[1, float("nan")]]), with_params(lr_mult=[[1, -1.0]]), with_params(lr_mult=[5]),
    with_params(wd_mult="x"), with_params(wd_mult=None), with_params(lr_scheduler="cosine"),
    with_params(lr_scheduler={"name": "cosine"}), with_params(lr_scheduler=[1]),
    with_params(lr_scheduler={"name": "cosine", "params": {**GOOD["params"]["lr_scheduler"]["params"],
                                                           "max_update": 0}}),
    {"name": "rmsprop", "params": {**kvopt.create("rmsprop").spec()["params"], "centered": 1}},
    {"name": "rmsprop", "params": {**kvopt.create("rmsprop").spec()["params"], "clip_weights": -1}},
    {"name": "sgd", "params": {**kvopt.create("sgd").spec()["params"], "momentum": 1.0}},
    {"name": "adagrad", "params": {**kvopt.create("adagrad").spec()["params"], "eps": "tiny"}},
]


@pytest.mark.parametrize("spec", GARBAGE, ids=range(len(GARBAGE)))
def test_from_spec_of_garbage_raises_optimizer_error_only(spec):
    """Anything malformed given to from_spec raises OptimizerError, never another exception."""
    with pytest.raises(OptimizerError):
        kvopt.from_spec(spec)


def test_from_spec_never_raises_anything_else_for_any_single_bad_value():
    """Each parameter of each optimizer replaced by each odd value: an optimizer or OptimizerError."""
    odd = [None, True, 0, -1, 2**70, 1e308, float("nan"), "", "x", [], [[]], [[1, 1, 1]], {}, {"a": 1},
           [[0, None]], b"bytes", 0.5, [0.5]]
    for name in kvopt.OPTIMIZERS:
        base = kvopt.create(name).spec()
        for param in base["params"]:
            for value in odd:
                try:
                    kvopt.from_spec({"name": name, "params": {**base["params"], param: value}})
                except OptimizerError:
                    pass


# -- create / register -----------------------------------------------------------------------------

def test_create_by_name_instance_and_errors():
    """create looks names up case-insensitively, passes an instance through, and raises OptimizerError."""
    assert type(kvopt.create("SGD")) is kvopt.SGD and type(kvopt.create("RmsProp")) is kvopt.RMSProp
    opt = kvopt.create("nag")
    assert kvopt.create(opt) is opt
    with pytest.raises(OptimizerError, match="adagrad"):  # the message lists the known names
        kvopt.create("ftrl")
    for bad in (lambda: kvopt.create(opt, learning_rate=0.1), lambda: kvopt.create("sgd", nesterov=True),
                lambda: kvopt.create("sgd", momentum=1.0), lambda: kvopt.create("adam", wd=-1),
                lambda: kvopt.create("sgd", clip_gradient=0), lambda: kvopt.create("sgd", rescale_grad=True),
                lambda: kvopt.create("sgd", lr_scheduler="factor"), lambda: kvopt.create(None)):
        with pytest.raises(OptimizerError):
            bad()


def test_register_adds_a_rule(monkeypatch):
    """register puts a subclass in OPTIMIZERS under its name; create and from_spec then find it."""
    monkeypatch.setattr(kvopt, "OPTIMIZERS", dict(kvopt.OPTIMIZERS))

    @kvopt.register
    class SignSGD(kvopt.Optimizer):
        name = "signsgd"

        def _step(self, w, g, state, lr, wd, t):
            w -= lr * np.sign(g)

    opt = kvopt.create("SignSGD", learning_rate=0.5)
    w = np.zeros(3)
    opt.update(0, w, np.array([2.0, -3.0, 0.0]))
    np.testing.assert_array_equal(w, [-0.5, 0.5, 0.0])
    assert type(kvopt.from_spec(opt.spec())) is SignSGD
    with pytest.raises(TypeError):
        kvopt.register(int)


# -- set_params ------------------------------------------------------------------------------------

def test_set_params_validates_all_before_changing_any():
    """One bad value (or unknown name) in set_params leaves every parameter as it was."""
    opt = kvopt.create("sgd", learning_rate=0.1, wd=0.01, lr_mult={1: 2.0})
    before = opt.spec()
    for bad in (dict(wd=0.5, learning_rate=-1.0), dict(wd=0.5, momentum=0.5), dict(rescale_grad=2.0, wd=None),
                dict(clip_gradient=1.0, lr_mult=[[1, 2, 3]]), dict(wd_mult={"a": 0.0}, clip_gradient=-1),
                dict(lr_mult={}, multi_precision=True)):
        with pytest.raises(OptimizerError):
            opt.set_params(**bad)
        assert opt.spec() == before
    opt.set_params(learning_rate=0.2, wd=0.0, rescale_grad=0.25, clip_gradient=None, lr_mult={"a": 3},
                   wd_mult=[[4, 0.5]])
    assert (opt.lr, opt.wd, opt.rescale_grad, opt.clip_gradient) == (0.2, 0.0, 0.25, None)
    assert opt.lr_mult == {"a": 3.0} and opt.wd_mult == {4: 0.5}
    scheduled = kvopt.create("sgd", lr_scheduler=FactorScheduler(step=2))
    with pytest.raises(OptimizerError, match="lr_scheduler"):
        scheduled.set_params(wd=0.1, learning_rate=0.5)
    assert scheduled.wd == 0.0


def test_set_lr_mult_and_wd_mult_replace_the_dicts():
    """set_lr_mult / set_wd_mult replace the whole mapping (MXNet), checking every key."""
    opt = kvopt.create("sgd", lr_mult={1: 2.0})
    opt.set_lr_mult({"x": 0.5})
    opt.set_wd_mult({2: 0.0})
    assert opt.lr_mult == {"x": 0.5} and opt.wd_mult == {2: 0.0}
    with pytest.raises(OptimizerError):
        opt.set_lr_mult({-5: 1.0})
    assert opt.lr_mult == {"x": 0.5}


# -- state -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,ref,own", RULES, ids=RULE_IDS)
def test_get_state_set_state_round_trip(name, ref, own):
    """get_state, flattened, then set_state on a fresh optimizer continues bit-identically (count too)."""
    params = dict(learning_rate=0.05, multi_precision=True, **own)
    opt = kvopt.create(name, **params)
    w = start(np.float16)
    run(opt, "k", w, grads(3, dtype=np.float16))
    assert kvopt.create(name).get_state("k") is None
    count, arrays = opt.get_state("k")
    assert count == 3 and list(arrays) == list(opt.state_names(np.float16))
    fresh = kvopt.create(name, **params)
    fresh.set_state("k", w, count, {n: a.reshape(-1) for n, a in reversed(arrays.items())})
    assert fresh.counts == {"k": 3} and fresh.num_update == 3
    w2 = w.copy()
    run(opt, "k", w, grads(2, seed=4, dtype=np.float16))
    run(fresh, "k", w2, grads(2, seed=4, dtype=np.float16))
    np.testing.assert_array_equal(w, w2)
    for a, b in zip(opt.get_state("k")[1].values(), fresh.get_state("k")[1].values()):
        np.testing.assert_array_equal(a, b)


def test_get_state_returns_copies():
    """Arrays from get_state do not change when the optimizer updates again."""
    opt = kvopt.create("adam")
    w = start()
    run(opt, 0, w, grads(1))
    _, arrays = opt.get_state(0)
    saved = arrays["mean"].copy()
    run(opt, 0, w, grads(1, seed=3))
    np.testing.assert_array_equal(arrays["mean"], saved)


def test_set_state_mismatches_raise_and_change_nothing():
    """Wrong names, sizes, dtypes, counts, keys or weights raise OptimizerError and leave all state."""
    opt = kvopt.create("rmsprop", centered=True)
    w = start(np.float32)
    run(opt, 1, w, grads(2, dtype=np.float32))
    good = opt.get_state(1)[1]
    before = {k: v.copy() for k, v in good.items()}
    z = np.zeros(12, np.float32)
    bad_calls = [
        (1, w, 5, {"n": z, "g": z}),
        (1, w, 5, {**good, "extra": z}),
        (1, w, 5, {**good, "n": np.zeros(11, np.float32)}),
        (1, w, 5, {**good, "n": np.zeros(12, np.float64)}),
        (1, w, 5, {**good, "n": [0.0] * 12}),
        (1, w, -1, good), (1, w, True, good), (1, w, 1.0, good),
        (-1, w, 5, good), (1.5, w, 5, good),
        (1, w.astype(np.int32), 5, good), (1, [1.0], 5, good),
        (1, w, 5, [("n", z)]),
        (2, w, 5, {"n": z}),
    ]
    for key, weight, count, arrays in bad_calls:
        with pytest.raises(OptimizerError):
            opt.set_state(key, weight, count, arrays)
        assert opt.counts == {1: 2} and opt.num_update == 2 and list(opt.states) == [1]
        for name, array in opt.states[1].items():
            np.testing.assert_array_equal(array, before[name])


def test_update_refuses_bad_inputs_before_changing_anything():
    """A non-float weight, or a grad of another shape or dtype, raises typed errors with no state change."""
    opt = kvopt.create("adam")
    run(opt, 0, start(), grads(1))
    snapshot = (dict(opt.counts), opt.num_update, {k: v.copy() for k, v in opt.states[0].items()})
    cases = [
        (DTypeMismatchError, 1, np.ones(SHAPE, np.int64), np.ones(SHAPE, np.int64)),
        (DTypeMismatchError, 0, start(), np.ones(SHAPE, np.float32)),
        (ShapeMismatchError, 0, start(), np.ones((4, 3))),
        (ShapeMismatchError, 0, np.ones((4, 3)), np.ones((4, 3))),  # state made for another shape
    ]
    for error, key, weight, grad in cases:
        with pytest.raises(error):
            opt.update(key, weight, grad)
        assert (opt.counts, opt.num_update) == snapshot[:2] and list(opt.states) == [0]
        for name, array in opt.states[0].items():
            np.testing.assert_array_equal(array, snapshot[2][name])
    readonly = start()
    readonly.flags.writeable = False
    with pytest.raises(ValueError):
        opt.update(0, readonly, start())
    assert opt.counts == snapshot[0]


def test_reset_states_drops_state_and_counts():
    """reset_states forgets every key: the next update starts fresh (Adam's t back to 1)."""
    opt = kvopt.create("adam", learning_rate=0.1)
    first = run(opt, 0, start(), grads(1))
    run(opt, 0, start(), grads(3))
    opt.reset_states()
    assert opt.states == {} and opt.counts == {} and opt.num_update == 0
    np.testing.assert_array_equal(run(opt, 0, start(), grads(1)), first)


# -- torch tensors ---------------------------------------------------------------------------------

TORCH_RULES = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9, "wd": 0.01, "clip_gradient": 0.8}),
    ("nag", {"momentum": 0.85, "wd": 0.01}),
    ("adam", {"wd": 0.01, "clip_gradient": 0.8}),
    ("adagrad", {"wd": 0.01}),
    ("rmsprop", {}),
    ("rmsprop", {"centered": True, "clip_weights": 1.1}),
]
TORCH_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(TORCH_RULES)]


def twin_optimizers(name, own, **extra):
    """Two optimizers with the same parameters: one for a numpy weight, one for a tensor weight."""
    def make():
        return kvopt.create(name, learning_rate=0.1, rescale_grad=0.5, **own, **extra)

    return make(), make()


def assert_agree(name, dtype, actual, expected):
    """sgd and nag run the same arithmetic bit for bit; the others may differ by about an ulp."""
    if name in ("sgd", "nag"):
        np.testing.assert_array_equal(actual, expected)
    elif np.dtype(dtype) == np.float32:
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-7)
    else:
        np.testing.assert_allclose(actual, expected, rtol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,own", TORCH_RULES, ids=TORCH_IDS)
def test_update_on_torch_tensors_matches_numpy(name, own, dtype):
    """Five steps on CPU tensors give the numpy path's weights and state; the grad tensor is not written."""
    torch = pytest.importorskip("torch")
    np_opt, t_opt = twin_optimizers(name, own)
    w_np, w_t = start(dtype), torch.tensor(start(dtype))
    for g in grads(dtype=dtype):
        g_t = torch.tensor(g)
        np_opt.update(0, w_np, g)
        t_opt.update(0, w_t, g_t)
        np.testing.assert_array_equal(g_t.numpy(), g)
    assert isinstance(w_t, torch.Tensor) and w_t.dtype == torch.tensor(start(dtype)).dtype
    assert not np.allclose(w_np, start(dtype))  # the steps did move the weight
    assert_agree(name, dtype, w_t.numpy(), w_np)
    assert t_opt.counts == np_opt.counts == {0: STEPS} and t_opt.num_update == STEPS
    np_count, np_state = np_opt.get_state(0)
    t_count, t_state = t_opt.get_state(0)
    assert t_count == np_count and list(t_state) == list(np_state)
    for n in np_state:
        assert_agree(name, dtype, t_state[n], np_state[n])


@pytest.mark.parametrize("name,own", TORCH_RULES, ids=TORCH_IDS)
def test_torch_weight_keeps_tensor_state_and_get_state_gives_numpy_copies(name, own):
    """A tensor weight's state arrays are tensors like it; get_state returns independent numpy copies."""
    torch = pytest.importorskip("torch")
    opt = kvopt.create(name, learning_rate=0.1, **own)
    w = torch.tensor(start(np.float32))
    for g in grads(2, dtype=np.float32):
        opt.update("k", w, torch.tensor(g))
    state = opt.states["k"]
    assert list(state) == list(opt.state_names(np.float32))
    for a in state.values():
        assert isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.device == w.device
        assert tuple(a.shape) == SHAPE
    count, arrays = opt.get_state("k")
    assert count == 2 and list(arrays) == list(state)
    for n, a in arrays.items():
        assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.shape == SHAPE
        np.testing.assert_array_equal(a, state[n].numpy())
        kept = state[n].clone()
        a += 1.0  # writing the copy leaves the optimizer's tensor alone
        assert torch.equal(state[n], kept)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_multi_precision_sgd_on_a_float16_tensor_matches_numpy(momentum):
    """multi_precision sgd on a float16 tensor keeps a float32 tensor weight32 and equals the numpy run."""
    torch = pytest.importorskip("torch")
    own = {"momentum": momentum, "wd": 0.01, "clip_gradient": 0.8}
    np_opt, t_opt = twin_optimizers("sgd", own, multi_precision=True)
    w_np, w_t = start(np.float16), torch.tensor(start(np.float16))
    for g in grads(dtype=np.float16):
        np_opt.update(0, w_np, g)
        t_opt.update(0, w_t, torch.tensor(g))
    state = t_opt.states[0]
    assert list(state) == ["weight32", *(["mom"] if momentum else [])]
    assert all(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in state.values())
    assert w_t.dtype == torch.float16
    assert not np.array_equal(w_np, start(np.float16))
    np.testing.assert_array_equal(w_t.numpy(), w_np)
    for n, a in np_opt.states[0].items():
        np.testing.assert_array_equal(state[n].numpy(), a)
    np.testing.assert_array_equal(w_t.numpy(), state["weight32"].numpy().astype(np.float16))


@pytest.mark.parametrize("name,own", TORCH_RULES, ids=TORCH_IDS)
def test_set_state_with_a_tensor_weight_stores_tensors(name, own):
    """set_state takes numpy arrays, keeps tensor copies shaped like the tensor weight; steps go on alike."""
    torch = pytest.importorskip("torch")
    np_opt, t_opt = twin_optimizers(name, own)
    w_np = start()
    run(np_opt, "k", w_np, grads(3))
    count, arrays = np_opt.get_state("k")
    flat = {n: a.reshape(-1).copy() for n, a in arrays.items()}
    w_t = torch.tensor(w_np)
    t_opt.set_state("k", w_t, count, flat)
    assert t_opt.counts == {"k": 3} and t_opt.num_update == 3
    state = t_opt.states["k"]
    assert list(state) == list(np_opt.states["k"])
    for n, a in state.items():
        assert isinstance(a, torch.Tensor) and a.dtype == torch.float64 and tuple(a.shape) == SHAPE
        np.testing.assert_array_equal(a.numpy(), arrays[n])
        flat[n][...] = 123.0  # the arrays given are copied, not kept
        np.testing.assert_array_equal(a.numpy(), arrays[n])
    for g in grads(2, seed=4):
        np_opt.update("k", w_np, g)
        t_opt.update("k", w_t, torch.tensor(g))
    assert_agree(name, np.float64, w_t.numpy(), w_np)


def test_set_state_with_a_float16_tensor_weight_and_multi_precision():
    """set_state for a float16 tensor weight with multi_precision stores float32 tensors (and weight32)."""
    torch = pytest.importorskip("torch")
    opt = kvopt.create("adam", multi_precision=True)
    w = torch.tensor(start(np.float16))
    arrays = {"weight32": start(np.float32), "mean": np.full(SHAPE, 0.5, np.float32),
              "var": np.full(SHAPE, 0.25, np.float32)}
    opt.set_state(2, w, 7, arrays)
    assert opt.counts == {2: 7} and opt.num_update == 7
    for n, a in opt.states[2].items():
        assert isinstance(a, torch.Tensor) and a.dtype == torch.float32
        np.testing.assert_array_equal(a.numpy(), arrays[n])
    with pytest.raises(OptimizerError):  # float16 arrays do not fit: the state is float32
        opt.set_state(2, w, 7, {n: a.astype(np.float16) for n, a in arrays.items()})


def snapshot(opt, weight):
    """Copies of everything update may change: weight, counts, num_update and every state array."""
    def as_np(a):
        return a.copy() if isinstance(a, np.ndarray) else a.detach().clone().numpy()

    return (as_np(weight), dict(opt.counts), opt.num_update,
            {k: {n: as_np(a) for n, a in st.items()} for k, st in opt.states.items()})


def assert_unchanged(opt, weight, before):
    w, counts, num_update, states = before
    assert (dict(opt.counts), opt.num_update) == (counts, num_update)
    np.testing.assert_array_equal(weight if isinstance(weight, np.ndarray) else weight.numpy(), w)
    assert set(opt.states) == set(states)
    for k, st in opt.states.items():
        assert set(st) == set(states[k])
        for n, a in st.items():
            np.testing.assert_array_equal(a if isinstance(a, np.ndarray) else a.numpy(), states[k][n])


def test_update_refuses_a_grad_on_the_other_side():
    """A tensor weight with a numpy grad, or the reverse, raises TypeError and changes nothing."""
    torch = pytest.importorskip("torch")
    opt = kvopt.create("adam", learning_rate=0.1)
    w_t, w_np = torch.tensor(start()), start()
    opt.update("t", w_t, torch.tensor(grads(1)[0]))
    opt.update("n", w_np, grads(1)[0])
    cases = [("t", w_t, grads(1)[0]), ("n", w_np, torch.tensor(grads(1)[0])),
             ("new", torch.tensor(start()), grads(1)[0]), ("new", start(), torch.tensor(grads(1)[0]))]
    for key, weight, grad in cases:
        before = snapshot(opt, weight)
        with pytest.raises(TypeError, match="side"):
            opt.update(key, weight, grad)
        assert_unchanged(opt, weight, before)
    assert "new" not in opt.states and opt.counts == {"t": 1, "n": 1} and opt.num_update == 1


def test_numpy_state_does_not_fit_a_tensor_weight_of_the_same_key():
    """State made for a numpy weight does not fit a tensor one (or the reverse): ShapeMismatchError."""
    torch = pytest.importorskip("torch")
    opt = kvopt.create("sgd", momentum=0.9, learning_rate=0.1)
    opt.update("a", start(), grads(1)[0])
    opt.update("b", torch.tensor(start()), torch.tensor(grads(1)[0]))
    for key, weight, grad in (("a", torch.tensor(start()), torch.tensor(grads(1)[0])),
                              ("b", start(), grads(1)[0])):
        before = snapshot(opt, weight)
        with pytest.raises(ShapeMismatchError):
            opt.update(key, weight, grad)
        assert_unchanged(opt, weight, before)
    assert isinstance(opt.states["a"]["mom"], np.ndarray) and isinstance(opt.states["b"]["mom"], torch.Tensor)


@pytest.mark.parametrize("name,own", TORCH_RULES, ids=TORCH_IDS)
def test_0d_tensor_weights_update_like_0d_numpy_weights(name, own):
    """A 0-d tensor weight stays 0-d (state too) and steps like a 0-d numpy weight."""
    torch = pytest.importorskip("torch")
    np_opt, t_opt = twin_optimizers(name, own)
    w_np, w_t = np.array(0.7), torch.tensor(0.7, dtype=torch.float64)
    for g in (1.5, -0.3, 2.0, 0.1, -1.2):
        np_opt.update(0, w_np, np.array(g))
        t_opt.update(0, w_t, torch.tensor(g, dtype=torch.float64))
    assert tuple(w_t.shape) == () and w_np.shape == () and w_np != 0.7
    assert all(tuple(a.shape) == () and isinstance(a, torch.Tensor) for a in t_opt.states[0].values())
    assert_agree(name, np.float64, w_t.numpy(), w_np)
    for n, a in np_opt.states[0].items():
        assert_agree(name, np.float64, t_opt.states[0][n].numpy(), a)


def test_update_of_a_parameter_that_requires_grad_runs_on_its_data() -> None:
    """A torch Parameter (requires_grad) is updated in place like a plain tensor, its grad untouched."""
    torch = pytest.importorskip("torch")
    weight = torch.nn.Parameter(torch.ones(3))
    grad = torch.full((3,), 2.0)
    opt = kvopt.create("sgd", learning_rate=0.5, momentum=0.5)
    opt.update("p", weight, grad)
    assert weight.requires_grad and torch.equal(weight.detach(), torch.zeros(3))
    assert torch.equal(grad, torch.full((3,), 2.0)) and opt.counts["p"] == 1


def test_float16_without_multi_precision_warns_as_mxnet_does():
    """A float16 weight updated in float16 gets MXNet's warning (Adam's state underflows to NaN there);
    with multi_precision the float32 master copy keeps the update finite and nothing is said."""
    grad = np.full(4, 1e-4, np.float16)
    plain, mixed = np.ones(4, np.float16), np.ones(4, np.float16)
    with pytest.warns(UserWarning, match="multi_precision=True"), np.errstate(invalid="ignore"):
        kvopt.create("adam").update(0, plain, grad)  # its variance and eps are 0 in float16: 0 / 0
    opt = kvopt.create("adam", multi_precision=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.update(0, mixed, grad)
    assert np.isfinite(mixed).all() and (mixed < 1).all()


PIECE_CASES = [("sgd", {}), ("sgd", {"momentum": 0.9, "wd": 1e-3, "clip_gradient": 0.8}),
               ("nag", {"momentum": 0.9, "wd": 1e-3}), ("adam", {"wd": 1e-3, "clip_gradient": 0.8}),
               ("adagrad", {"wd": 1e-3}), ("rmsprop", {"centered": True, "clip_weights": 0.7}),
               ("rmsprop", {}), ("adamw", {})]


@pytest.mark.parametrize(("name", "params"), PIECE_CASES)
@pytest.mark.parametrize(("dtype", "mixed"), [(np.float32, False), (np.float16, True)])
def test_a_big_key_stepped_in_pieces_matches_the_whole_step_bit_for_bit(monkeypatch, name, params,
                                                                         dtype, mixed) -> None:
    """Every built-in rule steps a big numpy key in pieces of STEP_PIECE elements (in cache), with the
    weights and every state array equal, bit for bit, to one step over the whole key."""
    from kvstore.core import optimizer_base

    monkeypatch.setattr(optimizer_base, "STEP_PIECE", 1000)
    n = 4 * 1000 + 123  # pieces of 1000, and a short last one
    rng = np.random.default_rng(5)
    w0, steps = rng.standard_normal(n).astype(dtype), [rng.standard_normal(n).astype(dtype) for _ in range(3)]
    pieced, whole = w0.copy(), w0.copy()
    a = kvopt.create(name, learning_rate=0.01, rescale_grad=0.37, multi_precision=mixed, **params)
    b = kvopt.create(name, learning_rate=0.01, rescale_grad=0.37, multi_precision=mixed, **params)
    for g in steps:
        a.update("k", pieced, g)
        assert a._pieces(pieced, g, a.states["k"]) is not None
        monkeypatch.setattr(optimizer_base, "STEP_PIECE", 10 ** 9)  # whole: too small for pieces
        b.update("k", whole, g)
        assert b._pieces(whole, g, b.states["k"]) is None
        monkeypatch.setattr(optimizer_base, "STEP_PIECE", 1000)
    assert np.array_equal(pieced, whole)
    assert a.states["k"].keys() == b.states["k"].keys()
    for state in a.states["k"]:
        assert np.array_equal(a.states["k"][state], b.states["k"][state])


def test_a_rule_subclass_that_does_not_declare_itself_elementwise_steps_whole(monkeypatch) -> None:
    """A subclass of a built-in rule (its _step may be anything) steps every key whole unless its own
    class body says ELEMENTWISE = True; a non-contiguous weight steps whole too."""
    from kvstore.core import optimizer_base

    monkeypatch.setattr(optimizer_base, "STEP_PIECE", 10)

    class Mine(kvopt.SGD):
        name = "mine-pieces-test"

    class Declared(kvopt.SGD):
        name = "declared-pieces-test"
        ELEMENTWISE = True

    w, g = np.ones(100, np.float32), np.ones(100, np.float32)
    assert Mine(learning_rate=0.1)._pieces(w, g, {}) is None
    assert Declared(learning_rate=0.1)._pieces(w, g, {}) is not None
    strided = np.ones(200, np.float32)[::2]
    assert Declared(learning_rate=0.1)._pieces(strided, g, {}) is None

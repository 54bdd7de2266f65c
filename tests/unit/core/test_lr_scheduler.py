"""Unit tests of kvstore.lr_scheduler: MXNet's values as pure functions, validation, specs."""

from __future__ import annotations

import json
import math
import random

import msgpack
import numpy as np
import pytest

from kvstore.core.lr_scheduler import (
    SCHEDULERS,
    CosineScheduler,
    FactorScheduler,
    LRScheduler,
    MultiFactorScheduler,
    from_spec,
)
from kvstore.errors import OptimizerError

# -- literal re-implementations of MXNet 1.x's stateful schedulers (python/mxnet/lr_scheduler.py) ---


class MxWarmup:
    """MXNet's LRScheduler base: warm-up towards the base_lr given to the constructor."""

    def __init__(self, base_lr, warmup_steps, warmup_begin_lr, warmup_mode):
        self.base_lr = base_lr
        self.warmup_steps = warmup_steps
        self.warmup_final_lr = base_lr
        self.warmup_begin_lr = warmup_begin_lr
        self.warmup_mode = warmup_mode

    def get_warmup_lr(self, num_update):
        if self.warmup_mode == "linear":
            increase = (self.warmup_final_lr - self.warmup_begin_lr) \
                * float(num_update) / float(self.warmup_steps)
            return self.warmup_begin_lr + increase
        return self.warmup_begin_lr


class MxFactor(MxWarmup):
    """MXNet's FactorScheduler: a hidden count and base_lr decayed in place."""

    def __init__(self, step, factor=1, stop_factor_lr=1e-8, base_lr=0.01, warmup_steps=0,
                 warmup_begin_lr=0, warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.step, self.factor, self.stop_factor_lr, self.count = step, factor, stop_factor_lr, 0

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while num_update > self.count + self.step:
            self.count += self.step
            self.base_lr *= self.factor
            if self.base_lr < self.stop_factor_lr:
                self.base_lr = self.stop_factor_lr
        return self.base_lr


class MxMultiFactor(MxWarmup):
    """MXNet's MultiFactorScheduler: an index into step advanced as num_update passes each."""

    def __init__(self, step, factor=1, base_lr=0.01, warmup_steps=0, warmup_begin_lr=0,
                 warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.step, self.factor, self.cur_step_ind = step, factor, 0

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        while self.cur_step_ind <= len(self.step) - 1:
            if num_update > self.step[self.cur_step_ind]:
                self.cur_step_ind += 1
                self.base_lr *= self.factor
            else:
                return self.base_lr
        return self.base_lr


class MxCosine(MxWarmup):
    """MXNet's CosineScheduler: base_lr recomputed while num_update <= max_update."""

    def __init__(self, max_update, base_lr=0.01, final_lr=0, warmup_steps=0, warmup_begin_lr=0,
                 warmup_mode="linear"):
        super().__init__(base_lr, warmup_steps, warmup_begin_lr, warmup_mode)
        self.base_lr_orig, self.max_update, self.final_lr = base_lr, max_update, final_lr
        self.max_steps = max_update - warmup_steps

    def __call__(self, num_update):
        if num_update < self.warmup_steps:
            return self.get_warmup_lr(num_update)
        if num_update <= self.max_update:
            self.base_lr = self.final_lr + (self.base_lr_orig - self.final_lr) * \
                (1 + math.cos(math.pi * (num_update - self.warmup_steps) / self.max_steps)) / 2
        return self.base_lr


CASES = [
    (FactorScheduler, MxFactor, dict(step=3, factor=0.5)),
    (FactorScheduler, MxFactor, dict(step=1, factor=0.9, stop_factor_lr=1e-3, base_lr=0.1)),
    (FactorScheduler, MxFactor, dict(step=4, factor=0.7, base_lr=0.2, warmup_steps=10, warmup_begin_lr=0.01)),
    (FactorScheduler, MxFactor, dict(step=5, factor=0.5, warmup_steps=3, warmup_mode="constant",
                                     warmup_begin_lr=0.001)),
    (FactorScheduler, MxFactor, dict(step=2, factor=1.0, stop_factor_lr=0.05, base_lr=0.01)),
    (FactorScheduler, MxFactor, dict(step=2, factor=0.0, stop_factor_lr=0.0, base_lr=0.3)),
    (MultiFactorScheduler, MxMultiFactor, dict(step=[3, 7, 8, 20], factor=0.3)),
    (MultiFactorScheduler, MxMultiFactor, dict(step=[5, 10], factor=0.1, base_lr=1.0, warmup_steps=6,
                                               warmup_begin_lr=0.5)),
    (CosineScheduler, MxCosine, dict(max_update=30, base_lr=0.5, final_lr=0.01)),
    (CosineScheduler, MxCosine, dict(max_update=25, base_lr=0.1, warmup_steps=5, warmup_begin_lr=0.02)),
    (CosineScheduler, MxCosine, dict(max_update=12, warmup_steps=4, warmup_mode="constant",
                                     warmup_begin_lr=0.003)),
]
IDS = [f"{c[0].name}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize("ours,theirs,params", CASES, ids=IDS)
def test_values_equal_mxnet_stateful_object_called_in_order(ours, theirs, params):
    """Called with 1, 2, 3, ..., each scheduler returns exactly MXNet's stateful object's value."""
    sched, reference = ours(**params), theirs(**params)
    for n in range(0, 60):
        assert sched(n) == reference(n), n


@pytest.mark.parametrize("ours,theirs,params", CASES, ids=IDS)
def test_values_depend_only_on_num_update(ours, theirs, params):
    """Asked in any order (backwards, repeated), a scheduler gives what a fresh one gives in order."""
    reference = theirs(**params)
    expected = [reference(n) for n in range(60)]
    sched = ours(**params)
    order = list(range(60)) * 2
    random.Random(5).shuffle(order)
    assert [sched(n) for n in order] == [expected[n] for n in order]
    assert [sched(n) for n in reversed(range(60))] == expected[::-1]


def test_factor_decays_count_from_zero_through_the_warmup():
    """Decays count from update 0 (MXNet): right after a warm-up of 10 with step 4, two have happened."""
    sched = FactorScheduler(step=4, factor=0.5, base_lr=1.0, warmup_steps=10, warmup_begin_lr=0.0)
    assert sched(9) == pytest.approx(0.9)
    assert sched(10) == 0.25  # ceil(10/4) - 1 = 2 decays
    assert sched(12) == 0.25 and sched(13) == 0.125


def test_factor_clamps_at_stop_factor_lr_even_from_below():
    """A decay below stop_factor_lr lands on it; a base_lr already below it is raised to it (MXNet's loop)."""
    assert FactorScheduler(step=1, factor=0.1, stop_factor_lr=0.004, base_lr=0.5)(100) == 0.004
    below = FactorScheduler(step=1, factor=1.0, stop_factor_lr=0.01, base_lr=0.001)
    assert below(1) == 0.001 and below(2) == 0.01


def test_factor_handles_a_huge_update_count_quickly():
    """A large num_update (a million decays of a slow factor) is answered and matches the clamp."""
    sched = FactorScheduler(step=1, factor=0.999999, stop_factor_lr=0.0, base_lr=1.0)
    value = sched(2_000_000)
    assert value == pytest.approx(0.999999 ** 1_999_999, rel=1e-6)
    assert sched(2_000_001) == value * 0.999999


def test_warmup_modes():
    """Linear warm-up rises from warmup_begin_lr towards base_lr in equal steps; constant stays put."""
    linear = CosineScheduler(max_update=100, base_lr=0.5, warmup_steps=4, warmup_begin_lr=0.1)
    assert [linear(n) for n in range(4)] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert linear(4) == 0.5
    constant = MultiFactorScheduler(step=[10], base_lr=0.5, warmup_steps=4, warmup_begin_lr=0.1,
                                    warmup_mode="constant")
    assert [constant(n) for n in range(5)] == [0.1, 0.1, 0.1, 0.1, 0.5]


def test_multifactor_counts_steps_strictly_passed():
    """MultiFactorScheduler multiplies by factor once for each step s with num_update > s."""
    sched = MultiFactorScheduler(step=[2, 5], factor=0.1, base_lr=1.0)
    assert [sched(n) for n in (0, 2, 3, 5, 6, 100)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_cosine_closed_form_and_after_max_update():
    """CosineScheduler follows the half cosine from base_lr to final_lr, then stays at final_lr."""
    sched = CosineScheduler(max_update=10, base_lr=1.0, final_lr=0.2, warmup_steps=2)
    for n in range(2, 11):
        assert sched(n) == pytest.approx(0.2 + 0.8 * (1 + math.cos(math.pi * (n - 2) / 8)) / 2)
    assert sched(10) == 0.2 and sched(11) == 0.2 and sched(10**6) == 0.2


def test_base_lr_is_public_and_followed():
    """Setting base_lr (as an optimizer does) changes every later value, warm-up target included."""
    factor, multi = FactorScheduler(step=2, factor=0.5), MultiFactorScheduler(step=[2], factor=0.5)
    cosine = CosineScheduler(max_update=10, warmup_steps=2)
    for sched in (factor, multi, cosine):
        sched(5)
        sched.base_lr = 0.8
    assert factor(3) == 0.4 and multi(3) == 0.4
    assert cosine(1) == 0.4  # halfway through the warm-up towards the new base_lr
    assert cosine(3) == pytest.approx(0.8 * (1 + math.cos(math.pi / 8)) / 2)
    with pytest.raises(OptimizerError, match="warmup_begin_lr"):
        FactorScheduler(step=2, warmup_begin_lr=0.5, base_lr=1.0).base_lr = 0.1


@pytest.mark.parametrize("value", [-1, True, 1.5, "3", None, np.float64(2.0)], ids=repr)
def test_bad_num_update_raises(value):
    """num_update must be an int >= 0 (numpy ints are fine)."""
    with pytest.raises(OptimizerError):
        FactorScheduler(step=2)(value)
    assert FactorScheduler(step=2)(np.int64(3)) == 0.01


@pytest.mark.parametrize("make", [
    lambda: FactorScheduler(step=0),
    lambda: FactorScheduler(step=2.0),
    lambda: FactorScheduler(step=True),
    lambda: FactorScheduler(step=2, factor=1.5),
    lambda: FactorScheduler(step=2, factor=-0.1),
    lambda: FactorScheduler(step=2, stop_factor_lr=-1.0),
    lambda: FactorScheduler(step=2, base_lr=float("nan")),
    lambda: FactorScheduler(step=2, base_lr=float("inf")),
    lambda: FactorScheduler(step=2, base_lr="0.1"),
    lambda: FactorScheduler(step=2, warmup_begin_lr=0.5, base_lr=0.1),
    lambda: FactorScheduler(step=2, warmup_steps=-1),
    lambda: FactorScheduler(step=2, warmup_mode="cosine"),
    lambda: FactorScheduler(step=2**70),
    lambda: MultiFactorScheduler(step=[]),
    lambda: MultiFactorScheduler(step=[3, 3]),
    lambda: MultiFactorScheduler(step=[5, 2]),
    lambda: MultiFactorScheduler(step=[0, 2]),
    lambda: MultiFactorScheduler(step=5),
    lambda: MultiFactorScheduler(step=[1, 2.5]),
    lambda: CosineScheduler(max_update=0),
    lambda: CosineScheduler(max_update=5, warmup_steps=5),
    lambda: CosineScheduler(max_update=5, final_lr=-0.1),
], ids=range(22))
def test_constructor_validation(make):
    """Bad constructor parameters raise OptimizerError (a ValueError)."""
    with pytest.raises(OptimizerError):
        make()


@pytest.mark.parametrize("ours,theirs,params", CASES, ids=IDS)
def test_spec_round_trips_through_json_and_msgpack(ours, theirs, params):
    """spec() holds every constructor parameter as plain values; from_spec rebuilds an equal scheduler."""
    sched = ours(**params)
    spec = sched.spec()
    assert spec["name"] == ours.name and set(spec["params"]) == set(ours.PARAMS)
    for wire in (json.loads(json.dumps(spec)), msgpack.unpackb(msgpack.packb(spec))):
        again = from_spec(wire)
        assert type(again) is ours and again.spec() == spec
        assert [again(n) for n in range(40)] == [sched(n) for n in range(40)]


def test_registry_names_every_scheduler():
    """SCHEDULERS maps each spec name to its class."""
    assert SCHEDULERS == {"factor": FactorScheduler, "multifactor": MultiFactorScheduler,
                          "cosine": CosineScheduler}


def test_base_class_has_no_spec_and_no_schedule():
    """The bare LRScheduler cannot be sent and defines no rate after the warm-up."""
    with pytest.raises(OptimizerError):
        LRScheduler().spec()
    with pytest.raises(NotImplementedError):
        LRScheduler()(0)


GOOD = FactorScheduler(step=3, factor=0.5).spec()
GARBAGE = [
    None, [], "factor", 3, {}, {"name": "factor"}, {"params": GOOD["params"]},
    {"name": "nope", "params": GOOD["params"]}, {"name": 7, "params": {}},
    {"name": "factor", "params": None}, {"name": "factor", "params": [1, 2]},
    {"name": "factor", "params": {**GOOD["params"], "extra": 1}},
    {"name": "factor", "params": {k: v for k, v in GOOD["params"].items() if k != "step"}},
    {"name": "factor", "params": {**GOOD["params"], 5: 1}},
    {**GOOD, "more": 1},
    {"name": "factor", "params": {**GOOD["params"], "step": "3"}},
    {"name": "factor", "params": {**GOOD["params"], "step": 3.0}},
    {"name": "factor", "params": {**GOOD["params"], "step": True}},
    {"name": "factor", "params": {**GOOD["params"], "factor": float("nan")}},
    {"name": "factor", "params": {**GOOD["params"], "base_lr": float("inf")}},
    {"name": "factor", "params": {**GOOD["params"], "base_lr": 10**400}},
    {"name": "factor", "params": {**GOOD["params"], "base_lr": False}},
    {"name": "factor", "params": {**GOOD["params"], "warmup_mode": None}},
    {"name": "factor", "params": {**GOOD["params"], "warmup_mode": ["linear"]}},
    {"name": "multifactor", "params": {**MultiFactorScheduler(step=[2]).spec()["params"], "step": [[1]]}},
    {"name": "multifactor", "params": {**MultiFactorScheduler(step=[2]).spec()["params"], "step": {"a": 1}}},
    {"name": "cosine", "params": {**CosineScheduler(max_update=3).spec()["params"], "max_update": None}},
]


@pytest.mark.parametrize("spec", GARBAGE, ids=range(len(GARBAGE)))
def test_from_spec_of_garbage_raises_optimizer_error_only(spec):
    """Anything malformed given to from_spec raises OptimizerError, never another exception."""
    with pytest.raises(OptimizerError):
        from_spec(spec)

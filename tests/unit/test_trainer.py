"""The Trainer on local stores: real torch models on scikit-learn's digits, against torch.optim."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import kvstore
from kvstore.core import optimizer as kvopt
from kvstore.core.lr_scheduler import FactorScheduler
from kvstore.errors import KeyNotInitializedError, OptimizerError
from kvstore.trainer import Trainer, resolve_update_on_kvstore

BATCH = 32
_digits = load_digits()
X = torch.tensor(_digits.data / 16.0, dtype=torch.float32)
Y = torch.tensor(_digits.target)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))


def batches(steps: int, seed: int = 1, size: int = BATCH) -> list[torch.Tensor]:
    """``steps`` batches of row indices from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(len(X), generator=gen)[:size] for _ in range(steps)]


def run(model: nn.Module, step_fn, rows: list[torch.Tensor], reduction: str = "sum") -> nn.Module:
    """Train ``model`` on ``rows``: backward of the (summed) loss, then ``step_fn(len(batch))``."""
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    for batch in rows:
        model.zero_grad()
        loss_fn(model(X[batch]), Y[batch]).backward()
        step_fn(len(batch))
    return model


def state(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_equal(a: nn.Module, b: nn.Module) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb), (pa - pb).abs().max()


def assert_close(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-5, atol=atol), (pa - pb).abs().max()


SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}


# -- the update rule --------------------------------------------------------------------------------

@pytest.mark.parametrize("uok", [True, False])
def test_sgd_matches_torch_sgd(uok: bool) -> None:
    """'sgd' with momentum and wd follows torch.optim.SGD step for step (constant lr)."""
    rows = batches(8)
    ours = make_model()
    trainer = Trainer(ours.parameters(), "sgd", SGD, kvstore="local", update_on_kvstore=uok)
    run(ours, trainer.step, rows)
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    run(ref, lambda n: opt.step(), rows, reduction="mean")
    assert_close(ours, ref)
    assert not torch.equal(state(ours)[0], state(make_model())[0])  # it did train


@pytest.mark.parametrize("name,params", [("sgd", SGD), ("adam", {"learning_rate": 0.01})])
def test_update_on_kvstore_true_and_false_agree(name: str, params: dict) -> None:
    """Updates in the local store and in the Trainer give bit-identical weights."""
    rows = batches(6)
    models = [make_model(), make_model()]
    for model, uok in zip(models, (True, False)):
        trainer = Trainer(model.named_parameters(), name, params, kvstore="local", update_on_kvstore=uok)
        run(model, trainer.step, rows)
    assert_equal(*models)


def test_rescale_rule_summed_loss_equals_mean_loss() -> None:
    """step(B) after a summed loss equals step(1) after the mean loss (rescale_grad = scale / B)."""
    rows = batches(5)
    summed, mean = make_model(), make_model()
    run(summed, Trainer(summed.parameters(), "sgd", SGD).step, rows, reduction="sum")
    t_mean = Trainer(mean.parameters(), "sgd", SGD)
    run(mean, lambda n: t_mean.step(1), rows, reduction="mean")
    assert_close(summed, mean)


def test_rescale_grad_in_optimizer_params_is_the_scale() -> None:
    """optimizer_params['rescale_grad'] scales like gluon: step(B) uses rescale_grad / B."""
    rows = batches(4)
    scaled, plain = make_model(), make_model()
    t_scaled = Trainer(scaled.parameters(), "sgd", {"learning_rate": 0.05, "rescale_grad": 2.0})
    run(scaled, t_scaled.step, rows)
    t_plain = Trainer(plain.parameters(), "sgd", {"learning_rate": 0.1})
    run(plain, t_plain.step, rows)
    assert_close(scaled, plain)
    assert t_scaled.optimizer.rescale_grad == pytest.approx(2.0 / BATCH)


def test_allreduce_grads_then_update_equals_step() -> None:
    """allreduce_grads() + update(B) is what step(B) does without update_on_kvstore."""
    rows = batches(4)
    a, b = make_model(), make_model()
    t_a = Trainer(a.parameters(), "sgd", SGD, update_on_kvstore=False)
    run(a, t_a.step, rows)
    t_b = Trainer(b.parameters(), "sgd", SGD, update_on_kvstore=False)

    def split_step(n: int) -> None:
        t_b.allreduce_grads()
        t_b.update(n)

    run(b, split_step, rows)
    assert_equal(a, b)


def test_non_contiguous_parameter_is_updated() -> None:
    """A non-contiguous parameter is updated through a copy written back (update_on_kvstore=False)."""
    base = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    strided = nn.Parameter(base.clone().t())  # shape (3, 4), not contiguous
    dense = nn.Parameter(base.clone().t().contiguous())
    assert not strided.is_contiguous()
    for p in (strided, dense):
        trainer = Trainer([p], "sgd", SGD, update_on_kvstore=False)
        for _ in range(3):
            p.grad = None
            (p * torch.arange(12.0).reshape(3, 4)).sum().backward()
            trainer.step(1)
    assert torch.equal(strided, dense) and not torch.equal(dense, base.t())


# -- parameters and keys ----------------------------------------------------------------------------

def test_params_as_list_named_pairs_or_dict() -> None:
    """Tensors are keyed by position, pairs and dicts by name; all three train the same."""
    rows = batches(3)
    models = [make_model() for _ in range(3)]
    forms = [models[0].parameters(), models[1].named_parameters(), dict(models[2].named_parameters())]
    trainers = [Trainer(f, "sgd", SGD, key_prefix=f"form{i}") for i, f in enumerate(forms)]
    assert trainers[0].keys == ["form0/0", "form0/1", "form0/2", "form0/3"]
    assert trainers[1].keys == ["form1/0.weight", "form1/0.bias", "form1/2.weight", "form1/2.bias"]
    assert trainers[2].keys == [k.replace("form1", "form2") for k in trainers[1].keys]
    for model, trainer in zip(models, trainers):
        run(model, trainer.step, rows)
    assert_equal(models[0], models[1])
    assert_equal(models[0], models[2])


def test_frozen_parameters_are_skipped() -> None:
    """Tensors that do not require grad get no key and are never changed; positions keep their index."""
    model = make_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = state(model)[:2]
    trainer = Trainer(model.parameters(), "sgd", SGD, key_prefix="frozen")
    assert trainer.keys == ["frozen/2", "frozen/3"]
    run(model, trainer.step, batches(3))
    assert all(torch.equal(a, b) for a, b in zip(frozen, state(model)[:2]))
    assert not torch.equal(state(model)[2], state(make_model())[2])


def test_bad_params_are_refused() -> None:
    """No trainable parameter, a tensor given twice, or a non-tensor raise before anything happens."""
    model = make_model()
    with pytest.raises(ValueError, match="no parameter requires grad"):
        Trainer([torch.zeros(3)], "sgd")
    w = model[0].weight
    with pytest.raises(ValueError, match="same tensor"):
        Trainer([("a", w), ("b", w)], "sgd")
    with pytest.raises(TypeError, match="torch tensors"):
        Trainer([np.zeros(3)], "sgd")


def test_default_prefixes_count_trainers_and_never_collide() -> None:
    """Default prefixes are trainer0, trainer1, ... so two Trainers share one store without clashing."""
    kv = kvstore.create("local")
    a, b = make_model(0), make_model(1)
    t_a = Trainer(a.parameters(), "sgd", SGD, kvstore=kv)
    t_b = Trainer(b.parameters(), "sgd", SGD, kvstore=kv)
    i = int(t_a.keys[0].split("/")[0].removeprefix("trainer"))
    assert t_a.keys[0] == f"trainer{i}/0" and t_b.keys[0] == f"trainer{i + 1}/0"
    rows = batches(3)
    run(a, t_a.step, rows)
    run(b, t_b.step, rows)
    ref = make_model(1)
    run(ref, Trainer(ref.parameters(), "sgd", SGD).step, rows)
    assert_equal(b, ref)  # a's keys did not disturb b's


def test_missing_gradient_pushes_zeros_and_warns_once() -> None:
    """A parameter with grad None is pushed as zeros, warned about once by name, and left as it was."""
    model = make_model()
    unused = nn.Parameter(torch.ones(5))
    params = [*model.named_parameters(), ("unused", unused)]
    for uok in (True, False):
        trainer = Trainer(params, "sgd", {"learning_rate": 0.1}, update_on_kvstore=uok, key_prefix=f"u{uok}")

        def step(n: int, trainer: Trainer = trainer) -> None:
            unused.grad = None  # allreduce_grads (uok False) filled it in the step before
            trainer.step(n)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(model, step, batches(3))
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and f"u{uok}/unused" in messages[0], messages
        assert torch.equal(unused, torch.ones(5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer([unused], "sgd", key_prefix="quiet").step(1, ignore_stale_grad=True)


def test_allreduce_fills_a_missing_gradient() -> None:
    """allreduce_grads gives a parameter without a gradient the reduced (zero) gradient."""
    p = nn.Parameter(torch.ones(3))
    trainer = Trainer([p], "sgd", update_on_kvstore=False)
    with pytest.warns(UserWarning, match="no gradient"):
        trainer.allreduce_grads()
    assert torch.equal(p.grad, torch.zeros(3))


# -- update_on_kvstore, store and optimizer arguments -----------------------------------------------

def test_update_on_kvstore_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit values win; None: async True, local False, other dist stores from the environment."""
    monkeypatch.delenv("KVSTORE_UPDATE_ON_KVSTORE", raising=False)
    monkeypatch.delenv("MXNET_UPDATE_ON_KVSTORE", raising=False)
    assert resolve_update_on_kvstore(None, "local") is False
    assert resolve_update_on_kvstore(True, "local") is True
    assert resolve_update_on_kvstore(None, "dist_sync") is True
    assert resolve_update_on_kvstore(False, "dist_sync") is False
    assert resolve_update_on_kvstore(None, "dist_async") is True
    assert resolve_update_on_kvstore(True, "dist_device_async") is True
    monkeypatch.setenv("MXNET_UPDATE_ON_KVSTORE", "0")
    assert resolve_update_on_kvstore(None, "dist_sync_device") is False
    assert resolve_update_on_kvstore(None, "dist_async") is True
    monkeypatch.setenv("KVSTORE_UPDATE_ON_KVSTORE", "1")
    assert resolve_update_on_kvstore(None, "dist_sync") is True
    monkeypatch.setenv("KVSTORE_UPDATE_ON_KVSTORE", "0")
    monkeypatch.delenv("MXNET_UPDATE_ON_KVSTORE")
    assert resolve_update_on_kvstore(None, "dist_sync") is False
    assert resolve_update_on_kvstore(None, "local") is False


@pytest.mark.parametrize("store_type", ["dist_async", "dist_async_device", "dist_device_async"])
def test_async_store_refuses_local_updates(store_type: str) -> None:
    """update_on_kvstore=False with an async store raises ValueError (MXNet's rule)."""
    with pytest.raises(ValueError, match="async"):
        resolve_update_on_kvstore(False, store_type)


def test_store_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """None means a new 'local' store outside a cluster; a name is created; a store is used as is."""
    monkeypatch.delenv("DMLC_ROLE", raising=False)
    model = make_model()
    default = Trainer(model.parameters(), "sgd")
    assert default.kvstore.type == "local" and default.update_on_kvstore is False
    assert Trainer(model.parameters(), "sgd", kvstore="device").kvstore.type == "device"
    kv = kvstore.create("local")
    assert Trainer(model.parameters(), "sgd", kvstore=kv, update_on_kvstore=True).kvstore is kv


def test_optimizer_argument() -> None:
    """An Optimizer object is used as is, its rescale_grad the scale; with optimizer_params it is refused."""
    model = make_model()
    opt = kvopt.create("sgd", learning_rate=0.1, rescale_grad=4.0)
    trainer = Trainer(model.parameters(), opt)
    assert trainer.optimizer is opt
    trainer.step(2, ignore_stale_grad=True)
    assert opt.rescale_grad == 2.0
    with pytest.raises(ValueError, match="optimizer_params"):
        Trainer(model.parameters(), opt, {"learning_rate": 0.1})
    assert isinstance(Trainer(model.parameters(), "adam", {"learning_rate": 0.1}).optimizer, kvopt.Optimizer)


def test_bad_batch_size_is_refused() -> None:
    """step(0) raises ValueError."""
    with pytest.raises(ValueError, match="batch_size"):
        Trainer(make_model().parameters(), "sgd").step(0)


def test_allreduce_and_update_need_local_updates() -> None:
    """allreduce_grads and update raise RuntimeError (naming the fix) when the store runs the optimizer."""
    trainer = Trainer(make_model().parameters(), "sgd", update_on_kvstore=True)
    with pytest.raises(RuntimeError, match="update_on_kvstore=False"):
        trainer.allreduce_grads()
    with pytest.raises(RuntimeError, match="update_on_kvstore=False"):
        trainer.update(1)


@pytest.mark.parametrize("uok", [True, False])
def test_learning_rate(uok: bool) -> None:
    """learning_rate reads the optimizer in effect; set_learning_rate changes the next steps."""
    rows = batches(4)
    changed, ref = make_model(), make_model()
    trainer = Trainer(changed.parameters(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=uok)
    assert trainer.learning_rate == 0.1
    run(changed, trainer.step, rows[:2])
    trainer.set_learning_rate(0.02)
    assert trainer.learning_rate == 0.02
    if uok:
        assert trainer.kvstore.get_optimizer().learning_rate == 0.02
    run(changed, trainer.step, rows[2:])
    t_ref = Trainer(ref.parameters(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=not uok)
    run(ref, t_ref.step, rows[:2])
    t_ref.set_learning_rate(0.02)
    run(ref, t_ref.step, rows[2:])
    assert_equal(changed, ref)


@pytest.mark.parametrize("uok", [True, False])
def test_learning_rate_follows_a_scheduler_and_cannot_be_set(uok: bool) -> None:
    """With an lr_scheduler, learning_rate follows it and set_learning_rate raises OptimizerError."""
    model = make_model()
    params = {"learning_rate": 0.1, "lr_scheduler": FactorScheduler(step=2, factor=0.5)}
    trainer = Trainer(model.parameters(), "sgd", params, update_on_kvstore=uok)
    run(model, trainer.step, batches(5))
    assert trainer.learning_rate == pytest.approx(0.025)  # decayed after updates 2 and 4
    with pytest.raises(OptimizerError, match="lr_scheduler"):
        trainer.set_learning_rate(0.5)
    assert trainer.learning_rate == pytest.approx(0.025)


# -- checkpoints ------------------------------------------------------------------------------------

@pytest.mark.parametrize("uok", [True, False])
@pytest.mark.parametrize("name,params", [("sgd", SGD), ("adam", {"learning_rate": 0.01, "wd": 1e-4})])
def test_save_and_load_states_resume_exactly(tmp_path: Path, name: str, params: dict, uok: bool) -> None:
    """Train k, save, load into a new Trainer on a copy of the model, train k more == 2k unbroken, exactly."""
    rows = batches(8)
    unbroken = make_model()
    run(unbroken, Trainer(unbroken.parameters(), name, params, update_on_kvstore=uok).step, rows)

    first = make_model()
    trainer = Trainer(first.named_parameters(), name, params, update_on_kvstore=uok, key_prefix="net")
    run(first, trainer.step, rows[:4])
    trainer.save_states(tmp_path / "trainer.states")
    resumed = copy.deepcopy(first)
    again = Trainer(resumed.named_parameters(), name, params, update_on_kvstore=uok, key_prefix="net")
    again.load_states(tmp_path / "trainer.states")
    run(resumed, again.step, rows[4:])
    assert_equal(resumed, unbroken)


@pytest.mark.parametrize("uok", [True, False])
def test_load_states_needs_the_same_keys(tmp_path: Path, uok: bool) -> None:
    """States saved under one key prefix do not load into a Trainer with another prefix."""
    model = make_model()
    trainer = Trainer(model.parameters(), "adam", update_on_kvstore=uok, key_prefix="saved")
    run(model, trainer.step, batches(1))
    trainer.save_states(tmp_path / "s")
    other = Trainer(copy.deepcopy(model).parameters(), "adam", update_on_kvstore=uok, key_prefix="other")
    with pytest.raises(KeyNotInitializedError, match="saved/0"):
        other.load_states(tmp_path / "s")


# -- the overlap's buckets (kvstore.overlap, issue 24) ------------------------------------------------
def test_buckets_group_parameters_in_backward_order_up_to_the_size() -> None:
    """Buckets fill from the last parameter until they hold the size (DDP's rule); 0: one per parameter."""
    from kvstore.overlap import make_buckets

    assert make_buckets([4096, 64, 640, 40], 700) == [[3, 2, 1], [0]]
    assert make_buckets([4096, 64, 640, 40], 600) == [[3, 2], [1, 0]]
    assert make_buckets([10, 10, 10], 1 << 20) == [[2, 1, 0]]
    assert make_buckets([10, 5000, 10], 100) == [[2, 1], [0]]
    assert make_buckets([10, 10, 10], 0) == [[2], [1], [0]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        make_buckets([10], -1)


def test_overlap_gives_the_first_layers_buckets_the_highest_priority() -> None:
    """The hooks send each bucket's pushpull at minus its first parameter's index: backward sends the
    last layers first at the lowest priority, and the first layer's bucket at the highest (0)."""
    from kvstore.local import LocalKVStore
    from kvstore.overlap import bucket_priority

    class Recording(LocalKVStore):
        def __init__(self) -> None:
            super().__init__("local")
            self.priorities: list[tuple[list, int]] = []

        def _pushpull_begin(self, keys, values, outs, priority=0):
            self.priorities.append((list(keys), priority))
            return super()._pushpull_begin(keys, values, outs, priority)

    assert bucket_priority([3, 2, 1]) == -1 and bucket_priority([0]) == 0
    kv = Recording()
    model = make_model()
    trainer = Trainer(model.parameters(), "sgd", dict(SGD), kvstore=kv, update_on_kvstore=False,
                      overlap=True, bucket_bytes=0)
    run(model, trainer.step, batches(2))  # the first step takes the plain path; the second, the hooks
    trainer.close()
    assert [p for _, p in kv.priorities] == [-3, -2, -1, 0]
    assert kv.priorities[-1][0] == [trainer._keys[0]]


def test_overlap_is_on_by_default_only_where_it_keeps_todays_semantics() -> None:
    """A local store gets no hooks unless asked; overlap=True on one replica installs one per parameter."""
    model = make_model()
    assert Trainer(model.parameters(), "sgd", {"learning_rate": 0.1})._overlap is None
    trainer = Trainer(model.parameters(), "sgd", {"learning_rate": 0.1}, overlap=True)
    assert trainer._overlap.hooks == 4
    trainer.close()
    assert trainer._overlap.hooks == 0


def test_overlap_on_a_local_store_gives_the_plain_weights() -> None:
    """overlap=True on a local store (both update modes, with no_sync accumulation) ends bit for bit as
    the plain Trainer."""
    for uok in (False, True):
        plain, overlapped = make_model(), make_model()
        a = Trainer(plain.parameters(), "sgd", dict(SGD), update_on_kvstore=uok, overlap=False)
        b = Trainer(overlapped.parameters(), "sgd", dict(SGD), update_on_kvstore=uok, overlap=True,
                    bucket_bytes=700)
        run(plain, a.step, batches(5))
        run(overlapped, b.step, batches(5))
        assert b._overlap.early == 4 * len(b._overlap.buckets)
        assert_equal(plain, overlapped)


def _one_weight_step(trainer: Trainer, model: nn.Module) -> None:
    """One step of a loss whose gradient is 1 for the single weight."""
    model.weight.grad = None
    model(torch.ones(1, 1)).sum().backward()
    trainer.step(1)


@pytest.mark.parametrize("uok", [True, False])
def test_weights_loaded_after_training_started_are_the_next_steps_start(uok: bool) -> None:
    """load_state_dict between steps: the next step starts from the loaded weights, as MXNet's reset."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1}, kvstore="local",
                      update_on_kvstore=uok)
    _one_weight_step(trainer, model)
    _one_weight_step(trainer, model)
    assert model.weight.item() == pytest.approx(-0.2)
    model.load_state_dict({"weight": torch.zeros(1, 1)})
    _one_weight_step(trainer, model)
    assert model.weight.item() == pytest.approx(-0.1)
    _one_weight_step(trainer, model)
    assert model.weight.item() == pytest.approx(-0.2)


def test_states_saved_after_loaded_weights_keep_the_first_key_names(tmp_path: Path) -> None:
    """After weights were loaded, save_states and state_dict name the keys as before: a new Trainer
    with the same key_prefix loads them, and they carry the momentum of the steps since."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    params = {"learning_rate": 0.1, "momentum": 0.9}
    trainer = Trainer(model.named_parameters(), "sgd", params, kvstore="local", update_on_kvstore=True,
                      key_prefix="reload")
    _one_weight_step(trainer, model)
    model.load_state_dict({"weight": torch.zeros(1, 1)})
    _one_weight_step(trainer, model)
    trainer.save_states(tmp_path / "states")
    saved = trainer.state_dict()
    assert list(saved["states"]) == ["reload/weight"]
    momentum = saved["states"]["reload/weight"]["arrays"]
    other = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(other.weight)
    fresh = Trainer(other.named_parameters(), "sgd", params, kvstore="local", update_on_kvstore=True,
                    key_prefix="reload")
    fresh.load_states(tmp_path / "states")
    assert fresh.state_dict()["states"]["reload/weight"]["arrays"].keys() == momentum.keys()
    for name, array in momentum.items():
        assert torch.equal(fresh.state_dict()["states"]["reload/weight"]["arrays"][name], array)
    trainer.load_state_dict(saved)  # the store's keys now: the loaded weights' keys
    count = saved["states"]["reload/weight"]["count"]
    assert trainer.state_dict()["states"]["reload/weight"]["count"] == count


def test_weights_written_in_place_every_step_are_warned_about_once() -> None:
    """nn.Embedding(max_norm=...) renormalises its weight in place at every forward: with
    update_on_kvstore each step then re-creates the keys (state restarts, servers keep every copy);
    the Trainer warns once, naming the parameter, instead of doing so silently."""
    model = nn.Embedding(4, 2, max_norm=0.5)
    trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1}, kvstore="local",
                      update_on_kvstore=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            model.weight.grad = None
            (model(torch.tensor([0, 1])) * 10).sum().backward()
            trainer.step(1)
    texts = [str(w.message) for w in caught if "in place" in str(w.message)]
    assert len(texts) == 1 and "'weight'" in texts[0] and "update_on_kvstore=False" in texts[0]


def test_a_step_without_data_pushes_zeros_and_needs_updates_on_the_store():
    """step_without_data pushes a zero gradient for every parameter through the store (plain sgd: the
    weights stay) and leaves .grad alone; with local updates it raises RuntimeError."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 5.0)
    trainer = kvstore.Trainer([("p", param)], "sgd", {"learning_rate": 1.0}, kvstore="local",
                              update_on_kvstore=True)
    trainer.step_without_data()
    assert torch.equal(param.detach(), torch.ones(3)) and torch.equal(param.grad, torch.full((3,), 5.0))
    trainer.step(1)
    assert torch.equal(param.detach(), torch.full((3,), -4.0))
    local = kvstore.Trainer([("q", torch.nn.Parameter(torch.ones(3)))], "sgd", kvstore="local",
                            update_on_kvstore=False)
    with pytest.raises(RuntimeError, match="update_on_kvstore"):
        local.step_without_data()


@pytest.mark.parametrize(("rejoined_at", "at_start", "agrees"),
                         [(None, False, True), (3, False, False), (0, False, False), (0, True, True)])
def test_the_first_step_agreement_is_met_by_every_worker_in_at_the_job_s_start(
        rejoined_at: int | None, at_start: bool, agrees: bool) -> None:
    """The servers' rescale_grad is agreed (a collective that sets it) by a first worker and by one that
    joined before the job's first step (kv.joined_at_start); a worker that restarted or joined a running
    job reads the agreed value instead."""
    from kvstore.local import LocalKVStore
    from kvstore.trainer import ServerRescale

    class Store(LocalKVStore):
        def __init__(self) -> None:
            super().__init__("local")
            self.rejoined_at, self.joined_at_start = rejoined_at, at_start
            self.params: list[dict] = []

        def set_optimizer_params(self, **params: float) -> None:
            self.params.append(params)
            super().set_optimizer_params(**params)

    kv = Store()
    kv.set_optimizer(kvopt.create("sgd", learning_rate=0.1, rescale_grad=0.5))
    assert ServerRescale(kv).factor(0.25) == (1.0 if agrees else 0.5)
    assert kv.params == ([{"rescale_grad": 0.25}] if agrees else [])

"""kvstore.torch_optim and Trainer.state_dict on local stores (one process): the wrapper is the
torch optimizer's class, steps as torch does, schedulers and torch.save round trips work."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.torch_optim import _layout, _rebuild  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _steps(model, opt, n: int, sched=None) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=g)).square().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def test_wrapper_is_the_optimizers_class_and_steps_as_torch() -> None:
    """One process: the same weights as the bare optimizer; StepLR works; param_groups are shared."""
    bare, wrapped = _model(), _model()
    opt = kvstore.DistributedOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=0.01),
                                       named_parameters=wrapped.named_parameters(), kv="local")
    assert isinstance(opt, torch.optim.AdamW) and opt.op == "average" and opt.kvstore.type == "local"
    ref = torch.optim.AdamW(bare.parameters(), lr=0.01)
    _steps(bare, ref, 4, torch.optim.lr_scheduler.StepLR(ref, 1, 0.5))
    _steps(wrapped, opt, 4, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    for a, b in zip(bare.parameters(), wrapped.parameters()):
        assert torch.equal(a, b)


def test_step_hooks_run_once_even_after_load_state_dict() -> None:
    """A step pre-hook runs once per step, before and after load_state_dict."""
    model = _model()
    opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       kv="local")
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    _steps(model, opt, 1)
    opt.load_state_dict(opt.state_dict())
    _steps(model, opt, 1)
    assert calls == [1, 1]


def test_a_store_that_runs_an_optimizer_is_refused() -> None:
    """The first step raises ConfigError when the store would update the gradients it should sum."""
    kv = kvstore.create("local")
    kv.set_optimizer(kvstore.optimizer.create("sgd"))
    model = _model()
    opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kv=kv)
    with pytest.raises(ConfigError, match="only sums"):
        _steps(model, opt, 1)


def test_bad_arguments() -> None:
    """op, non-optimizers, parameters the optimizer lacks, integer parameters and double wraps raise."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="op"):
        kvstore.DistributedOptimizer(opt, kv="local", op="mean")
    with pytest.raises(TypeError):
        kvstore.DistributedOptimizer(object(), kv="local")
    with pytest.raises(ValueError, match="does not update"):
        kvstore.DistributedOptimizer(opt, named_parameters=[("x", torch.zeros(2, requires_grad=True))],
                                     kv="local")
    with pytest.raises(TypeError, match="float"):
        kvstore.DistributedOptimizer(torch.optim.SGD([torch.zeros(2, dtype=torch.bfloat16,
                                                                  requires_grad=True)], lr=1), kv="local")
    wrapped = kvstore.DistributedOptimizer(opt, kv="local")
    with pytest.raises(ValueError, match="already"):
        kvstore.DistributedOptimizer(wrapped, kv="local")


def test_broadcasts_without_a_cluster_do_nothing() -> None:
    """One process: the tensors and state stay as they are; a root_rank other than 0 raises."""
    model = _model()
    before = copy.deepcopy(model.state_dict())
    kvstore.broadcast_parameters(model.state_dict())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="root_rank"):
        kvstore.broadcast_parameters(model.state_dict(), root_rank=1)


def test_layout_is_json_and_rebuilds_the_state_dict() -> None:
    """The layout names every tensor with its dtype and shape, keeps step counts and hyper-parameters
    (tuples as tuples), and the rebuilt dict loads into a fresh optimizer."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    _steps(model, opt, 2)
    import json

    layout = json.loads(_layout(opt.state_dict()))
    assert layout["param_groups"][0]["betas"] == [0.8, 0.9]
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    rebuilt, names, tensors = _rebuild(layout, fresh.state_dict())
    assert rebuilt["param_groups"][0]["betas"] == (0.8, 0.9) and rebuilt["param_groups"][0]["lr"] == 0.01
    assert len(names) == len(tensors) == 2 * len(list(model.parameters())) + (
        len(list(model.parameters())) if torch.is_tensor(opt.state_dict()["state"][0]["step"]) else 0)
    fresh.load_state_dict(rebuilt)
    assert fresh.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("uok", [False, True])
def test_trainer_state_dict_round_trips_through_torch_save(tmp_path: Path, uok: bool) -> None:
    """Trainer.state_dict -> torch.save -> torch.load(weights_only) -> load_state_dict resumes to the
    unbroken run's weights exactly (local store: the optimizer runs in the store or in the Trainer)."""
    def trainer_for(model):
        return kvstore.Trainer(model.named_parameters(), "adamw", {"learning_rate": 0.01}, kvstore="local",
                               update_on_kvstore=uok, key_prefix="t")

    def steps(model, trainer, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(6, 4, generator=g)).square().sum().backward()
            trainer.step(6)

    model = _model()
    trainer = trainer_for(model)
    steps(model, trainer, 1)
    torch.save({"trainer": trainer.state_dict(), "model": model.state_dict()}, tmp_path / "ckpt.pt")
    steps(model, trainer, 2)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    other = trainer_for(resumed)
    other.load_state_dict(saved["trainer"])
    assert saved["trainer"]["optimizer"]["name"] == "adamw" and saved["trainer"]["num_update"] == 3
    steps(resumed, other, 2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())


def test_trainer_load_state_dict_refuses_other_dicts() -> None:
    """A dict that is not a Trainer state dict raises ValueError."""
    model = _model()
    trainer = kvstore.Trainer(model.parameters(), "sgd", kvstore="local", key_prefix="bad")
    with pytest.raises(ValueError, match="not a Trainer state dict"):
        trainer.load_state_dict({"state": {}})


def _pushpulls(kv) -> list[int]:
    """Counts the store's pushpull calls (the store is real: its method is wrapped)."""
    calls, real = [], kv.pushpull

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    kv.pushpull = counted
    return calls


def test_synchronize_then_step_inside_skip_synchronize_reduces_once() -> None:
    """Horovod's clipping pattern: synchronize(), clip, then step() inside skip_synchronize() reduces
    once; step() after synchronize() outside it warns and does not reduce again; step() inside it
    without synchronize() warns that nothing was reduced."""
    model = _model()
    kv = kvstore.create("local")
    opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kv=kv)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # the first step also agrees which gradients are sparse (one pushpull, once)
    opt.zero_grad()
    calls = _pushpulls(kv)
    model(torch.ones(2, 4)).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    with opt.skip_synchronize():
        opt.step()
    assert len(calls) == 1
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="reduced already"):
        opt.step()
    assert len(calls) == 2
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    with pytest.warns(UserWarning, match="not reduced"), opt.skip_synchronize():
        opt.step()
    assert len(calls) == 2
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()  # the plain step reduces again
    assert len(calls) == 3


def test_backward_passes_per_step_bounds_the_passes_between_steps() -> None:
    """The default allows one backward pass per step: a second raises, naming the parameter; with
    backward_passes_per_step=2 two passes accumulate (the gradients sum) and a third raises."""
    model = _model()
    opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), kv="local")
    assert opt.backward_passes_per_step == 1  # Horovod's default
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'2.bias' got a gradient from 2 backward passes"):
        model(torch.ones(2, 4)).sum().backward()
    other = _model()
    acc = kvstore.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), kv="local",
                                       backward_passes_per_step=2)
    assert acc.backward_passes_per_step == 2
    for _ in range(2):
        other(torch.ones(2, 4)).sum().backward()
    assert torch.equal(other[2].bias.grad, torch.full((2,), 4.0))  # 2 samples x 2 passes
    acc.step()
    acc.zero_grad()
    for _ in range(2):
        other(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=2"):
        other(torch.ones(2, 4)).sum().backward()
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        kvstore.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), kv="local",
                                     backward_passes_per_step=0)


def test_parameters_that_take_no_gradient_are_skipped() -> None:
    """A frozen float parameter and an integer one in the optimizer are skipped (as Horovod), not a
    TypeError: only the trainable one is reduced and stepped."""
    w = torch.ones(3, requires_grad=True)
    frozen = torch.ones(3, requires_grad=False)
    count = torch.zeros(2, dtype=torch.int64)
    opt = kvstore.DistributedOptimizer(torch.optim.SGD([w, frozen, count], lr=1.0), kv="local",
                                       named_parameters=[("w", w), ("frozen", frozen), ("count", count)])
    w.sum().backward()
    opt.step()
    assert w.tolist() == [0.0] * 3 and frozen.tolist() == [1.0] * 3 and count.tolist() == [0, 0]


def test_naming_only_some_parameters_is_an_error_naming_the_rest() -> None:
    """named_parameters that leaves trainable parameters out raises ValueError naming each by its
    param_groups index and shape, as Horovod does."""
    model = _model()
    named = list(model.named_parameters())[:2]
    with pytest.raises(ValueError, match=r"leaves 2 .*unnamed.*'0\.2 \(2, 3\)', '0\.3 \(2,\)'"):
        kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kv="local",
                                     named_parameters=named)


def test_zero_grad_between_backward_passes_starts_the_count_again() -> None:
    """backward(), zero_grad() (a skipped batch), backward(), step() is one pass per step: zero_grad
    discards the gradients, so it does not raise as if two passes had accumulated."""
    model = _model()
    opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kv="local")
    model(torch.ones(2, 4)).sum().backward()
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    model(torch.ones(2, 4)).sum().backward()
    opt.zero_grad(set_to_none=False)
    model(torch.ones(2, 4)).sum().backward()
    assert torch.equal(model[2].bias.grad, torch.full((2,), 2.0))


def test_a_parameter_skipped_as_frozen_that_gets_a_gradient_is_refused() -> None:
    """A parameter frozen when the optimizer was wrapped (skipped) and unfrozen later would be stepped
    on its local gradient, unreduced: step() raises RuntimeError naming it instead of diverging."""
    model = _model()
    model[0].requires_grad_(False)
    opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kv="local")
    model[0].requires_grad_(True)
    before = model[0].weight.detach().clone()
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'0\.0 \(3, 4\)'.*wrap"):
        opt.step()
    assert torch.equal(model[0].weight, before)


def test_sparse_adam_over_a_sparse_embedding_steps_as_torch() -> None:
    """One process: SparseAdam over nn.Embedding(sparse=True) wrapped takes torch's steps (its gradient
    goes through a row-sparse key and comes back sparse); sparse_as_dense hands SGD a dense one."""
    def table() -> torch.nn.Embedding:
        torch.manual_seed(0)
        return torch.nn.Embedding(50, 4, sparse=True)
    bare, wrapped, dense = table(), table(), table()
    ref = torch.optim.SparseAdam(bare.parameters(), lr=0.1)
    opt = kvstore.DistributedOptimizer(torch.optim.SparseAdam(wrapped.parameters(), lr=0.1), kv="local")
    sgd = kvstore.DistributedOptimizer(torch.optim.SGD(dense.parameters(), lr=0.1), kv="local",
                                       sparse_as_dense=True)
    for ids in ([1, 7, 7, 3], [3, 40, 2, 1]):
        for model, o in ((bare, ref), (wrapped, opt), (dense, sgd)):
            o.zero_grad()
            model(torch.tensor(ids)).square().sum().backward()
            o.step()
        assert wrapped.weight.grad.is_sparse and not dense.weight.grad.is_sparse
    assert torch.equal(bare.weight, wrapped.weight)


def test_compression_is_the_stores_and_local_refuses_it() -> None:
    """compression= sets the store's gradient compression, which a local store does not take (MXNet's
    rule): UnsupportedError; 'none' sets nothing."""
    from kvstore.errors import UnsupportedError

    with pytest.raises(UnsupportedError):
        kvstore.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), kv="local",
                                     compression="fp16")
    kv = kvstore.create("local")
    kvstore.DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), kv=kv, compression="none")
    assert kv.get_gradient_compression() is None

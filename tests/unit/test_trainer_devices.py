"""The Trainer over model replicas, one per device: on CPU always, on CUDA where there is a GPU.

Every replica trains on its slice of each batch; the step sums their gradients through
the store, and the result must match one model trained on the whole batch with the
'local' store (the non-device run).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from kvstore.data import split_and_load
from kvstore.trainer import Trainer
from tests.helpers import cuda_devices
from tests.unit.test_trainer import X, Y, assert_close, batches, make_model

OPTIMIZERS = {"sgd": {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3},
              "adam": {"learning_rate": 0.01, "wd": 1e-3}}


def replicas(devices: list[str], seed: int = 0) -> list[nn.Module]:
    """Copies of one model, one on each device."""
    model = make_model(seed)
    return [copy.deepcopy(model).to(d) for d in devices]


def train_replicated(models: list[nn.Module], trainer: Trainer, rows: list[torch.Tensor]) -> None:
    """Each replica takes its slice of every batch; one trainer step per batch."""
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    devices = [next(m.parameters()).device for m in models]
    for batch in rows:
        for m in models:
            m.zero_grad()
        for m, x, y in zip(models, split_and_load(X[batch], devices), split_and_load(Y[batch], devices)):
            loss_fn(m(x), y).backward()
        trainer.step(len(batch))


def train_single(name: str, rows: list[torch.Tensor], steps_before: int = 0) -> nn.Module:
    """The non-device reference: one CPU model, the whole batch, the 'local' store."""
    model = make_model()
    trainer = Trainer(model.parameters(), name, OPTIMIZERS[name], kvstore="local")
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for batch in rows:
        model.zero_grad()
        loss_fn(model(X[batch]), Y[batch]).backward()
        trainer.step(len(batch))
    return model


def assert_replicas_equal(models: list[nn.Module]) -> None:
    for other in models[1:]:
        for a, b in zip(models[0].parameters(), other.parameters()):
            assert torch.equal(a.cpu(), b.cpu()), (a.cpu() - b.cpu()).abs().max()


def _check(devices: list[str], store: str, name: str, uok: bool, atol: float) -> None:
    rows = batches(6)
    models = replicas(devices)
    trainer = Trainer([m.parameters() for m in models], name, OPTIMIZERS[name], kvstore=store,
                      update_on_kvstore=uok)
    train_replicated(models, trainer, rows)
    assert_replicas_equal(models)
    assert_close(models[0].cpu(), train_single(name, rows), atol=atol)


@pytest.mark.parametrize("uok", [True, False], ids=["update_on_kvstore", "update_per_device"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("store", ["device", "local"])
def test_cpu_replicas_match_one_model_on_the_whole_batch(store: str, name: str, uok: bool) -> None:
    """Two CPU replicas on a device (or local) store end with the non-device single-model weights."""
    _check(["cpu", "cpu"], store, name, uok, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("uok", [True, False], ids=["update_on_kvstore", "update_per_device"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_cuda_replicas_match_one_cpu_model(name: str, uok: bool) -> None:
    """Two replicas on CUDA with the device store (sum and update on the GPU) match the CPU run."""
    _check(cuda_devices(2), "device", name, uok, atol=1e-5)


def test_replicas_must_match() -> None:
    """Replicas with other names, shapes or a shared tensor are refused with ValueError."""
    a, b = make_model(), make_model()
    with pytest.raises(ValueError, match="same names"):
        Trainer([a.named_parameters(), list(b.named_parameters())[:2]], "sgd")
    with pytest.raises(ValueError, match="replicas must match"):
        Trainer([a.parameters(), nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).parameters()],
                "sgd")
    with pytest.raises(ValueError, match="same tensor"):
        Trainer([list(a.parameters()), list(a.parameters())], "sgd")


def test_first_use_copies_rank0_weights_into_every_replica() -> None:
    """At the first step every replica starts from the first replica's weights."""
    first, second = make_model(0), make_model(1)
    trainer = Trainer([first.parameters(), second.parameters()], "sgd", {"learning_rate": 0.0})
    train_replicated([first, second], trainer, batches(1))
    assert_replicas_equal([first, second])
    assert_replicas_equal([first, make_model(0)])  # lr 0: the first replica's weights, unchanged


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_per_device_states_save_and_load(tmp_path: Path, name: str) -> None:
    """Replicas updating locally save the first replica's state; a load gives every replica a copy."""
    rows = batches(6)
    models = replicas(["cpu", "cpu"])
    trainer = Trainer([m.parameters() for m in models], name, OPTIMIZERS[name], kvstore="device",
                      update_on_kvstore=False, key_prefix="t")
    train_replicated(models, trainer, rows[:3])
    trainer.save_states(tmp_path / "t.states")
    resumed = [copy.deepcopy(m) for m in models]
    train_replicated(models, trainer, rows[3:])

    again = Trainer([m.parameters() for m in resumed], name, OPTIMIZERS[name], kvstore="device",
                    update_on_kvstore=False, key_prefix="t")
    again.load_states(tmp_path / "t.states")
    train_replicated(resumed, again, rows[3:])
    assert_replicas_equal(resumed)
    for a, b in zip(models[0].parameters(), resumed[1].parameters()):
        assert torch.equal(a, b), (a - b).abs().max()


def _resume_matches_unbroken(tmp_path: Path, make_param) -> None:
    """sgd+momentum updating locally: 2 steps, save, load into a fresh Trainer, 2 more = 4 unbroken."""
    def trainer_for(weight: torch.Tensor) -> Trainer:
        return Trainer({"w": weight}, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore="local",
                       update_on_kvstore=False, key_prefix="r")

    def steps(trainer: Trainer, weight: torch.Tensor, first: int, last: int) -> None:
        for i in range(first, last):
            weight.grad = torch.full_like(weight, float(i + 1))
            trainer.step(1)

    unbroken = make_param()
    steps(trainer_for(unbroken), unbroken, 0, 4)
    broken = make_param()
    first = trainer_for(broken)
    steps(first, broken, 0, 2)
    first.save_states(tmp_path / "r.states")
    second = trainer_for(broken)
    second.load_states(tmp_path / "r.states")
    steps(second, broken, 2, 4)
    assert torch.equal(broken.detach().cpu(), unbroken.detach().cpu())


def test_load_states_then_step_on_a_non_contiguous_parameter(tmp_path: Path) -> None:
    """A transposed (non-contiguous) CPU parameter resumes from saved states and keeps training."""
    _resume_matches_unbroken(tmp_path, lambda: torch.arange(12.0).reshape(4, 3).t().requires_grad_())


@pytest.mark.cuda
def test_load_states_then_step_on_a_cuda_parameter(tmp_path: Path) -> None:
    """A CUDA parameter resumes from saved states (loaded onto its GPU) and keeps training."""
    device = cuda_devices(1)[0]
    _resume_matches_unbroken(tmp_path,
                             lambda: torch.arange(12.0, device=device).reshape(4, 3).requires_grad_())

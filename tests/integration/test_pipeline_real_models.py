"""Pipelines of real models (docs/pipeline.md, "Real models"): a tuple crossing a stage boundary, a skip
connection from stage 0 straight to the last stage, and a weight tied between the first and the last
stage, trained through a Trainer over the Pipeline: every stage's weights after 3 steps are one
process's (float64, 1e-12 relative), in 2 and 4 stages, with 1 and 2 replicas.  Also: the tied
places' gradients summed without a Trainer, ``scale_grads=False`` for a sum-reduced loss,
``return_outputs``, and a boundary that changes form between steps named as a ShapeMismatchError.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import RemoteError, ShapeMismatchError  # noqa: E402
from kvstore.pipeline import LayerSpec, Pipeline, Save, Take, Tied  # noqa: E402
from kvstore.pipeline.layers import build  # noqa: E402
from kvstore.pipeline.schedule import held_bound  # noqa: E402

STEPS, BATCH, WIDTH, SEED = 3, 12, 6, 7
FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "20"}


class Split(torch.nn.Module):
    """One tensor in, a tuple of two out: (tanh(Linear(x)), 2 x)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.linear(x)), 2 * x


class Merge(torch.nn.Module):
    """The tuple (a, b) in, one tensor out: Linear(a) + b."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        return self.linear(a) + b


def transposed(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The tied projection's second place: x times the shared weight (not its transpose)."""
    return x @ module.weight


def layers() -> list:
    """8 layers: a tied projection, a skip kept, a tuple made and used, the skip used, the tied
    projection again."""
    tied = LayerSpec(torch.nn.Linear, WIDTH, WIDTH, bias=False, dtype=torch.float64)
    return [Tied("proj", tied), Save("skip"), LayerSpec(Split), LayerSpec(Merge), LayerSpec(torch.nn.Tanh),
            Take("skip"), LayerSpec(torch.nn.Linear, WIDTH, WIDTH, dtype=torch.float64),
            Tied("proj", tied, forward=transposed)]


# stages -> balance: 4 stages put the skip's Save on stage 0 and its Take on stage 3, the tuple between
# stages 1 and 2; 2 stages put the tuple between stages 0 and 1.  The tied places: stage 0 and the last.
BALANCE = {2: [3, 5], 4: [2, 1, 2, 3], 6: [2, 1, 1, 1, 1, 2]}


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64),
             torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64)) for _ in range(STEPS)]


def reference() -> dict[str, np.ndarray]:
    """One process, whole batches, a Trainer over the 'local' store: the final state."""
    from kvstore.trainer import Trainer

    model = build(layers(), seed=SEED)
    assert model[0].module is model[7].module  # one module, two places
    trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                      kvstore="local", key_prefix="ref-real")
    for x, y in data():
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        trainer.step(1)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def trained(kv, stages: int, schedule: str, update_on_kvstore: bool, virtual: int = 1) -> dict:
    """This rank's stage trained through a Trainer on its replica's share of each batch: its state."""
    from kvstore.trainer import Trainer

    pipe = Pipeline(layers(), stages=stages, balance=BALANCE[stages * virtual], kv=kv, chunks=3,
                    schedule=schedule, seed=SEED, virtual=virtual)
    trainer = Trainer(pipe, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                      update_on_kvstore=update_on_kvstore, key_prefix=f"real-{stages}-{schedule}")
    share = BATCH // pipe.replicas
    part = slice(pipe.replica * share, (pipe.replica + 1) * share)
    try:
        for x, y in data():
            pipe.module.zero_grad()
            pipe.step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None,
                      torch.nn.functional.mse_loss)
            trainer.step(pipe.replicas)
    finally:
        pipe.close()
    bound = held_bound(schedule, stages, 3, pipe.stage, virtual)
    return {"state": {k: v.detach().numpy().copy() for k, v in pipe.state_dict().items()},
            "workers": pipe.key_workers(), "held": (pipe.max_held, bound)}


CASES = [  # (workers, stages, schedule, update_on_kvstore, virtual)
    (2, 2, "1f1b", True, 1),
    (4, 4, "1f1b", False, 1),
    (4, 2, "gpipe", True, 1),
    (2, 2, "interleaved", False, 2),  # parts 0, 2 on stage 0: the tuple goes from stage 1 back to stage 0
    (2, 2, "interleaved", True, 3),  # 6 parts, M = 3: the skip joins parts 0 and 4, both on stage 0
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("workers,stages,schedule,uok,virtual", CASES,
                         ids=[f"{c[1]}stages-x{c[0] // c[1]}-{c[2]}" for c in CASES])
def test_tuples_skips_and_tied_weights_match_one_process(make_cluster, workers, stages, schedule,
                                                         uok, virtual) -> None:
    """A tuple boundary, a skip across stages and a tied weight: each stage's weights after 3 steps are
    one process's within 1e-12 (the tied places equal, their key in a set of the stages holding them)."""
    expected = reference()
    cluster = make_cluster(num_workers=workers, **FAST)
    parts = cluster.run(lambda kv: trained(kv, stages, schedule, uok, virtual))
    merged: dict[str, np.ndarray] = {}
    for rank, part in enumerate(parts):
        assert part["held"][0] == part["held"][1], part["held"]  # the schedule's activation bound, reached
        for name, value in part["state"].items():
            if name in merged:  # another replica of the stage
                np.testing.assert_array_equal(value, merged[name])
            merged[name] = value
        tied = part["workers"].get("0.module.weight")
        if rank % stages in (0, stages - 1):  # the stages that hold a place: one key, in their set
            assert tied == sorted(r for r in range(workers) if r % stages in (0, stages - 1)), part["workers"]
        else:
            assert tied is None
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(merged[name], value, rtol=1e-12, atol=0, err_msg=name)
    np.testing.assert_array_equal(merged["0.module.weight"], merged["7.module.weight"])


@pytest.mark.timeout(90)
def test_tied_gradients_without_a_trainer_sum_losses_and_outputs(make_cluster) -> None:
    """Without a Trainer, ``sum_tied_grads`` makes each tied place's gradient the sum of both places';
    ``scale_grads=False`` with a sum-reduced loss gives the batch sum's gradients, and
    ``return_outputs`` the whole batch's outputs, as one process computes them."""
    x, y = data()[0]
    model = build(layers(), seed=SEED)
    out = model(x)
    loss = torch.nn.functional.mse_loss(out, y, reduction="sum")
    loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        pipe = Pipeline(layers(), stages=2, balance=BALANCE[2], kv=kv, chunks=4, seed=SEED)
        try:
            got, outputs = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None,
                                     lambda o, t: torch.nn.functional.mse_loss(o, t, reduction="sum"),
                                     scale_grads=False, return_outputs=True)
            pipe.sum_tied_grads()
            return got, outputs, {name: p.grad.clone() for name, p in pipe.named_parameters()}
        finally:
            pipe.close()

    (none, no_out, first), (got, outputs, last) = cluster.run(run)
    assert none is None and no_out is None
    assert got == pytest.approx(float(loss.detach()), rel=1e-12)
    torch.testing.assert_close(outputs, out.detach(), rtol=1e-12, atol=0)
    grads = {**first, **last}
    torch.testing.assert_close(first["0.module.weight"], last["0.module.weight"], rtol=0, atol=0)
    assert sorted(grads) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-15, msg=name)


class Shifty(torch.nn.Module):
    """A layer whose output is a tuple at the first step and a tensor after it (a bug to be named)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> object:
        self.calls += 1
        out = self.linear(x)
        return (out, out + 1) if self.calls <= 2 else out


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2, dtype=torch.float64)

    def forward(self, value: object) -> torch.Tensor:
        return self.linear(value[0] + value[1] if isinstance(value, tuple) else value)


@pytest.mark.timeout(60)
def test_a_boundary_that_changes_form_is_a_shape_error_naming_both_stages(make_cluster) -> None:
    """A stage whose boundary was two tensors at the first step and is one at the second: the next stage
    raises ShapeMismatchError naming both stages and what it expected; the sender is told (RemoteError)."""
    cluster = make_cluster(num_workers=2, **FAST)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)

    def run(kv):
        pipe = Pipeline([LayerSpec(Shifty), LayerSpec(Pair)], stages=2, kv=kv, chunks=2)
        try:
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
        except Exception as exc:  # noqa: BLE001 - the test inspects which error each stage raised
            return exc
        finally:
            pipe.close()
        return None

    first, last = cluster.run(run)
    assert isinstance(last, ShapeMismatchError), last
    assert "stage 1 (worker 1) received from stage 0 (worker 0)" in str(last), last
    assert "expects 2 tensor(s)" in str(last), last
    assert isinstance(first, RemoteError) and "stage 1 (worker 1)" in str(first), first

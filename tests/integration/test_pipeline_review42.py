"""Reproducers from the hostile review of the real-model pipeline runtime (issues 42 items 1/4, 47
items 1/2), each failing before its fix: tied keys in opposite orders on two stages (init and calls per
run), a tuple boundary wider than a message may be, a skip that is a view of the caller's x, and two
Pipelines summing tied gradients on one store.  Small float64 models on in-process workers of a real
cluster.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import ConfigError  # noqa: E402
from kvstore.pipeline import LayerSpec, Pipeline, Save, Take, Tied  # noqa: E402
from kvstore.pipeline.layers import build  # noqa: E402

WIDTH, BATCH, SEED = 4, 6, 3
FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "8"}


def _linear(bias: bool = True) -> LayerSpec:
    return LayerSpec(torch.nn.Linear, WIDTH, WIDTH, bias=bias, dtype=torch.float64)


def _transposed(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


def _nested_tied() -> list:
    """Two tied modules nested: a, b on stage 0, then b, a on stage 1 (their keys in opposite orders)."""
    return [Tied("a", _linear(False)), Tied("b", _linear(False)), LayerSpec(torch.nn.Tanh),
            _linear(), Tied("b", _linear(False), forward=_transposed),
            Tied("a", _linear(False), forward=_transposed)]


def _batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64),
             torch.randn(BATCH, WIDTH, generator=gen, dtype=torch.float64)) for _ in range(steps)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("uok", [False, True], ids=["local-update", "update-on-kvstore"])
def test_two_tied_modules_in_opposite_orders_train_as_one_process(make_cluster, uok) -> None:
    """Two tied modules whose places nest (a, b ... b, a) over 2 stages train through a Trainer to one
    process's weights (1e-12): the stages name the tied keys in opposite orders."""
    _train_nested(make_cluster, uok)


def _train_nested(make_cluster, uok: bool) -> None:
    """Train _nested_tied over 2 stages through a Trainer; assert each stage's weights are one process's."""
    from kvstore.trainer import Trainer

    model = build(_nested_tied(), seed=SEED)
    ref = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1}, kvstore="local",
                  key_prefix="rev42-ref-nested")
    for x, y in _batches():
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        ref.step(1)
    expected = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        pipe = Pipeline(_nested_tied(), stages=2, balance=[3, 3], kv=kv, chunks=2, seed=SEED)
        trainer = Trainer(pipe, "sgd", {"learning_rate": 0.1}, update_on_kvstore=uok,
                          key_prefix=f"rev42-nested-{uok}")
        try:
            for x, y in _batches():
                pipe.module.zero_grad()
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None,
                          torch.nn.functional.mse_loss)
                trainer.step(1)
            return {k: v.detach().numpy().copy() for k, v in pipe.state_dict().items()}
        finally:
            pipe.close()

    merged: dict[str, np.ndarray] = {}
    for part in cluster.run(run):
        merged.update(part)
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(merged[name], value, rtol=1e-12, atol=0, err_msg=name)


@pytest.mark.timeout(90)
def test_tied_keys_in_opposite_orders_in_separate_runs_do_not_deadlock(make_cluster, monkeypatch) -> None:
    """With every key a store call of its own (CALL_BYTES made tiny, as a model of 64 MB tied tensors
    is), the nested tied modules still train to one process's weights: no two stages wait for each
    other's calls in opposite orders."""
    import kvstore.trainer

    monkeypatch.setattr(kvstore.trainer, "CALL_BYTES", 1)
    _train_nested(make_cluster, False)


class Many(torch.nn.Module):
    """One tensor in, a tuple of 300 tensors out (each a scaled copy)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x * (i + 1) for i in range(300))


class Gather(torch.nn.Module):
    """The tuple of 300 tensors in, their sum out."""

    def forward(self, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.stack(xs).sum(0)


@pytest.mark.timeout(60)
def test_a_tuple_boundary_of_300_tensors_trains_or_is_refused_clearly(make_cluster) -> None:
    """A boundary tuple of 300 tensors either crosses the stages (the loss is one process's) or the
    sending stage raises ConfigError at once; never a DeadlineExceededError on the receiver."""
    x, y = _batches(1)[0]
    expected = float(torch.nn.functional.mse_loss(Gather()(Many()(x)), y))
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        pipe = Pipeline([LayerSpec(Many), LayerSpec(Gather)], stages=2, kv=kv, chunks=1)
        try:
            return pipe.step(x if pipe.is_first else None, y if pipe.is_last else None,
                             torch.nn.functional.mse_loss)
        except Exception as exc:  # noqa: BLE001 - the test inspects which error each stage raised
            return exc
        finally:
            pipe.close()

    first, last = cluster.run(run)
    if isinstance(first, ConfigError):
        return
    assert first is None, first
    assert last == pytest.approx(expected, rel=1e-12), last


class Double(torch.nn.Module):
    """2 x (a fresh tensor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


@pytest.mark.timeout(90)
def test_predict_skip_of_the_input_is_not_changed_by_the_callers_later_write(make_cluster) -> None:
    """The first stage keeps its input x as a skip for the last (Save at layer 0): once its predict has
    returned, the caller overwriting x does not change the last stage's outputs (3 x as it was)."""
    import threading

    chunks, rows, width = 16, 64, 4096  # 2 MiB float64 per micro-batch: more than the socket buffers hold
    x = torch.randn(chunks * rows, width, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    expected = 3 * x
    written = threading.Event()
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        pipe = Pipeline([Save("s"), LayerSpec(Double), Take("s")], stages=2, balance=[2, 1], kv=kv,
                        chunks=chunks)
        try:
            if pipe.is_first:
                pipe.predict(x)
                x.zero_()  # the caller reuses its buffer for the next batch
                written.set()
                return None
            assert written.wait(60), "stage 0 did not return"
            return pipe.predict(None)
        finally:
            pipe.close()

    _, got = cluster.run(run)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _tied_pair() -> list:
    """A projection tied between the first layer and the last (2 stages: one place on each)."""
    return [Tied("t", _linear(False)), LayerSpec(torch.nn.Tanh), _linear(), Tied("t", _linear(False),
                                                                               forward=_transposed)]


@pytest.mark.timeout(90)
def test_a_second_pipeline_on_the_same_store_sums_its_tied_gradients(make_cluster) -> None:
    """A Pipeline made after another one was closed (same store, same model) sums its tied places'
    gradients as the first did: both places end with the same gradient."""
    x, y = _batches(1)[0]
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        grads = []
        for _ in range(2):
            pipe = Pipeline(_tied_pair(), stages=2, balance=[2, 2], kv=kv, chunks=2, seed=SEED)
            try:
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None,
                          torch.nn.functional.mse_loss)
                pipe.sum_tied_grads()
                grads.append(dict(pipe.named_parameters())["0.module.weight"].grad.clone())
            finally:
                pipe.close()
        return grads

    first, last = cluster.run(run)
    for a, b in zip(first, last):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

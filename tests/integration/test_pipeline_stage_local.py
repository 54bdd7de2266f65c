"""Stage-local pipelines (docs/pipeline.md, "Stage-local models"): each rank builds, holds and moves only
its stage.

A model described by layer factories (``LayerSpec``) or built on the ``meta`` device is materialised
per stage under per-layer seeds, so one process building the whole model (``layers.build``) is the
reference; a built ``nn.Sequential`` keeps only the stage's layers.  A Trainer over the Pipeline keeps
only the stage's keys, in the stage's worker set: weights after 3 steps equal one process's (float64,
1e-12), and the bytes a rank pushes per step are its stage's parameter bytes.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.pipeline import LayerSpec, Pipeline, load_state_dict  # noqa: E402
from kvstore.pipeline.layers import build  # noqa: E402

STEPS, BATCH = 3, 12
WIDTHS = (6, 10, 8, 8, 3)
FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "20"}
SEED = 5


def specs(dtype: torch.dtype = torch.float64, record: list[int] | None = None) -> list[LayerSpec]:
    """The MLP of test_pipeline.py as layer factories (``record`` collects the index of each Linear layer
    built for real, not on the meta device)."""
    def linear(index: int, a: int, b: int) -> torch.nn.Module:
        if record is not None and not torch.empty(0).is_meta:
            record.append(index)
        return torch.nn.Linear(a, b, dtype=dtype)

    out: list[LayerSpec] = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        out.append(LayerSpec(linear, len(out), a, b))
        if i < len(WIDTHS) - 2:
            out.append(LayerSpec(torch.nn.Tanh))
    return out


def meta_model(dtype: torch.dtype = torch.float64) -> torch.nn.Sequential:
    """The same MLP built on the meta device (no memory until a stage materialises its layers)."""
    with torch.device("meta"):
        return build(specs(dtype))  # build on meta: the factories run, nothing is allocated


def built_model(dtype: torch.dtype = torch.float64) -> torch.nn.Sequential:
    """The same MLP, built with real weights in this process (every rank passes a copy)."""
    return build(specs(dtype), seed=SEED)


def data(dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=gen, dtype=dtype),
             torch.randn(BATCH, 3, generator=gen, dtype=dtype)) for _ in range(STEPS)]


def reference() -> tuple[dict[str, np.ndarray], torch.nn.Sequential]:
    """One process, whole batches, a Trainer over the 'local' store (sgd with momentum), on the model the
    per-layer seeds build; its final weights and model."""
    from kvstore.trainer import Trainer

    model = build(specs(), seed=SEED)
    trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                      kvstore="local", key_prefix="ref-stage-local")
    for x, y in data():
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        trainer.step(1)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, model


def source(kind: str, record: list[int] | None = None):
    return {"spec": lambda: specs(record=record), "meta": meta_model, "sequential": built_model}[kind]()


def trained(kv, stages: int, kind: str, schedule: str, update_on_kvstore: bool) -> dict:
    """This rank's stage trained for STEPS steps through a Trainer on its replica's share of each batch:
    its state, what it built, the bytes it pushed in its last Trainer step, its stage's parameter bytes."""
    from kvstore.trainer import Trainer

    built: list[int] = []
    pipe = Pipeline(source(kind, built), stages=stages, kv=kv, chunks=3, schedule=schedule, seed=SEED)
    trainer = Trainer(pipe, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                      update_on_kvstore=update_on_kvstore, key_prefix=f"sl-{stages}-{kind}-{schedule}")
    share = BATCH // pipe.replicas
    part = slice(pipe.replica * share, (pipe.replica + 1) * share)
    pushed = 0
    try:
        for x, y in data():
            pipe.module.zero_grad()
            pipe.step(x[part] if pipe.is_first else None, y[part] if pipe.is_last else None,
                      torch.nn.functional.mse_loss)
            before = kv.stats()["bytes_out"]
            trainer.step(pipe.replicas)
            pushed = kv.stats()["bytes_out"] - before
    finally:
        pipe.close()
    grads = [p.grad for p in pipe.parameters()]
    return {"state": {k: v.detach().numpy().copy() for k, v in pipe.state_dict().items()},
            "built": built, "pushed": pushed, "stage": pipe.stage, "offset": pipe.offset,
            "end": pipe.offset + pipe.balance[pipe.stage],
            "bytes": sum(p.numel() * p.element_size() for p in pipe.parameters()),
            "names": [n for n, _ in pipe.named_parameters()], "grads": all(g is not None for g in grads)}


CASES = [  # (workers, stages, build, schedule, update_on_kvstore)
    (2, 2, "sequential", "gpipe", False),
    (4, 2, "spec", "1f1b", True),
    (4, 4, "meta", "gpipe", True),
    (8, 4, "spec", "1f1b", False),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,stages,kind,schedule,uok", CASES,
                         ids=[f"{c[1]}stages-x{c[0] // c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_stage_local_training_matches_one_process(make_cluster, workers, stages, kind, schedule, uok) -> None:
    """Each rank builds only its stage's layers and pushes only its stage's bytes; the stages' weights
    after 3 steps through a Trainer (worker set per stage) are one process's within 1e-12."""
    expected, _ = reference()
    cluster = make_cluster(num_workers=workers, **FAST)
    parts = cluster.run(lambda kv: trained(kv, stages, kind, schedule, uok))
    merged: dict[str, np.ndarray] = {}
    for rank, part in enumerate(parts):
        assert part["stage"] == rank % stages
        if kind == "spec":  # the factories of the stage's Linear layers (even indices), and no other, ran
            assert part["built"] == list(range(part["offset"] + part["offset"] % 2, part["end"], 2)), part
        assert part["grads"]
        assert part["pushed"] == part["bytes"], (rank, part["pushed"], part["bytes"])
        for name, value in part["state"].items():
            assert name in expected, name
            assert int(name.split(".")[0]) >= part["offset"]
            if name in merged:  # another replica of the stage: the same weights
                np.testing.assert_array_equal(value, merged[name])
            merged[name] = value
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(merged[name], value, rtol=1e-12, atol=0, err_msg=name)
    total = sum(v.nbytes for v in expected.values())
    assert max(p["pushed"] for p in parts) < total  # a stage pushes its own share, not the whole model's


@pytest.mark.timeout(90)
def test_a_sequential_keeps_only_its_stage_and_a_checkpoint_and_predict_are_one_process(
        make_cluster, tmp_path) -> None:
    """From a built nn.Sequential a rank keeps its stage's layers and moves the others to meta (no
    foreign parameter, no foreign .grad); ``save`` writes one part per stage whose union is the whole
    model's state (``load_state_dict``), ``load`` restores a stage, and ``predict`` (forward only, no
    graph) returns one process's outputs on the last stage."""
    _, model = reference()
    x_test = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected_out = model(x_test)
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        mine = copy.deepcopy(model)
        pipe = Pipeline(mine, stages=2, kv=kv, chunks=4)
        try:
            foreign = [p for i, layer in enumerate(mine) for p in layer.parameters()
                       if not pipe.offset <= i < pipe.offset + pipe.balance[pipe.stage]]
            assert foreign and all(p.is_meta for p in foreign)
            assert {id(p) for p in pipe.parameters()} == pipe.stage_parameters()
            out = pipe.predict(x_test if pipe.is_first else None)
            assert out is None or not out.requires_grad
            pipe.save(str(tmp_path / "ckpt"))
            saved = {k: v.clone() for k, v in pipe.state_dict().items()}
            with torch.no_grad():
                for p in pipe.parameters():
                    p.zero_()
            pipe.load(str(tmp_path / "ckpt"))
            for name, value in pipe.state_dict().items():
                assert torch.equal(value, saved[name]), name
            return out
        finally:
            pipe.close()

    first, last = cluster.run(run)
    assert first is None
    torch.testing.assert_close(last, expected_out, rtol=1e-12, atol=0)
    whole = load_state_dict(str(tmp_path / "ckpt"))
    assert sorted(whole) == sorted(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(whole[name], value), name


def test_layer_factories_and_meta_models_build_the_same_weights() -> None:
    """``build`` of factories and of a meta model under one seed give the same weights, another seed
    others; a meta layer nothing can initialise is a ConfigError naming it."""
    from kvstore.errors import ConfigError

    a, b = build(specs(), seed=SEED), build(meta_model(), seed=SEED)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert not torch.equal(build(specs(), seed=SEED + 1)[0].weight, a[0].weight)

    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        bare = torch.nn.Sequential(torch.nn.Linear(2, 3), Bare())
    with pytest.raises(ConfigError, match="no reset_parameters"):
        build(bare)


def _memory_run(*args: str) -> list[dict]:
    """benchmarks/pipeline_memory.py under launch.py -n 4 -s 2: each rank's JSON line."""
    import json

    from tests.helpers import finish, launch

    proc = launch(["-n", "4", "-s", "2", "benchmarks/pipeline_memory.py", *args], dict(os.environ))
    rc, output = finish(proc, timeout=500)
    assert rc == 0, output
    rows = [json.loads(line.split("] ", 1)[1]) for line in output.splitlines()
            if line.startswith("[worker") and '"peak_rss"' in line]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], output
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.pipemem
@pytest.mark.timeout(1200)
def test_a_model_bigger_than_any_worker_trains_in_four_stages() -> None:
    """4 stages of a 2.1 GB model (32 Linear(4096, 4096), LayerSpecs): every rank's peak RSS is below the
    model's parameter bytes and at most the empty-stage baseline + 4 x its stage's parameter bytes + its
    activations, and it pushes its stage's bytes per step (marked ``pipemem``: second tier)."""
    baseline = _memory_run("--width", "8")
    big = _memory_run()
    for empty, row in zip(baseline, big):
        assert row["peak_rss"] < row["model_bytes"], row
        bound = empty["peak_rss"] + 4 * row["stage_bytes"] + row["saved_bytes"]
        assert row["peak_rss"] <= bound, (row, empty["peak_rss"])
        assert row["pushed"] == row["stage_bytes"], row


@pytest.mark.timeout(60)
def test_a_trainer_over_a_stage_without_parameters_is_refused(make_cluster) -> None:
    """A Trainer over a stage that holds no trainable parameter (it would miss the others' collectives) is
    a ConfigError naming the stage; the stage with parameters gets its Trainer."""
    from kvstore.errors import ConfigError
    from kvstore.trainer import Trainer

    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        pipe = Pipeline([LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Tanh)], stages=2, kv=kv,
                        balance=[1, 1])
        try:
            if pipe.is_first:
                return Trainer(pipe, "sgd", {"learning_rate": 0.1}).kvstore is kv
            with pytest.raises(ConfigError, match=r"stage 1 \(worker 1\) holds no trainable parameter"):
                Trainer(pipe, "sgd", {"learning_rate": 0.1})
            return True
        finally:
            pipe.close()

    assert cluster.run(run) == [True, True]


def test_a_meta_transformer_layer_materialises_as_its_factory_builds_it() -> None:
    """A TransformerEncoderLayer built on meta gets its factory's weights: children are reset before
    their parent (attention's reset zeroes its output projection's bias after the projection's own)."""
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True))
    got = build(meta, seed=0)
    spec = LayerSpec(torch.nn.TransformerEncoderLayer, 8, 2, 16, dropout=0.0, batch_first=True)
    want = build([spec], seed=0)
    assert torch.count_nonzero(got[0].self_attn.out_proj.bias) == 0
    for name, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name


def test_a_layer_another_pipeline_released_is_refused_not_reinitialised() -> None:
    """A built layer released to meta (another Pipeline made from the same model object kept a different
    stage) is refused with a ConfigError when a Pipeline would build it, not drawn afresh; a layer built
    on meta on purpose is still materialised."""
    from kvstore.errors import ConfigError
    from kvstore.pipeline import layers

    model = built_model()
    layers.release(model[0])
    assert model[0].weight.is_meta
    with pytest.raises(ConfigError, match="released to the meta device by another Pipeline"):
        layers.materialise(model[0], 0, SEED)
    assert not layers.materialise(meta_model()[0], 0, SEED).weight.is_meta


@pytest.mark.timeout(60)
def test_optimizer_states_of_a_stage_trainer_are_refused_by_name(make_cluster, tmp_path) -> None:
    """A Trainer over a pipeline stage (its keys in the stage's worker set) refuses to save or load its
    optimizer states (each rank holds its own stage's keys only) with a ConfigError naming why."""
    from kvstore.errors import ConfigError
    from kvstore.trainer import Trainer

    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        pipe = Pipeline(specs(), stages=2, kv=kv, seed=SEED)
        try:
            trainer = Trainer(pipe, "sgd", {"learning_rate": 0.1}, key_prefix="states-refused")
            for call in (trainer.state_dict, lambda: trainer.save_states(str(tmp_path / f"s{kv.rank}"))):
                with pytest.raises(ConfigError, match="worker set"):
                    call()
            return True
        finally:
            pipe.close()

    assert cluster.run(run) == [True, True]

"""Pipeline parallelism over a real cluster: stages as in-process workers of a real scheduler/server.

Equivalence: a 4-layer MLP cut into stages ends with one process's weights after 3 steps
(float64 within 1e-12 relative, float32 within 1e-5), for 'gpipe' and '1f1b', with and
without checkpointing.  Failures: a shape mismatch names both stages and no stage hangs.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import NodeLostError, RemoteError, ShapeMismatchError  # noqa: E402
from kvstore.net.protocol import Op  # noqa: E402
from kvstore.pipeline import Pipeline  # noqa: E402

STEPS, BATCH = 3, 12
FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "20"}


def mlp(dtype: torch.dtype, widths: tuple[int, ...] = (6, 10, 8, 8, 3)) -> torch.nn.Sequential:
    """A seeded MLP of len(widths) - 1 Linear layers with Tanh between them."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.Tanh()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers).to(dtype)


def data(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS batches of (x, y)."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=gen, dtype=dtype),
             torch.randn(BATCH, 3, generator=gen, dtype=dtype)) for _ in range(STEPS)]


def one_process(dtype: torch.dtype) -> dict[str, np.ndarray]:
    """The reference: the whole model trained on whole batches in this process."""
    model = copy.deepcopy(MODELS[dtype])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data(dtype):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


MODELS = {dtype: mlp(dtype) for dtype in (torch.float64, torch.float32)}  # seeded once, not per thread


def pipelined(kv, dtype: torch.dtype, stages: int, **options) -> dict[str, np.ndarray]:
    """Train a copy of the MLP as stage kv.rank % stages; return the state of this stage's layers
    (and under "held", the most micro-batches whose activations it held at once)."""
    model = copy.deepcopy(MODELS[dtype])
    pipe = Pipeline(model, stages=stages, kv=kv, **options)
    try:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        for x, y in data(dtype):
            opt.zero_grad()
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
            opt.step()
    finally:
        pipe.close()
    mine = pipe.stage_parameters()
    state = {k: v.detach().numpy().copy() for (k, v) in model.state_dict().items()
             if id(dict(model.named_parameters())[k]) in mine}
    return {**state, "held": pipe.max_held}


def assert_same(parts: list[dict[str, np.ndarray]], reference: dict[str, np.ndarray], rtol: float) -> None:
    """Every layer's weights held by some stage match the reference, and every layer is held."""
    merged = {k: v for part in parts for k, v in part.items() if k != "held"}
    assert sorted(merged) == sorted(reference)
    for key, value in reference.items():
        np.testing.assert_allclose(merged[key], value, rtol=rtol, atol=0, err_msg=key)


CASES = [("gpipe", "never", torch.float64, 4), ("1f1b", "never", torch.float64, 4),
         ("gpipe", "always", torch.float64, 3), ("1f1b", "except_last", torch.float64, 5),
         ("1f1b", "always", torch.float32, 4), ("gpipe", "except_last", torch.float32, 1)]


@pytest.mark.timeout(90)
def test_two_stages_match_one_process(make_cluster) -> None:
    """2 stages x 1 replica: gpipe and 1f1b, every checkpoint mode, give one process's weights."""
    cluster = make_cluster(num_workers=2, **FAST)
    references = {dtype: one_process(dtype) for dtype in (torch.float64, torch.float32)}
    for schedule, checkpoint, dtype, chunks in CASES:
        parts = cluster.run(lambda kv, s=schedule, c=checkpoint, d=dtype, m=chunks: pipelined(
            kv, d, 2, chunks=m, schedule=s, checkpoint=c))
        assert all(parts), (schedule, checkpoint)
        assert_same(parts, references[dtype], 1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.timeout(90)
def test_fewer_micro_batches_than_stages(make_cluster) -> None:
    """3 stages, 2 micro-batches, 1f1b then gpipe: no hang, one process's weights; 1f1b holds <= K - i."""
    cluster = make_cluster(num_workers=3, **FAST)
    reference = one_process(torch.float64)
    for schedule in ("1f1b", "gpipe"):
        parts = cluster.run(lambda kv, s=schedule: pipelined(kv, torch.float64, 3, chunks=2, schedule=s,
                                                             balance=[2, 3, 2]))
        assert_same(parts, reference, 1e-12)
        held = [part["held"] for part in parts]
        assert held == ([2, 2, 1] if schedule == "1f1b" else [2, 2, 2]), (schedule, held)


@pytest.mark.timeout(60)
def test_a_shape_mismatch_names_both_stages(make_cluster) -> None:
    """A stage whose output does not fit the next stage's input: the receiver names both stages, the
    sender raises RemoteError (told, not left waiting)."""
    cluster = make_cluster(num_workers=2, **FAST)

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(8, 2)).double()

    def run(kv):
        model = copy.deepcopy(base)
        pipe = Pipeline(model, stages=2, kv=kv, chunks=2)
        x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        try:
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
        except Exception as exc:  # noqa: BLE001 - the test inspects which error each stage raised
            return exc
        finally:
            pipe.close()
        return None

    first, last = cluster.run(run)
    assert isinstance(last, ShapeMismatchError), last
    assert "stage 1 (worker 1) received from stage 0 (worker 0)" in str(last), last
    assert "(2, 7)" in str(last) and "(2, ..., 8)" in str(last), last
    assert isinstance(first, RemoteError) and "stage 1 (worker 1)" in str(first), first


@pytest.mark.timeout(60)
def test_a_lost_stage_is_named_to_every_other_stage(make_cluster) -> None:
    """The middle of 3 stages goes silent: both other stages raise NodeLostError naming it within the
    heartbeat timeout (+ 5 s), instead of waiting out KVSTORE_REQUEST_TIMEOUT."""
    cluster = make_cluster(num_workers=3, **FAST)
    x, y = data(torch.float64)[0]

    def run(kv):
        pipe = Pipeline(copy.deepcopy(MODELS[torch.float64]), stages=3, kv=kv, chunks=2, balance=[2, 3, 2])
        try:
            if pipe.stage == 1:
                kv._heartbeat.stop()  # as if its process froze: it sends nothing from now on
                return None
            started = time.monotonic()
            with pytest.raises(NodeLostError) as caught:
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None,
                          torch.nn.functional.mse_loss)
            return caught.value, time.monotonic() - started
        finally:
            pipe.close()

    first, middle, last = cluster.run(run)
    assert middle is None
    for error, elapsed in (first, last):
        assert (error.role, error.rank) == ("worker", 1), error
        assert "stage 1 (worker 1) is lost" in str(error), error
        assert elapsed < 3 + 5, elapsed


def trainer_reference(dtype: torch.dtype) -> dict[str, np.ndarray]:
    """One process, whole batches, a Trainer over the 'local' store (sgd with momentum)."""
    from kvstore.trainer import Trainer

    model = copy.deepcopy(MODELS[dtype])
    trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                      kvstore="local", key_prefix="ref")
    for x, y in data(dtype):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        trainer.step(1)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def hybrid(kv, dtype: torch.dtype, update_on_kvstore: bool, schedule: str,
           checkpoint: str) -> dict[str, np.ndarray]:
    """Stage kv.rank % 2 of replica kv.rank // 2, on that replica's half of each batch, through a Trainer;
    the stage's weights (the only ones this rank holds)."""
    from kvstore.trainer import Trainer

    model = copy.deepcopy(MODELS[dtype])
    pipe = Pipeline(model, stages=2, kv=kv, chunks=3, schedule=schedule, checkpoint=checkpoint)
    trainer = Trainer(pipe, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                      update_on_kvstore=update_on_kvstore, key_prefix=f"hybrid-{schedule}-{checkpoint}")
    half = slice(pipe.replica * BATCH // 2, (pipe.replica + 1) * BATCH // 2)
    try:
        for x, y in data(dtype):
            model.zero_grad()
            pipe.step(x[half] if pipe.is_first else None, y[half] if pipe.is_last else None,
                      torch.nn.functional.mse_loss)
            trainer.step(pipe.replicas)  # each replica's gradient is its half's mean: average the two
    finally:
        pipe.close()
    return {k: v.detach().numpy().copy() for k, v in pipe.state_dict().items()}


@pytest.mark.timeout(90)
def test_two_replicas_per_stage_through_a_trainer_match_one_process(make_cluster) -> None:
    """2 stages x 2 replicas (dist_sync): a Trainer over the Pipeline, optimizer on the servers or on the
    workers, gives each stage's replicas one process's weights for that stage."""
    cluster = make_cluster(num_workers=4, **FAST)
    references = {dtype: trainer_reference(dtype) for dtype in (torch.float64, torch.float32)}
    # workers' optimizer first: once set on the servers, an optimizer applies to every key's pushes
    cases = [(False, "gpipe", "never", torch.float64), (True, "1f1b", "except_last", torch.float64),
             (True, "gpipe", "always", torch.float32)]
    for uok, schedule, checkpoint, dtype in cases:
        reference = references[dtype]
        parts = cluster.run(lambda kv, u=uok, s=schedule, c=checkpoint, d=dtype: hybrid(kv, d, u, s, c))
        assert sorted({k for part in parts for k in part}) == sorted(reference)
        for rank, part in enumerate(parts):
            assert sorted(part) == sorted(parts[rank % 2])  # the stage's replicas hold the same keys
            for key, value in part.items():
                rtol = 1e-12 if dtype == torch.float64 else 1e-5
                np.testing.assert_allclose(value, reference[key], rtol=rtol, atol=0,
                                           err_msg=f"{key} {schedule} {checkpoint} {dtype}")


@pytest.mark.timeout(60)
def test_a_silent_neighbour_ends_in_a_deadline_naming_it(make_cluster) -> None:
    """A live stage that never steps: its neighbour raises DeadlineExceededError naming the stage and
    micro-batch it waited for after KVSTORE_REQUEST_TIMEOUT, and garbage sent to its socket meanwhile
    is dropped, not fatal."""
    from kvstore.errors import DeadlineExceededError
    from kvstore.net import transport

    cluster = make_cluster(num_workers=2, connect=False, **FAST)
    cluster.connect(request_timeout=2.0)
    x, _ = data(torch.float64)[0]

    def run(kv):
        pipe = Pipeline(copy.deepcopy(MODELS[torch.float64]), stages=2, kv=kv, chunks=2)
        try:
            if pipe.is_last:
                return None
            reply = kv.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": 0}, "own address")
            stranger = transport.connect_dealer(transport.address(*reply.body["address"]))
            transport.send(stranger, [b"not a mac", b"not a header"])
            try:
                with pytest.raises(DeadlineExceededError) as caught:
                    pipe.step(x, None, torch.nn.functional.mse_loss)
            finally:
                transport.close(stranger)
            return caught.value
        finally:
            pipe.close()

    error, nothing = cluster.run(run)
    assert nothing is None
    assert ("stage 0 (worker 0) waited 2 s for the gradient of micro-batch 0 from stage 1 (worker 1)"
            in str(error)), error


@pytest.mark.timeout(60)
def test_deferred_batch_norm_keeps_one_process_running_statistics(make_cluster) -> None:
    """deferred_batch_norm=True with 4 checkpointed micro-batches: the running mean and variance after 3
    steps are one process's over whole batches; plain batch norm's (per micro-batch) are not."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()
    whole = copy.deepcopy(base)
    for x, _ in data(torch.float64):
        whole(x)
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv, deferred: bool):
        model = copy.deepcopy(base)
        pipe = Pipeline(model, stages=2, kv=kv, chunks=4, schedule="1f1b", checkpoint="always",
                        balance=[2, 2], deferred_batch_norm=deferred)
        try:
            for x, y in data(torch.float64):
                pipe.step(x if pipe.is_first else None, y if pipe.is_last else None,
                          torch.nn.functional.mse_loss)
        finally:
            pipe.close()
        return model[0] if pipe.is_first else None

    for deferred in (True, False):
        norm, _ = cluster.run(lambda kv, d=deferred: run(kv, d))
        same = [np.allclose(getattr(norm, name).numpy(), getattr(whole[0], name).numpy(), rtol=1e-10, atol=0)
                for name in ("running_mean", "running_var")]
        assert same == [deferred, deferred], (deferred, norm.running_mean, whole[0].running_mean)
        assert int(norm.num_batches_tracked) == (3 if deferred else 3 * 4 * 2)  # plain: recomputed too


@pytest.mark.timeout(30)
def test_bad_arguments_are_config_errors() -> None:
    """A local store, a bad schedule, checkpoint or chunks: ConfigError naming it (balance and worker
    counts: tests/unit/test_pipeline_schedule.py)."""
    import kvstore
    from kvstore.errors import ConfigError

    model = copy.deepcopy(MODELS[torch.float64])
    with pytest.raises(ConfigError, match="dist store"):
        Pipeline(model, stages=1, kv=kvstore.create("local"))
    for options, names in (({"schedule": "zb"}, "'zb'"), ({"checkpoint": "sometimes"}, "'sometimes'"),
                           ({"chunks": 0}, "chunks")):
        with pytest.raises(ConfigError, match=names):
            Pipeline(model, stages=1, kv=kvstore.create("local"), **options)

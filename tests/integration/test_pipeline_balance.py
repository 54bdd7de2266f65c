"""Balance by measured cost on a real cluster (docs/pipeline.md, "Balance by measured cost"): worker 0
measures the layers, every worker gets its costs through the store, and a failed or overlong measurement
is told to every worker as a typed error."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import DeadlineExceededError, RemoteError  # noqa: E402
from kvstore.pipeline import LayerSpec, Pipeline, Save, Take  # noqa: E402
from kvstore.pipeline.profile import agreed_costs, choose  # noqa: E402

FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "20"}


def specs(record: list[int]) -> list[Any]:
    """A small model with a skip connection, as factories; ``record`` gets the index of each layer built
    for real (not on the meta device, where a Pipeline counts parameters)."""
    def linear(index: int, a: int, b: int) -> torch.nn.Module:
        if not torch.empty(0).is_meta:
            record.append(index)
        return torch.nn.Linear(a, b)

    return [LayerSpec(linear, 0, 16, 64), Save("s"), LayerSpec(linear, 2, 64, 64), LayerSpec(Take, "s"),
            LayerSpec(linear, 4, 64, 64), LayerSpec(linear, 5, 64, 4)]


def outcome(call) -> Any:
    """What ``call()`` returned, or its error's type name, message and the seconds it took to come."""
    start = time.monotonic()
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the error is the result under test
        return type(exc).__name__, str(exc), time.monotonic() - start


@pytest.mark.timeout(90)
def test_every_worker_gets_worker_0s_costs_and_only_worker_0_measures(make_cluster) -> None:
    """Worker 1 gets exactly worker 0's measured costs (time, then memory: a key per call) and the same cut,
    builds no layer, and needs no sample; a Pipeline made with balance='memory' cuts as choose does."""
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        built: list[int] = []
        entries = specs(built)
        sample = torch.randn(32, 16) if kv.rank == 0 else None
        times = agreed_costs(kv, entries, sample, "time", repeats=3)
        memory = agreed_costs(kv, entries, sample, "memory", optimizer_states=1)
        cut = choose("time", entries, 2, kv, sample, repeats=3)
        by_memory = choose("memory", entries, 2, kv, sample)
        pipe = Pipeline(specs([]), stages=2, balance="memory", sample=sample, kv=kv)  # measures again
        try:
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
        finally:
            pipe.close()
        return {"times": times, "memory": memory, "cut": cut, "built": built, "pipe": pipe.balance,
                "by_memory": by_memory}

    first, second = cluster.run(run)
    assert second["times"] == first["times"] and second["memory"] == first["memory"]
    assert second["cut"] == first["cut"] and sum(first["cut"]) == 6
    assert first["pipe"] == second["pipe"] == first["by_memory"]  # Pipeline(balance='memory', sample=x)
    assert len(first["times"]) == 6 and all(t > 0 for t in first["times"])
    linear = lambda a, b: (a * b + b) * 4 * 3  # noqa: E731 - float32 parameters, gradients, one state
    assert first["memory"][0] == linear(16, 64) + 32 * 16 * 4  # its input saved
    assert first["memory"][1] == first["memory"][3] == 0  # Save, Take(add)
    assert second["built"] == []  # worker 1 measured nothing
    assert sorted(set(first["built"])) == [0, 2, 4, 5]  # worker 0 built each Linear (once per measurement)


@pytest.mark.timeout(90)
def test_a_failed_measurement_is_told_to_every_worker(make_cluster) -> None:
    """Worker 0's sample does not fit layer 0: worker 0 raises torch's error and worker 1 a RemoteError
    naming the layer, at once, not after KVSTORE_REQUEST_TIMEOUT; the next call on the store still agrees."""
    cluster = make_cluster(num_workers=2, **FAST)

    def run(kv):
        entries = specs([])
        wrong = outcome(lambda: agreed_costs(kv, entries, torch.randn(8, 15) if kv.rank == 0 else None,
                                             "time"))
        right = agreed_costs(kv, entries, torch.randn(8, 16) if kv.rank == 0 else None, "memory")
        return wrong, right

    (first, costs0), (second, costs1) = cluster.run(run)
    assert first[0] == "RuntimeError" and "16" in first[1], first
    assert second[0] == RemoteError.__name__ and "layer 0" in second[1], second
    assert second[2] < 10, second
    assert costs0 == costs1


class Slow(torch.nn.Module):
    """The identity, which takes 3 s: a layer whose measurement outlasts a 2 s request deadline."""

    def forward(self, x: Any) -> Any:
        time.sleep(3)  # the measured work itself, not a wait for a condition
        return x


@pytest.mark.timeout(90)
def test_a_measurement_longer_than_the_request_deadline_is_a_deadline_error_everywhere(make_cluster) -> None:
    """With KVSTORE_REQUEST_TIMEOUT=2 and a 3 s measurement, worker 1 stops waiting after 2 s and worker 0
    when it reaches the barrier worker 1 left: both DeadlineExceededError naming the knob and the fix."""
    cluster = make_cluster(num_workers=2, **{**FAST, "KVSTORE_REQUEST_TIMEOUT": "2"})
    found = cluster.run(lambda kv: outcome(lambda: agreed_costs(kv, [LayerSpec(Slow)], torch.randn(2, 2),
                                                                "time", repeats=1, warmup=0)))
    for name, message, _ in found:
        assert name == DeadlineExceededError.__name__, found
        assert "KVSTORE_REQUEST_TIMEOUT" in message and "balance given as a list" in message, message
    assert found[1][2] < found[0][2]  # worker 1 gave up first

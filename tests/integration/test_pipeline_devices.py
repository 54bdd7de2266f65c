"""Pipeline stages on devices (docs/pipeline.md, "GPUs"): a stage's layers live on its device, its
boundary tensors cross as host arrays (pinned and copied on a side stream on a GPU), so a CPU stage and a
CUDA stage can be neighbours.  Each device pair trains the real-model pipeline of
test_pipeline_real_models.py (a tuple boundary, a skip, a tied weight) to one process's weights; the
pairs with a CUDA side are marked ``cuda`` and skip cleanly where there is no GPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.pipeline import Pipeline  # noqa: E402
from tests.integration.test_pipeline_real_models import (  # noqa: E402
    BALANCE,
    FAST,
    SEED,
    data,
    layers,
    reference,
)

PAIRS = [
    pytest.param(("cpu", "cpu"), id="cpu-cpu"),
    pytest.param(("cuda:0", "cpu"), id="cuda-cpu", marks=pytest.mark.cuda),
    pytest.param(("cpu", "cuda:0"), id="cpu-cuda", marks=pytest.mark.cuda),
    pytest.param(("cuda:0", "cuda:0"), id="cuda-cuda", marks=pytest.mark.cuda),  # two processes, one GPU
]


def trained(kv, devices: tuple[str, str]) -> dict:
    """This rank's stage on its device, trained 3 steps by a Trainer (optimizer on the servers)."""
    from kvstore.trainer import Trainer

    pipe = Pipeline(layers(), stages=2, balance=BALANCE[2], kv=kv, chunks=3, schedule="1f1b", seed=SEED,
                    device=list(devices))
    trainer = Trainer(pipe, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, update_on_kvstore=True,
                      key_prefix=f"dev-{'-'.join(devices)}")
    try:
        where = {p.device.type for p in pipe.parameters()}
        for x, y in data():
            pipe.module.zero_grad()
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
            trainer.step(1)
        out = pipe.predict(data()[0][0] if pipe.is_first else None)
    finally:
        pipe.close()
    return {"state": {k: v.detach().cpu().numpy().copy() for k, v in pipe.state_dict().items()},
            "where": where, "out": None if out is None else out.cpu()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", PAIRS)
def test_stage_devices_train_as_one_process(make_cluster, devices) -> None:
    """Each stage's parameters live on its device, and after 3 steps hold one process's weights (float64:
    1e-12 on the CPU, 1e-9 with a GPU's kernels); predict returns the last stage's outputs."""
    expected = reference()
    cluster = make_cluster(num_workers=2, **FAST)
    parts = cluster.run(lambda kv: trained(kv, devices))
    rtol = 1e-12 if devices == ("cpu", "cpu") else 1e-9
    merged: dict[str, np.ndarray] = {}
    for stage, part in enumerate(parts):
        assert part["where"] == {torch.device(devices[stage]).type}
        merged.update(part["state"])
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(merged[name], value, rtol=rtol, atol=1e-14, err_msg=name)
    assert parts[0]["out"] is None and parts[1]["out"].shape == data()[0][1].shape

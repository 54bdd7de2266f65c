"""Measured activation memory of pipeline stages (saved-tensor hooks): GPipe holds every micro-batch's
saved tensors at once, 1F1B and PipeDream at most K - i micro-batches' at stage i."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from kvstore.pipeline import Pipeline  # noqa: E402

FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "20"}
MICRO = 4  # samples per micro-batch: the batch grows with M, so one micro-batch's bytes stay the same
torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def peaks(kv, schedule: str, chunks: int) -> tuple[int, int]:
    """(stage, peak saved bytes) of one step of ``schedule`` with ``chunks`` micro-batches of MICRO."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(MICRO * chunks, 8, generator=gen), torch.randn(MICRO * chunks, 4, generator=gen)
    sgd = (lambda ps: torch.optim.SGD(ps, lr=0.01)) if schedule == "pipedream" else None
    pipe = Pipeline(copy.deepcopy(MODEL), stages=2, chunks=chunks, schedule=schedule, checkpoint="never",
                    kv=kv, optimizer=sgd, balance=[4, 3])
    try:
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
    finally:
        pipe.close()
    return pipe.stage, pipe.peak_saved_bytes


@pytest.mark.timeout(60)
def test_gpipe_peak_grows_with_m_and_1f1b_stays_bounded(make_cluster) -> None:
    """Measured peak: gpipe's is M micro-batches' bytes (doubles from M = 2 to 4), 1f1b's and
    pipedream's stay at K - i micro-batches' (2 at stage 0, 1 at stage 1) whatever M is."""
    cluster = make_cluster(num_workers=2, **FAST)
    got = {(schedule, m): dict(cluster.run(lambda kv, s=schedule, m=m: peaks(kv, s, m)))
           for schedule in ("gpipe", "1f1b", "pipedream") for m in (2, 4)}
    for stage in (0, 1):
        one = got[("gpipe", 2)][stage] // 2  # one micro-batch's saved bytes at this stage
        assert one > 0 and got[("gpipe", 2)][stage] == 2 * one, (stage, got)
        assert got[("gpipe", 4)][stage] == 4 * one, (stage, got)
        for schedule in ("1f1b", "pipedream"):
            for m in (2, 4):
                assert got[(schedule, m)][stage] == (2 - stage) * one, (schedule, m, stage, got)

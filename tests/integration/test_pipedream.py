"""schedule='pipedream' over a real cluster: weight stashing keeps each micro-batch's backward on its
forward's weight version, and the digits MLP cut into 2 and 4 stages trains as well as one process."""

from __future__ import annotations

import copy
import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from kvstore.errors import ConfigError  # noqa: E402
from kvstore.pipeline import Pipeline  # noqa: E402

FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "20"}
SEED, BATCH, CHUNKS, EPOCHS, LR = 0, 32, 4, 10, 0.0125  # 0.05 per 32 samples, per micro-batch of 8


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits data set (features in [0, 1]) with a fixed 75/25 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(data.data / 16.0, data.target, test_size=0.25,
                                                        random_state=SEED)
    return (torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32),
            torch.tensor(y_train), torch.tensor(y_test))


DATA = digits()
torch.manual_seed(SEED)
nn = torch.nn
MODEL = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32),
                      nn.ReLU(), nn.Linear(32, 10))


def sgd(params) -> torch.optim.Optimizer:
    """The optimizer of every run here."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def batches() -> list[torch.Tensor]:
    """The same shuffled mini-batch indices for every run."""
    gen = torch.Generator().manual_seed(SEED)
    return [b for _ in range(EPOCHS) for b in torch.randperm(len(DATA[0]), generator=gen).split(BATCH)]


def accuracy(net: torch.nn.Module) -> float:
    """Test accuracy of the whole model."""
    with torch.no_grad():
        return float((net(DATA[1]).argmax(1) == DATA[3]).float().mean())


@functools.cache  # deterministic (fixed seeds, data and batches): computed once for the module's tests
def one_process() -> float:
    """The reference: the whole MLP in this process, one update per micro-batch (the same training as
    'pipedream' without a pipeline, so without stale forwards)."""
    net = copy.deepcopy(MODEL)
    opt = sgd(net.parameters())
    for b in batches():
        for x, y in zip(DATA[0][b].chunk(CHUNKS), DATA[2][b].chunk(CHUNKS)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    return accuracy(net)


def pipedream(kv, stages: int, chunks: int, steps: int | None = None) -> dict:
    """Train the MLP as stage kv.rank of a 'pipedream' pipeline; return its model, version log and peak
    stashed versions."""
    net = copy.deepcopy(MODEL)
    pipe = Pipeline(net, stages=stages, chunks=chunks, schedule="pipedream", checkpoint="never", kv=kv,
                    optimizer=sgd, balance=[4, 3] if stages == 2 else [2, 2, 2, 1])
    logs = []
    try:
        for b in batches()[:steps]:
            pipe.step(DATA[0][b] if pipe.is_first else None, DATA[2][b] if pipe.is_last else None,
                      torch.nn.functional.cross_entropy)
            logs.append(list(pipe.stash.log))
    finally:
        pipe.close()
    return {"net": net, "logs": logs, "peak": pipe.stash.peak, "version": pipe.stash.version,
            "stage": pipe.stage, "params": pipe.stage_parameters()}


@pytest.mark.timeout(60)
def test_each_backward_uses_its_forwards_weight_version(make_cluster) -> None:
    """4 stages, 8 micro-batches: every backward ran on the version its forward ran on, stage i held
    K - i versions at most (and at peak), micro-batch m's forward was min(m, K - 1 - i) updates stale."""
    cluster = make_cluster(num_workers=4, **FAST)
    parts = cluster.run(lambda kv: pipedream(kv, 4, 8, steps=2))
    for part in parts:
        stage = part["stage"]
        assert part["version"] == 2 * 8, stage  # an update per micro-batch
        assert part["peak"] == 4 - stage, (stage, part["peak"])
        for log in part["logs"]:
            assert [mb for mb, *_ in log] == list(range(8)), (stage, log)
            assert all(forward == backward for _, forward, backward, _ in log), (stage, log)
            assert [live - forward for _, forward, _, live in log] == [min(m, 3 - stage) for m in range(8)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stages", [2, 4])
def test_digits_train_as_well_as_one_process(make_cluster, stages: int) -> None:
    """The digits MLP under 'pipedream' in 2 and 4 stages reaches one process's test accuracy - 0.01."""
    cluster = make_cluster(num_workers=stages, **FAST)
    parts = cluster.run(lambda kv: pipedream(kv, stages, CHUNKS))
    trained = {name: p for part in parts for name, p in part["net"].named_parameters()
               if id(p) in part["params"]}
    whole = copy.deepcopy(MODEL)
    assert sorted(trained) == sorted(name for name, _ in whole.named_parameters())
    whole.load_state_dict(trained, strict=False)
    got, reference = accuracy(whole), one_process()
    assert got >= reference - 0.01, (got, reference)


def replicated(kv) -> dict:
    """Train the MLP as 2 stages x 2 replicas under 'pipedream', each replica on its half of every
    mini-batch; return this rank's stage parameters."""
    net = copy.deepcopy(MODEL)
    pipe = Pipeline(net, stages=2, chunks=CHUNKS, schedule="pipedream", checkpoint="never", kv=kv,
                    optimizer=sgd, balance=[4, 3])
    try:
        for b in batches():
            half = b.chunk(2)[pipe.replica]
            pipe.step(DATA[0][half] if pipe.is_first else None, DATA[2][half] if pipe.is_last else None,
                      torch.nn.functional.cross_entropy)
    finally:
        pipe.close()
    return {"stage": pipe.stage, "replica": pipe.replica,
            "own": {name: p.detach().clone() for name, p in pipe.named_parameters()}}


@pytest.mark.timeout(120)
def test_stage_replicas_average_their_weights_every_step(make_cluster) -> None:
    """2 stages x 2 replicas: after training, both replicas of a stage hold the same weights (averaged
    through the store each step) and the model reaches one process's accuracy - 0.02."""
    cluster = make_cluster(num_workers=4, **FAST)
    parts = cluster.run(replicated)
    for stage in (0, 1):
        a, b = [p["own"] for p in parts if p["stage"] == stage]
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[name], b[name]) for name in a), stage
    whole = copy.deepcopy(MODEL)  # each rank holds its stage alone: replica 0's stages make the model
    whole.load_state_dict({**parts[0]["own"], **parts[1]["own"]}, strict=True)
    got, reference = accuracy(whole), one_process()
    assert got >= reference - 0.02, (got, reference)


@pytest.mark.timeout(30)
def test_pipedream_needs_an_optimizer(make_cluster) -> None:
    """'pipedream' without optimizer=: ConfigError naming it."""
    cluster = make_cluster(num_workers=2, **FAST)

    def build(kv, stages: int, **options):
        try:
            Pipeline(copy.deepcopy(MODEL), stages=stages, schedule="pipedream", kv=kv, **options).close()
        except ConfigError as exc:
            return str(exc)
        return None

    assert all("optimizer=" in str(e) for e in cluster.run(lambda kv: build(kv, 2)))

"""DistributedOptimizer over torch.optim on a real cluster (2 workers, 1 server, workers in threads):
2 workers end with one process's weights on the concatenated batches, broadcasts start every worker
from rank 0's state, and a torch.save'd state dict resumes to identical weights."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402

STEPS, LOCAL_BATCH = 5, 8
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05),
}


_seeding = threading.Lock()  # the workers are threads of this process: torch's global generator is shared


def _model() -> torch.nn.Module:
    with _seeding:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _data(steps: int, workers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(LOCAL_BATCH * workers, 6, generator=g),
             torch.randint(0, 3, (LOCAL_BATCH * workers,), generator=g)) for _ in range(steps)]


def _train(model: torch.nn.Module, opt, batches, part: slice = slice(None)) -> None:
    loss_fn = torch.nn.CrossEntropyLoss()  # the mean over the (local) batch
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x[part]), y[part]).backward()
        opt.step()


def _weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.timeout(60)
def test_two_workers_match_one_process(make_cluster) -> None:
    """SGD (momentum, wd), Adam and AdamW: 2 averaging workers end with one process's weights (fp32,
    1e-6) on the concatenated batches; rank 1 starts from other weights and gets rank 0's by broadcast."""
    cluster = make_cluster("dist_sync", 2, 1)
    batches = _data(STEPS)
    start = _model()

    def work(kv, name):
        model = copy.deepcopy(start)
        if kv.rank == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # different weights until the broadcast
        opt = kvstore.DistributedOptimizer(OPTIMIZERS[name](model.parameters()),
                                           named_parameters=model.named_parameters(), kv=kv)
        kvstore.broadcast_parameters(model.state_dict(), root_rank=0, kv=kv)
        kvstore.broadcast_optimizer_state(opt, root_rank=0, kv=kv)
        rows = slice(kv.rank * LOCAL_BATCH, (kv.rank + 1) * LOCAL_BATCH)
        _train(model, opt, batches, rows)
        return _weights(model)

    for name, make_opt in OPTIMIZERS.items():
        one = copy.deepcopy(start)
        _train(one, make_opt(one.parameters()), batches)
        dist = cluster.run(lambda kv, name=name: work(kv, name))
        assert _max_diff(dist[0], dist[1]) == 0.0, name
        diff = _max_diff(dist[0], _weights(one))
        print(f"{name}: max |dist - one process| = {diff:.3g}")
        assert diff <= 1e-6, name
        assert _max_diff(dist[0], _weights(start)) > 1e-3, f"{name} did not train"


@pytest.mark.timeout(60)
def test_state_dict_round_trip_resumes_to_identical_weights(make_cluster, tmp_path: Path) -> None:
    """Train 3 steps, torch.save the model's and the optimizer's state dicts on rank 0, train 3 more;
    fresh models and optimizers, rank 0 torch.loads the file and broadcasts it, 3 more steps: equal."""
    cluster = make_cluster("dist_sync", 2, 1)
    batches = _data(6)
    start = _model()
    ckpt = tmp_path / "ckpt.pt"

    def fresh(kv, prefix):
        model = copy.deepcopy(start)
        opt = kvstore.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters(), kv=kv,
                                           key_prefix=prefix)
        return model, opt

    def work(kv):
        rows = slice(kv.rank * LOCAL_BATCH, (kv.rank + 1) * LOCAL_BATCH)
        model, opt = fresh(kv, "first")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for batch in batches[:3]:
            _train(model, opt, [batch], rows)
            sched.step()
        if kv.rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, ckpt)
        kv.barrier()
        for batch in batches[3:]:
            _train(model, opt, [batch], rows)
            sched.step()
        unbroken = _weights(model)
        model, opt = fresh(kv, "second")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if kv.rank == 0:
            saved = torch.load(ckpt, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        sched.load_state_dict(torch.load(ckpt, weights_only=True)["sched"])  # a plain dict, on every worker
        kvstore.broadcast_parameters(model.state_dict(), kv=kv)
        kvstore.broadcast_optimizer_state(opt, kv=kv)
        for batch in batches[3:]:
            _train(model, opt, [batch], rows)
            sched.step()
        return unbroken, _weights(model)

    results = cluster.run(work)
    for unbroken, resumed in results:
        diff = _max_diff(unbroken, resumed)
        print(f"resume: max |unbroken - resumed| = {diff:.3g}")
        assert diff == 0.0
    assert _max_diff(results[0][1], results[1][1]) == 0.0


@pytest.mark.timeout(60)
def test_unused_parameters_and_sum(make_cluster) -> None:
    """A parameter with no gradient on one worker gets the other's (averaged over both); one with
    none anywhere keeps None and no state; op='sum' sums."""
    cluster = make_cluster("dist_sync", 2, 1)

    def work(kv):
        a, b, c = (torch.zeros(3, requires_grad=True) for _ in range(3))
        opt = kvstore.DistributedOptimizer(torch.optim.SGD([a, b, c], lr=1.0),
                                           named_parameters=[("a", a), ("b", b), ("c", c)], kv=kv,
                                           key_prefix="unused")
        total = kvstore.DistributedOptimizer(torch.optim.SGD([c], lr=1.0), kv=kv, op="sum",
                                             key_prefix="summed")
        a.grad = torch.full((3,), 2.0 * (kv.rank + 1))
        if kv.rank == 0:
            b.grad = torch.full((3,), 4.0)
        opt.step()
        state_c = c in opt.state and opt.state[c]
        c.grad = torch.ones(3)
        total.step()
        return a.detach().clone(), b.detach().clone(), c.detach().clone(), state_c

    for a, b, c, state_c in cluster.run(work):
        assert a.tolist() == [-3.0] * 3  # -(2 + 4) / 2
        assert b.tolist() == [-2.0] * 3  # -(4 + 0) / 2
        assert c.tolist() == [-2.0] * 3  # untouched by the first step, then -(1 + 1)
        assert not state_c


@pytest.mark.timeout(60)
@pytest.mark.parametrize("uok", [True, False], ids=["update_on_kvstore", "update_locally"])
def test_trainer_state_dict_round_trip(make_cluster, tmp_path: Path, uok: bool) -> None:
    """Trainer.state_dict (gathered from the servers with update_on_kvstore) is the same on both
    workers; torch.save/torch.load and load_state_dict into new Trainers resume to identical weights."""
    cluster = make_cluster("dist_sync", 2, 1)
    batches = _data(6)
    start = _model()

    def steps(kv, model, trainer, chunk):
        rows = slice(kv.rank * LOCAL_BATCH, (kv.rank + 1) * LOCAL_BATCH)
        loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
        for x, y in chunk:
            model.zero_grad()
            loss_fn(model(x[rows]), y[rows]).backward()
            trainer.step(2 * LOCAL_BATCH)

    def work(kv):
        model = copy.deepcopy(start)
        trainer = kvstore.Trainer(model.named_parameters(), "adamw", {"learning_rate": 0.01}, kvstore=kv,
                                  update_on_kvstore=uok, key_prefix="first")
        steps(kv, model, trainer, batches[:3])
        state = trainer.state_dict()
        path = tmp_path / f"ckpt{kv.rank}.pt"
        torch.save({"trainer": state, "model": model.state_dict()}, path)
        steps(kv, model, trainer, batches[3:])
        saved = torch.load(path, weights_only=True)
        resumed = copy.deepcopy(start)
        resumed.load_state_dict(saved["model"])
        other = kvstore.Trainer(resumed.named_parameters(), "sgd", kvstore=kv, update_on_kvstore=uok,
                                key_prefix="second")
        renamed = {**saved["trainer"], "states": {k.replace("first/", "second/", 1): v
                                                  for k, v in saved["trainer"]["states"].items()}}
        other.load_state_dict(renamed)
        steps(kv, resumed, other, batches[3:])
        return state, _weights(model), _weights(resumed)

    results = cluster.run(work)
    for state, unbroken, resumed in results:
        assert state["optimizer"]["name"] == "adamw" and len(state["states"]) == 4
        assert _max_diff(unbroken, resumed) == 0.0
    a, b = results[0][0]["states"], results[1][0]["states"]
    assert all(torch.equal(a[k]["arrays"][n], b[k]["arrays"][n]) for k in a for n in a[k]["arrays"])


@pytest.mark.timeout(60)
def test_adamw_on_the_servers_matches_torch(make_cluster) -> None:
    """kvstore.optimizer.create('adamw') on 2 servers (the key split between them), 2 workers pushing:
    the pulled weights match torch.optim.AdamW on the summed gradients to 1e-6 (float32, 10 steps)."""
    cluster = make_cluster("dist_sync", 2, 2)
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((40, 30)).astype(np.float32)  # 1200 elements > the bound 1000: split
    grads = [[rng.standard_normal(w0.shape).astype(np.float32) for _ in range(2)] for _ in range(10)]

    def work(kv):
        kv.init("adamw_w", w0)
        kv.set_optimizer(kvstore.optimizer.create("adamw", learning_rate=0.01, wd=0.05, beta2=0.99))
        out = np.empty_like(w0)
        for step in grads:
            kv.pushpull("adamw_w", step[kv.rank], out=out)
        return out

    p = torch.nn.Parameter(torch.tensor(w0))
    ref = torch.optim.AdamW([p], lr=0.01, weight_decay=0.05, betas=(0.9, 0.99))
    for step in grads:
        p.grad = torch.tensor(step[0] + step[1])
        ref.step()
    for weights in cluster.run(work):
        diff = float(np.abs(weights - p.detach().numpy()).max())
        print(f"adamw on the servers: max |servers - torch| = {diff:.3g}")
        assert diff <= 1e-6


@pytest.mark.timeout(60)
def test_clipping_between_synchronize_and_step_reduces_once(make_cluster) -> None:
    """2 workers, op='sum': synchronize(), clip, then step() inside skip_synchronize() steps on the once
    summed and clipped gradient (a second reduction would double it); integer and frozen parameters in
    the optimizer are skipped."""
    cluster = make_cluster("dist_sync", 2, 1)

    def work(kv):
        w = torch.zeros(4, requires_grad=True)
        frozen, count = torch.ones(2), torch.zeros(2, dtype=torch.int64)
        opt = kvstore.DistributedOptimizer(torch.optim.SGD([w, frozen, count], lr=1.0), kv=kv, op="sum",
                                           key_prefix="clip")
        (w * torch.tensor([3.0, 0.0, 4.0, 0.0]) * (kv.rank + 1)).sum().backward()
        opt.synchronize()  # [9, 0, 12, 0]: norm 15
        summed = w.grad.clone()
        torch.nn.utils.clip_grad_norm_([w], 1.5)
        with opt.skip_synchronize():
            opt.step()
        return summed, w.detach().clone(), frozen.clone(), count.clone()

    for summed, w, frozen, count in cluster.run(work):
        assert summed.tolist() == [9.0, 0.0, 12.0, 0.0]
        assert torch.allclose(w, torch.tensor([-0.9, 0.0, -1.2, 0.0]))
        assert frozen.tolist() == [1.0, 1.0] and count.tolist() == [0, 0]


@pytest.mark.timeout(90)
def test_sparse_adam_over_sparse_embeddings_agrees_on_two_workers(make_cluster) -> None:
    """SparseAdam over nn.Embedding(sparse=True) on 2 averaging workers, each its own ids: the gradients
    go through row-sparse keys, the tables agree and equal one process's on the concatenated batches
    (fp32, 1e-6); a step where one worker touches no row still counts it."""
    cluster = make_cluster("dist_sync", 2, 1)
    batches = [([1, 7, 7, 3], [3, 40, 2, 9]), ([5, 5, 6, 1], []), ([0, 49, 8, 8], [8, 1, 1, 2])]

    def table() -> torch.nn.Embedding:
        with _seeding:
            torch.manual_seed(0)
            return torch.nn.Embedding(50, 4, sparse=True)

    def loss(model, ids: list[int]) -> torch.Tensor:
        return model(torch.tensor(ids, dtype=torch.long)).square().sum() / 4  # a mean over 4 samples

    def work(kv):
        model = table()
        opt = kvstore.DistributedOptimizer(torch.optim.SparseAdam(model.parameters(), lr=0.1), kv=kv,
                                           key_prefix="emb")
        for pair in batches:
            opt.zero_grad()
            if pair[kv.rank]:
                loss(model, pair[kv.rank]).backward()
            opt.step()
        return model.weight.detach().clone()

    one = table()
    ref = torch.optim.SparseAdam(one.parameters(), lr=0.1)
    for first, second in batches:
        ref.zero_grad()
        ((loss(one, first) + (loss(one, second) if second else 0)) / 2).backward()
        ref.step()
    tables = cluster.run(work)
    assert torch.equal(tables[0], tables[1])
    assert torch.allclose(tables[0], one.weight, atol=1e-6)


@pytest.mark.timeout(60)
def test_fp16_compression_on_the_wrapper_trains_close_to_uncompressed(make_cluster) -> None:
    """compression='fp16' (the store's) on 2 workers: the model ends within fp16's rounding of the
    uncompressed run's, and the store reports the setting."""
    cluster = make_cluster("dist_sync", 2, 1)
    batches = _data(STEPS)

    def work(kv):
        model = _model()
        opt = kvstore.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), kv=kv,
                                           compression="fp16", key_prefix="half")
        _train(model, opt, batches, slice(kv.rank * LOCAL_BATCH, (kv.rank + 1) * LOCAL_BATCH))
        return _weights(model), kv.get_gradient_compression()["type"]

    one = _model()
    _train(one, torch.optim.SGD(one.parameters(), lr=0.1), batches)
    for weights, kind in cluster.run(work):
        assert kind == "fp16"
        assert _max_diff(weights, _weights(one)) < 1e-3

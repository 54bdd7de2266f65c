"""The Trainer's "done when": N-worker dist_sync training ends with one process's weights.

The distributed side runs tests/integration/scripts/trainer_equiv.py through the real
launcher (1 scheduler, 2 servers, 3 workers); the single-process side runs the same
training function in this process with the 'local' store.  Each launch trains with sgd
(momentum, wd) and then adam, one Trainer after the other on the same dist store.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.core import checkpoint
from kvstore.errors import RemoteError
from tests.helpers import finish, launch, poll_for, tagged_pids

SCRIPT = Path(__file__).parent / "scripts" / "trainer_equiv.py"
STEPS, GLOBAL_BATCH = 6, 24
OPTIMIZERS = ("sgd", "adam")


def _load_script():
    spec = importlib.util.spec_from_file_location("trainer_equiv", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(tag: str, args: list[str], timeout: float = 60) -> str:
    """Run the script under ``launch.py -n 3 -s 2``; return its output (fail on a non-zero exit)."""
    # a bound of 500 elements splits the first layer's 640-element weight over both servers
    env = {**os.environ, "KVSTORE_BIGARRAY_BOUND": "500", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
           "KVSTORE_CONNECT_TIMEOUT": "30", "KVSTORE_REQUEST_TIMEOUT": "30", "KVSTORE_TEST_TAG": tag}
    rc, out = finish(launch(["-n", "3", "-s", "2", str(SCRIPT), *args], env), timeout)
    assert rc == 0, out
    return out


@pytest.mark.parametrize("uok", ["1", "0"], ids=["update_on_kvstore", "update_locally"])
def test_dist_sync_training_matches_one_process(tmp_path: Path, tag: str, monkeypatch: pytest.MonkeyPatch,
                                                uok: str) -> None:
    """3 dist_sync workers, each on its share of every global batch, end with the local run's weights."""
    out_file = tmp_path / "dist.arrays"
    out = _launch(tag, [",".join(OPTIMIZERS), uok, str(out_file), str(STEPS), str(GLOBAL_BATCH)])
    for name in OPTIMIZERS:
        for rank in range(3):
            assert f"rank {rank} of 3 (dist_sync): trained {STEPS} steps of {name}" in out, out
    dist = checkpoint.load_arrays(out_file)

    monkeypatch.delenv("DMLC_ROLE", raising=False)  # the script's Trainer then uses a 'local' store
    script = _load_script()
    keys = set()
    for name in OPTIMIZERS:  # sgd with momentum and wd, adam with wd
        _, local = script.train(name, uok == "1", STEPS, GLOBAL_BATCH)
        _, initial = script.train(name, uok == "1", 0, GLOBAL_BATCH)
        for param, weight in local.items():
            key = f"{name}/{param}"
            keys.add(key)
            assert not np.array_equal(weight, initial[param]), f"{key} did not train"
            np.testing.assert_allclose(dist[key], weight.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)
    assert set(dist) == keys
    assert poll_for(lambda: not tagged_pids(tag), 10, "every launched process to exit")


def test_local_update_save_failure_reaches_every_worker(make_cluster, tmp_path: Path) -> None:
    """With update_on_kvstore=False, rank 0's failure to write the states is raised on every worker."""
    torch = pytest.importorskip("torch")
    from kvstore.trainer import Trainer

    cluster = make_cluster("dist_sync", 2, 1)

    def work(kv):
        weight = torch.zeros(3, requires_grad=True)
        trainer = Trainer([weight], "sgd", kvstore=kv, update_on_kvstore=False, key_prefix="t")
        try:
            trainer.save_states(tmp_path / "no" / "such" / "dir.states")
        except Exception as exc:  # noqa: BLE001 - the test inspects the type below
            return exc
        return None

    rank0, rank1 = cluster.run(work)
    assert isinstance(rank0, FileNotFoundError)
    assert isinstance(rank1, RemoteError) and "worker 0" in str(rank1)


def test_states_file_missing_after_a_reload_fails_on_every_worker(make_cluster, tmp_path: Path) -> None:
    """With update_on_kvstore, after weights were loaded, load_states of a missing file raises on every
    worker (rank 0's own error, the other's naming worker 0), not rank 0 alone with the rest waiting."""
    torch = pytest.importorskip("torch")
    from kvstore.trainer import Trainer

    cluster = make_cluster("dist_sync", 2, 1, KVSTORE_REQUEST_TIMEOUT="20")

    def work(kv):
        model = torch.nn.Linear(2, 1, bias=False)
        trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1}, kvstore=kv,
                          update_on_kvstore=True, key_prefix="reloaded")
        for load in (False, True):
            if load:
                model.load_state_dict({"weight": torch.zeros(1, 2)})
            model.weight.grad = None
            model(torch.ones(1, 2)).sum().backward()
            trainer.step(1)
        try:
            trainer.load_states(str(tmp_path / "missing.states"))
        except Exception as exc:  # noqa: BLE001 - the test inspects the type below
            return exc
        return None

    rank0, rank1 = cluster.run(work)
    assert isinstance(rank0, FileNotFoundError), rank0
    assert isinstance(rank1, RemoteError) and "worker 0" in str(rank1), rank1


def test_weights_loaded_on_two_workers_are_rank_0s_start_of_the_next_step(make_cluster) -> None:
    """update_on_kvstore on 2 workers: weights loaded between steps (rank 0 loads 1.0, rank 1 5.0) are
    the next step's start on both, rank 0's as at the first use: 1 - 0.1 x 2 = 0.8, not the servers'
    old -0.2 stepped on (-0.4)."""
    torch = pytest.importorskip("torch")
    from kvstore.trainer import Trainer

    cluster = make_cluster("dist_sync", 2, 1)

    def work(kv):
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1}, kvstore=kv,
                          update_on_kvstore=True, key_prefix="twice")
        seen = []
        for load in (None, 1.0 if kv.rank == 0 else 5.0):
            if load is not None:
                model.load_state_dict({"weight": torch.full((1, 1), load)})
            model.weight.grad = None
            model(torch.ones(1, 1)).sum().backward()  # a gradient of 1 on each worker: 2 summed
            trainer.step(1)
            seen.append(model.weight.item())
        return seen

    for seen in cluster.run(work):
        assert seen == pytest.approx([-0.2, 0.8])


@pytest.mark.parametrize("mode", ["dist_sync", "dist_async"])
def test_a_step_of_another_batch_size_scales_its_own_pushes_not_the_servers_rescale(make_cluster,
                                                                                   mode: str) -> None:
    """update_on_kvstore on 2 workers, rank 0 stepping with batch 1 and rank 1 with batch 4 (a gradient
    of 1 each): the servers keep rank 0's first rescale (1.0) and rank 1's pushes carry its own 1/4, so
    3 steps of sgd (lr 0.1) move the weight by 3 x 0.1 x (1 + 0.25) in both modes; before, rank 1's
    gradients were applied with rank 0's rescale (-0.6), and in dist_async a change of batch size on one
    worker rescaled the other's pushes in flight."""
    torch = pytest.importorskip("torch")
    from kvstore.trainer import Trainer

    cluster = make_cluster(mode, 2, 1)

    def work(kv):
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        trainer = Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1}, kvstore=kv,
                          update_on_kvstore=True, key_prefix=f"batches-{mode}")
        for _ in range(3):
            model.weight.grad = torch.ones(1, 1)
            trainer.step(1 if kv.rank == 0 else 4)
        kv.barrier()  # dist_async: every push applied before the pull
        kv.pull(f"batches-{mode}/weight", out=model.weight.data)
        return model.weight.item(), kv.get_optimizer().rescale_grad

    for weight, rescale in cluster.run(work):
        assert weight == pytest.approx(-0.375) and rescale == 1.0

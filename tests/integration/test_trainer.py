"""The Trainer's "done when": N-worker dist_sync training ends with one process's weights.

The distributed side runs tests/integration/scripts/trainer_equiv.py through the real
launcher (1 scheduler, 2 servers, 3 workers); the single-process side runs the same
training function in this process with the 'local' store.  Each launch trains with sgd
(momentum, wd) and then adam, one Trainer after the other on the same dist store.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore import checkpoint
from tests.helpers import REPO, poll_for, tagged_pids

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
    proc = subprocess.Popen([sys.executable, "launch.py", "-n", "3", "-s", "2", str(SCRIPT), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"launcher did not finish within {timeout} s:\n{out}") from None
    assert proc.returncode == 0, out
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

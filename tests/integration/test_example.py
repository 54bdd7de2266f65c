"""The examples through launch.py: the README's digits run, the cancer MLP and an exact save/resume."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.checkpoint import load_arrays
from tests.helpers import finish, launch

STEPS = 5  # k: the unbroken run trains 2k global steps, the broken one k, then k more after a resume


def _launch(args: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``launch.py ARGS`` in the repository; return its output, failing the test on a non-zero exit."""
    rc, output = finish(launch(args, {**os.environ, **(env or {})}), timeout)
    assert rc == 0, output
    return output


def _final_accuracy(output: str, worker: int = 0) -> float:
    """The final test accuracy ``worker`` printed (a pipeline's: its last stage of replica 0)."""
    match = re.search(rf"\[worker {worker}\] final test accuracy (\d\.\d+)", output)
    assert match, output
    return float(match.group(1))


@pytest.mark.timeout(240)
def test_example_reaches_accuracy_through_launcher() -> None:
    """4 workers and 2 servers in dist_sync train the digits MLP to >= 0.90 test accuracy and exit 0,
    printing at most 25 lines at the default log level."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    output = _launch(["-n", "4", "-s", "2", "examples/train_digits.py"], timeout=220,
                     env={"KVSTORE_LOG_LEVEL": ""})  # the default level, whatever the test's environment
    assert _final_accuracy(output) >= 0.90
    assert len(output.splitlines()) <= 25, output  # the quick start: no lifecycle chatter by default


@pytest.mark.timeout(180)
def test_example_with_two_replicas_per_worker_on_a_device_store() -> None:
    """2 workers x 2 CPU replicas on dist_sync_device train the digits MLP to >= 0.90 and exit 0."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    output = _launch(["-n", "2", "-s", "1", "examples/train_digits.py", "--kvstore", "dist_sync_device",
                      "--devices", "cpu,cpu", "--epochs", "10"], timeout=160)
    assert "2 worker(s) x 2 device(s)" in output, output
    assert _final_accuracy(output) >= 0.90


@pytest.mark.timeout(180)
def test_cancer_example_reaches_accuracy_through_launcher() -> None:
    """2 workers and 1 server train the breast cancer MLP with Adam and a cosine schedule to >= 0.93."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    output = _launch(["-n", "2", "-s", "1", "examples/train_cancer.py"], timeout=160)
    assert _final_accuracy(output) >= 0.93


RESUME_ENV = {"KVSTORE_BIGARRAY_BOUND": "256"}  # the 32x16 weight and its states are sliced over -s 2


class _Unbroken:
    """The unbroken runs of checkpoint_resume.py, one per optimizer: started by :meth:`start` (at
    once, running alongside the test's own launches) and read back by :meth:`weights`."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._runs: dict[tuple[str, ...], tuple[subprocess.Popen, Path]] = {}
        self._made: dict[tuple[str, ...], dict[str, np.ndarray]] = {}

    def start(self, optimizer: list[str]) -> None:
        """Launch 2k unbroken steps with ``optimizer``'s flags (states on the servers), unless done."""
        if tuple(optimizer) not in self._runs:
            out = self._tmp.mktemp("unbroken") / "unbroken.arrays"
            proc = launch(["-n", "2", "-s", "2", "examples/checkpoint_resume.py", *optimizer,
                           "--update-on-kvstore", "1", "--steps", str(2 * STEPS), "--out", str(out)],
                          {**os.environ, **RESUME_ENV})
            self._runs[tuple(optimizer)] = proc, out

    def weights(self, optimizer: list[str]) -> dict[str, np.ndarray]:
        """The unbroken run's final weights (waiting for it), failing the test if it failed."""
        if tuple(optimizer) not in self._made:
            proc, out = self._runs[tuple(optimizer)]
            rc, output = finish(proc, 60)
            assert rc == 0, output
            self._made[tuple(optimizer)] = load_arrays(out)
        return self._made[tuple(optimizer)]

    def close(self) -> None:
        """Kill any unbroken run still going (a test failed before it read the weights)."""
        for proc, _ in self._runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


@pytest.fixture(scope="module")
def unbroken_run(tmp_path_factory: pytest.TempPathFactory):
    """The weights of 2k unbroken steps of checkpoint_resume.py with an optimizer's flags (states on the
    servers), launched once per optimizer: with the states in the workers they are the same bits."""
    runs = _Unbroken(tmp_path_factory)
    yield runs
    runs.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("update_on_kvstore", ["1", "0"], ids=["states-on-servers", "states-in-workers"])
@pytest.mark.parametrize("optimizer", [
    ["--optimizer", "sgd", "--momentum", "0.9", "--wd", "0.001"],
    ["--optimizer", "adam", "--lr-step", "3"],
], ids=["sgd-momentum", "adam-lr-schedule"])
def test_resume_on_a_fresh_cluster_matches_unbroken_run(tmp_path: Path, optimizer: list[str],
                                                        update_on_kvstore: str, unbroken_run) -> None:
    """2k unbroken steps (states on the servers) equal, bit for bit, k steps + a checkpoint + k more on a
    fresh cluster (other -s), with the states on the servers or in the workers."""
    pytest.importorskip("torch")
    script = ["examples/checkpoint_resume.py", *optimizer, "--update-on-kvstore", update_on_kvstore]
    env = RESUME_ENV
    unbroken_run.start(optimizer)  # alongside the broken run's two launches
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed.arrays"
    _launch(["-n", "2", "-s", "1", *script, "--steps", str(STEPS), "--save", str(ckpt)], 60, env)
    assert {p.name for p in ckpt.iterdir()} >= {"weights.arrays", "trainer.states", "meta.json"}
    output = _launch(["-n", "2", "-s", "2", *script, "--steps", str(STEPS), "--resume", str(ckpt),
                      "--out", str(resumed)], 60, env)
    assert f"steps {STEPS} to {2 * STEPS}" in output, output
    expected, got = unbroken_run.weights(optimizer), load_arrays(resumed)
    assert sorted(got) == sorted(expected) and len(expected) == 4
    for name, value in expected.items():
        assert got[name].dtype == value.dtype == np.float32, name
        assert np.array_equal(got[name], value), f"{name} differs after the resume"


@pytest.mark.examples  # second tier: the Spark launcher's runs are in launch/test_spark.py
@pytest.mark.timeout(180)
def test_spark_example_reaches_accuracy() -> None:
    """examples/spark_digits.py trains the digits MLP inside a local Spark application to >= 0.90."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    pytest.importorskip("pyspark")
    import shutil
    import sys

    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("pyspark needs Java (17 or newer), and there is none")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run([sys.executable, "examples/spark_digits.py"], cwd=Path(__file__).parents[2],
                          env=env, capture_output=True, text=True, timeout=160)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"final test accuracy (\d\.\d+)", proc.stdout)
    assert match and float(match.group(1)) >= 0.90, proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_pipeline_example_two_stages_two_replicas_through_launcher() -> None:
    """launch.py -n 4 -s 1: the digits MLP in 2 pipeline stages x 2 replicas (1f1b) reaches >= 0.90."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    output = _launch(["-n", "4", "-s", "1", "examples/pipeline_digits.py"], timeout=130)
    assert "4 workers: 2 stages x 2 replicas" in output, output
    assert _final_accuracy(output, worker=1) >= 0.90


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.seeds) for s in (1, 2))])
def test_pipeline_example_pipedream_trains_like_the_synchronous_schedules(seed: int) -> None:
    """launch.py -n 2 -s 1 --schedule pipedream at its default epochs (an update per micro-batch, evaluated
    through the pipeline on the last stage) ends >= 0.95 and within 0.01 of 1f1b's
    accuracy over the same 2 stages, at the default seed and two others (marked ``seeds``: second tier)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    common = ["-n", "2", "-s", "1", "examples/pipeline_digits.py", "--seed", str(seed), "--schedule"]
    runs = {schedule: launch(common + [schedule], dict(os.environ)) for schedule in ("pipedream", "1f1b")}
    outputs = {}
    for schedule, proc in runs.items():
        rc, outputs[schedule] = finish(proc, timeout=130)
        assert rc == 0, outputs[schedule]
    assert "2 stages x 1 replicas, balance [1, 6], pipedream" in outputs["pipedream"], outputs["pipedream"]
    pipedream, synchronous = (_final_accuracy(outputs[s], worker=1) for s in ("pipedream", "1f1b"))
    assert pipedream >= 0.95 and pipedream >= synchronous - 0.01, (pipedream, synchronous)

"""Workers that rejoin (launch.py --max-restarts): a worker killed mid-training is restarted with its
rank and a new incarnation, the others go on without it meanwhile, and the job ends as planned."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.checkpoint import load_arrays
from tests.helpers import REPO, poll_for, python

SCRIPT = Path(__file__).parent / "scripts" / "restart_train.py"
# short heartbeats; the 8x32 weight is sliced over both servers
ENV = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
       "KVSTORE_BIGARRAY_BOUND": "100", "KVSTORE_CONNECT_TIMEOUT": "60"}


class Launch:
    """``python launch.py ARGS`` with its output read line by line as it comes (``lines``)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self.tag = env.get("RESTART_TEST_TAG", "")
        self.proc = subprocess.Popen([python(), "launch.py", *args], cwd=REPO, env={**os.environ, **env},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        """Everything read so far."""
        return "".join(self.lines)

    def finish(self, timeout: float) -> int:
        """The launcher's exit code; past ``timeout`` its process group is killed and the test fails."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"launcher did not finish within {timeout} s:\n{self.output}") from None
        finally:
            self.reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the launcher's whole session (its roles are in sessions of their own: see teardown)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def role_pids(tag: str, marker: str) -> list[int]:
    """Live processes of the launch tagged ``tag`` whose environment holds ``marker`` (``NAME=VALUE``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            wanted = (f"RESTART_TEST_TAG={tag}\0".encode(), f"{marker}\0".encode())
            if all(part in environ for part in wanted):
                found.append(int(entry.name))
    return found


def worker_pids(tag: str, rank: int) -> list[int]:
    """Live worker processes of the launch tagged ``tag`` with rank ``rank``."""
    return role_pids(tag, f"DMLC_WORKER_ID={rank}")


@pytest.fixture
def launches():
    """Launches started by a test; every process they left is SIGKILLed at teardown."""
    started: list[tuple[Launch, str]] = []

    def start(args: list[str], env: dict[str, str]) -> Launch:
        tag = uuid.uuid4().hex
        run = Launch(args, {**ENV, **env, "RESTART_TEST_TAG": tag})
        started.append((run, tag))
        return run

    yield start
    for run, tag in started:
        if run.proc.poll() is None:
            run.kill()
        for entry in Path("/proc").iterdir():  # roles run in sessions of their own
            if entry.name.isdigit():
                try:
                    if f"RESTART_TEST_TAG={tag}\0".encode() in (entry / "environ").read_bytes():
                        os.kill(int(entry.name), signal.SIGKILL)
                except OSError:
                    continue


def _weights(path: Path) -> dict[str, np.ndarray]:
    """The arrays a worker of restart_train.py wrote."""
    return load_arrays(str(path))


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> dict[str, np.ndarray]:
    """Rank 0's final weights after an unbroken run of restart_train.py (12 steps, 2 workers, 2 servers)."""
    out = tmp_path_factory.mktemp("unbroken") / "base"
    run = Launch(["-n", "2", "-s", "2", str(SCRIPT), "12", str(out)], ENV)
    assert run.finish(60) == 0, run.output
    return _weights(out.parent / "base.0")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("death", [{"KVSTORE_TEST_DIE_AT_ROUND": "1:4", "KVSTORE_LOG_LEVEL": "INFO"},
                                   ["--raise-at", "4"]],
                         ids=["sigkill", "exception"])
def test_a_worker_killed_at_a_round_boundary_ends_with_the_unbroken_weights(
        launches, unbroken, tmp_path: Path, death) -> None:
    """Worker 1 dies after round 4 (SIGKILL, or an exception in its script) under --max-restarts 1:
    every worker's final weights equal an unbroken run's (fp32, 1e-6), the restart is logged, exit 0."""
    env, extra = (death, []) if isinstance(death, dict) else ({}, death)  # --raise-at: worker 1 only
    run = launches(["-n", "2", "-s", "2", "--max-restarts", "1", str(SCRIPT), "12", str(tmp_path / "kill"),
                    *extra], env)
    assert run.finish(60) == 0, run.output
    out = run.output
    assert re.search(r"worker 1 exited with code (137|1); restarting it as incarnation 1", out), out
    assert re.search(r"\[worker 1\] rejoined the cluster as incarnation 1 at round \d+", out), out
    if "KVSTORE_LOG_LEVEL" in env:  # each server forgets the rejoin once its rounds are past it
        for server in (0, 1):
            assert re.search(rf"\[server {server}\] .* worker 1's rejoin is complete on every key", out), out
    for rank in (0, 1):
        got = _weights(tmp_path / f"kill.{rank}")
        for name, value in unbroken.items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6, err_msg=f"{name} on rank {rank}")


@pytest.mark.timeout(90)
def test_in_dist_async_a_restarted_worker_goes_on_from_its_own_step(launches, tmp_path: Path) -> None:
    """dist_async: worker 1 killed after its 4th step rejoins at step 4 and does steps 4..11 only."""
    run = launches(["-n", "2", "-s", "2", "--max-restarts", "1", str(SCRIPT), "12", str(tmp_path / "a"),
                    "--mode", "dist_async"], {"KVSTORE_TEST_DIE_AT_ROUND": "1:4"})
    assert run.finish(60) == 0, run.output
    assert "[worker 1] rejoined the cluster as incarnation 1 at round 4" in run.output, run.output
    assert "[worker 1] done steps 4..12 as rank 1" in run.output, run.output


@pytest.mark.timeout(90)
def test_a_death_past_the_restart_budget_fails_the_job(launches, tmp_path: Path) -> None:
    """Both workers die at round 3 under --max-restarts 1: one is restarted, the second death fails
    the launch fast with its code, naming the used-up budget."""
    run = launches(["-n", "2", "-s", "1", "--max-restarts", "1", str(SCRIPT), "12", str(tmp_path / "w")],
                   {"KVSTORE_TEST_DIE_AT_ROUND": "3"})
    assert run.finish(60) == 137, run.output
    assert "restarts (--max-restarts) are used" in run.output, run.output


DIGITS = ["examples/train_digits.py", "--epochs", "20", "--optimizer", "adam", "--min-accuracy", "0"]


def _final_accuracy(output: str) -> float:
    found = re.findall(r"final test accuracy ([0-9.]+)", output)
    assert found, output
    return float(found[-1])


@pytest.mark.timeout(180)
def test_digits_survive_a_worker_sigkilled_at_a_random_time(launches) -> None:
    """train_digits.py under --max-restarts 1, worker 1 SIGKILLed at a random moment of its training:
    the job finishes and its accuracy is at least the unbroken run's - 0.01."""
    slow = ["--slow-rank", "0", "--slow-ms", "5"]  # the survivor's steps take long enough for a restart
    # A heartbeat timeout longer than a restart takes on a busy machine: the restart's registration, not
    # the timeout, ends the old incarnation, so the others wait for it (the away path, where they train
    # on without it, is the exactness tests' exception case).
    env = {"KVSTORE_HEARTBEAT_TIMEOUT": "15"}
    # The unbroken run goes alongside (dist_sync: its accuracy does not depend on the timing).
    base = launches(["-n", "2", "-s", "1", *DIGITS, *slow], env)
    run = launches(["-n", "2", "-s", "1", "--max-restarts", "1", *DIGITS, *slow], env)
    poll_for(lambda: "[worker 0] epoch   2" in run.output or run.proc.poll() is not None, 90,
             "worker 0's second epoch")
    assert run.proc.poll() is None, run.output
    time.sleep(random.uniform(0.0, 0.5))  # a random moment of the training (not a wait for a condition)
    pids = worker_pids(run.tag, 1)
    assert pids, run.output
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert run.finish(120) == 0, run.output
    assert base.finish(120) == 0, base.output
    assert "restarting it as incarnation 1" in run.output, run.output
    assert _final_accuracy(run.output) >= _final_accuracy(base.output) - 0.01, (base.output, run.output)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim, marker", [("scheduler", "DMLC_ROLE=scheduler")])
def test_the_scheduler_lost_past_the_restart_budget_fails_fast_and_named(
        launches, tmp_path: Path, victim: str, marker: str) -> None:
    """SIGKILL of the scheduler mid-training under --max-restarts 1: restarted once (issue 45: a
    scheduler that can die, test_scheduler_restarts.py); SIGKILLed again, past the budget, it is not
    restarted: the launcher stops the job at once and exits 137, naming it.  (A server is restarted
    from its shard there, with no settings: test_server_restarts.py.)"""
    run = launches(["-n", "2", "-s", "1", "--max-restarts", "1", str(SCRIPT), "100000", str(tmp_path / "w")],
                   {"KVSTORE_HEARTBEAT_TIMEOUT": "6"})  # a restarted scheduler's start, on a loaded machine
    training = ("[worker 0] training from step 0", "[worker 1] training from step 0")
    poll_for(lambda: all(t in run.output for t in training) or run.proc.poll() is not None, 60,
             "both workers training")
    assert run.proc.poll() is None, run.output
    pids = role_pids(run.tag, marker)
    assert len(pids) == 1, (pids, run.output)
    os.kill(pids[0], signal.SIGKILL)
    poll_for(lambda: "cluster rebuilt" in run.output or run.proc.poll() is not None, 60, "the rebuild")
    assert run.proc.poll() is None, run.output
    assert f"{victim} exited with code 137; restarting it as incarnation 1" in run.output, run.output
    pids = role_pids(run.tag, marker)
    assert len(pids) == 1, (pids, run.output)
    os.kill(pids[0], signal.SIGKILL)
    started = time.monotonic()
    assert run.finish(60) == 137, run.output
    assert time.monotonic() - started < 30, run.output  # the shutdown timeout (5 s) and the stops, not a hang
    assert f"{victim} exited with code 137; stopping the other processes" in run.output, run.output
    assert "scheduler failed: all 1 restarts (--max-restarts) are used" in run.output, run.output
    assert "restarting it as incarnation 2" not in run.output, run.output


@pytest.mark.timeout(120)
def test_a_lost_pipeline_stage_fails_the_job_even_under_max_restarts(launches) -> None:
    """SIGKILL of a pipeline stage's worker under --max-restarts 1: its restart is refused, the other
    stage raises NodeLostError naming it, and the launcher exits non-zero within seconds."""
    script = str(REPO / "examples" / "pipeline_digits.py")
    run = launches(["-n", "2", "-s", "1", "--max-restarts", "1", script, "--epochs", "1000"], {})
    poll_for(lambda: "stages x" in run.output or run.proc.poll() is not None, 90, "the pipeline training")
    assert run.proc.poll() is None, run.output
    pids = worker_pids(run.tag, 1)
    assert pids, run.output
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    assert run.finish(90) != 0, run.output
    assert time.monotonic() - started < 60, run.output
    assert "lost stages are not restarted" in run.output, run.output
    assert re.search(r"\[worker 0\].*worker 1 on \S+ is lost", run.output), run.output


SPARSE_SCRIPT = Path(__file__).parent / "scripts" / "sparse_rejoin_train.py"
SPARSE_STEPS = 12


def _sparse_reference() -> dict[str, np.ndarray]:
    """sparse_rejoin_train.py's rows and dense key after SPARSE_STEPS unbroken steps of 2 workers with
    the same batches, in one local store (each step's pushes summed, then sgd momentum)."""
    import importlib.util

    import kvstore
    from kvstore import RowSparse

    spec = importlib.util.spec_from_file_location("sparse_rejoin_train", SPARSE_SCRIPT)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    kv = kvstore.create("local")
    train.setup(kv)
    for step in range(SPARSE_STEPS):
        ids, grads, fixed, frows, dense = train.batch(step)
        kv.push("d", [RowSparse(ids, grads, shape=(0, train.WIDTH))] * 2)
        kv.push("f", [RowSparse(fixed, frows, shape=(train.FIXED_ROWS, train.WIDTH))] * 2)
        kv.push("w", [dense, dense])
    dynamic = kv.row_sparse_pull("d", row_ids=train.table_ids())
    return {"d_ids": dynamic.indices, "d_rows": dynamic.rows,
            "f_rows": kv.row_sparse_pull("f", row_ids=np.arange(train.FIXED_ROWS)).rows,
            "w": kv.pull("w")}


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_training_rejoins_the_row_sparse_tables(launches, tmp_path: Path) -> None:
    """Worker 1 SIGKILLed after the dense key's round 4, before its tables' round 3, under
    --max-restarts 1 (2 workers, 2 servers, a dynamic and a fixed table and a dense key, sgd momentum
    on the servers, the same batch on every worker): the tables' rounds closed without it (3 at
    least) are scaled by 2/1, it rejoins every table at the job's step, and every
    worker's final rows equal an unbroken run's exactly (x * 2.0 and g + g are the same floats)."""
    go = tmp_path / "go"
    run = launches(["-n", "2", "-s", "2", "--max-restarts", "1", str(SPARSE_SCRIPT), str(SPARSE_STEPS),
                    str(tmp_path / "w"), str(go)], {"KVSTORE_TEST_DIE_AT_ROUND": "1:4"})
    rejoined = re.compile(r"\[worker 1\] rejoined the cluster as incarnation 1 at round (\d+)")
    poll_for(lambda: rejoined.search(run.output) or run.proc.poll() is not None, 60, "worker 1's rejoin")
    go.write_text("go")  # worker 0 waits before step PAUSE (7): the rejoin lands mid-training
    assert run.finish(90) == 0, run.output
    out = run.output
    assert re.search(r"worker 1 exited with code 137; restarting it as incarnation 1", out), out
    found = rejoined.search(out)
    assert found and 4 <= int(found.group(1)) <= 7, out  # rounds 4.. closed without it, scaled
    want = _sparse_reference()
    for rank in (0, 1):
        got = _weights(tmp_path / f"w.{rank}")
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} on rank {rank}\n{out[-3000:]}")

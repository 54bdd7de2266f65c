"""kvstore.Session end to end: examples/train_digits.py (no checkpoint code of its own) resumes by itself
when a worker is SIGKILLed under --max-restarts and when the whole job is killed and relaunched, through
a real S3-compatible server on loopback; a crash while a checkpoint is written leaves the previous one."""

from __future__ import annotations

import os
import re
import signal

import numpy as np
import pytest

from kvstore.core import storage
from tests.helpers import poll_for
from tests.integration import test_restarts
from tests.integration.test_restarts import role_pids, worker_pids
from tests.s3server import s3_server

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from tests.unit.test_session import _job as unit_job  # noqa: E402 -- needs torch

# 2 workers x 10 epochs of 22 steps (673 samples each in batches of 32: 21 and one of 1): 220 in all
TOTAL = 220
DIGITS = ["examples/train_digits.py", "--epochs", "10", "--min-accuracy", "0"]
ENV = {"KVSTORE_LOG_LEVEL": "INFO", "KVSTORE_HEARTBEAT_TIMEOUT": "15"}


launches = test_restarts.launches  # launch.py runs whose processes are all SIGKILLed at teardown


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server for this module's tests; yields the bucket's URL."""
    with s3_server() as url:
        yield url


@pytest.fixture(scope="module")
def unbroken():
    """The unbroken digits run both launch tests compare with, started once (alongside the first test's
    own launches); yields a callable that waits for it and returns its final test accuracy."""
    run = test_restarts.Launch(["-n", "2", "-s", "1", *DIGITS], {**test_restarts.ENV, **ENV})

    def accuracy() -> float:
        assert run.finish(120) == 0, run.output
        return _accuracy(run.output)

    yield accuracy
    if run.proc.poll() is None:
        run.kill()


def _accuracy(output: str) -> float:
    found = re.findall(r"\[worker 0\] final test accuracy ([0-9.]+)", output)
    assert found, output
    return float(found[-1])


def _complete_steps(url: str) -> list[int]:
    """The steps of the complete checkpoints under ``url`` (those with a session.json)."""
    try:
        names = storage.listdir(url)
    except FileNotFoundError:
        return []
    return sorted(int(n[5:]) for n in names
                  if n.startswith("step-") and storage.exists(f"{url}/{n}/session.json"))


def _kill_job(tag: str) -> None:
    """SIGKILL every process of the launch tagged ``tag``: the launcher, scheduler, servers, workers."""
    for pid in role_pids(tag, f"RESTART_TEST_TAG={tag}"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(180)
def test_a_job_killed_whole_and_relaunched_resumes_from_its_newest_s3_checkpoint(launches, unbroken,
                                                                                 s3: str) -> None:
    """The whole digits job SIGKILLed after its checkpoint of step 60 or later on S3; the same command
    relaunched resumes from the newest complete checkpoint (logged) and ends within 0.01 of an unbroken
    run's test accuracy (dist_sync, 2 workers: the very same weights)."""
    url = f"{s3}/relaunch"
    command = ["-n", "2", "-s", "1", *DIGITS, "--checkpoint", url, "--checkpoint-every", "20",
               "--slow-rank", "0", "--slow-ms", "10"]
    first = launches(command, ENV)
    poll_for(lambda: any(s >= 60 for s in _complete_steps(url)) or first.proc.poll() is not None, 120,
             "a checkpoint of step 60 or later")
    assert first.proc.poll() is None, first.output
    _kill_job(first.tag)
    first.proc.wait(30)
    saved = _complete_steps(url)
    assert saved and max(saved) < TOTAL, (saved, first.output)  # killed mid-training
    second = launches(command, ENV)
    assert second.finish(120) == 0, second.output
    resumed = re.search(r"\[worker 0\] resumed from \S+/step-(\d+) at step (\d+)", second.output)
    assert resumed, second.output
    assert int(resumed.group(1)) == int(resumed.group(2)) >= max(saved)
    assert "final test accuracy" not in first.output
    assert abs(_accuracy(second.output) - unbroken()) <= 0.01, second.output
    assert _complete_steps(url)[-1] == TOTAL


@pytest.mark.timeout(180)
def test_a_worker_sigkilled_under_max_restarts_goes_on_at_the_jobs_step(launches, unbroken, s3: str) -> None:
    """Worker 1 SIGKILLed mid-training under --max-restarts 1 with checkpoints on S3: its restart's Session
    goes on at the job's step (rejoined, logged) without loading a checkpoint, and the job ends within
    0.01 of an unbroken run's test accuracy."""
    url = f"{s3}/rejoin"
    run = launches(["-n", "2", "-s", "1", "--max-restarts", "1", *DIGITS, "--checkpoint", url,
                    "--checkpoint-every", "20", "--slow-rank", "0", "--slow-ms", "10"], ENV)
    poll_for(lambda: any(s >= 40 for s in _complete_steps(url)) or run.proc.poll() is not None, 120,
             "a checkpoint of step 40 or later")
    assert run.proc.poll() is None, run.output
    pids = worker_pids(run.tag, 1)
    assert pids, run.output
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert run.finish(120) == 0, run.output
    assert "restarting it as incarnation 1" in run.output, run.output
    rejoined = re.search(r"\[worker 1\] rejoined the job at step (\d+)", run.output)
    assert rejoined and 40 <= int(rejoined.group(1)) < TOTAL, run.output
    assert "resumed from" not in run.output, run.output
    assert abs(_accuracy(run.output) - unbroken()) <= 0.01, run.output


class _Crash(BaseException):
    """The process dying in the middle of a write (nothing catches it)."""


def _job(url: str, **session_args):
    """The unit tests' local-store job under adam on 64 samples, checkpointing to ``url``; returns
    (model, session, step_fn)."""
    return unit_job(url, None, ("adam", {"learning_rate": 0.01}), 64, **session_args)


@pytest.mark.timeout(60)
def test_a_crash_while_writing_an_s3_checkpoint_resumes_from_the_previous_one(s3: str, monkeypatch) -> None:
    """A process that dies while writing the checkpoint of step 8 to S3 (its weights and states written,
    its session.json not) leaves step 4 the newest complete one; a new Session resumes there and ends
    with exactly the weights of an unbroken run."""
    unbroken, session, step = _job(f"{s3}/unbroken")
    session.run(step, 64, 8, 3)

    url = f"{s3}/crash"
    real = storage.atomic_write

    def dying(location, fill) -> None:
        if str(location).endswith("step-00000008/session.json"):
            raise _Crash(location)
        real(location, fill)

    monkeypatch.setattr(storage, "atomic_write", dying)
    _, crashing, step = _job(url, every_steps=4)
    with pytest.raises(_Crash):
        crashing.run(step, 64, 8, 3)
    monkeypatch.undo()
    assert sorted(storage.listdir(f"{url}/step-00000008")) == ["trainer.states", "weights.arrays"]
    assert _complete_steps(url) == [4]

    model, resumed, step = _job(url, every_steps=4)
    assert resumed.run(step, 64, 8, 3) == 24
    assert resumed.start_step == 4
    for (name, got), want in zip(model.named_parameters(), unbroken.parameters()):
        np.testing.assert_array_equal(got.detach().numpy(), want.detach().numpy(), err_msg=name)
    assert "step-00000008" not in storage.listdir(url)  # the leftover was removed by a later save

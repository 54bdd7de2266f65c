"""Storage URLs against a real S3-compatible server on loopback (moto, tests/s3server.py): checkpoints,
launch.py --resume, server shards and a server restarted from them, optimizer-state files, and a
writer SIGKILLed mid-write, all on s3://."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.core import checkpoint, snapshot, storage
from kvstore.server.shards import shard_files
from tests.helpers import REPO, finish, launch, poll_for
from tests.integration.launch.test_tensorboard import kept_pids  # noqa: F401 -- the fixture
from tests.integration.test_restarts import launches  # noqa: F401 -- the fixture
from tests.integration.test_server_restarts import STEPS, WORKERS
from tests.integration.test_server_restarts import _run as run_server_restart
from tests.integration.test_snapshot import ENV as SNAPSHOT_ENV
from tests.integration.test_snapshot import SCRIPT as SNAPSHOT_SCRIPT
from tests.integration.test_snapshot import same_as_unbroken
from tests.s3server import s3_server

CRASH_SCRIPT = Path(__file__).parent / "scripts" / "storage_crash_write.py"
SCALAR_SCRIPT = Path(__file__).parent / "scripts" / "scalar_train.py"


@pytest.fixture(scope="module")
def bucket() -> str:
    """The s3:// URL of a bucket on a moto server started for this module (endpoint in the env)."""
    with s3_server() as url:
        yield url


@pytest.fixture
def s3(bucket: str) -> str:
    """A fresh prefix in the bucket for one test."""
    return f"{bucket}/{uuid.uuid4().hex}"


def test_save_checkpoint_and_state_files_round_trip_through_s3(s3: str) -> None:
    """kv.save_checkpoint to s3:// reads back (values and optimizer state, previous generation kept);
    save_optimizer_states/load_optimizer_states and Trainer.save_states/load_states use s3:// files."""
    import torch

    kv = kvstore.create("local")
    kv.init("w", np.zeros(3, np.float32))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0, momentum=0.5))
    for _ in range(3):
        kv.push("w", np.ones(3, np.float32))
        kv.save_checkpoint(f"{s3}/ckpt")
    assert sorted(storage.listdir(f"{s3}/ckpt")) == ["LATEST", "snapshot-000002", "snapshot-000003"]
    values, states = snapshot.read(f"{s3}/ckpt")
    np.testing.assert_array_equal(values["w"], np.full(3, -4.25, np.float32))
    assert states.num_update == 3
    kv.save_optimizer_states(f"{s3}/opt.states", dump_optimizer=True)
    fresh = kvstore.create("local")
    fresh.init("w", np.zeros(3, np.float32))
    fresh.load_optimizer_states(f"{s3}/opt.states")
    assert fresh.get_optimizer().num_update == 3

    model = torch.nn.Linear(2, 1)
    trainer = kvstore.Trainer(model.named_parameters(), "adam", {"learning_rate": 0.1},
                              kvstore=kvstore.create("local"), key_prefix="m")
    model(torch.ones(1, 2)).sum().backward()
    trainer.step(1)
    trainer.save_states(f"{s3}/trainer.states")
    saved = checkpoint.read_states(f"{s3}/trainer.states")
    again = kvstore.Trainer(model.named_parameters(), "sgd", {"learning_rate": 0.1},
                            kvstore=kvstore.create("local"), key_prefix="m")
    again.load_states(f"{s3}/trainer.states")
    assert saved.optimizer["name"] == "adam" and again.optimizer.spec()["name"] == "adam"
    assert sorted(n for n in storage.listdir(s3)) == ["ckpt", "opt.states", "trainer.states"]


@pytest.mark.timeout(120)
def test_launch_resume_from_s3_continues_the_unbroken_run(s3: str, tmp_path: Path) -> None:
    """3 steps + kv.save_checkpoint(s3://...) and 3 more under launch.py --resume s3://... end with the
    weights of 6 unbroken steps, bit for bit."""
    env = {**os.environ, **SNAPSHOT_ENV}
    unbroken, resumed = tmp_path / "unbroken.arrays", tmp_path / "resumed.arrays"
    alongside = launch(["-n", "1", "-s", "1", str(SNAPSHOT_SCRIPT), "sgd", "0", "6", "--out", str(unbroken)],
                       env)

    def broken() -> None:
        rc, out = finish(launch(["-n", "1", "-s", "1", str(SNAPSHOT_SCRIPT), "sgd", "0", "3", "--save",
                                 f"{s3}/snap"], env), 60)
        assert rc == 0, out
        assert storage.read_text(f"{s3}/snap/LATEST") == "snapshot-000001\n"
        rc, out = finish(launch(["-n", "1", "-s", "1", "--resume", f"{s3}/snap", str(SNAPSHOT_SCRIPT), "sgd",
                                 "3", "6", "--out", str(resumed)], env), 60)
        assert rc == 0, out
    same_as_unbroken(alongside, unbroken, resumed, broken, 60)


def test_resume_from_an_empty_s3_prefix_is_refused(s3: str) -> None:
    """launch.py --resume s3://... with no snapshot there fails at once, saying so."""
    rc, out = finish(launch(["-n", "1", "--resume", f"{s3}/none", str(SNAPSHOT_SCRIPT), "sgd", "0", "1"]), 30)
    assert rc != 0 and "no snapshot there" in out


@pytest.mark.timeout(150)
def test_a_sigkilled_server_restarts_from_its_shard_on_s3(launches, s3: str, tmp_path: Path) -> None:  # noqa: F811
    """KVSTORE_SNAPSHOT_DIR=s3://...: servers write their shards there, and server 1, SIGKILLed at its
    25th round, restarts from its newest shard there; every element misses only the rounds its log
    says were lost."""
    shards = {"KVSTORE_SNAPSHOT_DIR": f"{s3}/shards",  # a shard on s3 takes a few requests: die later
              "KVSTORE_TEST_SERVER_DIE_AT_ROUND": "1:25"}
    output, values = run_server_restart(launches, tmp_path, "dist_sync", shards, 1)
    assert "could not write" not in output, output
    found = re.search(r"\[server 1\].*lost (\d+)(?: to (\d+))? rounds of updates", output)
    assert found, output
    most = int(found.group(2) or found.group(1))
    allowed = {-WORKERS * (STEPS - lost) for lost in range(most + 1)}
    seen = set(np.concatenate([v.ravel() for v in values[0].values()]).tolist())
    assert seen <= allowed and -WORKERS * STEPS in seen, (seen, allowed, output[-3000:])
    for rank in range(2):
        files = shard_files(f"{s3}/shards", rank)
        assert 1 <= len(files) <= 2, files
        assert all(p.startswith(f"{s3}/shards/server-{rank}/shard-") for _, p in files), files
    assert not (tmp_path / "shards").exists()


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_write_leaves_the_previous_generation_on_s3(s3: str) -> None:
    """SIGKILL while a generation's optimizer-state file is half sent (a multipart upload under way):
    LATEST names the previous generation, which reads back; the half-sent file is nowhere; the next
    write takes a new number and removes the half-written generation, keeping the previous one."""
    url = f"{s3}/snap"
    proc = subprocess.Popen([sys.executable, str(CRASH_SCRIPT), url], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        assert line.strip() == "mid-write", line + proc.stdout.read()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert storage.read_text(f"{url}/LATEST") == "snapshot-000001\n"
    values, states = snapshot.read(url)
    np.testing.assert_array_equal(values[1], np.zeros(4))
    assert states is None
    assert storage.listdir(f"{url}/snapshot-000002") == ["values.arrays"]  # no trace of the states file
    assert snapshot.write(url, {1: np.full(4, 3.0)}, None) == f"{url}/snapshot-000003"
    assert sorted(storage.listdir(url)) == ["LATEST", "snapshot-000001", "snapshot-000003"]
    np.testing.assert_array_equal(snapshot.read(url)[0][1], np.full(4, 3.0))


@pytest.mark.timeout(120)
def test_tensorboard_on_s3_serves_every_roles_counters_from_the_store(s3: str, kept_pids) -> None:  # noqa: F811
    """launch.py --tensorboard s3://...: the event files are written to the store in parts (no append
    there) and the real TensorBoard, reading the store, lists every role's counters and the loss."""
    pytest.importorskip("tensorboard")
    from tests.integration.launch.test_tensorboard import EXPECTED, _run_job, _tags

    url, pid, out = _run_job(f"{s3}/tb", "--tensorboard-keep")
    kept_pids.append(pid)
    (job,) = storage.listdir(f"{s3}/tb")
    assert job.startswith("job-"), out
    assert sorted(storage.listdir(f"{s3}/tb/{job}")) == ["scheduler", "server-0", "worker-0", "worker-1"]
    parts = storage.listdir(f"{s3}/tb/{job}/worker-0")
    assert parts and all(name.startswith("events.out.tfevents.") for name in parts), parts

    def complete() -> bool:
        tags = _tags(url)
        return all(want <= tags.get(run, set()) for run, want in EXPECTED.items())

    poll_for(complete, 60, f"every role's tags at {url} (read from s3): {EXPECTED}", interval=0.5)


@pytest.mark.timeout(90)
def test_a_timeline_on_s3_holds_every_roles_events(s3: str) -> None:
    """KVSTORE_TIMELINE=s3://.../trace.json: each role writes its part to the store (whole, no append),
    and the launcher merges them there into one trace with every role's pushes or rounds."""
    import json

    trace = f"{s3}/trace.json"
    env = {**os.environ, "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
           "KVSTORE_TIMELINE": trace}
    code, out = finish(launch(["-n", "2", "-s", "1", str(SCALAR_SCRIPT), "20"], env), timeout=60)
    assert code == 0, out
    assert sorted(storage.listdir(f"{trace}.d")) == ["scheduler-0.json", "server-0.json", "worker-0.json",
                                                     "worker-1.json"]
    events = json.loads(storage.read_text(trace))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["scheduler", "server 0", "worker 0", "worker 1"]
    spans = [e for e in events if e.get("ph") == "X"]
    pushes = [e for e in spans if e["name"] == "push"]
    assert sum(names[e["pid"]] == "worker 0" for e in pushes) == 20, out
    assert sum(names[e["pid"]] == "worker 1" for e in pushes) == 20, out
    assert any(e["name"].startswith("round") for e in spans if names[e["pid"]] == "server 0")

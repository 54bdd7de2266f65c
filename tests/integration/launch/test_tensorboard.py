"""launch.py --tensorboard end to end: a real job, the real TensorBoard server and its HTTP API, and
the process gone after the job (or kept with --tensorboard-keep until the test stops it)."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvstore.net import transport
from tests.helpers import finish, launch, poll_for

pytest.importorskip("tensorboard")
pytestmark = pytest.mark.timeout(90)

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "scalar_train.py")
ANNOUNCED = re.compile(r"TensorBoard at (http://\S+) \(logdir .*, pid (\d+)\)")
# every role's counters (one each) and the user's loss on every worker
EXPECTED = {"scheduler": {"barriers", "joins"}, "server-0": {"rounds_applied", "bytes_in"},
            "worker-0": {"ops/push", "latency/push/p50_ms", "loss"},
            "worker-1": {"ops/push", "blocked_s/pull", "loss"}}


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie is not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def kept_pids():
    """Pids of TensorBoards a test left running: killed at teardown."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            poll_for(lambda pid=pid: not _alive(pid), 10, f"TensorBoard {pid} to die")


def _run_job(logdir: Path, *flags: str) -> tuple[str, int, str]:
    """Run the small training job with --tensorboard; return (url, TensorBoard's pid, output)."""
    env = {**os.environ, "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
           "KVSTORE_LOG_LEVEL": "INFO"}
    env.pop("TENSORBOARD_PORT", None)  # a free port
    proc = launch(["-n", "2", "-s", "1", "--tensorboard", str(logdir), *flags, SCRIPT, "100"], env)
    try:
        code, out = finish(proc, timeout=60)
    except AssertionError as exc:  # the launcher was killed: the TensorBoard it announced must go too
        for _, pid in ANNOUNCED.findall(str(exc)):
            os.kill(int(pid), signal.SIGKILL)
        raise
    assert code == 0, out
    found = ANNOUNCED.findall(out)
    assert len(found) == 1, out  # printed once
    return found[0][0], int(found[0][1]), out


def _tags(url: str) -> dict[str, set[str]]:
    """TensorBoard's scalar tags by run (the job folder left out); {} while it does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/data/plugin/scalars/tags", timeout=5) as reply:
            body = json.load(reply)
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    return {run.rsplit("/", 1)[-1]: set(tags) for run, tags in body.items()}


def test_kept_tensorboard_serves_every_roles_counters_and_the_loss(tmp_path: Path, kept_pids) -> None:
    """--tensorboard-keep: after the job TensorBoard still runs and lists every role's counters and the
    workers' loss; stopping it ends its process."""
    url, pid, out = _run_job(tmp_path / "tb", "--tensorboard-keep")
    kept_pids.append(pid)
    assert f"kill {pid}" in out

    def complete() -> bool:
        tags = _tags(url)
        return all(want <= tags.get(run, set()) for run, want in EXPECTED.items())

    poll_for(complete, 40, f"every role's tags at {url}: {EXPECTED}", interval=0.5)
    runs = [p.name for p in next((tmp_path / "tb").glob("job-*")).iterdir()]
    assert sorted(runs) == ["scheduler", "server-0", "worker-0", "worker-1"]
    os.kill(pid, signal.SIGTERM)
    poll_for(lambda: not _alive(pid), 20, "the kept TensorBoard to stop")


def test_tensorboard_is_stopped_after_the_job(tmp_path: Path, kept_pids) -> None:
    """Without --tensorboard-keep the launcher stops TensorBoard before it exits."""
    _, pid, out = _run_job(tmp_path / "tb")
    kept_pids.append(pid)  # killed at teardown should the launcher have left it
    assert not _alive(pid), out
    assert "keeps running" not in out


def _last_values(run_dir: Path, tags: set[str]) -> dict[str, float]:
    """The last value written for each of ``tags`` in the event files of ``run_dir`` (one role's run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not run_dir.is_dir():
        return {}
    events = EventAccumulator(str(run_dir), purge_orphaned_data=False)
    events.Reload()
    found = set(events.Tags()["scalars"]) & tags
    return {tag: events.Scalars(tag)[-1].value for tag in found}


def test_a_short_job_writes_every_roles_final_counters(tmp_path: Path, kept_pids) -> None:
    """A job shorter than a heartbeat: TensorBoard gets every worker's and server's final counters."""
    steps = 3
    env = {**os.environ, "KVSTORE_SHUTDOWN_TIMEOUT": "5"}
    env.pop("TENSORBOARD_PORT", None)
    env.pop("KVSTORE_HEARTBEAT_INTERVAL", None)  # the default (1 s): the job ends within a beat or two
    proc = launch(["-n", "2", "-s", "1", "--tensorboard", str(tmp_path / "tb"), SCRIPT, str(steps)], env)
    code, out = finish(proc, timeout=60)
    kept_pids.extend(int(pid) for _, pid in ANNOUNCED.findall(out))
    assert code == 0, out
    job = next((tmp_path / "tb").glob("job-*"))
    for rank in (0, 1):
        got = _last_values(job / f"worker-{rank}", {"ops/push", "ops/pull"})
        assert got == {"ops/push": steps, "ops/pull": steps}, (rank, got, out)
    assert _last_values(job / "server-0", {"rounds_applied"}) == {"rounds_applied": steps}, out


def test_a_full_disk_is_one_warning_then_one_line_when_it_writes_again(tmp_path: Path) -> None:
    """Event files that cannot grow (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC): one warning, no
    traceback, one line once they can be written again, and the file TensorBoard reads stays whole."""
    import subprocess
    import sys

    polls, limit = 20, 1500
    script = str(Path(__file__).parents[1] / "scripts" / "tensorboard_full_disk.py")
    done = subprocess.run([sys.executable, script, str(tmp_path / "run"), str(polls), str(limit)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 0 < int(done.stdout) < polls, done.stdout  # some written before the limit, then refused
    lines = done.stderr.splitlines()
    assert len([line for line in lines if line.startswith("WARNING")]) == 1, done.stderr
    assert len([line for line in lines if line.endswith("are written again")]) == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    files = list((tmp_path / "run" / "scheduler").iterdir())
    assert len(files) == 1 and files[0].stat().st_size <= limit + 400, files
    assert _last_values(tmp_path / "run" / "scheduler", {"joins"}) == {"joins": polls}


HISTOGRAM_SCRIPT = str(Path(__file__).parents[1] / "scripts" / "histogram_train.py")


def test_trainer_histograms_reach_the_workers_event_files(tmp_path: Path, kept_pids) -> None:
    """KVSTORE_HISTOGRAM_EVERY=2: every worker's run has weights/ and grads/ histograms of each parameter,
    the last one at the last recorded step, counting the parameter's elements."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    env = {**os.environ, "KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_HISTOGRAM_EVERY": "2",
           "KVSTORE_HEARTBEAT_INTERVAL": "0.2"}
    env.pop("TENSORBOARD_PORT", None)
    proc = launch(["-n", "2", "-s", "1", "--tensorboard", str(tmp_path / "tb"), HISTOGRAM_SCRIPT, "6"], env)
    code, out = finish(proc, timeout=60)
    kept_pids.extend(int(pid) for _, pid in ANNOUNCED.findall(out))
    assert code == 0, out
    job = next((tmp_path / "tb").glob("job-*"))
    sizes = {"net.0.weight": 128, "net.0.bias": 16, "net.2.weight": 32, "net.2.bias": 2}
    for rank in (0, 1):
        events = EventAccumulator(str(job / f"worker-{rank}"), purge_orphaned_data=False)
        events.Reload()
        tags = set(events.Tags()["histograms"])
        assert tags == {f"{k}/{name}" for k in ("weights", "grads") for name in sizes}, (rank, tags, out)
        for name, size in sizes.items():
            last = events.Histograms(f"weights/{name}")[-1]
            assert last.step == 6 and last.histogram_value.num == size, (rank, name, last)
            grads = events.Histograms(f"grads/{name}")[-1].histogram_value
            assert sum(grads.bucket) == size and grads.min <= grads.max


def test_a_writer_polling_later_than_the_linger_still_gets_the_final_counters(tmp_path: Path,
                                                                              make_cluster) -> None:
    """A TensorBoard writer whose next poll comes later than STATUS_LINGER after its last one (a loaded
    driver) still writes the worker's final counters: the exiting scheduler holds for it."""
    from kvstore.launch.tensorboard import ScalarWriter

    # no periodic beat during the job: the counters reach the scheduler only when the worker leaves
    cluster = make_cluster(num_workers=1, num_servers=1, KVSTORE_HEARTBEAT_INTERVAL=30,
                           KVSTORE_HEARTBEAT_TIMEOUT=120)
    where = transport.address("127.0.0.1", int(cluster.env["DMLC_PS_ROOT_PORT"]))
    # polls at once, then 5 s after each reply: twice STATUS_LINGER (2.5 s), past any window of it
    writer = ScalarWriter(str(tmp_path / "run"), cluster.cfg, where, interval=5.0)
    writer.start()
    try:
        poll_for(lambda: writer.polls >= 1, 30, "the writer's first STATUS")
        kv = cluster.workers[0]
        kv.init("w", np.zeros(4, np.float32))
        for _ in range(3):
            kv.push("w", np.ones(4, np.float32))
        kv.close()
        scheduler = cluster.procs.procs[0][1]
        poll_for(lambda: scheduler.poll() is not None, 30, "the scheduler to exit")
    finally:
        writer.stop()
    assert scheduler.returncode == 0, cluster.procs.output()
    assert _last_values(tmp_path / "run" / "worker-0", {"ops/push"}) == {"ops/push": 3}, \
        cluster.procs.output()

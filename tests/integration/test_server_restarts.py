"""Servers restarted from their own shards (launch.py --max-restarts with KVSTORE_SNAPSHOT_EVERY): a
server SIGKILLed mid-training comes back from its latest shard, the workers align with it and send
their unanswered pushes again, the job finishes, and only the rounds the log names are lost."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.checkpoint import load_arrays
from tests.helpers import poll_for
from tests.integration.test_restarts import launches, role_pids  # noqa: F401 -- the fixture

SCRIPT = Path(__file__).parent / "scripts" / "server_restart_train.py"
STEPS, WORKERS = 40, 2


def _run(launches, tmp_path: Path, mode: str, extra: dict[str, str],  # noqa: F811
         restarts: int) -> tuple[str, list[dict[str, np.ndarray]]]:
    """Launch 2 workers and 2 servers, server 1 SIGKILLed at its 12th round; the output and the values."""
    env = {"KVSTORE_SNAPSHOT_EVERY": "5", "KVSTORE_SNAPSHOT_DIR": str(tmp_path / "shards"),
           "KVSTORE_TEST_SERVER_DIE_AT_ROUND": "1:12", **extra}
    run = launches(["-n", str(WORKERS), "-s", "2", "--max-restarts", str(restarts), str(SCRIPT), str(STEPS),
                    str(tmp_path / "w"), mode], env)
    assert run.finish(120) == 0, run.output
    assert "server 1 exited with code 137; restarting it as incarnation 1" in run.output, run.output
    assert "did not confirm shutdown" not in run.output, run.output  # the restarted one stopped cleanly
    return run.output, [load_arrays(str(tmp_path / f"w.{rank}")) for rank in range(WORKERS)]


@pytest.mark.timeout(150)
def test_a_sigkilled_server_restarts_from_its_shard_and_loses_only_the_rounds_it_logs(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """dist_sync: every element held by the restarted server misses only rounds its log says were
    lost (per key), every other element has every round, and no round is applied twice; a worker killed later
    (at round 25) rejoins the restarted server by its new name and goes on from the job's step."""
    output, values = _run(launches, tmp_path, "dist_sync", {"KVSTORE_TEST_DIE_AT_ROUND": "1:25"}, 2)
    assert "worker 1 exited with code 137; restarting it as incarnation 1" in output, output
    found = re.search(r"\[server 1\].*lost (\d+)(?: to (\d+))? rounds of updates", output)
    assert found, output
    fewest, most = int(found.group(1)), int(found.group(2) or found.group(1))
    killed_at = int(re.search(r"killing server 1 at step (\d+)", output).group(1))  # 12, or a round later
    assert 0 <= fewest <= most <= killed_at, output  # when the hook waited for a shard's write
    whole = -WORKERS * STEPS
    allowed = {whole} | {-WORKERS * (STEPS - lost) for lost in range(fewest, most + 1)}
    for name in values[0]:
        assert np.array_equal(values[0][name], values[1][name]), name
    seen = set(np.concatenate([v.ravel() for v in values[0].values()]).tolist())
    assert seen <= allowed, (seen, allowed, output[-3000:])
    assert whole in seen  # server 0's elements
    assert -WORKERS * (STEPS - most) in seen  # the key of server 1 that lost the most
    assert re.search(r"\[worker [01]\] server 1 restarted \(incarnation 1\).*aligned", output), output


@pytest.mark.timeout(150)
def test_in_dist_async_a_retried_push_is_applied_at_most_once(launches, tmp_path: Path) -> None:  # noqa: F811
    """dist_async: the job finishes after the restart; no element has more pushes applied than were made."""
    output, values = _run(launches, tmp_path, "dist_async", {}, 1)
    for name in values[0]:
        assert np.array_equal(values[0][name], values[1][name]), name
    every = np.concatenate([v.ravel() for v in values[0].values()])
    assert every.min() >= -WORKERS * STEPS, (every.min(), output)
    assert every.max() < 0, output
    assert "workers aligned after the restart" in output, output


@pytest.mark.timeout(150)
def test_a_worker_and_a_server_killed_together_both_come_back(launches, tmp_path: Path) -> None:  # noqa: F811
    """A host failure: worker 1 and server 1 die at the same round. The restarted worker joins while the
    server is dead or aligning (its ALIGN says it is still rejoining), the job finishes, and every
    element has every round but those server 1's log says were lost."""
    env = {"KVSTORE_SNAPSHOT_EVERY": "5", "KVSTORE_SNAPSHOT_DIR": str(tmp_path / "shards"),
           "KVSTORE_TEST_SERVER_DIE_AT_ROUND": "1:25", "KVSTORE_TEST_DIE_AT_ROUND": "1:25"}
    run = launches(["-n", str(WORKERS), "-s", "2", "--max-restarts", "3", str(SCRIPT), str(STEPS),
                    str(tmp_path / "w"), "dist_sync"], env)
    assert run.finish(120) == 0, run.output
    output = run.output
    assert "server 1 exited with code 137" in output and "worker 1 exited with code 137" in output, output
    found = re.search(r"\[server 1\].*lost (\d+)(?: to (\d+))? rounds of updates", output)
    assert found, output
    most = int(found.group(2) or found.group(1))
    values = [load_arrays(str(tmp_path / f"w.{rank}")) for rank in range(WORKERS)]
    for name in values[0]:
        assert np.array_equal(values[0][name], values[1][name]), name
    allowed = {-WORKERS * (STEPS - lost) for lost in range(most + 1)}
    seen = set(np.concatenate([v.ravel() for v in values[0].values()]).tolist())
    assert seen <= allowed, (seen, allowed, output[-3000:])


EMPTY_SCRIPT = Path(__file__).parent / "scripts" / "empty_server_train.py"
HOLDS = re.compile(r"server (\d) wrote shard \d+ \(step \d+, keys 1\)")
DEFAULT_DIR = re.compile(r"servers' shards in (\S+) \(this job's own")


def _kill_server_then_go(launches, tmp_path: Path, holder: bool) -> str:  # noqa: F811
    """Two workers and two servers under --max-restarts 1 and no shard settings; SIGKILL the server that
    holds the one key (``holder``) or the other, let the workers finish once it is restarted; the output."""
    go = tmp_path / "go"
    env = {"KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_LOG_LEVEL": "INFO"}
    run = launches(["-n", "2", "-s", "2", "--max-restarts", "1", str(EMPTY_SCRIPT), "20", str(go)], env)
    poll_for(lambda: HOLDS.search(run.output) and "[worker 0] step 10" in run.output, 60,
             f"the key's shard and 10 steps:\n{run.output}")
    held = int(HOLDS.search(run.output).group(1))
    victim = held if holder else 1 - held
    # the victim's first shard is written just after it serves (fsync'd: seconds under a busy disk);
    # killed before it, a server has nothing to restart from and the job fails, by design
    poll_for(lambda: f"server {victim} wrote shard 1 " in run.output, 60,
             f"server {victim}'s first shard:\n{run.output}")
    (pid,) = role_pids(run.tag, f"KVSTORE_SERVER_ID={victim}")
    os.kill(pid, signal.SIGKILL)
    poll_for(lambda: "restarting it as incarnation 1" in run.output, 60, f"the restart:\n{run.output}")
    go.write_text("go")
    assert run.finish(90) == 0, run.output
    assert f"server {victim} exited with code -9; restarting it as incarnation 1" in run.output or \
        f"server {victim} exited with code 137; restarting it as incarnation 1" in run.output, run.output
    assert "[worker 0] done as rank 0" in run.output and "[worker 1] done as rank 1" in run.output
    folder = DEFAULT_DIR.search(run.output)
    assert folder and not os.path.exists(folder.group(1)), run.output  # removed after the job
    return run.output


@pytest.mark.timeout(300)
def test_without_shard_settings_a_sigkilled_server_restarts_from_a_shard_of_the_job(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """--max-restarts alone: the server holding the key writes shards to a folder of the job's own (removed
    after it), is SIGKILLed, restarts from its shard, and the job's last round sums right on every worker."""
    _kill_server_then_go(launches, tmp_path, holder=True)


@pytest.mark.timeout(300)
def test_a_server_that_holds_no_key_restarts_empty(launches, tmp_path: Path) -> None:  # noqa: F811
    """The server that holds no key has an (empty) shard from its start: SIGKILLed, it restarts empty
    instead of failing the job with no shard to restart from."""
    output = _kill_server_then_go(launches, tmp_path, holder=False)
    assert "no shard to restart from" not in output, output


@pytest.mark.timeout(120)
def test_a_server_killed_right_after_set_optimizer_returns_restarts_with_the_optimizer(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """A server acknowledges set_optimizer once a shard holding it is written: SIGKILLed the moment the
    call returns (its shard of the freshly initialised 64 MB key may still be in flight), it restarts
    with sgd and every later push is an sgd step (-1 each), never a value stored as pushed (+1)."""
    ready, go, out = tmp_path / "ready", tmp_path / "go", tmp_path / "w"
    env = {"KVSTORE_SNAPSHOT_EVERY": "3600s", "KVSTORE_SNAPSHOT_DIR": str(tmp_path / "shards")}
    run = launches(["-n", "1", "-s", "1", "--max-restarts", "1", str(OPTIMIZER_SCRIPT), "3", str(16 << 20),
                    str(ready), str(go), str(out)], env)
    poll_for(ready.exists, 60, f"set_optimizer to return:\n{run.output}")
    (pid,) = role_pids(run.tag, "DMLC_ROLE=server")
    os.kill(pid, signal.SIGKILL)
    go.write_text("go")
    assert run.finish(90) == 0, run.output
    assert "server 0 exited with code -9; restarting it as incarnation 1" in run.output or \
        "server 0 exited with code 137; restarting it as incarnation 1" in run.output, run.output
    value = load_arrays(str(out))["w"]
    assert set(np.unique(value).tolist()) == {-3.0}, (np.unique(value), run.output[-3000:])


OPTIMIZER_SCRIPT = Path(__file__).parent / "scripts" / "optimizer_restart_train.py"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["read-only", "under-a-file"])
def test_a_shard_folder_no_server_can_write_fails_the_launch_before_anything_starts(
        launches, tmp_path: Path, where: str) -> None:  # noqa: F811
    """--max-restarts with a KVSTORE_SNAPSHOT_DIR that cannot be written (a read-only mount, as root; a
    path under a file) fails the launch at once with exit 2, naming the folder, and starts no role: each
    server used to fail at its start, its exit code racing a kill (issue 45 item 5)."""
    folder = tmp_path / "shards"
    if where == "under-a-file":
        (tmp_path / "file").write_text("")
        folder = tmp_path / "file" / "shards"
    else:
        folder.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(folder), str(folder)]).returncode:
            pytest.skip("a read-only bind mount needs root")
        try:
            mounted = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)]).returncode == 0
            assert mounted, "remount read-only failed"
        except BaseException:
            subprocess.run(["umount", str(folder)])
            raise
    try:
        run = launches(["-n", "1", "-s", "1", "--max-restarts", "1", str(SCRIPT), "4", str(tmp_path / "w")],
                       {"KVSTORE_SNAPSHOT_DIR": str(folder)})
        assert run.finish(30) == 2, run.output
        assert f"KVSTORE_SNAPSHOT_DIR='{folder}' cannot be written" in run.output, run.output
        assert "[scheduler]" not in run.output and "[server 0]" not in run.output, run.output  # none ran
    finally:
        if where == "read-only":
            subprocess.run(["umount", str(folder)])

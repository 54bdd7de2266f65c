"""Servers restarted from their own shards (launch.py --max-restarts with KVSTORE_SNAPSHOT_EVERY): a
server SIGKILLed mid-training comes back from its latest shard, the workers align with it and send
their unanswered pushes again, the job finishes, and only the rounds the log names are lost."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvstore.core.checkpoint import load_arrays
from tests.integration.test_restarts import launches  # noqa: F401 -- the fixture

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
    assert 0 <= fewest <= most <= 12, output
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

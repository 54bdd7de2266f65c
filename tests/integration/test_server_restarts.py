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


def _run(launches, tmp_path: Path, mode: str) -> tuple[str, list[dict[str, np.ndarray]]]:  # noqa: F811
    """Launch 2 workers and 2 servers, server 1 SIGKILLed at its 12th round; the output and the values."""
    env = {"KVSTORE_SNAPSHOT_EVERY": "5", "KVSTORE_SNAPSHOT_DIR": str(tmp_path / "shards"),
           "KVSTORE_TEST_SERVER_DIE_AT_ROUND": "1:12"}
    run = launches(["-n", str(WORKERS), "-s", "2", "--max-restarts", "1", str(SCRIPT), str(STEPS),
                    str(tmp_path / "w"), mode], env)
    assert run.finish(120) == 0, run.output
    assert "server 1 exited with code 137; restarting it as incarnation 1" in run.output, run.output
    assert "did not confirm shutdown" not in run.output, run.output  # the restarted one stopped cleanly
    return run.output, [load_arrays(str(tmp_path / f"w.{rank}")) for rank in range(WORKERS)]


@pytest.mark.timeout(150)
def test_a_sigkilled_server_restarts_from_its_shard_and_loses_only_the_rounds_it_logs(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """dist_sync: every element held by the restarted server misses exactly the rounds its log says were
    lost, every other element has every round, and no round is applied twice."""
    output, values = _run(launches, tmp_path, "dist_sync")
    found = re.search(r"\[server 1\].*lost (\d+) rounds of updates", output)
    assert found, output
    lost = int(found.group(1))
    assert 0 <= lost <= 12, output
    whole, short = -WORKERS * STEPS, -WORKERS * (STEPS - lost)
    for name in values[0]:
        assert np.array_equal(values[0][name], values[1][name]), name
    seen = set(np.concatenate([v.ravel() for v in values[0].values()]).tolist())
    assert seen <= {whole, short}, (seen, whole, short, output)
    assert whole in seen  # server 0's elements
    assert short in seen  # server 1's elements (the same as whole when nothing was lost)
    assert re.search(r"\[worker [01]\] server 1 restarted \(incarnation 1\).*aligned", output), output


@pytest.mark.timeout(150)
def test_in_dist_async_a_retried_push_is_applied_at_most_once(launches, tmp_path: Path) -> None:  # noqa: F811
    """dist_async: the job finishes after the restart; no element has more pushes applied than were made."""
    output, values = _run(launches, tmp_path, "dist_async")
    for name in values[0]:
        assert np.array_equal(values[0][name], values[1][name]), name
    every = np.concatenate([v.ravel() for v in values[0].values()])
    assert every.min() >= -WORKERS * STEPS, (every.min(), output)
    assert every.max() < 0, output
    assert "workers aligned after the restart" in output, output

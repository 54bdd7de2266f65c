"""Elastic membership in dist_async (docs/elastic.md): a worker joins a running asynchronous job, takes
the servers' latest weights and the job's update count, and its pushes are applied as any worker's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers import REPO, python

SCRIPT = Path(__file__).parent / "scripts" / "elastic_async_train.py"
ENV = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
       "KVSTORE_BIGARRAY_BOUND": "100", "KVSTORE_CONNECT_TIMEOUT": "60", "KVSTORE_REQUEST_TIMEOUT": "10"}


def run_job(tmp_path: Path, mode: str, slots: int, **env: str) -> dict[tuple[int, int], list[list[str]]]:
    """launch.py with 2 workers of ``slots``, 2 servers and the script in ``mode``; each worker's
    records by (rank, incarnation), after checking the launch succeeded."""
    proc = subprocess.run([python(), "launch.py", "-n", "2", "-s", "2", "--max-workers", str(slots),
                           str(SCRIPT), str(tmp_path / "rec"), mode], cwd=REPO,
                          env={**os.environ, **ENV, **env}, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {}
    for path in tmp_path.glob("rec.[0-9].*"):
        _, rank, incarnation = path.name.split(".")
        records[(int(rank), int(incarnation))] = [line.split() for line in path.read_text().splitlines()]
    return records


def check_job(records: dict[tuple[int, int], list[list[str]]], joiner: tuple[int, int]) -> None:
    """Every push applied once (the final value is minus the sum of every push every worker recorded),
    and the joiner's first pull no older than the join: its value and its step (the job's update count)
    include every push recorded before the join was asked."""
    pushes = [(float(line[1]), float(line[2])) for lines in records.values() for line in lines
              if line[0] == "push"]
    zero = records[(0, 0)]
    final = next(line for line in zero if line[0] == "final")
    assert final[2] == "1" and float(final[1]) == -sum(v for v, _ in pushes), (final, len(pushes))
    asked = float(next(line for line in zero if line[0] == "join")[1])  # the first ask
    before = [v for v, t in pushes if t < asked]
    start = records[joiner][0]
    assert start[0] == "start", start
    rejoined_at, first = int(start[1]), float(start[2])  # first: its least updated element
    assert first <= -sum(before), (first, -sum(before))  # sgd lowers 'w' by every push: no older
    assert len(before) <= rejoined_at <= len(pushes), (len(before), rejoined_at, len(pushes))
    for (rank, incarnation), lines in records.items():
        assert lines[-1][0] in ("end", "lead"), (rank, incarnation, lines[-3:])
        if (rank, incarnation) != joiner:
            assert lines[0][1] == "None", (rank, lines[0])  # first incarnations started with the job
    assert len([1 for line in records[joiner] if line[0] == "push"]) == 40


def test_a_dist_async_job_grows_from_two_to_three_workers(tmp_path: Path) -> None:
    """A third worker joins a dist_async job mid-training: it starts from the servers' latest weights
    and the job's update count, trains beside the others, and the servers' final weights are the
    initial value minus lr times every push every worker made (nothing applied twice or lost)."""
    records = run_job(tmp_path, "grow", 3)
    assert sorted(records) == [(0, 0), (1, 0), (2, 1)]  # one process per slot: no relaunch
    check_job(records, (2, 1))


def test_a_left_slot_is_joined_again_by_a_new_incarnation_under_a_staleness_bound(tmp_path: Path) -> None:
    """Worker 1 leaves for good and a new incarnation joins its slot (KVSTORE_STALENESS=2): it learns
    the job's update count, not its slot's old pushes; its pushes are all applied (none taken for the
    old member's), and it is counted level with worker 0 from its join, so no push ran more than
    max(staleness, window) = 2 pushes ahead of the slowest worker (the servers' max_lead)."""
    records = run_job(tmp_path, "rejoin", 2, KVSTORE_STALENESS="2")
    assert sorted(records) == [(0, 0), (1, 0), (1, 1)]
    check_job(records, (1, 1))
    old = len([1 for line in records[(1, 0)] if line[0] == "push"])
    assert int(records[(1, 1)][0][1]) > old  # not the slot's earlier member's own count
    lead = int(next(line for line in records[(0, 0)] if line[0] == "lead")[1])
    assert 0 <= lead <= 2, lead

"""Elastic membership (launch.py --min-workers/--max-workers, docs/elastic.md): a dist_sync job grows
2 -> 4 -> 3 workers mid-training; every round sums exactly the workers present in it."""

from __future__ import annotations

import os
import subprocess
from collections import defaultdict
from pathlib import Path

from tests.helpers import REPO, python

SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
ENV = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
       "KVSTORE_BIGARRAY_BOUND": "100", "KVSTORE_CONNECT_TIMEOUT": "60"}


def read_records(folder: Path) -> dict[tuple[int, int], list[list[str]]]:
    """Each worker process's records, by (rank, pid)."""
    found = {}
    for path in folder.glob("rec.*.*"):
        _, rank, pid = path.name.split(".")
        found[(int(rank), int(pid))] = [line.split() for line in path.read_text().splitlines()]
    return found


def test_a_job_grows_from_two_to_four_workers_and_shrinks_to_three(tmp_path: Path) -> None:
    """Two workers start, two join (slots 2 and 3, the current weights and step), worker 3 leaves: each
    round's update is the sum over the workers that pushed in it, nothing applied twice or lost, and
    workers 0 and 1 keep their processes throughout."""
    proc = subprocess.run([python(), "launch.py", "-n", "2", "-s", "2", "--min-workers", "2",
                           "--max-workers", "4", str(SCRIPT), str(tmp_path / "rec"), "3"],
                          cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    records = read_records(tmp_path)
    assert sorted(rank for rank, _ in records) == [0, 1, 2, 3], output  # one process per slot: no relaunch
    pushed: dict[int, set[int]] = defaultdict(set)  # step -> ranks that pushed in it
    seen: dict[int, set[tuple[int, float]]] = defaultdict(set)  # step -> (members, value) workers read
    starts = {}
    for (rank, _), lines in records.items():
        assert lines[0][0] == "start" and lines[-1][0] == "end", (rank, lines[:2], lines[-2:])
        starts[rank] = (int(lines[0][1]), float(lines[0][2]))
        assert lines[0][3] == "1"
        steps = [int(line[0]) for line in lines[1:-1]]
        assert steps == list(range(starts[rank][0], int(lines[-1][1]))), rank  # every step, once
        for line in lines[1:-1]:
            assert line[3] == "1", (rank, line)  # every element moved alike, over both servers
            pushed[int(line[0])].add(rank)
            seen[int(line[0])].add((int(line[1]), float(line[2])))
    assert starts[0][0] == starts[1][0] == 0 and starts[2][0] > 3 and starts[3][0] > 3
    expected = 0.0  # the reference: sgd (lr 1) over the sum of 2**rank of the workers in each round
    values = {}
    for step in sorted(pushed):
        expected -= sum(2.0 ** r for r in pushed[step])
        values[step] = expected
        members = sum(1 << r for r in pushed[step])
        assert seen[step] == {(members, expected)}, (step, pushed[step], seen[step])
    for rank in (2, 3):  # a joiner starts from the weights after the round before its first
        first = starts[rank][0]
        assert starts[rank][1] == values[first - 1], (rank, first, starts[rank], values[first - 1])
    phases = [sorted(pushed[s]) for s in sorted(pushed)]
    assert phases[0] == [0, 1] and phases[-1] == [0, 1, 2]
    assert phases.count([0, 1, 2, 3]) == 5 and phases[-5:] == [[0, 1, 2]] * 5
    assert max(pushed) == len(pushed) - 1  # no step missing

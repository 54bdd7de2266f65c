"""Elastic membership (launch.py --min-workers/--max-workers, docs/elastic.md): a dist_sync job grows
2 -> 4 -> 3 workers mid-training; every round sums exactly the workers present in it."""

from __future__ import annotations

import os
import subprocess
from collections import defaultdict
from pathlib import Path

from tests.helpers import REPO, python

SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
SPLIT = Path(__file__).parent / "scripts" / "elastic_split.py"
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


def launch_split(tmp_path: Path, mode: str, samples: int, *options: str) -> subprocess.CompletedProcess:
    """launch.py with 2 servers and ``options`` running the split-Session script in ``mode``."""
    return subprocess.run([python(), "launch.py", "-s", "2", *options, str(SPLIT), str(tmp_path / "rec"),
                           str(samples), mode], cwd=REPO, env={**os.environ, **ENV}, capture_output=True,
                          text=True, timeout=150)


def test_a_split_session_sees_every_sample_once_per_epoch_as_the_job_grows_and_shrinks(
        tmp_path: Path) -> None:
    """Session.run(split=True) in a job of 2 -> 4 -> 3 workers: each epoch's samples are split over the
    view agreed at its start, so the workers' batches of every epoch hold every sample exactly once;
    the two joiners come in mid-epoch and push zeros until it ends; every step's update is the sum over
    the workers with data in it (a reference), the same on every worker; one process per slot."""
    samples = 50  # views of 2, 4 and 3 workers: 25 each; 13, 13, 12, 12; 17, 17, 16 (parts a batch short)
    proc = launch_split(tmp_path, "grow", samples, "-n", "2", "--min-workers", "2", "--max-workers", "4")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    records = read_records(tmp_path)
    assert sorted(rank for rank, _ in records) == [0, 1, 2, 3], output  # one process per slot: no relaunch
    data: dict[int, set[int]] = defaultdict(set)  # step -> ranks with a batch in it
    values: dict[int, set[float]] = defaultdict(set)  # step -> values the workers read after it
    rows: dict[int, list[int]] = defaultdict(list)  # epoch -> every sample id trained on in it
    epoch_of: dict[int, int] = {}
    starts, zeros = {}, defaultdict(list)
    for (rank, _), lines in records.items():
        assert lines[0][0] == "start" and lines[-1][0] == "end", (rank, lines[:2], lines[-2:])
        starts[rank] = (int(lines[0][1]), float(lines[0][2]))
        steps = [int(line[0]) for line in lines[1:-1]]
        assert steps == list(range(starts[rank][0], int(lines[-1][1]))), rank  # every step, once
        for line in lines[1:-1]:
            step = int(line[0])
            assert line[-1] == "1", (rank, line)  # every element moved alike, over both servers
            values[step].add(float(line[-2]))
            if line[1] == "data":
                data[step].add(rank)
                epoch_of[step] = int(line[2])
                rows[int(line[2])].extend(int(r) for r in line[3].split(","))
            else:
                zeros[rank].append(step)
    expected, reference = 0.0, {}
    for step in range(max(values) + 1):  # the reference: sgd (lr 1) over 2**r of the workers with data
        expected -= sum(2.0 ** r for r in data[step])
        reference[step] = expected
        assert values[step] == {expected}, (step, sorted(data[step]), values[step])
    epochs = sorted(rows)
    for epoch in epochs:  # the data rule: every sample exactly once per epoch
        assert sorted(rows[epoch]) == list(range(samples)), (epoch, sorted(rows[epoch]))
    members = {e: sorted({r for s, rs in data.items() if epoch_of[s] == e for r in rs}) for e in epochs}
    assert members[0] == members[1] == [0, 1] and members[epochs[-1]] == [0, 1, 2], members
    assert [members[e] for e in epochs].count([0, 1, 2, 3]) == 2
    for epoch in epochs[2:]:  # parts of 12 (4 workers) and 16 (3) are a batch short: zeros in the last step
        last = max(s for s, e in epoch_of.items() if e == epoch)
        assert data[last] == {0, 1}, (epoch, last, data[last])
    first_of_epoch2 = min(s for s, e in epoch_of.items() if e == 2)
    for rank in (2, 3):  # joined mid-epoch 1: zeros until it ended, from the weights after the round before
        first = starts[rank][0]
        assert first < first_of_epoch2, (rank, first, first_of_epoch2)
        assert zeros[rank][:first_of_epoch2 - first] == list(range(first, first_of_epoch2)), rank
        assert starts[rank][1] == reference[first - 1], (rank, first, starts[rank])
    assert {0, 1} <= set(starts) and starts[0][0] == starts[1][0] == 0


def test_a_job_that_shrinks_below_min_workers_fails_with_a_named_error(tmp_path: Path) -> None:
    """--min-workers 2: once worker 1 has left after epoch 0, worker 0's next epoch (its membership
    barrier) fails with TooFewWorkersError and the launch fails."""
    proc = launch_split(tmp_path, "shrink", 16, "-n", "2", "--min-workers", "2", "--max-workers", "3")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "TooFewWorkersError" in output and "fewer than --min-workers 2" in output, output


def test_a_join_before_a_plain_job_stored_its_weights_awaits_its_tagged_view(tmp_path: Path) -> None:
    """A worker joined before the others' init (a script with no Session) awaits the tagged view they
    agree once the weights are stored, following their init's and set_optimizer's barriers; then it
    pulls the initial weights and counts in every round from the first: each step lowers the key by
    1 + 2 + 4 on every worker."""
    script = Path(__file__).parent / "scripts" / "elastic_early_join.py"
    proc = subprocess.run([python(), "launch.py", "-n", "2", "-s", "1", "--min-workers", "2",
                           "--max-workers", "3", str(script), str(tmp_path / "rec"), "3"],
                          cwd=REPO, env={**os.environ, **ENV, "KVSTORE_REQUEST_TIMEOUT": "10"},
                          capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    found = {rank: (tmp_path / f"rec.{rank}").read_text().split("\n") for rank in range(3)}
    for rank, (values, joined, _) in found.items():
        assert [float(v) for v in values.split()] == [0.0, -7.0, -14.0, -21.0], (rank, output[-4000:])
        assert joined == ("0 1" if rank == 2 else "None 0")

"""Elastic jobs under --max-restarts (docs/elastic.md): a joined worker that dies is restarted as its
slot's next incarnation and rejoins; a scheduler SIGKILLed after a join is restarted, rebuilds the joined
slot as present, and takes a further join; every round's update is checked against a reference."""

from __future__ import annotations

import os
import re
import signal
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import poll_for
from tests.integration.test_elastic import read_records
from tests.integration.test_restarts import launches, role_pids  # noqa: F401 -- the fixture

SCRIPT = Path(__file__).parent / "scripts" / "elastic_restart_train.py"
# a hang fails fast (KVSTORE_REQUEST_TIMEOUT); the scheduler's restart needs the longer heartbeat timeout
ENV = {"KVSTORE_REQUEST_TIMEOUT": "15", "KVSTORE_CONNECT_TIMEOUT": "30"}


def _steps(folder: Path, rank: int, incarnation: str | None = None) -> int:
    """Steps recorded so far by a process of ``rank`` (of that ``incarnation``, when given)."""
    most = 0
    for path in folder.glob(f"rec.{rank}.*"):
        lines = path.read_text().splitlines()
        if lines and (incarnation is None or lines[0].split()[4:5] == [incarnation]):
            most = max(most, sum(1 for line in lines[1:] if line[:1].isdigit()))
    return most


def _max_step(folder: Path) -> int:
    """The highest step any worker has recorded so far."""
    steps = [int(line.split()[0]) for path in folder.glob("rec.*.*")
             for line in path.read_text().splitlines() if line[:1].isdigit() and len(line.split()) == 5]
    return max(steps, default=0)


def _join(run) -> None:
    """Ask the launcher for one more worker: a line 'join' appended to the control file every role is
    told of (KVSTORE_ELASTIC_CONTROL, read from worker 0's environment)."""
    (pid,) = poll_for(lambda: role_pids(run.tag, "DMLC_WORKER_ID=0"), 30, "worker 0's process")
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    (path,) = [entry.split(b"=", 1)[1].decode() for entry in environ
               if entry.startswith(b"KVSTORE_ELASTIC_CONTROL=")]
    with open(path, "a") as control:
        control.write("join\n")


def _stop(folder: Path, stop_file: Path) -> int:
    """Make every worker stop 100 steps from the furthest one (written whole, then renamed)."""
    at = _max_step(folder) + 100
    partial = stop_file.with_suffix(".partial")
    partial.write_text(str(at))
    partial.rename(stop_file)
    return at


def _check(records: dict, scaled_for: int | None = None) -> dict[int, float]:
    """Every step's update, read alike by every worker, is the sum of 2**r over the workers that pushed
    in it (times 3/2 for a round closed while worker ``scaled_for`` was away after its join: a quorum of
    the rest), every process did its steps once each, and each started from the value after the round
    before its first.  Returns the reference value after each step."""
    pushed: dict[int, set[int]] = defaultdict(set)
    seen: dict[int, set[tuple[float, float]]] = defaultdict(set)
    starts = []
    for (rank, pid), lines in records.items():
        assert lines[0][0] == "start", (rank, pid, lines[:2])
        first = int(lines[0][1])
        steps = [int(line[0]) for line in lines[1:] if line[0] != "end"]
        assert steps == list(range(first, first + len(steps))), (rank, pid)  # every step once
        starts.append((rank, first, float(lines[0][2])))
        for line in lines[1:]:
            if line[0] == "end":
                continue
            assert line[3] == "1", (rank, line)  # every element moved alike, over both servers
            pushed[int(line[0])].add(rank)
            seen[int(line[0])].add((float(line[1]), float(line[2])))
    joined_at = min((first for rank, first, _ in starts if first > 0), default=None)
    expected, reference = 0.0, {}
    for step in range(max(pushed) + 1):
        drop = sum(2.0 ** r for r in pushed[step])
        if scaled_for is not None and joined_at is not None and step >= joined_at \
                and scaled_for not in pushed[step]:
            drop *= 3 / 2
        expected -= drop
        reference[step] = expected
        assert seen[step] == {(drop, expected)}, (step, sorted(pushed[step]), seen[step])
    for rank, first, value in starts:
        assert value == (reference[first - 1] if first else 0.0), (rank, first, value)
    return reference


@pytest.mark.timeout(120)
def test_a_joined_worker_killed_is_restarted_as_its_slots_next_incarnation_and_rejoins(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """A job 2 -> 3 (a join into slot 2, incarnation 1); the joiner SIGKILLs itself after 20 steps and
    is restarted as incarnation 2 without KVSTORE_JOIN (it rejoins as a restart: rounds meanwhile are
    scaled as a quorum of the rest); the job ends 0, every round equal to the reference."""
    stop = tmp_path / "stop"
    run = launches(["-n", "2", "-s", "2", "--max-workers", "3", "--max-restarts", "1", str(SCRIPT),
                    str(tmp_path / "rec"), str(stop), "20"], {**ENV, "KVSTORE_HEARTBEAT_TIMEOUT": "3"})
    poll_for(lambda: _steps(tmp_path, 0) >= 10, 60, f"worker 0's steps:\n{run.output}")
    _join(run)
    poll_for(lambda: _steps(tmp_path, 2, incarnation="2") >= 20, 60, f"worker 2's restart:\n{run.output}")
    _stop(tmp_path, stop)
    assert run.finish(60) == 0, run.output
    output = run.output
    assert "worker 2 exited with code 137; restarting it as incarnation 2 (1 of 1 restarts used)" in output
    assert re.search(r"\[scheduler\].*worker 2 rejoined as incarnation 2", output), output
    records = read_records(tmp_path)
    assert sorted(rank for rank, _ in records) == [0, 1, 2, 2], output  # 0 and 1 kept their processes
    starts = sorted((lines[0][4], lines[0][5]) for (rank, _), lines in records.items() if rank == 2)
    assert starts == [("1", "1"), ("2", "0")], starts  # the join, then its restart: no KVSTORE_JOIN
    _check(records, scaled_for=2)


def _grown(launches, tmp_path: Path, stop: Path, slots: int, heartbeat_timeout: int):  # noqa: F811
    """A job of 2 workers of ``slots`` under --max-restarts 1, grown to 3 by a join once worker 0 has
    done 10 steps, returned once the joiner (worker 2) has done 30."""
    env = {**ENV, "KVSTORE_HEARTBEAT_TIMEOUT": str(heartbeat_timeout)}
    run = launches(["-n", "2", "-s", "2", "--max-workers", str(slots), "--max-restarts", "1", str(SCRIPT),
                    str(tmp_path / "rec"), str(stop)], env)
    poll_for(lambda: _steps(tmp_path, 0) >= 10, 60, f"worker 0's steps:\n{run.output}")
    _join(run)
    poll_for(lambda: _steps(tmp_path, 2) >= 30, 60, f"worker 2's steps:\n{run.output}")
    return run


@pytest.mark.timeout(120)
def test_a_scheduler_sigkilled_after_a_join_is_restarted_and_a_later_join_is_taken(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """A job 2 -> 3 of 4 slots; the scheduler SIGKILLed while the three train: it is restarted, every
    node re-registers (the joined worker 2 as present), a join asked after the rebuild takes slot 3; the
    job ends 0, every round the unscaled sum over its workers (the reference), one process per slot."""
    stop = tmp_path / "stop"
    run = _grown(launches, tmp_path, stop, slots=4, heartbeat_timeout=6)
    (pid,) = role_pids(run.tag, "DMLC_ROLE=scheduler")
    os.kill(pid, signal.SIGKILL)
    poll_for(lambda: "cluster rebuilt" in run.output, 60, f"the rebuild:\n{run.output}")
    _join(run)
    poll_for(lambda: _steps(tmp_path, 3) >= 20, 60, f"worker 3's steps:\n{run.output}")
    _stop(tmp_path, stop)
    assert run.finish(60) == 0, run.output
    output = run.output
    assert "scheduler exited with code 137; restarting it as incarnation 1" in output, output
    rebound = set(re.findall(r"\[(worker \d|server \d)\].*re-registered with the restarted scheduler",
                             output))
    assert rebound == {"worker 0", "worker 1", "worker 2", "server 0", "server 1"}, output
    assert re.search(r"cluster rebuilt .*left \[3\]", output), output  # slot 2 present, 3 absent
    assert output.index("cluster rebuilt") < output.index("worker 3 joined as incarnation 1"), output
    records = read_records(tmp_path)
    assert sorted(rank for rank, _ in records) == [0, 1, 2, 3], output  # one process per slot
    _check(records)


@pytest.mark.timeout(120)
def test_a_server_sigkilled_after_a_join_restarts_with_the_joined_worker_present(
        launches, tmp_path: Path) -> None:  # noqa: F811
    """A job 2 -> 3 of 3 slots; server 1 SIGKILLed while the three train restarts from its shard (the
    job's own folder, with no settings) with the joined slot present: it waits for worker 2 to align
    with the others and counts it in every round after; each element's every update is the sum over the
    workers that pushed (the reference), but for the one step where server 1's element went back to its
    shard (the rounds since it are lost, as for any server restart)."""
    stop = tmp_path / "stop"
    run = _grown(launches, tmp_path, stop, slots=3, heartbeat_timeout=3)
    (pid,) = role_pids(run.tag, "KVSTORE_SERVER_ID=1")
    os.kill(pid, signal.SIGKILL)
    poll_for(lambda: "workers aligned after the restart" in run.output, 60, f"the alignment:\n{run.output}")
    aligned = _max_step(tmp_path)
    poll_for(lambda: _max_step(tmp_path) >= aligned + 30, 60, f"steps after the restart:\n{run.output}")
    _stop(tmp_path, stop)
    assert run.finish(60) == 0, run.output
    assert "server 1 exited with code 137; restarting it as incarnation 1" in run.output, run.output
    assert "waiting for workers [0, 1, 2] to align" in run.output, run.output  # worker 2 present there
    pushed: dict[int, set[int]] = defaultdict(set)
    drops: dict[int, set[tuple[float, float]]] = defaultdict(set)
    for (rank, _), lines in read_records(tmp_path).items():
        for line in lines[1:]:
            if line[0] != "end":
                pushed[int(line[0])].add(rank)
                drops[int(line[0])].add((float(line[1]), float(line[4])))
    assert max(pushed) >= aligned + 30 and {0, 1, 2} in pushed.values()
    off = {0: [], 1: []}  # element (first, last) -> the steps its update was not the reference's
    for step in range(max(pushed) + 1):
        assert len(drops[step]) == 1, (step, drops[step])  # every worker read the same
        ((first, last),) = drops[step]
        reference = sum(2.0 ** r for r in pushed[step])
        off[0] += [step] * (first != reference)
        off[1] += [step] * (last != reference)
    bad = [steps for steps in off.values() if steps]
    assert len(bad) <= 1 and all(len(steps) == 1 for steps in bad), off  # one element, one step: the shard's

"""kvstore on Ray end to end: ``launch.py --launcher ray`` and ``kvstore.ray.run`` on a local Ray.

One Ray instance (2 CPUs) serves the module's Python-API tests; the launch.py tests start their own
or join that one with ``--ray-address``.  Every role carries a KVSTORE_TEST_TAG, and so do the
tethers and their ``/bin/sh`` keepers (in their environment, with the role's other KVSTORE_*
settings), so the tests can check that nothing is left behind.  Each test's waits have their own
deadlines; where they add up past the suite's 120 s, the test's timeout mark is raised to match.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstore import config as kvconfig
from kvstore.errors import DeadlineExceededError
from tests.helpers import finish, launch, poll_for, tagged_pids

ray = pytest.importorskip("ray", reason="needs the [ray] extra (pip install -e .[ray]): `import ray` failed")
kvray = pytest.importorskip("kvstore.ray")
from kvstore.errors import PlacementError, RoleFailed  # noqa: E402
from kvstore.launch import ray_actor, ray_job  # noqa: E402 -- after the skip: ray_job imports ray

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "sum_check.py")
ROLE_ENV = {"KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
            "KVSTORE_CONNECT_TIMEOUT": "30", "KVSTORE_LOG_LEVEL": "INFO"}


def _launch(args: list[str], tag: str) -> object:
    env = {**os.environ, **ROLE_ENV, "KVSTORE_TEST_TAG": tag, "RAY_USAGE_STATS_ENABLED": "0"}
    return launch(["--launcher", "ray", "--env", f"KVSTORE_TEST_TAG={tag}", *args], env)


@pytest.fixture(scope="module")
def ray_address():
    """A new local Ray instance (2 CPUs) for the module; yields its address."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        context = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                           logging_level="WARNING")
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()


def _all_cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0.0) == ray.cluster_resources().get("CPU")


def _no_live_placement_groups() -> bool:
    return all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def _tethers(tag: str) -> dict[int, str]:
    """The live tethers (``python -m kvstore.launch.tether``) and keepers (``/bin/sh -c ... kvstore.tether``)
    carrying ``tag`` in their environment: {pid: 'tether' or 'keeper'}."""
    found = {}
    for pid in tagged_pids(tag):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[1:3] == ["-m", "kvstore.launch.tether"]:
            found[pid] = "tether"
        elif argv[0] == "/bin/sh" and any("-m kvstore.launch.tether" in word for word in argv):
            found[pid] = "keeper"
    return found


def _nothing_left(tag: str) -> bool:
    """No process of the test is left: no role, no tether, no keeper, no worker actor."""
    return not _tethers(tag) and not tagged_pids(tag)


def _port_dirs() -> set[str]:
    """The scheduler actors' port-file directories (kvstore-ray-*) in this machine's temporary directory."""
    return {entry.name for entry in Path(tempfile.gettempdir()).glob("kvstore-ray-*")}


def _session_files_containing(text: str) -> list[str]:
    """The files under the module's Ray session directory (its logs among them) that contain ``text``."""
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    found = []
    for path in session.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and text.encode() in path.read_bytes():
                found.append(str(path.relative_to(session)))
        except OSError:
            continue
    return found


# -- what the worker functions run (in the workers' actors) ------------------------------------------

def sum_check(scale: float) -> tuple[int, int, float, str]:
    """Push ones * (rank + 1) * scale to a small and a big key; return (rank, W, pulled, node host)."""
    import kvstore

    kv = kvstore.create("dist_sync")
    workers = kv.num_workers
    pulled = []
    for key, size in ((5, 10), ("big", 2500)):  # the bound is 1000: "big" is split over the servers
        kv.init(key, np.zeros(size, np.float32))
        kv.push(key, np.ones(size, np.float32) * (kv.rank + 1) * scale)
        out = kv.pull(key)
        assert (out == out[0]).all()
        pulled.append(float(out[0]))
    assert pulled[0] == pulled[1] == scale * workers * (workers + 1) / 2, pulled
    kv.barrier()
    print(f"hello from rank {kv.rank}", flush=True)
    return kv.rank, workers, pulled[0], os.environ["DMLC_NODE_HOST"]


def steady(ready_dir: str) -> None:
    """dist_sync rounds for up to 60 s; after the first, create READY_DIR/rank<r>."""
    import kvstore

    kv = kvstore.create("dist_sync")
    kv.init("w", np.zeros(3000, np.float32))
    deadline = time.monotonic() + 60
    first = True
    while time.monotonic() < deadline:
        kv.push("w", np.ones(3000, np.float32))
        kv.pull("w")
        if first:
            (Path(ready_dir) / f"rank{kv.rank}").touch()
            first = False


def raise_on_rank_1() -> None:
    import kvstore

    kv = kvstore.create("dist_sync")
    kv.init("x", np.zeros(3, np.float32))
    if kv.rank == 1:
        raise RuntimeError("worker function fails on purpose")
    kv.pull("x")  # blocks: the failed worker never pushes
    kv.push("x", np.ones(3, np.float32))
    kv.pull("x")


def leave_and_rejoin(marker_dir: str) -> tuple[int, str, str, int]:
    """Elastic, 2 slots: worker 1 leaves for good after 3 rounds; worker 0 goes on alone (touching
    MARKER_DIR/solo) until it has had 3 rounds with a joiner, who stops after the same 3.  Each step pushes
    2**rank under sgd (lr 1), so a round's drop names its workers.  Returns (rank, KVSTORE_JOIN,
    KVSTORE_INCARNATION, its first step)."""
    import kvstore

    kv = kvstore.create("dist_sync")
    rank, joined = kv.rank, os.environ.get("KVSTORE_JOIN", "0")
    kv.init("w", np.zeros(4))
    kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=1.0))
    w = np.empty(4)
    kv.pull("w", out=w)
    first = step = kv.rejoined_at or 0
    alone = joined == "1"  # worker 0 counts rounds with the joiner once it has trained alone
    both = 0
    deadline = time.monotonic() + 60
    while both < 3 and not (rank == 1 and joined == "0" and step == 3):
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker {rank} saw no 3 rounds with a joiner within 60 s")
        time.sleep(0.01)  # the step's compute
        kv.push("w", np.full(4, 2.0 ** rank))
        new = np.empty(4)
        kv.pull("w", out=new)
        members, w, step = int((w - new)[0]), new, step + 1
        if members == 1:
            alone = True
            (Path(marker_dir) / "solo").touch()
        both += members == 3 and alone
    kv.close()
    return rank, joined, os.environ.get("KVSTORE_INCARNATION", "0"), first


class _StuckActor(ray_actor.RoleActor):
    """A role actor whose start of a command never returns (bounded at 120 s), as a stuck one would not."""

    def start_command(self, *args: object, **kwargs: object) -> None:
        threading.Event().wait(120)


class _StuckCreationActor(ray_actor.RoleActor):
    """A role actor whose creation never ends (bounded at 120 s): a process stuck starting."""

    def __init__(self, *args: object) -> None:
        threading.Event().wait(120)
        super().__init__(*args)


class _SlowCreationActor(ray_actor.RoleActor):
    """Worker 0's actor takes 12 s to be created (a slow but healthy start: a big import, a runtime_env)."""

    def __init__(self, name: str, *args: object) -> None:
        if name == "worker 0":
            threading.Event().wait(12)  # stands in for slow work, not a wait for something
        super().__init__(name, *args)


# -- a role actor's class, in this process (no Ray) ---------------------------------------------------

def _drain_to_exit(actor: object, timeout: float) -> tuple[list[str], int]:
    """Drain ``actor`` until its role's exit shows; return (its lines, its exit code)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        new, code = actor.drain(0.5)
        lines += new
        if code is not None:
            return lines, code
        if time.monotonic() > deadline:
            raise AssertionError(f"the role did not exit within {timeout} s; its output: {lines}")


def test_a_function_worker_gets_its_environment_only_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """start_function's env is in os.environ while the function runs (where kvstore.create reads it),
    and gone again after: it travels as an argument, not in the actor's runtime_env."""
    monkeypatch.setattr(ray_actor, "_leave_cluster", lambda failure: None)  # leave this process's store be
    name = f"KVSTORE_TEST_PROBE_{uuid.uuid4().hex[:8].upper()}"
    actor = ray_actor.RoleActor("worker 0", (lambda: kvconfig.child_environ({}).get(name), (), {}))
    actor.start_function({name: "set"})
    _, code = _drain_to_exit(actor, 30)
    assert (code, actor.result()) == (0, "set")
    assert name not in kvconfig.child_environ({})


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_a_tethered_role_runs_under_a_keeper_that_carries_its_settings_but_not_the_secret(tag: str) -> None:
    """start_command: the role gets the secret (on the tether's stdin); the /bin/sh keeper and the tether
    carry the role's other KVSTORE_* (the test's tag among them) in their environment, and nothing of
    the secret or tag on their command line.  The port file's directory is gone once the port is read.
    release() stops the role through its tether (SIGTERM: 143), and nothing is left."""
    secret = f"secret-{uuid.uuid4().hex}"
    script = ("import os, signal; p = os.environ['KVSTORE_PORT_FILE']; open(p + '.tmp', 'w').write('4321'); "
              f"os.replace(p + '.tmp', p); print('secret', os.environ['KVSTORE_SECRET'] == {secret!r}, "
              "flush=True); signal.pause()")
    actor = ray_actor.RoleActor("scheduler")
    actor.start_command(["-c", script], {"KVSTORE_TEST_TAG": tag, "KVSTORE_SECRET": secret}, None, 5.0,
                        python=True, port_file=True)
    try:
        port_dir = Path(actor._port_file).parent
        assert actor.wait_port(30) == (4321, None)
        assert not port_dir.exists()
        tethers = poll_for(lambda: _tethers(tag) if len(_tethers(tag)) == 2 else None, 30,
                           "the keeper and the tether")
        assert sorted(tethers.values()) == ["keeper", "tether"]
        for pid in tethers:
            assert f"KVSTORE_TEST_TAG={tag}".encode() in _environ(pid)
            assert secret.encode() not in _environ(pid)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert secret.encode() not in cmdline and tag.encode() not in cmdline
        assert poll_for(lambda: actor.drain(0.5)[0], 30, "the role's line") == ["secret True"]
    finally:
        actor.release()
        code = actor.wait(15)
        if code is None:
            actor._proc.kill()
            actor._proc.wait()
    assert code == 143
    assert poll_for(lambda: _nothing_left(tag), 15, "the role, its tether and keeper to exit")


# -- the launcher -------------------------------------------------------------------------------------

@pytest.mark.timeout(180)  # finish 90 s + 30 s for the processes to go, on a loaded 2-core machine
def test_launch_on_a_local_ray_runs_every_role_and_leaves_nothing(tag: str, ray_address: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.py -n 2 -s 2 --launcher ray starts its own Ray, even with RAY_ADDRESS naming the module's
    (which it leaves untouched: no placement group there), sums right, prefixes output, exits 0 and
    leaves no process (roles, tethers, keepers, actors or Ray's own) behind."""
    groups_before = len(ray.util.placement_group_table())
    monkeypatch.setenv("RAY_ADDRESS", ray_address)  # what ray.init(address=None) would join
    rc, out = finish(_launch(["-n", "2", "-s", "2", SCRIPT, "dist_sync"], tag), timeout=90)
    assert rc == 0, out
    for rank in range(2):
        assert f"[worker {rank}] RESULT ok rank={rank} of 2 servers=2" in out, out
    assert "[scheduler]" in out and "[server 1]" in out and "all workers left; shut down" in out, out
    assert len(ray.util.placement_group_table()) == groups_before, "the job ran on RAY_ADDRESS's cluster"
    assert poll_for(lambda: _nothing_left(tag), 30, "every process of the job and its Ray to exit")


@pytest.mark.timeout(180)  # finish 90 s + 20 s + 20 s
def test_launch_failing_worker_exits_1_naming_it(tag: str, ray_address: str) -> None:
    """A command worker that raises (sum_check.py dist_sync 1), on a joined Ray cluster: exit code 1,
    the message names worker 1, the other roles are stopped and the cluster is left running."""
    start = time.monotonic()
    rc, out = finish(_launch(["-n", "2", "-s", "1", "--ray-address", ray_address, SCRIPT, "dist_sync", "1"],
                             tag), timeout=90)
    assert rc == 1, out
    assert "worker 1 exited with code 1" in out, out
    assert "[worker 1] RuntimeError: worker 1 fails on purpose" in out, out
    last = out.strip().splitlines()[-1]
    assert last == "launch.py: worker 1 failed first (exit 1): RuntimeError: worker 1 fails on purpose", out
    assert time.monotonic() - start < 45, out  # the other worker was blocked in a pull with a 600 s deadline
    assert poll_for(lambda: _nothing_left(tag), 20, "every role, tether and keeper to exit")
    assert ray.is_initialized() and poll_for(_all_cpus_free, 20, "the job's CPUs to be released")


@pytest.mark.timeout(180)  # finish 100 s + 20 s
def test_launch_restarts_a_dead_command_worker_in_its_actor(tag: str, ray_address: str,
                                                            tmp_path: Path) -> None:
    """--max-restarts 1 on Ray: worker 1 SIGKILLed after round 3 is started again in its actor as
    incarnation 1, rejoins, and the job exits 0 with every role gone after it."""
    script = str(Path(__file__).parents[1] / "scripts" / "restart_train.py")
    rc, out = finish(_launch(["-n", "2", "-s", "1", "--ray-address", ray_address, "--max-restarts", "1",
                              "--env", "KVSTORE_TEST_DIE_AT_ROUND=1:3", script, "8", str(tmp_path / "w")],
                             tag), timeout=100)
    assert rc == 0, out
    assert "worker 1 exited with code 137; restarting it in its actor as incarnation 1" in out, out
    assert "[worker 1] rejoined the cluster as incarnation 1 at round" in out, out
    assert "[worker 1] done steps" in out and "[worker 0] done steps 0..8" in out, out
    assert poll_for(lambda: _nothing_left(tag), 20, "every role, tether and keeper to exit")


def test_an_elastic_job_on_ray_grows_from_two_to_three_workers(tag: str, ray_address: str,
                                                             tmp_path: Path) -> None:
    """--min-workers 2 --max-workers 3 on Ray: 2 of 3 slots start; worker 0's first 'join' in the control
    file starts a worker actor in slot 2 (KVSTORE_JOIN=1, incarnation 1) that takes the current weights
    and step and trains; its second finds every slot held and is refused and logged; every round's update
    is the sum over the workers in it, and the job exits 0 with nothing left."""
    script = str(Path(__file__).parents[1] / "scripts" / "ray_elastic.py")
    rc, out = finish(_launch(["-n", "2", "-s", "1", "--ray-address", ray_address, "--min-workers", "2",
                              "--max-workers", "3", script, str(tmp_path / "rec"), "3"], tag), timeout=100)
    assert rc == 0, out
    assert "elastic job of 3 worker slots: append a line 'join' to" in out, out
    assert "starting worker 2 (incarnation 1) to join the running job" in out, out
    assert "all 3 worker slots (max_workers) are held: refused" in out, out
    records = {}
    for path in tmp_path.glob("rec.*.*"):
        records[int(path.name.split(".")[1])] = [line.split() for line in path.read_text().splitlines()]
    assert sorted(records) == [0, 1, 2], out  # one process per slot: the second join started nothing
    pushed: dict[int, set[int]] = {}  # step -> ranks that pushed in it
    seen: dict[int, set[tuple[int, float]]] = {}  # step -> (members, value) the workers read
    for rank, lines in records.items():
        start, end = lines[0], lines[-1]
        assert start[0] == "start" and end[0] == "end", (rank, lines)
        assert start[3:] == (["1", "1", "3"] if rank == 2 else ["0", "0", "3"]), start  # JOIN, incarnation, W
        steps = [int(line[0]) for line in lines[1:-1]]
        assert steps == list(range(int(start[1]), int(end[1]))), rank  # every step from its start, once
        for step, members, value in lines[1:-1]:
            pushed.setdefault(int(step), set()).add(rank)
            seen.setdefault(int(step), set()).add((int(members), float(value)))
    expected, values = 0.0, {}  # the reference: sgd (lr 1) over the sum of 2**rank of each round's workers
    for step in sorted(pushed):
        expected -= sum(2.0 ** r for r in pushed[step])
        values[step] = expected
        assert seen[step] == {(sum(1 << r for r in pushed[step]), expected)}, (step, pushed[step], seen[step])
    first = int(records[2][0][1])
    assert first > 3 and float(records[2][0][2]) == values[first - 1]  # the weights after the round before
    assert sorted(pushed) == list(range(len(pushed)))  # no step missing
    assert [sorted(pushed[s]) for s in sorted(pushed)][-5:] == [[0, 1, 2]] * 5
    assert poll_for(lambda: _nothing_left(tag), 20, "every role, tether and keeper to exit")


# -- the Python API -----------------------------------------------------------------------------------

@pytest.mark.timeout(180)  # run 90 s + 20 s + 20 s
def test_run_a_function_returns_results_in_rank_order(tag: str, ray_address: str) -> None:
    """run(fn, 3, 2) calls fn in 3 worker actors joined to 2 servers; results come back by rank, and
    the function's prints come back prefixed."""
    out = io.StringIO()
    results = kvray.run(sum_check, 3, 2, args=(2.0,), env={**ROLE_ENV, "KVSTORE_TEST_TAG": tag},
                        stdout=out, timeout=90)
    host = ray.util.get_node_ip_address()
    assert results == [(rank, 3, 12.0, host) for rank in range(3)], out.getvalue()
    for rank in range(3):
        assert f"[worker {rank}] hello from rank {rank}\n" in out.getvalue()
    assert "[scheduler]" in out.getvalue() and "[server 1]" in out.getvalue()
    assert poll_for(lambda: _nothing_left(tag), 20, "every role, tether, keeper and worker actor to exit")
    assert poll_for(_all_cpus_free, 20, "the job's CPUs to be released") and _no_live_placement_groups()


@pytest.mark.timeout(180)  # solo 60 s + wait 90 s + 20 s
def test_add_worker_starts_a_function_worker_in_a_slot_left_for_good(tag: str, ray_address: str,
                                                                    tmp_path: Path) -> None:
    """start(fn, 2, 1, max_workers=2): worker 1 leaves for good (exit 0) and its slot is free again; then
    job.add_worker() starts a new worker actor in it (KVSTORE_JOIN=1, incarnation 1) that trains with
    worker 0 from the job's step; the results are by slot, the joiner's in slot 1."""
    env = {**ROLE_ENV, "KVSTORE_TEST_TAG": tag}
    job = kvray.start(leave_and_rejoin, 2, 1, args=(str(tmp_path),), env=env, stdout=io.StringIO(),
                      min_workers=1, max_workers=2)
    assert job.control_file is not None and Path(job.control_file).exists()
    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            outcome["results"] = job.wait(90)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            outcome["error"] = exc

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        assert poll_for(lambda: (tmp_path / "solo").exists() and job.held_slots == {0} or "error" in outcome,
                        60, "worker 1 to leave and worker 0 to train alone"), outcome
        job.add_worker()
    finally:
        waiter.join(100)
        job.stop()
    assert "error" not in outcome, outcome
    results = outcome["results"]
    assert results[0] == (0, "0", "0", 0), results
    assert results[1][:3] == (1, "1", "1") and results[1][3] > 3, results  # the joiner, from the job's step
    assert not Path(job.control_file).exists()  # its private folder is removed with the job
    assert poll_for(lambda: _nothing_left(tag), 20, "every role, tether, keeper and worker actor to exit")


@pytest.mark.timeout(150)  # run 90 s + 20 s
def test_the_secret_is_in_no_ray_log_or_session_file(tag: str, ray_address: str) -> None:
    """A function run's KVSTORE_SECRET reaches every role (they authenticate with it) but no file of the
    Ray session: not runtime_env_agent.log, which logs an actor's runtime_env, nor any other."""
    secret = f"ray-test-secret-{uuid.uuid4().hex}"
    env = {**ROLE_ENV, "KVSTORE_TEST_TAG": tag, "KVSTORE_SECRET": secret}
    results = kvray.run(sum_check, 2, 1, args=(1.0,), env=env, stdout=io.StringIO(), timeout=90)
    assert [result[:3] for result in results] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert poll_for(lambda: _nothing_left(tag), 20, "every role and worker actor to exit")
    assert _session_files_containing(secret) == []


@pytest.mark.timeout(330)  # start (placement 60 s, actors created 60 s, scheduler started 30 s, port 30 s,
                           # roles started 30 s) + 60 s + 60 s + 15 s + 20 s
@pytest.mark.parametrize("role,rank", [("worker", 1), ("server", 1), ("scheduler", None)])
def test_killing_a_role_actor_fails_the_run_naming_it(tag: str, ray_address: str, tmp_path: Path,
                                                      role: str, rank: int | None) -> None:
    """ray.kill of worker 1's, server 1's or the scheduler's actor mid-training: wait() raises RoleFailed
    naming it within seconds, and every role is stopped (a killed actor's tether, under its keeper,
    stops its process).  While the job runs, the scheduler's and servers' tethers and keepers carry
    the test's tag, so the final check would see them left behind.  No port-file directory is left,
    even by the killed scheduler's actor.  Heartbeats are slowed down, so neither the failure nor
    the clean-up can come from them."""
    dirs_before = _port_dirs()
    env = {**ROLE_ENV, "KVSTORE_TEST_TAG": tag, "KVSTORE_HEARTBEAT_TIMEOUT": "60"}
    job = kvray.start(steady, 3, 2, args=(str(tmp_path),), env=env, stdout=io.StringIO())
    with job:
        poll_for(lambda: len(list(tmp_path.iterdir())) == 3, 60, "every worker to finish a round")
        # 1 scheduler + 2 servers run tethered (function workers do not): a keeper and a tether each
        assert sorted(_tethers(tag).values()) == ["keeper"] * 3 + ["tether"] * 3, _tethers(tag)
        killed = time.monotonic()
        ray.kill(job.actor(role, rank))
        with pytest.raises(RoleFailed) as info:
            job.wait(timeout=60)
    assert time.monotonic() - killed < 20
    assert (info.value.role, info.value.rank, info.value.exit_code) == (role, rank, None)
    name = role if rank is None else f"{role} {rank}"
    assert f"{name} died" in str(info.value) and "ray.kill" in str(info.value), str(info.value)
    assert poll_for(lambda: _nothing_left(tag), 15, "every role, tether, keeper and worker actor to exit")
    assert poll_for(_all_cpus_free, 20, "the job's CPUs to be released")
    assert _port_dirs() - dirs_before == set()


@pytest.mark.parametrize("actor,connect,placement,expected", [
    (_StuckActor, "3", 60, "scheduler's Ray actor did not start its role within 3 s of being created "
     "(KVSTORE_CONNECT_TIMEOUT)"),
    (_StuckCreationActor, "60", 3,
     "scheduler's Ray actor was not created within 3 s (the placement timeout)"),
])
def test_an_actor_that_does_not_start_its_role_fails_the_start_in_time(
        tag: str, ray_address: str, monkeypatch: pytest.MonkeyPatch, actor: type, connect: str,
        placement: float, expected: str) -> None:
    """A role actor whose start call never returns, or whose creation never ends: start() raises
    DeadlineExceededError naming the scheduler and the wait that ran out (KVSTORE_CONNECT_TIMEOUT, or
    the placement timeout, 3 s here, the other one 60 s) instead of blocking, and tears the job down."""
    stuck = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(actor)
    monkeypatch.setattr(ray_job, "_Remote", stuck)
    env = {**ROLE_ENV, "KVSTORE_TEST_TAG": tag, "KVSTORE_CONNECT_TIMEOUT": connect}
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError) as info:
        kvray.start(steady, 2, 1, args=("/nonexistent",), env=env, stdout=io.StringIO(),
                    placement_timeout=placement)
    assert time.monotonic() - start < 45  # 3 s, and the teardown: up to 20 s for an actor still being created
    assert expected in str(info.value), str(info.value)
    assert poll_for(_no_live_placement_groups, 20, "the placement group to be removed")
    assert poll_for(_all_cpus_free, 20, "the stuck actor to be killed and its CPUs released")


@pytest.mark.timeout(150)  # run 90 s + 20 s
def test_a_slow_actor_creation_is_not_held_against_the_connect_timeout(
        tag: str, ray_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 0's actor takes 12 s to be created, KVSTORE_CONNECT_TIMEOUT is 8 s: every actor is created
    (within the placement timeout, 60 s) before any role starts, so neither the driver's wait for the
    start calls nor the scheduler's rendezvous (both KVSTORE_CONNECT_TIMEOUT) counts the creation, and
    the run succeeds.  (8 s, not less: the timeout still covers each role's own start, the scheduler's
    and servers' interpreter and imports, which took over 4 s on a loaded 2-core CI machine.)"""
    slow = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(_SlowCreationActor)
    monkeypatch.setattr(ray_job, "_Remote", slow)
    env = {**ROLE_ENV, "KVSTORE_TEST_TAG": tag, "KVSTORE_CONNECT_TIMEOUT": "8"}
    results = kvray.run(sum_check, 2, 1, args=(1.0,), env=env, stdout=io.StringIO(), timeout=90)
    assert [result[:3] for result in results] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert poll_for(lambda: _nothing_left(tag), 20, "every role and worker actor to exit")


def _read_lines(stream: io.TextIOBase, lines: list[str]) -> None:
    """Append each line of ``stream`` to ``lines`` until its end (run in a thread)."""
    for line in stream:
        lines.append(line)


@pytest.mark.timeout(180)  # READY 60 s + exit 60 s + output 10 s + 20 s
def test_sigterm_to_the_launcher_exits_143_and_stops_everything(tag: str, ray_address: str) -> None:
    """SIGTERM to launch.py --launcher ray while the workers are blocked: exit 143, nothing left."""
    proc = _launch(["-n", "2", "-s", "1", "--ray-address", ray_address, sys.executable, "-c",
                    "import kvstore, numpy as np; kv = kvstore.create('dist_sync'); "
                    "kv.init(1, np.zeros(1)); print('READY', flush=True); "
                    "kv.push(1, np.ones(1)) or kv.pull(1) if kv.rank == 0 else kv.barrier()"], tag)
    lines: list[str] = []
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    try:
        poll_for(lambda: any(line.startswith("[worker 1] READY") for line in list(lines)), 60,
                 "worker 1 to print READY")
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("launch.py ran on 60 s past SIGTERM:\n" + "".join(lines)) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    out = "".join(lines)
    assert not reader.is_alive(), "the launcher's output did not end with it: " + out
    assert rc == 143, out
    assert "interrupted; stopping every process" in out, out
    assert poll_for(lambda: _nothing_left(tag), 20, "every role, tether and keeper to exit")


def test_a_raising_function_fails_the_run_with_its_traceback(tag: str, ray_address: str) -> None:
    """A worker function that raises: RoleFailed names the worker, carries the traceback, exit code 1."""
    out = io.StringIO()
    with pytest.raises(RoleFailed) as info:
        kvray.run(raise_on_rank_1, 2, 1, env={**ROLE_ENV, "KVSTORE_TEST_TAG": tag}, stdout=out, timeout=60)
    assert (info.value.role, info.value.rank, info.value.exit_code) == ("worker", 1, 1)
    message = str(info.value)
    assert "worker 1's function raised" in message, message
    assert "RuntimeError: worker function fails on purpose" in message, message
    assert "Traceback" in message and "[worker 1] Traceback" in out.getvalue()
    assert poll_for(lambda: not tagged_pids(tag), 20, "every role and worker actor to exit")


def test_a_job_that_cannot_be_placed_fails_fast_naming_cpus(ray_address: str) -> None:
    """worker_cpus=64 on a 2-CPU Ray: PlacementError within the placement timeout, saying what was
    asked and what there is; the placement group is removed."""
    start = time.monotonic()
    with pytest.raises(PlacementError) as info:
        kvray.run(sum_check, 2, 1, args=(1.0,), worker_cpus=64, placement_timeout=2)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "2 workers x 64 CPU" in message and "1 scheduler x 0.05 CPU" in message, message
    assert "2 CPU in all" in message, message
    assert poll_for(_no_live_placement_groups, 10, "the placement group to be removed")
    assert poll_for(_all_cpus_free, 10, "every CPU to be free")


def test_launch_that_cannot_be_placed_exits_1_naming_the_cpus(tag: str, ray_address: str) -> None:
    """launch.py --ray-worker-cpus 64 on a 2-CPU Ray: exit 1 with the placement error, nothing started."""
    rc, out = finish(_launch(["-n", "2", "-s", "1", "--ray-address", ray_address, "--ray-worker-cpus", "64",
                              "--ray-placement-timeout", "2", SCRIPT, "dist_sync"], tag), timeout=90)
    assert rc == 1, out
    assert "could not place the job within 2 s" in out and "2 workers x 64 CPU" in out, out
    assert "[worker" not in out, out
    assert poll_for(_no_live_placement_groups, 10, "the placement group to be removed")

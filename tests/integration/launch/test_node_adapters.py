"""``python -m kvstore.node`` under cluster managers, end to end: every process gets only a manager's
environment (no DMLC_ROLE, no ids) and derives its role; real schedulers, servers and workers run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from kvstore.launch import managers
from tests.helpers import REPO, Processes, poll_for, python, tagged_pids

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "sum_check.py")
NODE = [sys.executable, "-m", "kvstore.node"]
# Every variable that could make a child pick another role or manager than the test means: blank
# counts as unset for kvstore.config and kvstore.launch.managers alike, so these mask the test runner's own.
MASKED = {name: "" for adapter in managers.ADAPTERS for name in adapter.variables} | {
    name: "" for name in ("DMLC_ROLE", "DMLC_WORKER_ID", "KVSTORE_SERVER_ID", "DMLC_NODE_HOST",
                          "DMLC_INTERFACE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER",
                          "DMLC_NUM_WORKER", "KVSTORE_RANK_OFFSET", "KVSTORE_NODE_PORT",
                          "SLURM_STEP_NUM_TASKS", "SLURM_NODELIST", "KVSTORE_PORT_FILE", "LOCAL_RANK")}


def kill_group(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s process group (it was started with a session of its own) unless it has exited, and
    join ``proc``: what it started (an mpirun's ranks, a node's helper) goes with it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()


def run_group(argv: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True)`` in ``REPO``, in a session of its own, so
    that a timeout or any error kills and joins the whole group, not only ``argv``'s process."""
    proc = subprocess.Popen(argv, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def free_port() -> int:
    """A port nothing listens on right now (bound to 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def procs(tmp_path: Path, tag: str):
    """Child processes, each carrying the test's tag; killed and joined at teardown."""
    children = Processes(tmp_path)
    yield children
    children.stop(timeout=0)  # anything still running is killed now and joined
    for pid in tagged_pids(tag):  # e.g. a scheduler a TF_CONFIG chief's node started
        os.kill(pid, signal.SIGKILL)


def base_env(tag: str, **extra: str) -> dict[str, str]:
    """The environment every process of a test cluster shares (plus ``extra``)."""
    return {**MASKED, "KVSTORE_BIGARRAY_BOUND": "1000", "KVSTORE_SECRET": "node-adapters-secret",
            "KVSTORE_CONNECT_TIMEOUT": "30", "KVSTORE_SHUTDOWN_TIMEOUT": "5", "PYTHONUNBUFFERED": "1",
            "KVSTORE_LOG_LEVEL": "INFO", "KVSTORE_TEST_TAG": tag, **extra}


BUSY = "Address already in use"


def run_cluster(procs: Processes, make_envs: Callable[[], list[tuple[str, dict[str, str]]]]
                ) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """Start ``kvstore.node sum_check.py dist_sync`` once per (name, env) of ``make_envs()``; wait for all
    to exit 0; return each one's output and env by name.

    ``make_envs`` draws its ports with :func:`free_port`, which another process may take before a role
    binds it: when a role fails with "Address already in use", the others are stopped and the cluster
    is started once more, with the ports of a second ``make_envs()``.
    """
    for attempt in (1, 2):
        envs = make_envs()
        started = [(procs.start(name, [*NODE, SCRIPT, "dist_sync"], env),
                    procs.workdir / f"{name.replace(' ', '_')}.log") for name, env in envs]
        poll_for(lambda started=started: _busy(started) or all(p.poll() is not None for p, _ in started), 90,
                 "every process to exit")
        if attempt == 1 and _busy(started):
            for proc, _ in started:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            continue
        assert [p.returncode for p, _ in started] == [0] * len(started), procs.output()
        return {name: log.read_text() for (name, _), (_, log) in zip(envs, started)}, dict(envs)
    raise AssertionError("not reached")


def _busy(started: list[tuple[subprocess.Popen, Path]]) -> bool:
    """Whether a process has failed because its port was taken."""
    return any(proc.poll() not in (None, 0) and BUSY in log.read_text(errors="replace")
               for proc, log in started)


def test_open_mpi_environment_runs_a_cluster(procs: Processes, tag: str) -> None:
    """Four processes with only OMPI_COMM_WORLD_RANK/SIZE: rank 0 schedules, rank 1 serves, 2-3 train."""
    def envs() -> list[tuple[str, dict[str, str]]]:
        shared = base_env(tag, OMPI_COMM_WORLD_SIZE="4", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1",
                          DMLC_PS_ROOT_PORT=str(free_port()))
        return [(f"rank {r}", {**shared, "OMPI_COMM_WORLD_RANK": str(r)}) for r in range(4)]

    out, used = run_cluster(procs, envs)
    port = used["rank 0"]["DMLC_PS_ROOT_PORT"]
    assert f"kvstore.node: mpi rank 0 of 4 -> scheduler, scheduler 127.0.0.1:{port}" in out["rank 0"]
    assert f"listening on port {port}" in out["rank 0"]
    assert "serving on 127.0.0.1:" in out["rank 1"]
    for rank, worker in ((2, 0), (3, 1)):
        assert f"mpi rank {rank} of 4 -> worker {worker}," in out[f"rank {rank}"]
        assert f"RESULT ok rank={worker} of 2 servers=1" in out[f"rank {rank}"], procs.output()
    assert "node-adapters-secret" not in procs.output()


def test_slurm_environment_runs_a_cluster(procs: Processes, tag: str) -> None:
    """Four Slurm tasks on node list 'localhost': the scheduler runs on its first (only) host."""
    def envs() -> list[tuple[str, dict[str, str]]]:
        shared = base_env(tag, SLURM_NTASKS="4", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77",
                          DMLC_NUM_SERVER="1", DMLC_PS_ROOT_PORT=str(free_port()))
        return [(f"task {r}", {**shared, "SLURM_PROCID": str(r)}) for r in range(4)]

    out, used = run_cluster(procs, envs)
    port = used["task 0"]["DMLC_PS_ROOT_PORT"]
    assert f"slurm task 0 of 4 -> scheduler, scheduler localhost:{port}" in out["task 0"]
    assert "slurm task 1 of 4 -> server 0" in out["task 1"]
    assert "RESULT ok rank=0 of 2 servers=1" in out["task 2"] and "RESULT ok rank=1 of 2" in out["task 3"]


def test_torchrun_runs_a_cluster(procs: Processes, tag: str) -> None:
    """The real torchrun (--standalone, 4 processes, -m kvstore.node): its agent shares its store with
    the processes (TORCHELASTIC_USE_AGENT_STORE=True), so the scheduler binds any free port, rank 0
    publishes it there, and every other rank reads it from there."""
    pytest.importorskip("torch.distributed.run")
    proc = procs.start("torchrun", [python(), "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node=4", "-m", "kvstore.node", SCRIPT, "dist_sync"],
                       base_env(tag, DMLC_NUM_SERVER="1"))
    poll_for(lambda: proc.poll() is not None, 90, "torchrun to exit")
    out = procs.output()
    assert proc.returncode == 0, out
    published = re.search(r"torchrun rank 0 of 4 -> scheduler, scheduler localhost:0 \(any free port, "
                          r"published in torchrun's store at localhost:(\d+) as "
                          r"kvstore/scheduler_port/[^/ ]+/restart0/nodes1/world4\)",
                          out)
    port = re.search(r"listening on port (\d+)", out)
    assert published and port, out
    assert int(port.group(1)) != int(published.group(1)) + 1  # not the old MASTER_PORT + 1 rule
    for rank, role in ((1, "server 0"), (2, "worker 0"), (3, "worker 1")):
        line = rf"torchrun rank {rank} of 4 -> {role}, scheduler localhost:{port.group(1)}(?!\d)"
        assert re.search(line, out), out
    assert "RESULT ok rank=0 of 2 servers=1" in out and "RESULT ok rank=1 of 2 servers=1" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every process, rank 0's helper too, to exit")


@pytest.fixture
def agent_store() -> Iterator[object]:
    """A TCPStore server standing in for torchrun's agent's (torch.distributed's, in this process)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    yield store
    del store


def torch_env(tag: str, store_port: int, rank: int, **extra: str) -> dict[str, str]:
    """The variables torchrun (torch >= 2.4, sharing its store) gives rank ``rank`` of 4, S=1."""
    return base_env(tag, **{"RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(store_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                            "DMLC_NUM_SERVER": "1", **extra})


SHOW_PORT = [python(), "-c", "import os; print('PORT', os.environ['DMLC_PS_ROOT_PORT'])"]


def test_torchrun_rank0_publishes_the_port_it_bound(agent_store, procs: Processes, tag: str) -> None:
    """Rank 0's scheduler binds any free port; a helper puts it under the round's key (run id, restart
    count, nodes, world size) in the agent's store, then exits (nothing but the scheduler is left)."""
    procs.start("rank 0", NODE, torch_env(tag, agent_store.port, 0, TORCHELASTIC_RESTART_COUNT="1",
                                          TORCHELASTIC_RUN_ID="job42", GROUP_WORLD_SIZE="2"))
    key = "kvstore/scheduler_port/job42/restart1/nodes2/world4"
    agent_store.set_timeout(timedelta(seconds=30))
    port = int(agent_store.get(key))
    log = procs.workdir / "rank_0.log"
    poll_for(lambda: f"listening on port {port} " in log.read_text(), 30, "rank 0's scheduler's log line")
    line = ("torchrun rank 0 of 4 -> scheduler, scheduler 127.0.0.1:0 (any free port, published in "
            f"torchrun's store at 127.0.0.1:{agent_store.port} as {key})")
    assert line in log.read_text()
    assert poll_for(lambda: len(tagged_pids(tag)) == 1, 30, "rank 0's helper to exit"), procs.output()


def test_torchrun_other_ranks_read_the_published_port(agent_store, tag: str) -> None:
    """Ranks 1..3 take DMLC_PS_ROOT_PORT from the store; without it by KVSTORE_CONNECT_TIMEOUT they exit
    1 naming the store and key; an unreachable store exits 2 saying to set DMLC_PS_ROOT_PORT; a plan
    that does not fit exits 2 before any wait."""
    agent_store.set("kvstore/scheduler_port/none/restart0/nodes1/world4", "45678")
    cases = {  # run side by side: each pays for importing torch
        "ok": torch_env(tag, agent_store.port, 2),
        "late": torch_env(tag, agent_store.port, 3, TORCHELASTIC_RESTART_COUNT="1",
                          KVSTORE_CONNECT_TIMEOUT="1"),
        "nobody": torch_env(tag, free_port(), 1, KVSTORE_CONNECT_TIMEOUT="1"),
        "nobody at rank 0": torch_env(tag, free_port(), 0, KVSTORE_CONNECT_TIMEOUT="1"),
        "bad plan": torch_env(tag, agent_store.port, 1, DMLC_NUM_SERVER="3"),
    }
    started: dict[str, subprocess.Popen] = {}
    try:
        for name, env in cases.items():
            started[name] = subprocess.Popen([*NODE, *SHOW_PORT], env={**os.environ, **env}, cwd=REPO,
                                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             start_new_session=True)
        done = {name: (proc.communicate(timeout=60), proc.returncode) for name, proc in started.items()}
    finally:
        for proc in started.values():
            kill_group(proc)
    (out, err), code = done["ok"]
    assert (code, out) == (0, "PORT 45678\n"), err
    assert "torchrun rank 2 of 4 -> worker 0, scheduler 127.0.0.1:45678" in err
    (_, err), code = done["late"]
    assert code == 1, err
    assert (f"kvstore.node: rank 0 did not publish the scheduler's port in torchrun's store at "
            f"127.0.0.1:{agent_store.port} (key kvstore/scheduler_port/none/restart1/nodes1/world4) "
            "within 1 s") in err
    for name in ("nobody", "nobody at rank 0"):  # rank 0 before it execs the scheduler
        (_, err), code = done[name]
        assert code == 2, err
        assert err.startswith("kvstore.node: cannot reach torchrun's store at 127.0.0.1:"), err
        assert "set DMLC_PS_ROOT_PORT" in err
    (_, err), code = done["bad plan"]
    assert code == 2 and "WORLD_SIZE=4 leaves no worker" in err, err
    assert not any("Traceback" in err for (_, err), _ in done.values())


def tf_config(cluster: dict[str, list[str]], kind: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def test_tf_config_chief_hosts_the_scheduler(procs: Processes, tag: str) -> None:
    """chief + worker + ps from TF_CONFIG alone: the ps binds its given port, the chief's node runs the
    scheduler at the chief's address beside its worker, and nothing is left once the workers are done."""
    clusters = []

    def envs() -> list[tuple[str, dict[str, str]]]:
        cluster = {job: [f"127.0.0.1:{free_port()}"] for job in ("chief", "worker", "ps")}
        clusters.append(cluster)
        return [(f"{kind} {i}", base_env(tag, TF_CONFIG=tf_config(cluster, kind, i)))
                for kind, i in (("ps", 0), ("worker", 0), ("chief", 0))]

    out, _ = run_cluster(procs, envs)
    chief, ps = (clusters[-1][job][0].rsplit(":", 1)[1] for job in ("chief", "ps"))
    assert f"serving on 127.0.0.1:{ps} " in out["ps 0"]  # KVSTORE_NODE_PORT: the port TF_CONFIG gave it
    assert (f"tf_config task chief:0 -> worker 0 and the scheduler, scheduler 127.0.0.1:{chief}"
            in out["chief 0"])
    assert f"listening on port {chief}" in out["chief 0"]  # the scheduler's output goes where the node's does
    assert "RESULT ok rank=0 of 2 servers=1" in out["chief 0"]
    assert "RESULT ok rank=1 of 2 servers=1" in out["worker 0"]
    assert poll_for(lambda: not tagged_pids(tag), 10, "every process, the chief's scheduler too, to exit")


def _start_blocked_chief(procs: Processes, tag: str) -> subprocess.Popen:
    """A TF_CONFIG chief whose worker blocks forever; returns its node once scheduler and worker run."""
    cluster = {"chief": [f"127.0.0.1:{free_port()}"], "ps": [f"127.0.0.1:{free_port()}"]}
    blocker = [python(), "-c", "import threading; print('READY', flush=True); threading.Event().wait()"]
    node = procs.start("chief", [*NODE, *blocker], base_env(tag, TF_CONFIG=tf_config(cluster, "chief", 0)))
    log = procs.workdir / "chief.log"
    poll_for(lambda: "READY" in log.read_text() and "listening on port" in log.read_text(), 30,
             "the chief's worker and scheduler to start")
    assert len(tagged_pids(tag)) == 3, procs.output()  # the node, its scheduler, its worker
    return node


def test_tf_chief_node_passes_sigterm_on_and_leaves_nothing(procs: Processes, tag: str) -> None:
    """SIGTERM to the chief's node reaches its worker and scheduler; it exits 143 and nothing is left."""
    node = _start_blocked_chief(procs, tag)
    node.send_signal(signal.SIGTERM)
    assert node.wait(timeout=30) == 128 + signal.SIGTERM, procs.output()
    assert poll_for(lambda: not tagged_pids(tag), 10, "the scheduler and worker to exit")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_tf_chief_children_die_with_the_node(procs: Processes, tag: str) -> None:
    """When the chief's node is SIGKILLed, its scheduler and worker do not outlive it."""
    node = _start_blocked_chief(procs, tag)
    node.kill()
    node.wait(timeout=30)
    assert poll_for(lambda: not tagged_pids(tag), 10, "the orphaned scheduler and worker to exit")


FAKE_MPI = '''
"""A stand-in for mpi4py.MPI: every rank on one host; non-root ranks receive FAKE_MPI_ROOT."""
import os
import numpy as np

_rank, _size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])


class _Comm:
    def Get_rank(self):
        return _rank

    def Get_size(self):
        return _size

    def Allgather(self, send, recv):
        recv[:] = send

    def Bcast(self, buf, root=0):
        if _rank != root:
            value = os.environ["FAKE_MPI_ROOT"].encode()
            buf[:] = 0
            buf[: len(value)] = np.frombuffer(value, np.uint8)


COMM_WORLD = _Comm()


def Get_processor_name():
    return "fakehost"


def Finalize():
    with open(os.environ["FAKE_MPI_FINALIZED"], "a") as fh:
        fh.write(f"finalized by {os.getpid()}\\n")
'''


def fake_mpi4py(where: Path, source: str) -> Path:
    """A package ``mpi4py`` under ``where`` whose ``MPI`` module is ``source``; returns ``where``."""
    (where / "mpi4py").mkdir(parents=True)
    (where / "mpi4py" / "__init__.py").write_text("")
    (where / "mpi4py" / "MPI.py").write_text(source)
    return where


def test_mpi4py_tells_the_root_and_mpi_is_finalized_before_exec(tmp_path: Path, procs: Processes,
                                                                 tag: str) -> None:
    """Without DMLC_PS_ROOT_URI and with mpi4py importable, rank 0 broadcasts its address (127.0.0.1
    when every rank shares its host) and MPI.Finalize runs before the role is exec'd."""
    fake = fake_mpi4py(tmp_path / "fake", FAKE_MPI)
    marker = tmp_path / "finalized"
    env = base_env(tag, OMPI_COMM_WORLD_SIZE="3", DMLC_NUM_SERVER="1", PYTHONPATH=str(fake),
                   FAKE_MPI_ROOT="127.0.0.1", FAKE_MPI_FINALIZED=str(marker))
    show = [python(), "-c", "import os; print('ROOT', os.environ['DMLC_PS_ROOT_URI'], "
            "os.environ['DMLC_WORKER_ID'], open(os.environ['FAKE_MPI_FINALIZED']).read().split()[-1] "
            "== str(os.getpid()))"]
    worker = run_group([*NODE, *show], {**os.environ, **env, "OMPI_COMM_WORLD_RANK": "2"})
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout.split() == ["ROOT", "127.0.0.1", "0", "True"], worker.stdout + worker.stderr
    port = free_port()
    procs.start("rank 0", [*NODE], {**env, "OMPI_COMM_WORLD_RANK": "0", "DMLC_PS_ROOT_PORT": str(port)})
    log = procs.workdir / "rank_0.log"
    poll_for(lambda: f"listening on port {port}" in log.read_text(), 30, "rank 0's scheduler")
    assert f"mpi rank 0 of 3 -> scheduler, scheduler 127.0.0.1:{port}" in log.read_text()
    assert marker.read_text().count("finalized") == 2  # once per rank


def test_node_without_manager_or_with_a_bad_plan_exits_2() -> None:
    """No manager: the old 'DMLC_ROLE is not set' error, naming the managers; a plan that does not fit
    SLURM_NTASKS: the one-line fix; both exit 2 without a traceback."""
    env = {**os.environ, **MASKED}
    none = run_group([*NODE, "train.py"], env, timeout=30)
    assert none.returncode == 2 and "DMLC_ROLE is not set" in none.stderr and "SLURM_PROCID" in none.stderr
    bad = run_group([*NODE, "train.py"], {**env, "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
                                          "SLURM_JOB_NODELIST": "n1", "DMLC_NUM_SERVER": "2",
                                          "DMLC_NUM_WORKER": "2"}, timeout=30)
    assert bad.returncode == 2, bad.stderr
    assert "SLURM_NTASKS=4 but DMLC_NUM_SERVER=2 + DMLC_NUM_WORKER=2 + 1 scheduler = 5 tasks" in bad.stderr
    assert "Traceback" not in bad.stderr
    workerless = run_group(NODE, {**env, "SLURM_PROCID": "2", "SLURM_NTASKS": "3",
                                  "SLURM_JOB_NODELIST": "localhost", "DMLC_NUM_SERVER": "1"}, timeout=30)
    assert workerless.returncode == 2 and "a worker needs a command" in workerless.stderr


def test_mpi_is_finalized_when_the_plan_fails_after_mpi_init(tmp_path: Path, tag: str) -> None:
    """A check that fails after mpi4py's MPI_Init (a worker without a command, counts that do not add
    up) still finalizes MPI before the exit 2."""
    fake = fake_mpi4py(tmp_path / "fake", FAKE_MPI)
    marker = tmp_path / "finalized"
    env = {**os.environ, **base_env(tag, OMPI_COMM_WORLD_SIZE="3", DMLC_NUM_SERVER="1", PYTHONPATH=str(fake),
                                    FAKE_MPI_ROOT="127.0.0.1", FAKE_MPI_FINALIZED=str(marker))}
    for extra, argv, message in (({"OMPI_COMM_WORLD_RANK": "2"}, [], "a worker needs a command"),
                                 ({"OMPI_COMM_WORLD_RANK": "1", "DMLC_NUM_WORKER": "5"}, ["train.py"],
                                  "OMPI_COMM_WORLD_SIZE=3 but DMLC_NUM_SERVER=1 + DMLC_NUM_WORKER=5")):
        marker.unlink(missing_ok=True)
        result = run_group([*NODE, *argv], {**env, **extra})
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert marker.read_text().count("finalized") == 1, result.stderr


def test_broken_mpi4py_exits_2_naming_the_fix(tmp_path: Path, tag: str) -> None:
    """mpi4py present but its import failing (libmpi missing): exit 2 with one line saying to set
    DMLC_PS_ROOT_URI, no traceback."""
    missing = "libmpi.so.40: cannot open shared object file: No such file or directory"
    broken = fake_mpi4py(tmp_path / "broken", f"raise ImportError({missing!r})\n")
    env = base_env(tag, OMPI_COMM_WORLD_SIZE="3", OMPI_COMM_WORLD_RANK="2", DMLC_NUM_SERVER="1",
                   PYTHONPATH=str(broken))
    result = run_group([*NODE, "train.py"], {**os.environ, **env})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("kvstore.node: mpi4py is installed but cannot be imported (libmpi.so.40: "
                                    "cannot open shared object file"), result.stderr
    assert "set DMLC_PS_ROOT_URI" in result.stderr and "Traceback" not in result.stderr


def test_a_command_that_cannot_start_exits_127(tag: str) -> None:
    """A worker command that does not exist: one line and exit 127, as the tether and the launcher do,
    whether DMLC_ROLE is set or derived."""
    env = {**os.environ, **base_env(tag, DMLC_PS_ROOT_PORT="1", DMLC_NUM_SERVER="1")}
    given = {**env, "DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NUM_WORKER": "1"}
    derived = {**env, "SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "localhost"}
    for case in (given, derived):
        result = run_group([*NODE, "no-such-command-kvstore", "--flag"], case, timeout=30)
        assert result.returncode == 127, result.stderr
        assert ("kvstore.node: cannot start no-such-command-kvstore: No such file or directory"
                in result.stderr), result.stderr
        assert "Traceback" not in result.stderr


def test_the_real_mpirun_runs_a_cluster(tmp_path: Path, tag: str) -> None:
    """Open MPI's own mpirun starts four copies of one command line; MPI ranks become the roles."""
    import shutil

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("needs Open MPI's mpirun (Debian's openmpi-bin; .ci/run installs it)")
    port = free_port()
    env = {**os.environ, **base_env(tag, DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1",
                                    DMLC_PS_ROOT_PORT=str(port)),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env = {name: value for name, value in env.items() if value != ""}  # mpirun sets the rank variables
    names = ("DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "KVSTORE_SECRET",
             "KVSTORE_BIGARRAY_BOUND", "KVSTORE_TEST_TAG")
    forwarded = [arg for name in names for arg in ("-x", name)]
    proc = subprocess.Popen([mpirun, "-n", "4", "--oversubscribe", *forwarded, *NODE, SCRIPT, "dist_sync"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    assert f"mpi rank 0 of 4 -> scheduler, scheduler 127.0.0.1:{port}" in out
    for worker in (0, 1):
        assert f"RESULT ok rank={worker} of 2 servers=1" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every MPI process to exit")


def test_the_real_mpirun_gives_every_rank_one_job_port() -> None:
    """Open MPI's mpirun sets a job id (OMPI_MCA_ess_base_jobid) in every rank: without
    DMLC_PS_ROOT_PORT the ranks of one job agree on a port from it, in 10000..29999 (not 9091)."""
    import shutil

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("needs Open MPI's mpirun (Debian's openmpi-bin; .ci/run installs it)")
    env = {name: value for name, value in {**os.environ, **MASKED}.items() if value != ""}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    show = ("import os; from kvstore.launch.managers.mpi import mpi; "
            "env = {**os.environ, 'DMLC_NUM_SERVER': '1', 'DMLC_PS_ROOT_URI': 'h'}; "
            # one write per rank: mpirun interleaves the ranks' writes
            "os.write(1, f\"<PORT={mpi(env)['DMLC_PS_ROOT_PORT']}>\\n\".encode())")
    result = run_group([mpirun, "-n", "3", "--oversubscribe", python(), "-c", show], env)
    assert result.returncode == 0, result.stdout + result.stderr
    ports = re.findall(r"<PORT=(\d+)>", result.stdout)
    assert len(ports) == 3 and len(set(ports)) == 1, result.stdout
    assert 10000 <= int(ports[0]) <= 29999

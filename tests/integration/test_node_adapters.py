"""``python -m kvstore.node`` under cluster managers, end to end: every process gets only a manager's
environment (no DMLC_ROLE, no ids) and derives its role; real schedulers, servers and workers run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import adapters
from tests.helpers import REPO, Processes, poll_for, python, tagged_pids

SCRIPT = str(Path(__file__).parent / "scripts" / "sum_check.py")
NODE = [sys.executable, "-m", "kvstore.node"]
# Every variable that could make a child pick another role or manager than the test means: blank
# counts as unset for kvstore.config and kvstore.adapters alike, so these mask the test runner's own.
MASKED = {name: "" for adapter in adapters.ADAPTERS for name in adapter.variables} | {
    name: "" for name in ("DMLC_ROLE", "DMLC_WORKER_ID", "KVSTORE_SERVER_ID", "DMLC_NODE_HOST",
                          "DMLC_INTERFACE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER",
                          "DMLC_NUM_WORKER", "KVSTORE_RANK_OFFSET", "KVSTORE_NODE_PORT",
                          "SLURM_STEP_NUM_TASKS", "SLURM_NODELIST", "KVSTORE_PORT_FILE", "LOCAL_RANK")}


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
            "KVSTORE_TEST_TAG": tag, **extra}


def run_cluster(procs: Processes, envs: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    """Start ``kvstore.node sum_check.py dist_sync`` once per (name, env); wait for all to exit 0;
    return each one's output by name."""
    started = [(name, procs.start(name, [*NODE, SCRIPT, "dist_sync"], env)) for name, env in envs]
    poll_for(lambda: all(p.poll() is not None for _, p in started), 90, "every process to exit")
    assert [p.returncode for _, p in started] == [0] * len(started), procs.output()
    return {name: (procs.workdir / f"{name.replace(' ', '_')}.log").read_text() for name, _ in started}


def test_open_mpi_environment_runs_a_cluster(procs: Processes, tag: str) -> None:
    """Four processes with only OMPI_COMM_WORLD_RANK/SIZE: rank 0 schedules, rank 1 serves, 2-3 train."""
    port = free_port()
    shared = base_env(tag, OMPI_COMM_WORLD_SIZE="4", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1",
                      DMLC_PS_ROOT_PORT=str(port))
    out = run_cluster(procs, [(f"rank {r}", {**shared, "OMPI_COMM_WORLD_RANK": str(r)}) for r in range(4)])
    assert f"kvstore.node: mpi rank 0 of 4 -> scheduler, scheduler 127.0.0.1:{port}" in out["rank 0"]
    assert f"listening on port {port}" in out["rank 0"]
    assert "serving on 127.0.0.1:" in out["rank 1"]
    for rank, worker in ((2, 0), (3, 1)):
        assert f"mpi rank {rank} of 4 -> worker {worker}," in out[f"rank {rank}"]
        assert f"RESULT ok rank={worker} of 2 servers=1" in out[f"rank {rank}"], procs.output()
    assert "node-adapters-secret" not in procs.output()


def test_slurm_environment_runs_a_cluster(procs: Processes, tag: str) -> None:
    """Four Slurm tasks on node list 'localhost': the scheduler runs on its first (only) host."""
    port = free_port()
    shared = base_env(tag, SLURM_NTASKS="4", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77",
                      DMLC_NUM_SERVER="1", DMLC_PS_ROOT_PORT=str(port))
    out = run_cluster(procs, [(f"task {r}", {**shared, "SLURM_PROCID": str(r)}) for r in range(4)])
    assert f"slurm task 0 of 4 -> scheduler, scheduler localhost:{port}" in out["task 0"]
    assert "slurm task 1 of 4 -> server 0" in out["task 1"]
    assert "RESULT ok rank=0 of 2 servers=1" in out["task 2"] and "RESULT ok rank=1 of 2" in out["task 3"]


def test_torchrun_runs_a_cluster(procs: Processes, tag: str) -> None:
    """The real torchrun (--standalone, 4 processes, -m kvstore.node): the scheduler on MASTER_PORT + 1."""
    pytest.importorskip("torch.distributed.run")
    proc = procs.start("torchrun", [python(), "-m", "torch.distributed.run", "--standalone",
                                    "--nproc-per-node=4", "-m", "kvstore.node", SCRIPT, "dist_sync"],
                       base_env(tag, DMLC_NUM_SERVER="1"))
    poll_for(lambda: proc.poll() is not None, 90, "torchrun to exit")
    out = procs.output()
    assert proc.returncode == 0, out
    assert "torchrun rank 0 of 4 -> scheduler" in out and "torchrun rank 3 of 4 -> worker 1" in out
    assert "RESULT ok rank=0 of 2 servers=1" in out and "RESULT ok rank=1 of 2 servers=1" in out, out


def tf_config(cluster: dict[str, list[str]], kind: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def test_tf_config_chief_hosts_the_scheduler(procs: Processes, tag: str) -> None:
    """chief + worker + ps from TF_CONFIG alone: the ps binds its given port, the chief's node runs the
    scheduler at the chief's address beside its worker, and nothing is left once the workers are done."""
    chief, worker, ps = free_port(), free_port(), free_port()
    cluster = {"chief": [f"127.0.0.1:{chief}"], "worker": [f"127.0.0.1:{worker}"], "ps": [f"127.0.0.1:{ps}"]}
    out = run_cluster(procs, [(f"{kind} {i}", base_env(tag, TF_CONFIG=tf_config(cluster, kind, i)))
                              for kind, i in (("ps", 0), ("worker", 0), ("chief", 0))])
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


def test_mpi4py_tells_the_root_and_mpi_is_finalized_before_exec(tmp_path: Path, procs: Processes,
                                                                 tag: str) -> None:
    """Without DMLC_PS_ROOT_URI and with mpi4py importable, rank 0 broadcasts its address (127.0.0.1
    when every rank shares its host) and MPI.Finalize runs before the role is exec'd."""
    fake = tmp_path / "fake"
    (fake / "mpi4py").mkdir(parents=True)
    (fake / "mpi4py" / "__init__.py").write_text("")
    (fake / "mpi4py" / "MPI.py").write_text(FAKE_MPI)
    marker = tmp_path / "finalized"
    env = base_env(tag, OMPI_COMM_WORLD_SIZE="3", DMLC_NUM_SERVER="1", PYTHONPATH=str(fake),
                   FAKE_MPI_ROOT="127.0.0.1", FAKE_MPI_FINALIZED=str(marker))
    show = [python(), "-c", "import os; print('ROOT', os.environ['DMLC_PS_ROOT_URI'], "
            "os.environ['DMLC_WORKER_ID'], open(os.environ['FAKE_MPI_FINALIZED']).read().split()[-1] "
            "== str(os.getpid()))"]
    worker = subprocess.run([*NODE, *show], env={**os.environ, **env, "OMPI_COMM_WORLD_RANK": "2"}, cwd=REPO,
                            capture_output=True, text=True, timeout=60)
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
    none = subprocess.run([*NODE, "train.py"], env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert none.returncode == 2 and "DMLC_ROLE is not set" in none.stderr and "SLURM_PROCID" in none.stderr
    bad = subprocess.run([*NODE, "train.py"], cwd=REPO, capture_output=True, text=True, timeout=30,
                         env={**env, "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1",
                              "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "2"})
    assert bad.returncode == 2, bad.stderr
    assert "SLURM_NTASKS=4 but DMLC_NUM_SERVER=2 + DMLC_NUM_WORKER=2 + 1 scheduler = 5 tasks" in bad.stderr
    assert "Traceback" not in bad.stderr
    workerless = subprocess.run(NODE, cwd=REPO, capture_output=True, text=True, timeout=30,
                                env={**env, "SLURM_PROCID": "2", "SLURM_NTASKS": "3",
                                     "SLURM_JOB_NODELIST": "localhost", "DMLC_NUM_SERVER": "1"})
    assert workerless.returncode == 2 and "a worker needs a command" in workerless.stderr


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
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    assert f"mpi rank 0 of 4 -> scheduler, scheduler 127.0.0.1:{port}" in out
    for worker in (0, 1):
        assert f"RESULT ok rank={worker} of 2 servers=1" in out, out
    assert poll_for(lambda: not tagged_pids(tag), 10, "every MPI process to exit")

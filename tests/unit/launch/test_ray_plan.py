"""The pure parts of kvstore.ray: the roles' bundles, their environments, messages, exit codes.

The Ray processes themselves are tested in tests/integration/test_ray.py.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import config as kvconfig
from kvstore.errors import PlacementError, RoleFailed
from kvstore.launch import envrules as roles
from kvstore.launch.options import LaunchConfig
from kvstore.net import address
from tests.helpers import REPO

kvray = pytest.importorskip("kvstore.ray", reason="needs the [ray] extra: `import ray` failed")
from kvstore.launch import ray_actor, ray_cluster, ray_job, ray_plan  # noqa: E402 -- after the skip: ray_job imports ray


def test_plan_has_scheduler_then_servers_then_workers_with_fractional_cpus() -> None:
    """Bundle i is role i: the scheduler, servers 0..S-1, workers 0..W-1, none asking a whole CPU."""
    roles = ray_plan.role_specs(3, 2)
    assert [r.name for r in roles] == ["scheduler", "server 0", "server 1",
                                       "worker 0", "worker 1", "worker 2"]
    assert [r.bundle() for r in roles] == [{"CPU": 0.05}] + [{"CPU": 0.1}] * 5
    assert all(r.cpus < 1 for r in roles)


def test_plan_sizes_are_configurable_and_gpus_go_to_workers_only() -> None:
    """CPU sizes per kind of role; worker_gpus adds a GPU to each worker's bundle only."""
    roles = ray_plan.role_specs(2, 1, scheduler_cpus=0.5, server_cpus=2, worker_cpus=4, worker_gpus=1)
    assert [r.bundle() for r in roles] == [{"CPU": 0.5}, {"CPU": 2},
                                           {"CPU": 4, "GPU": 1}, {"CPU": 4, "GPU": 1}]


@pytest.mark.parametrize("kwargs,message", [
    ({"num_workers": 0, "num_servers": 1}, "at least 1"),
    ({"num_workers": 1, "num_servers": 0}, "at least 1"),
    ({"num_workers": 1, "num_servers": 1, "worker_cpus": 0}, "worker_cpus=0"),
    ({"num_workers": 1, "num_servers": 1, "server_cpus": -1}, "server_cpus=-1"),
    ({"num_workers": 1, "num_servers": 1, "worker_gpus": -0.5}, "worker_gpus=-0.5"),
])
def test_bad_plans_are_value_errors(kwargs: dict, message: str) -> None:
    """Counts below 1, CPU amounts not > 0 and negative GPU amounts are refused, naming the argument."""
    with pytest.raises(ValueError, match=message):
        ray_plan.role_specs(**kwargs)


def test_describe_request_and_cluster() -> None:
    """The placement error's two halves: what was asked (roles x size, total) and what there is."""
    roles = ray_plan.role_specs(2, 2, worker_cpus=64)
    assert ray_plan.describe_request(roles) == ("1 scheduler x 0.05 CPU, 2 servers x 0.1 CPU, "
                                             "2 workers x 64 CPU (128.2 CPU in all)")
    one = ray_plan.role_specs(1, 1, worker_gpus=0.5)
    assert ray_plan.describe_request(one) == ("1 scheduler x 0.05 CPU, 1 server x 0.1 CPU, "
                                           "1 worker x 0.1 CPU + 0.5 GPU (0.25 CPU and 0.5 GPU in all)")
    assert ray_plan.describe_cluster({"CPU": 2.0}, {"CPU": 1.5}, [2.0]) == \
        "2 CPU in all, 1.5 available, on 1 node of at most 2 CPU"
    assert ray_plan.describe_cluster({"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0}, [4.0, 4.0]) == \
        "8 CPU in all, 8 available; 2 GPU in all, 0 available, on 2 nodes of at most 4 CPU"


def test_only_kvstore_dmlc_and_omp_variables_are_forwarded_and_never_per_role_ones() -> None:
    """The caller's KVSTORE_*/DMLC_* and OMP_NUM_THREADS go to every role, except the ones set per role;
    nothing else (PATH, HOME, ...)."""
    caller = {"KVSTORE_REQUEST_TIMEOUT": "5", "DMLC_INTERFACE": "eth0", "PATH": "/bin", "HOME": "/root",
              "OMP_NUM_THREADS": "8", "DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "10.0.0.1",
              "KVSTORE_PORT_FILE": "/tmp/p", "DMLC_WORKER_ID": "3", "KVSTORE_SERVER_ID": "1",
              "KVSTORE_NODE_PORT": "7000"}
    assert roles.forwarded(caller) == {"KVSTORE_REQUEST_TIMEOUT": "5", "DMLC_INTERFACE": "eth0",
                                       "OMP_NUM_THREADS": "8"}


def _env(spec: object, **overrides: object) -> dict[str, str]:
    kwargs = {"num_workers": 2, "num_servers": 1, "secret": "s3cret", "root_uri": "10.0.0.1",
              "root_port": 9000, "node_ip": "10.0.0.7", **overrides}
    return ray_plan.role_environ(spec, **kwargs)


def test_role_environments() -> None:
    """Each role gets the cluster contract, its own rank and node address, the secret, unbuffered
    output; workers default to OMP_NUM_THREADS=1."""
    scheduler, server, worker0, worker1 = ray_plan.role_specs(2, 1)
    common = {"DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "10.0.0.1",
              "DMLC_PS_ROOT_PORT": "9000", "DMLC_NODE_HOST": "10.0.0.7", "KVSTORE_SECRET": "s3cret",
              "PYTHONUNBUFFERED": "1"}
    assert _env(scheduler, root_port=0) == {**common, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_PORT": "0"}
    assert _env(server) == {**common, "DMLC_ROLE": "server", "KVSTORE_SERVER_ID": "0"}
    assert _env(worker1) == {**common, "DMLC_ROLE": "worker", "DMLC_WORKER_ID": "1", "OMP_NUM_THREADS": "1"}
    # every role's config parses, and names the scheduler's address
    for spec in (server, worker0):
        cfg = kvconfig.load(_env(spec))
        assert cfg.root_address == "tcp://10.0.0.1:9000" and address.node_host(cfg) == "10.0.0.7"


def test_role_environment_precedence() -> None:
    """Lowest to highest: OMP default, the caller's variables, PYTHONUNBUFFERED/secret, env (--env),
    then the per-role ones, which nothing overrides; DMLC_INTERFACE replaces the node address."""
    worker = ray_plan.role_specs(1, 1)[2]
    env = _env(worker, forwarded={"KVSTORE_SECRET": "callers", "KVSTORE_REQUEST_TIMEOUT": "5",
                                  "DMLC_NODE_HOST": "1.2.3.4"},
               extra={"OMP_NUM_THREADS": "4", "KVSTORE_REQUEST_TIMEOUT": "7", "KVSTORE_SECRET": "mine",
                      "DMLC_ROLE": "server", "DMLC_NUM_WORKER": "9", "DMLC_WORKER_ID": "5", "X": "y"})
    assert env["OMP_NUM_THREADS"] == "4" and env["KVSTORE_REQUEST_TIMEOUT"] == "7" and env["X"] == "y"
    assert env["KVSTORE_SECRET"] == "mine"
    assert (env["DMLC_ROLE"], env["DMLC_NUM_WORKER"], env["DMLC_WORKER_ID"]) == ("worker", "2", "0")
    assert env["DMLC_NODE_HOST"] == "10.0.0.7"
    by_interface = _env(worker, forwarded={"DMLC_INTERFACE": "eth0"})
    assert by_interface["DMLC_INTERFACE"] == "eth0" and "DMLC_NODE_HOST" not in by_interface
    assert "OMP_NUM_THREADS" not in _env(ray_plan.role_specs(1, 1)[1])  # servers keep their own default
    # the caller's OMP_NUM_THREADS (forwarded) replaces the workers' default of 1, and reaches servers
    for spec in ray_plan.role_specs(1, 1)[1:]:
        assert _env(spec, forwarded=roles.forwarded({"OMP_NUM_THREADS": "8"}))["OMP_NUM_THREADS"] == "8"


def test_without_an_address_a_new_local_ray_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """address=None is ray.init(address="local"): a new Ray even where RAY_ADDRESS or a `ray start`
    cluster would make ray.init(address=None) join that one; an address is passed as given."""
    calls: list[dict] = []
    monkeypatch.setattr(kvray.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(kvray.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray_cluster, "_disable_usage_stats", lambda: None)
    kvray.RayJob(["train.py"], 1, 1).connect()
    kvray.RayJob(["train.py"], 1, 1, address="10.0.0.5:6379").connect()
    assert [call["address"] for call in calls] == ["local", "10.0.0.5:6379"]


def test_death_reason_takes_rays_sentence() -> None:
    """The reason of a RayActorError is its 'The actor is dead because ...' line, else its first line."""
    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: _RoleActor\n"
            "The actor is dead because it was killed by `ray.kill`.")
    assert ray_job._death_reason(RuntimeError(text)) == "it was killed by `ray.kill`."
    assert ray_job._death_reason(RuntimeError("node lost\nmore")) == "node lost"


def test_wait_port_reports_the_exit_when_the_port_file_cannot_be_read(tmp_path: Path) -> None:
    """A scheduler that wrote its port and exited at once: the exit removes the port file's directory,
    maybe between wait_port seeing the file and opening it.  An unreadable port file (a directory
    here, which exists but cannot be opened) falls through to the exit code instead of raising."""
    actor = ray_actor.RoleActor("scheduler")
    actor._port_file = str(tmp_path)
    assert actor.wait_port(0.2) == (None, None)  # nothing readable, no exit: the deadline
    actor._exited(0)
    assert actor.wait_port(5) == (None, 0)
    port_file = tmp_path / "scheduler.port"
    port_file.write_text("4321\n")
    actor._port_file = str(port_file)
    assert actor.wait_port(5) == (4321, None)


class _FakeJob:
    """Stands in for RayJob in launch(): raises ``error`` from supervise(), records stop()."""

    error: BaseException | None = None
    stopped = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.exceptions: dict = {}  # no role printed a traceback

    def connect(self) -> None:
        pass

    def start(self) -> _FakeJob:
        return self

    def supervise(self) -> list:
        if _FakeJob.error is not None:
            raise _FakeJob.error
        return [0]

    def stop(self) -> None:
        _FakeJob.stopped += 1


@pytest.mark.parametrize("error,code,logged", [
    (None, 0, None),
    (RoleFailed("worker 1 exited with code 3", "worker", 1, 3), 3,
     "worker 1 exited with code 3; stopping the other processes"),
    (RoleFailed("worker 1 died (its Ray actor ...)", "worker", 1, None), 1, "worker 1 died"),
    (PlacementError("Ray could not place the job"), 1, "Ray could not place the job"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (KeyboardInterrupt(signal.SIGTERM), 143, "interrupted"),
])
def test_launch_exit_codes(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                           capsys: pytest.CaptureFixture, error: BaseException | None, code: int,
                           logged: str | None) -> None:
    """launch() keeps the local launcher's exit codes, logs the reason, and always tears down."""
    monkeypatch.setattr(kvray, "RayJob", _FakeJob)
    monkeypatch.setattr(_FakeJob, "error", error)
    monkeypatch.setattr(_FakeJob, "stopped", 0)
    cfg = LaunchConfig(2, 1, ["train.py"], launcher="ray")
    with caplog.at_level(logging.INFO, logger="kvstore.launcher"):
        assert kvray.launch(cfg, kvconfig.Config()) == code
    assert _FakeJob.stopped == 1
    if logged:
        assert any(logged in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    last = capsys.readouterr().err.strip().splitlines()[-1:]
    if isinstance(error, RoleFailed):  # the last line, as every launcher ends a failed run
        exit_text = "unknown" if error.exit_code is None else error.exit_code
        assert last == [f"launch.py: worker 1 failed first (exit {exit_text})"]
    else:
        assert last == []


def test_importing_kvstore_does_not_import_ray() -> None:
    """`import kvstore` leaves ray (and kvstore.ray) unimported."""
    out = subprocess.run([sys.executable, "-c", "import sys, kvstore, kvstore.launch.cli; "
                          "print('ray' in sys.modules, 'kvstore.ray' in sys.modules)"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr

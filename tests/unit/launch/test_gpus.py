"""--gpus-per-worker's placement logic (kvstore.launch.gpus), without GPUs: the host's count is injected."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.launch import cli, gpus, managers
from kvstore.launch.local import gpu_plan
from kvstore.launch.options import LaunchConfig, parse_args

pytestmark = pytest.mark.timeout(30)


def on_host(count: int):
    """A ``devices_of`` for :func:`gpus.plan`: every host has GPUs 0..count-1."""
    return lambda host: ([str(i) for i in range(count)], "a test")


def test_four_workers_with_two_gpus_each_share_an_eight_gpu_host() -> None:
    """4 x 2 on 8 GPUs: 0,1 / 2,3 / 4,5 / 6,7, with torchrun's names, and never MASTER_ADDR/PORT."""
    envs = gpus.plan([None] * 4, 2, on_host(8))
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0,1", "2,3", "4,5", "6,7"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1", "2", "3"]
    assert [env["RANK"] for env in envs] == ["0", "1", "2", "3"]
    assert {env["WORLD_SIZE"] for env in envs} == {"4"} and {env["LOCAL_WORLD_SIZE"] for env in envs} == {"4"}
    assert all(set(env) == set(gpus.GPU_NAMES) for env in envs)


def test_local_rank_counts_per_host() -> None:
    """Workers on two hosts (rank order a, b, a, b): each host's workers count from 0 and share its GPUs."""
    envs = gpus.plan(["a", "b", "a", "b"], 1, on_host(2))
    assert [(env["RANK"], env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) for env in envs] == [
        ("0", "0", "0"), ("1", "0", "0"), ("2", "1", "1"), ("3", "1", "1")]
    assert {env["LOCAL_WORLD_SIZE"] for env in envs} == {"2"}


def test_the_host_lists_ids_handed_out_in_order() -> None:
    """A host whose GPUs are 3,5,7,9 (CUDA_VISIBLE_DEVICES) gives those ids, not 0..3."""
    devices = gpus.host_devices({"CUDA_VISIBLE_DEVICES": "3,5,7,9"}, count=lambda: 99)
    envs = gpus.plan([None, None], 2, lambda host: devices)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["3,5", "7,9"]


def test_too_few_gpus_fail_naming_the_host_and_the_override() -> None:
    """2 workers x 1 GPU on a host with none: a ConfigError saying so, before anything starts."""
    with pytest.raises(ConfigError, match=r"host h1 runs 2 worker\(s\), which need 2 GPU\(s\), and it has 0 "
                       r"\(counted from a test; set KVSTORE_HOST_GPUS"):
        gpus.plan(["h1", "h1"], 1, on_host(0))
    with pytest.raises(ConfigError, match="must be >= 0"):
        gpus.plan(["h1"], -1, on_host(8))


def test_zero_gpus_per_worker_hides_every_gpu_and_needs_none() -> None:
    """--gpus-per-worker 0: an empty CUDA_VISIBLE_DEVICES and the torchrun names, on a host without GPUs."""
    envs = gpus.plan([None, None], 0, on_host(0))
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["", ""]
    assert [env["RANK"] for env in envs] == ["0", "1"]


@pytest.mark.parametrize(("environ", "count", "expected"), [
    ({"KVSTORE_HOST_GPUS": "3", "CUDA_VISIBLE_DEVICES": "0"}, 8, (["0", "1", "2"], "KVSTORE_HOST_GPUS")),
    ({"KVSTORE_HOST_GPUS": "4,6"}, None, (["4", "6"], "KVSTORE_HOST_GPUS")),
    ({"CUDA_VISIBLE_DEVICES": ""}, 8, ([], "CUDA_VISIBLE_DEVICES")),
    ({"CUDA_VISIBLE_DEVICES": "GPU-a1b2, GPU-c3d4"}, 8, (["GPU-a1b2", "GPU-c3d4"], "CUDA_VISIBLE_DEVICES")),
    ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, 8, (["1"], "CUDA_VISIBLE_DEVICES")),  # CUDA stops at an invalid id
    ({}, 2, (["0", "1"], "nvidia-smi -L")),
    ({"KVSTORE_HOST_GPUS": " "}, None, ([], "nvidia-smi -L (not found or failed)")),
])
def test_a_hosts_gpus_come_from_the_override_then_cuda_visible_devices_then_nvidia_smi(
        environ: dict[str, str], count: int | None, expected: tuple[list[str], str]) -> None:
    """KVSTORE_HOST_GPUS wins, then CUDA_VISIBLE_DEVICES (even empty), then nvidia-smi's count."""
    assert gpus.host_devices(environ, count=lambda: count) == expected


def test_a_negative_override_is_refused() -> None:
    """KVSTORE_HOST_GPUS=-1 is neither a count nor a list of ids."""
    with pytest.raises(ConfigError, match="KVSTORE_HOST_GPUS=-1"):
        gpus.host_devices({"KVSTORE_HOST_GPUS": "-1"})


def test_nvidia_smi_count_is_none_or_a_count_on_this_machine() -> None:
    """Without nvidia-smi (this machine) the count is None; it never raises."""
    found = gpus.nvidia_smi_count()
    assert found is None or found >= 0


def test_a_remote_host_needs_the_override() -> None:
    """ssh / mpirun -H hosts: the launcher cannot count their GPUs, so KVSTORE_HOST_GPUS must tell."""
    with pytest.raises(ConfigError, match="set KVSTORE_HOST_GPUS to the GPUs every host has"):
        gpus.devices_for({"CUDA_VISIBLE_DEVICES": "0,1"}, remote=True)
    assert gpus.devices_for({"KVSTORE_HOST_GPUS": "2"}, remote=True) == (["0", "1"], "KVSTORE_HOST_GPUS")


def test_the_launchers_plan_follows_the_ssh_placement() -> None:
    """-s 1 -n 3 on hosts a, b: server 0 on a, workers 0, 1, 2 on b, a, b; local ranks per host."""
    cfg = LaunchConfig(3, 1, ["t.py"], "ssh", hosts=[("a", None), ("b", None)], gpus_per_worker=1)
    envs = gpu_plan(cfg, {"KVSTORE_HOST_GPUS": "2"})
    assert [(env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) for env in envs] == [
        ("0", "2"), ("0", "1"), ("1", "2")]
    assert gpu_plan(LaunchConfig(3, 1, ["t.py"]), {}) is None  # no flag: no variables at all


def test_a_spark_task_uses_the_gpus_spark_assigned_it() -> None:
    """Spark's per-task GPU addresses are the worker's; local ranks still count per host."""
    env = gpus.task_share(3, 4, 1, 2, ["5", "6"], [], 1)
    assert env == {"CUDA_VISIBLE_DEVICES": "5", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match="spark.task.resource.gpu.amount"):
        gpus.task_share(0, 1, 0, 1, ["0"], [], 2)
    assert gpus.task_share(1, 2, 1, 2, None, ["0", "1", "2", "3"], 2)["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_worker_with_rank_and_world_size_but_no_master_addr_is_no_torchrun_job() -> None:
    """The variables --gpus-per-worker sets never make kvstore.node take a worker for a torchrun rank."""
    worker = gpus.plan([None, None], 0, on_host(0))[1]
    assert managers.detect(worker) is None
    under_mpi = {**worker, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    assert managers.detect(under_mpi).name == "mpi"
    assert managers.detect({**worker, "MASTER_ADDR": "h", "MASTER_PORT": "1"}).name == "torchrun"


def test_the_flag_is_parsed_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """--gpus-per-worker N: kept; negative, with Ray, or with --env of a variable it sets: usage errors."""
    assert parse_args(["-n", "2", "--gpus-per-worker", "2", "t.py"]).gpus_per_worker == 2
    assert parse_args(["-n", "2", "t.py"]).gpus_per_worker is None
    for argv, message in ((["--gpus-per-worker", "-1"], "must be >= 0"),
                          (["--launcher", "ray", "--gpus-per-worker", "1"], "--ray-worker-gpus"),
                          (["--gpus-per-worker", "1", "--env", "CUDA_VISIBLE_DEVICES=0"],
                           "CUDA_VISIBLE_DEVICES"),
                          (["--gpus-per-worker", "1", "--env-worker", "RANK=0"], "sets RANK")):
        with pytest.raises(SystemExit) as info:
            parse_args(["-n", "2", *argv, "t.py"])
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_the_launcher_refuses_too_few_gpus_before_starting_anything(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """launch.py -n 2 --gpus-per-worker 1 on a host with one GPU: exit 2 and why, nothing started
    (the worker command does not even exist)."""
    monkeypatch.setenv("KVSTORE_HOST_GPUS", "1")
    monkeypatch.setenv("KVSTORE_SECRET", "gpus-test")
    code = cli.main(["-n", "2", "-s", "1", "--gpus-per-worker", "1", "no-such-command-kvstore"])
    assert code == 2
    assert "host localhost runs 2 worker(s), which need 2 GPU(s), and it has 1" in caplog.text
    assert "cannot start" not in caplog.text  # the worker command was never tried

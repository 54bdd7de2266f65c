"""Argument parsing of the launcher, kvstore.launch.options (the process handling is tested in
tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.launch.options import parse_args


def test_servers_default_to_workers() -> None:
    """-s defaults to -n, as in MXNet's launch.py."""
    cfg = parse_args(["-n", "4", "train.py", "--lr", "0.1"])
    assert (cfg.num_workers, cfg.num_servers) == (4, 4)
    assert cfg.command == ["train.py", "--lr", "0.1"]
    assert cfg.launcher == "local"


def test_explicit_servers_and_env() -> None:
    """-s and repeated --env NAME=VALUE are kept; the worker command keeps its own flags."""
    cfg = parse_args(["-n", "2", "-s", "1", "--env", "A=1", "--env", "B=x=y", "python", "-c", "pass"])
    assert cfg.num_servers == 1 and cfg.env == {"A": "1", "B": "x=y"}
    assert cfg.command == ["python", "-c", "pass"]


@pytest.mark.parametrize("argv", [["-n", "2"], ["-n", "0", "x.py"], ["-n", "1", "-s", "0", "x.py"],
                                  ["-n", "1", "--env", "NOEQUALS", "x.py"],
                                  ["-n", "1", "--launcher", "ssh", "x.py"],
                                  ["-n", "1", "--ray-worker-cpus", "0.5", "x.py"],
                                  ["-n", "1", "--launcher", "ray", "--ray-server-cpus", "-1", "x.py"],
                                  ["-n", "1", "--launcher", "ray", "--ray-server-cpus", "0", "x.py"],
                                  ["-n", "1", "--launcher", "ray", "--ray-worker-cpus", "0", "x.py"],
                                  ["-n", "1", "--launcher", "ray", "--ray-worker-gpus", "-1", "x.py"],
                                  ["-n", "1", "--ray-address", "auto", "x.py"],
                                  ["-n", "1", "--launcher", "ray", "--ray-placement-timeout", "0", "x.py"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    """A missing command, counts below 1, a malformed --env, an unknown launcher, a Ray CPU amount or
    placement timeout that is not > 0 and a negative GPU count are usage errors."""
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2


def test_ray_flags_are_parsed() -> None:
    """--ray-address and the per-role resources reach LaunchConfig; unset ones are left to kvstore.ray."""
    cfg = parse_args(["-n", "2", "--launcher", "ray", "--ray-address", "10.0.0.1:6379", "--ray-worker-cpus",
                      "0.5", "--ray-worker-gpus", "1", "--ray-placement-timeout", "5", "train.py"])
    assert (cfg.launcher, cfg.ray_address) == ("ray", "10.0.0.1:6379")
    assert cfg.ray_options == {"worker_cpus": 0.5, "worker_gpus": 1.0, "placement_timeout": 5.0}
    assert parse_args(["-n", "1", "--launcher", "ray", "--ray-worker-gpus", "0", "x.py"]).ray_options == {
        "worker_gpus": 0.0}  # no GPU is fine; no CPU is not (Ray could not place the actor)


def test_missing_hostfile_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """-H of a file that is not there: exit 2 naming it; ssh flags without --launcher ssh too."""
    with pytest.raises(SystemExit) as info:
        parse_args(["-n", "1", "--launcher", "ssh", "-H", str(tmp_path / "nope"), "x.py"])
    assert info.value.code == 2 and "nope" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        parse_args(["-n", "1", "--sync-dst-dir", "/tmp/x", "x.py"])
    assert info.value.code == 2


def test_ssh_flags_are_parsed(tmp_path: Path) -> None:
    """--ssh-args is split like a shell; the other ssh flags are kept as given."""
    path = tmp_path / "hosts"
    path.write_text("a\nb:2200\n")
    cfg = parse_args(["-n", "2", "--launcher", "ssh", "-H", str(path), "--ssh-args", "-i 'my key' -o A=b",
                      "--sync-dst-dir", "/srv/job", "--remote-python", "/opt/py/bin/python",
                      "--host-ip", "10.0.0.1", "train.py"])
    assert cfg.hosts == [("a", None), ("b", 2200)] and cfg.ssh_args == ["-i", "my key", "-o", "A=b"]
    assert cfg.sync_dst_dir == "/srv/job" and cfg.remote_python == "/opt/py/bin/python"
    assert cfg.host_ip == "10.0.0.1"


# -- MXNet's --env NAME, --env-server, --env-worker; the launchers we do not have ------------------

def test_env_forwards_a_bare_name_and_keeps_name_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """--env NAME passes on NAME's value here; NAME=VALUE and MXNet's NAME:VALUE set one."""
    monkeypatch.setenv("KV_OPT_FORWARDED", "from-here")
    cfg = parse_args(["-n", "1", "--env", "KV_OPT_FORWARDED", "--env", "A=1", "--env", "B:2", "--env",
                      "C=x:y", "x.py"])
    assert cfg.env == {"KV_OPT_FORWARDED": "from-here", "A": "1", "B": "2", "C": "x:y"}
    assert cfg.env_server == {} and cfg.env_worker == {}


def test_env_server_and_env_worker_are_per_role(monkeypatch: pytest.MonkeyPatch) -> None:
    """--env-server and --env-worker fill their own maps (NAME[=VALUE], NAME:VALUE), a later one wins."""
    monkeypatch.setenv("KV_OPT_THREADS", "3")
    cfg = parse_args(["-n", "2", "--env-server", "OMP_NUM_THREADS=4", "--env-server", "S=1",
                      "--env-worker", "KV_OPT_THREADS", "--env-worker", "W:2", "--env-worker", "W=3",
                      "--env", "ALL=1", "x.py"])
    assert cfg.env == {"ALL": "1"}
    assert cfg.env_server == {"OMP_NUM_THREADS": "4", "S": "1"}
    assert cfg.env_worker == {"KV_OPT_THREADS": "3", "W": "3"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--env", "KV_OPT_UNSET_NAME"], "--env KV_OPT_UNSET_NAME is not set here"),
    (["--env-worker", "KV_OPT_UNSET_NAME"], "--env-worker KV_OPT_UNSET_NAME is not set here"),
    (["--env-server", "=1"], "--env-server '=1' is not NAME, NAME=VALUE or NAME:VALUE"),
    (["--env-worker", "DMLC_ROLE=server"], "--env-worker DMLC_ROLE is set by the launcher for each role"),
    (["--env-server", "DMLC_NUM_WORKER=3"], "--env-server DMLC_NUM_WORKER is set by the launcher"),
    (["--env-server", "KVSTORE_SERVER_ID=1"], "--env-server KVSTORE_SERVER_ID is set by the launcher"),
    (["--launcher", "ray", "--env-worker", "A=1"], "--env-server and --env-worker apply to --launcher local"),
])
def test_bad_env_flags_exit_2_saying_why(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A bare NAME that is not set, an empty name, a per-role variable the launcher sets itself, and
    per-role flags with --launcher ray are usage errors that say what is wrong."""
    monkeypatch.delenv("KV_OPT_UNSET_NAME", raising=False)
    with pytest.raises(SystemExit) as info:
        parse_args(["-n", "1", *argv, "x.py"])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_env_may_still_override_cluster_wide_variables() -> None:
    """--env (every role) keeps its documented power over DMLC_NUM_* (docs/env.md)."""
    assert parse_args(["-n", "1", "--env", "DMLC_NUM_WORKER=2", "x.py"]).env == {"DMLC_NUM_WORKER": "2"}


@pytest.mark.parametrize(("launcher", "instead"), [
    ("sge", ["--launcher ssh", "python -m kvstore.node", "Slurm"]),
    ("yarn", ["kvstore.spark.run", "--launcher ray", "kvstore.ray.run"]),
])
def test_mxnet_launchers_we_lack_are_refused_naming_what_to_use(
        launcher: str, instead: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--launcher sge / yarn exit 2 with a message naming the way to use instead."""
    with pytest.raises(SystemExit) as info:
        parse_args(["-n", "1", "--launcher", launcher, "x.py"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"--launcher {launcher} is not supported" in err
    assert all(way in err for way in instead), err


def test_help_lists_only_the_launchers_we_have(capsys: pytest.CaptureFixture[str]) -> None:
    """--help exits 0, names the program as given, and offers local, ssh, mpi and ray only."""
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"], prog="kvstore-launch")
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: kvstore-launch ")
    assert "{local,ssh,mpi,ray}" in out and "sge" not in out

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

"""Argument parsing of the launcher (the process handling is tested in tests/integration)."""

from __future__ import annotations

import pytest

from kvstore.launcher import parse_args


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
                                  ["-n", "1", "--launcher", "ssh", "x.py"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    """A missing command, counts below 1, a malformed --env or an unknown launcher are usage errors."""
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2

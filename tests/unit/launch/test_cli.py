"""The launcher's entry point, kvstore.launch.cli: dispatch to a launcher and its exit code (the process
handling is tested in tests/integration)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from kvstore import config as kvconfig
from kvstore.launch import cli as launcher
from kvstore.launch.options import LaunchConfig


def test_launcher_ray_without_ray_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """--launcher ray where kvstore.ray cannot be imported (no [ray] extra): exit 2 saying what to install."""
    monkeypatch.setitem(sys.modules, "kvstore.ray", None)  # its import then raises ImportError
    cfg = LaunchConfig(1, 1, ["x.py"], launcher="ray")
    with caplog.at_level(logging.ERROR, logger="kvstore.launcher"):
        assert launcher.run(cfg, kvconfig.Config()) == 2
    assert "--launcher ray needs the [ray] extra: pip install 'kvstore-ps[ray]'" in caplog.text


def test_a_scheduler_exiting_0_before_its_port_is_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A scheduler that exits 0 without reporting its port is a failed launch: exit 1, and the log
    line says why; the workers' command was never started."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")  # stands for sys.executable, which runs `-m scheduler`
    fake.chmod(0o755)
    marker = tmp_path / "worker-ran"
    monkeypatch.setattr(sys, "executable", str(fake))
    cfg = LaunchConfig(1, 1, ["sh", "-c", f"touch {marker}"])
    with caplog.at_level(logging.ERROR, logger="kvstore.launcher"):
        assert launcher.run(cfg, kvconfig.Config(connect_timeout=30, shutdown_timeout=5)) == 1
    assert ("scheduler exited with code 0 before it reported its port (a failed launch: the launcher "
            "exits with code 1)") in caplog.text
    assert not marker.exists()

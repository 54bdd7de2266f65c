"""--tensorboard's flags and the message without the [tensorboard] extra."""

from __future__ import annotations

import sys

import pytest

from kvstore.errors import ConfigError
from kvstore.launch import tensorboard
from kvstore.launch.options import parse_args


def test_tensorboard_flags_are_parsed() -> None:
    """--tensorboard DIR and --tensorboard-keep land in the LaunchConfig."""
    cfg = parse_args(["-n", "1", "--tensorboard", "runs", "--tensorboard-keep", "x.py"])
    assert (cfg.tensorboard, cfg.tensorboard_keep) == ("runs", True)
    assert parse_args(["-n", "1", "x.py"]).tensorboard is None


@pytest.mark.parametrize("argv,text", [(["--tensorboard-keep"], "needs --tensorboard"),
                                       (["--tensorboard", "d", "--launcher", "mpi"], "local and ssh")])
def test_bad_tensorboard_flags(argv, text, capsys) -> None:
    """--tensorboard-keep alone, or --tensorboard with mpi/ray, is a usage error."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["-n", "1", *argv, "x.py"])
    assert exc.value.code == 2 and text in capsys.readouterr().err


def test_a_clear_message_without_tensorboard(monkeypatch) -> None:
    """Without the extra, require() names what to install."""
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(ConfigError, match=r"kvstore-ps\[tensorboard\]"):
        tensorboard.require()


def test_port_from_the_environment() -> None:
    """TENSORBOARD_PORT, else 0 (a free port); a bad value is a ConfigError."""
    assert tensorboard.port_from({}) == 0
    assert tensorboard.port_from({"TENSORBOARD_PORT": "6007"}) == 6007
    with pytest.raises(ConfigError):
        tensorboard.port_from({"TENSORBOARD_PORT": "high"})


def test_the_scheduler_address_reaches_the_inbox() -> None:
    """A scheduler task's report (Spark) reaches the driver's inbox once; a bad one is ignored."""
    import socket
    import threading

    got: list[tuple[str, int]] = []
    arrived = threading.Event()
    inbox = tensorboard.AddressInbox(lambda host, port: (got.append((host, port)), arrived.set()))
    try:
        with socket.create_connection(("127.0.0.1", inbox.port), timeout=5) as conn:
            conn.sendall(b"not json\n")
        tensorboard.report_address(("127.0.0.1", inbox.port), "10.0.0.5", 9091)
        assert arrived.wait(10)
        assert got == [("10.0.0.5", 9091)]
    finally:
        inbox.close()

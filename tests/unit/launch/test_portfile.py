"""kvstore.launch.portfile: the scheduler's port file, written by the scheduler, read by the launchers."""

from __future__ import annotations

import time

from kvstore.launch import portfile


def test_read_port_file(tmp_path) -> None:
    """A written port is read back; no file, an empty one or a directory reads as 'not yet' (None)."""
    path = tmp_path / "scheduler.port"
    assert portfile.read(str(path)) is None
    path.write_text("")
    assert portfile.read(str(path)) is None
    path.write_text("40123\n")
    assert portfile.read(str(path)) == 40123
    assert portfile.read(str(tmp_path)) is None


def test_write_is_read_back_and_leaves_no_temporary_file(tmp_path) -> None:
    """write() puts the port there whole (a rename), with nothing else left in the directory."""
    path = tmp_path / "scheduler.port"
    portfile.write(str(path), 9091)
    assert portfile.read(str(path)) == 9091
    assert [p.name for p in tmp_path.iterdir()] == ["scheduler.port"]


def test_wait_returns_the_port_or_none_on_exit_or_deadline(tmp_path) -> None:
    """wait() returns a port at once when there is one; None as soon as the writer has exited; None at
    the deadline, having asked ``exited`` for waits no longer than the interval."""
    path = tmp_path / "scheduler.port"
    asked: list[float] = []

    def never_exits(seconds: float) -> bool:
        asked.append(seconds)
        time.sleep(seconds)
        return False

    start = time.monotonic()
    assert portfile.wait(str(path), 0.2, never_exits) is None
    assert 0.2 <= time.monotonic() - start < 5 and asked and max(asked) <= portfile.POLL_INTERVAL
    assert portfile.wait(str(path), 60, lambda seconds: True) is None
    portfile.write(str(path), 4321)
    assert portfile.wait(str(path), 60, lambda seconds: True) == 4321

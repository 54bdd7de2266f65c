"""kvstore.net.role.run_role: config errors, body errors and the body's own code as exit codes."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError, ProtocolError
from kvstore.net import role


@pytest.fixture
def setups(monkeypatch) -> list:
    """Record logs.setup calls instead of adding handlers; load a stand-in config."""
    calls: list = []
    monkeypatch.setattr(role.logs, "setup", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(role.kvconfig, "load", lambda: type("Cfg", (), {"log_level": None, "rank": 3})())
    return calls


def test_the_bodys_code_is_returned_after_logging_is_set_up(setups):
    """The body gets the config; its return value is the exit code; logging is set up with the rank."""
    assert role.run_role("server", lambda cfg: 7 + cfg.rank, rank=lambda cfg: cfg.rank) == 10
    assert setups == [(("server", 3), {"level": "WARNING"})]


def test_a_kvstore_error_of_the_body_exits_1(setups, monkeypatch):
    """A KVStoreError raised by the body is logged and gives exit code 1."""
    logged: list = []
    monkeypatch.setattr(role.log, "error", lambda *args: logged.append(args))

    def body(cfg):
        raise ProtocolError("bad frame")

    assert role.run_role("scheduler", body) == 1
    assert [str(args[1]) for args in logged] == ["bad frame"]


def test_an_invalid_setting_exits_2_before_the_body_runs(monkeypatch, capsys):
    """A ConfigError from loading the config is printed, prefixed with the role, and gives 2."""
    def bad_load():
        raise ConfigError("DMLC_NUM_WORKER must be an int")

    monkeypatch.setattr(role.kvconfig, "load", bad_load)
    ran = []
    assert role.run_role("server", lambda cfg: ran.append(cfg) or 0) == 2
    assert ran == []
    assert "server: DMLC_NUM_WORKER must be an int" in capsys.readouterr().err

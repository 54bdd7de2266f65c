"""Unit tests of kvstore.launch.envrules: the environment rules and exit codes every launcher shares."""

from __future__ import annotations

import signal

import pytest

from kvstore.launch import envrules as roles


def test_forwarded_keeps_kvstore_dmlc_and_omp_but_no_per_role_variable() -> None:
    """Every per-role variable (two servers on one host must not share KVSTORE_NODE_PORT) stays home."""
    caller = {name: "x" for name in roles.PER_ROLE} | {
        "KVSTORE_SECRET": "s", "DMLC_INTERFACE": "eth0", "OMP_NUM_THREADS": "4", "PATH": "/bin",
        "HOME": "/root", "MY_KVSTORE_THING": "no"}
    expected = {"KVSTORE_SECRET": "s", "DMLC_INTERFACE": "eth0", "OMP_NUM_THREADS": "4"}
    assert roles.forwarded(caller) == expected
    assert "KVSTORE_NODE_PORT" in roles.PER_ROLE


def test_inherited_is_everything_but_the_per_role_variables() -> None:
    """A local child keeps PATH, HOME and every other variable, but none a launcher sets per role."""
    environ = {name: "x" for name in roles.PER_ROLE} | {"PATH": "/bin", "KVSTORE_SECRET": "s", "OTHER": "1"}
    assert roles.inherited(environ) == {"PATH": "/bin", "KVSTORE_SECRET": "s", "OTHER": "1"}


@pytest.mark.parametrize("interface,expected", [(None, "10.0.0.7"), ("", "10.0.0.7"), ("  ", "10.0.0.7"),
                                                ("eth0", None)])
def test_with_node_host_unless_an_interface_is_named(interface: str | None, expected: str | None) -> None:
    """DMLC_NODE_HOST is the given host, unless a (non-blank) DMLC_INTERFACE names the address instead."""
    env = {"DMLC_NODE_HOST": "old", "A": "1"} | ({} if interface is None else {"DMLC_INTERFACE": interface})
    out = roles.with_node_host(env, "10.0.0.7")
    assert out.get("DMLC_NODE_HOST") == expected and out["A"] == "1"
    assert env["DMLC_NODE_HOST"] == "old"  # the input is not changed


@pytest.mark.parametrize("returncode,code", [(0, 0), (3, 3), (-signal.SIGKILL, 137), (-signal.SIGTERM, 143)])
def test_exit_code_is_the_shells(returncode: int, code: int) -> None:
    """A signal death is 128 + the signal number; other codes are unchanged."""
    assert roles.exit_code(returncode) == code


def test_raise_interrupt_carries_the_signal() -> None:
    """The SIGTERM handler raises KeyboardInterrupt with the signal number."""
    with pytest.raises(KeyboardInterrupt) as info:
        roles.raise_interrupt(signal.SIGTERM, None)
    assert info.value.args == (signal.SIGTERM,)


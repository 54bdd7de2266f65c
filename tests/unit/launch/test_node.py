"""Unit tests of kvstore.launch.node's helpers around the cluster-manager adapters: rank 0's address,
a node's advertised address, the torchrun port helper's failures and mpi4py's address exchange."""

from __future__ import annotations

import errno
import os
import socket
import sys
import types

import pytest

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.launch import node
from kvstore.launch.managers.torchrun import TorchStore
from kvstore.net import address


def test_rank0_address():
    """Every rank on rank 0's host: 127.0.0.1; else rank 0's address on the route to another host."""
    assert node.rank0_address(["h1", "h1", "h1"]) == "127.0.0.1"
    assert node.rank0_address(["h1", "h1", "localhost"]) == address.route_address("localhost")
    with pytest.raises(ConfigError, match="DMLC_NODE_HOST"):
        node.rank0_address(["h1", "no-such-host.invalid"])


def fake_routes(monkeypatch, routes: dict[str, str]) -> None:
    """Make address.route_address answer from ``routes`` (host -> source address); a host missing from
    it has no route (ConfigError, as the real one raises)."""
    def route_address(host: str, hint: str | None = None) -> str:
        if host not in routes:
            raise ConfigError(f"no route to {host!r}")
        return routes[host]

    monkeypatch.setattr(address, "route_address", route_address)


SERVER = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "n01", "DMLC_PS_ROOT_PORT": "1", "DMLC_NUM_SERVER": "1",
          "DMLC_NUM_WORKER": "1"}


def test_node_host_env_never_advertises_loopback_for_a_named_scheduler(monkeypatch):
    """On the scheduler's node, where /etc/hosts maps the node's own name (Slurm's first host, torchrun's
    MASTER_ADDR) to 127.0.1.1, a server advertises the machine's outward address instead."""
    fake_routes(monkeypatch, {"n01": "127.0.1.1", "192.0.2.1": "10.1.2.3"})
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "10.1.2.3"}
    assert node.node_host_env({**SERVER, "DMLC_ROLE": "worker"}) == {"DMLC_NODE_HOST": "10.1.2.3"}
    fake_routes(monkeypatch, {"n01": "::1", "2001:db8::1": "fd00::7"})  # IPv6 only: the second probe
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "fd00::7"}


def test_node_host_env_keeps_loopback_without_a_default_route(monkeypatch):
    """An isolated machine (no default route) runs every role itself: the loopback address is right."""
    fake_routes(monkeypatch, {"n01": "127.0.1.1"})
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "127.0.1.1"}
    assert address.outward_address() is None


def test_node_host_env_uses_a_real_route_and_leaves_loopback_roots_alone(monkeypatch):
    """A route to another machine gives that address (not the outward one); a root that is itself
    loopback (127.x, ::1, localhost) keeps config's 127.0.0.1 rule and asks for no route at all."""
    fake_routes(monkeypatch, {"n01": "10.9.8.7", "192.0.2.1": "10.1.2.3"})
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "10.9.8.7"}
    fake_routes(monkeypatch, {})
    for root in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"):
        assert node.node_host_env({**SERVER, "DMLC_PS_ROOT_URI": root}) == {}


def test_outward_address_is_not_loopback_where_there_is_a_default_route():
    """The real probe: this machine's address on its default route, never loopback (or None)."""
    outward = address.outward_address()
    assert outward is None or not address.is_loopback(outward)


def test_node_host_env():
    """A server or worker with a non-loopback root and no address gets the route's; others get nothing."""
    name = socket.gethostname()  # resolvable, and not a loopback *name*, so config has no rule for it
    base = {"DMLC_PS_ROOT_URI": name, "DMLC_PS_ROOT_PORT": "1", "DMLC_NUM_SERVER": "1",
            "DMLC_NUM_WORKER": "1"}
    route = address.route_address(name)  # loopback where /etc/hosts maps this host's name to 127.x
    outward = address.outward_address() or route
    expected = {"DMLC_NODE_HOST": outward if address.is_loopback(route) else route}
    assert node.node_host_env({**base, "DMLC_ROLE": "server"}) == expected
    assert node.node_host_env({**base, "DMLC_ROLE": "worker"}) == expected
    assert node.node_host_env({**base, "DMLC_ROLE": "scheduler"}) == {}
    assert node.node_host_env({**base, "DMLC_ROLE": "server", "DMLC_NODE_HOST": "10.0.0.2"}) == {}
    assert node.node_host_env({**base, "DMLC_ROLE": "server", "DMLC_INTERFACE": "lo"}) == {}
    assert node.node_host_env({**base, "DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1"}) == {}
    unknown = {**base, "DMLC_PS_ROOT_URI": "no-such-host.invalid"}
    assert node.node_host_env({**unknown, "DMLC_ROLE": "worker"}) == {}  # a worker falls back to its name
    with pytest.raises(ConfigError, match="no-such-host.invalid"):
        node.node_host_env({**unknown, "DMLC_ROLE": "server"})


STORE = TorchStore("127.0.0.1", 1, "kvstore/scheduler_port/none/restart0/nodes1/world4", True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts this process's fds in /proc")
@pytest.mark.parametrize("failing_fork", [1, 2])
def test_publish_port_reports_a_failed_fork(monkeypatch, tmp_path, failing_fork):
    """No first fork, or no second one (in the first child, a real process, joined): an OSError naming
    the helper, fork's reason and the fix; the pipe is closed and the port file's directory removed."""
    real_fork, calls = os.fork, []

    def fork() -> int:
        calls.append(1)  # the first child inherits the parent's one call
        if len(calls) == failing_fork:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    port_dir = tmp_path / "kvstore-node"
    port_dir.mkdir()
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match=r"^cannot fork the helper that publishes the scheduler's port in "
                       rf"torchrun's store \({os.strerror(errno.EAGAIN)}\); set DMLC_PS_ROOT_PORT"):
        node.publish_port(STORE, str(port_dir / "scheduler.port"), 1.0)
    assert set(os.listdir("/proc/self/fd")) == fds
    assert not port_dir.exists()


def test_node_main_reports_an_os_error_in_one_line(monkeypatch, capsys):
    """An OSError out of the derivation (a fork refused) is one kvstore.node line and exit 1."""
    def refuse(argv: list[str], env: dict[str, str], gpus_per_worker: int | None = None) -> int:
        raise OSError("cannot fork the helper that publishes the scheduler's port in torchrun's store")

    monkeypatch.setattr(kvconfig, "child_environ", lambda extra: {})
    monkeypatch.setattr(node, "_run_derived", refuse)
    assert node.main(["train.py"]) == 1
    assert capsys.readouterr().err == ("kvstore.node: cannot fork the helper that publishes the scheduler's "
                                       "port in torchrun's store\n")


def fake_mpi(monkeypatch, names: list[str], allgather_error: Exception | None = None) -> list[str]:
    """Install an in-process stand-in for mpi4py.MPI at rank 0 of ``names`` (every rank's host name);
    returns the list its Finalize appends to."""
    calls: list[str] = []

    class Comm:
        def Get_rank(self) -> int:  # noqa: N802 -- mpi4py's names
            return 0

        def Get_size(self) -> int:  # noqa: N802
            return len(names)

        def Allgather(self, send, recv) -> None:  # noqa: N802
            if allgather_error is not None:
                raise allgather_error
            for row, name in zip(recv, names):
                row[: len(name)] = list(name.encode())

        def Bcast(self, buf, root: int = 0) -> None:  # noqa: N802
            pass

    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = Comm()
    mpi.Get_processor_name = lambda: names[0]
    mpi.Finalize = lambda: calls.append("finalized")
    package = types.ModuleType("mpi4py")
    package.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return calls


def test_mpi_root_uri_finalizes_on_every_path(monkeypatch):
    """After MPI_Init, MPI is finalized when the exchange fails or rank 0 cannot tell its address; on
    success the caller gets Finalize to call before its exec."""
    calls = fake_mpi(monkeypatch, ["h1", "h1"])
    root, finalize = node._mpi_root_uri()
    assert (root, calls) == ("127.0.0.1", [])
    finalize()
    assert calls == ["finalized"]
    calls = fake_mpi(monkeypatch, ["h1", "no-such-host.invalid"])
    with pytest.raises(ConfigError, match="no-such-host.invalid"):
        node._mpi_root_uri()
    assert calls == ["finalized"]
    calls = fake_mpi(monkeypatch, ["h1", "h2"], allgather_error=RuntimeError("MPI_ERR_COMM"))
    with pytest.raises(RuntimeError, match="MPI_ERR_COMM"):
        node._mpi_root_uri()
    assert calls == ["finalized"]


def test_mpi4py_that_cannot_be_imported_is_a_config_error(monkeypatch):
    """mpi4py found but failing to import (its libmpi missing): a ConfigError saying to set
    DMLC_PS_ROOT_URI, not a traceback."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py raises ImportError
    with pytest.raises(ConfigError, match="mpi4py is installed but cannot be imported .*DMLC_PS_ROOT_URI"):
        node._mpi_root_uri()

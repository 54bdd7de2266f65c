"""kvstore.net.address: which address a node binds and advertises, loopback, routes, host:port parsing."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.net import address


def test_route_to_loopback_is_loopback():
    """The route to 127.0.0.1 leaves from 127.0.0.1."""
    assert address.route_address("127.0.0.1") == "127.0.0.1"


def test_route_to_a_name_resolves_it():
    """A host name is resolved first; localhost's route is a loopback address."""
    assert ipaddress.ip_address(address.route_address("localhost")).is_loopback


def test_ipv6_literal_with_or_without_brackets():
    """An IPv6 literal, bracketed as in a URL or not, gives ::1 for ::1."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.connect(("::1", 9))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    assert address.route_address("::1") == "::1"
    assert address.route_address("[::1]") == "::1"


def test_route_to_another_network_is_an_address_of_this_machine():
    """For a non-local address (TEST-NET-1, no packet is sent) the answer is an address this machine can
    bind; with no route at all it is a ConfigError saying what to set."""
    try:
        mine = address.route_address("192.0.2.1")
    except ConfigError as exc:
        assert "DMLC_NODE_HOST" in str(exc)
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((mine, 0))  # raises if the address is not one of this machine's


def test_unresolvable_name_is_a_config_error():
    """A name that does not resolve is a ConfigError naming it and the variables that fix it."""
    with pytest.raises(ConfigError) as info:
        address.route_address("no-such-host.invalid")
    message = str(info.value)
    assert "no-such-host.invalid" in message and "DMLC_NODE_HOST" in message and "DMLC_INTERFACE" in message


def test_localhost_prefers_ipv4_and_the_hint_is_in_the_error():
    """'localhost' routes over 127.0.0.1 where both families resolve; a caller's hint names its own fix."""
    assert address.route_address("localhost") == "127.0.0.1"
    with pytest.raises(ConfigError, match="give --host-ip"):
        address.route_address("no-such-host.invalid", hint="give --host-ip")


def test_node_host_wins_over_everything():
    """DMLC_NODE_HOST is used as given, even with an interface and a remote root."""
    cfg = kvconfig.load({"DMLC_NODE_HOST": "10.9.8.7", "DMLC_INTERFACE": "nosuchif0",
                         "DMLC_PS_ROOT_URI": "10.0.0.1"})
    assert address.node_host(cfg) == "10.9.8.7"


@pytest.mark.parametrize("root", ["127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"])
def test_loopback_root_gives_loopback_host(root):
    """With the scheduler on a loopback address and no host/interface, the node uses 127.0.0.1."""
    assert address.node_host(kvconfig.load({"DMLC_PS_ROOT_URI": root})) == "127.0.0.1"


def test_no_root_gives_loopback_host():
    """Without DMLC_PS_ROOT_URI (a local run) the node uses 127.0.0.1."""
    assert address.node_host(kvconfig.load({})) == "127.0.0.1"


@pytest.mark.parametrize("root", ["10.0.0.1", "192.168.1.20", "scheduler.example.com", "2001:db8::1"])
def test_remote_root_without_host_or_interface_is_a_config_error(root):
    """A non-loopback root with no DMLC_NODE_HOST/DMLC_INTERFACE raises ConfigError naming both fixes."""
    with pytest.raises(ConfigError) as info:
        address.node_host(kvconfig.load({"DMLC_PS_ROOT_URI": root}))
    assert "DMLC_NODE_HOST" in str(info.value)
    assert "DMLC_INTERFACE" in str(info.value)


def test_loopback_interface_gives_127_0_0_1():
    """DMLC_INTERFACE=lo resolves to the loopback interface's address, 127.0.0.1."""
    cfg = kvconfig.load({"DMLC_INTERFACE": "lo", "DMLC_PS_ROOT_URI": "10.0.0.1"})
    assert address.node_host(cfg) == "127.0.0.1"


def test_unknown_interface_is_a_config_error():
    """An interface that does not exist raises ConfigError naming DMLC_INTERFACE and the name."""
    with pytest.raises(ConfigError) as info:
        address.node_host(kvconfig.load({"DMLC_INTERFACE": "nosuchif0"}))
    assert "DMLC_INTERFACE" in str(info.value)
    assert "nosuchif0" in str(info.value)


def test_worker_advertises_hostname_when_no_bind_address_applies():
    """A worker binds nothing, so a non-loopback root without DMLC_NODE_HOST still gives a name."""
    cfg = kvconfig.load({"DMLC_PS_ROOT_URI": "10.1.2.3"})
    with pytest.raises(ConfigError):
        address.node_host(cfg)
    assert address.advertised_host(cfg) == socket.gethostname()
    assert address.advertised_host(kvconfig.load({"DMLC_NODE_HOST": "10.9.9.9"})) == "10.9.9.9"


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "10.1.2.3", "node7"])
def test_binding_beyond_loopback_needs_a_secret(host):
    """check_bind refuses a non-loopback address without a secret, unless KVSTORE_INSECURE=1."""
    with pytest.raises(ConfigError, match="KVSTORE_SECRET"):
        address.check_bind(kvconfig.load({}), host, "the scheduler")
    address.check_bind(kvconfig.load({"KVSTORE_SECRET": "s"}), host, "the scheduler")
    address.check_bind(kvconfig.load({"KVSTORE_INSECURE": "1"}), host, "the scheduler")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1", "localhost"])
def test_loopback_binds_without_a_secret(host):
    """Loopback addresses need no secret (nothing off this machine can reach them)."""
    address.check_bind(kvconfig.load({}), host, "a server")


def test_host_address_is_an_ip_address():
    assert address.resolve_ip("127.0.0.1:41179") == "127.0.0.1"
    assert address.resolve_ip("10.1.2.3:7077") == "10.1.2.3"
    assert address.resolve_ip("[::1]:5000") == "::1"
    assert address.resolve_ip("localhost:5000") in ("127.0.0.1", "::1")  # resolved: zmq binds addresses
    assert address.resolve_ip("no-such-host.invalid:1") == "no-such-host.invalid"  # for the bind to report


@pytest.mark.parametrize("host,expected", [
    ("localhost", True), ("127.0.1.1", True), ("[::1]", True), ("::1%lo", True),
    ("10.0.0.1", False), ("node7", False), ("", False)])
def test_one_loopback_rule(host, expected):
    """is_loopback takes names, brackets and zones alike (config and node used to disagree)."""
    assert address.is_loopback(host) is expected


def test_host_port_parsing():
    """parse_host_port takes host:port and [v6]:port; split_login keeps user@ and a port's text."""
    assert address.parse_host_port("w:2") == ("w", 2)
    assert address.parse_host_port("[fd00::1]:70") == ("fd00::1", 70)
    for bad in ("w", ":1", "w:0", "w:65536", "w:x"):
        with pytest.raises(ValueError):
            address.parse_host_port(bad)
    assert address.split_login("u@h:22") == ("u@h", "22")
    assert address.split_login("[::1]") == ("::1", None)
    assert address.split_login("::1") == ("::1", None)


def test_scheduler_bind_host():
    """An IP root binds itself, localhost binds 127.0.0.1, any other name binds every interface."""
    assert address.bind_host("10.0.0.1") == "10.0.0.1"
    assert address.bind_host("[::1]") == "::1"
    assert address.bind_host("localhost") == "127.0.0.1"
    assert address.bind_host("sched.example.com") == "*"

"""Unit tests of kvstore.config.route_address: this machine's address on the route to a host."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from kvstore import config as kvconfig
from kvstore.errors import ConfigError


def test_route_to_loopback_is_loopback():
    """The route to 127.0.0.1 leaves from 127.0.0.1."""
    assert kvconfig.route_address("127.0.0.1") == "127.0.0.1"


def test_route_to_a_name_resolves_it():
    """A host name is resolved first; localhost's route is a loopback address."""
    assert ipaddress.ip_address(kvconfig.route_address("localhost")).is_loopback


def test_ipv6_literal_with_or_without_brackets():
    """An IPv6 literal, bracketed as in a URL or not, gives ::1 for ::1."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.connect(("::1", 9))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    assert kvconfig.route_address("::1") == "::1"
    assert kvconfig.route_address("[::1]") == "::1"


def test_route_to_another_network_is_an_address_of_this_machine():
    """For a non-local address (TEST-NET-1, no packet is sent) the answer is an address this machine can
    bind; with no route at all it is a ConfigError saying what to set."""
    try:
        address = kvconfig.route_address("192.0.2.1")
    except ConfigError as exc:
        assert "DMLC_NODE_HOST" in str(exc)
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((address, 0))  # raises if the address is not one of this machine's


def test_unresolvable_name_is_a_config_error():
    """A name that does not resolve is a ConfigError naming it and the variables that fix it."""
    with pytest.raises(ConfigError) as info:
        kvconfig.route_address("no-such-host.invalid")
    message = str(info.value)
    assert "no-such-host.invalid" in message and "DMLC_NODE_HOST" in message and "DMLC_INTERFACE" in message


def test_localhost_prefers_ipv4_and_the_hint_is_in_the_error():
    """'localhost' routes over 127.0.0.1 where both families resolve; a caller's hint names its own fix."""
    assert kvconfig.route_address("localhost") == "127.0.0.1"
    with pytest.raises(ConfigError, match="give --host-ip"):
        kvconfig.route_address("no-such-host.invalid", hint="give --host-ip")

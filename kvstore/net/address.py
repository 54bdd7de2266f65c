"""Every rule about host names and addresses, in one place.

Which address a node binds and advertises (:func:`node_host`), whether a host is this machine's
loopback (:func:`is_loopback`, the one definition), the route to a host (:func:`route_address`) and
this machine's outward address, the scheduler's bind address, ``host:port`` parsing for hostfiles,
``TF_CONFIG`` and Spark, and the rule that refuses to listen beyond loopback without a secret.
Probes ask the kernel only: no packet is sent.
"""

from __future__ import annotations

import ipaddress
import socket

from kvstore.config import Config
from kvstore.errors import ConfigError

# Documentation addresses (RFC 5737, RFC 3849): a UDP connect() to one reveals the source address of
# the default route without sending anything.
OUTWARD_PROBES = ("192.0.2.1", "2001:db8::1")
NODE_HOST_HINT = "set DMLC_NODE_HOST to this node's address or DMLC_INTERFACE to its interface (e.g. eth0)"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses, bracketed (``[::1]``) or with a zone (``%lo``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_bind(config: Config, host: str, what: str) -> None:
    """Refuse to bind a non-loopback ``host`` without ``KVSTORE_SECRET`` (unless ``KVSTORE_INSECURE=1``).

    Raises :class:`ConfigError` saying how to fix it.
    """
    if config.secret or config.insecure or is_loopback(host):
        return
    raise ConfigError(f"{what} would listen on {host!r} without KVSTORE_SECRET, so anyone who can reach "
                      "it could push, pull or stop the cluster. Set the same KVSTORE_SECRET on every node "
                      "(launch.py does), or KVSTORE_INSECURE=1 on a network you trust.")


def bind_host(root_uri: str) -> str:
    """The address the scheduler binds for ``DMLC_PS_ROOT_URI``: an IP address itself, 127.0.0.1 for
    ``localhost``, every interface (``*``) for any other name."""
    host = root_uri.strip("[]")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return "127.0.0.1" if root_uri == "localhost" else "*"


def interface_address(name: str) -> str:
    """Return the IPv4 address of network interface ``name`` (Linux); raises ConfigError if it has none."""
    import fcntl
    import struct

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = struct.pack("256s", name.encode()[:15])
        raw = fcntl.ioctl(sock.fileno(), 0x8915, packed)  # SIOCGIFADDR
    except OSError as exc:
        raise ConfigError(f"DMLC_INTERFACE={name!r}: cannot read its address ({exc})") from None
    finally:
        sock.close()
    return socket.inet_ntoa(raw[20:24])


def node_host(config: Config) -> str:
    """Return the address this node binds and advertises.

    ``DMLC_NODE_HOST``, else the address of ``DMLC_INTERFACE``, else 127.0.0.1 when the scheduler is
    on a loopback address.  Raises :class:`ConfigError` when none applies.
    """
    if config.node_host:
        return config.node_host
    if config.interface:
        return interface_address(config.interface)
    if config.root_uri is None or is_loopback(config.root_uri):
        return "127.0.0.1"
    raise ConfigError(
        f"cannot tell which address to bind: DMLC_PS_ROOT_URI={config.root_uri} is not a loopback "
        "address, so set DMLC_NODE_HOST to this node's address or DMLC_INTERFACE to its interface "
        "(e.g. eth0)")


def advertised_host(config: Config) -> str:
    """The address a worker reports at registration (it binds nothing, so any name will do)."""
    try:
        return node_host(config)
    except ConfigError:
        return socket.gethostname()


def route_address(host: str, hint: str | None = None) -> str:
    """Return this machine's address on the route to ``host`` (an IP address or a name; IPv4 first).

    A UDP socket is ``connect()``-ed to ``host`` and its local address read back: this only asks the
    kernel which source address it would use, no packet is sent.  Raises :class:`ConfigError` when
    ``host`` does not resolve or no route leads to it; ``hint`` says how to fix it.
    """
    target = host.strip("[]")
    hint = hint or NODE_HOST_HINT
    try:
        infos = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"cannot resolve {host!r} to find this node's address on the route to it "
                          f"({exc}); {hint}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # 'localhost' -> 127.0.0.1 before ::1
    failure: OSError | None = None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(address)
                return str(sock.getsockname()[0])
        except OSError as exc:
            failure = exc
    raise ConfigError(f"no route to {host!r} to find this node's address on ({failure}); {hint}")


def outward_address() -> str | None:
    """This machine's address on its default route, or None when it has none (an isolated machine).

    :func:`route_address` of a documentation address (:data:`OUTWARD_PROBES`, IPv4 first): no packet
    is sent.  Raises nothing.
    """
    for probe in OUTWARD_PROBES:
        try:
            return route_address(probe)
        except ConfigError:
            continue
    return None


def resolve_ip(address: str) -> str:
    """The IP address of ``host`` or ``host:port`` (zmq binds addresses, not names): the host itself
    when it is an IP address, else what it resolves to (IPv4 first), else the name unchanged."""
    host = address.rpartition(":")[0] if ":" in address else address
    host = host.strip("[]") or "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    for family in (socket.AF_INET, socket.AF_UNSPEC):
        try:
            return socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0][4][0]
        except (OSError, IndexError):
            continue
    return host


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[v6]:port`` into the host (without brackets) and a port in [1, 65535].

    Raises ValueError when there is no host or no such port.
    """
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(address)
    return host, int(port)


REACHABLE, REFUSED, UNREACHABLE = "reachable", "refused", "unreachable"  # what probe() finds


def zmq_host_port(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``tcp://[v6]:port``) as ``(host, port)``; raises ValueError otherwise."""
    return parse_host_port(address.split("://", 1)[-1])


def probe(address: str, timeout: float) -> str:
    """Whether a TCP connection to ``address`` (``tcp://host:port``) opens within ``timeout`` s:
    REACHABLE; REFUSED (the host answers, nothing listens); UNREACHABLE (no route, no answer in time,
    a malformed address).  Raises nothing."""
    try:
        with socket.create_connection(zmq_host_port(address), timeout=timeout):
            return REACHABLE
    except ConnectionRefusedError:
        return REFUSED
    except (OSError, ValueError):
        return UNREACHABLE


def split_login(entry: str) -> tuple[str, str | None]:
    """Split a hostfile entry into the host ssh is given and the port's text (None without one).

    ``host``, ``host:port``, ``[addr]`` and ``[addr]:port`` (an IPv6 address; the host is given
    without the brackets), each maybe after ``user@``; an entry with more than one colon outside
    brackets (``::1``) is a host without a port.  Raises ValueError for an empty host or a bracket
    left open or followed by something other than ``:port``.
    """
    user, at, rest = entry.rpartition("@")
    if rest.startswith("["):
        inner, close, after = rest[1:].partition("]")
        if not close or not inner or (after and not after.startswith(":")):
            raise ValueError(entry)
        host, port = user + at + inner, (after[1:] if after else None)
    elif rest.count(":") == 1:
        host, _, port = entry.rpartition(":")
    else:
        host, port = entry, None
    if not host or host.endswith("@"):
        raise ValueError(entry)
    return host, port

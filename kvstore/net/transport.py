"""zmq sockets, and nothing else: the only module that imports zmq.

Servers and the scheduler bind a ROUTER (port 0 unless told otherwise, the
real port read back); every other peer connects a DEALER.  Frames are
bytes-like; large ones are sent without copying.  ``zmq.ZMQError`` is mapped
to this project's errors here and never reaches a user.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import zmq

from kvstore.errors import ConfigError, DeadlineExceededError, NodeLostError, ProtocolError

COPY_THRESHOLD = 64 * 1024  # frames at least this big are sent zero-copy
MAX_FRAMES = 1024  # identity + MAC + header + arrays: far more than any message of ours carries


def _context() -> zmq.Context:
    return zmq.Context.instance()  # pyzmq makes a new one after fork


def _unbounded(sock: zmq.Socket) -> None:
    # No high-water marks: with bounded queues a worker blocked sending and a server
    # blocked replying to it could wait on each other forever.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_router(host: str, port: int = 0, inbound: int = 0) -> tuple[zmq.Socket, int]:
    """Bind a ROUTER socket on ``host:port`` (0 = any free port); return it and the bound port.

    ``inbound`` > 0 caps the messages zmq queues from each peer: beyond it zmq stops reading
    that peer's connection, and TCP holds the sender back (flow control; replies are never
    capped, so neither side can block the other).  Raises :class:`ConfigError` when the
    address cannot be bound (port taken, bad host).
    """
    sock = _context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    _unbounded(sock)
    if inbound:
        sock.setsockopt(zmq.RCVHWM, inbound)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(f"tcp://{_host_in_url(host)}:{port}")
    except zmq.ZMQError as exc:
        sock.close()
        hint = " (is another process using it?)" if exc.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"cannot bind tcp://{host}:{port}: {exc.strerror}{hint}") from None
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, int(endpoint.rsplit(":", 1)[1])


def connect_dealer(address: str, identity: bytes | None = None) -> zmq.Socket:
    """Return a DEALER socket connected to ``address`` (``tcp://host:port``)."""
    sock = _context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    _unbounded(sock)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if "[" in address:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        sock.close()
        raise ConfigError(f"cannot connect to {address}: {exc.strerror}") from None
    return sock


def address(host: str, port: int) -> str:
    """The zmq address of ``host:port``."""
    return f"tcp://{_host_in_url(host)}:{port}"


def send(sock: zmq.Socket, frames: Sequence[Any], identity: bytes | None = None) -> None:
    """Send one message; with ``identity``, to that peer of a ROUTER.

    Raises :class:`NodeLostError` when a ROUTER's peer is no longer connected.
    """
    parts = ([identity] if identity is not None else []) + list(frames)
    last = len(parts) - 1
    try:
        for i, part in enumerate(parts):
            big = len(part) >= COPY_THRESHOLD if hasattr(part, "__len__") else False
            sock.send(part, flags=zmq.SNDMORE if i < last else 0, copy=not big)
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            raise NodeLostError(f"peer {identity!r} is not connected") from None
        raise NodeLostError(f"sending failed: {exc.strerror}") from None


def recv(sock: zmq.Socket, max_frames: int = MAX_FRAMES) -> list[memoryview]:
    """Receive one waiting message as a list of buffers (call after a poll said it is ready).

    A message of more than ``max_frames`` frames is read to its end, not kept, and refused
    with :class:`ProtocolError` (no message of ours has more; a flood of frames must not cost
    a MAC check and an object each).
    """
    return _recv_rest(sock, sock.recv(copy=False), max_frames)


def recv_nowait(sock: zmq.Socket, max_frames: int = MAX_FRAMES) -> list[memoryview] | None:
    """:func:`recv` of a message that is already waiting, or None when there is none (no poll)."""
    try:
        first = sock.recv(flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    return _recv_rest(sock, first, max_frames)


def _recv_rest(sock: zmq.Socket, first: Any, max_frames: int) -> list[memoryview]:
    frames = [first]
    while frames[-1].more:
        if len(frames) >= max_frames:
            while sock.getsockopt(zmq.RCVMORE):
                sock.recv(copy=False)
            raise ProtocolError(f"a message of more than {max_frames} frames was refused")
        frames.append(sock.recv(copy=False))
    return [frame.buffer for frame in frames]


class Poller:
    """Wait on several sockets (and plain file descriptors) at once."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()

    def add(self, sock_or_fd: Any) -> None:
        """Watch ``sock_or_fd`` for incoming messages."""
        self._poller.register(sock_or_fd, zmq.POLLIN)

    def remove(self, sock_or_fd: Any) -> None:
        """Stop watching ``sock_or_fd``."""
        self._poller.unregister(sock_or_fd)

    def wait(self, timeout: float | None) -> list[Any]:
        """Return the watched objects that are readable, waiting up to ``timeout`` seconds."""
        ms = None if timeout is None else max(0, int(timeout * 1000))
        return [obj for obj, _ in self._poller.poll(ms)]


def recv_within(sock: zmq.Socket, timeout: float, what: str) -> list[memoryview]:
    """Receive one message within ``timeout`` seconds, else raise :class:`DeadlineExceededError`.

    ``what`` names the awaited message in the error.
    """
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        raise DeadlineExceededError(f"no {what} after {timeout:g} s")
    return recv(sock)


def close(sock: zmq.Socket, linger: float = 0.0) -> None:
    """Close ``sock``, giving unsent messages up to ``linger`` seconds to leave."""
    sock.close(linger=int(linger * 1000))

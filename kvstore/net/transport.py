"""zmq sockets, and nothing else: with ``kvstore.net.curve`` (CURVE keys), the only module that imports zmq.

Servers and the scheduler bind a ROUTER (port 0 unless told otherwise, the
real port read back); every other peer connects a DEALER.  Frames are
bytes-like; large ones are sent without copying.  ``zmq.ZMQError`` is mapped
to this project's errors here and never reaches a user.
"""

from __future__ import annotations

import ctypes
import errno
import sys
from collections.abc import Sequence
from typing import Any

import zmq

from kvstore.errors import ConfigError, DeadlineExceededError, NodeLostError, ProtocolError
from kvstore.net import curve as _curve
from kvstore.net.curve import CurveKeys
from kvstore.net.curve import keys_for as curve_keys  # noqa: F401 - the call sites' one way to the keys

COPY_THRESHOLD = 64 * 1024  # frames at least this big are sent zero-copy
MAX_FRAMES = 1024  # identity + MAC + header + arrays: far more than any message of ours carries
# A ROUTER queues at most this many unsent messages for each peer; a reply that finds its peer's
# queue full is dropped (send() returns False), so a peer that never reads cannot grow the node
# without bound.  This cannot deadlock: no send anywhere blocks (ROUTERs drop, DEALERs have no
# SNDHWM).  A worker that reads loses no reply: its DEALER keeps RCVHWM 0, so its zmq I/O thread
# reads TCP into an unbounded queue whatever its Python threads do, and a server's queue to it
# holds only the replies TCP has not carried yet, each the answer to a request that worker sent.
# The bound is far above what one call sends one server (a pull is one message per key slice,
# small keys batched into 1 MiB messages): 1024 did drop replies of a pipelined pull of 300 x 1 MiB
# keys on loopback when set to 8, so the margin is wide.  Only a call of more than 65,536 messages
# to one server, over a link slower than the server, could lose a reply (its call then ends at
# KVSTORE_REQUEST_TIMEOUT); docs/security.md says what the bound costs against a peer that never reads.
ROUTER_SNDHWM = 65536
TRIM_AFTER_FRAMES = 1 << 16  # a discarded message of this many frames gives freed heap back to the OS

Socket = zmq.Socket  # the type of what bind_router and connect_dealer return, for the modules above


def _context() -> zmq.Context:
    return zmq.Context.instance()  # pyzmq makes a new one after fork


def _unbounded(sock: zmq.Socket) -> None:
    # No high-water marks: with bounded queues a worker blocked sending and a server
    # blocked replying to it could wait on each other forever.  (A ROUTER then bounds its
    # send queue, ROUTER_SNDHWM, but never waits on it: a reply that does not fit is dropped.)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bind_router(host: str, port: int = 0, inbound: int = 0, max_frame_bytes: int = 0,
                outbound: int = ROUTER_SNDHWM, curve: CurveKeys | None = None) -> tuple[zmq.Socket, int]:
    """Bind a ROUTER socket on ``host:port`` (0 = any free port); return it and the bound port.

    ``inbound`` > 0 caps the messages zmq queues from each peer: beyond it zmq stops reading
    that peer's connection, and TCP holds the sender back (flow control).  Replies queue up to
    ``outbound`` messages per peer (``ROUTER_SNDHWM``) and are never waited for (see :func:`send`),
    so neither side can block the other.  ``max_frame_bytes`` > 0 is zmq's MAXMSGSIZE: a peer that declares
    a bigger frame is disconnected as the frame's length arrives, before its bytes are buffered
    (a per-frame limit: zmq still buffers every frame of a message before delivering it).
    With ``curve`` the ROUTER is a CURVE server (``kvstore.net.curve``): peers must be CURVE clients.
    Raises :class:`ConfigError` when the address cannot be bound (port taken, bad host).
    """
    sock = _context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    _unbounded(sock)
    sock.setsockopt(zmq.SNDHWM, outbound)
    if inbound:
        sock.setsockopt(zmq.RCVHWM, inbound)
    if max_frame_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve is not None:
        try:
            _curve.make_server(sock, curve)
        except ConfigError:
            sock.close()
            raise
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


def connect_dealer(address: str, identity: bytes | None = None, curve: CurveKeys | None = None) -> zmq.Socket:
    """Return a DEALER socket connected to ``address`` (``tcp://host:port``); with ``curve``, as a
    CURVE client of that server key."""
    sock = _context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    _unbounded(sock)
    if curve is not None:
        _curve.make_client(sock, curve)
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


def send(sock: zmq.Socket, frames: Sequence[Any], identity: bytes | None = None) -> bool:
    """Send one message; with ``identity``, to that peer of a ROUTER, without waiting.

    Returns False, sending nothing, when that peer's queue already holds ``ROUTER_SNDHWM``
    messages (the caller drops the reply); True otherwise (a DEALER's send never waits: its
    queue is unbounded).  Raises :class:`NodeLostError` when a ROUTER's peer is no longer
    connected, or on any other zmq failure.
    """
    parts = ([identity] if identity is not None else []) + list(frames)
    last = len(parts) - 1
    try:
        for i, part in enumerate(parts):
            big = len(part) >= COPY_THRESHOLD if hasattr(part, "__len__") else False
            flags = zmq.SNDMORE if i < last else 0
            if i == 0 and identity is not None:
                flags |= zmq.NOBLOCK  # only the routing frame can find the queue full (EAGAIN)
            sock.send(part, flags=flags, copy=not big)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            raise NodeLostError(f"peer {identity!r} is not connected") from None
        raise NodeLostError(f"sending failed: {exc.strerror}") from None
    return True


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
            count = len(frames) + _discard_rest(sock, frames[-1])
            del frames
            if count >= TRIM_AFTER_FRAMES:
                trim_heap()
            raise ProtocolError(f"a message of more than {max_frames} frames was refused "
                                f"({count} frames read and dropped)")
        frames.append(sock.recv(copy=False))
    return [frame.buffer for frame in frames]


def _discard_rest(sock: zmq.Socket, frame: Any) -> int:
    """Read and drop the rest of the message ``frame`` belongs to; return how many frames that was.

    zmq delivers a message only once all its frames are in, so they are all queued already and
    must be read before the next message.  The cheapest read is libzmq's own ``zmq_msg_recv`` into
    one reused message (:class:`_Discarder`, about 1.1 us a frame here); where that library cannot
    be found, pyzmq's ``recv(copy=False)`` and its frame's ``more`` (1.1-2.6 us; 4 us with a
    ``RCVMORE`` query per frame).
    """
    if not frame.more:
        return 0
    if _DISCARDER is not None:
        count = _DISCARDER.discard(sock)
        if count is not None:
            return count
        frame = None  # it failed part-way: what is left is read below, asking RCVMORE
    recv, count = sock.recv, 0
    while frame.more if frame is not None else sock.get(zmq.RCVMORE):
        frame = recv(copy=False)
        count += 1
    return count


class _Discarder:
    """Reads the rest of a message with libzmq's C calls, through ``ctypes``: no Python object per
    frame.  Only for the very library pyzmq's backend calls (looked up through that extension
    module), so the socket's handle is one of its own."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)  # already loaded: the same module, its symbols looked up in what it links
        self._recv, self._more, self._close = lib.zmq_msg_recv, lib.zmq_msg_more, lib.zmq_msg_close
        self._recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._recv.restype = ctypes.c_int
        self._more.argtypes = self._close.argtypes = [ctypes.c_void_p]
        self._init = lib.zmq_msg_init
        self._init.argtypes = [ctypes.c_void_p]

    def discard(self, sock: zmq.Socket) -> int | None:
        """Read the frames left of the message being received; how many, or None when a read failed
        (the frames after it are left to the caller)."""
        msg = ctypes.create_string_buffer(64)  # a zmq_msg_t
        self._init(msg)
        handle, recv, more, count = ctypes.c_void_p(sock.underlying), self._recv, self._more, 0
        try:
            while True:
                if recv(msg, handle, 0) < 0:
                    return None
                count += 1
                if not more(msg):
                    return count
        finally:
            self._close(msg)


def _discarder() -> _Discarder | None:
    """The :class:`_Discarder` of the libzmq pyzmq's compiled backend calls, or None (another backend,
    or its libzmq's symbols are not visible).  Looked up through the backend's own module (its
    dependencies), never by a library's name: a libzmq that pyzmq does not call (pyzmq's linked in
    statically, another one loaded by something else) must never get a pyzmq socket."""
    try:
        path = sys.modules[zmq.backend.Socket.__module__].__file__
        if not (isinstance(path, str) and path.endswith((".so", ".pyd"))):
            return None  # the cffi backend (a .py), or no file: CDLL(None) would search everything
        return _Discarder(path)
    except (OSError, AttributeError, KeyError):
        return None


_DISCARDER = _discarder()


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (another libc or OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the heap's free memory back to the OS (glibc ``malloc_trim``); False where there is none.

    After a big discard: zmq's buffers for millions of frames are freed into malloc's arenas,
    which glibc otherwise keeps (tens of ms for a few hundred MB).  Raises nothing.
    """
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class Poller:
    """Wait on several sockets (and plain file descriptors, or objects with ``fileno()``) at once."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._objects: dict[int, Any] = {}  # descriptor -> the object watched through it (not zmq's)

    def _key(self, sock_or_fd: Any) -> Any:
        if isinstance(sock_or_fd, (zmq.Socket, int)):
            return sock_or_fd
        fd = sock_or_fd.fileno()
        self._objects[fd] = sock_or_fd
        return fd

    def add(self, sock_or_fd: Any) -> None:
        """Watch ``sock_or_fd`` for incoming messages."""
        self._poller.register(self._key(sock_or_fd), zmq.POLLIN)

    def remove(self, sock_or_fd: Any) -> None:
        """Stop watching ``sock_or_fd`` (before it is closed)."""
        key = self._key(sock_or_fd)
        self._poller.unregister(key)
        if not isinstance(sock_or_fd, (zmq.Socket, int)):
            del self._objects[key]

    def set_write(self, sock_or_fd: Any, on: bool) -> None:
        """Also report ``sock_or_fd`` (watched) when it can be written to (``on``), or no more."""
        self._poller.modify(self._key(sock_or_fd), zmq.POLLIN | (zmq.POLLOUT if on else 0))

    def wait(self, timeout: float | None) -> list[Any]:
        """Return the watched objects that are readable (or writable, :meth:`set_write`), waiting up to
        ``timeout`` seconds."""
        ms = None if timeout is None else max(0, int(timeout * 1000))
        objects = self._objects
        return [objects.get(obj, obj) if type(obj) is int else obj for obj, _ in self._poller.poll(ms)]


def recv_within(sock: zmq.Socket, timeout: float, what: str) -> list[memoryview]:
    """Receive one message within ``timeout`` seconds, else raise :class:`DeadlineExceededError`.

    ``what`` names the awaited message in the error.
    """
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        raise DeadlineExceededError(f"no {what} after {timeout:g} s")
    return recv(sock)


class Router:
    """A bound ROUTER as a request loop uses it (:class:`kvstore.net.router.RouterSocket`)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock

    def send(self, identity: bytes, frames: Sequence[Any]) -> bool:
        """:func:`send` to peer ``identity``."""
        return send(self.sock, frames, identity=identity)

    def recv(self, timeout: float | None) -> list[memoryview] | None:
        """One message within ``timeout`` seconds (None: one already waiting), else None; see :func:`recv`."""
        if timeout is None:
            return recv_nowait(self.sock)
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return recv(self.sock)

    def close(self) -> None:
        """:func:`close` the socket."""
        close(self.sock)


def close(sock: zmq.Socket, linger: float = 0.0) -> None:
    """Close ``sock``, giving unsent messages up to ``linger`` seconds to leave."""
    sock.close(linger=int(linger * 1000))


def connect_watch(address: str, interval: float, timeout: float,
                  curve: CurveKeys | None = None) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER to ``address`` that carries no message, only zmq's own heartbeats, and its monitor.

    libzmq's I/O threads send a ZMTP PING every ``interval`` seconds and answer the peer's, outside
    either side's Python (a server busy in its request loop still answers); a connection that hears
    nothing for ``timeout`` seconds is dropped, and so is it on the peer's side (``HEARTBEAT_TTL``).
    The monitor reports each handshake done and each drop: read it with :func:`watch_events`.
    Raises :class:`ConfigError` when ``address`` cannot be connected to (malformed).
    """
    sock = _context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(interval * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(100, int(timeout * 1000))))  # zmq's bounds
    if curve is not None:
        _curve.make_client(sock, curve)
    if "[" in address:
        sock.setsockopt(zmq.IPV6, 1)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        close_watch(sock, monitor)
        raise ConfigError(f"cannot connect to {address}: {exc.strerror}") from None
    return sock, monitor


def watch_events(monitor: zmq.Socket) -> list[bool]:
    """The events waiting on a :func:`connect_watch` monitor, oldest first, without waiting: True for
    a connection up (its handshake done), False for one dropped."""
    events = []
    while True:
        try:
            frames = monitor.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return events
        if len(frames) >= 1 and len(frames[0]) >= 2:
            event = int.from_bytes(frames[0][:2], "little")  # zmq's monitor frame: u16 event, u32 value
            if event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED):
                events.append(event == zmq.EVENT_HANDSHAKE_SUCCEEDED)


def close_watch(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    """Close a :func:`connect_watch` socket and its monitor."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    sock.close(linger=0)
    monitor.close(linger=0)

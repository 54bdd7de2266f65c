"""Unix-socket links between a worker and a server on one host: the data path without zmq's I/O threads.

A zmq message crosses two extra threads: the sender's I/O thread wakes to write it, the receiver's to
read it and wake the receiving thread, in both directions of a round trip (the largest single item
in both processes' profiles for a small key, issue 39).  Where a worker and a server share a host
(and a network namespace), the worker's messages to that server go instead over one Unix stream
socket that the sending thread writes and the receiving thread reads itself.  The frames are the
sealed frames of the zmq path, byte for byte (MAC, header, arrays); only their framing differs:
``<I`` the record's length after this field, ``<H`` the number of frames, a ``<I`` length per frame,
then the frames.  A record longer than the receiver's limit, with too many frames or lengths that do
not add up, closes the connection (logged): nothing read from it reaches the handlers unframed.

How a link is made (``Op.LINK``, over zmq first): the worker asks; a server that listens answers with
its abstract socket name (Linux's abstract namespace: no file, scoped to the network namespace, so
only a process on the same host and namespace reaches it) and a random token bound to the worker's
zmq identity; the worker connects and sends ``LINK {"token"}`` over the new socket, sealed as any
request; the server binds the connection to that identity and answers over it.  From then on the
server hands the connection's messages to its handlers under the worker's zmq identity (so shared
memory, labels and replies keyed by it are unchanged) and sends that identity's replies over it; the
worker sends everything for that server over it.  A stranger on the host that connects gets nothing:
every message is authenticated by the router as before, a LINK with a token not offered (or over zmq)
is refused, and a connection still unbound after UNBOUND_GRACE seconds is closed.

Sending: a worker's send writes the whole record before it returns (the server reads its links on
every turn of its loop, so this waits only while the server is inside a handler), in slices that
check the worker's closing and failure, within the request deadline (:class:`DeadlineExceededError`
naming the server).  A link the server closed (its process died) takes nothing more, as a zmq socket
to a dead peer: the requests wait for the server's restart (resent on zmq) or its loss.  The
heartbeat's thread never waits on a server: what it sends (a paced chunk nobody else sent, a parked
push) leaves the rest of its record pending for the next sender or the thread that waits for a reply.
A server's reply never waits: what the socket does not take at once is copied and queued, sent as the
socket drains (its poller watches for that); a connection with ``transport.ROUTER_SNDHWM`` replies
queued drops the next one, as a ROUTER does.
"""

from __future__ import annotations

import collections
import logging
import os
import resource
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import DeadlineExceededError, NodeLostError, ProtocolError
from kvstore.net import transport
from kvstore.net.router import RouterSocket

log = logging.getLogger("kvstore.link")

_LEN = struct.Struct("<I")
_COUNT = struct.Struct("<H")
READ_BYTES = 1 << 16  # what one read asks the kernel for (grown for a longer record)
MAX_CONNECTIONS = 1024  # a server's links, bound or not (fewer where the descriptor limit is low: _capacity)
UNBOUND_GRACE = 10.0  # seconds an unbound connection may stay open before it is closed
UNBOUND_BYTES = 4096  # the largest frame an unbound connection may send (its LINK is far smaller)
TOKEN_TTL = 60.0  # seconds an offered token stays valid
ACCEPT_PAUSE = 1.0  # seconds the listener is not watched after accept() ran out of descriptors
MAX_RECORD = 1 << 31  # a record's bytes where the cluster sets no KVSTORE_MAX_MESSAGE_BYTES
IOV_MAX = 1000  # buffers handed to one sendmsg (Linux allows 1024)
_SLICE = 0.05  # a blocked worker send re-checks its cancel flag this often (seconds)


def record(frames: Sequence[Any]) -> tuple[list[Any], int]:
    """The buffers of one record (its header, then the frames) and its total bytes."""
    sizes = [memoryview(f).nbytes for f in frames]
    header = _LEN.pack(2 + 4 * len(sizes) + sum(sizes)) + _COUNT.pack(len(sizes)) + \
        struct.pack(f"<{len(sizes)}I", *sizes)
    return [header, *frames], len(header) + sum(sizes)


def _advance(buffers: list[Any], sent: int) -> list[memoryview]:
    """What is left of ``buffers`` after the first ``sent`` bytes went out."""
    left: list[memoryview] = []
    for buf in buffers:
        view = memoryview(buf).cast("B")
        if sent >= view.nbytes:
            sent -= view.nbytes
            continue
        left.append(view[sent:])
        sent = 0
    return left


def _sendmsg(sock: socket.socket, buffers: list[Any]) -> int:
    """One nonblocking sendmsg of at most IOV_MAX buffers; bytes sent (0 when the socket is full)."""
    try:
        return sock.sendmsg(buffers[:IOV_MAX])
    except (BlockingIOError, InterruptedError):
        return 0


class Reader:
    """Reassembles records from a nonblocking stream socket; each as a list of frames (writable
    memoryviews of one bytearray of its own, as zmq's frames are)."""

    def __init__(self, sock: socket.socket, max_bytes: int, max_frames: int = transport.MAX_FRAMES) -> None:
        self.sock, self.max_bytes, self.max_frames = sock, max_bytes or MAX_RECORD, max_frames
        self._buf = bytearray(READ_BYTES)
        self._lo = self._hi = 0  # the unparsed bytes are _buf[_lo:_hi]
        self._verified = False  # whether the partial record at _lo has a checked header (its frames)

    def read(self, limit: int = 0) -> tuple[list[list[memoryview]], bool]:
        """The complete records the socket has now (with ``limit``, no further read once that many are
        in), and whether the peer closed its end.  Raises ProtocolError for a malformed record (the
        connection is to be closed)."""
        records: list[list[memoryview]] = []
        closed = False
        while not limit or len(records) < limit:
            self._room()
            try:
                n = self.sock.recv_into(memoryview(self._buf)[self._hi:])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset by the peer
                closed = True
                break
            if n == 0:
                closed = True
                break
            self._hi += n
            self._parse(records)
            if self._hi < len(self._buf):
                break  # the kernel had no more than this
        return records, closed

    def _room(self) -> None:
        """Make room after ``_hi``: move a partial record to the front, grow for a long one (only once
        its header, with every frame's length, has been checked: a length alone allocates nothing)."""
        if self._lo == self._hi:
            self._lo = self._hi = 0
        need = READ_BYTES
        if self._verified:
            need = max(need, 4 + _LEN.unpack_from(self._buf, self._lo)[0] - (self._hi - self._lo))
        if len(self._buf) - self._hi >= min(need, READ_BYTES):
            return
        pending = self._hi - self._lo
        if self._lo:
            self._buf[:pending] = self._buf[self._lo:self._hi]
            self._lo, self._hi = 0, pending
        if len(self._buf) - self._hi < need:
            self._buf.extend(bytes(need - (len(self._buf) - self._hi)))

    def _parse(self, records: list[list[memoryview]]) -> None:
        buf = self._buf
        while self._hi - self._lo >= 6:
            length = _LEN.unpack_from(buf, self._lo)[0]
            count = _COUNT.unpack_from(buf, self._lo + 4)[0]
            if count > self.max_frames or count == 0 or 2 + 4 * count > length:
                raise ProtocolError(f"a link record of {count} frames in {length} bytes")
            start = self._lo + 6
            body = start + 4 * count
            if self._hi < body:
                return
            sizes = struct.unpack_from(f"<{count}I", buf, start)
            if max(sizes) > self.max_bytes:  # zmq's MAXMSGSIZE is per frame too
                raise ProtocolError(f"a link frame of {max(sizes)} bytes exceeds the limit "
                                    f"({self.max_bytes})")
            if sum(sizes) != length - 2 - 4 * count:
                raise ProtocolError("a link record's frame lengths do not add up to its length")
            if self._hi - self._lo < 4 + length:
                self._verified = True
                return
            self._verified = False
            data = memoryview(buf[body:self._lo + 4 + length])  # a bytearray of its own: writable, as zmq's
            frames, at = [], 0
            for size in sizes:
                frames.append(data[at:at + size])
                at += size
            records.append(frames)
            self._lo += 4 + length
        if self._lo == self._hi:
            self._lo = self._hi = 0
        if len(buf) > 4 * READ_BYTES and self._hi - self._lo < READ_BYTES:  # a long record is gone
            self._buf = bytearray(buf[self._lo:self._hi]) + bytearray(READ_BYTES)
            self._hi -= self._lo
            self._lo = 0


class UnixLink:
    """A worker's link to one server: it sends every request for that server, and reads the replies.
    Polled like a zmq socket (``fileno``); :meth:`send` and :meth:`recv_nowait` as ``transport``'s."""

    def __init__(self, name: str, server: int, max_bytes: int, timeout: float,
                 cancelled: Callable[[], bool]) -> None:
        """Connect to the abstract socket ``name``; raises OSError when it cannot be reached."""
        self.server, self.timeout, self.cancelled = server, timeout, cancelled
        self.address = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect("\0" + name)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.reader = Reader(self.sock, max_bytes)
        self._records: collections.deque[list[memoryview]] = collections.deque()
        self.broken: BaseException | None = None
        self.pending: list[memoryview] = []  # bytes a send that could not wait left (copies)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frames: Sequence[Any], wait: bool = True) -> bool:
        """Write one message whole, after what earlier sends left (:attr:`pending`); False, nothing
        written, once the server has closed the link (as a DEALER's message to a dead peer, the request
        is left to the server's restart or loss).  With ``wait`` False (the heartbeat's thread, which
        must not wait on a server) what the socket does not take at once is copied and left pending,
        for the next send or :meth:`flush`.  Raises DeadlineExceededError (not taken within the request
        deadline: the link is broken from then on)."""
        if self.broken is not None:
            return False
        buffers, total = record(frames)
        if self.pending:
            if not wait:
                self.pending += [memoryview(bytes(b)) for b in buffers]
                self.try_flush()
                return self.broken is None
            if not self.flush():
                return False
        try:
            sent = _sendmsg(self.sock, buffers)
        except OSError as exc:
            self._broke(exc)
            return False
        if sent == total:
            return True
        left = _advance(buffers, sent)
        if not wait:
            self.pending = [memoryview(bytes(v)) for v in left]  # the caller's frames may change
            return True
        return self._send_rest(left)

    def flush(self) -> bool:
        """Write what earlier sends left pending, waiting as :meth:`send` does; False when the server
        has closed the link.  Raises as :meth:`send` does."""
        if self.broken is not None:
            return False
        left, self.pending = self.pending, []
        return self._send_rest(left)

    def try_flush(self) -> None:
        """Write what the socket takes of :attr:`pending` now, without waiting."""
        try:
            sent = _sendmsg(self.sock, self.pending)
        except OSError as exc:
            self._broke(exc)
            return
        self.pending = _advance(self.pending, sent)

    def _send_rest(self, left: list[memoryview]) -> bool:
        deadline = time.monotonic() + self.timeout
        while left:
            if self.cancelled():
                self._broke(NodeLostError("the store failed or closed mid-message"))
                return False
            wait = deadline - time.monotonic()
            if wait <= 0:
                error = DeadlineExceededError(f"server {self.server} did not read a message within "
                                              f"{self.timeout:g} s (KVSTORE_REQUEST_TIMEOUT)")
                self._broke(error)
                raise error
            select.select([], [self.sock], [], min(wait, _SLICE))
            try:
                sent = _sendmsg(self.sock, left)
            except OSError as exc:
                self._broke(exc)
                return False
            left = _advance(left, sent)
        return True

    def _broke(self, why: BaseException) -> None:
        """Mark the link unusable (a record may be cut short), logged once."""
        if self.broken is None:
            log.info("server %d's link is closed: %s", self.server, why)
        self.broken = why

    def recv_nowait(self) -> list[memoryview] | None:
        """The next reply read, or None when none is complete.  When the server closed the link or sent
        a malformed record, the link is broken from then on (logged; its sends return False)."""
        if not self._records:
            if self.broken is not None:
                return None
            try:
                records, closed = self.reader.read()
            except ProtocolError as exc:
                log.warning("server %d's link sent a malformed record: %s", self.server, exc)
                self._broke(exc)
                return None
            self._records.extend(records)
            if closed and not self._records:
                self._broke(NodeLostError(f"server {self.server} closed the link"))
                return None
            if not self._records:
                return None
        return self._records.popleft()

    def close(self) -> None:
        self.sock.close()


class _Conn:
    """One accepted connection on a server: unbound until its token names a worker's identity."""

    def __init__(self, sock: socket.socket, pseudo: bytes, max_bytes: int) -> None:
        self.sock, self.pseudo = sock, pseudo
        self.reader = Reader(sock, max_bytes)
        self.identity: bytes | None = None  # the worker's zmq identity, once bound
        self.out: collections.deque[memoryview] = collections.deque()  # unsent bytes, in order
        self.queued = 0  # messages with bytes in ``out``
        self.waiting = 0  # its messages read and not yet handled
        self.opened = time.monotonic()

    def fileno(self) -> int:
        return self.sock.fileno()


class UnixLinks:
    """A server's listening socket and its links; wraps its zmq ROUTER as the service's endpoint
    (:class:`kvstore.net.router.RouterSocket`): messages read from links and from zmq, in turn."""

    def __init__(self, router: RouterSocket, max_bytes: int, poller: transport.Poller | None = None,
                 inbound: int = 8) -> None:
        """Listen on a new abstract socket in front of ``router``; ``inbound``: the messages read from
        one link and not yet handled beyond which it is not read (the kernel then holds its sender
        back, as a ROUTER's inbound bound does).  Raises OSError when the socket cannot be made."""
        self.router = router  # the zmq side (transport.Router)
        self.inbound = inbound
        self.max_bytes = max_bytes
        self.name = f"kvstore-link-{os.getpid()}-{os.urandom(8).hex()}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.name)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.poller = poller
        self._conns: dict[bytes, _Conn] = {}  # pseudo identity -> connection
        self._bound: dict[bytes, _Conn] = {}  # worker identity -> its connection
        # token -> (identity, when offered), oldest first
        self._tokens: collections.OrderedDict[bytes, tuple[bytes, float]] = collections.OrderedDict()
        self._pending: collections.deque[tuple[_Conn, list[Any]]] = collections.deque()
        self._numbers = 0
        self._unbound = 0  # connections not yet bound (tick() closes those past UNBOUND_GRACE)
        self._paused_until = 0.0  # the listener is out of the poller until then (descriptors ran out)
        self._links_first = True  # recv() alternates links and zmq: neither starves the other
        self.capacity = _capacity()
        self.dropped = 0

    # -- setting a link up ---------------------------------------------------------------------------
    def offer(self, identity: bytes) -> dict[str, Any]:
        """The body of the LINK reply to ``identity``'s request over zmq: where to connect, the token."""
        token = os.urandom(16)
        self._tokens[token] = (identity, time.monotonic())
        while len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)
        return {"address": self.name, "token": token}

    def bind(self, pseudo: bytes, token: Any) -> bool:
        """Bind connection ``pseudo`` to the identity ``token`` was offered to; False (nothing
        changed) for an unknown token or a connection already bound."""
        conn = self._conns.get(pseudo)
        offered = self._tokens.pop(token, None) if isinstance(token, bytes) else None
        if conn is None or offered is None or conn.identity is not None:
            return False
        identity, when = offered
        if time.monotonic() - when > TOKEN_TTL:
            return False
        old = self._bound.get(identity)
        if old is not None:
            self._close(old, "replaced by a new link of the same worker")
        conn.identity = identity
        conn.reader.max_bytes = self.max_bytes or MAX_RECORD
        self._bound[identity] = conn
        self._unbound -= 1
        return True

    def is_pseudo(self, identity: bytes) -> bool:
        """Whether ``identity`` names an unbound connection (only LINK may come from one)."""
        conn = self._conns.get(identity)
        return conn is not None and conn.identity is None

    # -- the loop's side -----------------------------------------------------------------------------
    def watched(self) -> list[Any]:
        """What the server's poller watches for links: the listener and every connection."""
        return [self.listener, *self._conns.values()]

    def ready(self, obj: Any) -> bool:
        """Handle a poll result: accept, read or flush; False when ``obj`` is not a link's."""
        if obj is self.listener:
            self._accept()
            return True
        if not isinstance(obj, _Conn) or obj.pseudo not in self._conns:
            return False
        if obj.out:
            self._flush(obj)
        if obj.waiting < self.inbound:  # else read once its messages are handled (flow control)
            self._read(obj)
        return True

    @property
    def pending(self) -> bool:
        """Whether messages read from links wait to be handled."""
        return bool(self._pending)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, ENFILE: no descriptor for it; the listener stays readable
                log.warning("a link's connection could not be accepted (%s): links are not accepted for "
                            "%g s", exc, ACCEPT_PAUSE)
                if self.poller is not None:
                    self.poller.remove(self.listener)
                    self._paused_until = time.monotonic() + ACCEPT_PAUSE
                return
            self.tick()
            if len(self._conns) >= self.capacity:
                sock.close()
                log.warning("refused a link: %d connections are open", self.capacity)
                continue
            sock.setblocking(False)
            self._numbers += 1
            conn = _Conn(sock, b"\0link" + self._numbers.to_bytes(8, "big"), UNBOUND_BYTES)
            self._conns[conn.pseudo] = conn
            self._unbound += 1
            if self.poller is not None:
                self.poller.add(conn)

    def tick(self) -> None:
        """Between messages: close unbound connections open for UNBOUND_GRACE (a stranger's, or a
        worker's that died), and watch the listener again after a pause."""
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until and self.poller is not None:
            self._paused_until = 0.0
            self.poller.add(self.listener)
        if self._unbound:
            late = [c for c in self._conns.values() if c.identity is None and now - c.opened > UNBOUND_GRACE]
            for conn in late:
                self._close(conn, "no token in time")

    def _read(self, conn: _Conn) -> None:
        try:
            records, closed = conn.reader.read(self.inbound - conn.waiting)
        except ProtocolError as exc:
            self._close(conn, str(exc))
            return
        for frames in records:
            if conn.identity is None and conn.waiting:
                self._close(conn, "a second message before its token was accepted")
                return
            conn.waiting += 1
            self._pending.append((conn, frames))
        if closed:
            self._close(conn, None)

    def _close(self, conn: _Conn, why: str | None) -> None:
        if why is not None:
            log.warning("closed a link: %s", why)
        if self._conns.pop(conn.pseudo, None) is not None and conn.identity is None:
            self._unbound -= 1
        if conn.identity is not None and self._bound.get(conn.identity) is conn:
            del self._bound[conn.identity]
        if self.poller is not None:
            try:
                self.poller.remove(conn)
            except KeyError:
                pass
        conn.sock.close()

    # -- RouterSocket ---------------------------------------------------------------------------------
    def send(self, identity: bytes, frames: Sequence[Any]) -> bool:
        """A reply: over the identity's link when it has one (never waiting), else over zmq; over zmq
        too when the worker has closed that link meanwhile (it put its zmq socket back)."""
        conn = self._bound.get(identity) or self._conns.get(identity)
        if conn is None:
            return self.router.send(identity, frames)
        if conn.queued >= transport.ROUTER_SNDHWM:
            self.dropped += 1
            return False
        buffers, total = record(frames)
        sent = 0
        if not conn.out:
            try:
                sent = _sendmsg(conn.sock, buffers)
            except OSError as exc:  # the worker closed its link (it went back to zmq, or it is gone)
                self._close(conn, None)
                if conn.identity is not None:  # a worker keeps reading its zmq socket: the reply goes there
                    return self.router.send(identity, frames)
                raise NodeLostError(f"peer {identity!r}'s link is closed: {exc}") from None
            if sent == total:
                return True
        conn.out.extend(memoryview(bytes(v)) for v in _advance(buffers, sent))
        conn.queued += 1
        if self.poller is not None:
            self.poller.set_write(conn, True)
        return True

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            try:
                sent = _sendmsg(conn.sock, list(conn.out))
            except OSError:  # the worker is gone: what it was owed goes nowhere, as on a ROUTER
                self._close(conn, None)
                return
            if sent == 0:
                return
            left = _advance(list(conn.out), sent)
            conn.out = collections.deque(left)
        conn.queued = 0
        if self.poller is not None:
            self.poller.set_write(conn, False)

    def recv(self, timeout: float | None) -> list[Any] | None:
        """A message read from a link or from the zmq side, in turn (see RouterSocket)."""
        self._links_first = not self._links_first
        if not self._links_first or not self._pending:
            frames = self.router.recv(None if self._pending else timeout)
            if frames is not None or not self._pending:
                return frames
        conn, frames = self._pending.popleft()  # (a closed link's last messages too: its LEAVE)
        conn.waiting -= 1
        return [conn.identity or conn.pseudo, *frames]

    def close_links(self) -> None:
        """Close every link and the listening socket (the zmq side stays open)."""
        for conn in list(self._conns.values()):
            self._close(conn, None)
        self.listener.close()

    def close(self) -> None:
        """Close the links and the zmq side."""
        self.close_links()
        self.router.close()


def _capacity() -> int:
    """How many links a server accepts: MAX_CONNECTIONS, or a quarter of its descriptor limit where
    that is lower (the rest stay for its own files and zmq's sockets)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return MAX_CONNECTIONS
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft // 4))

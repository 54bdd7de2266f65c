"""Same-host shared memory: big arrays between a worker and a server move through a segment, not TCP.

Each worker makes one segment per server (``memfd_create``: anonymous shared memory with no name, so
nothing is ever left in ``/dev/shm``, whatever kills whom: the kernel frees the pages once the last
process that maps them is gone).  It tells the server, over the authenticated channel
(``Op.SHM_ATTACH``), its pid, the segment's descriptor number and a random nonce written at the
segment's start; the server opens ``/proc/<pid>/fd/<fd>``, compares the nonce and maps it.  Only a
server on the same host, in the same pid namespace and allowed to read that process's descriptors
finds that nonce there: any other answer (no such file, another file, another nonce) leaves the pair
on TCP.  docs/shm.md says why this and not named segments.

A mapping must not let its peer kill the server: a page the peer truncates away would fault every
read of it with SIGBUS.  So the worker seals its memfd against shrinking and growing before it
offers it, and a server maps only a memfd (:func:`open_mapping`: not huge pages) so sealed, that
the peer holds read-write, of the size offered; anything else is refused with the reason.  Arrays a
request names in a segment are views until the server has checked what they declare against its
keys (:meth:`ServerPeers.settle`), and a segment whose process is gone is unmapped
(:meth:`ServerPeers.sweep`).

The worker owns the whole segment (:class:`Segment`): it copies a pushed array into a free range and
sends the range's offset in the header (``protocol``: the header's ``shm`` field; the array frame is
empty); for a pull it reserves a range for the reply (``reply_at``), which the server fills
(:class:`ServerPeers`).  A pushed range is free again once the server's reply to that request is in
(the server copies what it reads before it replies); a reply's range once the last array viewing it
is gone.  A server never keeps a view of the segment.

Raises nothing a peer can provoke past these APIs other than :class:`ProtocolError` (a range outside
the segment, or one the worker did not reserve).
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.config import Config
from kvstore.errors import ProtocolError
from kvstore.net.protocol import Message

try:
    import fcntl  # sealing: POSIX; where it is missing shared memory is off (:func:`unusable`)
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

MIN_BYTES = 64 * 1024  # arrays smaller than this stay inline (the header round trip dominates)
ALIGN = 4096  # ranges start on page boundaries
HEAD = ALIGN  # the segment's first page holds the nonce
NONCE_BYTES = 16
MAX_PEERS = 4096  # a server maps at most this many workers' segments
MAX_PENDING = 65536  # replies a server remembers a reserved range for (more: they go inline)
GROW_STEP = 16 << 20  # a server first touches a segment's pages in steps of this (kvstore.server.peakmem)
# What a server requires of a segment: a size that cannot change (a shrink would fault its reads).
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
OFFERED_SEALS = SEALS | getattr(fcntl, "F_SEAL_SEAL", 0)  # what a worker seals: those, for good
SWEEP_SECONDS = 1.0  # a server looks for departed peers' segments at most this often


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Segment:
    """A worker's segment for one server: an allocator of page-aligned ranges over a memfd mapping,
    sealed with ``seals`` once sized (tests offer fewer to see a server refuse them).

    Raises :class:`OSError` when the segment cannot be made (no ``memfd_create``, no sealing, no memory).
    """

    def __init__(self, nbytes: int, seals: int = OFFERED_SEALS) -> None:
        if not hasattr(os, "memfd_create"):
            raise OSError("this system has no memfd_create")
        self.size = _round_up(max(nbytes, 2 * HEAD))
        self.fd: int | None = os.memfd_create("kvstore-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            if seals:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            self.close_fd()
            raise
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.map[:NONCE_BYTES] = self.nonce
        self._view = memoryview(self.map)
        self._free: list[tuple[int, int]] = [(HEAD, self.size - HEAD)]  # sorted (offset, length)
        self._taken: dict[int, int] = {}  # offset -> length
        self._replies: dict[int, int] = {}  # offset -> length: ranges reserved for a reply, not yet lent
        self._lent: set[int] = set()  # reply ranges viewed by a received array
        self._returned: collections.deque[int] = collections.deque()  # freed by finalizers (any thread)
        self._lock = threading.Lock()

    def attach_body(self) -> dict[str, Any]:
        """The SHM_ATTACH body that lets a server on this host map the segment."""
        return {"pid": os.getpid(), "fd": self.fd, "nonce": self.nonce, "bytes": self.size}

    def close_fd(self) -> None:
        """Close the descriptor (after the server mapped the segment or refused it); the mapping stays."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def take(self, nbytes: int, reply: bool = False) -> int | None:
        """Reserve a range of ``nbytes``; its offset, or None when no free range is big enough.
        ``reply``: a range the server will fill, lent to the reply's array by :meth:`lend`."""
        length = _round_up(nbytes)
        with self._lock:
            self._drain()
            for i, (off, size) in enumerate(self._free):
                if size >= length:
                    if size == length:
                        del self._free[i]
                    else:
                        self._free[i] = (off + length, size - length)
                    self._taken[off] = length
                    if reply:
                        self._replies[off] = nbytes
                    return off
        return None

    def give(self, off: int) -> None:
        """Free the range at ``off`` unless it was lent to a reply's array (that array's end frees it)."""
        with self._lock:
            self._replies.pop(off, None)
            if off in self._lent or off not in self._taken:
                return
            self._release(off)

    def _release(self, off: int) -> None:
        """Put the range at ``off`` back in the free list, merged with its neighbours (lock held)."""
        length = self._taken.pop(off)
        i = bisect.bisect(self._free, (off, 0))
        if i < len(self._free) and self._free[i][0] == off + length:
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            off, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (off, length))

    def _drain(self) -> None:
        while self._returned:
            off = self._returned.popleft()
            self._lent.discard(off)
            if off in self._taken:
                self._release(off)

    def write(self, off: int, array: np.ndarray) -> None:
        """Copy ``array`` (C-contiguous) into the range at ``off``."""
        flat = array.reshape(-1).view(np.uint8)
        np.copyto(np.frombuffer(self._view[off:off + flat.nbytes], np.uint8), flat)

    def view(self, off: int, nbytes: int) -> np.ndarray:
        """A read-only uint8 view of the ``nbytes`` at ``off``, written by :meth:`write` (its reader keeps
        the range taken while it reads: the view does not)."""
        view = np.frombuffer(self._view[off:off + nbytes], np.uint8)
        view.flags.writeable = False
        return view

    def lend(self, off: int, nbytes: int) -> np.ndarray:
        """The reply bytes at ``off``, which the server filled, as a uint8 array; the range is freed
        when that array and the last array viewing it are gone (numpy's views keep their base array
        alive; a plain memoryview would not be: numpy re-exports from the mmap itself).  Raises
        :class:`ProtocolError` for a range not reserved for a reply or too small."""
        with self._lock:
            reserved = self._replies.pop(off, None)
            if reserved is None or nbytes > reserved:
                if reserved is not None:
                    self._replies[off] = reserved
                raise ProtocolError(f"a reply names shared-memory bytes [{off}, +{nbytes}) this worker did "
                                    "not reserve for it")
            self._lent.add(off)
        lent = np.frombuffer(self._view[off:off + nbytes], np.uint8)
        weakref.finalize(lent, self._returned.append, off)
        return lent

    def free_bytes(self) -> int:
        """Bytes in free ranges (tests and logs)."""
        with self._lock:
            self._drain()
            return sum(size for _, size in self._free)


class Mapping:
    """A server's mapping of one worker's segment (see :func:`open_mapping`).

    Mapped rather than read and written with ``preadv`` / ``pwrite``: those held 1w1s 64 MB push+pull
    to 1.8-2.5 GB/s against 3.4-4.0 through the mapping (docs/shm.md).  The pages the server touches
    count in its RSS as shared memory (``RssShmem``): they are the worker's segment, not more memory.
    """

    def __init__(self, mapped: mmap.mmap, grown: Callable[[], None] | None = None,
                 peer: tuple[int, int | None] | None = None) -> None:
        self.map, self.size = mapped, len(mapped)
        self._bytes = np.frombuffer(mapped, np.uint8)
        self.reach = HEAD  # the server has touched no page at or past this offset
        self._grown = grown  # called before and after the server first touches pages (peakmem)
        self.peer = peer  # (pid, start time) of the process that offered the segment

    def _each(self, lo: int, hi: int, copy: Callable[[int, int], Any]) -> None:
        """``copy(a, b)`` over ``[lo, hi)``: at once below :attr:`reach`, else in steps of GROW_STEP with
        ``grown`` called before each step that reaches past it and once after the last."""
        if hi <= self.reach or self._grown is None:
            copy(lo, hi)
            return
        for a in range(lo, hi, GROW_STEP):
            b = min(hi, a + GROW_STEP)
            if b > self.reach:
                self._grown()
                self.reach = b
            copy(a, b)
        self._grown()

    def _range(self, off: Any, nbytes: int) -> np.ndarray:
        if not (type(off) is int and HEAD <= off and nbytes >= 0 and off + nbytes <= self.size):
            raise ProtocolError(f"shared-memory bytes [{off!r}, +{nbytes}) lie outside the worker's "
                                f"segment of {self.size} bytes")
        return self._bytes[off:off + nbytes]

    def view(self, off: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` at ``off``, not copied and not read (no page is touched); raises
        :class:`ProtocolError` for a range outside the segment."""
        return self._range(off, nbytes)

    def copy_out(self, off: int, nbytes: int) -> memoryview:
        """A private copy of ``nbytes`` at ``off`` (what the server keeps never aliases the worker's
        memory).  Raises :class:`ProtocolError` for a range outside the segment."""
        source = self._range(off, nbytes)
        out = np.empty(nbytes, np.uint8)
        self._each(off, off + nbytes, lambda a, b: np.copyto(out[a - off:b - off], source[a - off:b - off]))
        return memoryview(out)

    def write(self, off: int, nbytes: int, array: np.ndarray) -> None:
        """Copy ``array`` into ``nbytes`` at ``off``; raises :class:`ProtocolError` outside the segment or
        when it does not fit."""
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if flat.nbytes > nbytes:
            raise ProtocolError(f"a reply of {flat.nbytes} bytes does not fit the {nbytes} reserved")
        target, end = self._range(off, flat.nbytes), off + flat.nbytes
        self._each(off, end, lambda a, b: np.copyto(target[a - off:b - off], flat[a - off:b - off]))

    def close(self) -> None:
        """Drop the mapping (the worker's pages go once it has dropped its own too)."""
        self._bytes = np.empty(0, np.uint8)
        try:
            self.map.close()
        except BufferError:  # a view is still out (not expected: copies are made): the GC unmaps it
            pass


def open_mapping(body: Any, grown: Callable[[], None] | None = None) -> tuple[Mapping | None, str]:
    """Map the segment an SHM_ATTACH ``body`` describes: (mapping, "") or (None, why not); ``grown`` as
    :class:`Mapping`'s.  Only a memfd of ``bytes`` bytes without huge pages, sealed against shrinking
    and growing, that the peer holds read-write and that starts with the nonce is mapped: its pages
    can never fault, and the server writes only where the peer may.  Raises nothing."""
    if not (isinstance(body, dict) and type(body.get("pid")) is int and body["pid"] > 0
            and type(body.get("fd")) is int and body["fd"] >= 0 and type(body.get("bytes")) is int
            and 2 * HEAD <= body["bytes"] <= 1 << 40 and type(body.get("nonce")) is bytes
            and len(body["nonce"]) == NONCE_BYTES):
        return None, "a malformed SHM_ATTACH body"
    pid, number, size = body["pid"], body["fd"], body["bytes"]
    path = f"/proc/{pid}/fd/{number}"
    try:
        info, why = _described(path, size)  # what the link names, before anything is opened
        why = why or _access(pid, number, info.st_ino)
    except OSError as exc:
        return None, f"the worker's segment cannot be opened here ({exc.strerror}): another host?"
    except (KeyError, ValueError):  # an fdinfo of another format: not a kernel this was checked on
        return None, "the descriptor's access mode cannot be read here (/proc/<pid>/fdinfo)"
    if why:
        return None, why
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"the worker's segment cannot be opened here ({exc.strerror}): another host?"
    try:
        why = _opened(fd, info, body["nonce"])
        if why:
            return None, why
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        return None, f"the worker's segment cannot be mapped here ({str(exc)[:100]})"
    finally:
        os.close(fd)  # the mapping keeps the segment
    return Mapping(mapped, grown, (pid, _started(pid))), ""


def _described(path: str, size: int) -> tuple[os.stat_result, str]:
    """The file ``path`` (a ``/proc/<pid>/fd/<n>`` link) names, and why it is refused ("": it is not):
    not a memfd, a memfd of huge pages (a fault there raises SIGBUS when the pool is empty), another
    size.  Raises :class:`OSError` when the link cannot be read."""
    target = os.readlink(path)
    if not target.startswith("/memfd:"):  # before any stat: a stat of a stalled FUSE file never returns
        return os.lstat(path), (f"the descriptor names {target[:60]!r}, not a memfd: a server maps only a "
                                "sealed memfd (docs/shm.md)")
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        return info, (f"the descriptor names {target[:60]!r}, not a memfd: a server maps only a sealed "
                      "memfd (docs/shm.md)")
    if info.st_blksize != mmap.PAGESIZE:
        return info, "the memfd has huge pages (MFD_HUGETLB), whose faults may raise SIGBUS: refused"
    if info.st_size != size:
        return info, f"the memfd holds {info.st_size} bytes, not the {size} offered"
    return info, ""


def _access(pid: int, number: int, inode: int) -> str:
    """Why the peer's descriptor ``number`` is refused for its access mode ("": it is open read-write):
    the server writes pull replies into a segment, and never opens a file for more than its peer
    holds it for.  Raises :class:`OSError` when ``/proc/<pid>/fdinfo/<n>`` cannot be read."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/fdinfo/{number}", encoding="ascii")
                  if ":" in line)
    if "ino" in fields and int(fields["ino"]) != inode:
        return "the descriptor changed while it was checked"
    mode = int(fields["flags"], 8) & os.O_ACCMODE
    if mode != os.O_RDWR:
        return (f"the worker holds the memfd {'read-only' if mode == os.O_RDONLY else 'write-only'}: a "
                "server writes replies into a segment, so it needs a descriptor open read-write")
    return ""


def _opened(fd: int, info: os.stat_result, nonce: bytes) -> str:
    """Why the opened segment ``fd`` is refused ("": it is not): another file than ``info`` (the link
    changed), seals missing, another nonce.  Raises :class:`OSError`."""
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
        return "the descriptor changed while it was checked"
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        return ("the memfd is not sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW): a "
                "truncation would fault the server's reads")
    if os.pread(fd, NONCE_BYTES, 0) != nonce:
        return "the descriptor is not the worker's segment (no nonce): another host"
    return ""


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot: ``/proc/<pid>/stat``'s field 22), which
    tells it from a later process given the same pid; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class ServerPeers:
    """A server's side: its workers' mapped segments, by connection identity, and the ranges their
    pending requests reserved for replies.  ``grown`` (``kvstore.server.peakmem``'s checkpoint) is
    called around each first touch of a segment's pages and each unmapping; ``max_array_bytes`` (the
    server's ``KVSTORE_MAX_MESSAGE_BYTES``, 0: none) bounds an array in a segment as it bounds a frame
    on TCP."""

    def __init__(self, grown: Callable[[], None] | None = None, max_array_bytes: int = 0) -> None:
        self._grown = grown
        self._max_array = max_array_bytes
        self._maps: dict[bytes, Mapping] = {}
        self._pending: dict[tuple[bytes, int], list[int]] = {}  # (identity, seq) -> [offset, bytes]
        self._swept = time.monotonic()
        self.placed = 0  # reply bytes written into workers' segments (tests, logs)

    def attach(self, identity: bytes, body: Any) -> tuple[bool, str]:
        """Map the segment ``body`` describes for the worker at ``identity`` (replacing its earlier one);
        (True, "") or (False, why not).  Raises nothing."""
        if identity not in self._maps and len(self._maps) >= MAX_PEERS:
            return False, f"this server maps {MAX_PEERS} segments already"
        mapping, why = open_mapping(body, self._grown)
        if mapping is None:
            return False, why
        if identity in self._maps:
            self._close(self._maps[identity])
        self._maps[identity] = mapping
        return True, ""

    def forget(self, identity: bytes) -> None:
        """Close the segment of the worker at ``identity`` (it left); its pending reply ranges go too."""
        mapping = self._maps.pop(identity, None)
        if mapping is not None:
            self._close(mapping)
            self._pending = {k: v for k, v in self._pending.items() if k[0] != identity}

    def sweep(self) -> int:
        """Unmap the segments whose process is gone (it died, or left without LEAVE), looking at most
        every SWEEP_SECONDS; the number unmapped.  Raises nothing."""
        now = time.monotonic()
        if now - self._swept < SWEEP_SECONDS or not self._maps:
            return 0
        self._swept = now
        gone = [identity for identity, mapping in self._maps.items() if mapping.peer is not None
                and (mapping.peer[1] is None or _started(mapping.peer[0]) != mapping.peer[1])]
        for identity in gone:
            self.forget(identity)
        return len(gone)

    def _close(self, mapping: Mapping) -> None:
        """Unmap ``mapping`` between two checkpoints (its pages leave this process's RSS)."""
        if self._grown is not None:
            self._grown()
        mapping.close()
        if self._grown is not None:
            self._grown()

    def resolver(self, identity: bytes) -> Callable[[int, int], np.ndarray] | None:
        """``protocol.decode``'s resolver for arrays from ``identity``, or None: a view of the range,
        neither copied nor read, so a message's arrays in shared memory are views until
        :meth:`settle`.  The resolver raises :class:`ProtocolError` for a range outside the segment or
        an array over ``max_array_bytes``."""
        mapping = self._maps.get(identity)
        if mapping is None:
            return None
        limit = self._max_array

        def view(off: int, nbytes: int) -> np.ndarray:
            if limit and nbytes > limit:
                raise ProtocolError(f"an array of {nbytes} bytes in shared memory exceeds the {limit} "
                                    "a frame may have here (KVSTORE_MAX_MESSAGE_BYTES)")
            return mapping.view(off, nbytes)
        return view

    def settle(self, identity: bytes, msg: Message, check: Callable[[Message], None]) -> None:
        """Replace the arrays ``msg`` (from ``identity``) has in shared memory, views so far, by private
        copies once ``check(msg)`` accepted what they declare (a server never keeps a view of a
        segment, nor reads one for a request it refuses).  Raises what ``check`` raises, and
        :class:`ProtocolError` when the segment is no longer mapped."""
        if msg.shm is None:
            return
        check(msg)
        mapping = self._maps.get(identity)
        if mapping is None:
            raise ProtocolError("an array in shared memory whose segment is no longer mapped")
        for i, off in enumerate(msg.shm):
            if off is not None:
                view = msg.arrays[i]
                copy = mapping.copy_out(off, view.nbytes)
                msg.arrays[i] = np.frombuffer(copy, view.dtype).reshape(view.shape)

    def expect_reply(self, identity: bytes, seq: int, reply_at: list[int] | None) -> None:
        """Remember the range request ``seq`` of ``identity`` reserved for its reply (bounded)."""
        if reply_at is not None and identity in self._maps and len(self._pending) < MAX_PENDING:
            self._pending[(identity, seq)] = reply_at

    def place_reply(self, identity: bytes, msg: Message) -> None:
        """Before ``msg`` (a reply) is sealed: when its request reserved a range and ``msg`` carries one
        array that fits it, copy the array there and mark it (``msg.shm``).  Raises nothing."""
        if not self._pending:
            return
        reply_at = self._pending.pop((identity, msg.seq), None)
        if reply_at is None or len(msg.arrays) != 1:
            return
        array = msg.arrays[0]
        if not MIN_BYTES <= array.nbytes <= reply_at[1]:
            return
        try:
            self._maps[identity].write(reply_at[0], array.nbytes, array)
        except (KeyError, ProtocolError):
            return  # gone, or a range outside the segment: the reply goes inline
        msg.shm = [reply_at[0]]
        self.placed += array.nbytes


def unusable(cfg: Config) -> str | None:
    """Why a node with ``cfg`` keeps every pair on TCP (KVSTORE_SHM=0, KVSTORE_AUTH=full,
    KVSTORE_ENCRYPT, no memfd, no sealing), or None when shared memory may be used."""
    if not cfg.shm:
        return "KVSTORE_SHM=0"
    if cfg.auth_full:
        return "KVSTORE_AUTH=full tags array bytes in transit, and shared memory has no transit (docs/shm.md)"
    if cfg.encrypt:
        return f"KVSTORE_ENCRYPT={cfg.encrypt} keeps every byte on the encrypted sockets"
    if not hasattr(os, "memfd_create"):
        return "this system has no memfd_create"
    if not SEALS or not hasattr(fcntl, "F_GET_SEALS"):
        return "this system cannot seal a memfd (fcntl F_SEAL_SHRINK, F_SEAL_GROW)"
    return None

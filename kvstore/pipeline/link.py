"""Stage-to-stage transport: one bound socket per pipeline worker, sealed messages to its neighbours.

Each pipeline worker binds one ROUTER (port 0) and publishes its address through the
scheduler (PIPE_PUBLISH); after a barrier it looks its peers up (PIPE_LOOKUP) and connects a
DEALER to each: its neighbours, and the ranks a skip connection or an interleaved schedule's
wrap-around joins it to.  Activations go forward and gradients backward as sealed messages
(``kvstore.net.auth``, keyed by the cluster's secret and session), each array a raw frame
(zero-copy for big ones).  A message travels on a *channel*, ``(op, part, name)``: its kind, the
model part that receives it and its skip name ("" for the main boundary); the routes say which rank
sends on each channel this rank receives, and a message from any other rank is dropped.  A message
to a part of this rank goes straight into its inbox.  Every wait has a deadline (KVSTORE_REQUEST_TIMEOUT)
and watches the store's heartbeat: a lost worker is raised as the store raises it.

Anyone may connect to the bound socket, so it has a server's limits against a stranger: zmq's
frame limit, a receive high-water mark per connection, a bounded drain, and the heap trimmed
after a flood (docs/security.md, "A pipeline stage's socket").

Stages on one host move arrays of ``kvstore.net.shm.MIN_BYTES`` or more through a sealed segment the
sender owns for each peer (:class:`StageShm`): the sealed message then carries the array's offset,
its frame is empty, and every check above still applies (docs/pipeline.md, "Same host: shared memory").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import heap
from kvstore.client.store import DistKVStore
from kvstore.config import Config
from kvstore.core.dtypes import dtype_name
from kvstore.errors import (
    ConfigError,
    DeadlineExceededError,
    KVStoreError,
    NodeLostError,
    ProtocolError,
    RemoteError,
)
from kvstore.net import address, protocol, shm, transport
from kvstore.net.curve import CurveKeys
from kvstore.net.protocol import Message, Op
from kvstore.net.router import TRIM_AFTER_EVENTS, DropLog

log = logging.getLogger("kvstore.pipeline")
TICK = 0.05  # seconds between checks of the heartbeat's verdict while waiting for a neighbour
KINDS = {Op.PIPE_ACT: "activation", Op.PIPE_GRAD: "gradient"}
DRAIN_LIMIT = 1000  # messages read per wake-up before the deadline and the heartbeat are checked again
# Flow control, as a server's ROUTER has (kvstore.server.server.INBOUND_MESSAGES): zmq queues at most
# this many messages from each connection before it stops reading it, and TCP holds the sender back.
# A neighbour loses nothing (its DEALER queues what the stage has not taken yet, and never waits);
# a stranger's flood costs the stage at most about (INBOUND_MESSAGES + 1) x KVSTORE_MAX_MESSAGE_BYTES
# per connection (docs/security.md).
INBOUND_MESSAGES = 4
TRIM_AFTER_BYTES = 16 << 20  # refused bytes after which freed heap goes back to the OS (at most 1/s)
BIG_REFUSAL = 1 << 20  # a refused message of this many bytes is freed with the heap trimmed at once
MAX_CHUNKS = 1 << 16  # micro-batches of a step when the caller does not say (the most a stage may announce)
MAX_ARRAYS = 256  # tensors in one message (a tuple boundary's elements)
MAX_FREE = 4096  # offsets in one PIPE_SHM "free" message (a stage that read more sends several)
Channel = tuple[int, int, str]  # (op, part, name): PIPE_ACT or PIPE_GRAD, the receiving part, the skip name
Key = tuple[int, int, int, int, str]  # (op, step, mb, part, name): one message of one step


def neighbour_routes(prev: int | None, nxt: int | None) -> dict[Channel, int]:
    """The routes of a stage that only talks to its neighbours (part 0): activations from ``prev``,
    gradients from ``nxt``."""
    routes: dict[Channel, int] = {}
    if prev is not None:
        routes[(Op.PIPE_ACT, 0, "")] = prev
    if nxt is not None:
        routes[(Op.PIPE_GRAD, 0, "")] = nxt
    return routes


def label(rank: int) -> str:
    """The channel name of worker ``rank``'s pipeline socket."""
    return f"pipe-{rank}"


@dataclass
class ShmStats:
    """What a stage's link moved through same-host shared memory (tests, logs)."""

    sent: int = 0  # arrays this stage wrote into the segments it owns for its peers
    sent_bytes: int = 0
    received: int = 0  # arrays it copied out of its peers' segments
    received_bytes: int = 0
    full: int = 0  # arrays of MIN_BYTES or more sent over TCP because their peer's segment had no free range


class _Offered:
    """A segment a stage made for one peer: whether the peer mapped it, and the ranges lent to messages
    the peer has not yet said it read."""

    def __init__(self, segment: shm.Segment) -> None:
        self.segment = segment
        self.attached = False
        self.lent: set[int] = set()
        self.full_logged = False


class StageShm:
    """A stage's same-host shared memory: a sealed segment (``kvstore.net.shm.Segment``, KVSTORE_SHM_BYTES
    big) it owns for each peer it sends arrays of MIN_BYTES or more, and the segments its peers offered
    it, mapped only after a server's checks (``kvstore.net.shm.open_mapping``).  Off where
    ``kvstore.net.shm.unusable`` says why (KVSTORE_SHM=0, KVSTORE_AUTH=full, KVSTORE_ENCRYPT, no memfd).

    Attach: the first such send to a peer offers it the segment instead (PIPE_SHM ``{"offer"}``, sent
    just before that message, which goes over TCP); the peer maps it when it next reads its socket and
    answers ``{"attached": bool, "why"}``.  Sends to that peer use the segment only after ``attached:
    true``: nothing waits for the answer, and a peer that cannot map it (another host, KVSTORE_SHM=0
    there) or never answers keeps the pair on TCP.

    Freeing (the rule): a range lent to a message is free again once that peer says it has read it
    (PIPE_SHM ``{"free": [offset, ...]}``).  The peer copies an array out of the mapping when it files
    the message, or drops the message without reading it, and after each read of its socket tells each
    sender, in one message, the ranges of every message of its it took.  A connection delivers in
    order and a peer never reads a range after naming it, so a range is reused only when nothing will
    read it again; a stage frees only ranges it lent to the peer that names them.  A send that finds no
    free range big enough sends that array over TCP (``stats.full``, logged once per peer): no send
    waits, and a segment holds at most what its peer has not read yet.

    Receiving: an array in a peer's segment is a view while its message is checked, then a private copy
    (nothing filed aliases memory the sender will reuse).  A range outside the segment, an array over
    KVSTORE_MAX_MESSAGE_BYTES, an array from a peer whose segment is not mapped: :class:`ProtocolError`,
    and the message is dropped as any bad one is.
    """

    def __init__(self, cfg: Config, names: dict[int, str], rank: int) -> None:
        self.off = shm.unusable(cfg)  # why this stage uses no segment, or None
        self.size, self.max_array = cfg.shm_bytes, cfg.max_message_bytes
        self.names, self.rank = names, rank
        self.offered: dict[int, _Offered | None] = {}  # peer -> the segment offered it (None: TCP for good)
        self.mapped: dict[int, shm.Mapping] = {}  # peer -> its segment, mapped here
        self.read: dict[int, list[int]] = {}  # peer -> offsets of its messages taken, not yet told it
        self.stats = ShmStats()

    def place(self, peer: int, msg: Message) -> Message | None:
        """Copy ``msg``'s arrays of MIN_BYTES or more into ``peer``'s segment (their offsets in
        ``msg.shm``, their frames empty) once the peer has mapped it; the first time, return instead the
        offer to send before ``msg``.  An array that finds no free range stays inline.  Raises nothing."""
        if self.off is not None or not any(array.nbytes >= shm.MIN_BYTES for array in msg.arrays):
            return None
        if peer not in self.offered:
            return self._offer(peer)
        lane = self.offered[peer]
        if lane is None or not lane.attached:
            return None
        for i, array in enumerate(msg.arrays):
            if array.nbytes < shm.MIN_BYTES or dtype_name(array.dtype) is None:
                continue  # a dtype the wire refuses stays inline: sealing raises as it does on TCP
            off = lane.segment.take(array.nbytes)
            if off is None:
                self._full(peer, lane, array.nbytes)
                continue
            lane.segment.write(off, np.ascontiguousarray(array))  # a strided array as TCP sends it
            lane.lent.add(off)
            if msg.shm is None:
                msg.shm = [None] * len(msg.arrays)
            msg.shm[i] = off
            self.stats.sent += 1
            self.stats.sent_bytes += array.nbytes
        return None

    def short(self, peer: int, msg: Message) -> bool:
        """Whether ``peer``'s attached segment lacks the free bytes for ``msg``'s big arrays now (its
        "free" messages may be waiting, unread, in the socket)."""
        lane = self.offered.get(peer)
        if self.off is not None or lane is None or not lane.attached:
            return False
        need = sum(a.nbytes for a in msg.arrays if a.nbytes >= shm.MIN_BYTES)
        return need > 0 and lane.segment.free_bytes() < need

    def unplace(self, peer: int, msg: Message) -> None:
        """Give back the ranges :meth:`place` took for ``msg`` (it could not be sealed)."""
        lane = self.offered.get(peer)
        if msg.shm is None or lane is None:
            return
        for i, off in enumerate(msg.shm):
            if off is not None:
                lane.lent.discard(off)
                lane.segment.give(off)
                self.stats.sent -= 1
                self.stats.sent_bytes -= msg.arrays[i].nbytes
        msg.shm = None

    def _offer(self, peer: int) -> Message | None:
        """Make ``peer``'s segment; the PIPE_SHM offering it, or None when none can be made (TCP)."""
        try:
            segment = shm.Segment(self.size)
        except OSError as exc:
            self.offered[peer] = None
            log.warning("%s: no %d-byte shared-memory segment for %s (%s); arrays go over TCP",
                        self.names[self.rank], self.size, self.names[peer], exc.strerror or exc)
            return None
        self.offered[peer] = _Offered(segment)
        return Message(Op.PIPE_SHM, {"offer": segment.attach_body()})

    def _full(self, peer: int, lane: _Offered, nbytes: int) -> None:
        self.stats.full += 1
        if not lane.full_logged:
            lane.full_logged = True
            log.warning("%s: a %d-byte array does not fit the free part of its %d-byte shared-memory segment "
                        "for %s (KVSTORE_SHM_BYTES): such arrays go over TCP", self.names[self.rank], nbytes,
                        lane.segment.size, self.names[peer])

    def handle(self, sender: int, msg: Message) -> Message | None:
        """Act on a PIPE_SHM from peer ``sender``: map its offer (return the answer to send it), take its
        answer to this stage's offer, or free the ranges it read.  Raises :class:`ProtocolError` for any
        other body, an answer to no offer, or a range this stage did not lend it (the valid ones are
        freed)."""
        body, fields = msg.body, set(msg.body)
        if msg.arrays or fields not in ({"offer"}, {"attached", "why"}, {"free"}):
            raise ProtocolError(f"a PIPE_SHM from worker {sender} with fields {sorted(map(str, fields))[:4]} "
                                f"and {len(msg.arrays)} arrays")
        if fields == {"offer"}:
            return Message(Op.PIPE_SHM, self._map(sender, body["offer"]))
        lane = self.offered.get(sender)
        if fields == {"attached", "why"}:
            if lane is None or lane.attached or type(body["attached"]) is not bool:
                raise ProtocolError(f"an unasked-for PIPE_SHM answer from worker {sender}")
            lane.segment.close_fd()  # mapped there, or never to be
            if body["attached"]:
                lane.attached = True
                log.info("%s sends %s arrays of %d bytes or more through shared memory (a %d-byte segment)",
                         self.names[self.rank], self.names[sender], shm.MIN_BYTES, lane.segment.size)
            else:
                self.offered[sender] = None
                log.info("%s keeps %s on TCP: %s", self.names[self.rank], self.names[sender],
                         str(body["why"])[:200])
            return None
        offsets = body["free"]
        if lane is None or not lane.attached or type(offsets) is not list or len(offsets) > MAX_FREE:
            raise ProtocolError(f"a PIPE_SHM from worker {sender} freeing ranges of no segment offered it")
        unknown = 0
        for off in offsets:
            if type(off) is int and off in lane.lent:
                lane.lent.discard(off)
                lane.segment.give(off)
            else:
                unknown += 1
        if unknown:
            raise ProtocolError(f"a PIPE_SHM from worker {sender} freeing {unknown} range(s) not lent to it")
        return None

    def _map(self, sender: int, offer: Any) -> dict[str, Any]:
        """Map the segment ``sender`` offers (replacing its earlier one); the answer's body."""
        if self.off is not None:
            return {"attached": False, "why": self.off}
        mapping, why = shm.open_mapping(offer)
        if mapping is None:
            return {"attached": False, "why": why}
        old = self.mapped.pop(sender, None)
        if old is not None:
            old.close()
        self.mapped[sender] = mapping
        return {"attached": True, "why": ""}

    def resolver(self, header: Any) -> Callable[[int, int], np.ndarray] | None:
        """``protocol.decode``'s resolver for a message whose header frame is ``header`` (None while no
        peer's segment is mapped): a view of the range in the segment of the header's sender, read when
        first needed (decode runs after the MAC over that header is checked).  It raises
        :class:`ProtocolError` for an unmapped sender, a range outside its segment, an array over
        KVSTORE_MAX_MESSAGE_BYTES."""
        if not self.mapped:
            return None
        found: list[shm.Mapping | None] = []

        def view(off: int, nbytes: int) -> np.ndarray:
            if not found:
                sender = protocol.peek(header).get("sender")
                found.append(self.mapped.get(sender) if type(sender) is int else None)
            if found[0] is None:
                raise ProtocolError("an array in shared memory from a worker whose segment this stage has "
                                    "not mapped")
            if self.max_array and nbytes > self.max_array:
                raise ProtocolError(f"an array of {nbytes} bytes in shared memory exceeds the "
                                    f"{self.max_array} a frame may have (KVSTORE_MAX_MESSAGE_BYTES)")
            return found[0].view(off, nbytes)
        return view

    def took(self, msg: Message) -> None:
        """Note the ranges of ``msg`` (opened: filed or about to be dropped), to tell its sender."""
        if msg.shm is not None and msg.sender in self.mapped:
            self.read.setdefault(msg.sender, []).extend(off for off in msg.shm if off is not None)

    def settle(self, msg: Message) -> list[np.ndarray]:
        """``msg``'s arrays, those in its sender's segment copied out of it."""
        arrays = list(msg.arrays)
        for i, off in enumerate(msg.shm or ()):
            if off is not None:
                arrays[i] = arrays[i].copy()
                self.stats.received += 1
                self.stats.received_bytes += arrays[i].nbytes
        return arrays

    def reads(self) -> list[tuple[int, Message]]:
        """The PIPE_SHM messages telling each sender the ranges taken since the last call (then forgotten)."""
        told = [(peer, Message(Op.PIPE_SHM, {"free": offsets[i:i + MAX_FREE]}))
                for peer, offsets in self.read.items() for i in range(0, len(offsets), MAX_FREE)]
        self.read.clear()
        return told

    def close(self) -> None:
        """Close the descriptors still open and unmap the peers' segments (idempotent)."""
        for lane in self.offered.values():
            if lane is not None:
                lane.segment.close_fd()
        self.offered.clear()
        for mapping in self.mapped.values():
            mapping.close()
        self.mapped.clear()


class StageLink:
    """Worker ``rank``'s pipeline socket and its connections to its peers.  ``routes`` maps each channel
    this rank receives on to the rank that sends on it; ``peers`` are the other ranks it sends to (it
    connects to both).  ``names`` maps a rank to the words naming it in errors ("stage 0 (worker 2)").
    A step has at most ``chunks`` micro-batches: what waits in the inbox is at most one message per
    (channel, step, micro-batch) of this step and the next, so at most ``2 * len(routes) * chunks``.
    ``shm`` is its same-host shared memory (:class:`StageShm`; ``shm.stats`` counts what went through it)."""

    def __init__(self, kv: DistKVStore, routes: Mapping[Channel, int], names: dict[int, str],
                 chunks: int = MAX_CHUNKS, peers: Iterable[int] = ()) -> None:
        access = kv.stage_access(label(kv.rank))  # its channel is sealed with the cluster's session
        cfg, self.channel, self.request = access.cfg, access.channel, access.request
        self.kv, self.rank, self.names = kv, kv.rank, names
        self.routes = dict(routes)
        self.chunks = chunks
        self.timeout = cfg.request_timeout
        self.max_bytes = cfg.max_message_bytes  # every node's frame limit (the cluster map checks they agree)
        self.shm = StageShm(cfg, names, self.rank)
        host = address.node_host(cfg)
        address.check_bind(cfg, host, "a pipeline stage")
        curve = transport.curve_keys(cfg)
        self.sock, port = transport.bind_router(host, 0, inbound=INBOUND_MESSAGES,
                                                max_frame_bytes=cfg.max_message_bytes, curve=curve)
        self.peers: dict[int, Any] = {}
        self.inbox: dict[Key, tuple[list[np.ndarray], dict]] = {}  # message key -> arrays, body
        self.taken: set[Key] = set()  # keys received already (a repeat is dropped)
        self.ahead: tuple[int, str] | None = None  # a failure of the next step told while in this one
        self.drops = DropLog(log)  # what the socket refused, counted by reason and logged now and then
        self._untrimmed, self._untrimmed_bytes = 0, 0  # refused since the heap was last trimmed
        try:
            self.poller = transport.Poller()
            self.poller.add(self.sock)
            self.request(Op.PIPE_PUBLISH, {"host": host, "port": port}, "pipeline address")
            kv.barrier()  # every stage has published before anyone looks up
            for peer in sorted({*self.routes.values(), *peers} - {self.rank}):
                self.peers[peer] = self._connect(peer, curve)
        except BaseException:
            self.close()
            raise

    def _connect(self, peer: int, curve: CurveKeys | None) -> Any:
        reply = self.request(Op.PIPE_LOOKUP, {"rank": peer}, f"address of {self.names[peer]}")
        found = reply.body.get("address")
        if not (isinstance(found, list) and len(found) == 2):
            raise ProtocolError(f"the scheduler has no pipeline address for {self.names[peer]}")
        # No routing identity of our own: zmq assigns each connection one, so none can be claimed by
        # whoever connects first (a stranger holding a fixed "pipe-<rank>" had the ROUTER refuse the
        # real neighbour).  The stage never answers through its ROUTER, and who sent a message is
        # read from its sealed header, never from the connection.
        return transport.connect_dealer(transport.address(found[0], found[1]), curve=curve)

    def send(self, peer: int, op: Op, body: dict[str, Any], arrays: list[np.ndarray]) -> None:
        """Seal and send one message to ``peer`` (into this rank's own inbox when ``peer`` is this rank);
        raises NodeLostError when that fails, and ConfigError for an array bigger than
        KVSTORE_MAX_MESSAGE_BYTES: the receiving socket would drop it (zmq's frame limit) and its stage
        wait out its deadline for it."""
        if peer == self.rank:
            self._file(Message(op, body, [np.array(a) for a in arrays], sender=self.rank), body["step"])
            return
        big = max((a.nbytes for a in arrays), default=0)
        if self.max_bytes and big > self.max_bytes:
            raise ConfigError(f"{self.names[self.rank]} cannot send {self.names[peer]} the {KINDS[op]} of "
                              f"micro-batch {body.get('mb')}: {big} bytes, over KVSTORE_MAX_MESSAGE_BYTES="
                              f"{self.max_bytes} (a frame its socket refuses); use more micro-batches "
                              f"(chunks) or raise KVSTORE_MAX_MESSAGE_BYTES")
        msg = Message(op, body, arrays, sender=self.rank)
        if self.shm.short(peer, msg):  # a stage that only sends (a first stage's predict) reads the
            self._drain(body.get("step", 0), None)  # peer's "free" messages here, or never
        offer = self.shm.place(peer, msg)  # big arrays into the peer's segment, once it has mapped it
        if offer is not None:
            self._post(peer, offer)
        try:
            transport.send(self.peers[peer], self.channel.seal(msg, label(peer)))
        except BaseException:
            self.shm.unplace(peer, msg)
            raise

    def _post(self, peer: int, msg: Message) -> None:
        """Seal and send ``msg`` to ``peer``; raises NodeLostError when that fails."""
        msg.sender = self.rank
        transport.send(self.peers[peer], self.channel.seal(msg, label(peer)))

    def abort(self, message: str, step: int) -> None:
        """Tell every peer this stage failed ``step`` (they raise RemoteError instead of waiting)."""
        for peer in self.peers:
            try:
                self.send(peer, Op.PIPE_ABORT, {"message": message[:2000], "step": step}, [])
            except KVStoreError:
                pass  # it may be the one that is gone

    def receive(self, op: Op, step: int, mb: int, part: int = 0,
                name: str = "") -> tuple[list[np.ndarray], dict]:
        """The arrays and body of micro-batch ``mb`` of ``step`` on channel ``(op, part, name)`` (waits).

        Raises :class:`DeadlineExceededError` naming the awaited stage after KVSTORE_REQUEST_TIMEOUT,
        the store's :class:`NodeLostError` once the heartbeat reports a lost node, and
        :class:`RemoteError` when a peer aborted the step.
        """
        peer = self.routes[(op, part, name)]
        key = (op, step, mb, part, name)
        self._forget_before(step)
        if self.ahead is not None and self.ahead[0] == step and key not in self.inbox:
            raise RemoteError(self.ahead[1])
        deadline = time.monotonic() + self.timeout
        while key not in self.inbox:
            self._check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                what = KINDS[op] + (f" of skip {name!r}" if name else "")
                raise DeadlineExceededError(
                    f"{self.names[self.rank]} waited {self.timeout:g} s for the {what} of micro-batch "
                    f"{mb} from {self.names[peer]} (KVSTORE_REQUEST_TIMEOUT)")
            if self.poller.wait(min(left, TICK)):
                self._drain(step, key)
        self.taken.add(key)
        return self.inbox.pop(key)

    def _forget_before(self, step: int) -> None:
        """Drop what an earlier step left waiting (a failed step's late messages) and its receipts."""
        for key in [k for k in self.inbox if k[1] < step]:
            del self.inbox[key]
        self.taken = {k for k in self.taken if k[1] >= step}

    def _check_alive(self) -> None:
        """Raise the heartbeat's NodeLostError, naming the stage when the lost node is a pipeline worker."""
        try:
            self.kv.check_alive()
        except NodeLostError as exc:
            if exc.role != "worker" or exc.rank not in self.names:
                raise
            raise NodeLostError(f"{self.names[exc.rank]} is lost, so {self.names[self.rank]} stops: {exc}",
                                role=exc.role, rank=exc.rank, host=exc.host) from None

    def _drain(self, step: int, wanted: Key | None) -> None:
        """File waiting messages in the inbox until ``wanted`` is there; drop and count what is not for
        us (anyone may connect, so nothing read here may raise but a neighbour's PIPE_ABORT).  Reads at
        most DRAIN_LIMIT messages, so a flood cannot keep the caller from its deadline, and stops at
        the awaited one: zmq takes each connection's messages in turn, so a stranger's junk costs a
        step about one message per connection for each it waits for."""
        try:
            for _ in range(DRAIN_LIMIT):
                if not self._take(step) or wanted in self.inbox:
                    break
        finally:
            for peer, told in self.shm.reads():  # the shared-memory ranges it may reuse
                try:
                    self._post(peer, told)
                except KVStoreError:
                    pass  # gone: its ranges stay lent, and it keeps them
        self._flush_drops()  # after the last message read is freed, so a trim can return it too

    def _take(self, step: int) -> bool:
        """File one waiting message in the inbox, or drop and count it; False when none was waiting."""
        try:
            frames = transport.recv_nowait(self.sock)
        except ProtocolError as exc:  # too many frames: read, dropped (and trimmed) by the transport
            self.drops.count("frames", str(exc))
            return True
        if frames is None:
            return False
        # The refusal is counted after its except block: the exception's traceback holds the frames
        try:
            msg = self.channel.open(frames[1:], self.shm.resolver(frames[2] if len(frames) > 2 else b""))
        except Exception as exc:  # made-up frames may break anything in the decoder
            refusal = ("unreadable", f"{type(exc).__name__}: {exc}")
        else:
            self.shm.took(msg)  # read now or never: its sender may reuse its shared-memory ranges
            try:
                self._file(msg, step)
                return True
            except ProtocolError as exc:
                refusal = ("unexpected", str(exc))
            del msg  # its arrays are views of the frames
        self._refused(frames, *refusal)
        return True

    def _refused(self, frames: list[Any], reason: str, detail: str) -> None:
        """Count a dropped message under ``reason``, and its bytes towards the next heap trim; free a
        big one's buffers (the caller's last reference) with the heap trimmed as they go."""
        self.drops.count(reason, detail)
        size = sum(len(frame) for frame in frames)
        self._untrimmed += 1
        self._untrimmed_bytes += size
        if size >= BIG_REFUSAL:
            with heap.trimming():  # zmq's I/O thread's arena keeps its top otherwise (kvstore.heap)
                frames.clear()

    def _flush_drops(self) -> None:
        """Log the drop counts when due (at most once a second); after a flood, give the heap zmq
        queued it in back to the OS, as a server does (kvstore.net.router)."""
        if self.drops.flush() and (self._untrimmed >= TRIM_AFTER_EVENTS
                                   or self._untrimmed_bytes >= TRIM_AFTER_BYTES):
            self._untrimmed, self._untrimmed_bytes = 0, 0
            transport.trim_heap()

    def _file(self, msg: Message, step: int) -> None:
        if msg.sender not in self.peers and msg.sender != self.rank:
            raise ProtocolError(f"a pipeline message from worker {msg.sender}, not a peer")
        if msg.op == Op.PIPE_ABORT:
            got_step, text = msg.body.get("step"), msg.body.get("message")
            if type(got_step) is not int or not isinstance(text, str) or len(msg.arrays) > 0:
                raise ProtocolError(f"a PIPE_ABORT from worker {msg.sender} needs an int step, a str message "
                                    "and no arrays")
            failure = f"{self.names[msg.sender]} failed the step: {text[:2000]}"
            if got_step == step + 1:  # a peer already in the next step failed it: raised when it begins
                self.ahead = (got_step, failure)
            if got_step != step:
                return  # an earlier step's failure, already raised here
            raise RemoteError(failure)
        if msg.op == Op.PIPE_SHM:
            if msg.sender == self.rank:
                raise ProtocolError("a PIPE_SHM from this stage itself")
            answer = self.shm.handle(msg.sender, msg)
            if answer is not None:
                try:
                    self._post(msg.sender, answer)
                except KVStoreError:
                    pass  # gone
            return
        got_step, mb = msg.body.get("step"), msg.body.get("mb")
        part, name = msg.body.get("part", 0), msg.body.get("name", "")
        if type(part) is not int or not isinstance(name, str) or msg.op not in KINDS:
            raise ProtocolError(f"unexpected {msg.op.name} from worker {msg.sender}")
        count = len(msg.arrays)  # an activation carries at least one tensor; a gradient may carry none
        if (self.routes.get((msg.op, part, name)) != msg.sender or count > MAX_ARRAYS
                or (msg.op == Op.PIPE_ACT and count == 0)):
            raise ProtocolError(f"unexpected {msg.op.name} from worker {msg.sender} for part {part} "
                                f"{name!r} with {len(msg.arrays)} arrays")
        if (type(got_step) is not int or type(mb) is not int or not step <= got_step <= step + 1
                or not 0 <= mb < self.chunks):
            raise ProtocolError(f"{msg.op.name} from worker {msg.sender} for step {got_step!r} micro-batch "
                                f"{mb!r} (this step is {step}, of at most {self.chunks} micro-batches)")
        key = (msg.op, got_step, mb, part, name)
        if key in self.inbox or key in self.taken:
            raise ProtocolError(f"a repeated {msg.op.name} from worker {msg.sender} for step {got_step} "
                                f"micro-batch {mb}")
        self.inbox[key] = (self.shm.settle(msg), msg.body)

    def close(self) -> None:
        """Close every socket (idempotent).  What the connections to the neighbours have not sent yet
        (a last stage's final gradients) keeps up to KVSTORE_REQUEST_TIMEOUT to leave, in zmq's
        background thread: the wait a neighbour would otherwise spend on it, then fail."""
        for sock in self.peers.values():
            transport.close(sock, linger=self.timeout)
        self.peers = {}
        self.shm.close()
        if self.sock is not None:
            transport.close(self.sock)
            self.sock = None

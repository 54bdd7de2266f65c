"""The request loop shared by the scheduler and the servers: one ROUTER, one handler table.

(A node's side of registration is :mod:`kvstore.net.handshake`; the role process wrapper
``run_role`` is :mod:`kvstore.net.role`.)

A handler gets ``(identity, message)``.  When it raises, the caller gets an
ERROR reply naming the error, and the service keeps serving (its state is
untouched: handlers validate before they change anything).  Every message is
authenticated (``kvstore.net.auth``) before it is decoded.  What a peer without
the secret can make the node do is bounded:

- a message that fails authentication (bad or missing MAC, sealed for another
  node, replayed, or unreadable before its MAC) gets ONE unsigned ERROR per
  connection identity (:class:`RefusalGate`; a node with the wrong secret still
  learns why at registration), later ones from that identity get nothing;
- a message whose MAC verifies but whose content is malformed gets a sealed
  ERROR carrying its ``seq`` when the header has one (the sender holds the secret);
- with ``KVSTORE_AUTH=full``, a message whose header MAC verifies but whose array
  bytes fail the payload tag (damaged in transit) is not handled: its sender gets a
  sealed ``IntegrityError`` carrying its ``seq``, naming the op and the keys;
- replies never wait: one that finds its peer's queue full is dropped
  (``transport.ROUTER_SNDHWM``).

Every refusal and every reply not sent is counted by reason and logged at most
once a second (:class:`DropLog`).  Replies are addressed to the label the peer
last sent with.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvstore.errors import (
    AuthenticationError,
    IntegrityError,
    KVStoreError,
    ProtocolError,
    error_code,
    error_node,
)
from kvstore.net import protocol, transport
from kvstore.net.auth import (
    REASON_MALFORMED,
    REASON_PAYLOAD,
    REASON_UNDECODABLE,
    Channel,
    decode,
    refusal_reason,
    unsigned,
)
from kvstore.net.protocol import Message, Op
from kvstore.net.shm import ServerPeers

log = logging.getLogger("kvstore.router")

Handler = Callable[[bytes, Message], None]
LateHandler = Callable[[bytes, Message], Message]  # answers a holder of the secret without the session
PolledHandler = Callable[[bytes, Message], "Message | None"]  # answers a STATUS poller, or not at all


class RouterSocket(Protocol):
    """The bound ROUTER a :class:`RouterService` serves: :class:`kvstore.net.transport.Router` over zmq,
    or the in-memory :class:`kvstore.net.inproc.InProcRouter` of a unit test (no socket, no process)."""

    def send(self, identity: bytes, frames: list[Any]) -> bool:
        """Send ``frames`` to peer ``identity`` without waiting; False when its queue is full.
        Raises NodeLostError when the peer is gone."""
        ...

    def recv(self, timeout: float | None) -> list[Any] | None:
        """One message, identity first, waiting up to ``timeout`` seconds (None: only one already
        waiting); None when there is none.  Raises ProtocolError for one of too many frames."""
        ...

    def close(self) -> None:
        """Close the socket."""
        ...

ANSWERED_PEERS = 4096  # identities remembered as answered (unsigned) already
REANSWER_AFTER = 60.0  # a remembered identity silent this long may be forgotten to make room
LOG_EVERY = 1.0  # seconds between two lines of drop counts
TRIM_AFTER_EVENTS = 10_000  # after this many refusals the heap's free memory goes back to the OS
MAX_ERROR_TEXT = 300  # characters of an exception's text that go into an ERROR reply
# Reasons for counting, besides the refusal reasons of kvstore.net.auth:
NO_PAYLOAD = "no-payload"                  # an identity frame alone
TOO_MANY_FRAMES = "too-many-frames"        # over transport.MAX_FRAMES: read, dropped, not answered
WITHHELD_REPEAT = "reply-withheld"         # this identity was answered once already
WITHHELD_FULL = "reply-withheld-table-full"  # ANSWERED_PEERS identities answered, none idle
QUEUE_FULL = "reply-dropped-queue-full"    # the peer's send queue holds ROUTER_SNDHWM messages
PEER_GONE = "reply-dropped-peer-gone"      # the peer disconnected before its reply
REASON_LATE = "late-registration"          # the right secret, after the cluster was complete
OVER_RATE = "status-over-rate"             # a STATUS poller asking faster than it may: not answered


class RefusalGate:
    """Decides which refused messages get their one unsigned ERROR: each identity's first.

    Remembers up to ``capacity`` identities, least recently heard first out, and an identity is
    forgotten to make room only once silent for ``idle`` seconds; while the table is full of
    active ones, new identities get no reply either.  So unsigned replies are at most one per
    connection while it keeps sending, and at most ``capacity`` per ``idle`` seconds in all.
    """

    def __init__(self, capacity: int = ANSWERED_PEERS, idle: float = REANSWER_AFTER,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.idle, self._clock = capacity, idle, clock
        self._heard: collections.OrderedDict[bytes, float] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._heard)

    def may_answer(self, identity: bytes) -> str | None:
        """None when ``identity``'s refusal may be answered (it is remembered from now on), else
        why not (``WITHHELD_REPEAT`` or ``WITHHELD_FULL``).  Raises nothing."""
        now = self._clock()
        if identity in self._heard:
            self._heard[identity] = now
            self._heard.move_to_end(identity)
            return WITHHELD_REPEAT
        if len(self._heard) >= self.capacity:
            oldest, heard = next(iter(self._heard.items()))
            if now - heard < self.idle:
                return WITHHELD_FULL
            del self._heard[oldest]
        self._heard[identity] = now
        return None

    def forget(self, identity: bytes) -> None:
        """``identity`` has authenticated: its next refusal is answered again."""
        if self._heard:
            self._heard.pop(identity, None)


class DropLog:
    """Counts refused messages and unsent replies by reason; logs the counts at most once every
    ``every`` seconds (the first event after a quiet interval at once)."""

    def __init__(self, logger: logging.Logger, every: float = LOG_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.totals: collections.Counter[str] = collections.Counter()
        self._recent: collections.Counter[str] = collections.Counter()
        self._logger, self._every, self._clock = logger, every, clock
        self._logged_at = -math.inf
        self._since = 0.0
        self._last = ""

    def count(self, reason: str, detail: str = "") -> None:
        """Count one event of ``reason`` (``detail``: what happened, shown as the last one); the
        counts are logged by :meth:`flush`, which the request loop calls."""
        if not self._recent:
            self._since = self._clock()
        self.totals[reason] += 1
        self._recent[reason] += 1
        if detail:
            self._last = detail

    def flush(self) -> int:
        """Log the counts since the last line when ``every`` seconds have passed; return how many
        events that line counted (0: nothing logged)."""
        if not self._recent:
            return 0
        now = self._clock()
        if now - self._logged_at < self._every:
            return 0
        self._logger.warning("refused messages and unsent replies in %.1f s: %s; in all: %s; last: %s",
                             max(0.0, now - self._since), _counts(self._recent), _counts(self.totals),
                             self._last[:MAX_ERROR_TEXT])
        events = self._recent.total()
        self._recent.clear()
        self._logged_at = now
        return events


def _counts(counter: collections.Counter[str]) -> str:
    return " ".join(f"{reason}={n}" for reason, n in sorted(counter.items()))


class RouterService:
    """Receives requests on a bound ROUTER and dispatches them by op."""

    def __init__(self, sock: Any, channel: Channel, rank: int | None = None,
                 endpoint: RouterSocket | None = None) -> None:
        """Serve zmq ROUTER ``sock`` (a caller's poller may watch it), or ``endpoint`` (then ``sock``
        is None: a fake transport of a unit test)."""
        self.sock = sock
        self.endpoint: RouterSocket = endpoint if endpoint is not None else transport.Router(sock)
        self.channel = channel
        self.rank = rank
        self.handlers: dict[Op, Handler] = {}
        self.peers: dict[bytes, str] = {}  # connection identity -> label it last sent with
        self.gate = RefusalGate()
        self.drops = DropLog(log)
        # The scheduler, once the map is out, keeps a channel keyed without the session: a HELLO or
        # REGISTER that verifies under it comes from a node with the right secret registering late,
        # which is told so instead of being refused as a stranger.
        self.late: Channel | None = None
        # Ops answered to a holder of the secret without the session, over ``late`` (the scheduler's
        # STATUS for kvstore.status, a restarted worker's HELLO and REGISTER): the handler gets
        # ``(identity, message)`` and returns the reply, sealed with ``late``.
        self.late_handlers: dict[Op, LateHandler] = {}
        # The scheduler's channel for STATUS pollers (kvstore.status, the TensorBoard writer): keyed by
        # the secret and a key of the session (``status_client.poll_session``) from its start, so one
        # replay table spans the rendezvous and the map, and another cluster's messages do not verify.
        # Its handlers may return None: nothing is sent (a poller over its rate).
        self.polled: Channel | None = None
        self.polled_handlers: dict[Op, PolledHandler] = {}
        self._untrimmed = 0  # events logged since the heap was last trimmed
        self.shm: ServerPeers | None = None  # a server's peers when same-host shared memory is on

    def reply(self, identity: bytes, msg: Message) -> None:
        """Seal ``msg`` for peer ``identity`` and send it; a peer that has gone, or whose queue is full,
        is counted and logged, not raised."""
        msg.sender = self.rank
        if self.shm is not None:
            self.shm.place_reply(identity, msg)  # a reply its request reserved shared memory for
        self._send(identity, self.channel.seal(msg, self.peers.get(identity, "")), msg.op)

    def _send(self, identity: bytes, frames: list[Any], op: Op) -> None:
        try:
            if not self.endpoint.send(identity, frames):
                self.drops.count(QUEUE_FULL, f"{op.name} to {identity!r}: its queue is full")
        except KVStoreError as exc:
            self.drops.count(PEER_GONE, f"{op.name} to {identity!r}: {exc}")

    def reply_error(self, identity: bytes, seq: int, exc: BaseException) -> None:
        """Send the ERROR reply for ``exc`` to request ``seq`` of ``identity``."""
        self.reply(identity, protocol.error_reply(seq, error_code(exc), str(exc), node=error_node(exc)))

    def handle(self, frames: list[Any]) -> None:
        """Authenticate and decode one received message, identity first, and run its handler.

        Raises nothing: a bad message is refused (counted, answered at most as the module says).
        """
        if len(frames) < 2:
            self.drops.count(NO_PAYLOAD, "a message with no payload")
            return
        identity = bytes(frames[0])
        try:
            msg = self._open(identity, frames[1:])
        except Exception as exc:  # belt and braces: nothing a peer sends may end the loop
            self.drops.count(REASON_UNDECODABLE, _text(exc))
            return
        if msg is None:
            return
        handler = self.handlers.get(msg.op)
        try:
            if handler is None:
                raise ProtocolError(f"op {msg.op.name} is not served here")
            handler(identity, msg)
        except Exception as exc:  # a bad request must not kill the service
            if not isinstance(exc, KVStoreError):
                log.exception("handler for %s failed", msg.op.name)
            self.reply_error(identity, msg.seq, exc)

    def _open(self, identity: bytes, payload: list[Any]) -> Message | None:
        """The authenticated, decoded message; None when it was refused (and answered or not)."""
        try:
            self.channel.verify(payload)
        except IntegrityError:  # the header is authentic, its arrays were damaged: tell the sender
            self._damaged(identity, payload[1])
            return None
        except Exception as exc:  # any exception: frames a peer made up may break anything
            if not self._answer_late(identity, payload) and not self._answer_polled(identity, payload):
                self._refuse(identity, exc)
            return None
        try:
            msg = decode(payload, None if self.shm is None else self.shm.resolver(identity))
        except Exception as exc:
            self._malformed(identity, payload[1] if len(payload) > 1 else None, exc)  # None: compact
            return None
        try:
            label = self.channel.admit(msg.auth)
        except AuthenticationError as exc:  # for another node, or replayed
            self._refuse(identity, exc)
            return None
        except Exception as exc:  # an auth field of the wrong shape, under a valid MAC
            self._answer_malformed(identity, msg.seq, self.peers.get(identity, ""), exc)
            return None
        self.gate.forget(identity)
        self.peers[identity] = label
        if msg.reply_at is not None and self.shm is not None:
            self.shm.expect_reply(identity, msg.seq, msg.reply_at)
        return msg

    def _answer_late(self, identity: bytes, payload: list[Any]) -> bool:
        """Tell a registration sealed with the secret but not the session that the cluster is already
        complete (sealed, so the node trusts it); False when ``payload`` is no such message."""
        if self.late is None:
            return False
        try:
            self.late.verify(payload)
            msg = decode(payload)
            label = self.late.admit(msg.auth)
        except Exception:  # not a late registration: refused as any other message
            return False
        if msg.op in self.late_handlers:
            self._answer_outsider(identity, msg, label)
            return True
        if msg.op not in (Op.HELLO, Op.REGISTER):
            return False
        self.drops.count(REASON_LATE, f"{msg.op.name} from {label!r} after the cluster was complete")
        late = ProtocolError("the cluster is already complete; late registrations are refused")
        reply = protocol.error_reply(msg.seq, error_code(late), str(late), sender=self.rank)
        self._send(identity, self.late.seal(reply, label), reply.op)
        return True

    def _answer_polled(self, identity: bytes, payload: list[Any]) -> bool:
        """Answer a message sealed with the pollers' channel (``polled``) by its handler; False when
        ``payload`` is no such message (it is refused as any other then)."""
        if self.polled is None:
            return False
        try:
            self.polled.verify(payload)
            msg = decode(payload)
            label = self.polled.admit(msg.auth)
        except Exception:
            return False
        if msg.op not in self.polled_handlers:
            return False
        self._answer_outsider(identity, msg, label, self.polled, self.polled_handlers)
        return True

    def _answer_outsider(self, identity: bytes, msg: Message, label: str, channel: Channel | None = None,
                         handlers: dict[Op, PolledHandler] | None = None) -> None:
        """Answer ``msg`` (verified with ``channel``, default ``late``) by its handler in ``handlers``
        (default the late ones), sealed with ``channel``; a handler's None is counted, not sent."""
        channel = self.late if channel is None else channel
        assert channel is not None
        try:
            reply = (self.late_handlers if handlers is None else handlers)[msg.op](identity, msg)
        except Exception as exc:  # a bad request must not kill the service
            if not isinstance(exc, KVStoreError):
                log.exception("handler for %s from outside the cluster failed", msg.op.name)
            reply = protocol.error_reply(0, error_code(exc), _text(exc))
        if reply is None:
            self.drops.count(OVER_RATE, f"{msg.op.name} from {label!r} over its rate: not answered")
            return
        if reply.op is Op.MAP:  # admitted late (a restart): later messages to it are addressed to it
            self.peers[identity] = label
        reply.seq, reply.sender = msg.seq, self.rank
        self._send(identity, channel.seal(reply, label), reply.op)

    def _refuse(self, identity: bytes, exc: BaseException) -> None:
        """Count a message that failed authentication; answer it unsigned if the gate allows."""
        self.drops.count(refusal_reason(exc), _text(exc))
        withheld = self.gate.may_answer(identity)
        if withheld is not None:
            self.drops.count(withheld)
            return
        if not isinstance(exc, KVStoreError):
            exc = ProtocolError("the message could not be read")
        reply = protocol.error_reply(0, error_code(exc), _text(exc), sender=self.rank)
        self._send(identity, unsigned(reply), reply.op)

    def _malformed(self, identity: bytes, header: Any, exc: BaseException) -> None:
        """A message whose MAC verified but that does not decode: check its auth field if the header
        has one (a replay or a message for another node is refused as such), then answer sealed."""
        seq, auth = _peek(header)
        label = self.peers.get(identity, "")
        if auth is not None:
            try:
                label = self.channel.admit(auth)
            except AuthenticationError as refused:
                self._refuse(identity, refused)
                return
            except Exception:  # an auth field of the wrong shape: answer the decoding error
                pass
        self._answer_malformed(identity, seq, label, exc)

    def _damaged(self, identity: bytes, header: Any) -> None:
        """A message whose header MAC verified but whose array bytes did not (KVSTORE_AUTH=full): its
        auth is checked (a replay is refused as such), nothing is applied, the sender gets a sealed
        IntegrityError with its ``seq`` that names the op and the keys."""
        fields = protocol.peek(header)
        seq = fields.get("seq")
        seq = seq if type(seq) is int else 0
        label = self.peers.get(identity, "")
        try:
            label = self.channel.admit(fields.get("auth"))
        except AuthenticationError as refused:
            self._refuse(identity, refused)
            return
        except Exception:  # an auth field of the wrong shape: answer the damage all the same
            pass
        exc = IntegrityError(_damage_text(fields))
        self.drops.count(REASON_PAYLOAD, f"from {label!r}: {exc}")
        reply = protocol.error_reply(seq, error_code(exc), _text(exc), sender=self.rank)
        self._send(identity, self.channel.seal(reply, label), reply.op)

    def _answer_malformed(self, identity: bytes, seq: int, label: str, exc: BaseException) -> None:
        self.drops.count(REASON_MALFORMED, _text(exc))
        reply = protocol.error_reply(seq, error_code(exc), _text(exc), sender=self.rank)
        self._send(identity, self.channel.seal(reply, label), reply.op)

    def poll_once(self, timeout: float) -> bool:
        """Handle at most one message, waiting up to ``timeout`` seconds; return whether one came."""
        ready = self._handle_next(timeout)
        self._flush_drops()  # also logs the counts left once the bad traffic stops
        return ready

    def drain(self, limit: int = 1000) -> int:
        """Handle the messages already waiting (at most ``limit``); return how many."""
        handled = 0
        while handled < limit and self._handle_next(None):
            handled += 1
        self._flush_drops()
        return handled

    def close(self) -> None:
        """Close the socket served."""
        self.endpoint.close()

    def _flush_drops(self) -> None:
        """Log the drop counts when due; after a flood, give the memory zmq queued it in back to the
        OS (glibc keeps freed heap otherwise: 229 MiB stayed after two million junk messages)."""
        self._untrimmed += self.drops.flush()
        if self._untrimmed >= TRIM_AFTER_EVENTS:
            self._untrimmed = 0
            transport.trim_heap()

    def _handle_next(self, timeout: float | None) -> bool:
        """Receive one message within ``timeout`` (None: one already waiting) and handle it; False
        when none came."""
        try:
            frames = self.endpoint.recv(timeout)
        except ProtocolError as exc:  # too many frames: read, dropped, not answered
            self.drops.count(TOO_MANY_FRAMES, str(exc))
            return True
        if frames is None:
            return False
        self.handle(frames)
        return True


def _peek(header: Any) -> tuple[int, Any]:
    """The ``seq`` (0 when absent) and ``auth`` field (None when absent) of a header that failed to
    decode as a whole; (0, None) when even its map cannot be read."""
    fields = protocol.peek(header)
    seq = fields.get("seq")
    return (seq if type(seq) is int else 0), fields.get("auth")


def _damage_text(fields: dict[str, Any]) -> str:
    """What a damaged message was: "push of key 'w' refused: ...", from its (authenticated) header."""
    return (f"{protocol.describe(fields)} refused: its array bytes failed the integrity check "
            "(KVSTORE_AUTH=full); nothing was applied")


def _text(exc: BaseException) -> str:
    return str(exc)[:MAX_ERROR_TEXT] or type(exc).__name__

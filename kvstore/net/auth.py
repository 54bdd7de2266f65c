"""Message authentication: every frame set carries a MAC proving the sender holds the cluster secret.

A :class:`Channel` is one sender's end (and, for what comes back, one receiver's end).
It seals outgoing messages and opens incoming ones::

    frames on the wire:  [mac, header, array, array, ...]

The header's ``auth`` field is ``[label, n, to]``: the sending channel's random
label, its message counter (strictly increasing) and the name of the receiver it
is meant for.  The MAC (HMAC-SHA256, 16 bytes) covers the whole header, the
number of frames and every frame's length.  It is keyed by the cluster secret and,
once the cluster map is out, by the cluster's session id, so messages of an earlier
cluster with the same secret do not verify.  With ``KVSTORE_AUTH=full`` the MAC frame
also carries a 16-byte payload tag (32 bytes in all): Poly1305 over the array frames,
under a one-time key derived from the session key and the header MAC (each message's
``[label, n]`` is unique, so no key is used twice).  By default array bytes rely on
TCP's integrity.

Opening checks, in order: the MAC (:meth:`Channel.verify`: :class:`AuthenticationError`
when it is wrong or missing, :class:`IntegrityError` when the header MAC holds but the
payload tag does not: array bytes damaged by someone who cannot forge MACs), the header
(``protocol.decode``: :class:`ProtocolError`), that the message is addressed to this
channel, and that ``n`` is larger than anything seen from that label before
(:meth:`Channel.admit`: a replay is an :class:`AuthenticationError`).  :meth:`Channel.open`
does all three; the request loop (``kvstore.net.router``) calls them one by one, to tell a
stranger's message (answered once, unsigned) from an authenticated but malformed or
damaged one (answered sealed), and tags each refusal with a reason (:func:`refusal_reason`).
Without a secret the MAC frame is empty and the other checks still apply; a node with a
secret refuses unsigned messages and the other way round.

Where the compiled ``kvstore.net._hot`` is built (``kvstore.net.native``), the header MAC and the
compact layout's sealing, checking and decoding run in C, with the same bytes and checks; a channel
made with ``compiled=False`` (and every channel under ``KVSTORE_PURE_PYTHON=1``) runs the Python.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
import secrets
import threading
from typing import Any

from kvstore.config import Config
from kvstore.errors import AuthenticationError, ConfigError, IntegrityError, ProtocolError
from kvstore.net import compact, native, protocol
from kvstore.net.protocol import Message

MAC_BYTES = 16  # the header MAC (HMAC-SHA256, truncated)
TAG_BYTES = 16  # KVSTORE_AUTH=full: the payload tag (Poly1305) after the header MAC
# Why a message was refused (refusal_reason): the first five are failures to authenticate.
REASON_FRAMES = "no-header"        # fewer than a MAC frame and a header
REASON_MAC = "unauthenticated"     # a wrong or missing MAC (or one where none is expected)
REASON_ADDRESSEE = "misaddressed"  # sealed for another node
REASON_REPLAY = "replayed"         # a number its label has used before
REASON_UNDECODABLE = "undecodable"  # frames the checks could not even read
REASON_MALFORMED = "malformed"     # authenticated, but the header or arrays are wrong
REASON_PAYLOAD = "damaged-payload"  # KVSTORE_AUTH=full: the header MAC holds, the payload tag not


def derive_key(secret: str | None) -> bytes | None:
    """The HMAC key of a cluster secret (None without a secret)."""
    if not secret:
        return None
    return hashlib.sha256(b"kvstore-auth-v1\0" + secret.encode()).digest()


def channel_for(cfg: Config, label: str) -> Channel:
    """A channel keyed by ``cfg``'s ``KVSTORE_SECRET`` (and ``KVSTORE_AUTH``) sending as ``label`` (a node
    starting: it also says, once, when the compiled message path is not built)."""
    native.announce()
    return Channel(derive_key(cfg.secret), label, full=cfg.auth_full)


def unsigned(msg: Message) -> list[Any]:
    """Frames of ``msg`` with an empty MAC: only for error replies to peers that failed to authenticate."""
    msg.auth = None
    return [b"", *protocol.encode(msg)]


def server_name(rank: int, incarnation: int = 0) -> str:
    """The name workers address server ``rank`` by: ``server1``, or ``server1.2`` once restarted twice
    (a new name: nothing sealed for an earlier incarnation is accepted by a later one)."""
    return f"server{rank}" if incarnation == 0 else f"server{rank}.{incarnation}"


def new_label(role: str) -> str:
    """A fresh random channel label, e.g. ``worker-3fa9c1d2``."""
    return f"{role}-{secrets.token_hex(4)}"


def heartbeat_label(role: str, rank: int) -> str:
    """A fresh label for ``role rank``'s heartbeat channel, e.g. ``worker0-heartbeat-3fa9c1d2``: it names
    its node, so a restarted scheduler lets only that node say where its numbers stand."""
    return new_label(f"{role}{rank}-heartbeat")


def is_heartbeat_label(label: str, role: str, rank: int) -> bool:
    """Whether ``label`` is one :func:`heartbeat_label` makes for ``role rank``."""
    return label.startswith(f"{role}{rank}-heartbeat-")


class Channel:
    """Seals messages sent from ``label`` and opens messages addressed to one of ``names``."""

    def __init__(self, key: bytes | None, label: str, full: bool = False, session: bytes = b"",
                 compiled: bool = True) -> None:
        self.key, self.label, self.full = key, label, full
        self._hot = compact.HOT if compiled else None  # the compiled layout and MAC, or None
        if full and key is not None:
            _poly1305()  # a missing package is a ConfigError when the node starts, not per message
        self.names = {label}
        self._session_key, self._hot_key = self._keyed(session)
        self._counter = itertools.count(1)
        self._last: dict[str, int] = {}  # sender label -> highest n accepted
        self._lock = threading.Lock()

    def _keyed(self, session: bytes) -> tuple[Any, Any]:
        """An HMAC object keyed by the secret and ``session``, copied for each message, and the same
        key compiled (``_hot.Key``, None without the compiled path); (None, None) without a key."""
        if self.key is None:
            return None, None
        key = hmac.new(self.key, b"session\0" + session, hashlib.sha256).digest()
        return (hmac.new(key, digestmod=hashlib.sha256),
                None if self._hot is None else self._hot.Key(key, MAC_BYTES))

    def rename(self, label: str) -> None:
        """Send as ``label`` and accept messages addressed to it (a server once it knows its rank)."""
        self.label, self.names = label, {label}

    def reserve(self) -> int:
        """Take the next message number without sealing anything: every later message is numbered
        above it (a node telling a restarted scheduler where its numbers stand)."""
        return next(self._counter)

    def floor(self, label: str, n: int) -> None:
        """Refuse from ``label`` every number up to ``n`` from now on, as if seen (a restarted scheduler:
        the numbers its predecessor may have taken from that sender)."""
        with self._lock:
            self._last[label] = max(self._last.get(label, 0), n)

    def set_session(self, session: bytes) -> None:
        """Key every later message to the cluster's ``session`` id (from the cluster map)."""
        self._session_key, self._hot_key = self._keyed(session)

    def _mac(self, frames: list[Any]) -> bytes:
        """The header MAC: over the frame count, each frame's length and the header (never arrays)."""
        if self._hot_key is not None:
            return self._hot_key.mac(frames)
        mac = self._session_key.copy()  # the keyed state is computed once per session
        mac.update(len(frames).to_bytes(4, "big"))
        for frame in frames:
            mac.update(memoryview(frame).nbytes.to_bytes(8, "big"))
        mac.update(frames[0])
        return mac.digest()[:MAC_BYTES]

    def _tag(self, header_mac: bytes, arrays: list[Any]) -> bytes:
        """The payload tag: Poly1305 over the array frames, keyed once for this message's header MAC."""
        one_time = self._session_key.copy()
        one_time.update(b"payload-key\0" + header_mac)  # unlike any header MAC's input (a frame count)
        poly = _poly1305()(one_time.digest())
        for frame in arrays:
            poly.update(memoryview(frame).cast("B"))
        return poly.finalize()

    def seal(self, msg: Message, to: str) -> list[Any]:
        """The frames of ``msg`` addressed to ``to``, with this channel's next number and the MAC."""
        msg.auth = [self.label, next(self._counter), to]
        if self._session_key is not None and not self.full and compact.fits(msg):
            if self._hot_key is not None:
                return [compact.seal(self._hot_key, msg)]
            frame = compact.pack(msg, MAC_BYTES)  # one frame: [MAC | compact body]
            frame[:MAC_BYTES] = self._mac([memoryview(frame)[MAC_BYTES:]])
            return [frame]
        frames = protocol.encode(msg)
        if self._session_key is None:
            return [b"", *frames]
        mac = self._mac(frames)
        return [mac + self._tag(mac, frames[1:]) if self.full else mac, *frames]

    def open(self, frames: list[Any], resolve: Any = None) -> Message:
        """Verify and decode ``frames``; raise AuthenticationError or ProtocolError without side effects.

        The same as :meth:`verify`, ``protocol.decode`` of the rest (``resolve``: its shared-memory
        resolver), then :meth:`admit` of its auth.
        """
        self.verify(frames)
        msg = decode(frames, resolve, self._hot is not None)
        self.admit(msg.auth)
        return msg

    def verify(self, frames: list[Any]) -> None:
        """Check the MAC frame of ``frames`` (MAC frame, header, arrays) before anything is decoded.

        Raises :class:`ProtocolError` (reason ``REASON_FRAMES``) without a MAC frame and a header,
        or (``REASON_UNDECODABLE``) for a header over ``MAX_HEADER_BYTES``, which is refused before
        it is hashed; :class:`AuthenticationError` (``REASON_MAC``) for a wrong, missing or
        unexpected MAC, or one of the other ``KVSTORE_AUTH`` mode; :class:`IntegrityError`
        (``REASON_PAYLOAD``) when the header MAC holds but the payload tag does not.
        """
        if len(frames) == 1 and _is_compact(frames[0]):
            self._verify_compact(memoryview(frames[0]))
            return
        if len(frames) < 2:
            raise _refusal(ProtocolError("a message needs a MAC frame and a header"), REASON_FRAMES)
        size = memoryview(frames[1]).nbytes
        if size > protocol.MAX_HEADER_BYTES:  # no header is this big: not worth a MAC over it
            raise _refusal(ProtocolError(f"header of {size} bytes exceeds the {protocol.MAX_HEADER_BYTES}"
                                         "-byte limit"), REASON_UNDECODABLE)
        size = memoryview(frames[0]).nbytes
        if self._session_key is None:
            if size:
                raise _refusal(AuthenticationError("a signed message reached a node without KVSTORE_SECRET "
                                                   "(set the same secret on every node)"), REASON_MAC)
            return
        mac = bytes(frames[0]) if size in (MAC_BYTES, MAC_BYTES + TAG_BYTES) else b""
        header_mac = self._mac(frames[1:])
        if not hmac.compare_digest(mac[:MAC_BYTES], header_mac):
            raise _refusal(AuthenticationError("message authentication failed (a peer without the "
                                               "cluster's KVSTORE_SECRET, or a damaged or stale message)"),
                           REASON_MAC)
        if len(mac) != (MAC_BYTES + TAG_BYTES if self.full else MAC_BYTES):
            raise _refusal(AuthenticationError(_mode_mismatch(self.full)), REASON_MAC)
        if self.full and not hmac.compare_digest(mac[MAC_BYTES:], self._tag(header_mac, frames[2:])):
            raise _refusal(IntegrityError("a message's array bytes failed the integrity check "
                                          "(KVSTORE_AUTH=full): they were damaged in transit"),
                           REASON_PAYLOAD)

    def _verify_compact(self, frame: memoryview) -> None:
        """:meth:`verify` of a one-frame compact message: its MAC covers the whole body (arrays too)."""
        if frame.nbytes > MAC_BYTES + compact.MAX_BYTES:  # no compact message is this big
            raise _refusal(ProtocolError(f"a compact message of {frame.nbytes} bytes exceeds "
                                         f"{MAC_BYTES + compact.MAX_BYTES}"), REASON_UNDECODABLE)
        if self._session_key is None:
            raise _refusal(AuthenticationError("a signed message reached a node without KVSTORE_SECRET "
                                               "(set the same secret on every node)"), REASON_MAC)
        if not (self._hot_key.verify(frame) if self._hot_key is not None
                else hmac.compare_digest(bytes(frame[:MAC_BYTES]), self._mac([frame[MAC_BYTES:]]))):
            raise _refusal(AuthenticationError("message authentication failed (a peer without the "
                                               "cluster's KVSTORE_SECRET, or a damaged or stale message)"),
                           REASON_MAC)
        if self.full:  # only KVSTORE_AUTH=header sends compact messages
            raise _refusal(AuthenticationError(_mode_mismatch(True)), REASON_MAC)

    def admit(self, auth: Any) -> str:
        """Accept a verified header's ``auth`` field (``[label, n, to]``); return the sender's label.

        Records ``n`` as the label's highest.  Raises :class:`ProtocolError` (``REASON_MALFORMED``)
        for a field of the wrong shape, :class:`AuthenticationError` for a message addressed to
        another node (``REASON_ADDRESSEE``) or a number not above the label's highest
        (``REASON_REPLAY``).
        """
        label, n, to = _auth_fields(auth)
        if to not in self.names:
            raise _refusal(AuthenticationError(f"a message for {to!r} reached {sorted(self.names)}"),
                           REASON_ADDRESSEE)
        with self._lock:
            if n <= self._last.get(label, 0):
                raise _refusal(AuthenticationError(f"replayed message {n} from {label!r} refused"),
                               REASON_REPLAY)
            self._last[label] = n
        return label


def _is_compact(frame: Any) -> bool:
    """Whether a lone frame is a compact message: a MAC, then the compact marker (never raises)."""
    try:
        view = memoryview(frame)
        return view.ndim == 1 and view.itemsize == 1 and view.nbytes > MAC_BYTES \
            and view[MAC_BYTES] == compact.MARKER
    except (TypeError, ValueError):
        return False


def decode(frames: list[Any], resolve: Any = None, compiled: bool = True) -> Message:
    """The message in ``frames`` (MAC frame, header, arrays; or one compact frame) once
    :meth:`Channel.verify` passed; ``resolve``: the shared-memory resolver (``protocol.decode``);
    ``compiled``: a compact frame by the compiled layout where it is built.
    Raises ProtocolError, and nothing else, for frames that are no such message."""
    if len(frames) == 1 and _is_compact(frames[0]):
        return compact.unpack(memoryview(frames[0])[MAC_BYTES:], compiled)
    return protocol.decode(frames[1:], resolve)


def _mode_mismatch(full: bool) -> str:
    mine, theirs = ("full", "header") if full else ("header", "full")
    return (f"a message sealed with KVSTORE_AUTH={theirs} reached a node with KVSTORE_AUTH={mine} "
            "(set the same KVSTORE_AUTH on every node)")


@functools.cache
def _poly1305() -> Any:
    """The Poly1305 class of ``cryptography`` (imported on first use by KVSTORE_AUTH=full)."""
    try:
        from cryptography.hazmat.primitives.poly1305 import Poly1305
    except ImportError:
        raise ConfigError("KVSTORE_AUTH=full needs the 'cryptography' package "
                          "(pip install 'cryptography>=42')") from None
    return Poly1305


def _auth_fields(auth: Any) -> tuple[str, int, str]:
    if not (isinstance(auth, list) and len(auth) == 3 and isinstance(auth[0], str)
            and isinstance(auth[1], int) and not isinstance(auth[1], bool) and auth[1] > 0
            and isinstance(auth[2], str)):
        raise _refusal(ProtocolError("the header's auth field must be [label, n > 0, to]"), REASON_MALFORMED)
    return auth[0], auth[1], auth[2]


def _refusal(exc: Exception, reason: str) -> Exception:
    exc.refusal = reason  # type: ignore[attr-defined]  # read back by refusal_reason()
    return exc


def refusal_reason(exc: BaseException) -> str:
    """Why :meth:`Channel.verify` or :meth:`Channel.admit` refused a message (a ``REASON_*``);
    ``REASON_UNDECODABLE`` for any other exception (frames that are not even bytes-like)."""
    return getattr(exc, "refusal", REASON_UNDECODABLE)


def sender_label(msg: Message) -> str:
    """The label of the channel that sent ``msg`` (after :meth:`Channel.open`)."""
    return msg.auth[0]

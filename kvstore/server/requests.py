"""The requests object: what a server's request paths share, handed to them instead of the server.

:class:`Requests` holds the shard a server serves, the keys it holds as float32 master copies of
bfloat16 values, and its optimizer (whose update it installs as the shard's update hook), checks
what every data request must carry, and sends the replies.  The generic handlers
(``server/server.py``), the key-group path (``server/fastpath.py``), a restart's alignment
(``server/restore.py``) and the row-sparse handlers (``server/sparse.py``) take it, never the
``Server``.  So a push goes one way: the server's handler checks and widens the message, the
key-group path or the generic one hands its entries to the shard, and the completions the shard
returns come here to be answered (:meth:`Requests.reply_all`).
"""

from __future__ import annotations

import numpy as np

from kvstore.core import precision
from kvstore.core.groups import GroupedShardState
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key
from kvstore.core.replies import Completion
from kvstore.errors import DTypeMismatchError, ProtocolError
from kvstore.net.protocol import Message, Op
from kvstore.net.router import RouterService
from kvstore.server.meter import ServerMeter


class Batch:
    """One data request being answered: its reply goes out once every entry is done.

    The shard's tokens for it are ``(batch, i)``: entry ``i``, or ``-1`` for a key group's whole
    answer (every entry at once)."""

    __slots__ = ("identity", "seq", "values", "left", "bf16")

    def __init__(self, identity: bytes, seq: int, entries: int, bf16: bool = False) -> None:
        self.identity, self.seq, self.left, self.bf16 = identity, seq, entries, bf16
        self.values: list[np.ndarray | None] = [None] * entries

    def arrays(self) -> list[np.ndarray]:
        """The reply's arrays: none for acks, else the entries' values in one flat array."""
        if self.values[0] is None:
            return []
        if len(self.values) == 1:
            flat = self.values[0].reshape(-1)
        else:
            flat = np.concatenate([v.reshape(-1) for v in self.values])
        return [precision.narrow(flat) if self.bf16 else flat]  # bfloat16 keys: fp32 masters rounded


class Requests:
    """A server's shard, its bfloat16 keys and its optimizer, and its replies (see the module docstring)."""

    def __init__(self, service: RouterService, state: GroupedShardState, meter: ServerMeter) -> None:
        self.state = state
        self.bf16_keys: set[Key] = set()  # keys held as float32 master copies of bfloat16 values
        self.optimizer: Optimizer | None = None
        self._service, self._meter = service, meter

    def sender(self, msg: Message) -> int:
        """The worker rank ``msg`` was sent by; raises :class:`ProtocolError` when it carries none of
        this cluster's ranks."""
        if not (isinstance(msg.sender, int) and 0 <= msg.sender < self.state.num_workers):
            raise ProtocolError(f"{msg.op.name} carries no valid worker rank (got {msg.sender!r})")
        return msg.sender

    def check_precision(self, keys: list[Key], bf16: bool, op: str) -> None:
        """Refuse (DTypeMismatchError, nothing changed) a push whose values are bfloat16 for a key
        that is not, or not bfloat16 for one that is: both are float32 once widened."""
        if not bf16 and not self.bf16_keys:
            return  # the common case: no bfloat16 key at all
        odd = [k for k in keys if (k in self.bf16_keys) != bf16]
        if odd:
            held = "bfloat16" if odd[0] in self.bf16_keys else "not bfloat16"
            sent = "bfloat16" if bf16 else "non-bfloat16"
            raise DTypeMismatchError(f"{op} of {sent} values to key {odd[0]!r}, which is {held}")

    def mark_precision(self, keys: list[Key], bf16: bool) -> None:
        """Record whether newly stored ``keys`` hold bfloat16 values (as float32 master copies)."""
        if bf16:
            self.bf16_keys.update(keys)
        else:
            self.bf16_keys.difference_update(keys)

    def check_updatable(self, key: Key, dtype: np.dtype) -> None:
        """Refuse (DTypeMismatchError) a push of ``dtype`` values to ``key`` when an optimizer is set
        and they are not floating-point: it updates floating-point keys only."""
        if self.optimizer is not None and dtype.kind != "f":
            raise DTypeMismatchError(f"key {key!r} holds {dtype}; the {self.optimizer.name} optimizer "
                                     "updates floating-point keys only")

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Make ``optimizer`` the one that updates every key from now on (the shard's update hook)."""
        self.optimizer = optimizer
        self.state.updater = self._update

    def _update(self, key: Key, total: np.ndarray, stored: np.ndarray) -> np.ndarray:
        """The shard's update hook: a step of the optimizer on a copy of ``stored`` (a stored array
        may still be on its way out in a reply), returned as the new value."""
        weight = stored.copy()
        self.optimizer.update(key, weight, total)
        return weight

    def reply(self, identity: bytes, msg: Message) -> None:
        """Send ``msg`` to the peer ``identity`` (a reply never waits, see ``kvstore.net.router``)."""
        self._service.reply(identity, msg)

    def reply_all(self, done: list[Completion]) -> None:
        """Answer each :class:`Batch` whose last entry ``done`` completes: one OK with its values; a
        completion with an error (an aborted round) answers its batch with that ERROR at once, and
        the batch's other entries are then dropped."""
        for c in done:
            batch, index = c.token
            if batch.left < 0:
                continue  # answered already (an error)
            if c.error is not None:
                batch.left = -1
                self._service.reply_error(batch.identity, batch.seq, c.error)
                continue
            if index < 0:  # a key group's whole answer (kvstore.core.groups): every entry at once
                batch.values, batch.left = [c.value], 1
            else:
                batch.values[index] = c.value
            batch.left -= 1
            if batch.left == 0:
                arrays = batch.arrays()
                if arrays:
                    self._meter.replied(arrays[0].nbytes)
                self._service.reply(batch.identity, Message(Op.OK, seq=batch.seq, arrays=arrays))

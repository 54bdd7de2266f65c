"""A dist store's pushpull in two halves: sent now, its replies collected later.

The Trainer's overlap (``kvstore.overlap``) pushes each bucket of gradients from an autograd hook
and needs the result (the new weights, or the summed gradients) only in ``step``.  A PUSH then a
PULL costs two requests and two replies per message; one PUSHPULL, sent from the hook and collected
by ``step``, costs one of each, and the server answers it as soon as the key's round is applied.
:meth:`PendingCalls._pushpull_begin` checks everything and sends; the call it returns waits for
the replies and writes the outs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.base import once_each
from kvstore.client.joining import after_round
from kvstore.core.partition import Key
from kvstore.net.protocol import Op


class PendingCalls:
    """The dist store's :meth:`_pushpull_begin` (a mixin of ``DistKVStore``)."""

    def _pushpull_begin(self, keys: list[Key], values: list[Any], outs: list[Any]) -> Callable[[bool], None]:
        """Send a PUSHPULL of ``keys`` (one value and one out each) now; return ``finish(write=True)``,
        which waits for the replies and writes each key's result into its out (with ``write=False``
        only waits, raising what failed).  The caller must make that call: a failure of the pushpull
        is raised there and nowhere else.  Raises what ``pushpull`` raises for bad arguments, before
        anything is sent."""
        once_each(keys)
        store: Any = self
        groups = store._groups(keys, values)
        targets = store._outs(keys, outs, False)
        store._pushed = True
        started = store._meter.begin("pushpull")
        try:
            sent = store._send_groups(Op.PUSHPULL, groups)
        finally:
            store._meter.end("pushpull", started)

        def finish(write: bool = True) -> None:
            try:
                arrays = store._collect(*sent, targets if write else None)
                if write:
                    store._deliver(sent[0], arrays, targets, False)
            finally:
                after_round(store._cfg, store._rank, store._pushes, store._compress)  # residuals, test hook
        return finish

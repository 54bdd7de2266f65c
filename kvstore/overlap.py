"""The Trainer's overlap of communication with backward (issue 24): buckets of gradients pushed from
autograd hooks, pulled back in forward order by ``Trainer.step``.

Each trainable parameter gets a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``).
Parameters are grouped into *buckets* in reverse order (the order backward produces their gradients,
first bucket = last layers); as in DDP, a bucket is closed once it holds ``bucket_bytes`` or more, so
small parameters ride with the next large one instead of travelling alone; ``bucket_bytes=0`` gives
one bucket per parameter.  When every parameter of a
bucket has its gradient, the hook pushes the bucket as one pushpull of its keys, at the priority
:func:`bucket_priority` gives it (first layers highest: they overtake what waits of the later layers'
big values, ``kvstore.client.sendqueue``), sent now and collected
by ``step`` (``layer_calls(kv).pushpull_begin``; the store batches the small keys per server into one
message, and the server answers as soon as the round is applied: one request and one reply where a
push then a pull took two of each).  ``step`` then sends the buckets still waiting (a parameter that
got no gradient pushes zeros, with the warning of today's path), and collects every bucket's result in
forward order (first layers first): into the parameters with update_on_kvstore, into the ``.grad`` otherwise,
before the local update.  It waits only for what is still in flight.

The first step of a Trainer takes the plain path (it initialises the keys); hooks push from the second
on.  A parameter whose hook runs twice before a step (gradients accumulated over several backward
passes) makes that step take the plain path: with update_on_kvstore=False it pushes every key again
(one extra round, the same on every worker when every worker accumulates alike), which gives today's
sums; with update_on_kvstore=True the earlier push has been applied already, so the step raises
(use ``trainer.no_sync()`` around the backward passes that only accumulate).  ``no_sync()`` turns the
hooks off inside its block, as DDP's does.

Thread-safety: the hooks run on autograd's thread (for CPU tensors, the one that called backward), and
push through the store, whose calls are thread-safe (``kvstore.client.mux``: a lock guards the sockets;
the store's ``_lock`` and ``_send_lock`` guard its tables).  The hooks hold only a weak reference to
this object, and its handles are removed by :meth:`Overlap.close` or when it is garbage collected.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from kvstore.base import KVStore, layer_calls

DEFAULT_BUCKET_BYTES = 1 << 20  # 1 MiB (DDP: 25 MB, its first bucket 1 MB); see docs/trainer.md


def make_buckets(nbytes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Parameter indexes grouped into buckets in backward order (last parameter first).

    A bucket takes parameters until it holds ``bucket_bytes`` or more (DDP's rule), so a bucket
    exceeds the size by at most its last parameter; 0 gives one bucket per parameter.  Raises
    ValueError when ``bucket_bytes`` is negative.
    """
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be >= 0, got {bucket_bytes!r}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(nbytes))):
        current.append(index)
        filled += nbytes[index]
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def bucket_priority(indexes: list[int]) -> int:
    """The ``priority`` of a bucket's pushpull: minus its first parameter's index, so the first layers
    (which the next forward needs first) go first among the requests waiting to be sent (MXNet's Gluon
    Trainer gives parameter ``i`` priority ``-i`` likewise)."""
    return -min(indexes)


def _on_grad(ref: weakref.ref, index: int, param: Any) -> None:
    """The hook of parameter ``index``: tell the Overlap, if it still exists."""
    overlap = ref()
    if overlap is not None:
        overlap.ready(index)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class Overlap:
    """Pushes a Trainer's gradients bucket by bucket during backward (see the module's docstring)."""

    def __init__(self, kv: KVStore, keys: list[str], params: list[Any], update_on_kvstore: bool,
                 bucket_bytes: int) -> None:
        self._kv, self._keys, self._params = kv, keys, params
        self._calls = layer_calls(kv)  # pushpull_begin: a bucket sent now, collected by step
        self._uok = update_on_kvstore
        self.buckets = make_buckets([p.numel() * p.element_size() for p in params], bucket_bytes)
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self.priorities = [bucket_priority(b) for b in self.buckets]  # each bucket's pushpull's
        self._armed = False     # set by the first reduce: keys initialised, rescale known
        self._paused = 0        # no_sync() depth
        self._scale: float | None = None  # the rescale the servers hold for this step's pushes
        self.early = 0          # buckets pushed from the hooks, over the Trainer's life
        self._reset()
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(
            lambda param, i=i: _on_grad(ref, i, param)) for i, p in enumerate(params)]
        self._finalizer = weakref.finalize(self, _remove, self._handles)

    def _reset(self) -> None:
        self._fired = [0] * len(self._params)
        self._left = [len(b) for b in self.buckets]
        self._pushed = [False] * len(self.buckets)
        self._pending: dict[int, tuple[Callable[[bool], None], list[Any]]] = {}  # bucket -> finish, outs
        self._refired = False

    def close(self) -> None:
        """Remove every hook (idempotent), then collect what the hooks sent since the last step (its
        results are not wanted); raises the first failure among those."""
        pending, self._pending = self._pending, {}
        self._finalizer()
        self._drain(pending)

    @staticmethod
    def _drain(pending: dict[int, Any], quiet: bool = False) -> None:
        """Wait for every pushpull of ``pending`` without writing its result, so that none is left
        uncollected (its failure would be lost); raise the first failure unless ``quiet``."""
        first = None
        for finish, _ in pending.values():
            try:
                finish(False)
            except Exception as exc:  # every one is collected; the first failure is raised
                first = first or exc
        pending.clear()
        if first is not None and not quiet:
            raise first

    @property
    def hooks(self) -> int:
        """The number of hooks still installed."""
        return len(self._handles)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, backward only accumulates gradients: nothing is pushed."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def ready(self, index: int) -> None:
        """Parameter ``index`` has its gradient: push its bucket once the bucket is complete."""
        if not self._armed or self._paused:
            return
        self._fired[index] += 1
        if self._fired[index] > 1:
            self._refired = True  # accumulation: the step takes the plain path
            return
        bucket = self._bucket_of[index]
        self._left[bucket] -= 1
        if self._left[bucket] == 0 and not self._refired:
            grads = {i: self._params[i].grad for i in self.buckets[bucket]}
            self._push(bucket, grads, self._params if self._uok else grads)
            self.early += 1

    def _push(self, bucket: int, grads: Any, outs: Any) -> None:
        """Send bucket ``bucket``'s pushpull: ``grads[i]`` of each parameter index ``i`` in it, its
        result to go into ``outs[i]`` (the parameter with update_on_kvstore, else the gradient)."""
        self._pushed[bucket] = True
        indexes = self.buckets[bucket]
        targets = [outs[i] for i in indexes]
        self._pending[bucket] = (self._calls.pushpull_begin(
            [self._keys[i] for i in indexes], [grads[i] for i in indexes], targets,
            self.priorities[bucket]), targets)

    def reduce(self, grads: Any, scale: float) -> bool:
        """Finish the step's communication: push the buckets not pushed yet, pull every key in
        forward order; False when the step must take the plain path instead (the first step, or
        gradients accumulated over several backward passes with update_on_kvstore=False).

        ``grads()`` returns every gradient (zeros, and the warning, where one is None); ``scale`` is
        the rescale_grad of this step.  Raises RuntimeError (update_on_kvstore) when a gradient was
        accumulated after its push, ValueError when pushes left with another rescale_grad.
        """
        pushed, refired, pushed_scale, pending = self._pushed, self._refired, self._scale, self._pending
        pushed_any = any(pushed)
        armed, self._armed, self._scale = self._armed, True, scale
        self._reset()
        if not armed:
            return False
        refusal = self._refusal(pushed_any and self._uok, refired, scale, pushed_scale)
        if refusal is not None or refired:
            self._drain(pending)  # answered, not written: the plain path pushes every key again
            if refusal is not None:
                raise refusal
            return False
        self._finish(grads(), pushed, pending)
        return True

    @staticmethod
    def _refusal(applied: bool, refired: bool, scale: float, pushed_scale: float | None) -> Exception | None:
        """Why a step whose hooks pushed with update_on_kvstore (``applied``) cannot go on, or None."""
        if applied and refired:
            return RuntimeError("a gradient was accumulated after the hooks pushed it, and the servers have "
                                "applied that push: with update_on_kvstore and overlap, run the backward "
                                "passes that only accumulate inside trainer.no_sync()")
        if applied and scale != pushed_scale:
            return ValueError(f"this step's gradients were pushed during backward with rescale_grad "
                              f"{pushed_scale!r} (the previous step's batch size), and step asked for "
                              f"{scale!r}: "
                              "with update_on_kvstore and overlap every step needs the same batch size; "
                              "create the Trainer with overlap=False (or update_on_kvstore=False) to vary it")
        return None

    def _finish(self, values: list[Any], pushed: list[bool], pending: dict[int, Any]) -> None:
        """Send the buckets ``pushed`` marks False (last layers first), then collect every bucket's
        result in forward order (first layers first); a step whose hooks pushed nothing (no parameter
        got a gradient) is one pushpull."""
        outs = self._params if self._uok else values
        if not any(pushed):
            self._kv.pushpull(self._keys, [[v] for v in values], out=[[o] for o in outs])
        else:
            for bucket, done in enumerate(pushed):
                if not done:
                    self._push(bucket, values, outs)
            pending.update(self._pending)
            self._reset()  # _push marked them: this step's are over
            try:
                for bucket in reversed(range(len(self.buckets))):
                    finish, targets = pending.pop(bucket)
                    finish()
                    for i, target in zip(self.buckets[bucket], targets):
                        if outs[i] is not target:  # a .grad replaced since its hook: it gets the sum too
                            outs[i].copy_(target)
            finally:
                self._drain(pending, quiet=True)  # after a failure: the others are still collected
        if not self._uok:
            for p, g in zip(self._params, values):
                if p.grad is None:
                    p.grad = g

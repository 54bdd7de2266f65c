"""A worker's path for a list of keys it has pushed or pulled before: one precomputed plan per list.

A training loop pushes and pulls the same list of keys every step.  For a list of small keys
(each travels whole, in batches: ``kvstore.core.plan``) this module learns, once, everything the
generic path works out per key on every call: the keys' metas, each batch's keys, where each
pushed value goes in its batch's one array and where each pulled key lies in its reply.  A call
then checks its values (or outs) with a few C-level list comparisons, gathers each batch's values
with one ``np.concatenate`` (the copy ``push`` owes its caller), and copies each reply slice into
its out; there is no per-key Python left but that copy and the push-window bookkeeping.

Eligible: numpy keys (not tensors, not bfloat16) of one list of distinct int or str keys (or one
such key with one array: its one-key list), no gradient compression, each value one numpy array of
the key's shape and dtype (each out one writable numpy array).  Anything else, or a list not seen
yet and not eligible, takes the generic path of ``kvstore.client.store`` (which raises the usual
errors).  The plans are forgotten when keys are initialised or compression is set.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvstore.base import public
from kvstore.client.joining import die_if_asked
from kvstore.core.dtypes import BF16
from kvstore.core.plan import SMALL_BYTES, Send
from kvstore.errors import ProtocolError
from kvstore.net.protocol import Op

MAX_LISTS = 64  # the key lists remembered (the least recently used is forgotten)
_KEY_TYPES = {int, str}


class KeyList:
    """The precomputed plan of one list of keys (both directions)."""

    __slots__ = ("keys", "shapes", "dtypes", "push_sends", "push_index", "send_keys", "pull_sends",
                 "pull_dtypes", "slots", "push_dtypes", "push_slots", "flat")

    def __init__(self, keys: tuple, metas: list[Any], push: list[Send], pull: list[Send]) -> None:
        self.keys = keys
        self.shapes = [m.shape for m in metas]
        self.dtypes = [m.dtype for m in metas]
        self.flat = all(len(shape) == 1 for shape in self.shapes)
        position = {k: i for i, k in enumerate(keys)}
        self.push_sends, self.pull_sends = push, pull
        self.push_index = [[position[p.key] for p in s.parts] for s in push]
        self.send_keys = [[p.key for p in s.parts] for s in push]
        self.pull_dtypes = [self.dtypes[position[s.parts[0].key]] for s in pull]  # one dtype a batch
        self.push_dtypes = [self.dtypes[position[s.parts[0].key]] for s in push]
        self.slots, self.push_slots = _slots(pull, position), _slots(push, position)

    def takes(self, arrays: list[Any], writable: bool = False) -> bool:
        """Whether ``arrays`` are one numpy array per key, of its shape and dtype (and writable)."""
        if set(map(type, arrays)) != {np.ndarray}:
            return False
        if [a.shape for a in arrays] != self.shapes or [a.dtype for a in arrays] != self.dtypes:
            return False
        return not writable or all(a.flags.writeable for a in arrays)


def _slots(sends: list[Send], position: dict[Any, int]) -> list[tuple[int, int, int]]:
    """For each key (by ``position``): its message's index in ``sends`` and its range in the array."""
    slots: list[Any] = [None] * len(position)
    for i, send in enumerate(sends):
        offsets = send.offsets()
        for j, part in enumerate(send.parts):
            slots[position[part.key]] = (i, offsets[j], offsets[j + 1])
    return slots


def _whole_batches(sends: list[Send], sizes: dict[Any, int]) -> bool:
    """Whether every key of ``sends`` travels whole, in exactly one message."""
    seen = 0
    for send in sends:
        if send.lo is not None:
            return False
        for part in send.parts:
            if part.start != 0 or part.stop != sizes[part.key]:
                return False
            seen += 1
    return seen == len(sizes)


class FastPath:
    """The fast push and pull of known key lists for one :class:`~kvstore.client.store.DistKVStore`."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._lists: dict[tuple, KeyList | None] = {}  # None: seen, not eligible

    def forget(self) -> None:
        """Drop every plan (keys were initialised, or compression was set)."""
        self._lists.clear()

    def _find(self, keys: list) -> KeyList | None:
        if not set(map(type, keys)) <= _KEY_TYPES:
            return None  # 1 == True == 1.0: only plain ints and strs may match a plan
        name = tuple(keys)
        if name in self._lists:
            found = self._lists.pop(name)
        else:
            found = self._learn(name)
            if len(self._lists) >= MAX_LISTS:
                self._lists.pop(next(iter(self._lists)))
        self._lists[name] = found  # (re)inserted last: the most recently used
        return found

    def _learn(self, keys: tuple) -> KeyList | None:
        store = self.store
        if len(set(keys)) != len(keys) or store._compression is not None or store._device_mode:
            return None
        with store._lock:
            metas = [store._meta.get(k) for k in keys]
        if any(m is None or m.tensor or m.dtype == BF16 or m.size * m.dtype.itemsize > SMALL_BYTES
               for m in metas):
            return None  # a big key's send buffer is reused by the generic path (no page faults)
        sizes = {k: m.size for k, m in zip(keys, metas)}
        push, _ = store._plan(keys)
        pull, _ = store._plan(keys, chunked=False)
        if not (_whole_batches(push, sizes) and _whole_batches(pull, sizes)):
            return None
        return KeyList(keys, metas, push, pull)

    def _match(self, keys: Any, arrays: Any, writable: bool = False) -> tuple[KeyList | None, list]:
        """The plan of the list ``keys`` (or of one key with one array) if ``arrays`` (one per key) fit."""
        if type(keys) in _KEY_TYPES and type(arrays) is np.ndarray:
            keys, arrays = [keys], [arrays]  # one key: its one-key list's plan
        elif type(keys) is not list or not keys or type(arrays) is not list or len(arrays) != len(keys):
            return None, arrays
        plan = self._find(keys)
        return (plan if plan is not None and plan.takes(arrays, writable) else None), arrays

    def push(self, keys: Any, values: Any) -> bool:
        """Push ``values`` (one numpy array per key) of a known list; False: the generic path must."""
        plan, values = self._match(keys, values)
        return plan is not None and self._pushed(Op.PUSH, plan, values, None)

    def pushpull(self, keys: Any, values: Any, outs: Any) -> bool:
        """Pushpull ``values`` of a known list, writing the result into ``outs``; False: the generic
        path must.  Raises what the generic pushpull raises."""
        plan, values = self._match(keys, values)
        plan_out, outs = self._match(keys, outs, writable=True)
        return plan is not None and plan_out is plan and self._pushed(Op.PUSHPULL, plan, values, outs)

    def _pushed(self, op: Op, plan: KeyList, values: list[np.ndarray], outs: list[np.ndarray] | None) -> bool:
        """A PUSH of ``values`` (``outs`` None) or a PUSHPULL written into ``outs``; returns True."""
        store, name = self.store, op.name.lower()
        store._check_open()
        store._pushed = True
        started = store._meter.begin(name)
        try:
            requests = self._send(op, plan, _gathered(plan, values))
            if outs is not None:
                self._receive(plan, plan.push_sends, plan.push_dtypes, plan.push_slots, requests, outs)
        finally:
            store._meter.end(name, started)
            if outs is not None:
                die_if_asked(store._cfg, store._rank, store._pushes)  # KVSTORE_TEST_DIE_AT_ROUND
        return True

    def _send(self, op: Op, plan: KeyList, arrays: list[np.ndarray]) -> list[Any]:
        """Send ``op``'s messages of ``plan`` under the push window; return their requests."""
        store, keys = self.store, plan.keys
        window, deadline = store._window, time.monotonic() + store._cfg.request_timeout
        window.wait_room(keys, deadline, store._io.wait)  # KVSTORE_PUSH_WINDOW
        store._raise_push_failures(keys)  # a refused earlier push of these keys: nothing is sent
        pushes = store._pushes
        while True:
            with store._send_lock:
                if window.has_room(keys):
                    for key in keys:  # this call's round of each key (docs/protocol.md)
                        pushes[key] = pushes.get(key, 0) + 1
                    requests = [store._submit(op, s, a) for s, a in zip(plan.push_sends, arrays)]
                    window.add_sends(plan.send_keys, requests, failures=op is Op.PUSH)
                    return requests
            window.wait_room(keys, deadline, store._io.wait)

    def pull(self, keys: Any, outs: Any) -> bool:
        """Pull a known list into ``outs`` (one writable numpy array per key); False: the generic
        path must.  Raises what the generic pull raises (a failed earlier push, a timeout)."""
        plan, outs = self._match(keys, outs, writable=True)
        if plan is None:
            return False
        store = self.store
        store._check_open()
        started = store._meter.begin("pull")
        try:
            requests = [store._submit(Op.PULL, send, None) for send in plan.pull_sends]
            self._receive(plan, plan.pull_sends, plan.pull_dtypes, plan.slots, requests, outs)
        finally:
            store._meter.end("pull", started)
            die_if_asked(store._cfg, store._rank, store._pushes)  # KVSTORE_TEST_DIE_AT_ROUND
        return True

    def _receive(self, plan: KeyList, sends: list[Send], dtypes: list[np.dtype], slots: list[Any],
                 requests: list[Any], outs: list[np.ndarray]) -> None:
        """Wait for the replies to ``requests`` and write each key's slice into its out."""
        store = self.store
        waiting = time.perf_counter()
        try:
            replies = store._request_all(requests)
        finally:
            store._meter.blocked_for("pull", time.perf_counter() - waiting)
        store._raise_push_failures(plan.keys)
        _write(plan, slots, [_flat(s, r.arrays, d) for s, r, d in zip(sends, replies, dtypes)], outs)


class FastCalls:
    """``push``, ``pull`` and ``pushpull`` of a dist store, through its :class:`FastPath` (``_fast``)
    where it applies, else the generic calls."""

    _fast: FastPath

    @public
    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """As :meth:`kvstore.base.KVStore.push`."""
        if not self._fast.push(key, value):
            super().push(key, value, priority)  # type: ignore[misc]

    @public
    def pull(self, key: Any, out: Any = None, priority: int = 0) -> Any:
        """As :meth:`kvstore.base.KVStore.pull`."""
        if out is not None and self._fast.pull(key, out):
            return out
        return super().pull(key, out, priority)  # type: ignore[misc]

    @public
    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> Any:
        """As :meth:`kvstore.base.KVStore.pushpull`."""
        target = value if out is None else out
        if self._fast.pushpull(key, value, target):
            return target
        return super().pushpull(key, value, out, priority)  # type: ignore[misc]


def _gathered(plan: KeyList, values: list[np.ndarray]) -> list[np.ndarray]:
    """Each push message's one array: its keys' values, copied (the caller may reuse its arrays)."""
    return [np.concatenate([values[j] for j in index], axis=None) if len(index) > 1
            else values[index[0]].reshape(-1).copy() for index in plan.push_index]


def _flat(send: Send, arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The one flat array of a reply to ``send``; raises ProtocolError when it is not what was asked."""
    if len(arrays) != 1 or arrays[0].ndim != 1 or arrays[0].size != send.offsets()[-1] \
            or arrays[0].dtype != dtype:
        raise ProtocolError(f"server {send.server} answered a pull of {len(send.parts)} key(s) with "
                            f"{[(a.dtype.name, a.shape) for a in arrays]}")
    return arrays[0]


def _write(plan: KeyList, slots: list[Any], flats: list[np.ndarray], outs: list[np.ndarray]) -> None:
    """Copy each key's slice of the replies (``slots``: where it is) into its out."""
    if plan.flat:
        for out, (i, a, b) in zip(outs, slots):
            out[:] = flats[i][a:b]
        return
    for out, (i, a, b), shape in zip(outs, slots, plan.shapes):
        out[...] = flats[i][a:b].reshape(shape)

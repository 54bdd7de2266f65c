"""A worker's path for a list of keys it has pushed or pulled before: one precomputed plan per list.

A training loop pushes and pulls the same list of keys every step.  For a list of small keys
(each travels whole, in batches: ``kvstore.core.plan``) this module learns, once, everything the
generic path works out per key on every call: the keys' metas, each batch's keys, where each
pushed value goes in its batch's one array and where each pulled key lies in its reply.  A call
then checks its values (or outs) with a few C-level list comparisons, gathers each batch's values
with one ``np.concatenate`` (the copy ``push`` owes its caller), and copies each reply slice into
its out; there is no per-key Python left but that copy and the push-window bookkeeping.

Eligible: numpy keys (not tensors, not bfloat16) of one list of distinct int or str keys, no
gradient compression, each value one numpy array of the key's shape and dtype (each out one
writable numpy array).  Anything else, or a list not seen yet and not eligible, takes the
generic path of ``kvstore.client.store`` (which raises the usual errors).  The plans are
forgotten when keys are initialised or compression is set.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvstore.core.dtypes import BF16
from kvstore.core.plan import Send
from kvstore.errors import ProtocolError
from kvstore.net.protocol import Op

MAX_LISTS = 64  # the key lists remembered (the least recently used is forgotten)
_KEY_TYPES = {int, str}


class KeyList:
    """The precomputed plan of one list of keys (both directions)."""

    __slots__ = ("keys", "shapes", "dtypes", "push_sends", "push_index", "send_keys", "pull_sends",
                 "pull_dtypes", "slots", "flat")

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
        slots: list[Any] = [None] * len(keys)
        for i, send in enumerate(pull):
            offsets = send.offsets()
            for j, part in enumerate(send.parts):
                slots[position[part.key]] = (i, offsets[j], offsets[j + 1])
        self.slots = slots

    def takes(self, arrays: list[Any], writable: bool = False) -> bool:
        """Whether ``arrays`` are one numpy array per key, of its shape and dtype (and writable)."""
        if set(map(type, arrays)) != {np.ndarray}:
            return False
        if [a.shape for a in arrays] != self.shapes or [a.dtype for a in arrays] != self.dtypes:
            return False
        return not writable or all(a.flags.writeable for a in arrays)


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

    def _find(self, keys: Any) -> KeyList | None:
        if type(keys) is not list or len(keys) < 2 or not set(map(type, keys)) <= _KEY_TYPES:
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
        if any(m is None or m.tensor or m.dtype == BF16 for m in metas):
            return None
        sizes = {k: m.size for k, m in zip(keys, metas)}
        push, _ = store._plan(keys)
        pull, _ = store._plan(keys, chunked=False)
        if not (_whole_batches(push, sizes) and _whole_batches(pull, sizes)):
            return None
        return KeyList(keys, metas, push, pull)

    def push(self, keys: Any, values: Any) -> bool:
        """Push ``values`` (one numpy array per key) of a known list; False: the generic path must."""
        plan = self._find(keys) if type(values) is list and len(values) == len(keys) else None
        if plan is None or not plan.takes(values):
            return False
        store = self.store
        store._check_open()
        store._pushed = True
        started = store._meter.begin("push")
        try:
            arrays = [np.concatenate([values[j] for j in index], axis=None) if len(index) > 1
                      else values[index[0]].reshape(-1).copy() for index in plan.push_index]
            self._send(plan, arrays)
        finally:
            store._meter.end("push", started)
        return True

    def _send(self, plan: KeyList, arrays: list[np.ndarray]) -> None:
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
                    requests = [store._submit(Op.PUSH, send, array)
                                for send, array in zip(plan.push_sends, arrays)]
                    window.add_sends(plan.send_keys, requests)
                    return
            window.wait_room(keys, deadline, store._io.wait)

    def pull(self, keys: Any, outs: Any) -> bool:
        """Pull a known list into ``outs`` (one writable numpy array per key); False: the generic
        path must.  Raises what the generic pull raises (a failed earlier push, a timeout)."""
        plan = self._find(keys) if type(outs) is list and len(outs) == len(keys) else None
        if plan is None or not plan.takes(outs, writable=True):
            return False
        store = self.store
        store._check_open()
        started = store._meter.begin("pull")
        try:
            requests = [store._submit(Op.PULL, send, None) for send in plan.pull_sends]
            waiting = time.perf_counter()
            try:
                replies = store._request_all(requests)
            finally:
                store._meter.blocked_for("pull", time.perf_counter() - waiting)
            store._raise_push_failures(list(plan.keys))
            _write(plan, [_flat(send, reply.arrays, dtype) for send, reply, dtype in
                          zip(plan.pull_sends, replies, plan.pull_dtypes)], outs)
        finally:
            store._meter.end("pull", started)
        return True


def _flat(send: Send, arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The one flat array of a reply to ``send``; raises ProtocolError when it is not what was asked."""
    if len(arrays) != 1 or arrays[0].ndim != 1 or arrays[0].size != send.offsets()[-1] \
            or arrays[0].dtype != dtype:
        raise ProtocolError(f"server {send.server} answered a pull of {len(send.parts)} key(s) with "
                            f"{[(a.dtype.name, a.shape) for a in arrays]}")
    return arrays[0]


def _write(plan: KeyList, flats: list[np.ndarray], outs: list[np.ndarray]) -> None:
    """Copy each key's slice of the replies into its out."""
    if plan.flat:
        for out, (i, a, b) in zip(outs, plan.slots):
            out[:] = flats[i][a:b]
        return
    for out, (i, a, b), shape in zip(outs, plan.slots, plan.shapes):
        out[...] = flats[i][a:b].reshape(shape)

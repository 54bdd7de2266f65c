"""The worker's data path: :class:`DataPath`, the one object that holds a dist store's sockets and
what travels over them, and :class:`FastPath`, its precomputed plans for lists of keys seen before.

:class:`DataPath` owns the :class:`~kvstore.client.mux.Mux`, the push window, the plan cache, the
placements, the push buffers and the push counts (each key's rounds).  The store
(``kvstore.client.store``), the fast path, realignment (``client/realign.py``), row-sparse keys
(``client/sparse.py``) and the collective calls (``client/collective.py``) take it instead of the store.

A training loop pushes and pulls the same list of keys every step.  For a list of small keys (each
travels whole, in batches: ``kvstore.core.plan``) :class:`FastPath` learns, once, everything the
generic path works out per key on every call: the keys' metas, each batch's keys, where each pushed
value goes in its batch's one array and where each pulled key lies in its reply.  A call then checks
its values (or outs) with a few C-level list comparisons, gathers each batch's values with one
``np.concatenate`` (the copy ``push`` owes its caller), and copies each reply slice into its out;
there is no per-key Python left but that copy and the push-window bookkeeping.

Eligible: numpy keys (not tensors, not bfloat16) of one list of distinct int or str keys (or one such
key with one array: its one-key list), no gradient compression, no device mode, each value one numpy
array of the key's shape and dtype (each out one writable numpy array).  Anything else, or a list not
seen yet and not eligible, takes the generic path (which raises the usual errors).  The fast plans are
forgotten when keys are initialised, compression is set or a device mode is turned on.

**A held push** (issue 39): in ``dist_sync`` a fast push of a list whose push and pull are one and the
same message (the same keys, whole, to one server, under :data:`HOLD_BYTES`: :func:`holdable`) is
parked rather than sent (``kvstore.client.mux``: ``push`` still returns at once).  If the next call is
a fast pull of the same list, the push goes out with it as ONE ``PUSHPULL`` whose reply acknowledges
the push and answers the pull (in dist_sync a pull after a push waits for that push's round anyway,
so the pull sees what it would have seen).  Any other call sends the held push first, as it is; so
does the Mux's releaser thread when the caller's thread lets the GIL go.  A held push taken along
fails with its pull: the pull raises its error (as a pushpull's: a refused one aborts the round on
every worker); a held push sent alone fails as any push, raised by the key's next call.
``dist_async`` never holds: each push is applied on arrival, and nothing waits for it; nor does a
worker started with ``KVSTORE_HOLD_PUSH=0``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError as FutureTimeout  # the built-in from 3.11 on
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.base import Pushed
from kvstore.client import shmlanes
from kvstore.client.compress import WorkerCompression
from kvstore.client.joining import after_round
from kvstore.client.meter import WorkerMeter
from kvstore.client.mux import Mux, Request
from kvstore.client.shmlanes import Lent
from kvstore.client.window import PushWindow
from kvstore.config import Config
from kvstore.core import xp
from kvstore.core.dtypes import BF16
from kvstore.core.partition import Key, Piece, placement
from kvstore.core.plan import SMALL_BYTES, Send, init_body, pack, plan
from kvstore.core.values import Meta
from kvstore.errors import (
    CollectiveMismatchError,
    DeadlineExceededError,
    DTypeMismatchError,
    KVStoreError,
    NodeLostError,
    ProtocolError,
    ShapeMismatchError,
    from_cluster,
)
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.dist")
MAX_LISTS = 64  # the key lists remembered by the fast path (the least recently used is forgotten)
MAX_PLANS = 64  # the generic plans remembered
# A held push's values are under this many bytes: it travels in the compact layout
# (kvstore.net.compact.MAX_ARRAY_BYTES) and never in shared memory (kvstore.net.shm.MIN_BYTES).
HOLD_BYTES = 64 * 1024
_KEY_TYPES = {int, str}
REQUEST_KNOB = "KVSTORE_REQUEST_TIMEOUT"
Summer = Callable[..., Any]  # the store's sum of one key's values: (key, meta, values, out=, host=) -> array


@dataclass(frozen=True)
class ClusterView:
    """What a worker keeps of the scheduler's cluster map: its place in the cluster and the servers."""

    rank: int
    num_workers: int
    servers: tuple[str, ...]  # each server's address, by index
    seed: int  # placement's hash seed
    session: bytes  # keys a pipeline's stage-to-stage channel (kvstore.pipeline)
    chunk_bytes: int  # the cluster's chunk size (0: none)
    mode: str  # 'dist_sync' or 'dist_async'

    @classmethod
    def of(cls, body: dict[str, Any], mode: str, servers: Iterable[str]) -> ClusterView:
        """The view of a cluster map's ``body`` (``servers``: their addresses, in order)."""
        return cls(body["rank"], body["num_workers"], tuple(servers), body["seed"], body["session"],
                   body.get("chunk_bytes", 0), mode)

    @property
    def num_servers(self) -> int:
        """Number of servers in the cluster."""
        return len(self.servers)


class DataPath:
    """A worker's sockets and what travels over them (see the module docstring).

    ``metas`` and ``lock`` are the store's: the initialised keys' metas, guarded by that lock; ``summer``
    is the store's sum of one key's pushed values (numpy, or a device mode's GPU sum brought to host).
    """

    mux: Mux  # the sockets (kvstore.client.mux)
    window: PushWindow  # each key's unacknowledged pushes (KVSTORE_PUSH_WINDOW) and refused pushes
    cluster: ClusterView  # the cluster map

    def __init__(self, cfg: Config, cluster: ClusterView, mux: Mux, window: PushWindow, meter: WorkerMeter,
                 metas: dict[Key, Meta], lock: threading.RLock, compression: WorkerCompression,
                 summer: Summer) -> None:
        self.mux, self.window, self.cluster, self._cfg = mux, window, cluster, cfg
        self._meter, self._metas, self._lock = meter, metas, lock
        self._compression, self._sum = compression, summer
        self._send_lock = threading.Lock()  # one call's push-like messages leave as one run
        self._pushes: dict[Key, int] = {}  # key -> pushes sent: a PUSH's "rounds" (under _send_lock)
        self._placements: dict[Key, list[Piece]] = {}  # each key's pieces, computed once (under _lock)
        self._plans: dict[tuple, tuple[list[Send], frozenset]] = {}  # see plan (under _lock)
        self._buffers: dict[Key, tuple[np.ndarray, list[Request]]] = {}  # see _flat (under _lock)
        # after a round: residuals due with the servers' shards, KVSTORE_TEST_DIE_AT_ROUND (else nothing)
        self._round_hooks = bool(cfg.snapshot_dir) or (cfg.test_die_at_round is not None
                                                       and not cfg.incarnation)

    # -- placement and plans ------------------------------------------------------------------------
    def pieces(self, key: Key, size: int | None = None) -> list[Piece]:
        """Where ``key``'s value lives, computed once per initialised key; with ``size`` (its element
        count), where a key not initialised yet would live (nothing remembered)."""
        found = self._placements.get(key)
        if found is not None:
            return found
        found = placement(key, self._metas[key].size if size is None else size, self.cluster.num_servers,
                          self.cluster.seed, self._cfg.bigarray_bound)
        if size is None:
            with self._lock:
                self._placements[key] = found
        return found

    def plan(self, keys: Iterable[Key], chunked: bool = True) -> tuple[list[Send], frozenset]:
        """The messages for ``keys`` (initialised, distinct), and which keys travel only in batches.

        Pushes are chunked; pulls are not (``chunked=False``): a server answers a slice in one
        message, so a pull never combines chunks from before and after another worker's push.
        Planned once per list of keys (and compression setting), since a training loop pushes and
        pulls the same keys every step; the 64 plans used last are remembered.
        Raises DTypeMismatchError for a compressed key that is not float32."""
        keys = tuple(keys)
        spec = self._compression.spec
        with self._lock:
            found = self._plans.pop((keys, chunked, spec), None)
            if found is None:
                meta = self._metas
                sends = plan([(k, meta[k].dtype, self.pieces(k)) for k in keys], self._cfg.batch_bytes,
                             self.cluster.chunk_bytes, chunked,
                             self._compression.tags(keys, meta) if chunked and spec is not None else None)
                viewed = {p.key for s in sends if len(s.parts) == 1 for p in s.parts}
                found = (sends, frozenset(keys) - viewed)
                if len(self._plans) >= MAX_PLANS:
                    self._plans.pop(next(iter(self._plans)))  # the least recently used
            self._plans[(keys, chunked, spec)] = found  # (re)inserted last: the most recently used
        return found

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, op: Op, send: Send, array: np.ndarray | None, extra: dict | None = None,
               priority: int = 0, defer: bool = False, park: bool = False) -> Request:
        """Queue one data message (a batch, a whole piece or a chunk) to its server; an INIT's body is
        the init body of ``send``, a PUSH's or PUSHPULL's carries each key's round (its pushes so far),
        and so does a ROUND_ABORT's: the round the refused pushpull would have carried.  ``priority``
        orders it among the messages waiting to be sent, after every earlier one of its keys;
        ``defer``: a paced chunk, left in the outbox; ``park``: a held push (``Mux.submit``)."""
        first, more = send.parts[0].key, len(send.parts) - 1
        keys = f"key {first!r}" + (f" and {more} more" if more else "")
        what = f"{op.name.lower()} of {keys} to server {send.server} ({self.cluster.servers[send.server]})"
        body = init_body(send) if op is Op.INIT else send.body()
        if extra:
            body = {**body, **extra}  # e.g. a compressed push's "compression"
        if op is Op.PUSH or op is Op.PUSHPULL:  # each key's round: this worker's earlier pushes of it
            body = {**body, "rounds": [self._pushes[part.key] - 1 for part in send.parts]}
        elif op is Op.ROUND_ABORT:  # never sent, so not counted
            body = {**body, "rounds": [self._pushes.get(part.key, 0) for part in send.parts]}
        if array is not None:
            self._meter.sent(array.nbytes)
        msg = Message(op, body, [] if array is None else [array])
        keys = send.body()["keys"]  # computed once per planned message
        if self.mux.lanes is None:
            return self.mux.submit(send.server, msg, what, priority=priority, keys=keys, defer=defer,
                                   park=park)
        hints = shmlanes.hints(op, send, self._metas, array)  # a same-host server's shared memory
        return self.mux.submit(send.server, msg, what, priority=priority, keys=keys, defer=defer, park=park,
                               **hints)

    def wait(self, requests: list[Request], timeout: float | None = None,
             knob: str = REQUEST_KNOB) -> list[Message]:
        """The replies to ``requests``, under one deadline (default: ``KVSTORE_REQUEST_TIMEOUT``).

        Raises a request's error (a lost peer's NodeLostError also fails every other request), or
        :class:`DeadlineExceededError` naming the request and ``knob``."""
        timeout = self._cfg.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        results = []
        for request in requests:
            try:
                results.append(reply := self.mux.wait(request, max(0.0, deadline - time.monotonic())))
                if reply.arrays:
                    self._meter.received(sum(a.nbytes for a in reply.arrays))
            except KVStoreError as exc:  # first: a reply's error may be a TimeoutError too
                if isinstance(exc, NodeLostError) and exc.role is not None:
                    self.mux.fail(exc)  # the first loss fails every request, and the store's calls
                log.debug("%s failed inside kvstore", request.what, exc_info=exc)
                raise from_cluster(exc) from None  # the user's traceback: their call and the error
            except FutureTimeout:
                data = request.what.startswith(("push", "pull")) and self.cluster.mode == "dist_sync"
                hint = (" (in dist_sync a push is acknowledged, and a pull answered, only once "
                        "every worker has pushed that key)" if data else "")
                raise from_cluster(DeadlineExceededError(f"{request.what}: no reply after {timeout:g} s "
                                                         f"({knob}){hint}")) from None
        return results

    def receive(self, keys: list[Key], requests: list[Request], pushed: bool = False) -> list[Message]:
        """The replies to a pull's or (``pushed``) a pushpull's ``requests`` (the time waited counted as
        blocked); raises the failure of an earlier push of ``keys`` (after the replies are in).  A
        pushpull refused or aborted (its round, on the servers: ``ShardState.abort``) is uncounted
        first (:meth:`_uncount`): every worker's count of ``keys`` is then as if it never happened."""
        waiting = time.perf_counter()
        try:
            replies = self.wait(requests)
        except (CollectiveMismatchError, ShapeMismatchError, DTypeMismatchError):
            if pushed:
                self._uncount(keys)
            raise
        finally:
            self._meter.blocked_for("pull", time.perf_counter() - waiting)
        self._raise_failure(keys)
        return replies

    def after_round(self) -> None:
        """Once a pull or pushpull is done: the compression residuals written when due with the servers'
        shards, and the ``KVSTORE_TEST_DIE_AT_ROUND`` hook; nothing unless either was set at start."""
        if self._round_hooks:
            after_round(self._cfg, self.cluster.rank, self._pushes, self._compression)

    def _raise_failure(self, keys: Iterable[Key] | None = None) -> None:
        """Raise (once) the failure of an earlier push to one of ``keys`` (None: any key)."""
        error = self.window.take_failure(keys)
        if error is not None:
            raise from_cluster(error)

    # -- sending pushes ------------------------------------------------------------------------------
    def send(self, op: Op, groups: list[Pushed], priority: int = 0, borrow: bool = False,
             lend: bool = False) -> tuple[list[Key], list[Send], list[Request]]:
        """Sum every group (all before anything is sent), then queue the call's PUSH or PUSHPULL
        messages at ``priority`` as one run: another thread's messages cannot come between them in
        call order, so a key's chunks reach its server in order.  Chunks beyond the first
        ``Mux.pace_bytes`` of the call are paced (:func:`_paced`).  Waits for room in the push window
        first; raises the failure of an earlier push of these keys (nothing sent).  ``borrow``: the
        caller waits for the replies before it returns (a blocking pushpull), so a lone CPU value is
        sent as it is, not copied (a big key's push costs no second copy of it).  ``lend``: with
        same-host shared memory and no compression, a lone CPU value goes to the lanes as it is
        (``shmlanes.Lent``), which copy it into the segment, or aside when it goes inline, before this
        returns: one copy where a sum and the segment's took two, and the caller may change the value
        at once, as after any push.  Returns the keys, the messages and their requests."""
        todo = {k: (meta, vs) for k, meta, vs in groups}
        deadline = time.monotonic() + self._cfg.request_timeout
        self.window.wait_room(todo, deadline, self.mux.wait)  # KVSTORE_PUSH_WINDOW
        self._raise_failure(todo)  # a refused earlier push of these keys: nothing is sent
        sends, packed = self.plan(todo)
        encode = self._compression.encode if self._compression.spec is not None else None
        lend = lend and not borrow and encode is None and self.mux.lanes is not None
        flats = {k: self._flat(k, meta, vs, k in packed, borrow, lend) for k, (meta, vs) in todo.items()}
        while True:  # another thread may have filled a window meanwhile
            with self._send_lock:
                if self.window.has_room(todo):
                    for key in todo:  # this call's round of each key (docs/protocol.md)
                        self._pushes[key] = self._pushes.get(key, 0) + 1
                    paced = _paced(sends, flats, self.mux.pace_bytes)
                    requests = [self.submit(op, send, pack(send, flats), None, priority, later)
                                if encode is None else
                                self.submit(op, send, *encode(send, flats), priority=priority, defer=later)
                                for send, later in zip(sends, paced)]
                    carriers: dict[Key, list[Request]] = {}
                    for send, request in zip(sends, requests):
                        for part in send.parts:
                            carriers.setdefault(part.key, []).append(request)
                    self.window.add(carriers, failures=op is Op.PUSH)
                    break
            self.window.wait_room(todo, deadline, self.mux.wait)
        with self._lock:  # a key sent as views may reuse its buffer later (never a borrowed or lent value)
            for key, held in carriers.items():
                mine = type(flats[key]) is not Lent and not (borrow and _lone(todo[key][1]))
                if key not in packed and mine:
                    self._buffers[key] = (flats[key], held)
        return list(todo), sends, requests

    def _flat(self, key: Key, meta: Meta, values: list[Any], packed: bool,
              borrow: bool = False, lend: bool = False) -> np.ndarray:
        """One key's pushed sum as a flat numpy array that its messages may send.

        A key whose messages are all batches is copied when the batch is packed, so a single numpy
        value is used as it is; so is a lone CPU value the caller lends (``borrow``: it waits for the
        replies), or lent to the lanes (``lend``: a :class:`Lent` view, for a key not packed); any
        other sum goes into a buffer of ours: the key's buffer of its
        previous push once every message of that push has been acknowledged (the server has it, so
        zmq is done with it), which saves a fresh allocation's page faults, else a new one."""
        if packed and len(values) == 1 and type(values[0]) is np.ndarray:
            return values[0].reshape(-1)
        if (borrow or (lend and not packed)) and _lone(values):
            view = values[0] if type(values[0]) is np.ndarray else xp.numpy_view(values[0])
            if view.flags.c_contiguous and view.dtype == meta.dtype:
                return view.reshape(-1).view(Lent) if lend else view.reshape(-1)
        buffer = None
        with self._lock:
            held = self._buffers.pop(key, None)
        if held is not None and all(r.future.done() and r.future.exception() is None for r in held[1]):
            buffer = held[0].reshape(meta.shape)
        return self._sum(key, meta, values, out=buffer, host=True).reshape(-1)  # a GPU sum comes to host

    def send_planned(self, op: Op, keys: tuple, sends: list[Send], arrays: list[np.ndarray],
                     send_keys: list[list[Key]], priority: int = 0, hold: bool = False,
                     extra: dict | None = None) -> list[Request]:
        """Send a fast plan's messages (``sends[i]`` carrying ``arrays[i]``, the whole values of
        ``send_keys[i]``) at ``priority`` as one run under the push window, as :meth:`send` does;
        return their requests.  ``hold``: a PUSH of one message, held for a pull to take along
        (``FastPath.pull``; the module docstring).
        An INIT's messages (``keys`` and ``send_keys`` unused; ``extra``: fields added to each body,
        a worker set's ``workers``) leave as one run, so a key's chunks do."""
        if op is Op.INIT:
            with self._send_lock:
                return [self.submit(op, s, a, extra) for s, a in zip(sends, arrays)]
        window, deadline = self.window, time.monotonic() + self._cfg.request_timeout
        window.wait_room(keys, deadline, self.mux.wait)  # KVSTORE_PUSH_WINDOW
        self._raise_failure(keys)  # a refused earlier push of these keys: nothing is sent
        pushes = self._pushes
        while True:
            with self._send_lock:
                if window.has_room(keys):
                    for key in keys:  # this call's round of each key (docs/protocol.md)
                        pushes[key] = pushes.get(key, 0) + 1
                    requests = [self.submit(op, s, a, None, priority, park=hold)
                                for s, a in zip(sends, arrays)]
                    window.add_sends(send_keys, requests, failures=op is Op.PUSH)
                    return requests
            window.wait_room(keys, deadline, self.mux.wait)

    def _uncount(self, keys: Iterable[Key]) -> None:
        """Take back one push of each of ``keys``: a pushpull whose round was aborted on the servers
        (docs/api.md, blocking rules), so the round it carried is this worker's next one again."""
        with self._send_lock:
            for key in keys:
                if self._pushes.get(key, 0) > 0:
                    self._pushes[key] -= 1

    def hold(self, server: int) -> dict[Key, int]:
        """Hold every request to ``server`` (``Mux.hold``: a restarted server, kvstore.client.realign)
        and return a copy of the push counts taken at the same instant (no push counted but not held)."""
        with self._send_lock:
            self.mux.hold(server)
            return dict(self._pushes)


def _lone(values: list[Any]) -> bool:
    """Whether a push's values are one array in this process's memory (numpy or a CPU tensor)."""
    return len(values) == 1 and (type(values[0]) is np.ndarray
                                 or (xp.is_tensor(values[0]) and not xp.is_cuda(values[0])))


def _paced(sends: list[Send], flats: dict[Key, np.ndarray], pace: int) -> list[bool]:
    """For each of a call's messages, whether it is a chunk beyond the call's first ``pace`` bytes: it
    waits in the outbox (``Mux.submit``'s ``defer``), so a later call's message of higher priority can
    go before it; whole pieces and batches are never paced."""
    spent, paced = 0, []
    for send in sends:
        paced.append(send.lo is not None and spent >= pace)
        if send.lo is not None:
            part = send.parts[0]
            spent += (part.stop - part.start) * flats[part.key].itemsize
    return paced


def holdable(push: list[Send], pull: list[Send], nbytes: int) -> bool:
    """Whether a push of a key list planned as ``push`` may be held for a pull planned as ``pull`` to
    take along (the module docstring): one message each way, carrying the same keys whole to the same
    server, with under :data:`HOLD_BYTES` of values (``nbytes``).  The mode (dist_sync only) is the
    caller's to check."""
    return (len(push) == 1 and len(pull) == 1 and push[0].lo is None and pull[0].lo is None
            and push[0].server == pull[0].server and push[0].parts == pull[0].parts and nbytes < HOLD_BYTES)


class KeyList:
    """The precomputed plan of one list of keys (both directions); ``hold``: its push may be held for
    its pull (:func:`holdable`, dist_sync)."""

    __slots__ = ("keys", "shapes", "dtypes", "push_sends", "push_index", "send_keys", "pull_sends",
                 "pull_dtypes", "slots", "push_dtypes", "push_slots", "flat", "hold")

    def __init__(self, keys: tuple, metas: list[Meta], push: list[Send], pull: list[Send],
                 hold: bool = False) -> None:
        self.keys = keys
        self.hold = hold
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
    """The fast push and pull of known key lists over one :class:`DataPath`.

    ``metas`` and ``lock`` are the store's, ``compression`` its setting (no fast path while one is set),
    ``meter`` counts the calls; ``device_mode`` (no fast path) is the store's to set; ``hold``: pushes
    may be held for their pulls (``KVSTORE_HOLD_PUSH``; dist_sync only, the module docstring)."""

    def __init__(self, path: DataPath, metas: dict[Key, Meta], lock: threading.RLock, meter: WorkerMeter,
                 compression: WorkerCompression, device_mode: bool, hold: bool = False) -> None:
        self.path, self.metas, self.lock, self.meter = path, metas, lock, meter
        self.compression, self.device_mode = compression, device_mode
        self.hold = hold and path.cluster.mode == "dist_sync"
        self._lists: dict[tuple, KeyList | None] = {}  # None: seen, not eligible

    def forget(self) -> None:
        """Drop every plan (keys were initialised, compression was set, a device mode turned on)."""
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
        if len(set(keys)) != len(keys) or self.compression.spec is not None or self.device_mode:
            return None
        with self.lock:
            metas = [self.metas.get(k) for k in keys]
        if any(m is None or m.tensor or m.dtype == BF16 or m.size * m.dtype.itemsize > SMALL_BYTES
               for m in metas):
            return None  # a big key's send buffer is reused by the generic path (no page faults)
        sizes = {k: m.size for k, m in zip(keys, metas)}
        push, _ = self.path.plan(keys)
        pull, _ = self.path.plan(keys, chunked=False)
        if not (_whole_batches(push, sizes) and _whole_batches(pull, sizes)):
            return None
        nbytes = sum(m.size * m.dtype.itemsize for m in metas)
        hold = self.hold and holdable(push, pull, nbytes)
        return KeyList(keys, metas, push, pull, hold)

    def match(self, keys: Any, arrays: Any, writable: bool = False) -> tuple[KeyList | None, list]:
        """The plan of the list ``keys`` (or of one key with one array) if ``arrays`` (one per key) fit
        it (numpy, each of its key's shape and dtype, and ``writable``), else None; and the arrays as a
        list."""
        if type(keys) in _KEY_TYPES and type(arrays) is np.ndarray:
            keys, arrays = [keys], [arrays]  # one key: its one-key list's plan
        elif type(keys) is not list or not keys or type(arrays) is not list or len(arrays) != len(keys):
            return None, arrays
        plan = self._find(keys)
        return (plan if plan is not None and plan.takes(arrays, writable) else None), arrays

    def push(self, op: Op, plan: KeyList, values: list[np.ndarray],
             outs: list[np.ndarray] | None = None, priority: int = 0) -> None:
        """A PUSH of ``values`` (``outs`` None), or a PUSHPULL whose result is written into ``outs``, of
        a matched plan, at ``priority``.  Raises what the generic push or pushpull raises."""
        name = op.name.lower()
        started = self.meter.begin(name)
        try:
            requests = self.path.send_planned(op, plan.keys, plan.push_sends, _gathered(plan, values),
                                              plan.send_keys, priority, plan.hold and outs is None)
            if outs is not None:
                self._receive(plan, plan.push_sends, plan.push_dtypes, plan.push_slots, requests, outs, True)
        finally:
            self.meter.end(name, started)
            if outs is not None:
                self.path.after_round()  # KVSTORE_TEST_DIE_AT_ROUND

    def pull(self, plan: KeyList, outs: list[np.ndarray], priority: int = 0) -> None:
        """Pull a matched plan into ``outs`` at ``priority``, taking along the push of the same list
        held just before (:meth:`_send_held`).  Raises what the generic pull raises (a failed
        earlier push, a timeout), and the failure of a held push it took along."""
        started = self.meter.begin("pull")
        try:
            held = self._send_held(plan.pull_sends[0], priority) if plan.hold else None
            if held is not None:  # one PUSHPULL: the held push and this pull
                self._receive(plan, plan.pull_sends, plan.pull_dtypes, plan.slots, [held], outs, True)
                return
            requests = [self.path.submit(Op.PULL, send, None, None, priority) for send in plan.pull_sends]
            self._receive(plan, plan.pull_sends, plan.pull_dtypes, plan.slots, requests, outs)
        finally:
            self.meter.end("pull", started)
            self.path.after_round()  # KVSTORE_TEST_DIE_AT_ROUND

    def _send_held(self, send: Send, priority: int) -> Request | None:
        """If the push held last is of ``send``'s keys to its server (this pull is the next call), send
        it as the PUSHPULL that answers this pull too, at ``priority`` or its own if higher, and return
        its request: its failure is this pull's to raise, not remembered for the keys' next call.
        Else None (a held push of other keys has gone out first, as it is)."""
        return self.path.mux.send_parked_as(send.server, send.body()["keys"], Op.PUSHPULL, priority,
                                            self.path.window.raised_by_call)

    def _receive(self, plan: KeyList, sends: list[Send], dtypes: list[np.dtype], slots: list[Any],
                 requests: list[Request], outs: list[np.ndarray], pushed: bool = False) -> None:
        """Wait for the replies to ``requests`` (a pushpull's with ``pushed``) and write each key's
        slice into its out."""
        replies = self.path.receive(list(plan.keys), requests, pushed)
        _write(plan, slots, [_flat(s, r.arrays, d) for s, r, d in zip(sends, replies, dtypes)], outs)


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

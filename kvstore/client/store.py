"""The worker side of the ``dist_*`` modes: :class:`DistKVStore`'s data path.

The API threads validate, sum, encode and drive the sockets themselves
(``kvstore.client.mux``: whoever waits receives).  Each reply resolves a future;
every wait has a deadline.  The optimizer, state and snapshot calls are
``kvstore.client.collective``'s; the one store per process is ``kvstore.client.instance``'s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout  # the built-in from 3.11 on
from typing import Any

import numpy as np

from kvstore import config as kvconfig
from kvstore import logs
from kvstore.base import KVStore, Pushed, public
from kvstore.client import realign, shmlanes
from kvstore.client.barriers import Barriers
from kvstore.client.collective import CollectiveCalls, StoreLink
from kvstore.client.compress import WorkerCompression
from kvstore.client.datapath import FastCalls, FastPath
from kvstore.client.joining import after_round, join, rejoin
from kvstore.client.meter import WorkerMeter
from kvstore.client.mux import SCHEDULER, Mux, Request
from kvstore.client.pending import PendingCalls
from kvstore.client.sparse import DistRows, RowsLink
from kvstore.client.window import PushWindow
from kvstore.core import values as V
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key, Piece, placement
from kvstore.core.plan import Send, collect, init_body, pack, plan
from kvstore.errors import DeadlineExceededError, KVStoreError, NodeLostError, StoreClosedError, from_cluster
from kvstore.net import address, transport
from kvstore.net.auth import channel_for, new_label
from kvstore.net.heartbeat import Heartbeat
from kvstore.net.protocol import Message, Op

log = logging.getLogger("kvstore.dist")


def mode_of(name: str) -> str:
    """The cluster mode behind a dist store name: ``'dist_sync'`` or ``'dist_async'``."""
    return "dist_async" if "async" in name else "dist_sync"


class DistKVStore(FastCalls, PendingCalls, KVStore):
    """A worker's handle on the servers of a ``dist_sync`` / ``dist_async`` cluster.

    In ``dist_*_device`` modes, CUDA values are summed on a GPU and copied once into pinned memory to be
    sent; pulls into CUDA outs are staged there and copied to each device on a side stream (``device``).
    """

    def __init__(self, name: str, cfg: kvconfig.Config) -> None:
        super().__init__(name)
        cfg.require_cluster(f"kvstore.create({name!r})")
        self._cfg = cfg
        self._pid = os.getpid()
        self._mode = mode_of(name)
        scheduler = transport.connect_dealer(cfg.root_address, curve=transport.curve_keys(cfg))
        channel = channel_for(cfg, new_label("worker"))
        body = join(scheduler, channel, cfg, self._mode)
        self._rank, self._num_workers = body["rank"], body["num_workers"]
        self._seed = body["seed"]
        self._session = body["session"]  # keys a pipeline's stage-to-stage channel (kvstore.pipeline)
        self._servers = [transport.address(h, p) for h, p in body["servers"]]
        logs.set_identity("worker", self._rank)
        servers = [transport.connect_dealer(a, curve=transport.curve_keys(cfg)) for a in self._servers]
        self._io = Mux(scheduler, servers, self._rank, channel, body.get("max_message_bytes", 0),
                        names=realign.server_names(body))  # servers restarted before this worker joined
        self._io.set_lanes(shmlanes.attach(cfg, self._io, len(servers), cfg.connect_timeout))  # same host
        self._placements: dict[Key, list[Piece]] = {}  # each initialised key's pieces, computed once
        self._plans: dict[tuple, tuple[list[Send], frozenset]] = {}  # see _plan (under _lock)
        self._send_lock = threading.Lock()  # one call's push-like messages leave as one run
        self._buffers: dict[Key, tuple[np.ndarray, list[Request]]] = {}  # see _flat
        self._window = PushWindow(body.get("push_window", cfg.push_window))
        self._pushes: dict[Key, int] = {}  # key -> pushes sent: a PUSH's "rounds" (under _send_lock)
        self._chunk_bytes = body.get("chunk_bytes", 0)  # the cluster's chunk size, from the scheduler
        self._lost: NodeLostError | None = None  # set by the heartbeat thread when a peer is lost
        self._compress = WorkerCompression()  # set_gradient_compression's residuals (client/compress.py)
        self._barriers = Barriers(self._io, cfg, self._mode, self._rank, self._num_workers, self._wait)
        self._rows = DistRows(RowsLink(  # row_sparse keys (client/sparse.py)
            self._io.submit, self._request_all, self._io.wait, self._window, self._collective,
            len(self._servers), self._chunk_bytes, cfg.request_timeout,
            lambda *a: self._collective_calls.resumed_table(*a),
            lambda keys: self._collective_calls.initialised(keys)))
        self._collective_calls = CollectiveCalls(StoreLink(
            run_collective=self._collective, barrier=self.barrier, submit=self._io.submit,
            request_all=self._request_all, pieces=self._pieces, metas=self._metas,
            pull=lambda keys: self._pull(keys, 0), servers=self._servers, resume=cfg.resume,
            chunk_bytes=self._chunk_bytes,
            save_residuals=lambda d: self._compress.save(d, self._rank, self._num_workers),
            rows=self._rows, sparse_metas=lambda: dict(self._sparse.metas)))
        self._rows_init, self._rows_push, self._rows_pull = self._rows.init, self._rows.push, self._rows.pull
        self._meter = WorkerMeter(self._rank, address.advertised_host(cfg))
        self._fast = FastPath(self)  # push/pull/pushpull of known lists of small keys (FastCalls)
        self._heartbeat = Heartbeat(cfg, "worker", self._rank, body["session"], self._on_lost,  # restarted
                                    stats=self._snapshot, on_left=self._barriers.warn_left,  # servers
                                    on_restarted=realign.Realigner(self, body).on_restarted)  # realign
        self._heartbeat.start()
        log.info("joined %s cluster as worker %d of %d", self._mode, self._rank, self._num_workers)
        # a restarted worker (launch.py --max-restarts): counted again by every server from this round
        self._rejoined_at = rejoin(self._io, len(self._servers), body, self._request_all)

    @property
    def rejoined_at(self) -> int | None:
        """None in a worker's first incarnation; in a restarted one, the step to go on from: in
        dist_sync the round it rejoined at (the steps the job has done), in dist_async the pushes
        of its earlier incarnations the servers applied (its own steps); docs/failures.md."""
        return self._rejoined_at

    # -- properties -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank in ``[0, num_workers)``."""
        return self._rank

    @property
    def num_workers(self) -> int:
        """Number of workers in the cluster."""
        return self._num_workers

    @property
    def num_servers(self) -> int:
        """Number of servers in the cluster."""
        return len(self._servers)

    # -- plumbing -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise StoreClosedError(f"this store belongs to process {self._pid}; a forked child must "
                                   "not use its parent's store")
        super()._check_open()
        lost = self._lost
        if lost is not None:
            raise from_cluster(NodeLostError(str(lost), role=lost.role, rank=lost.rank, host=lost.host))

    def scheduler_request(self, op: Op, body: dict[str, Any], what: str) -> Message:
        """Send one control request to the scheduler and return its reply (kvstore.pipeline's hook);
        raises what a request raises (DeadlineExceededError after KVSTORE_REQUEST_TIMEOUT, NodeLostError)."""
        self._check_open()
        return self._request_all([self._io.submit(SCHEDULER, Message(op, body), what)])[0]

    def check_alive(self) -> None:
        """Raise the NodeLostError the heartbeat reported (or StoreClosedError); else return."""
        self._check_open()

    def _on_lost(self, error: NodeLostError) -> None:
        """The heartbeat thread's report: every waiting and later call raises ``error``."""
        self._lost = error
        self._io.fail(error)

    def _place(self, key: Key, size: int) -> list[Piece]:
        """Where a ``size``-element value of ``key`` lives in this cluster."""
        return placement(key, size, len(self._servers), self._seed, self._cfg.bigarray_bound)

    def _pieces(self, key: Key) -> list[Piece]:
        pieces = self._placements.get(key)
        return self._place(key, self._meta[key].size) if pieces is None else pieces

    def _submit(self, op: Op, send: Send, array: np.ndarray | None, extra: dict | None = None) -> Request:
        """Queue one data message (a batch, a whole piece or a chunk) to its server."""
        first, more = send.parts[0].key, len(send.parts) - 1
        keys = f"key {first!r}" + (f" and {more} more" if more else "")
        what = f"{op.name.lower()} of {keys} to server {send.server} ({self._servers[send.server]})"
        body = init_body(send) if op is Op.INIT else send.body()
        if extra:
            body = {**body, **extra}  # e.g. a compressed push's "compression"
        if op is Op.PUSH or op is Op.PUSHPULL:  # each key's round: this worker's earlier pushes of it
            body = {**body, "rounds": [self._pushes[part.key] - 1 for part in send.parts]}
        if array is not None:
            self._meter.sent(array.nbytes)
        return self._io.submit(send.server, Message(op, body, [] if array is None else [array]), what,
                               **shmlanes.hints(op, send, self._meta, array))  # same-host server

    def _wait(self, requests: list[Request], timeout: float, knob: str) -> list[Message]:
        deadline = time.monotonic() + timeout
        results = []
        for request in requests:
            try:
                results.append(reply := self._io.wait(request, max(0.0, deadline - time.monotonic())))
                if reply.arrays:
                    self._meter.received(sum(a.nbytes for a in reply.arrays))
            except KVStoreError as exc:  # first: a reply's error may be a TimeoutError too
                if isinstance(exc, NodeLostError) and exc.role is not None and self._lost is None:
                    self._on_lost(exc)
                log.debug("%s failed inside kvstore", request.what, exc_info=exc)
                raise from_cluster(exc) from None  # the user's traceback: their call and the error
            except FutureTimeout:
                data = request.what.startswith(("push", "pull"))
                hint = (" (in dist_sync a push is acknowledged, and a pull answered, only once "
                        "every worker has pushed that key)" if self._mode == "dist_sync" and data else "")
                raise from_cluster(DeadlineExceededError(f"{request.what}: no reply after {timeout:g} s "
                                                         f"({knob}){hint}")) from None
        return results

    def _raise_push_failures(self, keys: list[Key] | None = None) -> None:
        """Raise (once) the failure of an earlier push to one of ``keys`` (None: any key)."""
        error = self._window.take_failure(keys)
        if error is not None:
            raise from_cluster(error)

    def _snapshot(self) -> dict[str, Any]:
        return self._meter.snapshot(self._window.blocked_seconds)

    @public
    def stats(self, cluster: bool = False) -> dict[str, Any]:
        """This worker's counters (docs/observability.md, schema 1); with ``cluster``, the scheduler's
        STATUS reply: every node's latest snapshot.  Raises what a request raises."""
        self._check_open()
        if not cluster:
            return self._snapshot()
        request = self._io.submit(SCHEDULER, Message(Op.STATUS, {}), "status request to the scheduler")
        return self._request_all([request])[0].body

    # -- primitives -------------------------------------------------------------------------------
    def _request_all(self, requests: list[Request]) -> list[Message]:
        return self._wait(requests, self._cfg.request_timeout, "KVSTORE_REQUEST_TIMEOUT")

    def _metas(self) -> dict[Key, V.Meta]:
        """A copy of the initialised keys' metas."""
        with self._lock:
            return dict(self._meta)

    def _collective(self, what: str, action: Any) -> None:
        self._barriers.collective(what, action)

    def _barrier_only(self, failure: dict[str, str] | None = None) -> list:
        return self._barriers.join(failure).get("failures", [])

    # -- the collective calls on the servers' optimizer and state (kvstore.client.collective) ------
    def _set_optimizer(self, optimizer: Optimizer) -> None:
        if self._rejoined_at is None:  # a restarted worker: the servers have it (and its state)
            self._collective_calls.set_optimizer(optimizer)

    def _set_optimizer_params(self, params: dict[str, Any]) -> None:
        self._collective_calls.set_optimizer_params(params)

    @public
    def get_optimizer(self) -> Optimizer | None:
        """A copy of the servers' optimizer (spec, and the highest update count of any server), or None."""
        self._check_open()
        return self._collective_calls.get_optimizer()

    def _save_states(self, fname: str, dump_optimizer: bool) -> None:
        self._collective_calls.save_states(fname, dump_optimizer)

    def _load_states(self, fname: str) -> None:
        self._collective_calls.load_states(fname)

    def _save_checkpoint(self, directory: str) -> None:
        self._collective_calls.save_checkpoint(directory)

    def _set_compression(self, params: Any) -> None:
        """Collective: every worker checks ``params`` (and that it has not pushed) before any installs."""
        checked: list = []
        if self._rejoined_at is not None:  # a restarted worker: the others agreed long ago
            checked.append(self._check_compression(params))
        else:
            self._barriers.agree("set_gradient_compression",
                                 lambda: checked.append(self._check_compression(params)))
        with self._lock:
            self._compression = self._compress.spec = checked[0]
            self._plans.clear()  # push plans group compressed keys apart
            self._fast.forget()
        # saved residuals: a restarted worker's own (KVSTORE_SNAPSHOT_DIR), else KVSTORE_RESUME's
        self._compress.restore(self._cfg, self._rank, self._num_workers, self._rejoined_at is not None)

    # -- the data path ------------------------------------------------------------------------------
    def _init(self, items: list[tuple[Key, np.ndarray]]) -> None:
        def send_all() -> None:
            flats = {key: array.reshape(-1) for key, array in self._collective_calls.resumed(items)}
            entries = [(key, flat.dtype, self._place(key, flat.size)) for key, flat in flats.items()]
            sends = plan(entries, self._cfg.batch_bytes, self._chunk_bytes)  # big slices in chunks
            with self._send_lock:  # a key's chunks leave as one run
                requests = [self._submit(Op.INIT, s, pack(s, flats)) for s in sends]
            self._request_all(requests)

        if self._rejoined_at is not None:  # a restarted worker: the servers hold every key already
            return
        started = self._meter.begin("init")
        try:
            self._collective(f"init of {len(items)} key(s)", send_all)
        finally:
            self._meter.end("init", started)

    def _initialised(self, keys: list[Key]) -> None:
        with self._lock:
            for key in keys:
                self._placements[key] = self._place(key, self._meta[key].size)
        self._fast.forget()  # a list that held an unknown key may be eligible now
        self._collective_calls.initialised(keys)

    def _plan(self, keys: Any, chunked: bool = True) -> tuple[list[Send], frozenset]:
        """The messages for ``keys`` (initialised, distinct), and which keys travel only in batches.

        Pushes are chunked; pulls are not (``chunked=False``): a server answers a slice in one
        message, so a pull never combines chunks from before and after another worker's push.
        Planned once per list of keys, since a training loop pushes and pulls the same keys every
        step; the 64 plans used last are remembered."""
        keys = tuple(keys)
        with self._lock:
            found = self._plans.pop((keys, chunked), None)
            if found is None:
                meta = self._meta
                sends = plan([(k, meta[k].dtype, self._pieces(k)) for k in keys], self._cfg.batch_bytes,
                             self._chunk_bytes, chunked, self._compress.tags(keys, meta) if chunked else None)
                viewed = {p.key for s in sends if len(s.parts) == 1 for p in s.parts}
                found = (sends, frozenset(keys) - viewed)
                if len(self._plans) >= 64:
                    self._plans.pop(next(iter(self._plans)))  # the least recently used
            self._plans[(keys, chunked)] = found  # (re)inserted last: the most recently used
        return found

    def _push(self, groups: list[Pushed], priority: int) -> None:
        started = self._meter.begin("push")  # priority is accepted for MXNet scripts; sends keep call order
        try:
            self._send_groups(Op.PUSH, groups)
        finally:
            self._meter.end("push", started)

    def _send_groups(self, op: Op, groups: list[Pushed]) -> tuple[list[Key], list[Send], list[Request]]:
        """Sum every group (all before anything is sent), then send the call's PUSH or PUSHPULL
        messages as one run: another thread's messages cannot come between them, so a key's chunks
        reach its server in order.  Returns the keys, the messages and their requests."""
        todo = {k: (meta, vs) for k, meta, vs in groups}
        deadline = time.monotonic() + self._cfg.request_timeout
        self._window.wait_room(todo, deadline, self._io.wait)  # KVSTORE_PUSH_WINDOW
        self._raise_push_failures(list(todo))  # a refused earlier push of these keys: nothing is sent
        sends, packed = self._plan(todo)
        flats = {k: self._flat(k, meta, vs, k in packed) for k, (meta, vs) in todo.items()}
        while True:  # another thread may have filled a window meanwhile
            with self._send_lock:
                if self._window.has_room(todo):
                    for key in todo:  # this call's round of each key (docs/protocol.md)
                        self._pushes[key] = self._pushes.get(key, 0) + 1
                    requests = [self._submit(op, send, *self._compress.encode(send, flats)) for send in sends]
                    carriers: dict[Key, list[Request]] = {}
                    for send, request in zip(sends, requests):
                        for part in send.parts:
                            carriers.setdefault(part.key, []).append(request)
                    self._window.add(carriers, failures=op is Op.PUSH)
                    break
            self._window.wait_room(todo, deadline, self._io.wait)
        with self._lock:  # a key sent as views may reuse its buffer later
            for key, held in carriers.items():
                if key not in packed:
                    self._buffers[key] = (flats[key], held)
        return list(todo), sends, requests

    def _flat(self, key: Key, meta: Any, values: list[Any], packed: bool) -> np.ndarray:
        """One key's pushed sum as a flat numpy array that its messages may send.

        A key whose messages are all batches is copied when the batch is packed, so a single numpy
        value is used as it is; any other sum goes into a buffer of ours: the key's buffer of its
        previous push once every message of that push has been acknowledged (the server has it, so
        zmq is done with it), which saves a fresh allocation's page faults, else a new one."""
        if packed and len(values) == 1 and type(values[0]) is np.ndarray:
            return values[0].reshape(-1)
        buffer = None
        with self._lock:
            held = self._buffers.pop(key, None)
        if held is not None and all(r.future.done() and r.future.exception() is None for r in held[1]):
            buffer = held[0].reshape(meta.shape)
        return self._sum(key, meta, values, out=buffer, host=True).reshape(-1)  # a GPU sum comes to host

    def _collect(self, keys: list[Key], sends: list[Send], requests: list[Request],
                 outs: list[list[Any]] | None = None) -> list[np.ndarray | None]:
        """Wait for the replies to ``sends`` and assemble each key's value from its parts
        (``plan.collect``): a key whose out is one C-contiguous numpy array gets None, its out written.
        """
        waiting = time.perf_counter()
        try:
            replies = self._wait(requests, self._cfg.request_timeout, "KVSTORE_REQUEST_TIMEOUT")
        finally:
            self._meter.blocked_for("pull", time.perf_counter() - waiting)
        self._raise_push_failures(keys)
        targets = None if outs is None else [o[0] if len(o) == 1 else None for o in outs]
        return collect(keys, [self._meta[k] for k in keys], sends, [r.arrays for r in replies], targets)

    def _pull(self, keys: list[Key], priority: int, outs: list[list[Any]] | None = None) -> list[Any]:
        started = self._meter.begin("pull")
        try:
            return self._pull_keys(keys, outs)
        finally:
            self._meter.end("pull", started)
            after_round(self._cfg, self._rank, self._pushes, self._compress)  # residuals, test hook

    def _pull_keys(self, keys: list[Key], outs: list[list[Any]] | None = None) -> list[Any]:
        unique = list(dict.fromkeys(keys))  # a message names each key once
        if len(unique) != len(keys):
            found = dict(zip(unique, self._pull_keys(unique)))
            return [found[k] for k in keys]
        sends, _ = self._plan(keys, chunked=False)
        return self._collect(keys, sends, [self._submit(Op.PULL, s, None) for s in sends], outs)

    def _pushpull(self, groups: list[Pushed], priority: int,
                  outs: list[list[Any]] | None = None) -> list[Any]:
        started = self._meter.begin("pushpull")
        try:
            return self._collect(*self._send_groups(Op.PUSHPULL, groups), outs)
        finally:
            self._meter.end("pushpull", started)
            after_round(self._cfg, self._rank, self._pushes, self._compress)  # residuals, test hook

    def _flush(self, timeout: float, knob: str) -> None:
        requests = self._window.outstanding()
        deadline = time.monotonic() + timeout
        for request in requests:  # every one: a failure must not end the wait for the others
            try:
                self._wait([request], max(0.0, deadline - time.monotonic()), knob)
            except DeadlineExceededError:
                raise
            except KVStoreError:
                pass  # raised below, with the key it belongs to
        self._raise_push_failures()

    @public
    def barrier(self) -> None:
        """Wait until this worker's pushes are applied, then until every worker reaches the barrier.

        Raises the failure of an earlier push (after joining the barrier, so the other
        workers are not left waiting), or :class:`DeadlineExceededError`.
        """
        self._check_open()
        started = self._meter.begin("barrier")
        try:
            self._barrier_after_pushes()
        finally:
            self._meter.end("barrier", started, blocked="barrier")

    def _barrier_after_pushes(self) -> None:
        error: KVStoreError | None = None
        try:
            self._flush(self._cfg.request_timeout, "KVSTORE_REQUEST_TIMEOUT")
        except DeadlineExceededError:
            raise
        except KVStoreError as exc:
            error = exc
        self._barrier_only()
        if error is not None:
            raise error

    @public
    def close(self) -> None:
        """Tell every server, then the scheduler, that this worker is done; close the sockets.

        The servers hear it after this worker's pushes, so each push is applied or counted in
        its sync round; from then on this worker no longer counts toward barriers and dist_sync
        rounds, so the others can finish epochs with more batches.  Idempotent.  Raises the
        failure of a push a server refused, if any, after closing.
        """
        self._close(None)

    def _leave_servers(self, timeout: float) -> KVStoreError | None:
        """Send LEAVE to every server after this worker's pushes, on the same connections, and wait
        for the replies: then every push has been taken in (applied, or waiting in a sync round that
        no longer waits for this worker).  Returns the failure of a push the servers refused."""
        try:
            if self._lost is None:  # after a loss the cluster is broken: nothing waits for us
                self._wait([self._io.submit(i, Message(Op.LEAVE), f"leave message to server {i}")
                            for i in range(len(self._servers))], timeout, "KVSTORE_SHUTDOWN_TIMEOUT")
            self._raise_push_failures()  # replies come in order: a refused push has failed by now
        except KVStoreError as exc:
            return exc
        return None

    def _close(self, failure: str | None) -> None:
        """close(); with ``failure`` (the process is dying of it) nothing is drained, and the
        scheduler is told this worker failed, so every other worker raises NodeLostError."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        error: BaseException | None = None
        timeout = self._cfg.shutdown_timeout
        if failure is None:
            error = self._leave_servers(timeout)
        self._heartbeat.stop()  # the last beat before LEAVE: after the last LEAVE no scheduler answers it
        self._heartbeat.join(timeout)
        if self._lost is None or self._lost.role != "scheduler":
            body = {} if failure is None else {"failure": failure}
            try:  # after a lost peer too: the scheduler counts this worker out and can finish
                leave = self._io.submit(SCHEDULER, Message(Op.LEAVE, body), "leave message to the scheduler",
                                        after_failure=True)
                self._wait([leave], timeout, "KVSTORE_SHUTDOWN_TIMEOUT")
            except KVStoreError as exc:
                log.warning("%s", exc)
        self._io.stop(timeout)
        if error is not None:
            raise error

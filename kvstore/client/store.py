"""The worker side of the ``dist_*`` modes: :class:`DistKVStore`.

The API threads validate, sum, encode and drive the sockets themselves, through the store's one
:class:`~kvstore.client.datapath.DataPath` (``kvstore.client.mux``: whoever waits receives).  Each reply
resolves a future; every wait has a deadline.  The optimizer, state and snapshot calls are
``kvstore.client.collective``'s; the one store per process is ``kvstore.client.instance``'s.

A store joins its cluster over real sockets (:func:`connect`); :class:`Joined` is the seam a unit test
uses to build one over a fake transport instead (no processes, no sockets).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore import config as kvconfig
from kvstore import logs
from kvstore.base import KVStore, Pushed, known_key, once_each
from kvstore.client import realign, shmlanes, unixlinks
from kvstore.client.barriers import Barriers
from kvstore.client.collective import CollectiveCalls, StoreLink
from kvstore.client.compress import WorkerCompression
from kvstore.client.datapath import ClusterView, DataPath, FastPath
from kvstore.client.joining import Rejoin, WorkerRebind, join, rejoin
from kvstore.client.meter import WorkerMeter
from kvstore.client.mux import SCHEDULER, Mux, Request, Tamper
from kvstore.client.sparse import DistRows, RowsLink
from kvstore.client.window import PushWindow
from kvstore.core import agreement, xp
from kvstore.core import values as V
from kvstore.core.membership import Membership, check_tag, view_of
from kvstore.core.optimizer import Optimizer
from kvstore.core.partition import Key
from kvstore.core.plan import Send, collect, pack, plan
from kvstore.core.worker_sets import WorkerSet
from kvstore.errors import (
    DeadlineExceededError,
    DTypeMismatchError,
    KVStoreError,
    NodeLostError,
    ShapeMismatchError,
    StoreClosedError,
    from_cluster,
    public,
)
from kvstore.net import address, transport
from kvstore.net.auth import Channel, channel_for, derive_key, new_label
from kvstore.net.heartbeat import Heartbeat
from kvstore.net.links import ServerLinks
from kvstore.net.protocol import Message, Op
from kvstore.sparse import SparseCalls

log = logging.getLogger("kvstore.dist")
_FORKS = [0]  # forks this process is removed from its first ancestor: a store works in its own process only
os.register_at_fork(after_in_child=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


def mode_of(name: str) -> str:
    """The cluster mode behind a dist store name: ``'dist_sync'`` or ``'dist_async'``."""
    return "dist_async" if "async" in name else "dist_sync"


@dataclass(frozen=True)
class StageAccess:
    """A pipeline stage's part of its worker's store (:meth:`DistKVStore.stage_access`): the worker's
    settings, its stage socket's channel, and ``request(op, body, what)``, one control request to the
    scheduler answered or raised (DeadlineExceededError, NodeLostError)."""

    cfg: kvconfig.Config
    channel: Channel
    request: Callable[[Op, dict[str, Any], str], Message]


@dataclass
class Joined:
    """A worker already in its cluster: the cluster map's body, the servers' addresses (by index) and the
    :class:`Mux` over its sockets.  :func:`connect` makes one over real sockets; a unit test makes one
    over a fake transport (a ``Mux`` of its own), with ``heartbeat`` False (no heartbeat thread, no shared
    memory offered)."""

    body: dict[str, Any]
    servers: list[str]
    mux: Mux
    heartbeat: bool = True


def connect(cfg: kvconfig.Config, mode: str, tamper: Tamper | None = None) -> Joined:
    """Register with the scheduler as a worker of ``mode`` and connect to every server (the store offers
    same-host servers shared memory once its heartbeat beats).  ``tamper``: tests only, see
    ``kvstore.client.mux``.
    Raises what registration raises (ConfigError, AuthenticationError, DeadlineExceededError...)."""
    scheduler = transport.connect_dealer(cfg.root_address, curve=transport.curve_keys(cfg))
    channel = channel_for(cfg, new_label("worker"))
    body = join(scheduler, channel, cfg, mode)
    addresses = [transport.address(h, p) for h, p in body["servers"]]
    logs.set_identity("worker", body["rank"])
    servers = [transport.connect_dealer(a, curve=transport.curve_keys(cfg)) for a in addresses]
    mux = Mux(scheduler, servers, body["rank"], channel, body.get("max_message_bytes", 0),
              names=realign.server_names(body), tamper=tamper)  # servers restarted before this worker joined
    return Joined(body, addresses, mux)


def joined_view(body: dict[str, Any], slots: int) -> Membership:
    """A worker's first membership view from its cluster ``body``: a joined or restarted worker's map
    carries the job's last tagged view; any other map, the slots absent at the start."""
    last = body.get("view")
    if isinstance(last, dict):
        return view_of(last, slots, 0)
    return view_of({"absent": body.get("absent") or []}, slots, int(body.get("barriers", 0)))


class Owner:
    """The hold ``kvstore.client.instance`` keeps on the process's one store: what it may do beyond the
    public API, bound by the store it is given to: ``close(failure)`` (the process is dying of
    ``failure``: nothing is drained, the scheduler is told this worker failed) and ``device_on()``
    (a ``*_device`` name asked for: GPU sums from now on)."""

    close: Callable[[str | None], None]
    device_on: Callable[[], None]


class DistKVStore(KVStore):
    """A worker's handle on the servers of a ``dist_sync`` / ``dist_async`` cluster.

    In ``dist_*_device`` modes, CUDA values are summed on a GPU and copied once into pinned memory to be
    sent; pulls into CUDA outs are staged there and copied to each device on a side stream (``device``).
    ``joined``: a cluster already joined (the fake-transport seam of unit tests); by default the store
    joins over real sockets.  ``owner``: bound for ``kvstore.client.instance``.
    """

    def __init__(self, name: str, cfg: kvconfig.Config, joined: Joined | None = None,
                 owner: Owner | None = None) -> None:
        super().__init__(name)
        cfg.require_cluster(f"kvstore.create({name!r})")
        self._cfg = cfg
        self._pid, self._forks = os.getpid(), _FORKS[0]
        self._mode = mode_of(name)
        joined = connect(cfg, self._mode) if joined is None else joined
        body, self._io = joined.body, joined.mux
        self._cluster = cluster = ClusterView.of(body, self._mode, joined.servers)
        self._session = cluster.session  # keys a pipeline's stage-to-stage channel (kvstore.pipeline)
        self._compress = WorkerCompression()  # set_gradient_compression's residuals (client/compress.py)
        self._meter = WorkerMeter(cluster.rank, address.advertised_host(cfg))
        self._window = PushWindow(body.get("push_window", cfg.push_window))
        self._path = DataPath(cfg, cluster, self._io, self._window, self._meter, self._meta, self._lock,
                              self._compress, self._sum)
        self._fast = FastPath(self._path, self._meta, self._lock, self._meter,  # known lists of small keys
                              self._compress, self._device_mode, cfg.hold_push)
        self._barriers = Barriers(self._io, cfg, self._mode, cluster.rank, cluster.num_workers,
                                  self._path.wait, self._meter.pushes, passed=body.get("barriers", 0),
                                  absent=body.get("absent"), view=joined_view(body, cluster.num_workers),
                                  tagged=body.get("view") if isinstance(body.get("view"), dict) else None)
        self._rows = DistRows(RowsLink(  # row_sparse keys (client/sparse.py)
            self._path, self._collective, cfg.request_timeout,
            lambda *a: self._collective_calls.resumed_table(*a),
            lambda keys: self._collective_calls.initialised(keys), self._meter.sent,
            lambda: self._compression, residuals=self._compress.rows))
        self._sparse = SparseCalls(self._meta, self._rows.init, self._rows.push, self._rows.pull)
        self._collective_calls = CollectiveCalls(StoreLink(
            run_collective=self._collective, barrier=self.barrier, submit=self._io.submit,
            request_all=self._path.wait, pieces=self._path.pieces, metas=self._metas,
            pull=lambda keys: self._pull(keys, 0), servers=cluster.servers, resume=cfg.resume,
            chunk_bytes=cluster.chunk_bytes,
            save_residuals=lambda d: self._compress.save(d, cluster.rank, cluster.num_workers),
            rows=self._rows, sparse_metas=lambda: dict(self._sparse.metas)))
        self._heartbeat: Heartbeat | None = None
        self._rejoin = Rejoin(bool(body.get("rejoin")))  # a restarted worker: rejoined below
        self._at_start = False  # a joiner that came in at the job's first view (await_view)
        if joined.heartbeat:  # restarted servers: realign
            links = ServerLinks(cluster.servers, cfg.heartbeat_interval, cfg.heartbeat_timeout,
                                transport.curve_keys(cfg))  # partitions from a server (net/links.py)
            aligner = realign.Realigner(self._path, cfg, body, self._rejoin, moved=links.moved,
                                        hold=self._rows.hold)
            self._heartbeat = Heartbeat(cfg, "worker", cluster.rank, cluster.session, self._io.fail,
                                        stats=self._beat, on_left=self._barriers.warn_left,
                                        on_restarted=aligner.on_restarted,
                                        rebinder=WorkerRebind(self._io, cfg, body, self._mode,
                                                              lambda: self._barriers.passed,
                                                              lambda: self._barriers.left,
                                                              lambda: self._barriers.tagged),
                                        links=links)
            self._heartbeat.start()
            self._io.heartbeat_thread = self._heartbeat.ident  # it never waits on a server's link
            # after the first beat's thread is up: an offer to a server that died meanwhile waits for
            # the heartbeat to name its restart (the offer is sent again to it) or its loss
            linked = unixlinks.attach(cfg, self._io, cluster.num_servers, cfg.connect_timeout)
            lanes = shmlanes.attach(cfg, self._io, cluster.num_servers, cfg.connect_timeout)
            self._io.set_lanes(lanes)
            unixlinks.keep_with_segments(self._io, linked, lanes.segments if lanes is not None else ())
        if owner is not None:
            owner.close, owner.device_on = self._close, self._device_on
        log.info("joined %s cluster as worker %d of %d", self._mode, cluster.rank, cluster.num_workers)
        # a restarted worker (launch.py --max-restarts): counted again by every server from this round
        rejoin(self._io, cluster.num_servers, body, self._path.wait, self._rejoin)
        if self._rejoin.at is not None:  # its tables' push counts start at that round, as the servers'
            self._rows.rejoined(self._rejoin.at)

    @property
    def rejoined_at(self) -> int | None:
        """None in a worker's first incarnation; in a restarted one, the step to go on from: in
        dist_sync the round it rejoined at (the steps the job has done), in dist_async the pushes
        of its earlier incarnations the servers applied (its own steps); docs/failures.md.  In a
        worker that joined an elastic job: in dist_sync the same, in dist_async the job's update
        count (the most pushes applied to one key, every worker's together); docs/elastic.md."""
        return self._rejoin.step

    # -- properties -----------------------------------------------------------------------------
    @property
    def cluster_id(self) -> str:
        """An id of this cluster's run (the same on every worker, another after a relaunch): a hash of
        its session, which it does not reveal."""
        return hashlib.sha256(b"kvstore cluster id\0" + self._cluster.session).hexdigest()[:16]

    @property
    def rank(self) -> int:
        """This worker's rank in ``[0, num_workers)``."""
        return self._cluster.rank

    @property
    def num_workers(self) -> int:
        """Number of workers in the cluster."""
        return self._cluster.num_workers

    @property
    def num_servers(self) -> int:
        """Number of servers in the cluster."""
        return self._cluster.num_servers

    @property
    def view(self) -> Membership:
        """The membership the last barrier this worker passed agreed (no request): before any, the
        map's (a worker that joined or restarted: the job's last tagged view, with its tag)."""
        return self._barriers.view

    @public
    def membership(self, tag: Sequence[int] = ()) -> Membership:
        """Collective, a barrier after this worker's pushes are applied: the workers present when it
        is released, the same view (number, ranks) on every worker it releases; ``tag`` (at most 8
        ints, e.g. an epoch and a step) is kept by the scheduler as the job's last view's, which a
        worker that joins or restarts later reads in :attr:`view`.  Raises TypeError / ValueError for a
        bad tag, what :meth:`barrier` raises, TooFewWorkersError when fewer workers than ``launch.py
        --min-workers`` are present, DeadlineExceededError when the reply was given up on."""
        ints = check_tag(tag)
        self._check_open()
        started = self._meter.begin("barrier")
        try:
            self._barrier_after_pushes(ints)
        finally:
            self._meter.end("barrier", started, blocked="barrier")
        return self._barriers.view

    @public
    def await_view(self, timeout: float | None = None) -> Membership:
        """For a worker that joined an elastic job before the job agreed a tagged membership view (a
        split Session's first epoch, docs/elastic.md): meet the others' barriers, each as no call of
        its own (it pairs with their plain barriers, collectives and views alike), until one agrees a
        tagged view, and return it (:attr:`view` from then on); at once when :attr:`view` is tagged.
        ``timeout``: seconds, KVSTORE_CONNECT_TIMEOUT by default (a barrier asked before it ends may
        take up to KVSTORE_REQUEST_TIMEOUT more).  Raises DeadlineExceededError naming what it
        waited for, and what a barrier raises (NodeLostError, TooFewWorkersError...)."""
        self._check_open()
        budget = self._cfg.connect_timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + budget
        while not self._barriers.view.tag:
            if time.monotonic() >= deadline:
                raise DeadlineExceededError(
                    f"worker {self.rank} joined before the job's first tagged membership view and waited "
                    f"{budget:g} s (KVSTORE_CONNECT_TIMEOUT) for the others to store the weights and agree "
                    f"it; none came (the last barrier passed: {self._barriers.passed}): do the others run "
                    "a split Session (kvstore.Session.run(split=True))?")
            try:
                reply = self._barriers.join(follow=True)
            except DeadlineExceededError:
                continue  # withdrawn from it, nothing passed: ask again while the deadline allows
            if not reply:
                raise DeadlineExceededError("a barrier this worker followed was released but its reply was "
                                            "given up on (KVSTORE_REQUEST_TIMEOUT): whether it agreed the "
                                            "view is unknown")
        if self._rejoin.step == 0:  # nothing applied when it joined (dist_async: the job's count)
            self._at_start = True
        return self._barriers.view

    @property
    def joined_at_start(self) -> bool:
        """Whether this worker joined before the job's first step and came in at its first view
        (:meth:`await_view`, no round opened yet): it takes part in the first step's collectives (the
        Trainer's rescale_grad agreement) with the others, unlike a worker that joins a running job."""
        return self._at_start

    # -- plumbing -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if _FORKS[0] != self._forks:  # a forked child (no getpid() syscall on every call)
            raise StoreClosedError(f"this store belongs to process {self._pid}; a forked child must "
                                   "not use its parent's store")
        super()._check_open()
        lost = self._io.failure
        if isinstance(lost, NodeLostError):
            raise from_cluster(NodeLostError(str(lost), role=lost.role, rank=lost.rank, host=lost.host))

    def _device_on(self) -> None:
        """GPU sums from now on (``Owner.device_on``); known key lists leave the fast path."""
        self._device_mode = self._fast.device_mode = True
        self._fast.forget()

    def stage_access(self, label: str) -> StageAccess:
        """What a pipeline stage (kvstore.pipeline.link) takes from this worker: its settings, a channel
        ``label`` sealed with the cluster's session, and control requests to the scheduler."""
        self._check_open()
        cfg = self._cfg
        channel = Channel(derive_key(cfg.secret), label, full=cfg.auth_full, session=self._session)
        return StageAccess(cfg, channel, self._scheduler_request)

    def _scheduler_request(self, op: Op, body: dict[str, Any], what: str) -> Message:
        """Send one control request to the scheduler and return its reply; raises what a request raises
        (DeadlineExceededError after KVSTORE_REQUEST_TIMEOUT, NodeLostError)."""
        self._check_open()
        return self._path.wait([self._io.submit(SCHEDULER, Message(op, body), what)])[0]

    def check_alive(self) -> None:
        """Raise the NodeLostError the heartbeat reported (or StoreClosedError); else return."""
        self._check_open()

    def _raise_push_failures(self) -> None:
        """Raise (once) the failure of an earlier push to any key."""
        error = self._window.take_failure()
        if error is not None:
            raise from_cluster(error)

    def _snapshot(self) -> dict[str, Any]:
        return self._meter.snapshot(self._window.blocked_seconds)

    def _beat(self) -> dict[str, Any]:
        """Each heartbeat's snapshot; first the outbox's paced chunks are sent if no call has sent
        anything since the last beat (``Mux.nudge``), so none waits more than two beats."""
        self._io.nudge()
        return self._snapshot()

    @public
    def stats(self, cluster: bool = False) -> dict[str, Any]:
        """This worker's counters (docs/observability.md, schema 1); with ``cluster``, the scheduler's
        STATUS reply: every node's latest snapshot.  Raises what a request raises."""
        self._check_open()
        if not cluster:
            return self._snapshot()
        request = self._io.submit(SCHEDULER, Message(Op.STATUS, {}), "status request to the scheduler")
        return self._path.wait([request])[0].body

    # -- primitives -------------------------------------------------------------------------------
    def _metas(self) -> dict[Key, V.Meta]:
        """A copy of the initialised keys' metas."""
        with self._lock:
            return dict(self._meta)

    def _collective(self, what: str, action: Callable[[], Any]) -> None:
        self._barriers.collective(what, action)

    def _agree(self, what: str, digest: str) -> None:
        self._check_open()
        self._barriers.exchange(what, digest)

    def _barrier_only(self, failure: dict[str, str] | None = None) -> list:
        return self._barriers.join(failure).get("failures", [])

    # -- the collective calls on the servers' optimizer and state (kvstore.client.collective) ------
    def _set_optimizer(self, optimizer: Optimizer) -> None:
        if self._rejoin.at is None:  # a restarted worker: the servers have it (and its state)
            self._collective_calls.set_optimizer(optimizer)

    def _set_optimizer_params(self, params: dict[str, Any]) -> None:
        self._collective_calls.set_optimizer_params(params)

    @public
    def get_optimizer(self) -> Optimizer | None:
        """A copy of the servers' optimizer (spec, and the highest update count of any server), or None."""
        self._check_open()
        return self._collective_calls.get_optimizer()

    def _save_states(self, fname: str, dump_optimizer: bool, collective: bool = True) -> None:
        self._collective_calls.save_states(fname, dump_optimizer, collective)

    def _load_states(self, fname: str) -> None:
        self._collective_calls.load_states(fname)

    def _save_checkpoint(self, directory: str) -> None:
        self._collective_calls.save_checkpoint(directory)

    def _set_compression(self, params: Any) -> None:
        """Collective: every worker checks ``params`` (and that it has not pushed) before any installs."""
        checked: list = []
        if self._rejoin.at is not None:  # a restarted worker: the others agreed long ago
            checked.append(self._check_compression(params))
        else:
            self._barriers.agree("set_gradient_compression",
                                 lambda: checked.append(self._check_compression(params)))
        with self._lock:  # push plans group compressed keys apart: planned again per setting
            self._compression = self._compress.spec = checked[0]
            self._fast.forget()
        # saved residuals: a restarted worker's own (KVSTORE_SNAPSHOT_DIR), else KVSTORE_RESUME's
        rank, workers = self._cluster.rank, self._cluster.num_workers
        self._compress.restore(self._cfg, rank, workers, self._rejoin.at is not None)

    # -- the data path ------------------------------------------------------------------------------
    def _init(self, items: list[tuple[Key, np.ndarray]], members: WorkerSet | None = None) -> None:
        extra = None if members is None else {"workers": list(members.ranks)}

        def send_all() -> None:
            flats = {key: array.reshape(-1) for key, array in self._collective_calls.resumed(items)}
            entries = [(key, flat.dtype, self._path.pieces(key, flat.size)) for key, flat in flats.items()]
            sends = plan(entries, self._cfg.batch_bytes, self._cluster.chunk_bytes)  # big slices in chunks
            self._path.wait(self._path.send_planned(Op.INIT, (), sends, [pack(s, flats) for s in sends], [],
                                                    extra=extra))

        if self._rejoin.at is not None:  # a restarted worker: the servers hold every key already
            early = self._rejoin.step == 0 and not self._barriers.view.tag and not self._at_start
            if early and self._cfg.join:
                log.warning("worker %d joined before the job's first round, and no tagged membership view "
                            "says the others have stored the weights: a joiner skips init and set_optimizer, "
                            "so if they are still setting up, their collectives wait for it and its pulls "
                            "find no key; call kv.await_view() first (docs/elastic.md)", self.rank)
            return
        if members is not None:
            self._init_set(items, members, send_all)
            return
        started = self._meter.begin("init")
        sent = agreement.digest((key, array.shape, array.dtype.name) for key, array in items)
        try:  # every worker's keys, shapes and dtypes compared at the barrier init meets anyway
            self._barriers.collective(f"init of {len(items)} key(s)", send_all, sent)
        finally:
            self._meter.end("init", started)

    def _init_set(self, items: list[tuple[Key, np.ndarray]], members: WorkerSet,
                  send_all: Callable[[], None]) -> None:
        """Init of a worker set's keys (docs/worker-sets.md): the lowest member not known to have
        left sends the values; then every member meets the others at each server holding a piece of
        the keys, which answers once every member present has come, or with CollectiveMismatchError
        when their keys, shapes, dtypes or sets differ (anywhere in the call: every server compares the
        whole call's digest, so a failed call leaves no key made).  Raises DeadlineExceededError naming
        the set when a member does not come within KVSTORE_REQUEST_TIMEOUT."""
        started = self._meter.begin("init")
        try:
            left = set(self._barriers.left)
            if self.rank == min((r for r in members.ranks if r not in left), default=self.rank):
                send_all()
            # one digest of the whole call, met at every server: members that differ on any key fail at
            # every server, so none keeps a key of a failed call and a corrected init can be retried
            digest = agreement.digest((key, array.shape, array.dtype.name) for key, array in items)
            per_server: dict[int, list[tuple[Key, int, str]]] = {}
            for key, array in items:
                for piece in self._path.pieces(key, array.size):
                    per_server.setdefault(piece.server, []).append((key, piece.stop - piece.start, digest))
            body = {"workers": list(members.ranks)}
            requests = [self._io.submit(server, Message(Op.INIT, dict(body, keys=[k for k, _, _ in entries],
                                                                      sizes=[n for _, n, _ in entries],
                                                                      meet=[d for _, _, d in entries])),
                                        f"init of {len(items)} key(s) of worker set {members} at server "
                                        f"{server}: waits for every member present to call it")
                        for server, entries in sorted(per_server.items())]
            # every server's answer before raising: when this returns or raises, each server has ended
            # this call's rendezvous, so a retry cannot meet the remains of this one
            deadline, first = time.monotonic() + self._cfg.request_timeout, None
            for request in requests:
                try:
                    self._path.wait([request], max(0.0, deadline - time.monotonic()))
                except KVStoreError as exc:
                    first = first or exc
            if first is not None:
                raise first
        finally:
            self._meter.end("init", started)

    def _init_value(self, value: Any) -> np.ndarray:
        """A key's initial value for :meth:`_init`, which sends it and waits: a view of a C-contiguous
        CPU value (no copy of a big model's weights), else a contiguous copy."""
        return np.asarray(xp.numpy_view(value), order="C")  # keeps a 0-d value 0-d

    def _initialised(self, keys: list[Key]) -> None:
        self._fast.forget()  # a list that held an unknown key may be eligible now
        if not any(key in self._sets for key in keys):  # a set's keys: no all-worker collective
            self._collective_calls.initialised(keys)
        for key in keys:  # placed now, so that no push or pull computes a placement
            self._path.pieces(key)

    @public
    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """As :meth:`kvstore.base.KVStore.push`; a list of small numpy keys seen before takes the fast
        path (``kvstore.client.datapath``)."""
        self._check_open()
        fast, values = self._fast.match(key, value)
        if fast is not None:
            self._pushed = True
            self._fast.push(Op.PUSH, fast, values, priority=priority)
            return
        groups = self._push_args(key, value)
        if groups is not None:
            self._push(groups, priority)

    def _push(self, groups: list[Pushed], priority: int) -> None:
        started = self._meter.begin("push")
        try:
            self._path.send(Op.PUSH, groups, priority)
        finally:
            self._meter.end("push", started)

    def _collect(self, keys: list[Key], sends: list[Send], requests: list[Request],
                 outs: list[list[Any]] | None = None, pushed: bool = False) -> list[np.ndarray | None]:
        """Wait for the replies to ``sends`` (a pushpull's with ``pushed``) and assemble each key's
        value from its parts (``plan.collect``): a key whose out is one C-contiguous numpy array gets
        None, its out written."""
        replies = self._path.receive(keys, requests, pushed)
        targets = None if outs is None else [o[0] if len(o) == 1 else None for o in outs]
        return collect(keys, [self._meta[k] for k in keys], sends, [r.arrays for r in replies], targets)

    @public
    def pull(self, key: Any, out: Any = None, priority: int = 0) -> Any:
        """As :meth:`kvstore.base.KVStore.pull`; a list of small numpy keys seen before, pulled into
        numpy outs, takes the fast path (``kvstore.client.datapath``)."""
        self._check_open()
        if out is not None:
            fast, outs = self._fast.match(key, out, writable=True)
            if fast is not None:
                self._fast.pull(fast, outs, priority)
                return out
        single = not isinstance(key, (list, tuple))
        metas = self._meta
        keys = [known_key(k, metas) for k in key] if not single else [known_key(key, metas)]
        if self._sparse.metas and self._sparse.owns(keys):
            return self._sparse.pull_whole(key, out)
        targets = self._pull_outs(keys, out, single)
        result = self._deliver(keys, self._pull(keys, priority, targets), targets, single)
        return result if out is None else out

    def _pull(self, keys: list[Key], priority: int, outs: list[list[Any]] | None = None) -> list[Any]:
        started = self._meter.begin("pull")
        try:
            return self._pull_keys(keys, outs, priority)
        finally:
            self._meter.end("pull", started)
            self._path.after_round()  # residuals, test hook

    def _pull_keys(self, keys: list[Key], outs: list[list[Any]] | None = None,
                   priority: int = 0) -> list[Any]:
        unique = list(dict.fromkeys(keys))  # a message names each key once
        if len(unique) != len(keys):
            found = dict(zip(unique, self._pull_keys(unique, priority=priority)))
            return [found[k] for k in keys]
        sends, _ = self._path.plan(keys, chunked=False)
        requests = [self._path.submit(Op.PULL, s, None, None, priority) for s in sends]
        return self._collect(keys, sends, requests, outs)

    @public
    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> Any:
        """As :meth:`kvstore.base.KVStore.pushpull`; a list of small numpy keys seen before, with numpy
        outs, takes the fast path (``kvstore.client.datapath``)."""
        target = value if out is None else out
        fast, values = self._fast.match(key, value)
        if fast is not None:
            fast_out, outs = self._fast.match(key, target, writable=True)
            if fast_out is fast:
                self._check_open()
                self._pushed = True
                self._fast.push(Op.PUSHPULL, fast, values, outs, priority)
                return target
        single = not isinstance(key, (list, tuple))
        if not single:
            once_each(key)
        self._check_open()
        groups, keys, outs = self._pushpull_args(key, value, target, single)
        self._deliver(keys, self._pushpull(groups, priority, outs), outs, single)
        return target

    def _pushpull_args(self, key: Any, value: Any, target: Any,
                       single: bool) -> tuple[list[Pushed], list[Key], list[list[Any]]]:
        """As :meth:`kvstore.base.KVStore._pushpull_args`; a value or out of another shape or dtype
        than its key's also aborts this round of the call's keys on the servers (:meth:`_refused`)."""
        try:
            return super()._pushpull_args(key, value, target, single)
        except (ShapeMismatchError, DTypeMismatchError) as exc:
            self._refused(key, exc)
            raise

    def _refused(self, key: Any, exc: KVStoreError) -> None:
        """A pushpull of ``key`` (one or a list) was refused with ``exc`` before anything was sent: in
        dist_sync, tell each server holding a piece of its initialised dense keys (ROUND_ABORT), so
        that round fails on every worker rather than the others waiting for this one until their
        deadline, and wait for their OKs (request deadline).  Raises nothing: a failure is logged
        (the caller raises ``exc``)."""
        if self._cluster.mode != "dist_sync":
            return
        keys: dict[Key, None] = {}  # distinct, in order
        for k in key if isinstance(key, (list, tuple)) else [key]:
            try:
                k = known_key(k, self._meta)
            except KVStoreError:
                continue  # refused for its key already: not pushed by anyone
            if k in self._meta:
                keys[k] = None
        if not keys:
            return
        path = self._path
        try:  # one ROUND_ABORT per message a pull of the keys would send: each server holding a piece
            sends, _ = path.plan(list(keys), chunked=False)
            path.wait([path.submit(Op.ROUND_ABORT, send, None, {"reason": str(exc)}) for send in sends])
        except KVStoreError as failed:
            log.warning("could not abort the round of key(s) %s on every server (%s): the other workers' "
                        "pushpulls of it wait out their deadline", list(keys)[:3], failed)

    def _pushpull(self, groups: list[Pushed], priority: int,
                  outs: list[list[Any]] | None = None) -> list[Any]:
        started = self._meter.begin("pushpull")
        try:
            # blocking: the values are lent, not copied, until the replies are in
            return self._collect(*self._path.send(Op.PUSHPULL, groups, priority, borrow=True), outs,
                                 pushed=True)
        finally:
            self._meter.end("pushpull", started)
            self._path.after_round()  # residuals, test hook

    def _pushpull_begin(self, keys: list[Key], values: list[Any], outs: list[Any],
                        priority: int = 0) -> Callable[[bool], None]:
        """Send a PUSHPULL of ``keys`` (one value and one out each) at ``priority`` now; return
        ``finish(write=True)``, which waits for the replies and writes each key's result into its out
        (with ``write=False`` only waits, raising what failed).  The caller must make that call: a
        failure of the pushpull is raised there and nowhere else.  Raises what ``pushpull`` raises for
        bad arguments, before anything is sent.  The Trainer's overlap sends each bucket from its hook
        this way (one request and one reply where a push then a pull took two of each;
        ``kvstore.overlap``)."""
        once_each(keys)
        self._check_open()
        try:
            groups = self._groups(keys, values)
            targets = self._outs(keys, outs, False)
        except (ShapeMismatchError, DTypeMismatchError) as exc:
            self._refused(keys, exc)
            raise
        self._pushed = True
        started = self._meter.begin("pushpull")
        try:
            sent = self._path.send(Op.PUSHPULL, groups, priority, lend=True)  # copied once, into shm
        finally:
            self._meter.end("pushpull", started)

        def finish(write: bool = True) -> None:
            try:
                arrays = self._collect(*sent, targets if write else None, pushed=True)
                if write:
                    self._deliver(sent[0], arrays, targets, False)
            finally:
                self._path.after_round()  # residuals, test hook
        return finish

    def _flush(self, timeout: float, knob: str) -> None:
        requests = self._window.outstanding()
        deadline = time.monotonic() + timeout
        for request in requests:  # every one: a failure must not end the wait for the others
            try:
                self._path.wait([request], max(0.0, deadline - time.monotonic()), knob)
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

    def _barrier_after_pushes(self, tag: tuple[int, ...] | None = None) -> None:
        """Wait for this worker's pushes (a push failure is raised after the barrier), then join the
        barrier: a membership one with ``tag`` (DeadlineExceededError when its reply was given up on)."""
        error: KVStoreError | None = None
        try:
            self._flush(self._cfg.request_timeout, "KVSTORE_REQUEST_TIMEOUT")
        except DeadlineExceededError:
            raise
        except KVStoreError as exc:
            error = exc
        if tag is None:
            self._barrier_only()
        elif not self._barriers.join(tag=tag):
            raise DeadlineExceededError("the membership barrier was released but its reply was given up "
                                        "on (KVSTORE_REQUEST_TIMEOUT): the view is unknown")
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

    def _final_stats(self) -> dict[str, Any]:
        """The LEAVE's ``{"stats": snapshot}``: the scheduler holds this worker's final counters from its
        LEAVE on, whether or not the last heartbeat (another connection) is read first.  ``{}`` when
        the snapshot fails to build (logged; the LEAVE goes all the same)."""
        try:
            return {"stats": self._snapshot()}
        except Exception as exc:  # noqa: BLE001 - a broken snapshot must not keep this worker counted in
            log.warning("the LEAVE goes without this worker's final stats: %s", str(exc)[:300])
            return {}

    def _stop_heartbeat(self, timeout: float) -> None:
        """Stop the heartbeat thread (its last beat carries the final snapshot) and wait for it."""
        assert self._heartbeat is not None
        self._heartbeat.stop()
        self._heartbeat.join(timeout)

    def _leave_servers(self, timeout: float) -> KVStoreError | None:
        """Send LEAVE to every server after this worker's pushes, on the same connections, and wait
        for the replies: then every push has been taken in (applied, or waiting in a sync round that
        no longer waits for this worker).  Returns the failure of a push the servers refused."""
        try:
            if self._io.failure is None:  # after a loss the cluster is broken: nothing waits for us
                leaves = [self._io.submit(i, Message(Op.LEAVE), f"leave message to server {i}")
                          for i in range(self._cluster.num_servers)]
                self._path.wait(leaves, timeout, "KVSTORE_SHUTDOWN_TIMEOUT")
            self._raise_push_failures()  # replies come in order: a refused push has failed by now
        except KVStoreError as exc:
            return exc
        return None

    def _close(self, failure: str | None) -> None:
        """close(); with ``failure`` (the process is dying of it) nothing is drained, and the
        scheduler is told this worker failed, so every other worker raises NodeLostError."""
        if self._closed or _FORKS[0] != self._forks:
            return
        self._closed = True
        error: BaseException | None = None
        timeout = self._cfg.shutdown_timeout
        if failure is None:
            error = self._leave_servers(timeout)
        # Under scheduler restarts the heartbeat runs until the LEAVE is answered: a LEAVE sent while the
        # scheduler is down is held until the heartbeat has re-registered this worker with its restart,
        # then sent again (else the restarted scheduler waits for this worker and declares it lost).
        riding = self._cfg.scheduler_restarts and self._heartbeat is not None
        if self._heartbeat is not None and not riding:
            self._stop_heartbeat(timeout)  # the last beat before LEAVE: after the last LEAVE none is answered
        lost = self._io.failure
        if not isinstance(lost, NodeLostError) or lost.role != "scheduler":
            body = self._final_stats()
            if failure is not None:
                body["failure"] = failure
            wait = timeout + (self._cfg.heartbeat_timeout if riding else 0.0)  # a restart's gap, the reply
            try:  # after a lost peer too: the scheduler counts this worker out and can finish
                leave = self._io.submit(SCHEDULER, Message(Op.LEAVE, body), "leave message to the scheduler",
                                        after_failure=True)
                self._path.wait([leave], wait, "KVSTORE_SHUTDOWN_TIMEOUT")
            except KVStoreError as exc:
                log.warning("%s", exc)
        if riding:
            self._stop_heartbeat(timeout)
        self._io.stop(timeout)
        if error is not None:
            raise error

"""The worker's side of row-sparse keys in the dist stores (docs/sparse.md): a table created on the
servers by row ranges, pushes that carry only the rows present (each to the server holding it, cut
into messages of at most the cluster's chunk size), and pulls of the rows asked for.

A dynamic table's rows are placed by a seeded hash of the id over every server
(:func:`kvstore.core.dynamic.servers_of`), each server's ids kept sorted.

Every push of a key goes to every server holding a range of it, with no rows when this worker has none
for that range: a dist_sync round counts one push per worker, as for dense keys.  Pushes share the
store's push window (``KVSTORE_PUSH_WINDOW``), so ``barrier()`` and ``close()`` wait for them and a
refused push is raised by the key's next call.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvstore.client.compress import RowResiduals
from kvstore.client.datapath import DataPath
from kvstore.client.mux import Request
from kvstore.core import compression as C
from kvstore.core import rowsparse as R
from kvstore.core.checkpoint import Stored, check_stored, runs
from kvstore.core.dtypes import dtype_name
from kvstore.core.dynamic import servers_of
from kvstore.core.partition import Key
from kvstore.core.snapshot import HeldRows
from kvstore.errors import ProtocolError, from_cluster
from kvstore.net.protocol import Message, Op

DEFAULT_CHUNK_BYTES = 4 << 20  # rows per message when the cluster sets no chunk size


@dataclass
class RowsLink:
    """What the dist store hands its row-sparse side: its data path (sockets, waits, the push window,
    the cluster), its collective calls, and the ``KVSTORE_RESUME`` hooks."""

    path: DataPath
    collective: Callable[[str, Callable[[], None]], None]
    request_timeout: float
    resumed: Callable[[Key, tuple, np.dtype], np.ndarray | R.RowSparse | Stored | HeldRows | None] = (
        lambda key, shape, dtype: None)
    initialised: Callable[[list[Key]], None] = lambda keys: None  # KVSTORE_RESUME: restore their states
    sent: Callable[[int], None] = lambda nbytes: None  # counts bytes of arrays sent (stats' bytes_out)
    compression: Callable[[], C.Spec | None] = lambda: None  # set_gradient_compression's setting
    residuals: RowResiduals = field(default_factory=RowResiduals)  # 2bit / 1bit: by (table, row id)


class SetCall:
    """The SPARSE_SETs of one init or load: each carries the call's id and its part number (per
    server), and :meth:`settle` ends the call with one settle request to each server it set rows on,
    answered once a shard holding them is written (a server with shards; at once without): a restart
    from an earlier shard would otherwise bring back what they overwrote silently.  A settle is not
    waited for: it waits in the push window under the call's keys (``barrier()``, ``close()`` and the
    keys' next calls raise its failure: a NodeLostError when a restart lost some of the sets), so an
    init per key costs one shard write each only while the servers keep up, never a write per call
    waited for in turn."""

    def __init__(self, rows: DistRows) -> None:
        self.rows = rows
        self.call = secrets.randbits(62)  # distinct from any other call a server may still count
        self.parts: dict[int, int] = {}  # server -> sets sent to it
        self.keys: set[Key] = set()

    def stamp(self, server: int, key: Key, body: dict) -> dict:
        """``body`` of the next set of ``key`` to ``server``, with the call and its part number."""
        part = self.parts.get(server, 0)
        self.parts[server] = part + 1
        self.keys.add(key)
        return {**body, "call": self.call, "part": part}

    def settle(self) -> None:
        """Send each server its settle request and hold them in the push window of the call's keys
        (its sets are all acknowledged: the caller waited for them)."""
        if not self.parts:
            return
        submit = self.rows.link.path.mux.submit
        requests = [submit(server, Message(Op.SPARSE_SET, {"settle": self.call, "parts": count}),
                           f"settle of {count} row message(s) set on server {server}")
                    for server, count in self.parts.items()]
        self.rows.link.path.window.add({key: requests for key in self.keys}, failures=True)


class DistRows:
    """Row-sparse init, push and pull for one dist store."""

    def __init__(self, link: RowsLink) -> None:
        self.link = link
        self._pushes: dict[Key, int] = {}  # key -> rounds pushed by this worker (under _counting)
        self._origin: int | None = None  # a restarted worker: the round it rejoined at (rejoined())
        self._lock = threading.Lock()  # one push of a key leaves as one run, rounds in order
        self._counting = threading.Lock()  # a push's count and its queued messages, as one (never
        # held while waiting): a restarted server's hold (:meth:`hold`) sees both or neither

    def _submit(self, server: int, msg: Message, what: str) -> Request:
        """Queue ``msg`` to server ``server``, its arrays counted as bytes sent."""
        if msg.arrays:
            self.link.sent(sum(a.nbytes for a in msg.arrays))
        return self.link.path.mux.submit(server, msg, what)

    def ranges(self, meta: R.SparseMeta) -> list[tuple[int, int, int]]:
        """``(server, lo, hi)`` of each server holding rows of a table (empty ranges left out)."""
        bounds = R.row_bounds(meta.num_rows, self.link.path.cluster.num_servers)
        return [(s, lo, hi) for s, (lo, hi) in enumerate(bounds) if hi > lo]

    def rows_per_message(self, meta: R.SparseMeta) -> int:
        chunk = self.link.path.cluster.chunk_bytes or DEFAULT_CHUNK_BYTES
        return max(1, chunk // (meta.width * meta.dtype.itemsize + 8))

    def rejoined(self, at: int) -> None:
        """This worker is a restart that rejoined at round ``at`` (kvstore.client.joining.rejoin): the
        servers hold its tables, and its push count of each starts at ``at`` (its first push of a
        table joins round ``at``, its pulls wait for the rounds before it), as the servers count it."""
        with self._counting:
            self._origin = at
            for key in self._pushes:
                self._pushes[key] = max(self._pushes[key], at)

    def init(self, items: list[tuple[Key, R.SparseMeta, dict, np.ndarray | None]]) -> None:
        """Create each table on its servers (rank 0 sends; collective), then its rows from a value.  A
        restarted worker (:meth:`rejoined`) sends nothing: the servers hold the tables already."""
        if self._origin is not None:
            with self._counting:
                for key, _, _, _ in items:
                    self._pushes.setdefault(key, self._origin)
            return

        def send_all() -> None:
            requests = []
            for key, meta, spec, _ in items:
                if meta.dynamic is not None:
                    requests.extend(self._init_dynamic(key, meta, meta.dynamic, spec))
                    continue
                for server, lo, hi in self.ranges(meta):
                    body = {"key": key, "shape": list(meta.shape), "dtype": dtype_name(meta.dtype),
                            "lo": lo, "hi": hi, "init": spec}
                    requests.append(self._submit(server, Message(Op.SPARSE_INIT, body),
                                                     f"row_sparse init of key {key!r} to server {server}"))
            self.link.path.wait(requests)
            call = SetCall(self)
            resumed = [self.link.resumed(key, meta.shape, meta.dtype) for key, meta, _, _ in items]
            check_stored(*(part for saved in resumed  # every table left in the file read through once:
                           for part in ((saved.indices, saved.rows) if isinstance(saved, HeldRows)
                                        else (saved,))))  # a damaged one refused before a row is set
            for (key, meta, _, array), saved in zip(items, resumed):  # KVSTORE_RESUME's table, or None
                if meta.dynamic is not None:  # rows made on first touch, or the snapshot's rows
                    if isinstance(saved, R.RowSparse):
                        self.set_dynamic(key, meta, saved.indices, saved.rows, call)
                    elif isinstance(saved, HeldRows):  # left in the file: a chunk of rows at a time
                        step = self.rows_per_message(meta)
                        total = int(saved.rows.shape[0])
                        sizes = [min(step, total - start) for start in range(0, total, step)]
                        chunks = runs(saved.rows, [n * meta.width for n in sizes], checked=True)
                        for ids, chunk in zip(runs(saved.indices, sizes, checked=True), chunks):
                            self.set_dynamic(key, meta, ids, chunk.reshape(ids.size, meta.width), call)
                    continue
                assert not isinstance(saved, (R.RowSparse, HeldRows))  # snapshot.check_fits refuses it
                value = array if saved is None else saved
                if value is not None:
                    self._set(key, meta, value, call, checked=True)
            call.settle()

        self.link.collective(f"row_sparse init of {len(items)} key(s)", send_all)
        self.link.initialised([key for key, _, _, _ in items])

    def _init_dynamic(self, key: Key, meta: R.SparseMeta, dynamic: R.DynamicSpec,
                      spec: dict) -> list[Request]:
        """SPARSE_INIT of a dynamic table to every server: a row's shape and the table's DynamicSpec."""
        body = {"key": key, "shape": list(meta.shape[1:]), "dtype": dtype_name(meta.dtype), "init": spec,
                "dynamic": dynamic.wire()}
        return [self._submit(server, Message(Op.SPARSE_INIT, body),
                             f"dynamic row_sparse init of key {key!r} to server {server}")
                for server in range(self.link.path.cluster.num_servers)]

    def dynamic_cuts(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """For sorted distinct ``ids`` of a dynamic table: each server's positions in ``ids`` (sorted)."""
        num = self.link.path.cluster.num_servers
        if num == 1:
            return [(0, np.arange(ids.size))]
        where = servers_of(ids, num)
        order = np.argsort(where, kind="stable")
        edges = np.searchsorted(where[order], np.arange(num + 1))
        return [(s, order[edges[s]:edges[s + 1]]) for s in range(num)]

    def _set(self, key: Key, meta: R.SparseMeta, table: np.ndarray | Stored, call: SetCall,
             checked: bool = False) -> None:
        """Send a fixed table's every row (a value in memory, or one left in a snapshot's file, read a
        chunk at a time as it is sent, its member checked first unless ``checked``) to the servers
        holding them."""
        step, requests = self.rows_per_message(meta), []
        cuts = [(server, start, min(hi, start + step)) for server, lo, hi in self.ranges(meta)
                for start in range(lo, hi, step)]
        chunks = runs(table, [(stop - start) * meta.width for _, start, stop in cuts], checked)
        for (server, start, stop), chunk in zip(cuts, chunks):
            ids = np.arange(start, stop, dtype=np.int64)
            msg = Message(Op.SPARSE_SET, call.stamp(server, key, {"key": key}),
                          [ids, chunk.reshape(stop - start, meta.width)])
            requests.append(self._submit(server, msg, f"row_sparse init of key {key!r} rows "
                                                      f"[{start}, {stop}) to server {server}"))
            if len(requests) >= 8:  # a few in flight: what the value's rows take on the wire stays small
                self.link.path.wait(requests)
                requests = []
        self.link.path.wait(requests)

    def set_dynamic(self, key: Key, meta: R.SparseMeta, ids: np.ndarray, rows: np.ndarray,
                    call: SetCall) -> None:
        """Store ``rows`` (one per distinct int64 id of ``ids``) in dynamic table ``key``: each id's rows
        to its server in chunks (sets of ``call``), made there (capacity allowing) or overwritten."""
        order = np.argsort(ids, kind="stable")
        ids, flat = ids[order], np.ascontiguousarray(rows.reshape(ids.size, meta.width)[order])
        step, requests = self.rows_per_message(meta), []
        for server, where in self.dynamic_cuts(ids):
            for start in range(0, where.size, step):
                part = where[start:start + step]
                msg = Message(Op.SPARSE_SET, call.stamp(server, key, {"key": key}), [ids[part], flat[part]])
                requests.append(self._submit(server, msg, f"{part.size} rows of dynamic key {key!r} to "
                                                              f"server {server}"))
                if len(requests) >= 8:
                    self.link.path.wait(requests)
                    requests = []
        self.link.path.wait(requests)

    def push(self, items: list[tuple[Key, R.SparseMeta, np.ndarray, np.ndarray]]) -> None:
        """Send one round of each key's merged rows to the servers; returns without waiting for acks.
        Raises the failure of an earlier push of these keys first."""
        keys = [key for key, _, _, _ in items]
        deadline = time.monotonic() + self.link.request_timeout
        with self._lock:
            self.link.path.window.wait_room(keys, deadline, self.link.path.mux.wait)
            error = self.link.path.window.take_failure(keys)
            if error is not None:
                raise from_cluster(error)
            held = {}
            with self._counting:
                for key, meta, ids, rows in items:
                    rnd = self._pushes.get(key, 0)
                    self._pushes[key] = rnd + 1
                    held[key] = self._send(key, meta, rnd, ids, rows)
            self.link.path.window.add(held, failures=True)

    def hold(self, server: int) -> dict[Key, int]:
        """Hold every request to ``server`` (:meth:`DataPath.hold`: a restarted server,
        kvstore.client.realign) and return the push counts of the dense keys and the tables taken at
        the same instant: no push counted but not held."""
        with self._counting:
            counts = self.link.path.hold(server)
            counts.update(self._pushes)
            return counts

    def _encoding(self, meta: R.SparseMeta) -> C.Spec | None:
        """The compression a push of a table travels under: the store's setting for a float32 table of
        at least ``size_lower_bound`` elements (a dynamic table's count is unbounded), else None."""
        spec = self.link.compression()
        if spec is None or meta.dtype != np.float32:
            return None
        if meta.dynamic is None and meta.num_rows * meta.width < spec.size_lower_bound:
            return None
        return spec

    def _half(self, spec: C.Spec | None, key: Key, ids: np.ndarray, rows: np.ndarray,
              has: np.ndarray | None) -> tuple[np.ndarray, dict]:
        """``rows`` as they travel, and the push body's field saying so: fp16 or bf16 (bits) under that
        compression, with ``error_feedback`` through the rows' residuals (``has``: the rows given one);
        otherwise as they are (2bit and 1bit are coded per message: :meth:`_messages`)."""
        if spec is None or spec.type not in C.CASTS:
            return rows, {}
        if has is not None:
            half = self.link.residuals.cast(spec, key, ids, rows, has).reshape(-1)
        else:
            half = C.to_half(spec.type, np.ascontiguousarray(rows).reshape(-1), None)
        if spec.type == "bf16":
            half = half.view(np.float16)  # bfloat16 bits travel in a 2-byte wire dtype (as dense keys')
        return half.reshape(rows.shape[0], -1), {"half": spec.type}

    def _messages(self, key: Key, spec: C.Spec | None, body: dict, ids: np.ndarray, rows: np.ndarray,
                  has: np.ndarray | None) -> list[Message]:
        """One chunk of a round: a SPARSE_PUSH of ``ids`` and their ``rows`` (``body`` says whether it is
        the round's last).  Under 2bit / 1bit the rows with a residual (``has``, from
        :meth:`RowResiduals.reserve`) travel as packed words (``quantised``: ``[type, threshold]``), and
        those it had no room for as they are (float32, exact) in a second message before the
        ``last`` one: two messages of the round with disjoint ids."""
        if spec is None or spec.type not in C.QUANTISED:
            return [Message(Op.SPARSE_PUSH, body, [ids, rows])]
        assert has is not None
        messages = []
        if not has.all():
            raw, rest = ~has, bool(has.any())  # rest: rows quantised after (else this is the chunk)
            messages.append(Message(Op.SPARSE_PUSH, {**body, "last": body["last"] and not rest},
                                    [ids[raw], rows[raw]]))
            if not rest:
                return messages
            ids, rows = ids[has], rows[has]
        packed = self.link.residuals.quantise(spec, key, ids, rows)
        messages.append(Message(Op.SPARSE_PUSH, {**body, "quantised": spec.wire()}, [ids, packed]))
        return messages

    def _send(self, key: Key, meta: R.SparseMeta, rnd: int, ids: np.ndarray,
              rows: np.ndarray) -> list[Request]:
        spec = self._encoding(meta)
        has = None
        if spec is not None and spec.residual:  # the push's rows get residuals together (2bit, 1bit,
            has = self.link.residuals.reserve(key, ids, meta.width)  # a cast's error_feedback)
        rows, wire = self._half(spec, key, ids, rows, has)
        if meta.dynamic is not None:
            requests = []
            for server, where in self.dynamic_cuts(ids):
                part = None if has is None else has[where]
                requests.extend(self._send_to(key, spec, rnd, server, ids[where], rows[where], wire, meta,
                                              part))
            return requests
        ranges = self.ranges(meta)
        cuts = R.split(ids, [(lo, hi) for _, lo, hi in ranges])
        requests = []
        for (server, _, _), (start, stop) in zip(ranges, cuts):
            part = None if has is None else has[start:stop]
            requests.extend(self._send_to(key, spec, rnd, server, ids[start:stop], rows[start:stop], wire,
                                          meta, part))
        return requests

    def _send_to(self, key: Key, spec: C.Spec | None, rnd: int, server: int, ids: np.ndarray,
                 rows: np.ndarray, wire: dict, meta: R.SparseMeta, has: np.ndarray | None) -> list[Request]:
        """One server's part of a round of a table's push, in chunks (one, empty, at least)."""
        step, requests = self.rows_per_message(meta), []
        pieces = list(range(0, ids.size, step)) or [0]
        for i, first in enumerate(pieces):
            end = min(ids.size, first + step)
            body = {"key": key, "round": rnd, "last": i == len(pieces) - 1, **wire}
            for msg in self._messages(key, spec, body, ids[first:end], rows[first:end],
                                      None if has is None else has[first:end]):
                requests.append(self._submit(server, msg, f"row_sparse push of key {key!r} "
                                                          f"({end - first} rows) to server {server}"))
        return requests

    def pull(self, key: Key, meta: R.SparseMeta, ids: np.ndarray, admit: bool = False) -> np.ndarray:
        """The current rows ``ids`` (sorted, distinct) of ``key`` as ``(n, width)``, after this worker's
        earlier pushes of it are applied (read-your-writes); ``admit``: a dynamic table stores the
        rows it did not hold.  Raises what the servers raise."""
        error = self.link.path.window.take_failure([key])
        if error is not None:
            raise from_cluster(error)
        if meta.dynamic is not None:
            return self._pull_dynamic(key, meta, ids, admit)
        ranges = self.ranges(meta)
        cuts = R.split(ids, [(lo, hi) for _, lo, hi in ranges])
        step, requests, spans = self.rows_per_message(meta), [], []
        after = self._pushes.get(key, 0)
        for (server, _, _), (start, stop) in zip(ranges, cuts):
            for first in range(start, stop, step):
                end = min(stop, first + step)
                msg = Message(Op.SPARSE_PULL, {"key": key, "after": after}, [ids[first:end]])
                requests.append(self._submit(server, msg, f"row_sparse_pull of key {key!r} "
                                                              f"({end - first} rows) from server {server}"))
                spans.append((first, end))
        out = np.empty((ids.size, meta.width), meta.dtype)
        for (first, end), reply in zip(spans, self.link.path.wait(requests)):
            got = reply.arrays[0] if reply.arrays else None
            if got is None or got.shape != (end - first, meta.width) or got.dtype != meta.dtype:
                raise from_cluster(ProtocolError(f"row_sparse_pull of key {key!r}: a server answered "
                                              "rows of the wrong shape"))
            out[first:end] = got
        return out

    def _pull_dynamic(self, key: Key, meta: R.SparseMeta, ids: np.ndarray, admit: bool) -> np.ndarray:
        step, requests, spans = self.rows_per_message(meta), [], []
        body = {"key": key, "after": self._pushes.get(key, 0)}
        if admit:
            body["admit"] = True
        for server, where in self.dynamic_cuts(ids):
            for first in range(0, where.size, step):
                part = where[first:first + step]
                msg = Message(Op.SPARSE_PULL, body, [np.ascontiguousarray(ids[part])])
                requests.append(self._submit(server, msg, f"row_sparse_pull of key {key!r} "
                                                          f"({part.size} rows) from server {server}"))
                spans.append(part)
        out = np.empty((ids.size, meta.width), meta.dtype)
        for part, reply in zip(spans, self.link.path.wait(requests)):
            got = reply.arrays[0] if reply.arrays else None
            if got is None or got.shape != (part.size, meta.width) or got.dtype != meta.dtype:
                raise from_cluster(ProtocolError(f"row_sparse_pull of key {key!r}: a server answered "
                                                 "rows of the wrong shape"))
            out[part] = got
        return out

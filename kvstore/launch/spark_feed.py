"""The streaming feed of ``kvstore.spark.run(data=df, epochs=E)``: a DataFrame's rows, reshuffled per
epoch, streamed to the workers in bounded batches.  No Spark here (the driver's epoch loop is in
:mod:`kvstore.spark`); three parts, all over one TCP wire of length-prefixed msgpack maps
(:func:`kvstore.net.protocol.pack_map`; arrays as dtype, shape and raw bytes: never pickle):

* :class:`FeedHub`, on the driver: a listener the feed tasks and the workers connect to.  The feed
  tasks of an epoch's Spark job send it their partition's rows in chunks; it deals the rows round robin
  (row ``i`` of the epoch to worker ``i % W``), cuts each worker's rows into batches of ``batch_size``
  and keeps at most :data:`QUEUE_BATCHES` batches per worker, queued one per worker per round (no
  worker more than one batch ahead of another); a worker asks for its next batch.  When
  the epoch's job has ended, every worker's last (short) batch and an end-of-epoch mark are queued.
* :func:`feed_partition`, in a feed task: one partition's rows, converted to columns, sent in chunks
  of at most ``chunk_rows`` rows; it ends once the hub has dealt them all.
* :class:`WorkerFeed`, in a worker: what ``train_fn`` iterates: one iterator of batches per epoch.

Every connection starts with the hub's random nonce, answered with an HMAC of it under the job's
secret, in a hello of at most :data:`HELLO_LIMIT` bytes within :data:`HANDSHAKE_SECONDS`; at most
:data:`MAX_HANDSHAKES` connections may be in their handshake at once (the hub answers more with
``busy`` and closes them; :func:`connect` tries again), so a stranger without the secret costs the hub
a bounded number of threads and bytes, and nothing it sends stops the hub.  Every wait has a deadline
(``timeout``) and raises :class:`FeedError` naming what it waited for.  Memory: a worker holds at
most :data:`PREFETCH` batches beyond its own; the driver one chunk per feed task plus
``QUEUE_BATCHES + 1`` batches per worker; a feed task one chunk.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import ConfigError, FeedError, ProtocolError, TaskFailed
from kvstore.net import protocol

FRAME = struct.Struct("<I")
MAX_FRAME = 256 * 1024 * 1024  # a longer frame is refused (a chunk of chunk_rows rows is far below)
QUEUE_BATCHES = 4  # batches the hub keeps ready per worker
PREFETCH = 2  # requests a worker keeps outstanding
POLL = 0.5  # seconds between checks of a closed hub while a queue wait runs (each wait has a deadline)
NONCE_BYTES = 16
HELLO_LIMIT = 1024  # the largest hello (read before the HMAC check); a real one is ~100 bytes
HANDSHAKE_SECONDS = 5.0  # a connection's hello must come within this after it is accepted
MAX_HANDSHAKES = 64  # connections in their handshake at once (more are answered busy and closed)
BUSY_RETRY = 0.2  # seconds connect() waits before it tries a busy hub again

log = logging.getLogger("kvstore.launcher")

# Spark SQL type names -> numpy dtypes of a column (arrays of these become 2-D columns)
NUMERIC = {"float": "<f4", "double": "<f8", "integer": "<i4", "long": "<i8", "short": "<i2", "byte": "|i1",
           "boolean": "|b1"}
LISTED = ("string", "binary")  # carried as msgpack lists


@dataclass(frozen=True)
class Column:
    """One column of the feed: its name and kind (a numpy dtype string; ``array:<dtype>`` for a Spark
    array of numbers, a 2-D column; ``list`` for strings and bytes)."""

    name: str
    kind: str


@dataclass(frozen=True)
class FeedSpec:
    """Where the driver's hub listens and how the feed runs; pickled by Spark into the feed tasks and
    the barrier tasks (the secret travels beside it, in the job's closure)."""

    host: str
    port: int
    epochs: int
    batch_size: int
    timeout: float
    columns: tuple[Column, ...]
    chunk_rows: int


def columns_of(schema: Any) -> tuple[Column, ...]:
    """The feed's columns for a Spark ``StructType`` (duck-typed: fields with ``name`` and a
    ``dataType`` that has ``typeName()``).  Raises ConfigError for a type the feed cannot carry."""
    found = []
    for field in schema.fields:
        kind = field.dataType.typeName()
        if kind in NUMERIC:
            found.append(Column(field.name, NUMERIC[kind]))
        elif kind == "array" and field.dataType.elementType.typeName() in NUMERIC:
            found.append(Column(field.name, "array:" + NUMERIC[field.dataType.elementType.typeName()]))
        elif kind in LISTED:
            found.append(Column(field.name, "list"))
        else:
            raise ConfigError(f"the feed cannot carry column {field.name!r} of type "
                              f"{field.dataType.simpleString()} (numbers, arrays of numbers, strings and "
                              "binary only): select or cast it first")
    return tuple(found)


# -- the wire -----------------------------------------------------------------------------------------

def _encode(value: Any) -> Any:
    """A column for msgpack: an array as ``{"d", "s", "b"}``, a list as ``{"l"}``."""
    if isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value)
        return {"d": value.dtype.str, "s": list(value.shape), "b": value.tobytes()}
    return {"l": list(value)}


def _decode(raw: Any, what: str) -> np.ndarray | list:
    """The column ``raw`` (from :func:`_encode`); raises FeedError for anything else (no object
    dtypes)."""
    if isinstance(raw, dict) and isinstance(raw.get("l"), list):
        return raw["l"]
    try:
        dtype = np.dtype(raw["d"])
        shape = tuple(int(n) for n in raw["s"])
        if dtype.kind not in "biuf" or len(raw["b"]) != dtype.itemsize * int(np.prod(shape)):
            raise ValueError(f"dtype {dtype}, shape {shape}, {len(raw['b'])} bytes")
        return np.frombuffer(raw["b"], dtype).reshape(shape).copy()  # writable, like any array
    except (KeyError, TypeError, ValueError) as exc:
        raise FeedError(f"a bad column in {what}: {exc}") from None


def send(conn: socket.socket, message: Mapping[str, Any]) -> None:
    """Send one frame (the socket's own timeout bounds it).  Raises OSError."""
    body = protocol.pack_map(dict(message))
    conn.sendall(FRAME.pack(len(body)))
    conn.sendall(body)


def _receive_exact(conn: socket.socket, size: int, deadline: float, what: str) -> bytes:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise FeedError(f"no {what} within the feed's timeout")
        conn.settimeout(None if left == float("inf") else left)
        try:
            n = conn.recv_into(view[got:])
        except TimeoutError:
            raise FeedError(f"no {what} within the feed's timeout") from None
        except OSError as exc:
            raise FeedError(f"the connection broke while waiting for {what}: {exc}") from None
        if not n:
            raise FeedError(f"the connection closed while waiting for {what}")
        got += n
    return bytes(buf)


def receive(conn: socket.socket, deadline: float, what: str, limit: int = MAX_FRAME) -> dict:
    """One frame of at most ``limit`` bytes, a msgpack map, by ``deadline`` (time.monotonic()).  Raises
    FeedError naming ``what`` when it does not come, the connection ends, or the frame is bad."""
    (size,) = FRAME.unpack(_receive_exact(conn, FRAME.size, deadline, what))
    if size > limit:
        raise FeedError(f"{what}: a frame of {size} bytes is over the limit of {limit}")
    try:
        return protocol.unpack_map(_receive_exact(conn, size, deadline, what))
    except ProtocolError as exc:
        raise FeedError(f"{what}: {exc}") from None


def _mac(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), b"kvstore-spark-feed" + nonce, hashlib.sha256).digest()


def connect(spec: FeedSpec, secret: str, hello: Mapping[str, Any]) -> socket.socket:
    """A connection to the hub, past its handshake (a busy hub is tried again until ``spec.timeout``).
    Raises FeedError."""
    deadline = time.monotonic() + spec.timeout
    while True:
        try:
            conn = socket.create_connection((spec.host, spec.port), timeout=spec.timeout)
        except OSError as exc:
            raise FeedError(f"cannot reach the driver's feed at {spec.host}:{spec.port}: {exc}") from None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greeting = receive(conn, deadline, "the feed's nonce", HELLO_LIMIT)
            if greeting.get("busy") is True and time.monotonic() + BUSY_RETRY < deadline:
                conn.close()
                time.sleep(BUSY_RETRY)  # too many handshakes at the hub (strangers?): try again
                continue
            nonce = greeting.get("nonce")
            if not isinstance(nonce, bytes):
                raise FeedError("the feed's greeting has no nonce (too many connections in their handshake)"
                                if greeting.get("busy") else "the feed's greeting has no nonce")
            send(conn, {**hello, "mac": _mac(secret, nonce)})
            conn.settimeout(spec.timeout)
            return conn
        except (OSError, FeedError) as exc:
            conn.close()
            raise FeedError(f"the handshake with the driver's feed failed: {exc}") from None


# -- columns --------------------------------------------------------------------------------------------

def to_columns(rows: list[tuple], columns: tuple[Column, ...], where: str) -> dict[str, Any]:
    """``rows`` (tuples in the order of ``columns``) as one array or list per column.  Raises TaskFailed
    for a null in a numeric column or arrays of different lengths in one."""
    out: dict[str, Any] = {}
    for i, column in enumerate(columns):
        values = [row[i] for row in rows]
        if column.kind == "list":
            out[column.name] = values
            continue
        try:
            array = np.array(values, dtype=column.kind.removeprefix("array:"))
        except (TypeError, ValueError) as exc:
            raise TaskFailed(f"column {column.name!r} of {where} cannot be fed ({exc}): nulls or arrays of "
                             "different lengths; fill or drop them first") from None
        if array.ndim != (2 if column.kind.startswith("array:") else 1) and len(rows):
            raise TaskFailed(f"column {column.name!r} of {where}: arrays of different lengths")
        out[column.name] = array
    return out


def _take(column: Any, start: int, step: int) -> Any:
    return column[start::step]


def _concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    return [value for part in parts for value in part]


class _Pending:
    """One worker's dealt rows not yet cut into a batch."""

    def __init__(self) -> None:
        self.parts: list[dict[str, Any]] = []
        self.count = 0

    def add(self, part: dict[str, Any], count: int) -> None:
        self.parts.append(part)
        self.count += count

    def take(self, count: int) -> dict[str, Any]:
        """The first ``count`` rows (all of them when fewer)."""
        names = list(self.parts[0])
        whole = {name: _concat([part[name] for part in self.parts]) for name in names}
        count = min(count, self.count)
        self.count -= count
        self.parts = [{name: column[count:] for name, column in whole.items()}] if self.count else []
        return {name: column[:count] for name, column in whole.items()}


# -- the driver's hub -------------------------------------------------------------------------------------

class _Slot:
    """A worker's queue of batches (``("batch", columns, n)``, ``("end", epoch)``, ``("error", text)``)."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue(QUEUE_BATCHES)
        self.gone = threading.Event()
        self.connected = False


class FeedHub:
    """The driver's side of the feed (see the module's doc): it deals the feed tasks' rows to the
    workers' queues and serves each worker's requests.  ``begin_epoch``/``end_epoch`` frame an epoch;
    ``fail`` hands every worker an error; ``close`` stops it."""

    def __init__(self, secret: str, num_workers: int, epochs: int, batch_size: int, timeout: float) -> None:
        self.secret, self.num_workers, self.epochs = secret, num_workers, epochs
        self.batch_size, self.timeout = batch_size, timeout
        self.slots = [_Slot() for _ in range(num_workers)]
        self.listener = socket.create_server(("", 0))
        self.port = self.listener.getsockname()[1]
        self.error: str | None = None
        self._deal_lock = threading.Lock()
        self._epoch = -1
        self._offset = 0
        self._fed: set[int] = set()
        self._pending = [_Pending() for _ in range(num_workers)]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept, name="kvstore-spark-feed", daemon=True)
        self._thread.start()

    # the epochs (called by the driver's epoch loop)

    def begin_epoch(self, epoch: int) -> None:
        """Accept the feed tasks of ``epoch`` from now on."""
        with self._deal_lock:
            self._epoch, self._offset, self._fed = epoch, 0, set()

    def end_epoch(self, epoch: int) -> int:
        """The epoch's feed job has ended (every task's rows are dealt): queue each worker's last batch
        and the end mark.  Returns the number of rows dealt.  Raises FeedError (a worker's queue stayed
        full past the timeout, or the hub closed)."""
        with self._deal_lock:
            for rank, pending in enumerate(self._pending):  # every rank's last batch before any end mark
                if pending.count:
                    count = pending.count
                    self._put(rank, ("batch", pending.take(count), count))
            for rank in range(self.num_workers):
                self._put(rank, ("end", epoch))
            self._epoch = -1
            return self._offset

    def fail(self, message: str) -> None:
        """Hand every worker ``message`` as its next reply (queued batches are dropped)."""
        self.error = message
        for slot in self.slots:
            while True:
                try:
                    slot.queue.get_nowait()
                except queue.Empty:
                    break
            try:
                slot.queue.put_nowait(("error", message))
            except queue.Full:  # a dealer refilled it meanwhile: its put sees the error first
                pass

    def close(self) -> None:
        """Stop listening and end every connection (waits stop at their next check)."""
        self._closed.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (Linux)
        except OSError:
            pass
        self.listener.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(2.0)

    # connections

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                self._closed.wait(POLL)  # e.g. out of file descriptors: try again
                continue
            if not self._handshakes.acquire(blocking=False):
                self._refuse(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="kvstore-spark-feed-conn",
                                 daemon=True).start()
            except RuntimeError:  # no thread to be had
                self._handshakes.release()
                conn.close()

    @staticmethod
    def _refuse(conn: socket.socket) -> None:
        """Answer ``busy`` (too many connections in their handshake) and close, without waiting."""
        with conn:
            try:
                conn.setblocking(False)
                send(conn, {"busy": True})
            except OSError:
                pass

    def _serve(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            with conn:
                hello = self._handshake(conn)
                if hello is None:
                    return  # not one of this job's tasks: dropped without a word
                conn.settimeout(self.timeout)
                if hello.get("role") == "worker":
                    self._serve_worker(conn, hello.get("rank"))
                elif hello.get("role") == "feeder":
                    self._serve_feeder(conn, hello.get("epoch"), hello.get("partition"))
        except (OSError, FeedError):
            pass  # the peer's side reports its own error; a dead peer is noticed by its slot
        except Exception:  # a node never dies of a message: only this connection ends
            log.exception("the Spark feed dropped a connection on an unexpected error")
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    def _handshake(self, conn: socket.socket) -> dict | None:
        """Send a nonce and read the hello (:data:`HELLO_LIMIT` bytes, :data:`HANDSHAKE_SECONDS`): the
        hello when its HMAC is right, else None.  Frees the handshake's place.  Raises OSError, FeedError."""
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_SECONDS)
            nonce = os.urandom(NONCE_BYTES)
            send(conn, {"nonce": nonce})
            hello = receive(conn, time.monotonic() + HANDSHAKE_SECONDS, "a feed connection's hello",
                            HELLO_LIMIT)
        finally:
            self._handshakes.release()
        mac = hello.get("mac")
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, _mac(self.secret, nonce)):
            return None
        return hello

    def _serve_worker(self, conn: socket.socket, rank: Any) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.num_workers or self.slots[rank].connected:
            send(conn, {"op": "error", "message": f"worker rank {rank!r} is not one this feed expects"})
            return
        slot = self.slots[rank]
        slot.connected = True
        try:
            while True:
                request = receive(conn, float("inf"), f"worker {rank}'s request")  # ends when it leaves
                if request.get("op") != "next":
                    return
                item = self._next_item(rank)
                if item[0] == "batch":
                    send(conn, {"op": "batch", "n": item[2],
                                "cols": {name: _encode(col) for name, col in item[1].items()}})
                elif item[0] == "end":
                    send(conn, {"op": "end", "epoch": item[1]})
                    if item[1] == self.epochs - 1:
                        receive(conn, float("inf"), "worker's goodbye")  # nothing more: wait for its close
                        return
                else:
                    send(conn, {"op": "error", "message": item[1]})
                    return
        finally:
            slot.gone.set()
            while True:  # what a dealer put is dropped; later puts see `gone`
                try:
                    slot.queue.get_nowait()
                except queue.Empty:
                    break

    def _next_item(self, rank: int) -> tuple:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self.slots[rank].queue.get(timeout=min(POLL, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if self._closed.is_set():
                    return ("error", "the driver's feed closed")
                if time.monotonic() >= deadline:
                    epoch = self._epoch
                    which = f"of epoch {epoch}" if epoch >= 0 else "of the next epoch"
                    return ("error", f"no batch for worker {rank} within {self.timeout:g} s (feed_timeout; "
                            f"the feed job {which} did not deliver: is there a task slot free for it beside "
                            "the barrier stage?)")

    def _serve_feeder(self, conn: socket.socket, epoch: Any, partition: Any) -> None:
        what = f"the feed task of partition {partition} (epoch {epoch})"
        with self._deal_lock:
            expected = epoch == self._epoch and isinstance(partition, int) and partition not in self._fed
            refused = None if expected else (f"{what} is not expected now (a retried feed task cannot be "
                                             "taken: rows it already sent were dealt)")
            if expected:
                self._fed.add(partition)
        if refused:
            send(conn, {"op": "error", "message": refused})
            return
        dealt = 0
        try:
            while True:
                message = receive(conn, time.monotonic() + self.timeout, f"rows from {what}")
                if message.get("op") == "end":
                    if message.get("n") != dealt:
                        raise FeedError(f"{what} says it sent {message.get('n')} rows; {dealt} came")
                    send(conn, {"op": "ok", "n": dealt})
                    return
                count, raw_cols = message.get("n"), message.get("cols")
                if not isinstance(raw_cols, dict):
                    raise FeedError(f"{what} sent a chunk without columns")
                cols = {name: _decode(raw, what) for name, raw in raw_cols.items()}
                if not isinstance(count, int) or any(len(col) != count for col in cols.values()):
                    raise FeedError(f"{what} sent a chunk whose columns do not have its {count} rows")
                self._deal(cols, count)
                dealt += count
        except FeedError as exc:
            send(conn, {"op": "error", "message": str(exc)})

    def _deal(self, cols: dict[str, Any], count: int) -> None:
        """Row ``i`` of the epoch to worker ``i % W``; full batches to the workers' queues."""
        workers = self.num_workers
        with self._deal_lock:
            for rank in range(workers):
                start = (rank - self._offset) % workers
                if start >= count:
                    continue
                self._pending[rank].add({name: _take(col, start, workers) for name, col in cols.items()},
                                        len(range(start, count, workers)))
            self._offset += count
            self._hand_out()

    def _hand_out(self) -> None:
        """Queue the full batches of every worker's dealt rows one batch per worker per round, so that
        no worker is more than one batch ahead of another: a put that blocks on a full queue never
        leaves another worker (waiting at the same collective step) without its batch."""
        while True:
            ready = [rank for rank, pending in enumerate(self._pending) if pending.count >= self.batch_size]
            if not ready:
                return
            for rank in ready:
                self._put(rank, ("batch", self._pending[rank].take(self.batch_size), self.batch_size))

    def _put(self, rank: int, item: tuple) -> None:
        """Queue ``item`` for worker ``rank`` (dropped once it has left).  Raises FeedError when its
        queue stays full for the timeout, the hub closes or fails."""
        slot = self.slots[rank]
        deadline = time.monotonic() + self.timeout
        while not slot.gone.is_set():
            if self._closed.is_set() or self.error is not None:
                raise FeedError(self.error or "the driver's feed closed")
            try:
                slot.queue.put(item, timeout=POLL)
                return
            except queue.Full:
                if time.monotonic() >= deadline:
                    raise FeedError(f"worker {rank} took no batch within {self.timeout:g} s "
                                    "(feed_timeout)") from None


# -- a feed task ------------------------------------------------------------------------------------------

def feed_partition(spec: FeedSpec, secret: str, epoch: int, partition: int,
                   rows: Iterable[Any]) -> Iterator[int]:
    """Send partition ``partition`` of epoch ``epoch`` to the hub, ``spec.chunk_rows`` rows at a time;
    yield its row count once the hub has dealt them.  Raises TaskFailed."""
    where = f"partition {partition} of epoch {epoch}"
    try:
        conn = connect(spec, secret, {"role": "feeder", "epoch": epoch, "partition": partition})
    except FeedError as exc:
        raise TaskFailed(f"feed task of {where}: {exc}") from None
    with conn:
        sent, chunk = 0, []
        try:
            for row in rows:
                chunk.append(tuple(row))
                if len(chunk) >= spec.chunk_rows:
                    send(conn, {"op": "rows", "n": len(chunk), "cols": _encoded(chunk, spec, where)})
                    sent, chunk = sent + len(chunk), []
            if chunk:
                send(conn, {"op": "rows", "n": len(chunk), "cols": _encoded(chunk, spec, where)})
                sent += len(chunk)
            send(conn, {"op": "end", "n": sent})
            reply = receive(conn, time.monotonic() + spec.timeout, f"the driver's receipt for {where}")
        except (OSError, FeedError) as exc:
            raise TaskFailed(f"feed task of {where}: {exc}") from None
    if reply.get("op") != "ok":
        raise TaskFailed(f"feed task of {where}: the driver refused it: {reply.get('message')}")
    yield sent


def _encoded(rows: list[tuple], spec: FeedSpec, where: str) -> dict[str, Any]:
    return {name: _encode(col) for name, col in to_columns(rows, spec.columns, where).items()}


# -- a worker -------------------------------------------------------------------------------------------

class WorkerFeed:
    """``train_fn``'s first argument under ``epochs=E``: iterating it gives E iterators, one per epoch in
    order, each of this worker's batches of that epoch: dicts of column name to a numpy array (a 2-D one
    for an array column) or a list (strings, bytes), of ``batch_size`` rows but the epoch's last.
    An epoch left before its end is skipped to its end when the next one starts.

    ``epochs`` and ``rank`` say what it is; ``rows_seen`` counts the rows handed out.  Raises
    :class:`FeedError` when the feed fails or no batch comes within ``feed_timeout``."""

    def __init__(self, spec: FeedSpec, secret: str, rank: int) -> None:
        self.epochs, self.rank, self.rows_seen = spec.epochs, rank, 0
        self._spec = spec
        self._conn: socket.socket | None = connect(spec, secret, {"role": "worker", "rank": rank})
        self._ended = 0  # epochs whose end mark came
        self._asked = 0
        for _ in range(PREFETCH):
            self._ask()

    def __iter__(self) -> Iterator[Iterator[dict[str, Any]]]:
        for epoch in range(self.epochs):
            yield self._batches(epoch)

    def _ask(self) -> None:
        if self._conn is not None:
            try:
                send(self._conn, {"op": "next"})
            except OSError as exc:
                raise FeedError(f"worker {self.rank} cannot ask the driver's feed for a batch: "
                                f"{exc}") from None

    def _reply(self) -> dict:
        if self._conn is None:
            raise FeedError(f"worker {self.rank}'s feed is closed")
        message = receive(self._conn, time.monotonic() + self._spec.timeout + 30.0,
                          f"a batch of epoch {self._ended} for worker {self.rank} from the driver's feed")
        if message.get("op") == "error":
            raise FeedError(f"worker {self.rank}: {message.get('message')}")
        if not (message.get("op") == "end" and message.get("epoch") == self.epochs - 1):
            self._ask()
        return message

    def _batches(self, epoch: int) -> Iterator[dict[str, Any]]:
        while self._ended < epoch:  # an earlier epoch left before its end
            if self._reply().get("op") == "end":
                self._ended += 1
        while self._ended == epoch:
            message = self._reply()
            if message.get("op") == "end":
                self._ended += 1
                return
            batch = {name: _decode(raw, "a batch") for name, raw in (message.get("cols") or {}).items()}
            self.rows_seen += int(message.get("n") or 0)
            yield batch

    def close(self) -> None:
        """Leave the feed (the hub drops this worker's later rows)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

"""A server's counters and its stall inspector (issue 21; the schema is docs/observability.md).

The request loop counts bytes, refusals and each closed round's wait; once a second (:meth:`tick`)
it copies its gauges (keys, open rounds, bytes held) and looks for sync rounds that have waited
longer than ``KVSTORE_STALL_WARN`` (logged once per round, naming the workers it waits for and what
each last did here) or ``KVSTORE_STALL_ABORT`` (the pulls waiting on it are answered with a
:class:`StallError`).  The heartbeat thread reads :meth:`snapshot`: one lock guards the counters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.core.partition import Key
from kvstore.core.shard import ShardState
from kvstore.core.stats import Counters, Histogram, node_snapshot, snapshot_size
from kvstore.errors import StallError
from kvstore.net import timeline
from kvstore.net.protocol import Op

log = logging.getLogger("kvstore.server")
TICK = 1.0  # seconds between two looks at the gauges and the open rounds
LATE_LOG_EVERY = 10.0  # seconds between two warnings about one worker's late pushes
MAX_TABLES = 32  # dynamic tables whose counters a snapshot carries at most ...
MAX_TABLES_BYTES = 24 * 1024  # ... within this estimated size (the snapshot stays under its 64 KiB)
MAX_NAME = 64  # characters of a table's name in a snapshot (a longer one is cut and given a hash)


def short_name(name: str) -> str:
    """``name`` as a snapshot carries it: itself up to ``MAX_NAME`` characters, else its first ones,
    ``~`` and 16 hex digits of its hash (two long names stay apart)."""
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{name[:MAX_NAME - 17]}~{digest}"


def bounded_tables(tables: dict[str, dict]) -> dict[str, dict]:
    """The first of ``tables`` (counters by name) that fit a snapshot: at most ``MAX_TABLES``, names
    cut by :func:`short_name`, within ``MAX_TABLES_BYTES`` estimated."""
    out: dict[str, dict] = {}
    left = MAX_TABLES_BYTES
    for name, counters in tables.items():
        name = short_name(name)
        size = snapshot_size({name: counters}, left)
        if len(out) == MAX_TABLES or size > left:
            break
        out[name] = counters
        left -= size
    return out


_CONNECTING = frozenset({"shm_attach", "link"})  # a worker's requests as it connects, not its job's

class ServerMeter:
    """The counters of one server, and what each worker last did here."""

    def __init__(self, host: str, stall_warn: float, stall_abort: float | None) -> None:
        self.rank, self.host = -1, host
        self.stall_warn, self.stall_abort = stall_warn, stall_abort
        self._lock = threading.Lock()
        self.counters = Counters(self._lock)
        self.round_wait = Histogram(self._lock)
        self.started = time.time()
        self.last_round: dict[str, Any] | None = None
        self.last_by_worker: dict[int, tuple[str, float]] = {}  # worker -> (op, unix time)
        self._warned: dict[Key, float] = {}  # stalled key -> how long its round had waited last tick
        self.extra_held: Callable[[], int] = lambda: 0  # bytes held outside the shard (row-sparse tables)
        self.extra_tables: Callable[[], dict[str, dict]] = dict  # dynamic tables' counters, by key
        # rounds open outside the shard (row-sparse tables): as ShardState.stalled
        self.extra_stalled: Callable[[float], list[tuple[Key, float, list[int]]]] = lambda older_than: []
        self.dynamic_tables: dict[str, dict] = {}  # their copy at the last tick
        self._next_tick = 0.0
        self.dropped: dict[str, int] = {}  # refusals of the request loop (authentication, ...)
        self._late_logged: dict[int, tuple[float, int]] = {}  # worker -> (last warning, late since)
        self.timeline = timeline.recorder("server", lambda: self.rank)  # KVSTORE_TIMELINE, else None

    def request(self, worker: int | None, op: str, nbytes: int) -> None:
        """Count one request of ``worker`` carrying ``nbytes`` of arrays; a worker's last op is a request
        of the job's (its same-host link and shared-memory offer at connection are not)."""
        self.counters.add("bytes_in", nbytes)
        if worker is not None and op not in _CONNECTING:
            with self._lock:
                self.last_by_worker[worker] = (op, time.time())

    def replied(self, nbytes: int) -> None:
        """Count ``nbytes`` of arrays sent back."""
        self.counters.add("bytes_out", nbytes)

    def refused(self, reason: str) -> None:
        """Count one request refused for ``reason`` (an error class name)."""
        self.counters.add_label("refused", reason)

    def round_closed(self, key: Key, waited: float, last: int, count: int = 1) -> None:
        """ShardState's report of a closed round: its wait from first to last arrival, and who came last
        (``count``: a key group's round, one round of each of its ``count`` keys, observed once)."""
        self.round_wait.observe(waited)
        self.counters.add("rounds_applied", count)
        if last >= 0:
            self.counters.add_label("last_arrivals", str(last), count)
        with self._lock:
            self.last_round = {"key": str(key), "waited_s": waited, "last_worker": last}
        if self.timeline is not None:  # the round, from its first contribution to its update
            now = time.time()
            self.timeline.span(f"round {str(key)[:40]}", "server", now - waited, now,
                               {"key": str(key)[:200], "last_worker": last, "waited_s": waited})

    def late_push(self, key: Key, worker: int, number: int) -> None:
        """ShardState's report of a late push (its round closed by quorum): counted per worker, and
        warned about at most once per ``LATE_LOG_EVERY`` seconds per worker."""
        self.counters.add_label("late_pushes", str(worker))
        now = time.monotonic()
        last, since = self._late_logged.get(worker, (-LATE_LOG_EVERY, 0))
        if now - last < LATE_LOG_EVERY:
            self._late_logged[worker] = (last, since + 1)
            return
        self._late_logged[worker] = (now, 0)
        log.warning("dropped a late push of key %r from worker %d: its round %d was already applied by "
                    "quorum (KVSTORE_SYNC_QUORUM)%s", key, worker, number,
                    f"; {since} more since the last warning" if since else "")

    def tick(self, state: ShardState, abort: Callable[[Key, StallError], None],
             dropped: dict[str, int]) -> None:
        """Once a second: copy the gauges (and ``dropped``, the request loop's refusals by reason)
        and inspect stalled rounds (see the module docstring)."""
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + TICK
        self.dropped = dict(dropped)
        self.counters.set("keys", len(state))
        self.counters.set("open_rounds", state.open_rounds())
        self.counters.set("held_bytes", state.nbytes() + state.held_bytes() + self.extra_held())
        self.counters.set("max_lead", state.gate.max_lead if state.gate is not None else 0)
        tables = bounded_tables(self.extra_tables())
        with self._lock:
            self.dynamic_tables = tables
        warned = {}
        for key, waited, late in [*state.stalled(self.stall_warn), *self.extra_stalled(self.stall_warn)]:
            before = self._warned.get(key)
            warned[key] = waited
            if before is None or waited < before:  # once per round: a shorter wait is a newer round
                log.warning("a sync round of key %r has waited %.0f s (KVSTORE_STALL_WARN=%g) for %s",
                            key, waited, self.stall_warn, self.describe(late))
        self._warned = warned
        if self.stall_abort is not None:
            for key, waited, late in [*state.stalled(self.stall_abort),
                                      *self.extra_stalled(self.stall_abort)]:
                abort(key, StallError(f"the sync round of key {key!r} waited {waited:.0f} s for "
                                      f"{self.describe(late)} (KVSTORE_STALL_ABORT={self.stall_abort:g})"))

    def describe(self, workers: list[int]) -> str:
        """``worker 1 (last here: push, 12 s ago), worker 3 (never seen here)``."""
        now, parts = time.time(), []
        with self._lock:
            seen_by = {worker: self.last_by_worker.get(worker) for worker in workers}
        for worker, seen in seen_by.items():
            what = "never seen here" if seen is None else f"last here: {seen[0]}, {now - seen[1]:.0f} s ago"
            parts.append(f"worker {worker} ({what})")
        return ", ".join(parts) or "no worker"

    def snapshot(self) -> dict[str, Any]:
        """This server's node snapshot (schema 1)."""
        counts = self.counters.snapshot()
        with self._lock:
            last_round = None if self.last_round is None else dict(self.last_round)
            recent = max(self.last_by_worker.values(), key=lambda seen: seen[1], default=None)
            tables = self.dynamic_tables
        snap = node_snapshot("server", self.rank, self.host, os.getpid(), self.started, time.time(),
                             *(recent if recent is not None else (None, None)))
        snap.update({
            "bytes_in": int(counts.get("bytes_in", 0)), "bytes_out": int(counts.get("bytes_out", 0)),
            "rounds_applied": int(counts.get("rounds_applied", 0)), "keys": int(counts.get("keys", 0)),
            "last_arrivals": {w: int(n) for w, n in counts.get("last_arrivals", {}).items()},
            "round_wait": self.round_wait.snapshot(), "last_round": last_round,
            "open_rounds": int(counts.get("open_rounds", 0)), "held_bytes": int(counts.get("held_bytes", 0)),
            "late_pushes": {w: int(n) for w, n in counts.get("late_pushes", {}).items()},
            "max_lead": int(counts.get("max_lead", 0)),
            "refused": {**self.dropped, **{r: int(n) for r, n in counts.get("refused", {}).items()}},
        })
        if tables:  # only a server holding dynamic tables reports them
            snap["dynamic_tables"] = tables
        return snap


def record_arrivals(path: str, rank: int, handlers: dict[Op, Any]) -> dict[Op, Any]:
    """``handlers`` with each INIT, PUSH, PULL and PUSHPULL request appended, as it arrives, to the file
    ``path`` as one JSON line (server, op, sender, keys, chunk offset ``lo``, the wall clock ``t``).  A
    test hook (``KVSTORE_TEST_ARRIVALS``), installed at start only when set: the order a worker's
    ``priority`` gave its requests (tests/integration/test_priority.py), whether a push went out held
    with its pull, and when a lone push arrived (benchmarks/msg_cpu.py)."""
    out = open(path, "a", buffering=1)  # noqa: SIM115 - one line per request until the process ends

    def wrap(op: Op, handler: Any) -> Any:
        def recorded(identity: bytes, msg: Any) -> None:
            body = msg.body if isinstance(msg.body, dict) else {}
            keys = body.get("keys", [body["key"]] if "key" in body else [])
            line = {"server": rank, "op": op.name, "sender": msg.sender,
                    "keys": [str(k) for k in keys] if isinstance(keys, list) else [], "lo": body.get("lo"),
                    "t": time.time()}
            out.write(json.dumps(line) + "\n")
            handler(identity, msg)
        return recorded
    data = (Op.INIT, Op.PUSH, Op.PULL, Op.PUSHPULL)
    return {op: wrap(op, h) if op in data else h for op, h in handlers.items()}

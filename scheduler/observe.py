"""The scheduler's counters, every node's latest snapshot, barrier timing and the STATUS reply.

Pure bookkeeping (no sockets, no clock: the caller passes monotonic ``now`` and wall ``wall``);
the schema is docs/observability.md's.  What a node sends is checked
(:func:`kvstore.core.stats.check_snapshot`) and only the latest one per known node is kept, so
the memory held is bounded by the cluster's size.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvstore.core import stats as kvstats

STATUS_BUDGET = 768 * 1024  # estimated bytes of node snapshots one STATUS reply carries, at most
REASON_MALFORMED = "malformed"
REASON_TOO_BIG = "too-big"
REASON_UNKNOWN = "unknown-node"
POLL_RATE = 10.0  # STATUS replies a connection may get a second, on average ...
POLL_BURST = 20  # ... and in a burst (kvstore.status asks at most 10 a second, waiting for each)
POLLERS = 4096  # connections whose rate is kept (the least recently heard forgotten first)


class PollGate:
    """Bounds the STATUS replies per connection (a token bucket of ``burst`` refilled at ``rate`` a
    second), so a poller that never reads its replies cannot queue more than that in the scheduler.
    Remembers ``capacity`` connections at most."""

    def __init__(self, rate: float = POLL_RATE, burst: int = POLL_BURST, capacity: int = POLLERS) -> None:
        self.rate, self.burst, self.capacity = rate, burst, capacity
        self._tokens: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # -> (tokens, at)

    def allow(self, identity: bytes, now: float) -> bool:
        """Whether the connection ``identity`` may have a reply now (``now``: monotonic seconds)."""
        tokens, at = self._tokens.pop(identity, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        allowed = tokens >= 1.0
        self._tokens[identity] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)
        return allowed


class SchedulerStats:
    """Joins, losses, barriers and each worker's time in them; the nodes' latest snapshots."""

    def __init__(self, now: float, wall: float) -> None:
        self.started, self.started_wall = now, wall
        self.joins = self.losses = self.barriers = 0
        self.barrier_wait_s: dict[int, float] = {}  # worker rank -> seconds waited in barriers
        self.arrived: dict[int, float] = {}  # worker rank -> when it entered the open barrier
        self.opened_at: float | None = None  # when the open barrier's first worker arrived
        self.warned = False  # the open barrier's stall has been logged
        self.snapshots: dict[tuple[str, int], tuple[dict[str, Any], int]] = {}  # -> (snapshot, size)
        self.heard: dict[tuple[str, int], float] = {}  # (role, rank) -> last heartbeat
        self.refused: dict[str, int] = {}  # snapshots refused, by reason
        self.last_op: str | None = None
        self.last_op_at: float | None = None  # wall time

    def did(self, op: str, wall: float) -> None:
        """Record the scheduler's own last op (a registration, barrier, leave)."""
        self.last_op, self.last_op_at = op, wall

    # -- barriers -----------------------------------------------------------------------------------

    def arrive(self, rank: int, now: float) -> None:
        """Worker ``rank`` entered the barrier (a retry keeps its first arrival)."""
        if not self.arrived:
            self.opened_at, self.warned = now, False
        self.arrived.setdefault(rank, now)

    def depart(self, ranks: list[int] | None, now: float) -> None:
        """``ranks`` (None: every waiting worker) left the barrier; add their time in it."""
        for rank in list(self.arrived) if ranks is None else ranks:
            since = self.arrived.pop(rank, None)
            if since is not None:
                self.barrier_wait_s[rank] = self.barrier_wait_s.get(rank, 0.0) + max(0.0, now - since)
        if not self.arrived:
            self.opened_at = None

    def released(self, now: float) -> None:
        """The barrier completed: every waiting worker goes through."""
        self.barriers += 1
        self.depart(None, now)

    def open_for(self, now: float) -> float | None:
        """Seconds the current barrier has been open; None when no worker waits in one."""
        return None if self.opened_at is None else max(0.0, now - self.opened_at)

    # -- snapshots ----------------------------------------------------------------------------------

    def heartbeat(self, role: str, rank: int, snapshot: Any, known: bool, now: float) -> str | None:
        """Record a heartbeat of a node and its snapshot (None when it sent none); return why the
        snapshot was refused, or None.  Only ``known`` nodes (in the map) are remembered."""
        if not known:
            return self._refuse(REASON_UNKNOWN) if snapshot is not None else None
        self.heard[(role, rank)] = now
        if snapshot is None:
            return None
        try:
            size = kvstats.check_snapshot(snapshot, role, rank)
        except ValueError as exc:
            return self._refuse(REASON_TOO_BIG if "bytes" in str(exc) else REASON_MALFORMED, str(exc))
        self.snapshots[(role, rank)] = (snapshot, size)
        return None

    def _refuse(self, reason: str, detail: str = "") -> str:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return f"{reason}: {detail}" if detail else reason

    def latest(self, role: str, rank: int) -> dict[str, Any] | None:
        """The latest snapshot of ``(role, rank)``, or None."""
        entry = self.snapshots.get((role, rank))
        return entry[0] if entry else None

    def node_snapshots(self, budget: int = STATUS_BUDGET) -> list[dict[str, Any]]:
        """Every node's latest snapshot, servers then workers by rank; past ``budget`` estimated
        bytes in all, a node is listed as ``{"schema", "role", "rank", "truncated": true}``."""
        out, used = [], 0
        for (role, rank), (snapshot, size) in sorted(self.snapshots.items()):
            used += size
            out.append(snapshot if used <= budget else
                       {"schema": kvstats.SCHEMA_VERSION, "role": role, "rank": rank, "truncated": True})
        return out

    def describe_last(self, role: str, rank: int, wall: float) -> str:
        """What ``role rank`` last did, by its latest snapshot: 'last op push 3.1 s ago'."""
        snapshot = self.latest(role, rank)
        if snapshot is None:
            return "no snapshot from it yet"
        op, at = snapshot.get("last_op"), snapshot.get("last_op_at")
        if not isinstance(op, str):
            return "no op yet"
        if isinstance(at, (int, float)) and not isinstance(at, bool):
            return f"last op {op[:40]} {max(0.0, wall - at):.1f} s ago"
        return f"last op {op[:40]}"


def node_rows(nodes: list[tuple[str, int | None, str]], stats: SchedulerStats, left: set[int],
              lost: set[tuple[str, int]], now: float) -> list[dict[str, Any]]:
    """The scheduler snapshot's "nodes": ``nodes`` are (role, rank or None before the map, host)."""
    rows = []
    for role, rank, host in nodes:
        heard = stats.heard.get((role, rank)) if rank is not None else None
        rows.append({"role": role, "rank": rank, "host": host,
                     "heartbeat_age_s": None if heard is None else max(0.0, now - heard),
                     "left": role == "worker" and rank in left,
                     "lost": rank is not None and (role, rank) in lost})
    return rows


def scheduler_snapshot(stats: SchedulerStats, base: dict[str, Any], rows: list[dict[str, Any]],
                       now: float) -> dict[str, Any]:
    """The scheduler's own snapshot: ``base`` (the common fields) and its counters."""
    return dict(base, nodes=rows, joins=stats.joins, losses=stats.losses, barriers=stats.barriers,
                barrier_wait_s={str(r): s for r, s in sorted(stats.barrier_wait_s.items())},
                waiting_in_barrier=sorted(stats.arrived), barrier_open_s=stats.open_for(now),
                snapshots_refused=dict(stats.refused))

"""The text of ``kvstore.status``'s live view, from STATUS replies (pure: no I/O, no clock).

A reply is docs/observability.md's ``{"schema", "cluster", "nodes", "scheduler"}``; rates are the
differences between two successive replies over the seconds between them.  Every field is read
defensively (a node may not have sent a snapshot yet, or run a schema with fewer fields).
"""

from __future__ import annotations

from typing import Any

from kvstore.core.stats import quantile

Key = tuple[str, Any]


def by_node(status: dict[str, Any]) -> dict[Key, dict[str, Any]]:
    """The reply's node snapshots by ``(role, rank)``."""
    return {(n.get("role"), n.get("rank")): n for n in status.get("nodes", []) if isinstance(n, dict)}


def _num(node: dict[str, Any] | None, field: str) -> float:
    value = (node or {}).get(field)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _ops(node: dict[str, Any] | None) -> float:
    ops = (node or {}).get("ops")
    return sum(v for v in ops.values() if isinstance(v, (int, float))) if isinstance(ops, dict) else 0


def rates(now: dict[str, Any] | None, before: dict[str, Any] | None,
          seconds: float) -> dict[str, float] | None:
    """Per-second rates of one node between two snapshots: rounds, ops, bytes in and out; None
    without an earlier snapshot."""
    if now is None or before is None or seconds <= 0:
        return None
    return {"rounds": (_num(now, "rounds_applied") - _num(before, "rounds_applied")) / seconds,
            "ops": (_ops(now) - _ops(before)) / seconds,
            "bytes_in": (_num(now, "bytes_in") - _num(before, "bytes_in")) / seconds,
            "bytes_out": (_num(now, "bytes_out") - _num(before, "bytes_out")) / seconds}


def _arrivals(status: dict[str, Any]) -> dict[str, float]:
    """Rounds each worker (rank as str) was last to arrive in, summed over the servers."""
    total: dict[str, float] = {}
    for (role, _), node in by_node(status).items():
        counts = node.get("last_arrivals") if role == "server" else None
        for rank, n in (counts or {}).items() if isinstance(counts, dict) else ():
            if isinstance(n, (int, float)):
                total[str(rank)] = total.get(str(rank), 0) + n
    return total


def straggler(status: dict[str, Any], previous: dict[str, Any] | None = None) -> str | None:
    """Who the cluster waits for: the workers an open barrier lacks, else the worker most often last
    to arrive in the servers' rounds (since ``previous``, else ever); None when nobody stands out."""
    sched = status.get("scheduler") or {}
    waiting, open_s = sched.get("waiting_in_barrier"), sched.get("barrier_open_s")
    if isinstance(waiting, list) and waiting and isinstance(open_s, (int, float)):
        absent = [f"worker {row.get('rank')}" for row in sched.get("nodes", [])
                  if isinstance(row, dict) and row.get("role") == "worker"
                  and row.get("rank") not in waiting and not row.get("left") and not row.get("lost")]
        if absent:
            return f"a barrier open for {open_s:.1f} s waits for {', '.join(absent)}"
    counts = _arrivals(status)
    if previous is not None:
        before = _arrivals(previous)
        counts = {rank: n - before.get(rank, 0) for rank, n in counts.items()}
    counts = {rank: n for rank, n in counts.items() if n > 0}
    if not counts:
        return None
    rank = max(counts, key=lambda r: counts[r])
    share = counts[rank] / sum(counts.values())
    waits = [node.get("last_round") for (role, _), node in by_node(status).items() if role == "server"]
    waited = [w.get("waited_s") for w in waits if isinstance(w, dict) and str(w.get("last_worker")) == rank]
    detail = f"; its last such round waited {max(waited):.3f} s for it" if waited else ""
    return f"worker {rank}, last to arrive in {share:.0%} of rounds{detail}"


def human_bytes(n: float) -> str:
    """1536 -> '1.5K' (powers of 1024)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def _age(value: Any) -> str:
    return f"{value:.1f}s" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _last_op(node: dict[str, Any] | None, now: float) -> str:
    op, at = (node or {}).get("last_op"), (node or {}).get("last_op_at")
    if not isinstance(op, str):
        return "-"
    return f"{op[:12]} {_age(now - at)} ago" if isinstance(at, (int, float)) else op[:12]


def _activity(role: str, node: dict[str, Any] | None, rate: dict[str, float] | None) -> str:
    """The role-specific columns: rates where two snapshots allow, else totals."""
    if node is None:
        return "(no snapshot yet)"
    if node.get("truncated"):
        return "(snapshot left out: reply size cap)"
    if role == "server":
        extra = f"keys {int(_num(node, 'keys'))} open {int(_num(node, 'open_rounds'))} " \
                f"held {human_bytes(_num(node, 'held_bytes'))}"
        if rate is None:
            return f"rounds {int(_num(node, 'rounds_applied'))} {extra}"
        return (f"{rate['rounds']:8.1f} rounds/s in {human_bytes(rate['bytes_in'])}/s "
                f"out {human_bytes(rate['bytes_out'])}/s {extra}")
    if role == "worker":
        p50 = quantile((node.get("latency") or {}).get("push") or {}, 0.5)
        lat = f" push p50<={p50:g}ms" if p50 is not None else ""
        if rate is None:
            return f"ops {int(_ops(node))}{lat}"
        return (f"{rate['ops']:8.1f} ops/s out {human_bytes(rate['bytes_out'])}/s "
                f"in {human_bytes(rate['bytes_in'])}/s{lat}")
    return ""


def render(status: dict[str, Any], previous: dict[str, Any] | None, seconds: float,
           address: str) -> str:
    """The screen for ``status`` (``previous``: the reply ``seconds`` earlier, for rates)."""
    cluster, sched = status.get("cluster") or {}, status.get("scheduler") or {}
    now = _num(sched, "time")
    state = "complete" if cluster.get("complete") else f"registering {cluster.get('registered')}"
    lines = [f"kvstore cluster at {address}: {cluster.get('mode') or '-'}, "
             f"{cluster.get('num_workers')} workers, {cluster.get('num_servers')} servers, {state}, "
             f"scheduler up {_age(sched.get('uptime_s'))}",
             f"joins {sched.get('joins', 0)}  losses {sched.get('losses', 0)}  "
             f"barriers {sched.get('barriers', 0)}  barrier open {_age(sched.get('barrier_open_s'))}",
             "", f"{'ROLE':<9} {'RANK':>4} {'HOST':<16} {'HEARTBEAT':>9} {'LAST OP':<20} ACTIVITY"]
    snaps, before = by_node(status), by_node(previous) if previous else {}
    for row in sched.get("nodes", []):
        if not isinstance(row, dict):
            continue
        key = (row.get("role"), row.get("rank"))
        node = snaps.get(key)
        flag = " LOST" if row.get("lost") else " left" if row.get("left") else ""
        activity = _activity(str(key[0]), node, rates(node, before.get(key), seconds))
        lines.append(f"{str(key[0]):<9} {str(key[1]):>4} {str(row.get('host'))[:16]:<16} "
                     f"{_age(row.get('heartbeat_age_s')):>9} {_last_op(node, now):<20} {activity}{flag}")
    lines += ["", f"straggler: {straggler(status, previous) or 'none'}"]
    return "\n".join(lines)

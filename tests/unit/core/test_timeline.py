"""kvstore.core.timeline: the bounded ring, a role's part (a Chrome trace) and the merge."""

from __future__ import annotations

import json

from kvstore.core import timeline


def test_ring_keeps_the_most_recent_events() -> None:
    """The ring holds ``capacity`` events and counts every one added."""
    ring = timeline.EventRing(capacity=2)
    for i in range(5):
        ring.span(f"e{i}", "worker", float(i), i + 0.5)
    assert [e[0] for e in ring.events()] == ["e3", "e4"] and ring.added == 5


def test_part_is_a_trace_on_the_scheduler_clock() -> None:
    """A part names its track and moves times by the offset, in microseconds."""
    doc = timeline.part("worker", 1, [("push", "worker", 10.0, 0.25, None)], offset_s=2.0, dropped=3)
    json.dumps(doc, allow_nan=False)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert {"name": "worker 1"} in [e["args"] for e in meta]
    span = next(e for e in doc["traceEvents"] if e["ph"] == "X")
    assert span["ts"] == 12.0e6 and span["dur"] == 0.25e6
    assert span["pid"] == timeline.pid_of("worker", 1) and doc["otherData"]["dropped"] == 3


def test_merge_joins_parts_and_skips_broken_ones() -> None:
    """Every part's events, distinct tracks per role and rank, and no crash on a non-trace."""
    parts = [timeline.part("scheduler", 0, [("barrier", "scheduler", 1.0, 1.0, {"workers": [0]})], 0.0),
             timeline.part("server", 0, [], 0.0), {"nonsense": 1}]
    doc = timeline.merge(parts)
    assert len({e["pid"] for e in doc["traceEvents"]}) == 2
    assert [p["role"] for p in doc["otherData"]["parts"]] == ["scheduler", "server"]
    assert timeline.pid_of("scheduler", 0) < timeline.pid_of("server", 0) < timeline.pid_of("worker", 0)


def test_appended_lines_hold_the_events_part_gives() -> None:
    """A part's head, a line a write and its tail parse as the trace ``part`` builds (same events and
    times); args that are not JSON (a NaN) become text instead of breaking the file."""
    events = [("pu\"sh", "worker", 10.0, 0.25, None), ("round 1", "server", 11.0, 0.5, {"last_worker": 1})]
    text = (timeline.part_head("worker", 1) + timeline.event_lines("worker", 1, events[:1], 2.0)
            + timeline.event_lines("worker", 1, events[1:], 2.0)
            + timeline.part_tail("worker", 1, 2.0, 2, 5, 1, 10))
    doc = json.loads(text)
    assert doc["traceEvents"] == timeline.part("worker", 1, events, 2.0)["traceEvents"]
    assert doc["otherData"]["dropped"] == 3 and timeline.read_part(text) == doc
    odd = timeline.event_lines("worker", 1, [("x", "worker", 1.0, 0.1, {"w": float("nan")})], 0.0)
    assert json.loads("[" + odd[2:] + "]")[0]["args"] == {"text": "{'w': nan}"}

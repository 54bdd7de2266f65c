"""kvstore.net.timeline: the clock offset, a role's part written atomically, the merge of the parts."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.net import timeline


def test_clock_keeps_the_offset_of_the_shortest_round_trip() -> None:
    """The sample with the smallest round trip wins; a reversed one is ignored."""
    clock = timeline.Clock()
    clock.observe(100.0, 100.4, 105.0)  # rtt 0.4, offset 4.8
    clock.observe(200.0, 200.02, 205.01)  # rtt 0.02, offset 5.0
    clock.observe(300.0, 299.0, 0.0)
    assert abs(clock.offset - 5.0) < 1e-9


def test_recorder_writes_its_part_and_the_merge_joins_them(tmp_path: Path) -> None:
    """Each role's part is valid JSON on its own (written only with news and a rank); the merge is one
    trace of all."""
    path = str(tmp_path / "t.json")
    clock = timeline.Clock()
    clock.observe(0.0, 0.0, 1.0)
    rank = {"value": -1}
    worker = timeline.Recorder(path, "worker", lambda: rank["value"], capacity=10, clock=clock)
    worker.span("push", "worker", 5.0, 5.5)
    assert worker.write() is False  # no rank yet
    rank["value"] = 0
    assert worker.write() is True and worker.write() is False  # nothing new the second time
    part = json.loads((tmp_path / "t.json.d" / "worker-0.json").read_text())
    assert next(e for e in part["traceEvents"] if e["ph"] == "X")["ts"] == 6.0e6
    scheduler = timeline.Recorder(path, "scheduler", lambda: 0, clock=clock)
    scheduler.span("barrier", "scheduler", 6.0, 6.1)
    scheduler.close()
    worker.close()
    (tmp_path / "t.json.d" / "broken.json").write_text("{")
    assert timeline.merge_parts(path) == 2
    merged = json.loads(Path(path).read_text())
    assert {e["name"] for e in merged["traceEvents"] if e["ph"] == "X"} == {"push", "barrier"}
    assert not list((tmp_path / "t.json.d").glob("*.tmp"))


def test_no_recorder_without_the_variable(tmp_path: Path) -> None:
    """KVSTORE_TIMELINE unset: no recorder; set: one per role and path, reused."""
    assert timeline.recorder("worker", lambda: 0, environ={}) is None
    env = {"KVSTORE_TIMELINE": str(tmp_path / "x.json")}
    first = timeline.recorder("server", lambda: 0, environ=env)
    assert first is not None and timeline.recorder("server", lambda: 1, environ=env) is first
    assert first.rank() == 1
    first.close()
    assert timeline.merge_parts(str(tmp_path / "missing.json")) == 0

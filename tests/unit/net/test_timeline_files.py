"""kvstore.net.timeline: the clock offset, a role's part written atomically, the merge of the parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def _spans(doc: dict) -> list[str]:
    return [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]


@pytest.fixture
def no_writer_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorders' writing threads wait an hour between writes: only the test's writes write."""
    monkeypatch.setattr(timeline, "WRITE_EVERY", 3600.0)


def test_a_write_appends_the_new_events_only(tmp_path: Path, no_writer_thread: None) -> None:
    """A write keeps the part's earlier bytes and adds the new events' lines; when the part is full
    it moves whole, unchanged, to .prev.json and the new events start a new part."""
    path = str(tmp_path / "t.json")
    rec = timeline.Recorder(path, "worker", lambda: 0, capacity=100)
    for i in range(60):
        rec.span(f"e{i}", "worker", float(i), i + 0.5)
    assert rec.write()
    part = tmp_path / "t.json.d" / "worker-0.json"
    before = part.read_bytes()
    for i in range(60, 100):
        rec.span(f"e{i}", "worker", float(i), i + 0.5)
    assert rec.write()
    full = part.read_bytes()
    head = before[:before.rindex(b"\n]")]
    assert full.startswith(head) and full[len(head):].count(b'"ph":"X"') == 40
    assert _spans(json.loads(full)) == [f"e{i}" for i in range(100)]
    rec.span("late", "worker", 200.0, 200.5)
    assert rec.write()
    assert (tmp_path / "t.json.d" / "worker-0.prev.json").read_bytes() == full
    assert _spans(json.loads(part.read_bytes())) == ["late"]
    rec.close()


def test_a_full_part_rotates_and_the_merge_keeps_the_most_recent(tmp_path: Path,
                                                                 no_writer_thread: None) -> None:
    """Past ``capacity`` events the part moves to .prev.json (two generations on disk, no more); the
    merge gives the role's most recent ``capacity`` events and counts the rest as dropped."""
    path = str(tmp_path / "t.json")
    rec = timeline.Recorder(path, "server", lambda: 1, capacity=10)
    for i in range(35):
        rec.span(f"e{i}", "server", float(i), i + 0.5)
        if i % 4 == 3:
            rec.write()
    rec.close()
    files = sorted(p.name for p in (tmp_path / "t.json.d").iterdir())
    assert files == ["server-1.json", "server-1.prev.json"]
    current = json.loads((tmp_path / "t.json.d" / "server-1.json").read_text())
    previous = json.loads((tmp_path / "t.json.d" / "server-1.prev.json").read_text())
    assert len(_spans(current)) + len(_spans(previous)) <= 20
    assert timeline.merge_parts(path) == 1
    merged = json.loads(Path(path).read_text())
    assert _spans(merged) == [f"e{i}" for i in range(25, 35)]
    assert merged["otherData"]["parts"] == [{"role": "server", "rank": 1, "clock_offset_s": 0.0,
                                             "events": 10, "dropped": 25}]


def test_a_part_cut_short_keeps_its_whole_lines(tmp_path: Path, no_writer_thread: None) -> None:
    """A part whose last write was cut off mid-line (a killed process, a full disk) still merges, with
    the events of its earlier writes."""
    path = str(tmp_path / "t.json")
    rec = timeline.Recorder(path, "worker", lambda: 2, capacity=10)
    for i in range(3):
        rec.span(f"e{i}", "worker", float(i), i + 0.5)
        rec.write()  # a line each
    rec.close()
    part = tmp_path / "t.json.d" / "worker-2.json"
    text = part.read_text()
    part.write_text(text[:text.rindex('"ph":"X"') + 4])  # the last event's line cut in its middle
    assert timeline.merge_parts(path) == 1
    assert _spans(json.loads(Path(path).read_text())) == ["e0", "e1"]


def test_a_write_costs_in_proportion_to_the_new_events(tmp_path: Path, no_writer_thread: None) -> None:
    """With 100,000 events kept, writing 100 new ones takes milliseconds, not the whole ring's dump."""
    import time

    rec = timeline.Recorder(str(tmp_path / "t.json"), "worker", lambda: 0)
    for i in range(timeline.core.CAPACITY):
        rec.span("push", "worker", float(i), i + 0.5)
    assert rec.write()
    for i in range(100):
        rec.span("pull", "worker", float(i), i + 0.5)
    started = time.thread_time()
    assert rec.write()
    assert time.thread_time() - started < 0.05
    rec.close()


def test_a_part_on_an_object_store_is_written_whole_when_due_and_at_close(monkeypatch: pytest.MonkeyPatch,
                                                                          no_writer_thread: None) -> None:
    """Under a storage URL (fsspec's memory://) a part is kept in memory and written whole at most every
    REMOTE_EVERY seconds and at close; it rotates and merges there as on a disk."""
    pytest.importorskip("fsspec")
    import uuid

    from kvstore.core import storage

    path = f"memory://timeline-{uuid.uuid4().hex}/t.json"
    part = f"{path}.d/server-1.json"
    rec = timeline.Recorder(path, "server", lambda: 1, capacity=10)
    rec.span("e0", "server", 0.0, 0.5)
    assert rec.write()  # the first write stores the part (its start)
    stored = json.loads(storage.read_text(part))
    rec.span("e1", "server", 1.0, 1.5)
    assert rec.write()  # within REMOTE_EVERY: kept in memory
    assert json.loads(storage.read_text(part)) == stored
    for i in range(2, 25):
        rec.span(f"e{i}", "server", float(i), i + 0.5)
    rec.close()  # the last write stores, rotating past capacity on the way
    assert sorted(storage.listdir(f"{path}.d")) == ["server-1.json", "server-1.prev.json"]
    assert timeline.merge_parts(path) == 1
    assert _spans(json.loads(storage.read_text(path))) == [f"e{i}" for i in range(15, 25)]

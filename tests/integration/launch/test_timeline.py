"""KVSTORE_TIMELINE end to end: a 2-worker job with a slowed worker writes a Chrome trace that parses,
has a track for every role, and shows the slowed worker last in the servers' rounds."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import finish, launch

pytestmark = pytest.mark.timeout(90)
SCRIPT = str(Path(__file__).parents[1] / "scripts" / "scalar_train.py")


def test_timeline_of_a_job_with_a_slowed_worker(tmp_path: Path) -> None:
    """Every role's events are in the merged trace; worker 1 (slowed 50 ms a step) closes the rounds."""
    trace = tmp_path / "trace.json"
    env = {**os.environ, "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_SHUTDOWN_TIMEOUT": "5",
           "KVSTORE_TIMELINE": str(trace)}
    code, out = finish(launch(["-n", "2", "-s", "1", SCRIPT, "40", "1", "0.05"], env), timeout=60)
    assert code == 0, out
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["scheduler", "server 0", "worker 0", "worker 1"]
    spans = [e for e in events if e.get("ph") == "X"]
    by_track = Counter(names[e["pid"]] for e in spans)
    assert all(by_track[name] > 0 for name in names.values()), by_track
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in spans)
    pushes = Counter(names[e["pid"]] for e in spans if e["name"] == "push")
    assert pushes["worker 0"] == pushes["worker 1"] == 40
    assert any(e["name"] == "barrier" for e in spans if names[e["pid"]] == "scheduler")
    rounds = [e for e in spans if names[e["pid"]] == "server 0" and e["name"].startswith("round")]
    assert len(rounds) >= 40
    last = Counter(e["args"]["last_worker"] for e in rounds)
    assert last[1] >= 0.9 * len(rounds), last  # the slowed worker came last
    for part in sorted((tmp_path / "trace.json.d").iterdir()):  # each role's own file parses too
        assert json.loads(part.read_text())["traceEvents"]

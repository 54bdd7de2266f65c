"""The Scheduler's public surface and its extensions' API: pinned, so neither grows unnoticed."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from kvstore import config as kvconfig
from kvstore.net.inproc import InProcRouter
from kvstore.scheduler.extension import SchedulerAPI
from kvstore.scheduler.scheduler import Scheduler

# The public attributes of a Scheduler before its features became extensions, less ``pipe_book``
# (now the pipes extension's own).  This set may shrink; it must not grow.
SCHEDULER_PUBLIC = {
    "barrier", "cfg", "challenges", "check_liveness", "check_stall", "failed", "hosts", "left", "liveness",
    "lost", "map_at", "map_body", "map_sent", "mode", "port", "rendezvous", "restarts", "run", "servers",
    "service", "session", "snapshot", "stalled", "stats", "status_asks", "status_at", "status_body",
    "stopped_servers", "timeline", "worker_ranks",
}
# What an extension may use of the scheduler (docs/architecture.md lists each member).
EXTENSION_API = {
    "cfg", "challenges", "handle", "handle_late", "reply", "worker_rank", "mode", "lost", "live_servers",
    "declare_lost", "away", "rejoin",
}
FEATURES = ("restarts.py", "pipes.py")


def test_the_schedulers_public_attributes_do_not_grow():
    """dir(Scheduler(...)) without underscores is exactly the pinned set."""
    cfg = kvconfig.load({"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "0",
                         "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "KVSTORE_SECRET": "s"})
    sched = Scheduler(cfg, endpoint=InProcRouter())
    assert {name for name in dir(sched) if not name.startswith("_")} == SCHEDULER_PUBLIC


def test_the_extension_api_has_its_dozen_documented_members():
    """SchedulerAPI's fields are the pinned set, at most 12, and docs/architecture.md names each."""
    names = {field.name for field in dataclasses.fields(SchedulerAPI)}
    assert names == EXTENSION_API and len(names) <= 12
    doc = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    assert [name for name in sorted(names) if not re.search(rf"`{name}[`(]", doc)] == []


def test_features_never_import_the_scheduler():
    """restarts.py and pipes.py reach the scheduler only through the SchedulerAPI they are given."""
    folder = Path(__file__).parents[3] / "scheduler"
    for name in FEATURES:
        tree = ast.parse((folder / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "scheduler" not in imported and not any(m and m.endswith(".scheduler") for m in imported), name

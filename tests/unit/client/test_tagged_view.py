"""A worker keeps the last tagged membership view it passed and re-registers with it, so a restarted
scheduler learns the job's last view back (docs/elastic.md; scheduler/recovery.py)."""

from __future__ import annotations

from typing import Any

from kvstore import config as kvconfig
from kvstore.client.barriers import Barriers
from kvstore.client.joining import WorkerRebind
from kvstore.net.protocol import Message, Op


class _Channel:
    label = "w1-label"

    def reserve(self) -> int:
        return 7


class _Io:
    """What Barriers and WorkerRebind use of the Mux: submit (the reply is scripted) and the channel."""

    rank = 1
    channel = _Channel()

    def __init__(self) -> None:
        self.replies: list[dict] = []

    def submit(self, target: Any, msg: Message, what: str) -> dict:
        return self.replies.pop(0)


def test_a_worker_re_registers_with_the_last_tagged_view_it_passed() -> None:
    """A tagged barrier's reply is kept as {view, left, tag}; a later untagged barrier leaves it; the
    re-registration carries it (and none before any tagged barrier)."""
    cfg = kvconfig.load({"DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "1"})
    io = _Io()
    barriers = Barriers(io, cfg, "dist_sync", 1, 3,
                        lambda requests, timeout, knob: [Message(Op.OK, requests[0])])
    rebind = WorkerRebind(io, cfg, {"servers": []}, "dist_sync", lambda: barriers.passed,
                          lambda: barriers.left, lambda: barriers.tagged)
    assert "view" not in rebind.identity()
    io.replies.append({"failures": [], "left": [2], "view": 1, "tag": [5, 6]})
    barriers.join(tag=(5, 6))
    io.replies.append({"failures": [], "left": [2]})
    barriers.join()
    identity = rebind.identity()
    assert identity["view"] == {"view": 1, "left": [2], "tag": [5, 6]} and identity["passed"] == 2


def test_a_worker_re_registers_with_the_slots_the_scheduler_last_said_have_left() -> None:
    """An elastic job's absent slots are reported left until the scheduler's word no longer names one
    (a join took it): the re-registration then leaves it out, so a restarted scheduler waits for it."""
    cfg = kvconfig.load({"DMLC_NUM_WORKER": "4", "DMLC_NUM_SERVER": "1"})
    barriers = Barriers(_Io(), cfg, "dist_sync", 1, 4, lambda requests, timeout, knob: [], absent=[2, 3])
    rebind = WorkerRebind(_Io(), cfg, {}, "dist_sync", lambda: 0, lambda: barriers.left)
    assert rebind.identity()["left"] == [2, 3]
    barriers.warn_left([3])  # a heartbeat reply after the join of slot 2
    assert rebind.identity()["left"] == [3] and barriers.left == [3]
    barriers.warn_left([0, 3])  # worker 0 left
    assert rebind.identity()["left"] == [0, 3]

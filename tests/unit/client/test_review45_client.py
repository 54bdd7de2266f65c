"""Review 45's reproducers (client side), fixed: a dist_async joiner of a running job tells whether it came
in at the job's start by the job's update count (``kv.rejoined_at``), not by its fresh slot's count."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.client.mux import SCHEDULER
from kvstore.client.store import DistKVStore, Joined
from kvstore.net.protocol import Message, Op
from tests.unit.client.fake_transport import SERVERS, FakeMux, fake_config


class _AsyncJoinMux(FakeMux):
    """Servers of a dist_async job that has applied ``updates`` pushes: a REJOIN of a slot never held
    before answers round 0 (the slot's own count) and step ``updates`` (the job's count); the scheduler
    answers the first barrier with a tagged view."""

    def __init__(self, updates: int) -> None:
        super().__init__(len(SERVERS))
        self.updates = updates

    def _answer(self, target: int, msg: Message) -> Message:
        if msg.op is Op.REJOIN:
            return Message(Op.OK, {"round": 0, "step": self.updates} if "at" not in msg.body else {})
        if target == SCHEDULER and msg.op is Op.BARRIER and not msg.body.get("cancel"):
            return Message(Op.OK, {"failures": [], "left": [], "view": 9, "tag": [1, 0]})
        return super()._answer(target, msg)


def _async_joiner(updates: int) -> DistKVStore:
    """A dist_async store of worker 2 that joined a fresh slot of a job with ``updates`` applied."""
    body = {"rank": 2, "num_workers": 3, "seed": 7, "session": b"fake", "push_window": 2, "chunk_bytes": 0,
            "servers": [["10.0.0.1", 9001], ["10.0.0.2", 9002]], "rejoin": True, "join": True,
            "incarnation": 1, "barriers": 0}
    return DistKVStore("dist_async", fake_config(join=True),
                       joined=Joined(body, SERVERS, _AsyncJoinMux(updates), heartbeat=False))


def test_a_dist_async_joiner_of_a_running_job_is_not_in_at_its_start() -> None:
    """A dist_async worker that joins a fresh slot of a job with 500 updates applied (REJOIN: round 0,
    step 500) and awaits a tagged view is not joined_at_start: it must not meet the first step's
    rescale_grad agreement the others met long ago (kv.joined_at_start reads the slot's count, 0)."""
    kv = _async_joiner(500)
    try:
        assert kv.rejoined_at == 500  # the job's update count: the job is running
        kv.await_view()
        assert not kv.joined_at_start
    finally:
        kv.close()


def test_a_dist_async_joiner_of_a_running_job_is_not_told_to_await_a_first_view(
        caplog: pytest.LogCaptureFixture) -> None:
    """A dist_async worker joining a fresh slot of a job with 500 updates applied, in a script that agrees
    no views, skips init without the warning meant for a joiner before the job's first round (which
    tells it to call kv.await_view(), a wait no view of such a job ever ends)."""
    kv = _async_joiner(500)
    try:
        with caplog.at_level("WARNING", logger="kvstore"):
            kv.init("w", np.zeros(4))
        assert not [r for r in caplog.records if "await_view" in r.getMessage()], caplog.text
    finally:
        kv.close()

"""kvstore.client.joining.Rejoin: which servers a restarted worker's realigner tells ``rejoining``."""

from __future__ import annotations

from kvstore.client.joining import Rejoin
from kvstore.client.mux import Request


def test_a_server_is_pending_until_it_answers_the_second_step() -> None:
    """A restart is pending with every server until that server's second REJOIN is answered; a worker
    that never restarted is pending nowhere."""
    assert not Rejoin(False).pending(0)
    progress = Rejoin(True)
    assert progress.pending(0) and progress.pending(1)  # nothing sent yet
    progress.second = {0: Request("rejoin 0"), 1: Request("rejoin 1")}
    progress.second[0].future.set_result(None)
    assert not progress.pending(0) and progress.pending(1)

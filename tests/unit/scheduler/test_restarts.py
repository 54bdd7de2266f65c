"""Unit tests of the scheduler's restart bookkeeping (kvstore.scheduler.restarts.Restarts)."""

from __future__ import annotations

import pytest

from kvstore.errors import ProtocolError
from kvstore.scheduler.restarts import Restarts


def test_losses_are_absorbed_until_the_budget_is_used() -> None:
    """With a budget of 1 the first loss makes a worker away, a second loss is not absorbed."""
    restarts = Restarts(1, 2)
    assert restarts.absorbs(0)
    restarts.depart(0, 10.0)
    assert not restarts.absorbs(0) and not restarts.absorbs(1)


def test_a_restart_is_admitted_once_with_a_higher_incarnation() -> None:
    """check() takes a worker rank with a higher incarnation; admit() records it and ends its absence."""
    restarts = Restarts(2, 2)
    restarts.depart(1, 0.0)
    assert restarts.check(1, 1) == (1, 1)
    restarts.admit(1, 1)
    assert restarts.away == {} and restarts.incarnation == {1: 1}
    with pytest.raises(ProtocolError, match="not above"):
        restarts.check(1, 1)


@pytest.mark.parametrize("rank, incarnation", [(2, 1), (-1, 1), ("0", 1), (0, None), (True, 1)])
def test_a_bad_late_registration_is_refused(rank, incarnation) -> None:
    """A rank outside the workers, or a missing incarnation, is a ProtocolError."""
    with pytest.raises(ProtocolError):
        Restarts(1, 2).check(rank, incarnation)


def test_no_budget_or_a_used_one_refuses_late_registrations() -> None:
    """Without restarts, and once they are used, a late REGISTER is refused naming why."""
    with pytest.raises(ProtocolError, match="late registrations are refused"):
        Restarts(0, 2).check(0, 1)
    restarts = Restarts(1, 2)
    restarts.depart(0, 0.0)
    restarts.admit(0, 1)
    with pytest.raises(ProtocolError, match="restarts .KVSTORE_MAX_RESTARTS. are used"):
        restarts.check(1, 1)


def test_a_worker_away_too_long_is_overdue_once() -> None:
    """overdue() returns the workers away longer than the timeout and forgets them."""
    restarts = Restarts(2, 3)
    restarts.depart(0, 0.0)
    restarts.depart(2, 5.0)
    assert restarts.overdue(8.0, 6.0) == [0]
    assert restarts.overdue(8.0, 6.0) == []
    assert list(restarts.away) == [2]


def test_a_server_loss_is_absorbed_only_with_shards_and_budget() -> None:
    """A lost server is away only when servers write shards and budget is left; it shares the budget."""
    restarts = Restarts(1, 2)
    assert not restarts.server_absorbs(0, shards=False)
    assert restarts.server_absorbs(0, shards=True)
    restarts.depart(1, 0.0)  # a worker used the one restart
    assert not restarts.server_absorbs(0, shards=True)


def test_a_server_away_too_long_is_overdue_once() -> None:
    """overdue_servers() returns a server away longer than the timeout, and forgets it."""
    restarts = Restarts(2, 2)
    restarts.servers_away[1] = 10.0
    assert restarts.overdue_servers(15.0, 10.0) == []
    assert restarts.overdue_servers(21.0, 10.0) == [1]
    assert restarts.servers_away == {} and restarts.overdue_servers(40.0, 10.0) == []

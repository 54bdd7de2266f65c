"""The scheduler's book of pipeline sockets (scheduler/pipes.py): publish, look up, refuse bad bodies."""

from __future__ import annotations

import pytest

from kvstore.errors import ProtocolError
from scheduler.pipes import PipeBook

pytestmark = pytest.mark.timeout(10)


def test_publish_then_lookup() -> None:
    """A published address is found by rank; an unpublished rank is None."""
    book = PipeBook(2)
    book.publish(1, {"host": "127.0.0.1", "port": 4000})
    assert book.lookup({"rank": 1}) == ["127.0.0.1", 4000]
    assert book.lookup({"rank": 0}) is None


@pytest.mark.parametrize("body", [{}, {"host": "", "port": 1}, {"host": "h", "port": 0},
                                  {"host": "h", "port": "80"}, {"host": "x" * 300, "port": 1}])
def test_bad_publications_are_refused_without_change(body: dict) -> None:
    """A bad PIPE_PUBLISH body is a ProtocolError and records nothing."""
    book = PipeBook(2)
    with pytest.raises(ProtocolError):
        book.publish(0, body)
    assert book.addresses == {}


@pytest.mark.parametrize("rank", [-1, 2, "0", None, True])
def test_bad_lookups_are_refused(rank: object) -> None:
    """A PIPE_LOOKUP of a rank outside [0, num_workers) is a ProtocolError."""
    with pytest.raises(ProtocolError):
        PipeBook(2).lookup({"rank": rank})

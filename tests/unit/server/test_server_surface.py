"""The Server's public surface and its requests object's (issue 36): pinned, so neither grows unseen.

A member made public only for a collaborator to reach shows up here; the collaborators get the narrow
:class:`~kvstore.server.requests.Requests` instead (docs/architecture.md lists its members).
"""

from __future__ import annotations

from kvstore.server.requests import Requests

from .fake import FakeCluster

# The Server's public names before issue 36 (a joined server's attributes and its methods).
BEFORE = {"cfg", "host", "port", "service", "memory", "scheduler", "to_scheduler", "state", "bf16_keys",
          "optimizer", "heartbeat", "shards", "restored", "meter", "sparse", "rejoins", "join", "run",
          "batch"}
SERVER = {"cfg", "service", "memory", "meter", "state", "rejoins", "sparse", "shards", "restored", "run"}
REQUESTS = {"state", "bf16_keys", "optimizer", "sender", "check_precision", "mark_precision",
            "check_updatable", "set_optimizer", "reply", "reply_all"}


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def test_the_servers_public_names_are_pinned_and_did_not_grow() -> None:
    """A built Server's public attributes and methods are exactly these, none beyond what it had."""
    server = FakeCluster().server
    assert _public(server) == SERVER
    assert SERVER <= BEFORE


def test_the_requests_object_is_narrow() -> None:
    """Requests, what fastpath, restore and sparse take instead of the Server, has these members only
    (at most about a dozen)."""
    requests = FakeCluster().server._requests
    assert isinstance(requests, Requests)
    assert _public(requests) == REQUESTS
    assert len(REQUESTS) <= 12

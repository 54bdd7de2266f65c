"""What a scheduler feature may use: the narrow, typed object a :class:`Scheduler` hands its extensions.

dask's extension pattern (``distributed.Scheduler.extensions``): a feature (:mod:`.restarts`,
:mod:`.pipes`) is a class built with a :class:`SchedulerAPI`.  It registers its own handlers and keeps
its own state; it reaches the scheduler only through these members, never the Scheduler itself, so
it cannot depend on the scheduler's private state (the Scheduler builds the API from its own methods).
The members are listed in docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.config import Config
from kvstore.net.protocol import Message, Op
from kvstore.net.router import Handler, LateHandler

from .state import Challenges, Node


@dataclass(frozen=True)
class SchedulerAPI:
    """The scheduler as its extensions see it (every member documented in docs/architecture.md)."""

    cfg: Config
    challenges: Challenges  # HELLO's nonce and challenge per connection, shared with registration
    handle: Callable[[Op, Handler], None]  # serve ``op`` from registered nodes (sealed with the session)
    handle_late: Callable[[Op, LateHandler], None]  # serve ``op`` to a holder of the secret alone
    reply: Callable[[bytes, Message], None]  # send a message to a node; never raises
    worker_rank: Callable[[bytes], int]  # the rank of a registered worker's connection; ProtocolError
    mode: Callable[[], str | None]  # the cluster's mode once the map is out
    lost: Callable[[], list[list]]  # [role, rank, host, why] of every node declared lost, in order
    live_servers: Callable[[], list[Node]]  # the servers in rank order, less the lost ones
    declare_lost: Callable[[str, int, str], None]  # lose (role, rank) for good: barriers fail, job fails
    away: Callable[[str, int], str | None]  # stop counting (role, rank) (see Scheduler); returns its host
    rejoin: Callable[[Node, int, int, bool], dict]  # admit a restarted (node, rank, incarnation), or with
    # the last True a new member to an absent slot (elastic, docs/elastic.md); its MAP body

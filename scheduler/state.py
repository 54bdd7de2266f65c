"""Pure rendezvous, barrier and liveness bookkeeping of the scheduler (no sockets, no clock)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from kvstore.errors import AuthenticationError, CollectiveMismatchError, ConfigError, ProtocolError


@dataclass(frozen=True)
class Node:
    """A registered node: its connection identity and what it told the scheduler."""

    identity: bytes
    role: str
    host: str
    port: int | None = None
    wanted_rank: int | None = None
    mode: str | None = None
    quorum: int | None = None  # a worker's create(..., quorum=N) or KVSTORE_SYNC_QUORUM
    label: str = ""  # the label its requests are sealed with (a restarted scheduler rebinds by it)


def hello_nonce(body: dict[str, Any]) -> str:
    """A HELLO's nonce; raise :class:`ProtocolError` unless it is a str of 1 to 128 characters."""
    nonce = body.get("nonce")
    if not (isinstance(nonce, str) and 0 < len(nonce) <= 128):
        raise ProtocolError("HELLO needs a nonce (a str of at most 128 characters)")
    return nonce


class Challenges:
    """The nonce each connection sent in its HELLO and the challenge it was given, until it registers."""

    def __init__(self) -> None:
        self._issued: dict[bytes, tuple[str, str]] = {}  # identity -> (its nonce, our challenge)

    def __len__(self) -> int:
        return len(self._issued)

    def issue(self, identity: bytes, nonce: str, bound: int | None = None) -> str:
        """Give ``identity`` a fresh challenge for ``nonce`` (replacing one it was given before) and
        return it; with ``bound``, the oldest outstanding one is forgotten first when there are that many."""
        if bound is not None and len(self._issued) >= bound:
            self._issued.pop(next(iter(self._issued)))
        challenge = secrets.token_hex(16)
        self._issued[identity] = (nonce, challenge)
        return challenge

    def check(self, identity: bytes, answer: Any) -> None:
        """Raise :class:`AuthenticationError` unless ``answer`` is the challenge ``identity`` was given."""
        issued = self._issued.get(identity)
        if issued is None or answer != issued[1]:
            raise AuthenticationError("REGISTER must answer the challenge this connection was given")

    def take(self, identity: bytes) -> str:
        """Forget ``identity``'s challenge; return the nonce it sent (its MAP echoes it).  KeyError
        when it was given none."""
        return self._issued.pop(identity)[0]

    def clear(self) -> None:
        """Forget every outstanding challenge."""
        self._issued.clear()


def assign_ranks(nodes: list[Node]) -> list[Node]:
    """Order ``nodes`` by rank: their wanted ranks when complete and unique, else arrival order."""
    wanted = [n.wanted_rank for n in nodes]
    if None not in wanted and sorted(wanted) == list(range(len(nodes))):
        return sorted(nodes, key=lambda n: n.wanted_rank)
    return list(nodes)


class Rendezvous:
    """Collects exactly ``num_servers`` servers and ``num_workers`` workers."""

    def __init__(self, num_workers: int, num_servers: int) -> None:
        self.expected = {"worker": num_workers, "server": num_servers}
        self.nodes: dict[str, list[Node]] = {"worker": [], "server": []}

    def register(self, node: Node) -> None:
        """Add ``node``; raise :class:`ProtocolError` for a bad role, a duplicate or one too many."""
        if node.role not in self.nodes:
            raise ProtocolError(f"cannot register role {node.role!r}; expected worker or server")
        if any(n.identity == node.identity for group in self.nodes.values() for n in group):
            raise ProtocolError("this connection has already registered")
        group = self.nodes[node.role]
        if len(group) >= self.expected[node.role]:
            raise ConfigError(f"a {node.role} from {node.host} registered, but all "
                              f"{self.expected[node.role]} {node.role}s expected "
                              f"(DMLC_NUM_{node.role.upper()}) have already registered")
        if node.role == "server" and not node.port:
            raise ProtocolError("a server must register the port it listens on")
        group.append(node)

    @property
    def complete(self) -> bool:
        """True when every expected node has registered."""
        return all(len(self.nodes[r]) == self.expected[r] for r in self.expected)

    def progress(self) -> str:
        """E.g. '3/4 workers and 2/2 servers registered'."""
        return (f"{len(self.nodes['worker'])}/{self.expected['worker']} workers and "
                f"{len(self.nodes['server'])}/{self.expected['server']} servers registered")

    def mode(self) -> str:
        """The cluster's mode, which every worker must agree on; raise :class:`ConfigError` if not."""
        modes = {n.mode for n in self.nodes["worker"]}
        if len(modes) != 1 or None in modes:
            detail = ", ".join(f"{n.host} asked for {n.mode}" for n in self.nodes["worker"])
            raise ConfigError(f"workers disagree on the store type: {detail}; every worker must "
                              "call kvstore.create with the same dist_* name")
        return modes.pop()

    def quorum(self, default: int | None) -> int | None:
        """The cluster's ``dist_sync`` quorum: the one the workers asked for (all that asked must agree),
        else ``default`` (the scheduler's KVSTORE_SYNC_QUORUM); raise :class:`ConfigError` when they
        disagree or it is outside ``[1, num_workers]``."""
        asked = {n.quorum for n in self.nodes["worker"] if n.quorum is not None}
        if len(asked) > 1:
            detail = ", ".join(f"{n.host} asked for {n.quorum}" for n in self.nodes["worker"])
            raise ConfigError(f"workers disagree on the sync quorum: {detail}; give every worker the "
                              "same quorum (create(..., quorum=N) or KVSTORE_SYNC_QUORUM)")
        value = asked.pop() if asked else default
        workers = self.expected["worker"]
        if value is not None and not 1 <= value <= workers:
            raise ConfigError(f"a sync quorum of {value} is outside [1, {workers}] (DMLC_NUM_WORKER)")
        return value

    def ranked(self) -> dict[str, list[Node]]:
        """Workers and servers, each list in rank order."""
        return {role: assign_ranks(group) for role, group in self.nodes.items()}


class Barrier:
    """Counts workers at a barrier; releases them all when every worker has arrived.

    A worker may arrive carrying a failure message (its part of a collective
    operation failed); the release hands every worker the failures of that
    generation, so no worker carries on as if the operation had worked.  A worker may also carry a
    digest of its arguments to a collective (``kvstore.core.agreement``): the release hands every
    worker every digest of the generation, so each can see whether they all agree.  A worker that
    joined before the job's first tagged view may *follow* (``arrive(..., follow=True)``): it counts as
    arrived but is no call of its own, so it pairs with whatever the others call (docs/elastic.md).
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.waiting: dict[int, tuple[bytes, int]] = {}  # rank -> (identity, request seq)
        self.failures: dict[int, Any] = {}  # rank -> failure, this generation
        self.released_failures: dict[int, Any] = {}  # the failures of the last released generation
        self.digests: dict[int, str] = {}  # rank -> digest of its collective's arguments, this generation
        self.released_digests: dict[int, str] = {}  # the digests of the last released generation
        self.tags: dict[int, list[int]] = {}  # rank -> the tag of its membership view, this generation
        self.released_tag: list[int] | None = None  # the lowest rank's tag of the last released one
        # the last released one's calls when they differ (rank -> its tag, None for a plain barrier)
        self.released_mixed: dict[int, list[int] | None] = {}
        self.followers: set[int] = set()  # ranks that follow this generation: paired with any call
        self.generation = 0  # barriers released so far: a worker says which it passed (a restart's resend)

    def arrive(self, rank: int, identity: bytes, seq: int,
               failure: Any = None, digest: str | None = None,
               tag: list[int] | None = None, follow: bool = False) -> list[tuple[bytes, int]]:
        """Record ``rank``'s arrival; return every (identity, seq) to release, or [] to wait on.

        A rank that arrives again in the same generation (it retried after its
        deadline) replaces its earlier entry, so it is counted once and the
        reply goes to the request that is still waiting.  On release,
        :attr:`released_failures` holds the failures reported in the generation, and
        :attr:`released_digests` its digests, :attr:`released_tag` its lowest rank's tag (None: none),
        and :attr:`released_mixed` every rank's call when they were not all one (membership views of
        differing tags, or a view among plain barriers; empty otherwise).  A ``follow`` arrival is
        left out of that comparison (it pairs with any call; it carries no failure, digest or tag).
        """
        self.waiting[rank] = (identity, seq)
        if follow:
            self.followers.add(rank)
            failure = digest = tag = None
        else:
            self.followers.discard(rank)
        if failure is None:
            self.failures.pop(rank, None)
        else:
            self.failures[rank] = failure
        if digest is None:
            self.digests.pop(rank, None)
        else:
            self.digests[rank] = digest
        if tag is None:
            self.tags.pop(rank, None)
        else:
            self.tags[rank] = tag
        if len(self.waiting) < self.num_workers:
            return []
        return self._released()

    def _released(self) -> list[tuple[bytes, int]]:
        """End the generation: every waiter, its failures, digests and tags kept as the released ones."""
        calls = {rank: self.tags.get(rank) for rank in sorted(self.waiting) if rank not in self.followers}
        released, self.waiting, self.followers = list(self.waiting.values()), {}, set()
        self.generation += 1
        self.released_failures, self.failures = self.failures, {}
        self.released_digests, self.digests = self.digests, {}
        self.released_tag = self.tags[min(self.tags)] if self.tags else None
        self.released_mixed = calls if self.tags and len({repr(c) for c in calls.values()}) > 1 else {}
        self.tags = {}
        return released

    def cancel(self, rank: int) -> bool:
        """Withdraw ``rank`` (its wait timed out); False when it was not waiting (already released)."""
        self.failures.pop(rank, None)
        self.digests.pop(rank, None)
        self.tags.pop(rank, None)
        self.followers.discard(rank)
        return self.waiting.pop(rank, None) is not None

    def leave(self, rank: int) -> list[tuple[bytes, int]]:
        """``rank`` left the cluster: count one worker fewer; return whoever that releases."""
        self.cancel(rank)
        self.num_workers -= 1
        if not self.waiting or len(self.waiting) < self.num_workers:
            return []
        return self._released()

    def drain(self) -> list[tuple[bytes, int]]:
        """Give up the current generation: return every waiting (identity, seq) and forget them."""
        waiting, self.waiting, self.failures, self.digests = list(self.waiting.values()), {}, {}, {}
        self.tags, self.followers = {}, set()
        return waiting


class Liveness:
    """When each node was last heard from, and which have been silent too long.

    Times are whatever clock the caller passes (``time.monotonic()`` in the scheduler).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.last: dict[tuple[str, int], float] = {}  # (role, rank) -> last time heard

    def watch(self, role: str, rank: int, now: float) -> None:
        """Start watching ``(role, rank)`` as if it had just been heard."""
        self.last[(role, rank)] = now

    def beat(self, role: str, rank: int, now: float) -> bool:
        """Record a heartbeat; False for a node that is not watched (never registered, left or lost)."""
        if (role, rank) not in self.last:
            return False
        self.last[(role, rank)] = now
        return True

    def forget(self, role: str, rank: int) -> None:
        """Stop watching ``(role, rank)`` (it left in good order)."""
        self.last.pop((role, rank), None)

    def expired(self, now: float) -> list[tuple[str, int]]:
        """Nodes silent for more than ``timeout``, in (role, rank) order; they are no longer watched."""
        gone = sorted(node for node, seen in self.last.items() if now - seen > self.timeout)
        for node in gone:
            del self.last[node]
        return gone


def mixed_calls(generation: int, calls: dict[int, list[int] | None]) -> CollectiveMismatchError:
    """The error of barrier ``generation`` whose workers made different calls (``calls``: rank -> its
    membership tag, None for a plain barrier): it says who asked for what, and its ``ranks`` are those
    outside the largest group that agrees (ties: the group of the lowest rank)."""
    groups: dict[str, list[int]] = {}
    for rank, tag in sorted(calls.items()):
        groups.setdefault("a plain barrier" if tag is None else f"membership view {tag}", []).append(rank)
    agreed = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    said = "; ".join(f"workers {ranks} asked for {what}" for what, ranks in groups.items())
    return CollectiveMismatchError(
        f"barrier {generation} paired different calls: {said}; it fails on every worker.  Every worker "
        "must ask for the membership view at the same point (a worker leaving a split Session closes its "
        "store right after run returns)", sorted(set(calls) - set(agreed)))

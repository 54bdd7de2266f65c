"""A restarted scheduler's rebuild of the running cluster from its nodes' re-registrations.

Under ``launch.py --max-restarts K`` the launcher restarts a lost scheduler at the same address and
port (``KVSTORE_INCARNATION`` >= 1).  The new one starts knowing only its environment (the counts, the
workers that have exited, the restarts used) and the digest of the old one's session, which the first
incarnation wrote next to its port file (:func:`write_digest`).  Each live node, once its heartbeats
fail, re-registers (HELLO, CHALLENGE, REGISTER sealed with the secret) with its current identity:
role, rank, incarnation, address, the label its requests are sealed with, the cluster session and map
it holds, the barriers it has passed, and what it knows of left and away workers.  A re-registration
whose session does not match the digest is refused, and so is a second claim on a rank from another
connection: only a member of the old cluster can take a rank back, and only its own.

:class:`Recovery` is the pure bookkeeping (no sockets, no clock): it checks each re-registration and
says who is still missing; the scheduler resumes once every node that was alive is back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvstore.core.membership import MAX_TAG
from kvstore.errors import AuthenticationError, ProtocolError
from kvstore.launch import portfile
from kvstore.net.auth import is_heartbeat_label

log = logging.getLogger("scheduler")
def session_digest(session: bytes) -> str:
    """The digest of a cluster session a restarted scheduler checks re-registrations against."""
    return hashlib.sha256(b"kvstore scheduler session\0" + session).hexdigest()


def write_digest(port_file: str, session: bytes) -> None:
    """Write ``session``'s digest next to ``port_file`` (kvstore.launch.portfile).  Raises OSError."""
    portfile.write_digest(port_file, session_digest(session))


read_digest = portfile.read_digest  # the digest written next to a port file, or None


def _ranks(value: Any, bound: int, what: str) -> frozenset[int]:
    if not (isinstance(value, list) and all(type(r) is int and 0 <= r < bound for r in value)):
        raise ProtocolError(f"a re-registration's {what} must be a list of ranks below {bound}")
    return frozenset(value)


@dataclass(frozen=True)
class Rebound:
    """One node's re-registration, checked: who it is, where, and what it knows of the cluster."""

    role: str
    rank: int
    incarnation: int
    host: str
    port: int | None  # a server's data port
    label: str  # the label its requests to the scheduler are sealed with
    passed: int  # barriers this worker has passed (0 for a server)
    left: frozenset[int]  # workers it knows have left
    away: frozenset[int]  # workers it knows are away (being restarted)
    used: int  # restarts it knows were used
    counters: tuple[tuple[str, int], ...] = ()  # (label, number): its channels' numbers stand above these
    view: tuple[int, frozenset[int], tuple[int, ...]] | None = None  # a worker's last tagged view:
    # (number, left, tag), as the scheduler kept it (docs/elastic.md)


def parse(body: dict[str, Any], num_workers: int, num_servers: int) -> Rebound:
    """The :class:`Rebound` in a re-registration's REGISTER ``body``; ProtocolError when malformed."""
    role, rank, incarnation = body.get("role"), body.get("rank"), body.get("incarnation")
    count = {"worker": num_workers, "server": num_servers}.get(role)  # type: ignore[call-overload]
    if count is None or not (type(rank) is int and 0 <= rank < count) \
            or not (type(incarnation) is int and incarnation >= 0):
        raise ProtocolError("a re-registration must name its role (worker or server), its rank within "
                            "the cluster's counts and its incarnation")
    port, label = body.get("port"), body.get("label")
    passed, used = body.get("passed", 0), body.get("used", 0)
    if role == "server" and not (type(port) is int and 0 < port < 65536):
        raise ProtocolError("a server's re-registration must name its port")
    if not (isinstance(label, str) and 0 < len(label) <= 64):
        raise ProtocolError("a re-registration must name the label its requests are sealed with")
    if not (type(passed) is int and passed >= 0 and type(used) is int and used >= 0):
        raise ProtocolError("a re-registration's passed barriers and used restarts must be ints >= 0")
    counters = body.get("counters", [])
    if not (isinstance(counters, list) and len(counters) <= 4 and all(
            isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and 0 < len(c[0]) <= 64
            and type(c[1]) is int and c[1] >= 0 for c in counters)):
        raise ProtocolError("a re-registration's counters must be at most 4 [label, number >= 0] pairs")
    return Rebound(role, rank, incarnation, str(body.get("host"))[:256], port if role == "server" else None,
                   label, passed, _ranks(body.get("left", []), num_workers, "left"),
                   _ranks(body.get("away", []), num_workers, "away"), used,
                   tuple((c[0], c[1]) for c in counters), _view(body.get("view"), num_workers, passed))


def _view(value: Any, num_workers: int, passed: int) -> tuple[int, frozenset[int], tuple[int, ...]] | None:
    """A re-registration's last tagged membership view ``{"view": n, "left": [...], "tag": [...]}``
    (absent: None) as ``(n, left, tag)``; ProtocolError when malformed or numbered past the barriers
    the worker passed."""
    if value is None:
        return None
    number, tag = value.get("view") if isinstance(value, dict) else None, \
        value.get("tag") if isinstance(value, dict) else None
    if not (type(number) is int and 0 < number <= passed and isinstance(tag, list) and len(tag) <= MAX_TAG
            and all(type(t) is int for t in tag)):
        raise ProtocolError("a re-registration's view must be {view: an int in [1, barriers passed], left: "
                            f"ranks, tag: at most {MAX_TAG} ints}}")
    return number, _ranks(value.get("left", []), num_workers, "view's left"), tuple(tag)


def _server_entry(entry: Any) -> bool:
    """Whether ``entry`` is a map's server address: ``[host (str), port (int in 1..65535)]``."""
    return isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) \
        and type(entry[1]) is int and 0 < entry[1] < 65536


def own_counters(node: Rebound, taken: set[str]) -> Rebound:
    """``node`` with only its own labels' counters: its request label's and its heartbeat's
    (:func:`is_heartbeat_label`), none in ``taken`` (other nodes' labels).  Another's are dropped (logged):
    flooring them would refuse that node's next messages as replays."""
    own = tuple((label, n) for label, n in node.counters if label not in taken and (
        label == node.label or is_heartbeat_label(label, node.role, node.rank)))
    dropped = [label for label, n in node.counters if (label, n) not in own]
    if dropped:
        log.warning("%s %d's re-registration names labels not its own in its counters: ignored (%s)",
                    node.role, node.rank, ", ".join(map(repr, dropped)))
    return dataclasses.replace(node, counters=own)


def check_map(cmap: Any, num_workers: int, num_servers: int, session: bytes,
              settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cluster map a re-registration carries, checked against the counts and ``session``: every
    server's address ``[host, port]``, the placement seed, the quorum, the absent slots and, when
    present, ``server_incarnations`` (``num_servers`` ints >= 0).  Returns the map a restarted scheduler
    sends: those fields, with ``settings`` (its own configuration's fields) in place of the member's,
    and nothing else (a node's own fields, or any it does not know, are dropped).  ProtocolError when
    malformed."""
    if not (isinstance(cmap, dict) and cmap.get("num_workers") == num_workers
            and cmap.get("num_servers") == num_servers and isinstance(cmap.get("servers"), list)
            and len(cmap["servers"]) == num_servers and cmap.get("mode") in ("dist_sync", "dist_async")):
        raise ProtocolError("a re-registration's cluster map does not match this cluster's counts")
    if not all(_server_entry(entry) for entry in cmap["servers"]):
        raise ProtocolError("a re-registration's cluster map must list each server as [host, port]")
    if cmap.get("session") != session:
        raise ProtocolError("a re-registration's cluster map names another session than its own")
    seed, quorum = cmap.get("seed"), cmap.get("sync_quorum")
    if not (type(seed) is int and 0 <= seed < 1 << 63):
        raise ProtocolError("a re-registration's cluster map must carry the placement seed (an int >= 0)")
    if not (quorum is None or (type(quorum) is int and 1 <= quorum <= num_workers)):
        raise ProtocolError(f"a re-registration's sync_quorum must be None or an int in [1, {num_workers}]")
    incarnations = cmap.get("server_incarnations")
    if incarnations is not None and not (isinstance(incarnations, list) and len(incarnations) == num_servers
                                         and all(type(n) is int and n >= 0 for n in incarnations)):
        raise ProtocolError(f"a re-registration's server_incarnations must be {num_servers} ints >= 0")
    kept = ("num_workers", "num_servers", "mode", "seed", "session", "sync_quorum",
            "chunk_bytes", "max_message_bytes", "push_window", "staleness")
    checked = {k: cmap[k] for k in kept if k in cmap}
    checked.update(settings or {})
    checked["servers"] = [list(entry) for entry in cmap["servers"]]
    if "absent" in cmap:
        checked["absent"] = sorted(_ranks(cmap["absent"], num_workers, "absent slots"))
    if incarnations is not None:
        checked["server_incarnations"] = list(incarnations)
    return checked


class Recovery:
    """Who has re-registered with a restarted scheduler, checked against the old session's digest.

    ``left``: worker slots the launcher saw exit 0 that no live worker holds (``KVSTORE_RECOVER_LEFT``);
    a member's word that a worker has left yields to that worker's own re-registration; ``used``: restarts the
    launcher has used (``KVSTORE_RESTARTS_USED``); ``settings``: the map's fields the scheduler's own
    configuration sets (:func:`check_map`).  The cluster is rebuilt (:attr:`complete`) once every
    server and every worker that has neither left nor is away has re-registered.
    """

    def __init__(self, num_workers: int, num_servers: int, digest: str, left: Iterable[int] = (),
                 used: int = 0, settings: dict[str, Any] | None = None) -> None:
        self.num_workers, self.num_servers, self.digest = num_workers, num_servers, digest
        self.settings = dict(settings or {})  # the map's fields the scheduler's configuration sets
        self.nodes: dict[tuple[str, int], Rebound] = {}
        self.map: dict[str, Any] | None = None  # the first member's map: servers' addresses updated
        self.session: bytes | None = None
        self._left, self._used = set(left), used

    def admit(self, body: dict[str, Any]) -> Rebound:
        """Check a re-registration and record it (its counters only for its own labels: :func:`own_counters`);
        raise AuthenticationError when it does not carry the old cluster's session, ProtocolError when it is
        malformed (its map too, when it is the first), its rank is claimed by another connection or
        incarnation, or its label is another node's.  Nothing changes when it raises."""
        session = body.get("session")
        if not isinstance(session, bytes) or session_digest(session) != self.digest:
            raise AuthenticationError("this re-registration does not carry the session of the cluster the "
                                      "scheduler is rebuilding: refused (only its members may take a rank)")
        node = parse(body, self.num_workers, self.num_servers)
        prior = self.nodes.get((node.role, node.rank))
        if prior is not None and (prior.label, prior.incarnation) != (node.label, node.incarnation):
            raise ProtocolError(f"{node.role} {node.rank} has re-registered already (incarnation "
                                f"{prior.incarnation}) from another connection; refused")
        if node.role == "worker" and node.rank in self._left:  # the launcher's word: no live process
            raise ProtocolError(f"worker {node.rank} has left the cluster; it cannot re-register")
        others = {n.label: key for key, n in self.nodes.items() if key != (node.role, node.rank)}
        if node.label in others:
            role, rank = others[node.label]
            raise ProtocolError(f"{node.role} {node.rank}'s re-registration names the label {role} {rank} "
                                "re-registered with; refused")
        node = own_counters(node, set(others))
        cmap = self.map if self.map is not None else check_map(body.get("map"), self.num_workers,
                                                               self.num_servers, session, self.settings)
        # checked: nothing below raises, so a refusal above changed nothing
        if self.map is None:
            self.map, self.session = cmap, session
        self.nodes[(node.role, node.rank)] = node
        if node.role == "server":
            cmap["servers"][node.rank] = [node.host, node.port]
            if node.incarnation:
                incarnations = cmap.setdefault("server_incarnations", [0] * self.num_servers)
                incarnations[node.rank] = node.incarnation
        return node

    def gone_for_good(self, rank: int) -> bool:
        """Whether the launcher saw worker slot ``rank`` exit 0 with no live worker in it since."""
        return rank in self._left

    @property
    def left(self) -> set[int]:
        """Workers that have left: those the launcher saw exit 0 and those any member knows of, but
        a worker that re-registered itself (an elastic job's slot another member still knew absent,
        joined since: docs/elastic.md)."""
        back = {rank for role, rank in self.nodes if role == "worker"}
        return self._left.union(*(n.left for n in self.nodes.values())) - back

    @property
    def away(self) -> set[int]:
        """Workers away (being restarted) by any member's word, less those back and those that left."""
        back = {rank for role, rank in self.nodes if role == "worker"}
        return set().union(*(n.away for n in self.nodes.values())) - back - self.left

    @property
    def used(self) -> int:
        """Restarts used: the most anyone knows of (the launcher's count includes this scheduler's)."""
        return max([self._used, *(n.used for n in self.nodes.values())])

    @property
    def last_view(self) -> dict[str, Any] | None:
        """The job's last tagged membership view, as the scheduler keeps it (``{"view", "left", "tag"}``):
        the highest-numbered one any worker re-registered with, or None."""
        views = [n.view for n in self.nodes.values() if n.role == "worker" and n.view is not None]
        if not views:
            return None
        number, left, tag = max(views, key=lambda v: v[0])
        return {"view": number, "left": sorted(left), "tag": list(tag)}

    @property
    def generation(self) -> int:
        """Barriers released before the death: the most any worker has passed."""
        return max([n.passed for n in self.nodes.values() if n.role == "worker"], default=0)

    def missing(self) -> list[tuple[str, int]]:
        """``(role, rank)`` of every node that was alive and has not re-registered, servers first."""
        gone = self.left | self.away
        wanted = [("server", r) for r in range(self.num_servers)] + \
                 [("worker", r) for r in range(self.num_workers) if r not in gone]
        return [key for key in wanted if key not in self.nodes]

    @property
    def complete(self) -> bool:
        """Whether every node that was alive is back."""
        return self.map is not None and not self.missing()


def die_hook(spec: tuple[str, int] | None, incarnation: int, barrier_open: Callable[[], int | None]
             ) -> Callable[[str], None] | None:
    """The test hook ``KVSTORE_TEST_SCHEDULER_DIE_AT`` for a first incarnation (None otherwise): a
    callable the scheduler calls with ``"beat"`` after each heartbeat and ``"barrier"`` after each
    arrival; it SIGKILLs the process after the N-th heartbeat (``beats:N``), or once the N-th barrier
    has a worker in it (``barrier:N``; ``barrier_open()`` is the open barrier's number, or None)."""
    if spec is None or incarnation:
        return None
    kind, number = spec
    beats = [0]

    def hook(event: str) -> None:
        if kind == "beats" and event == "beat":
            beats[0] += 1
            due = beats[0] >= number
        else:
            due = kind == "barrier" and event == "barrier" and barrier_open() == number
        if due:
            log.warning("KVSTORE_TEST_SCHEDULER_DIE_AT=%s:%d: killing the scheduler (SIGKILL)", kind, number)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook

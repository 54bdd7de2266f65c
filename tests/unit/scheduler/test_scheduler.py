"""The Scheduler's request handling over the fake transport (kvstore.net.inproc): no socket, no process.

Each peer seals its requests as a node would; they go in through the in-memory ROUTER and the
scheduler's own request loop (``service.drain``), and the replies it sent are opened with the
peer's channel.
"""

from __future__ import annotations

import time

import pytest

from kvstore import config as kvconfig
from kvstore.net import protocol
from kvstore.net.auth import Channel, derive_key, new_label
from kvstore.net.inproc import InProcRouter
from kvstore.net.protocol import Message, Op
from kvstore.scheduler.scheduler import Scheduler

SECRET = "unit-secret"


class Peer:
    """One connection to the scheduler: its identity and channel, and the replies it got."""

    def __init__(self, sched: Scheduler, name: str, secret: str = SECRET) -> None:
        self.sched, self.identity = sched, name.encode()
        self.channel = Channel(derive_key(secret), new_label(name))
        self.seq = 0
        self.seen = 0  # replies to this peer already returned

    def send(self, op: Op, body: dict | None = None, sender: int | None = None) -> list[Message]:
        """:meth:`post` one request; return the sealed replies this peer got since its last call, opened."""
        self.post(op, body, sender)
        return self.replies()

    def post(self, op: Op, body: dict | None = None, sender: int | None = None) -> None:
        """Send one request through the fake ROUTER and let the scheduler's loop handle it."""
        self.seq += 1
        endpoint = self.sched.service.endpoint
        assert isinstance(endpoint, InProcRouter)
        msg = Message(op, body or {}, seq=self.seq, sender=sender)
        endpoint.deliver(self.identity, self.channel.seal(msg, "scheduler"))
        assert self.sched.service.drain() == 1

    def replies(self) -> list[Message]:
        """The replies this peer got since the last call, opened with its channel."""
        mine = [frames for ident, frames in self.sched.service.endpoint.sent if ident == self.identity]
        new, self.seen = mine[self.seen:], len(mine)
        return [self.channel.open(frames) for frames in new]

    def raw(self) -> list[list]:
        """Every frame list sent to this peer (unsigned ones too)."""
        return [frames for ident, frames in self.sched.service.endpoint.sent if ident == self.identity]


def make_scheduler(**env: str) -> Scheduler:
    """A scheduler for 2 workers and 1 server over an in-memory ROUTER."""
    cfg = kvconfig.load({"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1",
                         "DMLC_PS_ROOT_PORT": "0", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
                         "KVSTORE_SECRET": SECRET, **env})
    return Scheduler(cfg, endpoint=InProcRouter())


def register(sched: Scheduler, name: str, role: str, rank: int) -> tuple[Peer, list[Message]]:
    """HELLO then REGISTER as ``role`` wanting ``rank``; return the peer and its REGISTER's replies."""
    peer = Peer(sched, name)
    (challenge,) = peer.send(Op.HELLO, {"nonce": f"n-{name}"})
    assert challenge.op is Op.CHALLENGE and challenge.body["nonce"] == f"n-{name}"
    body = {"role": role, "host": f"host-{name}", "rank": rank, "mode": "dist_sync", "port": 9000 + rank,
            "challenge": challenge.body["challenge"]}
    return peer, peer.send(Op.REGISTER, body)


def complete(sched: Scheduler) -> dict[str, Peer]:
    """Register server 0 and workers 0 and 1; key each peer's channel to the session."""
    peers = {}
    for name, role, rank in (("s0", "server", 0), ("w0", "worker", 0), ("w1", "worker", 1)):
        peers[name], _ = register(sched, name, role, rank)
    for peer in peers.values():
        peer.replies()  # its MAP, sealed before the session
        peer.channel.set_session(sched.session)
    return peers


def test_no_socket_is_bound_over_the_fake_transport():
    """Built over an InProcRouter, the scheduler binds nothing (port 0); run()'s close reaches the fake."""
    sched = make_scheduler()
    assert sched.port == 0 and sched.service.sock is None
    sched.service.close()
    assert sched.service.endpoint.closed


def test_one_server_and_two_workers_registering_get_the_map():
    """The third registration completes the cluster: every node gets its MAP (rank, role, its nonce,
    the servers, the mode and the session), no one before."""
    sched = make_scheduler()
    s0, replies = register(sched, "s0", "server", 0)
    assert replies == []
    w1, replies = register(sched, "w1", "worker", 1)
    assert replies == [] and not sched.map_sent
    w0, replies = register(sched, "w0", "worker", 0)
    assert sched.map_sent and sched.mode == "dist_sync"
    maps = {"w0": replies[0], "w1": w1.replies()[0], "s0": s0.replies()[0]}
    for name, role, rank in (("s0", "server", 0), ("w0", "worker", 0), ("w1", "worker", 1)):
        body = maps[name].body
        assert maps[name].op is Op.MAP
        assert (body["role"], body["rank"], body["nonce"]) == (role, rank, f"n-{name}")
        assert body["servers"] == [["host-s0", 9000]] and body["mode"] == "dist_sync"
        assert body["num_workers"] == 2 and body["num_servers"] == 1 and body["session"] == sched.session
    assert sched.worker_ranks == {b"w0": 0, b"w1": 1} and len(sched.challenges) == 0


def test_a_register_without_its_challenge_is_refused_and_changes_nothing():
    """A REGISTER answering the wrong challenge gets AuthenticationError; nobody is registered."""
    sched = make_scheduler()
    peer = Peer(sched, "w0")
    peer.send(Op.HELLO, {"nonce": "n"})
    (reply,) = peer.send(Op.REGISTER, {"role": "worker", "host": "h", "mode": "dist_sync",
                                       "challenge": "not-it"})
    assert reply.op is Op.ERROR and reply.body["code"] == "AuthenticationError"
    assert sched.rendezvous.nodes == {"worker": [], "server": []}


def test_a_barrier_releases_when_every_worker_has_arrived():
    """The first worker's BARRIER waits (no reply); the second's releases both, with no failures."""
    sched = make_scheduler()
    peers = complete(sched)
    assert peers["w0"].send(Op.BARRIER, sender=0) == []
    assert sched.stats.arrived.keys() == {0}
    (second,) = peers["w1"].send(Op.BARRIER, sender=1)
    (first,) = peers["w0"].replies()
    for reply, seq in ((first, peers["w0"].seq), (second, peers["w1"].seq)):
        assert reply.op is Op.OK and reply.seq == seq and reply.body == {"failures": [], "left": []}
    assert sched.barrier.waiting == {} and sched.stats.barriers == 1


def test_a_heartbeat_from_an_unknown_node_is_refused_and_changes_nothing():
    """After the map, a connection without the session (not a node of this cluster) gets one unsigned
    AuthenticationError for its heartbeat; liveness and the stats are untouched."""
    sched = make_scheduler()
    complete(sched)
    watched, heard = dict(sched.liveness.last), dict(sched.stats.heard)
    stranger = Peer(sched, "stranger")  # the secret, but not the session
    stranger.post(Op.HEARTBEAT, {"role": "worker", "rank": 0}, sender=0)
    (frames,) = stranger.raw()
    assert frames[0] == b""  # unsigned: the stranger holds no session to open a sealed reply with
    reply = protocol.decode(frames[1:])
    assert reply.op is Op.ERROR and reply.body["code"] == "AuthenticationError"
    assert sched.liveness.last == watched and sched.stats.heard == heard and sched.lost == []


def test_a_malformed_heartbeat_gets_a_protocol_error_and_changes_nothing():
    """A node's heartbeat naming no valid role gets a sealed ProtocolError; nothing is recorded."""
    sched = make_scheduler()
    peers = complete(sched)
    watched, heard = dict(sched.liveness.last), dict(sched.stats.heard)
    (reply,) = peers["w0"].send(Op.HEARTBEAT, {"role": "scheduler", "rank": 0}, sender=0)
    assert reply.op is Op.ERROR and reply.body["code"] == "ProtocolError"
    assert sched.liveness.last == watched and sched.stats.heard == heard


def test_the_pipes_extension_publishes_and_looks_up_stage_addresses():
    """A worker's PIPE_PUBLISH is answered OK and its address found by another's PIPE_LOOKUP; an
    address not yet published is None; a server may do neither."""
    sched = make_scheduler()
    peers = complete(sched)
    (reply,) = peers["w1"].send(Op.PIPE_LOOKUP, {"rank": 0}, sender=1)
    assert reply.op is Op.OK and reply.body == {"address": None}
    (reply,) = peers["w0"].send(Op.PIPE_PUBLISH, {"host": "10.0.0.5", "port": 7000}, sender=0)
    assert reply.op is Op.OK
    (reply,) = peers["w1"].send(Op.PIPE_LOOKUP, {"rank": 0}, sender=1)
    assert reply.body == {"address": ["10.0.0.5", 7000]}
    (reply,) = peers["s0"].send(Op.PIPE_PUBLISH, {"host": "h", "port": 1}, sender=0)
    assert reply.op is Op.ERROR and reply.body["code"] == "ProtocolError"
    (reply,) = peers["w0"].send(Op.PIPE_PUBLISH, {"host": "h", "port": 0}, sender=0)
    assert reply.op is Op.ERROR and "port" in reply.body["message"]
    (reply,) = peers["w1"].send(Op.PIPE_LOOKUP, {"rank": 0}, sender=1)
    assert reply.body == {"address": ["10.0.0.5", 7000]}  # the refused publish changed nothing


def test_a_lost_worker_within_the_restart_budget_is_away_not_lost():
    """With KVSTORE_MAX_RESTARTS=1, a silent worker is made away: the barrier waiting for it releases,
    the server gets AWAY, the other worker's heartbeat names it away, and nothing is lost."""
    sched = make_scheduler(KVSTORE_MAX_RESTARTS="1", KVSTORE_HEARTBEAT_TIMEOUT="5")
    peers = complete(sched)
    assert peers["w0"].send(Op.BARRIER, sender=0) == []
    peers["w0"].send(Op.HEARTBEAT, {"role": "worker", "rank": 0}, sender=0)
    peers["s0"].send(Op.HEARTBEAT, {"role": "server", "rank": 0}, sender=0)
    sched.liveness.watch("worker", 1, time.monotonic() - 60)  # worker 1 has been silent a minute
    sched.check_liveness(time.monotonic())
    assert sched.lost == []
    (released,) = peers["w0"].replies()
    assert released.op is Op.OK and released.body["left"] == []
    (away,) = peers["s0"].replies()
    assert away.op is Op.AWAY and away.body == {"worker": 1, "incarnation": 0}
    (beat,) = peers["w0"].send(Op.HEARTBEAT, {"role": "worker", "rank": 0}, sender=0)
    assert beat.body["away"] == [1] and beat.body["lost"] == []


@pytest.mark.parametrize("budget", ["0", "1"])
def test_a_late_hello_is_challenged_only_under_a_restart_budget(budget):
    """After the map, a HELLO sealed with the secret alone is challenged when restarts are on, and
    told the cluster is complete when not."""
    sched = make_scheduler(KVSTORE_MAX_RESTARTS=budget)
    complete(sched)
    late = Peer(sched, "w1-again")
    (reply,) = late.send(Op.HELLO, {"nonce": "again"})
    if budget == "1":
        assert reply.op is Op.CHALLENGE and reply.body["nonce"] == "again"
    else:
        assert reply.op is Op.ERROR and "already complete" in reply.body["message"]


def test_a_barrier_with_equal_digests_replies_with_the_digest_once():
    """Workers whose digests agree get one copy of the text in the release, not one per worker: a
    reply must not grow with workers x keys (10,000 keys at 64 workers would be ~50 MB per reply)."""
    from kvstore.client.barriers import Barriers
    from kvstore.core.agreement import digest

    sched = make_scheduler()
    peers = complete(sched)
    text = digest(((f"k{i}", (3,), "float32") for i in range(100)), root=0)
    assert peers["w0"].send(Op.BARRIER, {"digest": text}, sender=0) == []
    (second,) = peers["w1"].send(Op.BARRIER, {"digest": text}, sender=1)
    assert str(second.body["digests"]).count(text) == 1
    Barriers._check_agreement("broadcast", second.body)  # noqa: SLF001 -- agreeing: no error
    peers["w0"].replies()  # the first release's reply to w0
    assert peers["w0"].send(Op.BARRIER, {"digest": text}, sender=0) == []
    (odd,) = peers["w1"].send(Op.BARRIER, {"digest": digest([("k0", (4,), "float32")], root=0)}, sender=1)
    with pytest.raises(Exception, match="worker 1 differs from worker 0") as info:
        Barriers._check_agreement("broadcast", odd.body)  # noqa: SLF001
    assert info.value.ranks == [1]

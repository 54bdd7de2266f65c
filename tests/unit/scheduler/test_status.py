"""The scheduler's STATUS, heartbeat snapshots and barrier stall inspector, driven through its request
loop's ``handle`` (its socket is bound on loopback, port 0, but carries nothing: replies are captured)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from kvstore import config as kvconfig
from kvstore.core.stats import SCHEMA_VERSION, node_snapshot
from kvstore.errors import StallError, error_from_code
from kvstore.net import protocol, transport
from kvstore.net.auth import Channel, derive_key, new_label
from kvstore.net.protocol import Message, Op
from kvstore.net.status_client import poll_session
from kvstore.scheduler.observe import POLL_BURST, SchedulerStats, node_rows
from kvstore.scheduler.scheduler import Scheduler

SECRET = "unit-secret"


class Peer:
    """A connection to the scheduler: its identity and channel; what the scheduler sent it."""

    def __init__(self, sched: Scheduler, name: str, secret: str | None = SECRET) -> None:
        self.sched, self.identity = sched, name.encode()
        self.channel = Channel(derive_key(secret), new_label(name))
        self.seq = 0

    def send(self, op: Op, body: dict | None = None, sender: int | None = None) -> Message | None:
        """Send one request; return the sealed reply it got (None: none), opened with this channel.
        A STATUS answered with the session only (net/status_client.py's first step) is asked again
        from a channel keyed with it, as kvstore.status does."""
        self.seq += 1
        before = len(self.sched.sent)
        self.last = self.channel.seal(Message(op, body or {}, seq=self.seq, sender=sender), "scheduler")
        self.sched.service.handle([self.identity, *self.last])
        replies = [f for ident, f in self.sched.sent[before:] if ident == self.identity]
        reply = self.channel.open(replies[-1]) if replies else None
        if op is Op.STATUS and reply is not None and set(reply.body) == {"session"}:
            self.channel = Channel(self.channel.key, new_label(self.identity.decode()))
            self.channel.set_session(poll_session(reply.body["session"]))
            return self.send(op, {**(body or {}), "session": reply.body["session"]}, sender)
        return reply

    def raw_replies(self) -> list[list[Any]]:
        return [f for ident, f in self.sched.sent if ident == self.identity]


def make_scheduler(**env: str) -> Scheduler:
    """A scheduler for 2 workers and 1 server, replies captured in ``sched.sent``."""
    cfg = kvconfig.load({"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1",
                         "DMLC_PS_ROOT_PORT": "0", "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1",
                         "KVSTORE_SECRET": SECRET, **env})
    sched = Scheduler(cfg)
    sched.sent = []
    sched.service._send = lambda identity, frames, op: sched.sent.append((identity, frames))
    return sched


@pytest.fixture
def sched():
    s = make_scheduler()
    yield s
    transport.close(s.service.sock)


def register(sched: Scheduler, name: str, role: str, rank: int) -> Peer:
    peer = Peer(sched, name)
    challenge = peer.send(Op.HELLO, {"nonce": f"n-{name}"})
    body = {"role": role, "host": "127.0.0.1", "rank": rank, "mode": "dist_sync", "port": 9000,
            "challenge": challenge.body["challenge"]}
    peer.seq += 1
    sched.service.handle([peer.identity, *peer.channel.seal(Message(Op.REGISTER, body), "scheduler")])
    return peer


def complete(sched: Scheduler) -> dict[str, Peer]:
    """Register workers 0, 1 and server 0; key each peer's channel to the session."""
    peers = {"w0": register(sched, "w0", "worker", 0), "w1": register(sched, "w1", "worker", 1),
             "s0": register(sched, "s0", "server", 0)}
    assert sched.map_sent
    for peer in peers.values():
        peer.channel.set_session(sched.session)
    return peers


def test_status_before_the_cluster_is_complete(sched):
    """An outsider with the secret gets STATUS while nodes register: complete False, counts, joins."""
    register(sched, "w0", "worker", 0)
    reply = Peer(sched, "tool").send(Op.STATUS)
    assert reply.op is Op.OK and reply.body["schema"] == SCHEMA_VERSION
    cluster = reply.body["cluster"]
    assert cluster["complete"] is False and cluster["registered"] == {"worker": 1, "server": 0}
    own = reply.body["scheduler"]
    assert own["role"] == "scheduler" and own["joins"] == 1 and own["last_op"] == "register"
    assert own["nodes"] == [{"role": "worker", "rank": None, "host": "127.0.0.1",
                             "heartbeat_age_s": None, "left": False, "lost": False}]


def test_status_after_the_map_from_an_outsider_and_a_worker(sched):
    """After the map an outsider (secret, no session) gets the session over the late channel, sealed
    with the secret's pre-session key, then the status over the pollers' channel; a registered worker
    over its session channel."""
    peers = complete(sched)
    outsider = Peer(sched, "tool")
    reply = outsider.send(Op.STATUS)
    assert reply.op is Op.OK and reply.body["cluster"]["complete"] is True
    assert reply.body["cluster"]["mode"] == "dist_sync" and reply.body["cluster"]["session_age_s"] >= 0
    rows = reply.body["scheduler"]["nodes"]
    assert [(r["role"], r["rank"]) for r in rows] == [("server", 0), ("worker", 0), ("worker", 1)]
    assert outsider.send(Op.STATUS).op is Op.OK  # again: each request is answered
    reply = peers["w0"].send(Op.STATUS, sender=0)
    assert reply.op is Op.OK and reply.body["scheduler"]["joins"] == 3


@pytest.mark.parametrize("secret", ["wrong", None])
def test_status_with_the_wrong_secret_is_refused_unsigned(sched, secret):
    """A wrong or missing secret gets the one unsigned ERROR of any stranger, and no status."""
    complete(sched)
    tool = Peer(sched, "stranger", secret=secret)
    tool.seq += 1
    sched.service.handle([tool.identity, *tool.channel.seal(Message(Op.STATUS, {}), "scheduler")])
    (frames,) = tool.raw_replies()
    assert frames[0] == b""  # unsigned
    reply = protocol.decode(frames[1:])
    assert reply.op is Op.ERROR and reply.body["code"] == "AuthenticationError"
    assert "cluster" not in reply.body and "nodes" not in reply.body



def test_only_an_outsiders_status_holds_the_scheduler_at_exit(sched, monkeypatch):
    """A worker's own STATUS (stats(cluster=True)) does not make the exiting scheduler linger; an
    outsider's (a poller: kvstore.status, the TensorBoard writer) does, for STATUS_LINGER."""
    import kvstore.scheduler.scheduler as scheduler_process

    monkeypatch.setattr(scheduler_process, "STATUS_LINGER", 1.5)  # over a loaded machine's hiccups
    peers = complete(sched)
    assert peers["w0"].send(Op.STATUS, sender=0).op is Op.OK
    started = time.monotonic()
    sched._linger_for_status()
    assert time.monotonic() - started < 1.5
    assert Peer(sched, "tool").send(Op.STATUS).op is Op.OK
    started = time.monotonic()
    sched._linger_for_status()
    assert time.monotonic() - started >= 1.5


def test_a_following_poller_holds_the_exiting_scheduler_however_long_ago_it_asked(sched, monkeypatch):
    """A poller that says it follows the job (the TensorBoard writer) holds the exiting scheduler for
    FOLLOW_LINGER even when its last STATUS is older than STATUS_LINGER; one that does not, not then."""
    import kvstore.scheduler.scheduler as scheduler_process

    monkeypatch.setattr(scheduler_process, "STATUS_LINGER", 0.0)  # every request is already too old
    monkeypatch.setattr(scheduler_process, "FOLLOW_LINGER", 1.0)
    complete(sched)
    assert Peer(sched, "tool").send(Op.STATUS).op is Op.OK
    started = time.monotonic()
    sched._linger_for_status()
    assert time.monotonic() - started < 1.0
    assert Peer(sched, "writer").send(Op.STATUS, {"follow": True}).op is Op.OK
    started = time.monotonic()
    sched._linger_for_status()
    assert time.monotonic() - started >= 1.0

def beat(peer: Peer, role: str, rank: int, stats: Any = None) -> Message:
    body = {"role": role, "rank": rank}
    if stats is not None:
        body["stats"] = stats
    return peer.send(Op.HEARTBEAT, body, sender=rank)


def test_heartbeat_snapshots_are_kept_latest_only_and_listed(sched):
    """Each node's latest snapshot is kept and listed by STATUS; earlier ones are replaced."""
    peers = complete(sched)
    beat(peers["w1"], "worker", 1, node_snapshot("worker", 1, "h", 7, 0.0, 1.0, "push", 1.0))
    beat(peers["w1"], "worker", 1, node_snapshot("worker", 1, "h", 7, 0.0, 2.0, "pull", 2.0))
    beat(peers["s0"], "server", 0, dict(node_snapshot("server", 0, "h", 8, 0.0, 2.0), rounds_applied=4))
    nodes = Peer(sched, "tool").send(Op.STATUS).body["nodes"]
    assert [(n["role"], n["rank"]) for n in nodes] == [("server", 0), ("worker", 1)]
    assert nodes[1]["last_op"] == "pull" and nodes[0]["rounds_applied"] == 4
    assert len(sched.stats.snapshots) == 2


def test_a_leaves_snapshot_is_the_workers_last_and_a_later_beat_does_not_replace_it(sched):
    """A worker's LEAVE carries its final snapshot: STATUS lists it from then on, even when the final
    heartbeat (another connection) never comes or is read after the LEAVE with an older snapshot."""
    peers = complete(sched)
    beat(peers["w0"], "worker", 0, node_snapshot("worker", 0, "h", 7, 0.0, 1.0, "push", 1.0))
    final = node_snapshot("worker", 0, "h", 7, 0.0, 3.0, "barrier", 3.0)
    assert peers["w0"].send(Op.LEAVE, {"stats": final}, sender=0).op is Op.OK
    tool = Peer(sched, "tool")
    (worker,) = [n for n in tool.send(Op.STATUS).body["nodes"] if n["role"] == "worker"]
    assert worker["last_op"] == "barrier"
    beat(peers["w0"], "worker", 0, node_snapshot("worker", 0, "h", 7, 0.0, 2.0, "pull", 2.0))
    (worker,) = [n for n in tool.send(Op.STATUS).body["nodes"] if n["role"] == "worker"]
    assert worker["last_op"] == "barrier"


@pytest.mark.parametrize("stats", [
    [1], "text", {"schema": 1}, dict(node_snapshot("worker", 0, "h", 1, 0.0, 1.0)),
    dict(node_snapshot("worker", 1, "h", 1, 0.0, 1.0), blob=list(range(20000))),
    dict(node_snapshot("worker", 1, "h", 1, 0.0, 1.0), bad={3: 4}),
], ids=["list", "str", "no-role", "other-rank", "too-big", "int-key"])
def test_bad_snapshots_are_ignored_never_fatal(sched, stats, caplog):
    """A malformed or oversize snapshot is dropped and counted; the heartbeat is still answered, and
    a node's bad snapshots are logged once."""
    peers = complete(sched)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        for _ in range(3):
            assert beat(peers["w1"], "worker", 1, stats).op is Op.OK
    assert sched.stats.latest("worker", 1) is None
    refused = Peer(sched, "tool").send(Op.STATUS).body["scheduler"]["snapshots_refused"]
    assert sum(refused.values()) == 3
    assert sum("ignoring the stats" in r.message for r in caplog.records) == 1


def test_snapshots_of_unknown_nodes_are_not_kept(sched):
    """A heartbeat naming a node outside the map is answered, its snapshot not stored."""
    peers = complete(sched)
    assert beat(peers["w0"], "worker", 9, node_snapshot("worker", 9, "h", 1, 0.0, 1.0)).op is Op.OK
    assert sched.stats.snapshots == {} and sched.stats.refused == {"unknown-node": 1}


def test_status_reply_caps_the_snapshots_it_carries():
    """Past the budget, a node is listed as truncated."""
    stats = SchedulerStats(0.0, 0.0)
    for rank in range(3):
        snap = dict(node_snapshot("worker", rank, "h", 1, 0.0, 1.0), pad="x" * 1000)
        assert stats.heartbeat("worker", rank, snap, True, 1.0) is None
    listed = stats.node_snapshots(budget=9000)
    assert [n.get("truncated", False) for n in listed] == [False, False, True]
    assert listed[2] == {"schema": 1, "role": "worker", "rank": 2, "truncated": True}


def test_barrier_counters_and_node_rows():
    """Arrivals, releases and departures add up each worker's time in barriers."""
    stats = SchedulerStats(0.0, 0.0)
    stats.arrive(0, 10.0)
    assert stats.open_for(12.0) == 2.0
    stats.arrive(1, 13.0)
    stats.released(14.0)
    assert stats.barriers == 1 and stats.barrier_wait_s == {0: 4.0, 1: 1.0} and stats.open_for(15) is None
    stats.arrive(1, 20.0)
    stats.depart([1], 21.0)
    assert stats.barrier_wait_s[1] == 2.0 and stats.arrived == {}
    stats.heartbeat("worker", 0, None, True, 30.0)
    rows = node_rows([("worker", 0, "h"), ("worker", 1, "h")], stats, {1}, set(), 31.0)
    assert rows[0]["heartbeat_age_s"] == 1.0
    assert rows[1]["left"] is True and rows[1]["heartbeat_age_s"] is None


def test_barrier_stall_is_logged_once_naming_the_late_worker(caplog):
    """Past KVSTORE_STALL_WARN the scheduler logs once whom the barrier waits for and its last op."""
    sched = make_scheduler(KVSTORE_STALL_WARN="1")
    try:
        peers = complete(sched)
        beat(peers["w1"], "worker", 1, node_snapshot("worker", 1, "h", 1, 0.0, time.time(), "pull",
                                                      time.time() - 5))
        assert peers["w0"].send(Op.BARRIER, sender=0) is None  # waits
        with caplog.at_level(logging.WARNING, logger="scheduler"):
            sched.check_stall(time.monotonic())  # not yet
            for _ in range(3):
                sched.check_stall(time.monotonic() + 2)
        lines = [r.getMessage() for r in caplog.records if "KVSTORE_STALL_WARN" in r.getMessage()]
        assert len(lines) == 1 and "worker 1 (last op pull 5." in lines[0] and "[0]" in lines[0]
        assert Peer(sched, "tool").send(Op.STATUS).body["scheduler"]["waiting_in_barrier"] == [0]
    finally:
        transport.close(sched.service.sock)


def test_barrier_stall_abort_fails_the_waiters_with_stall_error():
    """Past KVSTORE_STALL_ABORT the waiting workers get StallError naming the late worker; their
    withdrawal is told the barrier did not pass, and the next barrier starts afresh."""
    sched = make_scheduler(KVSTORE_STALL_ABORT="2")
    try:
        peers = complete(sched)
        assert peers["w0"].send(Op.BARRIER, sender=0) is None
        sched.check_stall(time.monotonic() + 1)
        assert not any(i == b"w0" for i, _ in sched.sent[-1:])
        sched.check_stall(time.monotonic() + 3)
        reply = peers["w0"].channel.open(peers["w0"].raw_replies()[-1])
        assert reply.op is Op.ERROR and reply.body["code"] == "StallError"
        error = error_from_code(reply.body["code"], reply.body["message"])
        assert isinstance(error, StallError) and "worker 1" in str(error)
        assert "KVSTORE_STALL_ABORT=2" in str(error)
        assert peers["w0"].send(Op.BARRIER, {"cancel": True}, sender=0).body == {"released": False}
        assert sched.barrier.waiting == {} and sched.stats.opened_at is None
        assert peers["w0"].send(Op.BARRIER, sender=0) is None
        assert peers["w1"].send(Op.BARRIER, sender=1).op is Op.OK  # a new barrier passes
    finally:
        transport.close(sched.service.sock)


def test_heartbeat_carries_the_snapshot_and_survives_a_bad_one(caplog):
    """A node's Heartbeat puts stats() in each beat; a snapshot that raises or cannot fit a message
    is left out of the beat (logged once), the beat still goes."""
    from kvstore.net.heartbeat import Heartbeat

    cfg = kvconfig.load({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
                         "KVSTORE_SECRET": SECRET})
    scheduler_side = Channel(derive_key(SECRET), "scheduler")
    scheduler_side.set_session(b"s" * 16)
    snapshots = iter([{"schema": 1, "role": "worker"}, RuntimeError("broken"), "x" * (2 << 20)])

    def stats() -> dict:
        item = next(snapshots)
        if isinstance(item, Exception):
            raise item
        return item

    hb = Heartbeat(cfg, "worker", 1, b"s" * 16, lambda error: None, stats=stats)
    with caplog.at_level(logging.WARNING, logger="kvstore.heartbeat"):
        bodies = [scheduler_side.open(hb._beat()).body for _ in range(3)]
    assert bodies[0] == {"role": "worker", "rank": 1, "stats": {"schema": 1, "role": "worker"}}
    assert bodies[1] == bodies[2] == {"role": "worker", "rank": 1}
    assert sum("without this node's stats" in r.message for r in caplog.records) == 1
    plain = Heartbeat(cfg, "server", 0, b"s" * 16, lambda error: None)
    assert scheduler_side.open(plain._beat()).body == {"role": "server", "rank": 0}


def _replayed(sched: Scheduler, frames: list[Any], identity: bytes = b"replayer") -> list[Message]:
    """What ``sched`` answers (opened without checks) to ``frames`` sent again by ``identity``."""
    before = len(sched.sent)
    sched.service.handle([identity, *frames])
    return [protocol.decode(f[1:]) for ident, f in sched.sent[before:] if ident == identity]


def test_a_status_captured_on_one_cluster_is_not_answered_by_another():
    """Two clusters with the same secret: a STATUS request captured on one gets no status from the
    other (its session differs), at most the offer of that cluster's session."""
    first, second = make_scheduler(), make_scheduler()
    try:
        complete(first), complete(second)
        tool = Peer(first, "tool")
        assert "cluster" in tool.send(Op.STATUS).body
        replies = _replayed(second, tool.last)
        assert all("cluster" not in reply.body for reply in replies), replies
    finally:
        transport.close(first.service.sock), transport.close(second.service.sock)


def test_a_status_captured_during_the_rendezvous_is_not_answered_after_the_map(sched):
    """A STATUS request captured before the map is not answered again once the map is out."""
    register(sched, "w0", "worker", 0)
    tool = Peer(sched, "tool")
    assert tool.send(Op.STATUS).body["cluster"]["complete"] is False
    complete_rest = {"w1": register(sched, "w1", "worker", 1), "s0": register(sched, "s0", "server", 0)}
    assert sched.map_sent and complete_rest
    replies = _replayed(sched, tool.last, tool.identity)
    assert all("cluster" not in reply.body for reply in replies), replies


def test_a_status_flood_gets_a_bounded_number_of_replies(sched):
    """A poller asking 500 times without pause gets at most the gate's burst of replies (the rest are
    counted, not queued); another poller is still answered, and a worker is never limited."""
    peers = complete(sched)
    tool = Peer(sched, "tool")
    answered = sum(tool.send(Op.STATUS) is not None for _ in range(500))
    assert POLL_BURST <= answered <= POLL_BURST + 5, answered
    assert sched.service.drops.totals["status-over-rate"] >= 400
    assert Peer(sched, "other").send(Op.STATUS).op is Op.OK
    assert all(peers["w0"].send(Op.STATUS, sender=0) is not None for _ in range(50))


def test_a_late_heartbeat_is_logged_with_what_held_it(caplog):
    """A beat that goes out more than half a heartbeat timeout after the previous one is logged by the
    node itself, with the previous beat's send time and the links check's; an on-time one is not."""
    from kvstore.net.heartbeat import Heartbeat

    cfg = kvconfig.load({"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1", "KVSTORE_SECRET": SECRET,
                         "KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "1"})
    hb = Heartbeat(cfg, "worker", 0, b"s" * 16, lambda error: None)
    with caplog.at_level(logging.WARNING, logger="kvstore.heartbeat"):
        assert hb._note_late(None, 5.0, 0.0, 0.0) == 5.0  # the first beat
        assert hb._note_late(5.0, 5.69, 0.01, 0.2) == 5.69  # 0.2 + 0.5 allowed
        assert not caplog.records
        hb._note_late(5.69, 6.5, 0.25, 0.125)
    (record,) = caplog.records
    assert "went out 0.81 s after the previous one" in record.message
    assert "every 0.2 s expected" in record.message and "silent for 1 s is lost" in record.message
    assert "0.25 s to send" in record.message and "links 0.12 s" in record.message

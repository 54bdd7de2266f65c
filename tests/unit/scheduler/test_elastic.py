"""The scheduler's side of an elastic job (docs/elastic.md) over the fake transport: slots and joins."""

from __future__ import annotations

from kvstore.net.protocol import Message, Op
from kvstore.scheduler.scheduler import Scheduler
from tests.unit.scheduler.test_scheduler import Peer, make_scheduler, register


def elastic(**env: str) -> tuple[Scheduler, dict[str, Peer]]:
    """A scheduler of 4 worker slots, 2 present (KVSTORE_ELASTIC_WORKERS=2), and 1 server, all registered
    (``env``: more settings)."""
    sched = make_scheduler(DMLC_NUM_WORKER="4", KVSTORE_ELASTIC_WORKERS="2", **env)
    peers = {}
    for name, role, rank in (("s0", "server", 0), ("w0", "worker", 0), ("w1", "worker", 1)):
        peers[name], _ = register(sched, name, role, rank)
    for peer in peers.values():
        peer.replies()
        peer.channel.set_session(sched.session)
    return sched, peers


def join(sched: Scheduler, name: str, rank: int, incarnation: int, flag: bool = True) -> Message:
    """A late HELLO and REGISTER of a joining worker; the REGISTER's reply."""
    peer = Peer(sched, name)
    (challenge,) = peer.send(Op.HELLO, {"nonce": f"n-{name}"})
    assert challenge.op is Op.CHALLENGE, challenge.body
    body = {"role": "worker", "host": "h", "rank": rank, "mode": "dist_sync", "incarnation": incarnation,
            "challenge": challenge.body["challenge"], **({"join": True} if flag else {})}
    (reply,) = peer.send(Op.REGISTER, body)
    return reply


def test_two_of_four_slots_complete_the_rendezvous_and_the_rest_are_absent() -> None:
    """The map goes out at 2 workers; it names slots 2 and 3 absent, which count as left."""
    sched, _ = elastic()
    assert sched.map_sent and sched.map_body["absent"] == [2, 3] and sched.left == {2, 3}
    assert sched.barrier.num_workers == 2


def test_a_join_takes_an_absent_slot_and_counts_in_barriers() -> None:
    """A joining worker of slot 2 gets the map with join and rejoin; it is no longer absent."""
    sched, peers = elastic()
    reply = join(sched, "w2", 2, 1)
    assert reply.op is Op.MAP and reply.body["join"] and reply.body["rejoin"], reply.body
    assert reply.body["rank"] == 2 and reply.body["incarnation"] == 1
    assert sched.left == {3} and sched.barrier.num_workers == 3 and sched.map_body["absent"] == [3]
    assert peers["w0"].send(Op.BARRIER, {}, sender=0) == []  # the barrier now waits for worker 2 too
    assert peers["w1"].send(Op.BARRIER, {}, sender=1) == []


def test_a_join_of_a_present_slot_an_old_incarnation_or_a_plain_late_worker_is_refused() -> None:
    """A join names an absent slot with an incarnation above its last; a late REGISTER that is no join
    is a restart, refused without a budget; nothing changes."""
    sched, _ = elastic()
    assert join(sched, "x1", 1, 1).op is Op.ERROR
    assert join(sched, "x2", 2, 0).op is Op.ERROR
    assert join(sched, "x3", 3, 1, flag=False).op is Op.ERROR
    assert sched.left == {2, 3} and sched.barrier.num_workers == 2


def test_a_job_that_is_not_elastic_refuses_a_join() -> None:
    """Without KVSTORE_ELASTIC_WORKERS a late HELLO is told the cluster is complete."""
    sched = make_scheduler()
    for name, role, rank in (("s0", "server", 0), ("w0", "worker", 0), ("w1", "worker", 1)):
        register(sched, name, role, rank)
    (reply,) = Peer(sched, "late").send(Op.HELLO, {"nonce": "n"})
    assert reply.op is Op.ERROR and "already complete" in reply.body["message"]


def test_a_barrier_release_gives_every_worker_the_same_view_and_keeps_its_tag() -> None:
    """Both workers released by one barrier read its number and who is absent; the tag one of them sent
    is kept as the job's last view, which a worker that joins afterwards gets with its map."""
    sched, peers = elastic()
    assert peers["w0"].send(Op.BARRIER, {"tag": [0, 0]}, sender=0) == []
    (r1,) = peers["w1"].send(Op.BARRIER, {"tag": [0, 0]}, sender=1)
    (r0,) = peers["w0"].replies()
    assert r0.body["view"] == r1.body["view"] == 1 and r0.body["left"] == r1.body["left"] == [2, 3]
    assert r0.body["tag"] == r1.body["tag"] == [0, 0]
    assert peers["w0"].send(Op.BARRIER, {}, sender=0) == []  # an untagged barrier keeps the last view
    (r1,) = peers["w1"].send(Op.BARRIER, {}, sender=1)
    assert r1.body == {"failures": [], "left": [2, 3]}
    reply = join(sched, "w2", 2, 1)
    assert reply.body["view"] == {"view": 1, "left": [2, 3], "tag": [0, 0]}, reply.body


def test_a_barrier_tag_that_is_not_a_few_ints_is_refused() -> None:
    """A tag of a str or of more than 8 ints is a ProtocolError; the barrier does not count the worker."""
    sched, peers = elastic()
    (reply,) = peers["w0"].send(Op.BARRIER, {"tag": ["x"]}, sender=0)
    assert reply.op is Op.ERROR and reply.body["code"] == "ProtocolError"
    (reply,) = peers["w0"].send(Op.BARRIER, {"tag": list(range(9))}, sender=0)
    assert reply.op is Op.ERROR and sched.barrier.waiting == {}


def test_a_barrier_after_the_job_shrank_below_min_workers_fails_on_every_worker() -> None:
    """KVSTORE_MIN_WORKERS=2: once worker 1 left, worker 0's next barrier fails with TooFewWorkersError
    naming the present workers and the minimum; the barriers before it went through."""
    sched, peers = elastic(KVSTORE_MIN_WORKERS="2")
    assert peers["w0"].send(Op.BARRIER, {}, sender=0) == []
    (ok,) = peers["w1"].send(Op.BARRIER, {}, sender=1)
    assert ok.op is Op.OK
    peers["w0"].replies()
    assert peers["w1"].send(Op.LEAVE, {}, sender=1)[0].op is Op.OK
    (reply,) = peers["w0"].send(Op.BARRIER, {}, sender=0)
    assert reply.op is Op.ERROR and reply.body["code"] == "TooFewWorkersError", reply.body
    message = reply.body["message"]
    assert "1 worker(s) present (ranks [0])" in message and "--min-workers 2" in message


def test_a_leave_that_releases_a_waiting_barrier_below_min_workers_fails_it() -> None:
    """A worker waiting in a barrier when the leave takes the job below the minimum gets the error at once."""
    sched, peers = elastic(KVSTORE_MIN_WORKERS="2")
    assert peers["w0"].send(Op.BARRIER, {}, sender=0) == []
    assert peers["w1"].send(Op.LEAVE, {}, sender=1)[0].op is Op.OK
    (reply,) = peers["w0"].replies()
    assert reply.op is Op.ERROR and reply.body["code"] == "TooFewWorkersError", reply.body


def test_a_membership_view_paired_with_a_plain_barrier_fails_on_every_worker() -> None:
    """Worker 1's last plain barrier (it is leaving) meets worker 0's membership view: both get
    CollectiveMismatchError naming who asked for what, and the barrier counts as passed (the next, both
    asking for the view, is released with number 2)."""
    sched, peers = elastic()
    assert peers["w0"].send(Op.BARRIER, {"tag": [1, 4], "after": 0}, sender=0) == []
    (r1,) = peers["w1"].send(Op.BARRIER, {"after": 0}, sender=1)
    (r0,) = peers["w0"].replies()
    for reply in (r0, r1):
        assert reply.op is Op.ERROR and reply.body["code"] == "CollectiveMismatchError", reply.body
        assert "workers [0] asked for membership view [1, 4]" in reply.body["message"]
        assert "workers [1] asked for a plain barrier" in reply.body["message"]
    assert peers["w0"].send(Op.BARRIER, {"tag": [1, 4], "after": 1}, sender=0) == []
    (r1,) = peers["w1"].send(Op.BARRIER, {"tag": [1, 4], "after": 1}, sender=1)
    assert r1.op is Op.OK and r1.body["view"] == 2 and r1.body["tag"] == [1, 4], r1.body


def test_membership_views_of_differing_tags_fail_on_every_worker() -> None:
    """Two workers asking for views of different tags (they disagree on the epoch) both fail, and no
    view is kept for a worker that joins later."""
    sched, peers = elastic()
    assert peers["w0"].send(Op.BARRIER, {"tag": [1, 4]}, sender=0) == []
    (r1,) = peers["w1"].send(Op.BARRIER, {"tag": [2, 8]}, sender=1)
    (r0,) = peers["w0"].replies()
    assert r0.body["code"] == r1.body["code"] == "CollectiveMismatchError", (r0.body, r1.body)
    assert join(sched, "w2", 2, 1).body.get("view") is None


def test_a_worker_that_joined_before_the_first_view_follows_any_call_up_to_it() -> None:
    """A joiner's follow barriers pair with the others' plain (digest-carrying) barriers and with their
    membership view, which names it and gives it the tag; a follow that is not a bool is refused."""
    sched, peers = elastic()
    peer = Peer(sched, "w2")
    (challenge,) = peer.send(Op.HELLO, {"nonce": "n-w2"})
    body = {"role": "worker", "host": "h", "rank": 2, "mode": "dist_sync", "incarnation": 1,
            "challenge": challenge.body["challenge"], "join": True}
    (cmap,) = peer.send(Op.REGISTER, body)
    assert cmap.op is Op.MAP and cmap.body["barriers"] == 0 and "view" not in cmap.body
    peer.channel.set_session(sched.session)
    (refused,) = peer.send(Op.BARRIER, {"follow": "yes"}, sender=2)
    assert refused.op is Op.ERROR and "follow" in refused.body["message"]
    assert peers["w0"].send(Op.BARRIER, {"digest": "d", "after": 0}, sender=0) == []
    assert peers["w1"].send(Op.BARRIER, {"digest": "d", "after": 0}, sender=1) == []
    (plain,) = peer.send(Op.BARRIER, {"follow": True, "after": 0}, sender=2)
    assert plain.op is Op.OK and "tag" not in plain.body and plain.body["digests"] == [[[0, 1], "d"]]
    assert [r.op for name in ("w0", "w1") for r in peers[name].replies()] == [Op.OK, Op.OK]
    assert peers["w0"].send(Op.BARRIER, {"tag": [0, 0], "after": 1}, sender=0) == []
    assert peer.send(Op.BARRIER, {"follow": True, "after": 1}, sender=2) == []
    (r1,) = peers["w1"].send(Op.BARRIER, {"tag": [0, 0], "after": 1}, sender=1)
    (r0,) = peers["w0"].replies()
    (view,) = peer.replies()
    for reply in (r0, r1, view):
        assert reply.op is Op.OK and reply.body["view"] == 2 and reply.body["tag"] == [0, 0], reply.body
        assert reply.body["left"] == [3]

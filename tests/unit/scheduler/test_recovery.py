"""A restarted scheduler's rebuild (scheduler/recovery.py): the pure bookkeeping, and the scheduler
taking the cluster's nodes back over the in-memory ROUTER."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import AuthenticationError, ProtocolError
from kvstore.net.auth import heartbeat_label, is_heartbeat_label
from kvstore.net.protocol import Message, Op
from kvstore.scheduler.recovery import Recovery, session_digest, write_digest
from kvstore.scheduler.scheduler import Scheduler
from tests.unit.scheduler.test_elastic import join
from tests.unit.scheduler.test_scheduler import Peer, complete, make_scheduler

SESSION = b"s" * 16
MAP = {"num_workers": 2, "num_servers": 1, "servers": [["h", 9000]], "mode": "dist_sync", "seed": 7,
       "session": SESSION, "chunk_bytes": 1 << 20}


def body(role: str, rank: int, label: str, session: bytes = SESSION, **extra: object) -> dict:
    """A re-registration's REGISTER body."""
    return {"role": role, "rank": rank, "incarnation": 0, "host": f"host-{role}{rank}", "label": label,
            "session": session, "map": dict(MAP), "port": 9100 + rank, **extra}


def test_a_re_registration_without_the_old_session_is_refused_and_changes_nothing():
    """A holder of the secret but not the session (a stranger) cannot take a rank, even first."""
    book = Recovery(2, 1, session_digest(SESSION))
    with pytest.raises(AuthenticationError, match="does not carry the session"):
        book.admit(body("worker", 0, "w0", session=b"x" * 16))
    assert book.nodes == {} and book.map is None and book.session is None


def test_a_rank_taken_back_by_one_connection_is_refused_to_another():
    """A second claim on worker 1 from another label (or incarnation) is refused; the same node's retry
    is accepted."""
    book = Recovery(2, 1, session_digest(SESSION))
    book.admit(body("worker", 1, "w1"))
    with pytest.raises(ProtocolError, match="another connection"):
        book.admit(body("worker", 1, "intruder"))
    with pytest.raises(ProtocolError, match="another connection"):
        book.admit(body("worker", 1, "w1", incarnation=2))
    assert book.admit(body("worker", 1, "w1")).label == "w1"
    assert book.nodes[("worker", 1)].label == "w1"


def test_the_rebuild_waits_for_every_node_that_was_alive_and_takes_what_they_know():
    """Workers that left (the launcher's word or a member's) or are away are not waited for; barriers
    passed is the most any worker passed; a server's address replaces the map's."""
    book = Recovery(3, 1, session_digest(SESSION), left=[2], used=1)
    assert not book.complete
    book.admit(body("worker", 0, "w0", passed=4, away=[1], used=2, map=dict(MAP, num_workers=3)))
    assert book.missing() == [("server", 0)] and book.away == {1} and book.left == {2}
    book.admit(body("server", 0, "s0", incarnation=1))
    assert book.complete and book.generation == 4 and book.used == 2
    assert book.map is not None and book.map["servers"] == [["host-server0", 9100]]
    assert book.map["server_incarnations"] == [1]
    with pytest.raises(ProtocolError, match="has left"):
        book.admit(body("worker", 2, "w2"))


def test_a_malformed_re_registration_is_refused():
    """A rank outside the counts, a server without a port, or a map of other counts: ProtocolError."""
    book = Recovery(2, 1, session_digest(SESSION))
    for bad in (body("worker", 2, "w"), body("server", 0, "s", port=None),
                body("worker", 0, "w", map=dict(MAP, num_workers=3)), body("worker", 0, "w", left=[5])):
        with pytest.raises(ProtocolError):
            book.admit(bad)
    assert book.nodes == {}


def restarted(tmp_path: Path) -> Scheduler:
    """A second incarnation of a scheduler for 2 workers and 1 server whose first one had SESSION."""
    port_file = str(tmp_path / "scheduler.port")
    write_digest(port_file, SESSION)
    return make_scheduler(KVSTORE_INCARNATION="1", KVSTORE_PORT_FILE=port_file, KVSTORE_MAX_RESTARTS="2",
                          KVSTORE_RESTARTS_USED="1")


def reregister(sched: Scheduler, name: str, role: str, rank: int, **extra: object) -> tuple[Peer, Message]:
    """HELLO then a re-registering REGISTER; the peer (its channel keyed to the session) and the reply."""
    peer = Peer(sched, name)
    (challenge,) = peer.send(Op.HELLO, {"nonce": f"n-{name}"})
    (reply,) = peer.send(Op.REGISTER, dict(body(role, rank, peer.channel.label, **extra),
                                           challenge=challenge.body["challenge"]))
    peer.channel.set_session(SESSION)
    return peer, reply


def test_a_restarted_scheduler_takes_its_nodes_back_and_repeats_only_the_open_barrier(tmp_path: Path):
    """Each node re-registers (a stranger is refused meanwhile); a BARRIER held while rebuilding is
    answered after; a barrier released before the death is answered at once, the open one counted."""
    sched = restarted(tmp_path)
    w0, reply = reregister(sched, "w0", "worker", 0, passed=3)
    assert reply.op is Op.MAP and reply.body["session"] == SESSION and not sched.map_sent
    (early,) = w0.send(Op.HEARTBEAT, {"role": "worker", "rank": 1})  # worker 1 is not back yet: refused
    assert early.op is Op.ERROR
    assert w0.send(Op.BARRIER, {"after": 3}, sender=0) == []  # held back while rebuilding
    _, refused = reregister(sched, "stranger", "worker", 1, session=b"y" * 16)
    assert refused.op is Op.ERROR and refused.body["code"] == "AuthenticationError"
    s0, _ = reregister(sched, "s0", "server", 0)
    s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})  # its own connection: AWAY and SHUTDOWN go there
    assert not sched.map_sent
    w1, _ = reregister(sched, "w1", "worker", 1, passed=2)  # its reply to barrier 3 was lost
    assert sched.map_sent and sched.barrier.generation == 3 and sched.restarts.book.used == 1
    (late,) = w1.send(Op.BARRIER, {"after": 2}, sender=1)  # barrier 3: released before the death
    assert late.op is Op.OK and late.body == {"failures": [], "left": []}
    (second,) = w1.send(Op.BARRIER, {"after": 3}, sender=1)  # barrier 4 with w0's held one: released
    (first,) = w0.replies()
    assert first.op is Op.OK and second.op is Op.OK and sched.barrier.generation == 4
    (beat,) = s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})
    assert beat.op is Op.OK and beat.body["restarts"] == [1, 2]
    assert sched.servers[0].identity == b"s0"  # SHUTDOWN and AWAY go to its connection


def test_a_barrier_that_reaches_a_restarted_scheduler_before_its_sender_is_held_not_refused(tmp_path: Path):
    """A worker's BARRIER queued across the death arrives before the worker re-registered (its label
    not yet bound): held, then counted once the worker is back, not refused."""
    sched = restarted(tmp_path)
    w0, _ = reregister(sched, "w0", "worker", 0, passed=3)
    w1 = Peer(sched, "w1")
    w1.channel.set_session(SESSION)
    assert w1.send(Op.BARRIER, {"after": 3}, sender=1) == []  # unbound yet: held
    assert w0.send(Op.BARRIER, {"after": 3}, sender=0) == []
    s0, _ = reregister(sched, "s0", "server", 0)
    s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})
    rebind = Peer(sched, "w1-rebind")  # its heartbeat's fresh socket, naming w1's request label
    (challenge,) = rebind.send(Op.HELLO, {"nonce": "n"})
    (reply,) = rebind.send(Op.REGISTER, dict(body("worker", 1, w1.channel.label, passed=3),
                                             challenge=challenge.body["challenge"]))
    assert reply.op is Op.MAP and sched.map_sent
    (first,), (second,) = w0.replies(), w1.replies()
    assert first.op is Op.OK and second.op is Op.OK and sched.barrier.generation == 4


def test_a_live_scheduler_answers_a_barrier_it_released_already(tmp_path: Path):
    """A worker that resends a barrier whose release it did not see (after < barriers released) is
    answered at once, and nothing is counted twice."""
    sched = make_scheduler()
    peers = complete(sched)
    peers["w0"].send(Op.BARRIER, {"after": 0}, sender=0)
    peers["w1"].send(Op.BARRIER, {"after": 0}, sender=1)
    peers["w0"].replies()  # its release
    assert sched.barrier.generation == 1
    (again,) = peers["w0"].send(Op.BARRIER, {"after": 0}, sender=0)
    assert again.op is Op.OK and sched.barrier.waiting == {} and sched.barrier.generation == 1


def test_a_live_scheduler_lets_a_member_take_its_own_rank_back_only():
    """A re-registration on a live scheduler (its beats went unanswered a while) is accepted for the
    node's own rank and label, refused for another's."""
    sched = make_scheduler(KVSTORE_MAX_RESTARTS="1", KVSTORE_SCHEDULER_RESTARTS="1")
    peers = complete(sched)
    label = peers["w0"].channel.label
    for rank, expected in ((0, Op.MAP), (1, Op.ERROR)):
        peer = Peer(sched, f"again{rank}")
        (challenge,) = peer.send(Op.HELLO, {"nonce": "n"})
        (reply,) = peer.send(Op.REGISTER, dict(body("worker", rank, label, session=sched.session),
                                               challenge=challenge.body["challenge"]))
        assert reply.op is expected, reply.body


def test_a_restarted_scheduler_refuses_numbers_its_predecessor_may_have_seen(tmp_path: Path):
    """A re-registration says where its channels' numbers stand: a message from that label numbered at
    or below it (a replay of one the dead scheduler took) is refused; the next one is served."""
    sched = restarted(tmp_path)
    w0 = Peer(sched, "w0")
    w0.channel.set_session(SESSION)
    rebind = Peer(sched, "w0-rebind")
    (challenge,) = rebind.send(Op.HELLO, {"nonce": "n"})
    rebind.send(Op.REGISTER, dict(body("worker", 0, w0.channel.label, counters=[[w0.channel.label, 10]]),
                                  challenge=challenge.body["challenge"]))
    w0.post(Op.HEARTBEAT, {"role": "worker", "rank": 0})  # numbered 1: as if replayed
    assert [frames[0] for frames in w0.raw()] == [b""]  # refused, unsigned
    w0.seen = 1  # that refusal read
    while w0.channel.reserve() < 10:
        pass
    (beat,) = w0.send(Op.HEARTBEAT, {"role": "worker", "rank": 0})
    assert beat.op is Op.OK


def test_a_malformed_first_map_does_not_wedge_the_rebuild(tmp_path: Path):
    """A first re-registration whose map's server entry is malformed is refused and changes nothing:
    the real nodes that follow still rebuild the cluster."""
    sched = restarted(tmp_path)
    _, bad = reregister(sched, "bad", "worker", 0, map=dict(MAP, servers=[5]))
    assert bad.op is Op.ERROR
    assert sched._recovery is not None and sched._recovery.nodes == {} and sched._recovery.map is None
    reregister(sched, "w0", "worker", 0)
    s0, r1 = reregister(sched, "s0", "server", 0)
    w1, r2 = reregister(sched, "w1", "worker", 1)
    assert r1.op is Op.MAP and r2.op is Op.MAP, (r1.body, r2.body)
    s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})
    assert sched.map_sent and sched.map_body["servers"] == [["host-server0", 9100]]


def test_a_server_incarnations_field_of_another_shape_is_refused_before_anything_changes(tmp_path: Path):
    """A map carrying server_incarnations of the wrong shape (a str, the wrong length, not ints) is
    refused, not half-admitted."""
    sched = restarted(tmp_path)
    for i, bad in enumerate(("x", [1, 2], ["1"])):
        _, reply = reregister(sched, f"bad{i}", "server", 0, incarnation=1,
                              map=dict(MAP, server_incarnations=bad))
        assert reply.op is Op.ERROR, bad
        assert sched._recovery is not None and sched._recovery.nodes == {} and sched._recovery.map is None
    _, good = reregister(sched, "s0", "server", 0, incarnation=1, map=dict(MAP, server_incarnations=[0]))
    assert good.op is Op.MAP and sched.map_body["server_incarnations"] == [1]


def test_a_map_with_servers_of_another_shape_is_refused():
    """Each server entry of a first re-registration's map must be [host (str), port (int)]: else
    ProtocolError, and nothing is recorded."""
    book = Recovery(2, 1, session_digest(SESSION))
    for servers in ([5], [["h"]], [[1, 9000]], [["h", "9000"]], [["h", 0]], [("h", 9000, 1)]):
        with pytest.raises(ProtocolError, match="server"):
            book.admit(body("worker", 0, "w0", map=dict(MAP, servers=servers)))
    assert book.nodes == {} and book.map is None and book.session is None


def test_a_re_registration_cannot_floor_another_nodes_label(tmp_path: Path):
    """A re-registration's counters may floor only the labels of the node re-registering: worker 0
    naming worker 1's request label with a huge number must not cut worker 1 off the scheduler."""
    sched = restarted(tmp_path)
    w1 = Peer(sched, "w1")
    w1.channel.set_session(SESSION)
    reregister(sched, "w0", "worker", 0, counters=[[w1.channel.label, 10**15]])
    s0, _ = reregister(sched, "s0", "server", 0)
    s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})
    rebind = Peer(sched, "w1-rebind")
    (challenge,) = rebind.send(Op.HELLO, {"nonce": "n"})
    (reply,) = rebind.send(Op.REGISTER, dict(body("worker", 1, w1.channel.label),
                                             challenge=challenge.body["challenge"]))
    assert reply.op is Op.MAP and sched.map_sent
    w1.post(Op.HEARTBEAT, {"role": "worker", "rank": 1})
    assert w1.raw()[-1][0] != b"", "worker 1's beat was refused as a replay (unsigned refusal)"


def test_a_re_registration_keeps_only_its_own_labels_counters():
    """Counters are kept for the node's request label and its own heartbeat label only: another rank's
    heartbeat label or a label another node re-registered with are dropped; a label another node
    re-registered with is refused as the node's own."""
    beat0, beat1 = heartbeat_label("worker", 0), heartbeat_label("worker", 1)
    assert not is_heartbeat_label(heartbeat_label("worker", 10), "worker", 1)
    book = Recovery(2, 1, session_digest(SESSION))
    book.admit(body("worker", 1, "w1"))
    node = book.admit(body("worker", 0, "w0", counters=[["w0", 5], [beat0, 6], [beat1, 7], ["w1", 8]]))
    assert node.counters == (("w0", 5), (beat0, 6))
    assert book.nodes[("worker", 0)].counters == node.counters
    with pytest.raises(ProtocolError, match="label"):
        book.admit(body("server", 0, "w1"))
    assert ("server", 0) not in book.nodes


def test_a_live_scheduler_does_not_let_one_member_take_anothers_rank_by_naming_its_label():
    """Without KVSTORE_SCHEDULER_RESTARTS (nodes never re-register), a live scheduler refuses a
    re-registration: a member naming worker 0's label (sent in clear) cannot take its rank back."""
    sched = make_scheduler(KVSTORE_MAX_RESTARTS="1")
    peers = complete(sched)
    victim = peers["w0"].channel.label
    peer = Peer(sched, "w1-rebind")
    (challenge,) = peer.send(Op.HELLO, {"nonce": "n"})
    (reply,) = peer.send(Op.REGISTER, dict(body("worker", 0, victim, session=sched.session,
                                                counters=[[victim, 10**15]]),
                                           challenge=challenge.body["challenge"]))
    assert reply.op is Op.ERROR, "another connection re-registered as worker 0 by naming its label"


def test_without_scheduler_restarts_a_member_cannot_cut_another_worker_off():
    """Under a worker/server restart budget only (no KVSTORE_SCHEDULER_RESTARTS: behaviour must not
    change), a re-registration naming worker 0's label must not floor its numbers: worker 0's next
    heartbeat is still served."""
    sched = make_scheduler(KVSTORE_MAX_RESTARTS="1")
    peers = complete(sched)
    victim = peers["w0"].channel.label
    peer = Peer(sched, "w1-again")
    (challenge,) = peer.send(Op.HELLO, {"nonce": "n"})
    peer.send(Op.REGISTER, dict(body("worker", 0, victim, session=sched.session,
                                     counters=[[victim, 10**15]]), challenge=challenge.body["challenge"]))
    peers["w0"].post(Op.HEARTBEAT, {"role": "worker", "rank": 0})
    assert peers["w0"].raw()[-1][0] != b"", "worker 0's beat was refused as a replay: cut off"


def test_a_live_scheduler_that_can_be_restarted_floors_nothing_on_a_re_registration():
    """With KVSTORE_SCHEDULER_RESTARTS, a live scheduler's re-registration (its own rank and label) sets
    no floor: it has seen every number itself, so naming a huge one cannot cut the node off."""
    sched = make_scheduler(KVSTORE_MAX_RESTARTS="1", KVSTORE_SCHEDULER_RESTARTS="1")
    peers = complete(sched)
    label = peers["w0"].channel.label
    peer = Peer(sched, "w0-rebind")
    (challenge,) = peer.send(Op.HELLO, {"nonce": "n"})
    (reply,) = peer.send(Op.REGISTER, dict(body("worker", 0, label, session=sched.session,
                                                counters=[[label, 10**15]]),
                                           challenge=challenge.body["challenge"]))
    assert reply.op is Op.MAP
    (beat,) = peers["w0"].send(Op.HEARTBEAT, {"role": "worker", "rank": 0})
    assert beat.op is Op.OK


def test_the_rebuilt_map_takes_the_schedulers_own_settings_not_the_first_members():
    """A first re-registration's map claiming other settings (chunk size, message limit, window,
    staleness) and carrying unknown fields: the rebuilt map has the scheduler's own settings and only the
    fields it knows."""
    settings = {"chunk_bytes": 1 << 20, "max_message_bytes": 64 << 20, "push_window": 32, "staleness": None}
    book = Recovery(2, 1, session_digest(SESSION), settings=settings)
    claimed = dict(MAP, chunk_bytes=1, max_message_bytes=1 << 40, push_window=0, staleness=0, extra="x",
                   rank=1, absent=[1])
    book.admit(body("worker", 0, "w0", map=claimed))
    assert book.map is not None
    assert {k: book.map[k] for k in settings} == settings
    assert "extra" not in book.map and "rank" not in book.map and book.map["absent"] == [1]
    assert book.map["seed"] == MAP["seed"] and book.map["servers"] == [["h", 9000]]


@pytest.mark.parametrize("change", [{"session": b"t" * 16}, {"seed": -1}, {"seed": "7"}, {"seed": None},
                                    {"sync_quorum": 0}, {"sync_quorum": 3}, {"sync_quorum": "2"},
                                    {"absent": [2]}, {"absent": "1"}])
def test_a_first_map_with_a_bad_seed_quorum_session_or_absent_slots_is_refused(change: dict) -> None:
    """The member-held fields a rebuilt map keeps are checked: another session, a seed that is not an
    int in [0, 2**63), a quorum outside [1, workers], absent slots that are not ranks: ProtocolError, and
    nothing is recorded."""
    book = Recovery(2, 1, session_digest(SESSION))
    with pytest.raises(ProtocolError):
        book.admit(body("worker", 0, "w0", map={**MAP, **change}))
    assert book.nodes == {} and book.map is None and book.session is None


def test_the_last_tagged_view_is_learnt_back_from_the_workers_and_bad_ones_are_refused():
    """A worker re-registers with its last tagged membership view: the rebuild keeps the highest-numbered
    one any worker had; a view numbered past the worker's barriers, or with a bad tag or left, is refused."""
    book = Recovery(3, 1, session_digest(SESSION))
    m3 = dict(MAP, num_workers=3)
    for bad in ({"view": 5, "left": [], "tag": [1]}, {"view": 2, "left": [7], "tag": []},
                {"view": 2, "left": [], "tag": ["x"]}, {"view": 2, "left": [], "tag": list(range(99))}, [2]):
        with pytest.raises(ProtocolError):
            book.admit(body("worker", 0, "w0", passed=3, view=bad, map=m3))
    assert book.last_view is None
    book.admit(body("worker", 0, "w0", passed=3, view={"view": 3, "left": [2], "tag": [4, 1]}, map=m3))
    book.admit(body("worker", 1, "w1", passed=2, view={"view": 1, "left": [], "tag": [0]}, map=m3))
    assert book.last_view == {"view": 3, "left": [2], "tag": [4, 1]}


def test_a_restarted_scheduler_answers_a_replayed_tagged_barrier_with_its_view(tmp_path: Path):
    """A membership barrier released just before the scheduler's death, whose reply one worker lost: the
    restarted scheduler learns the view from the worker that saw it and answers the replay with that view
    and tag (not a bare barrier), and keeps it as the job's last view."""
    sched = restarted(tmp_path)
    seen = {"view": 3, "left": [], "tag": [9]}
    reregister(sched, "w0", "worker", 0, passed=3, view=seen)
    s0, _ = reregister(sched, "s0", "server", 0)
    s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})
    w1, _ = reregister(sched, "w1", "worker", 1, passed=2)  # its reply to barrier 3 was lost
    assert sched.map_sent
    (late,) = w1.send(Op.BARRIER, {"after": 2, "tag": [9]}, sender=1)
    assert late.op is Op.OK and late.body == {"failures": [], "left": [], "view": 3, "tag": [9]}
    (older,) = w1.send(Op.BARRIER, {"after": 1}, sender=1)  # an untagged barrier before it: no view
    assert older.body == {"failures": [], "left": []}


def test_a_worker_that_re_registers_has_not_left_whatever_another_member_still_knew():
    """An elastic job's slot a member still knew absent (joined since) is not left once that worker
    re-registers itself, in either order; the launcher's word (no live process) still refuses a rank."""
    m4 = dict(MAP, num_workers=4, absent=[2, 3])
    book = Recovery(4, 1, session_digest(SESSION), left=[1])
    book.admit(body("worker", 0, "w0", left=[1, 2, 3], map=m4))  # its word of slot 2 predates the join
    assert book.left == {1, 2, 3} and book.missing() == [("server", 0)]
    book.admit(body("worker", 2, "w2", incarnation=1, left=[1, 3], map=m4))
    assert book.left == {1, 3} and book.missing() == [("server", 0)]
    with pytest.raises(ProtocolError, match="has left"):
        book.admit(body("worker", 1, "w1", map=m4))
    book.admit(body("server", 0, "s0", map=m4))
    assert book.complete and book.left == {1, 3}


def test_a_restarted_elastic_scheduler_rebuilds_a_joined_slot_as_present_and_takes_a_later_join(
        tmp_path: Path):
    """Slots 0 and 1 started, 2 joined before the death: the members' maps still name 2 absent, but
    worker 2 re-registers, so the rebuilt scheduler counts 0, 1 and 2 in barriers, its map names only
    slot 3 absent (a server restarted later starts with that), a join of slot 2 is refused and a join
    of slot 3 is admitted."""
    sched = restarted_elastic(tmp_path)
    m4 = dict(MAP, num_workers=4, absent=[2, 3])
    s0, _ = reregister(sched, "s0", "server", 0, map=m4)
    s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})
    reregister(sched, "w0", "worker", 0, passed=2, left=[3], map=m4)
    reregister(sched, "w1", "worker", 1, passed=2, left=[3], map=m4)
    assert not sched.map_sent  # no member's word says worker 2 left: it is waited for
    reregister(sched, "w2", "worker", 2, passed=2, incarnation=1, left=[3], map=m4)
    assert sched.map_sent and sched.left == {3} and sched.map_body["absent"] == [3]
    assert sched.barrier.num_workers == 3 and sched.barrier.generation == 2
    assert join(sched, "x2", 2, 2).op is Op.ERROR  # present: refused
    reply = join(sched, "w3", 3, 1)
    assert reply.op is Op.MAP and reply.body["join"] and reply.body["rank"] == 3, reply.body
    assert sched.left == set() and sched.barrier.num_workers == 4


def restarted_elastic(tmp_path: Path) -> Scheduler:
    """A second incarnation of a scheduler of 4 worker slots (2 started) and 1 server whose first had
    SESSION."""
    port_file = str(tmp_path / "scheduler.port")
    write_digest(port_file, SESSION)
    return make_scheduler(KVSTORE_INCARNATION="1", KVSTORE_PORT_FILE=port_file, KVSTORE_MAX_RESTARTS="2",
                          KVSTORE_RESTARTS_USED="1", DMLC_NUM_WORKER="4", KVSTORE_ELASTIC_WORKERS="2",
                          KVSTORE_SCHEDULER_RESTARTS="1")


def test_a_joined_worker_no_other_member_knew_of_is_counted_again_when_it_re_registers_late(
        tmp_path: Path):
    """Worker 2 joined a heartbeat before the death: the others' word still names it left, so the
    rebuild does not wait for it; its re-registration after the rebuild (its session, its own label)
    counts it again as present, and a stranger's claim on slot 3 is still refused."""
    sched = restarted_elastic(tmp_path)
    m4 = dict(MAP, num_workers=4, absent=[2, 3])
    s0, _ = reregister(sched, "s0", "server", 0, map=m4)
    s0.send(Op.HEARTBEAT, {"role": "server", "rank": 0})
    reregister(sched, "w0", "worker", 0, passed=2, left=[2, 3], map=m4)
    reregister(sched, "w1", "worker", 1, passed=2, left=[2, 3], map=m4)
    assert sched.map_sent and sched.left == {2, 3} and sched.barrier.num_workers == 2
    _, reply = reregister(sched, "w2", "worker", 2, passed=2, incarnation=1, left=[3], map=m4)
    assert reply.op is Op.MAP and reply.body["rebound"], reply.body
    assert sched.left == {3} and sched.map_body["absent"] == [3] and sched.barrier.num_workers == 3
    _, refused = reregister(sched, "x3", "worker", 3, passed=2, session=b"y" * 16, map=m4)
    assert refused.op is Op.ERROR and sched.left == {3}

"""Unit tests of scheduler.state: rank assignment, rendezvous and barrier counting (no sockets)."""

from __future__ import annotations

import pytest

from kvstore.errors import CollectiveMismatchError, ConfigError, ProtocolError
from kvstore.scheduler.state import Barrier, Liveness, Node, Rendezvous, assign_ranks, mixed_calls


def worker(i: int, wanted: int | None = None, mode: str | None = "dist_sync") -> Node:
    """A worker node with identity b'w<i>' on host h<i>."""
    return Node(identity=f"w{i}".encode(), role="worker", host=f"h{i}", wanted_rank=wanted, mode=mode)


def server(i: int, wanted: int | None = None, port: int | None = 9000) -> Node:
    """A server node with identity b's<i>' on host s<i>."""
    return Node(identity=f"s{i}".encode(), role="server", host=f"s{i}", port=port, wanted_rank=wanted)


def ids(nodes: list[Node]) -> list[bytes]:
    """The identities of ``nodes`` in order."""
    return [n.identity for n in nodes]


# -- assign_ranks -----------------------------------------------------------------------------------

def test_assign_ranks_honours_complete_unique_wanted_ranks():
    """When every node wants a distinct rank covering 0..n-1, nodes are ordered by it."""
    nodes = [worker(0, wanted=2), worker(1, wanted=0), worker(2, wanted=1)]
    assert ids(assign_ranks(nodes)) == [b"w1", b"w2", b"w0"]


@pytest.mark.parametrize("wanted", [
    [1, None, 0],      # incomplete
    [None, None, None],
    [1, 1, 0],         # duplicate
    [0, 1, 3],         # out of range
    [-1, 0, 1],        # negative
    [1, 2, 3],         # shifted
], ids=["incomplete", "none", "duplicate", "out-of-range", "negative", "shifted"])
def test_assign_ranks_falls_back_to_arrival_order(wanted):
    """Incomplete, duplicate or out-of-range wanted ranks are ignored: arrival order decides."""
    nodes = [worker(i, wanted=w) for i, w in enumerate(wanted)]
    assert ids(assign_ranks(nodes)) == [b"w0", b"w1", b"w2"]


def test_assign_ranks_of_nothing_is_empty():
    """No nodes give no ranks."""
    assert assign_ranks([]) == []


def test_assign_ranks_does_not_change_its_input():
    """assign_ranks returns a new list and leaves the arrival list as it was."""
    nodes = [worker(0, wanted=1), worker(1, wanted=0)]
    assign_ranks(nodes)
    assert ids(nodes) == [b"w0", b"w1"]


# -- Rendezvous -------------------------------------------------------------------------------------

def test_rendezvous_counts_and_completes():
    """The rendezvous completes exactly when all workers and servers have registered."""
    r = Rendezvous(num_workers=2, num_servers=1)
    assert not r.complete
    r.register(worker(0))
    r.register(server(0))
    assert not r.complete
    r.register(worker(1))
    assert r.complete


def test_rendezvous_progress_string():
    """progress() says how many of each role have registered out of how many expected."""
    r = Rendezvous(num_workers=4, num_servers=2)
    assert r.progress() == "0/4 workers and 0/2 servers registered"
    for i in range(3):
        r.register(worker(i))
    r.register(server(0))
    assert r.progress() == "3/4 workers and 1/2 servers registered"


@pytest.mark.parametrize("role", ["worker", "server"])
def test_one_too_many_of_a_role_is_a_config_error(role):
    """Registering one more node of a role than expected raises ConfigError naming DMLC_NUM_*."""
    r = Rendezvous(num_workers=1, num_servers=1)
    make = worker if role == "worker" else server
    r.register(make(0))
    with pytest.raises(ConfigError, match=f"DMLC_NUM_{role.upper()}"):
        r.register(make(1))
    assert len(r.nodes[role]) == 1


def test_duplicate_identity_is_a_protocol_error():
    """A connection that registers twice (even as another role) raises ProtocolError."""
    r = Rendezvous(num_workers=2, num_servers=1)
    r.register(worker(0))
    with pytest.raises(ProtocolError):
        r.register(worker(0))
    with pytest.raises(ProtocolError):
        r.register(Node(identity=b"w0", role="server", host="h0", port=9000))
    assert r.progress() == "1/2 workers and 0/1 servers registered"


@pytest.mark.parametrize("role", ["scheduler", "Worker", "", "client"])
def test_bad_role_is_rejected(role):
    """Only workers and servers register; another role raises ProtocolError and is not counted."""
    r = Rendezvous(num_workers=1, num_servers=1)
    with pytest.raises(ProtocolError, match="role"):
        r.register(Node(identity=b"x", role=role, host="h", port=1))
    assert r.progress() == "0/1 workers and 0/1 servers registered"


@pytest.mark.parametrize("port", [None, 0])
def test_server_without_port_is_rejected(port):
    """A server that registers without the port it listens on raises ProtocolError."""
    r = Rendezvous(num_workers=1, num_servers=1)
    with pytest.raises(ProtocolError, match="port"):
        r.register(server(0, port=port))
    assert not r.nodes["server"]


def test_workers_need_no_port():
    """A worker may register without a port."""
    r = Rendezvous(num_workers=1, num_servers=0)
    r.register(worker(0))
    assert r.complete


def test_mode_when_workers_agree():
    """mode() returns the store type every worker asked for."""
    r = Rendezvous(num_workers=3, num_servers=0)
    for i in range(3):
        r.register(worker(i, mode="dist_async"))
    assert r.mode() == "dist_async"


@pytest.mark.parametrize("modes", [["dist_sync", "dist_async"], ["dist_sync", None], [None, None]],
                         ids=["disagree", "one-missing", "all-missing"])
def test_mode_disagreement_is_a_config_error(modes):
    """Workers asking for different (or no) modes raise ConfigError listing what each asked for."""
    r = Rendezvous(num_workers=len(modes), num_servers=0)
    for i, mode in enumerate(modes):
        r.register(worker(i, mode=mode))
    with pytest.raises(ConfigError) as info:
        r.mode()
    assert "h0 asked for" in str(info.value) and "h1 asked for" in str(info.value)


def test_ranked_orders_each_role():
    """ranked() gives workers and servers in rank order, each role ranked on its own."""
    r = Rendezvous(num_workers=2, num_servers=2)
    r.register(server(0, wanted=1))
    r.register(worker(0))
    r.register(server(1, wanted=0))
    r.register(worker(1, wanted=0))  # incomplete wanted ranks among workers: arrival order
    ranked = r.ranked()
    assert ids(ranked["server"]) == [b"s1", b"s0"]
    assert ids(ranked["worker"]) == [b"w0", b"w1"]


# -- Barrier ----------------------------------------------------------------------------------------

def test_barrier_releases_everyone_at_the_last_arrival():
    """Arrivals before the N-th get []; the N-th returns every (identity, seq)."""
    b = Barrier(3)
    assert b.arrive(2, b"w2", 10) == []
    assert b.arrive(0, b"w0", 11) == []
    released = b.arrive(1, b"w1", 12)
    assert sorted(released) == [(b"w0", 11), (b"w1", 12), (b"w2", 10)]


def test_barrier_resets_for_the_next_generation():
    """After releasing, the barrier starts counting afresh (same ranks may arrive again)."""
    b = Barrier(2)
    b.arrive(0, b"w0", 1)
    b.arrive(1, b"w1", 2)
    assert b.arrive(1, b"w1", 3) == []
    assert sorted(b.arrive(0, b"w0", 4)) == [(b"w0", 4), (b"w1", 3)]


def test_barrier_keeps_the_calls_of_a_generation_that_mixed_a_view_with_other_calls():
    """A generation of one view's tag everywhere, or of plain barriers only, is not mixed; one pairing a
    view with a plain barrier or another tag keeps every rank's call, and its error names the ranks
    outside the largest agreeing group (ties: the lowest rank's group)."""
    b = Barrier(3)
    for rank in range(3):
        b.arrive(rank, b"w%d" % rank, 1, tag=[0, 0])
    assert b.released_mixed == {} and b.released_tag == [0, 0]
    for rank in range(3):
        b.arrive(rank, b"w%d" % rank, 2)
    assert b.released_mixed == {} and b.released_tag is None
    b.arrive(0, b"w0", 3, tag=[1, 4])
    b.arrive(1, b"w1", 3)
    b.arrive(2, b"w2", 3, tag=[1, 4])
    assert b.released_mixed == {0: [1, 4], 1: None, 2: [1, 4]}
    error = mixed_calls(b.generation, b.released_mixed)
    assert isinstance(error, CollectiveMismatchError) and error.ranks == [1]
    said = "workers [0, 2] asked for membership view [1, 4]; workers [1] asked for a plain barrier"
    assert said in str(error)
    assert mixed_calls(4, {0: None, 1: [2, 8]}).ranks == [1]


def test_barrier_of_one_releases_at_once():
    """With a single worker every arrival is released immediately."""
    assert Barrier(1).arrive(0, b"w0", 5) == [(b"w0", 5)]


def test_double_arrival_replaces_the_earlier_entry():
    """A rank that retries after a deadline counts once and is answered on its newest request."""
    b = Barrier(2)
    assert b.arrive(0, b"w0", 1) == []
    assert b.arrive(0, b"w0", 2) == []
    assert sorted(b.arrive(1, b"w1", 3)) == [(b"w0", 2), (b"w1", 3)]


def test_cancel_withdraws_a_waiting_rank():
    """A cancelled rank no longer counts; cancelling after a release reports it was not waiting."""
    b = Barrier(2)
    b.arrive(0, b"w0", 1)
    assert b.cancel(0) is True
    assert b.arrive(1, b"w1", 2) == []
    assert sorted(b.arrive(0, b"w0", 3)) == [(b"w0", 3), (b"w1", 2)]
    assert b.cancel(0) is False


def test_barrier_hands_every_worker_the_failures_of_its_generation():
    """A failure reported on arrival is in released_failures at release, and gone next generation."""
    b = Barrier(2)
    failure = {"code": "FormatError", "message": "bad file"}
    assert b.arrive(0, b"w0", 1, failure) == []
    assert len(b.arrive(1, b"w1", 2)) == 2
    assert b.released_failures == {0: failure}
    b.arrive(0, b"w0", 3)
    b.arrive(1, b"w1", 4)
    assert b.released_failures == {}


def test_barrier_hands_every_worker_the_digests_of_its_generation():
    """Digests carried on arrival are all in released_digests at release; a cancel drops its rank's."""
    b = Barrier(2)
    b.arrive(0, b"w0", 1, None, "d0")
    b.cancel(0)
    b.arrive(0, b"w0", 2, None, "d0'")
    assert len(b.arrive(1, b"w1", 3, None, "d1")) == 2
    assert b.released_digests == {0: "d0'", 1: "d1"}
    b.arrive(0, b"w0", 4)
    b.arrive(1, b"w1", 5)
    assert b.released_digests == {}


def test_barrier_failure_is_withdrawn_with_its_rank():
    """A retry without a failure, or a cancel, drops the rank's earlier failure."""
    b = Barrier(2)
    b.arrive(0, b"w0", 1, {"code": "X", "message": "m"})
    b.arrive(0, b"w0", 2)
    b.arrive(1, b"w1", 3, {"code": "Y", "message": "n"})
    assert b.released_failures == {1: {"code": "Y", "message": "n"}}
    b.arrive(0, b"w0", 4, {"code": "X", "message": "m"})
    assert b.cancel(0) is True
    b.arrive(0, b"w0", 5)
    b.arrive(1, b"w1", 6)
    assert b.released_failures == {}


def test_barrier_leave_releases_the_rest_and_counts_one_fewer():
    """A worker that leaves is not waited for: the others are released; later barriers need one fewer."""
    barrier = Barrier(3)
    assert barrier.arrive(0, b"a", 1) == [] and barrier.arrive(1, b"b", 2) == []
    assert sorted(barrier.leave(2)) == [(b"a", 1), (b"b", 2)]
    assert barrier.arrive(0, b"a", 3) == []
    assert sorted(barrier.arrive(1, b"b", 4)) == [(b"a", 3), (b"b", 4)]


def test_barrier_leave_of_a_waiting_worker_withdraws_it():
    """A rank that leaves while waiting is withdrawn, not released; nobody else waiting means no release."""
    barrier = Barrier(2)
    barrier.arrive(1, b"b", 1, failure={"code": "X", "message": "m"})
    assert barrier.leave(1) == [] and barrier.waiting == {} and barrier.failures == {}
    assert barrier.arrive(0, b"a", 2) == [(b"a", 2)]


def test_barrier_drain_returns_every_waiter_and_forgets_them():
    """drain gives up the generation: every waiter back, nothing left, the count unchanged."""
    barrier = Barrier(3)
    barrier.arrive(0, b"a", 1)
    barrier.arrive(2, b"c", 5)
    assert sorted(barrier.drain()) == [(b"a", 1), (b"c", 5)]
    assert barrier.waiting == {} and barrier.num_workers == 3


def test_liveness_expires_silent_nodes_once():
    """Nodes silent for more than the timeout expire (sorted), once; beats keep a node alive."""
    live = Liveness(timeout=10.0)
    for role, rank in (("worker", 1), ("server", 0), ("worker", 0)):
        live.watch(role, rank, now=0.0)
    assert live.beat("worker", 0, now=8.0)
    assert live.expired(now=10.0) == []  # exactly the timeout is not yet too long
    assert live.expired(now=10.5) == [("server", 0), ("worker", 1)]
    assert live.expired(now=30.0) == [("worker", 0)] and live.expired(now=60.0) == []


def test_liveness_ignores_unwatched_and_forgotten_nodes():
    """A beat from a node never watched, or forgotten (it left), is not recorded and never expires."""
    live = Liveness(timeout=1.0)
    assert not live.beat("worker", 7, now=0.0)
    live.watch("worker", 0, now=0.0)
    live.forget("worker", 0)
    assert not live.beat("worker", 0, now=0.5) and live.expired(now=100.0) == []


def _worker(i: int, quorum: int | None) -> Node:
    return Node(identity=bytes([i]), role="worker", host=f"h{i}", mode="dist_sync", quorum=quorum)


def test_the_quorum_is_the_workers_else_the_schedulers():
    """Workers that ask for a quorum decide it (all must agree); without any, the scheduler's."""
    rdv = Rendezvous(3, 0)
    for i, quorum in enumerate((2, None, 2)):
        rdv.register(_worker(i, quorum))
    assert rdv.quorum(default=3) == 2
    quiet = Rendezvous(2, 0)
    for i in range(2):
        quiet.register(_worker(i, None))
    assert quiet.quorum(default=1) == 1 and quiet.quorum(default=None) is None


def test_a_quorum_the_workers_disagree_on_or_out_of_range_is_a_config_error():
    rdv = Rendezvous(2, 0)
    rdv.register(_worker(0, 1))
    rdv.register(_worker(1, 2))
    with pytest.raises(ConfigError, match="disagree on the sync quorum: h0 asked for 1, h1 asked for 2"):
        rdv.quorum(default=None)
    big = Rendezvous(2, 0)
    big.register(_worker(0, 3))
    big.register(_worker(1, None))
    with pytest.raises(ConfigError, match=r"outside \[1, 2\]"):
        big.quorum(default=None)


def test_a_follower_pairs_with_any_call_and_carries_nothing() -> None:
    """A follow arrival counts toward the release but is left out of the calls compared (a view with a
    follower is no mixed generation), and its failure, digest and tag are dropped; a cancel forgets it."""
    b = Barrier(3)
    failure = {"code": "x", "message": "m"}
    assert b.arrive(2, b"w2", 1, failure=failure, digest="z", tag=[9], follow=True) == []
    assert b.arrive(0, b"w0", 1, tag=[0, 0]) == []
    assert len(b.arrive(1, b"w1", 1, tag=[0, 0])) == 3
    assert b.released_mixed == {} and b.released_tag == [0, 0]
    assert b.released_failures == {} and b.released_digests == {}
    assert b.arrive(2, b"w2", 2, follow=True) == [] and b.cancel(2) and b.followers == set()
    b.arrive(2, b"w2", 3)  # arrives again, as a call of its own: compared
    b.arrive(0, b"w0", 2, tag=[1, 4])
    assert len(b.arrive(1, b"w1", 2, tag=[1, 4])) == 3
    assert b.released_mixed == {0: [1, 4], 1: [1, 4], 2: None}

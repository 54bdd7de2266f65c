"""A worker's liveness links to its servers (kvstore/net/links.py): the judgement of a dropped link,
the TCP probe, and the links over real zmq sockets on loopback."""

from __future__ import annotations

import socket
import time

import zmq

from kvstore.net import transport
from kvstore.net.address import REACHABLE, REFUSED, UNREACHABLE, probe, zmq_host_port
from kvstore.net.curve import derive_keys
from kvstore.net.links import Link, ServerLinks
from tests.helpers import poll_for


def test_a_drop_then_no_route_is_a_partition_once_the_scheduler_replied_after_it() -> None:
    """A link that was up and dropped, its server unreachable, is partitioned only after a scheduler
    reply newer than the drop (before it, the scheduler may yet name the server lost)."""
    link = Link("tcp://10.0.0.2:5000")
    link.saw(True, 1.0)
    link.saw(False, 5.0)
    assert not link.partitioned(lambda: UNREACHABLE, heard=4.9)
    assert link.partitioned(lambda: UNREACHABLE, heard=5.1)


def test_a_refused_probe_marks_the_server_gone_until_its_link_is_up_again() -> None:
    """A closed port (the server's process is gone: the scheduler's business) is never a partition,
    not even when later probes find no route; a new handshake clears it."""
    link = Link("tcp://10.0.0.2:5000")
    link.saw(True, 1.0)
    link.saw(False, 2.0)
    assert not link.partitioned(lambda: REFUSED, heard=3.0) and link.gone
    assert not link.partitioned(lambda: UNREACHABLE, heard=4.0)
    link.saw(True, 5.0)
    assert link.up and not link.gone and link.down_at is None


def test_a_reachable_server_or_a_link_never_up_is_no_partition() -> None:
    """A dropped link whose server answers a TCP connect again is not partitioned (zmq reconnects it);
    a drop of a connection that never came up is no news; an up link is never probed."""
    link = Link("tcp://10.0.0.2:5000")
    link.saw(False, 1.0)
    assert link.down_at is None and not link.partitioned(lambda: UNREACHABLE, heard=9.0)
    link.saw(True, 2.0)

    def never() -> str:
        raise AssertionError("an up link was probed")

    assert not link.partitioned(never, heard=9.0)
    link.saw(False, 3.0)
    assert not link.partitioned(lambda: REACHABLE, heard=9.0) and not link.gone


def test_a_link_that_never_came_up_within_the_timeout_counts_as_dropped() -> None:
    """A partition from before the link was made: no handshake within the timeout counts as a drop
    then (and is judged as one); a link that came up once is judged only by its events."""
    link = Link("tcp://10.0.0.2:5000", opened=10.0)
    link.waited(11.0, timeout=2.0)
    assert link.down_at is None
    link.waited(12.0, timeout=2.0)
    assert link.down_at == 12.0 and link.partitioned(lambda: UNREACHABLE, heard=12.5)
    seen = Link("tcp://10.0.0.2:5000", opened=10.0)
    seen.saw(True, 10.1)
    seen.saw(False, 10.2)
    seen.saw(True, 10.3)
    seen.waited(20.0, timeout=2.0)
    assert seen.up and seen.down_at is None


def test_probe_tells_listening_from_refused_from_malformed() -> None:
    """The probe: a listening port is reachable, a closed one refused, a malformed address unreachable."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        assert probe(f"tcp://127.0.0.1:{port}", 1.0) == REACHABLE
    finally:
        listener.close()
    assert probe(f"tcp://127.0.0.1:{port}", 1.0) == REFUSED
    assert probe("tcp://127.0.0.1:notaport", 1.0) == UNREACHABLE
    assert zmq_host_port("tcp://[::1]:7") == ("::1", 7)


def _router(curve: bool) -> tuple[zmq.Socket, str]:
    keys = derive_keys("a secret of this test") if curve else None
    sock, port = transport.bind_router("127.0.0.1", curve=keys)
    return sock, transport.address("127.0.0.1", port)


def test_links_stay_up_to_a_server_that_never_reads_and_name_a_partition() -> None:
    """Over CURVE, a link to a ROUTER whose owner never reads comes up and stays up past the heartbeat
    timeout (libzmq answers the pings); when it drops and the probe finds no route, check() names the
    server, its address and the partition.  A closed server (refused) is not named."""
    router, address = _router(curve=True)
    probes = [REFUSED]
    links = ServerLinks([address], 0.05, 0.3, derive_keys("a secret of this test"),
                        reach=lambda where, timeout: probes[0])
    try:
        assert links.check(heard=time.monotonic()) is None  # opens the link
        watched = links._watched[0]
        poll_for(lambda: links.check(time.monotonic()) is None and watched.link.up, 10, "the link to come up")
        started = time.monotonic()
        while time.monotonic() - started < 0.9:  # three heartbeat timeouts without a read on the ROUTER
            assert links.check(time.monotonic()) is None and watched.link.up
            time.sleep(0.05)
        router.close(linger=0)
        poll_for(lambda: links.check(time.monotonic()) is None and watched.link.gone, 10,
                 "the drop to be seen and the server found gone")
        watched.link.gone = False  # as if the drop had found no route instead
        probes[0] = UNREACHABLE
        error = links.check(time.monotonic() + 1.0)
        assert error is not None and error.role == "server" and error.rank == 0, error
        assert error.host == "127.0.0.1"
        assert f"server 0 at {address} is partitioned from this worker (the scheduler still hears both)" \
            in str(error), error
    finally:
        links.close()
        router.close(linger=0)


def test_a_moved_server_is_watched_at_its_new_address() -> None:
    """After moved() (a restarted server), the next check watches the new address."""
    first, old = _router(curve=False)
    second, new = _router(curve=False)
    links = ServerLinks([old], 0.05, 0.3)
    try:
        links.check(time.monotonic())
        links.moved(0, new)
        links.check(time.monotonic())
        watched = links._watched[0]
        assert watched.link.address == new
        poll_for(lambda: links.check(time.monotonic()) is None and watched.link.up, 10, "the new link")
    finally:
        links.close()
        first.close(linger=0)
        second.close(linger=0)


def _closed_ports(n: int) -> list[str]:
    """``n`` loopback addresses nothing listens at (their links never come up)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        out.append(transport.address("127.0.0.1", s.getsockname()[1]))
        s.close()
    return out


def test_one_check_probes_at_most_one_dropped_link() -> None:
    """With 8 servers whose links dropped (they never came up), a check probes none of them before the
    scheduler has replied since the drop, and at most one after (a probe may wait 0.5 s on the heartbeat
    thread, whose beats must go on: found by review, a check took 4 s with 8 unanswered probes)."""
    calls: list[str] = []

    def answered(address: str, wait: float) -> str:
        calls.append(address)
        return REACHABLE  # the path is back: nothing named, the next check may probe another

    links = ServerLinks(_closed_ports(8), 0.5, 0.05, reach=answered)
    try:
        links.check(heard=0.0)  # makes the links
        deadline = time.monotonic() + 10
        while not calls:  # once they count as dropped (0.05 s after being made), a check after a reply probes
            assert time.monotonic() < deadline, "no dropped link was ever probed"
            assert links.check(heard=0.0) is None and not calls  # no reply since the drop: no probe
            assert links.check(heard=time.monotonic() + 1) is None
        assert len(calls) == 1
        assert links.check(heard=time.monotonic() + 1) is None and len(calls) == 2
    finally:
        links.close()

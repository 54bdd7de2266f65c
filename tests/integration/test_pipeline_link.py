"""The stage link (kvstore/pipeline/link.py) against bad input on its bound socket: a stranger's
oversized message or flood, and a neighbour that repeats or sends what is not asked for.  Two
in-process workers of a real cluster, each with a StageLink of 2 micro-batches; no torch needed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from kvstore.errors import ConfigError, DeadlineExceededError, RemoteError
from kvstore.net import transport
from kvstore.net.protocol import Op
from kvstore.pipeline.link import StageLink, neighbour_routes

NAMES = {0: "stage 0 (worker 0)", 1: "stage 1 (worker 1)"}
ACT = np.arange(4, dtype=np.float32)
ROUTES = {0: neighbour_routes(None, 1), 1: neighbour_routes(0, None)}  # stage 0 -> stage 1
Side = Callable[[Any, StageLink], Any]


def _pair(make_cluster, timeout: float, first: Side, second: Side, **settings: str) -> list[Any]:
    """Run ``first(kv, link)`` on worker 0 (stage 0) and ``second(kv, link)`` on worker 1 (stage 1);
    return what each returns.  Each link is closed after its side; ``settings`` are the cluster's env."""
    cluster = make_cluster(num_workers=2, connect=False, **settings)
    cluster.connect(request_timeout=timeout)

    def run(kv):
        link = StageLink(kv, ROUTES[kv.rank], NAMES, chunks=2)
        try:
            return (first if kv.rank == 0 else second)(kv, link)
        finally:
            link.close()

    return cluster.run(run)


def _stranger(kv) -> Any:
    """A DEALER of nobody's, connected to stage 1's socket."""
    found = kv.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": 1}, "stage 1").body["address"]
    return transport.connect_dealer(transport.address(*found))


def _send_then_wait(*messages: tuple[Op, dict, list]) -> Side:
    """Stage 0's side: send ``messages`` to stage 1, then wait at a barrier before closing."""
    def side(kv, link: StageLink) -> None:
        for op, body, arrays in messages:
            link.send(1, op, body, arrays)
        kv.barrier()
    return side


@pytest.mark.timeout(60)
def test_a_message_of_too_many_frames_is_dropped_not_raised(make_cluster) -> None:
    """A stranger's message of more than MAX_FRAMES frames is counted and dropped; the stage then
    receives its neighbour's activation."""
    def first(kv, link: StageLink) -> None:
        kv.barrier()  # the stranger's message has arrived
        _send_then_wait((Op.PIPE_ACT, {"step": 0, "mb": 0}, [ACT]))(kv, link)

    def second(kv, link: StageLink) -> tuple:
        stranger = _stranger(kv)
        try:
            transport.send(stranger, [b"x"] * (transport.MAX_FRAMES + 5))
            assert link.poller.wait(10), "the stranger's message never arrived"
            kv.barrier()
            (array,), _ = link.receive(Op.PIPE_ACT, 0, 0)
            kv.barrier()
        finally:
            transport.close(stranger)
        return array, link.drops.totals["frames"]

    array, dropped = _pair(make_cluster, 5.0, first, second)[1]
    np.testing.assert_array_equal(array, ACT)
    assert dropped == 1


@pytest.mark.timeout(60)
def test_repeats_and_out_of_range_micro_batches_do_not_pile_up(make_cluster) -> None:
    """A neighbour's repeated micro-batches and one past ``chunks`` are dropped, one never asked for is
    forgotten when the next step begins: the inbox ends empty and the right arrays are received."""
    sent = [(Op.PIPE_ACT, {"step": step, "mb": mb}, [ACT + 10 * step + mb])
            for step, mb in ((0, 0), (0, 0), (0, 5), (0, 1), (1, 0), (1, 0), (1, 1))]

    def second(kv, link: StageLink) -> tuple:
        got = [link.receive(Op.PIPE_ACT, step, mb)[0][0] for step, mb in ((0, 0), (1, 0), (1, 1))]
        kv.barrier()
        return got, dict(link.inbox), link.drops.totals["unexpected"]

    got, left, dropped = _pair(make_cluster, 5.0, _send_then_wait(*sent), second)[1]
    for array, want in zip(got, (ACT, ACT + 10, ACT + 11), strict=True):
        np.testing.assert_array_equal(array, want)
    assert left == {}
    assert dropped >= 3  # two repeats and micro-batch 5 (step 0's micro-batch 1: forgotten, or dropped late)


@pytest.mark.timeout(60)
def test_a_malformed_abort_is_dropped_and_a_good_one_raised(make_cluster) -> None:
    """A PIPE_ABORT whose step is a bool (True == 1) or whose message is not a str is dropped; a
    well-formed one for this step is the neighbour's RemoteError."""
    sent = [(Op.PIPE_ABORT, body, []) for body in ({"step": True, "message": "bool step"},
                                                   {"step": 1, "message": ["not", "a str"]},
                                                   {"step": 1, "message": "it broke"})]

    def second(kv, link: StageLink) -> tuple:
        with pytest.raises(RemoteError) as caught:
            link.receive(Op.PIPE_ACT, 1, 0)
        kv.barrier()
        return str(caught.value), link.drops.totals["unexpected"]

    text, dropped = _pair(make_cluster, 5.0, _send_then_wait(*sent), second)[1]
    assert text == "stage 0 (worker 0) failed the step: it broke"
    assert dropped == 2


@pytest.mark.timeout(60)
def test_a_stage_that_closes_right_after_sending_still_delivers(make_cluster) -> None:
    """Closing a link gives what it has not sent yet time to leave: the last stage's final gradient
    reaches its neighbour even when that stage closes at once."""
    big = np.arange(1 << 21, dtype=np.float32)  # 8 MiB: still in the DEALER's queue when it closes

    def first(kv, link: StageLink) -> np.ndarray:
        return link.receive(Op.PIPE_GRAD, 0, 0)[0][0]

    def second(kv, link: StageLink) -> None:
        link.send(0, Op.PIPE_GRAD, {"step": 0, "mb": 0}, [big])

    np.testing.assert_array_equal(_pair(make_cluster, 10.0, first, second)[0], big)  # stage 1 sends


@pytest.mark.timeout(60)
def test_a_flood_does_not_hold_a_stage_past_its_deadline(make_cluster) -> None:
    """While a stranger floods a stage's socket without pause, its wait still ends at its deadline
    with DeadlineExceededError naming the stage it waited for."""
    def second(kv, link: StageLink) -> tuple:
        stop, stranger = threading.Event(), _stranger(kv)

        def flood() -> None:
            while not stop.is_set():
                for _ in range(1000):
                    transport.send(stranger, [b"not a mac", b"not a header"])

        thread = threading.Thread(target=flood, daemon=True)
        thread.start()
        start = time.monotonic()
        try:
            with pytest.raises(DeadlineExceededError) as caught:
                link.receive(Op.PIPE_ACT, 0, 0)
        finally:
            stop.set()
            thread.join(10)
            transport.close(stranger)
        return time.monotonic() - start, str(caught.value)

    took, text = _pair(make_cluster, 1.0, lambda kv, link: None, second)[1]  # stage 0 sends nothing
    assert "from stage 0 (worker 0)" in text
    assert took < 15, took


@pytest.mark.timeout(60)
def test_an_array_over_the_frame_limit_is_refused_by_its_sender(make_cluster) -> None:
    """An activation bigger than KVSTORE_MAX_MESSAGE_BYTES (the receiving socket's frame limit, past
    which zmq drops the connection and the receiver would wait out its deadline) raises ConfigError
    at the sender, naming the limit; the link still carries the next message."""
    def first(kv, link: StageLink) -> str | None:
        try:
            link.send(1, Op.PIPE_ACT, {"step": 0, "mb": 0}, [np.zeros(300_000, np.float32)])  # 1.2 MB
            refused = None
        except ConfigError as exc:
            refused = str(exc)
        _send_then_wait((Op.PIPE_ACT, {"step": 0, "mb": 1}, [ACT]))(kv, link)
        return refused

    def second(kv, link: StageLink) -> np.ndarray:
        (array,), _ = link.receive(Op.PIPE_ACT, 0, 1)
        kv.barrier()
        return array

    refused, array = _pair(make_cluster, 5.0, first, second, KVSTORE_MAX_MESSAGE_BYTES=str(1 << 20),
                            KVSTORE_CHUNK_BYTES=str(1 << 18))
    assert refused is not None and "KVSTORE_MAX_MESSAGE_BYTES=1048576" in refused, refused
    assert "micro-batch 0" in refused and "stage 1 (worker 1)" in refused, refused
    np.testing.assert_array_equal(array, ACT)


def _hijack_before_barrier(kv, neighbour: int, hijackers: list) -> None:
    """Make ``kv``'s next barrier first connect a stranger to ``kv``'s own pipeline socket with the
    routing identity neighbour ``neighbour`` used (``pipe-<rank>``) and wait for zmq to accept it: a
    StageLink calls that barrier after it published its address and before any neighbour connects."""
    barrier = kv.barrier

    def hijack_then_barrier() -> None:
        found = kv.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": kv.rank}, "own").body["address"]
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"pipe-{neighbour}".encode())
        hijackers.append(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            sock.connect(transport.address(*found))
            # zmq's ROUTER takes the stranger's identity once its handshake is done
            assert monitor.poll(10_000), "the stranger's handshake did not complete"
        finally:
            sock.disable_monitor()
            monitor.close(0)
        kv.__dict__.pop("barrier")  # the real barrier from now on
        barrier()

    kv.barrier = hijack_then_barrier


@pytest.mark.timeout(60)
def test_a_stranger_holding_a_neighbours_routing_identity_does_not_cut_it_off(make_cluster) -> None:
    """A stranger that connects to each stage's socket first, with the routing identity its neighbour
    used to connect with (``pipe-0`` / ``pipe-1``), and sends nothing: two steps of activations and
    gradients still go through (they used to be refused, and the stage waited out its deadline)."""
    hijackers: list = []
    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=5.0)
    for kv in cluster.workers:
        _hijack_before_barrier(kv, 1 - kv.rank, hijackers)

    def run(kv) -> list[np.ndarray]:
        link = StageLink(kv, ROUTES[kv.rank], NAMES, chunks=2)
        got = []
        try:
            for step in range(2):
                for mb in range(2):
                    if kv.rank == 0:
                        link.send(1, Op.PIPE_ACT, {"step": step, "mb": mb}, [ACT + step])
                        got.append(link.receive(Op.PIPE_GRAD, step, mb)[0][0])
                    else:
                        (array,), _ = link.receive(Op.PIPE_ACT, step, mb)
                        got.append(array)
                        link.send(0, Op.PIPE_GRAD, {"step": step, "mb": mb}, [array * 2])
            kv.barrier()
            return got
        finally:
            link.close()

    try:
        first, second = cluster.run(run)
    finally:
        for sock in hijackers:
            transport.close(sock)
    assert len(hijackers) == 2
    for step in range(2):
        for mb in range(2):
            np.testing.assert_array_equal(second[2 * step + mb], ACT + step)
            np.testing.assert_array_equal(first[2 * step + mb], (ACT + step) * 2)


@pytest.mark.timeout(60)
def test_a_failure_of_the_next_step_read_early_is_raised_when_that_step_begins(make_cluster) -> None:
    """A neighbour already in step 1 fails it while this stage is still receiving step 0: the abort, read
    among step 0's messages, is kept and raised as RemoteError when this stage waits in step 1, not after
    a deadline."""
    sent = [(Op.PIPE_ABORT, {"step": 1, "message": "it broke ahead"}, []),
            (Op.PIPE_ACT, {"step": 0, "mb": 0}, [ACT])]

    def second(kv, link: StageLink) -> tuple:
        (array,), _ = link.receive(Op.PIPE_ACT, 0, 0)  # reads the abort first, then the activation
        start = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            link.receive(Op.PIPE_ACT, 1, 0)
        waited = time.monotonic() - start
        kv.barrier()
        return array, str(caught.value), waited

    array, text, waited = _pair(make_cluster, 5.0, _send_then_wait(*sent), second)[1]
    np.testing.assert_array_equal(array, ACT)
    assert text == "stage 0 (worker 0) failed the step: it broke ahead"
    assert waited < 2.5  # at once, not after the 5 s deadline

"""The stage link (kvstore/pipeline/link.py) against bad input on its bound socket: a stranger's
oversized message, and a neighbour that floods, repeats or sends what is not asked for.  Two
in-process workers of a real cluster, each with a StageLink; no torch needed."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.net import transport
from kvstore.net.protocol import Op
from kvstore.pipeline.link import StageLink

NAMES = {0: "stage 0 (worker 0)", 1: "stage 1 (worker 1)"}
ACT = np.arange(4, dtype=np.float32)


def _link(kv, chunks: int = 2) -> StageLink:
    return StageLink(kv, None if kv.rank == 0 else 0, 1 if kv.rank == 0 else None, NAMES, chunks=chunks)


@pytest.mark.timeout(60)
def test_a_message_of_too_many_frames_is_dropped_not_raised(make_cluster) -> None:
    """A stranger's message of more than MAX_FRAMES frames is counted and dropped; the stage then
    receives its neighbour's activation."""
    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=5.0)

    def run(kv):
        link = _link(kv)
        try:
            if kv.rank == 0:
                kv.barrier()
                link.send(1, Op.PIPE_ACT, {"step": 0, "mb": 0}, [ACT])
                kv.barrier()  # a closed DEALER drops what it has not sent yet (LINGER 0)
                return None
            stranger = transport.connect_dealer(transport.address(*kv.scheduler_request(
                Op.PIPE_LOOKUP, {"rank": 1}, "own address").body["address"]))
            try:
                transport.send(stranger, [b"x"] * (transport.MAX_FRAMES + 5))
                assert link.poller.wait(10), "the stranger's message never arrived"
                kv.barrier()
                array, _ = link.receive(Op.PIPE_ACT, 0, 0)
                kv.barrier()
            finally:
                transport.close(stranger)
            return array, link.drops.totals["frames"]
        finally:
            link.close()

    _, (array, dropped) = cluster.run(run)
    np.testing.assert_array_equal(array, ACT)
    assert dropped == 1


@pytest.mark.timeout(60)
def test_repeats_and_out_of_range_micro_batches_do_not_pile_up(make_cluster) -> None:
    """A neighbour's repeated micro-batches and one past ``chunks`` are dropped, one never asked for is
    forgotten when the next step begins: the inbox ends empty and the right arrays are received."""
    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=5.0)

    def run(kv):
        link = _link(kv)
        try:
            if kv.rank == 0:
                for step, mb in ((0, 0), (0, 0), (0, 5), (0, 1), (1, 0), (1, 0), (1, 1)):
                    link.send(1, Op.PIPE_ACT, {"step": step, "mb": mb}, [ACT + 10 * step + mb])
                kv.barrier()  # a closed DEALER drops what it has not sent yet (LINGER 0)
                return None
            got = [link.receive(Op.PIPE_ACT, step, mb)[0] for step, mb in ((0, 0), (1, 0), (1, 1))]
            kv.barrier()
            return got, dict(link.inbox), link.drops.totals["unexpected"]
        finally:
            link.close()

    _, (got, left, dropped) = cluster.run(run)
    for array, want in zip(got, (ACT, ACT + 10, ACT + 11), strict=True):
        np.testing.assert_array_equal(array, want)
    assert left == {}
    assert dropped >= 3  # two repeats and micro-batch 5 (step 0's micro-batch 1: forgotten, or dropped late)


@pytest.mark.timeout(60)
def test_a_malformed_abort_is_dropped_and_a_good_one_raised(make_cluster) -> None:
    """A PIPE_ABORT whose step is a bool (True == 1) or whose message is not a str is dropped; a
    well-formed one for this step is the neighbour's RemoteError."""
    from kvstore.errors import RemoteError

    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=5.0)

    def run(kv):
        link = _link(kv)
        try:
            if kv.rank == 0:
                for body in ({"step": True, "message": "bool step"}, {"step": 1, "message": ["not", "a str"]},
                             {"step": 1, "message": "it broke"}):
                    link.send(1, Op.PIPE_ABORT, body, [])
                kv.barrier()  # a closed DEALER drops what it has not sent yet (LINGER 0)
                return None
            with pytest.raises(RemoteError) as caught:
                link.receive(Op.PIPE_ACT, 1, 0)
            kv.barrier()
            return str(caught.value), link.drops.totals["unexpected"]
        finally:
            link.close()

    _, (text, dropped) = cluster.run(run)
    assert text == "stage 0 (worker 0) failed the step: it broke"
    assert dropped == 2


@pytest.mark.timeout(60)
def test_a_stage_that_closes_right_after_sending_still_delivers(make_cluster) -> None:
    """Closing a link gives what it has not sent yet time to leave: the last stage's final gradient
    reaches its neighbour even when that stage closes at once."""
    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=10.0)
    big = np.arange(1 << 21, dtype=np.float32)  # 8 MiB: still in the DEALER's queue when it closes

    def run(kv):
        link = _link(kv)
        try:
            if kv.rank == 1:
                link.send(0, Op.PIPE_GRAD, {"step": 0, "mb": 0}, [big])
                return None
            return link.receive(Op.PIPE_GRAD, 0, 0)[0]
        finally:
            link.close()

    got, _ = cluster.run(run)
    np.testing.assert_array_equal(got, big)


@pytest.mark.timeout(60)
def test_a_flood_does_not_hold_a_stage_past_its_deadline(make_cluster) -> None:
    """While a stranger floods a stage's socket without pause, its wait still ends at its deadline
    with DeadlineExceededError naming the stage it waited for."""
    import threading
    import time

    from kvstore.errors import DeadlineExceededError

    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=1.0)

    def run(kv):
        link = _link(kv)
        try:
            if kv.rank == 0:
                return None  # sends nothing
            stop = threading.Event()
            stranger = transport.connect_dealer(transport.address(*kv.scheduler_request(
                Op.PIPE_LOOKUP, {"rank": 1}, "own address").body["address"]))

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
        finally:
            link.close()

    _, (took, text) = cluster.run(run)
    assert "from stage 0 (worker 0)" in text
    assert took < 15, took

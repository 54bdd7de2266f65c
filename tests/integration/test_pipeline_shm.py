"""Pipeline stages on one host exchange big activations and gradients through shared memory
(kvstore/pipeline/link.py, StageShm): a 2-stage pipeline gives the same weights through it as over TCP,
KVSTORE_SHM=0 keeps TCP, forged ranges are dropped and counted, and read ranges are given back.
Stages are in-process workers of a real cluster, as in the other pipeline tests."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvstore.net import shm
from kvstore.net.protocol import Message, Op
from kvstore.pipeline.link import StageLink, neighbour_routes
from tests.integration.conftest import insider

NAMES = {0: "stage 0 (worker 0)", 1: "stage 1 (worker 1)"}
ROUTES = {0: neighbour_routes(None, 1), 1: neighbour_routes(0, None)}  # stage 0 -> stage 1
FAST = {"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_HEARTBEAT_TIMEOUT": "3",
        "KVSTORE_REQUEST_TIMEOUT": "20"}
WIDTH = 4096  # a micro-batch of 6 rows crosses the boundary as 6 x 4096 float64: 192 KiB >= shm.MIN_BYTES


def _model() -> object:
    """A seeded 2-layer MLP, made in the test's thread (torch's global generator is not per thread)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 3)).double()


def _train(kv, seeded: object, steps: int) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """Train a copy of ``seeded`` as stage kv.rank of 2 (2 micro-batches of 6 rows) for ``steps`` steps;
    return this stage's weights and its link's shared-memory stats and setting."""
    import torch

    from kvstore.pipeline import Pipeline

    model = copy.deepcopy(seeded)
    pipe = Pipeline(model, stages=2, kv=kv, chunks=2, balance=[2, 1], schedule="1f1b")
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(12, 8, generator=gen, dtype=torch.float64),
                torch.randn(12, 3, generator=gen, dtype=torch.float64)) for _ in range(steps)]
    try:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            opt.zero_grad()
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
            opt.step()
    finally:
        pipe.close()
    mine = pipe.stage_parameters()
    weights = {k: v.detach().numpy().copy() for k, v in model.named_parameters() if id(v) in mine}
    return weights, {"stats": copy.copy(pipe.link.shm.stats), "off": pipe.link.shm.off}


@pytest.mark.timeout(90)
def test_a_pipeline_through_shared_memory_matches_its_tcp_run(make_cluster) -> None:
    """Two stages on one host send their 192 KiB activations and gradients through shared memory
    (counted on both links) and end with the weights of the same run with KVSTORE_SHM=0 (float64, 1e-12),
    whose links send nothing through it.  Not bit for bit: the arrays arrive bit for bit (the other tests
    here), but torch's float64 matmul rounds differently for an input 8 bytes off a 16-byte boundary,
    as zmq's frames are, than for the 64-byte-aligned copy out of the segment."""
    seeded, steps = _model(), 3  # the first step offers the segments (over TCP); the others use them
    through = make_cluster(num_workers=2, **FAST).run(lambda kv: _train(kv, seeded, steps))
    tcp = make_cluster(num_workers=2, KVSTORE_SHM="0", **FAST).run(lambda kv: _train(kv, seeded, steps))
    for (shm_weights, used), (tcp_weights, unused) in zip(through, tcp, strict=True):
        assert sorted(shm_weights) == sorted(tcp_weights) and shm_weights
        for name, value in tcp_weights.items():
            np.testing.assert_allclose(shm_weights[name], value, rtol=1e-12, atol=1e-13, err_msg=name)
        assert used["off"] is None and unused["off"] == "KVSTORE_SHM=0"
        assert used["stats"].sent >= 2 and used["stats"].received >= 2, used  # both ways, in later steps
        assert used["stats"].full == 0
        assert (unused["stats"].sent, unused["stats"].received) == (0, 0), unused


@pytest.mark.timeout(60)
def test_many_steps_give_ranges_back_and_never_fill_the_segment(make_cluster) -> None:
    """30 steps of two 256 KiB activations through a 1 MiB segment (room for 3 at once): every range
    comes back once read, so none falls back to TCP and the segment ends wholly free; what arrives is
    what was sent."""
    steps, act = 30, np.arange(1 << 16, dtype=np.float32)  # 256 KiB
    cluster = make_cluster(num_workers=2, connect=False, KVSTORE_SHM_BYTES=str(1 << 20))
    cluster.connect(request_timeout=10.0)

    def run(kv):
        link = StageLink(kv, ROUTES[kv.rank], NAMES, chunks=2)
        wrong = 0
        try:
            for step in range(steps):
                for mb in range(2):
                    if kv.rank == 0:
                        link.send(1, Op.PIPE_ACT, {"step": step, "mb": mb}, [act + step + mb])
                    else:
                        (array,), _ = link.receive(Op.PIPE_ACT, step, mb)
                        wrong += not np.array_equal(array, act + step + mb)
                        link.send(0, Op.PIPE_GRAD, {"step": step, "mb": mb}, [np.ones(4, np.float32)])
                if kv.rank == 0:
                    for mb in range(2):
                        link.receive(Op.PIPE_GRAD, step, mb)
            kv.barrier()
            lane = link.shm.offered.get(1)
            free = (lane.segment.free_bytes(), lane.segment.size, len(lane.lent)) if lane else None
            return copy.copy(link.shm.stats), wrong, free
        finally:
            link.close()

    (sent, _, free), (received, wrong, _) = cluster.run(run)
    assert wrong == 0
    assert sent.full == 0, sent
    assert sent.sent >= 2 * (steps - 1) and received.received == sent.sent, (sent, received)
    assert free is not None and free[0] == free[1] - shm.HEAD and free[2] == 0, free


@pytest.mark.timeout(60)
def test_forged_ranges_are_dropped_and_counted_and_the_stage_goes_on(make_cluster) -> None:
    """Sealed activations naming a range outside stage 0's segment, in its nonce page, or before any
    segment is mapped, and PIPE_SHM answers and frees nobody asked for, are dropped and counted; the
    stage then receives its neighbour's activation through shared memory."""
    big = np.arange(1 << 15, dtype=np.float32)  # 128 KiB
    cluster = make_cluster(num_workers=2, connect=False)
    cluster.connect(request_timeout=10.0)

    def forge(kv, step: int, messages: list[Message]) -> None:
        """Send ``messages`` to stage 1, sealed with the cluster's secret, claiming to be stage 0."""
        from kvstore.net import transport

        sealer = insider(kv, f"forger-{step}")
        found = kv.stage_access("test").request(Op.PIPE_LOOKUP, {"rank": 1}, "stage 1").body["address"]
        sock = transport.connect_dealer(transport.address(*found))
        try:
            for msg in messages:
                msg.sender = 0
                transport.send(sock, sealer.seal(msg, "pipe-1"))
        finally:
            transport.close(sock, linger=5.0)

    def act(mb: int, off: int | None) -> Message:
        return Message(Op.PIPE_ACT, {"step": 0, "mb": mb}, [big], shm=None if off is None else [off])

    def run(kv):
        link = StageLink(kv, ROUTES[kv.rank], NAMES, chunks=5)
        try:
            if kv.rank == 1:  # each forgery ends with an inline activation: once in, all before it were read
                forge(kv, 0, [act(2, shm.HEAD), act(3, None)])  # before stage 0's segment is mapped here
                link.receive(Op.PIPE_ACT, 0, 3)
                unmapped = link.drops.totals["unreadable"]
                kv.barrier()
                np.testing.assert_array_equal(link.receive(Op.PIPE_ACT, 0, 0)[0][0], big)  # TCP; maps it
                link.send(0, Op.PIPE_GRAD, {"step": 0, "mb": 0}, [np.ones(4, np.float32)])
                size = link.shm.mapped[0].size
                forge(kv, 1, [act(2, size), act(2, 0), act(2, size - shm.ALIGN),
                              Message(Op.PIPE_SHM, {"attached": True, "why": ""}),
                              Message(Op.PIPE_SHM, {"free": [shm.HEAD]}), act(4, None)])
                link.receive(Op.PIPE_ACT, 0, 4)
                kv.barrier()  # stage 0 sends micro-batch 1 now
                array = link.receive(Op.PIPE_ACT, 0, 1)[0][0]
                kv.barrier()
                return array, unmapped, dict(link.drops.totals), link.shm.stats.received
            kv.barrier()  # the first forgery is in
            link.send(1, Op.PIPE_ACT, {"step": 0, "mb": 0}, [big])  # offers the segment; goes over TCP
            link.receive(Op.PIPE_GRAD, 0, 0)  # reads stage 1's answer: attached
            kv.barrier()
            link.send(1, Op.PIPE_ACT, {"step": 0, "mb": 1}, [big + 1])
            kv.barrier()
            return link.shm.stats.sent
        finally:
            link.close()

    sent, (array, unmapped, drops, received) = cluster.run(run)
    np.testing.assert_array_equal(array, big + 1)
    assert sent == 1 and received == 1
    assert unmapped == 1 and drops.get("unreadable") == 4, drops  # the forged arrays
    assert drops.get("unexpected") == 2, drops  # the unasked-for answer and free

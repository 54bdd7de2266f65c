"""One pipeline stage sending another an activation of 1, 16 and 64 MB: same-host shared memory against
TCP (``KVSTORE_SHM=0``), alternated in one run (issue 47 item 1).

Each round launches two stages (``launch.py -n 2 -s 1``: two worker processes, each a StageLink) with
shared memory, then the same with ``KVSTORE_SHM=0``, back to back, so both see the same load.  Stage 0
sends stage 1 one float32 activation of each size; stage 1 answers each with a 16-byte gradient, so a
send's time is stage 0's wait for that answer (the transfer, the receiver's copy and the tiny reply).
Per size: 2 warm-up sends (the first of a run offers the segment, over TCP), then the best of
``--blocks`` blocks of ``--sends`` sends (at least 64 MB a block: 64 sends of 1 MB); MB/s = size x sends
/ seconds.

    python benchmarks/stage_shm.py [--rounds 5] [--blocks 3] [--sends 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZES_MB = (1, 16, 64)


def stage(blocks: int, sends: int) -> None:
    """A stage's side (worker 0 sends, worker 1 answers); worker 0 prints its rates and what went
    through shared memory."""
    import numpy as np

    import kvstore
    from kvstore.net.protocol import Op
    from kvstore.pipeline.link import StageLink, neighbour_routes

    kv = kvstore.create("dist_sync")
    names = {0: "stage 0 (worker 0)", 1: "stage 1 (worker 1)"}
    link = StageLink(kv, neighbour_routes(None, 1) if kv.rank == 0 else neighbour_routes(0, None), names,
                     chunks=1)
    step, rates = 0, []
    try:
        for mb in SIZES_MB:
            per_block = max(sends, 64 // mb)
            act, ack = np.ones((mb << 20) // 4, np.float32), np.ones(4, np.float32)
            best = float("inf")
            for block in range(blocks + 1):  # block 0: the 2 warm-up sends
                count = 2 if block == 0 else per_block
                started = time.perf_counter()
                for _ in range(count):
                    if kv.rank == 0:
                        link.send(1, Op.PIPE_ACT, {"step": step, "mb": 0}, [act])
                        link.receive(Op.PIPE_GRAD, step, 0)
                    else:
                        (got,), _ = link.receive(Op.PIPE_ACT, step, 0)
                        assert got.nbytes == act.nbytes and got[0] == 1.0
                        link.send(0, Op.PIPE_GRAD, {"step": step, "mb": 0}, [ack])
                    step += 1
                if block:
                    best = min(best, time.perf_counter() - started)
            rates.append(mb * per_block / best)
        kv.barrier()
        if kv.rank == 0:
            stats = link.shm.stats
            print(f"RESULT {' '.join(f'{r:.1f}' for r in rates)} {stats.sent} {stats.full}", flush=True)
    finally:
        link.close()
        kv.close()


def launch(shm: bool, blocks: int, sends: int) -> tuple[list[float], int, int]:
    """One launch of two stages; stage 0's MB/s per size, arrays sent through shared memory, and arrays
    that found the segment full."""
    env = {**os.environ, "KVSTORE_SHM": "1" if shm else "0", "KVSTORE_MAX_MESSAGE_BYTES": str(128 << 20)}
    env.pop("KVSTORE_SECRET", None)  # the launcher makes one: authentication as shipped
    done = subprocess.run([sys.executable, "launch.py", "-n", "2", "-s", "1", __file__, "--stage",
                           "--blocks", str(blocks), "--sends", str(sends)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            *rates, sent, full = line.split("RESULT ", 1)[1].split()
            return [float(r) for r in rates], int(sent), int(full)
    raise SystemExit(f"the launch failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")


def main() -> None:
    """Alternate launches with and without shared memory; print each round's rates and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--sends", type=int, default=8)
    parser.add_argument("--stage", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        return stage(args.blocks, args.sends)
    ratios: list[list[float]] = [[] for _ in SIZES_MB]
    for i in range(args.rounds):
        (shm_rates, sent, full), (tcp_rates, tcp_sent, _) = (launch(True, args.blocks, args.sends),
                                                            launch(False, args.blocks, args.sends))
        assert tcp_sent == 0, tcp_sent
        for j, (a, b) in enumerate(zip(shm_rates, tcp_rates)):
            ratios[j].append(a / b)
        print(f"round {i + 1}, MB/s shared memory / KVSTORE_SHM=0 (ratio): " + ", ".join(
            f"{mb} MB {a:.0f}/{b:.0f} ({a / b:.2f}x)" for mb, a, b in zip(SIZES_MB, shm_rates, tcp_rates))
            + f"; {sent} arrays through shared memory, {full} over TCP for a full segment", flush=True)
    print("median ratio: " + ", ".join(f"{mb} MB {statistics.median(r):.2f}x"
                                       for mb, r in zip(SIZES_MB, ratios)))


if __name__ == "__main__":
    main()

"""A server's CPU per small request without sockets (issue 39): a real ``Server`` behind its
``RouterService`` over the in-memory ROUTER (``kvstore.net.inproc``), handed pre-sealed one-key
PUSHPULL requests of one worker; each is opened, dispatched (the group fast path, the shard's round)
and answered (sealed), exactly as in a cluster, minus zmq and the loop's poll.

    python benchmarks/handle_cpu.py [--requests 20000] [--size 1] [--blocks 5]

Prints the thread CPU per request of each block, the compiled and the pure-Python path alternated in
child processes (``KVSTORE_PURE_PYTHON``), and the medians.  What a cluster adds (zmq, the poll, a
cold cache after every context switch) is what ``msg_cpu.py`` measures.
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
SESSION = b"handle-cpu-session-0123456789abc"


def child(requests: int, size: int) -> float:
    """Microseconds of this thread's CPU per request handled (this process's path)."""
    import numpy as np

    from kvstore import config
    from kvstore.net.auth import channel_for
    from kvstore.net.inproc import InProcRouter
    from kvstore.net.protocol import Message, Op
    from kvstore.net.router import RouterService
    from kvstore.server.server import Server

    cfg = config.load({"DMLC_ROLE": "server", "KVSTORE_SECRET": "handle-cpu"})
    router = InProcRouter()
    service = RouterService(None, channel_for(cfg, "server"), endpoint=router)
    Server(cfg, service, {"rank": 0, "session": SESSION, "mode": "dist_sync", "num_workers": 1})
    worker = channel_for(cfg, "worker0-bench")
    worker.set_session(SESSION)
    identity = b"dealer-0"

    def sealed(op: Op, body: dict, arrays: list, seq: int) -> list:
        return [identity, *[bytes(f) for f in worker.seal(Message(op, body, arrays, seq=seq, sender=0),
                                                          "server0")]]

    service.handle(sealed(Op.INIT, {"keys": ["k"], "sizes": [size]}, [np.zeros(size, np.float32)], 1))
    value = np.ones(size, np.float32)
    batch = [sealed(Op.PUSHPULL, {"keys": ["k"], "sizes": [size], "rounds": [i]}, [value], i + 2)
             for i in range(requests)]
    router.sent.clear()
    began = time.thread_time()
    for frames in batch:
        service.handle(frames)
    spent = time.thread_time() - began
    if len(router.sent) != requests:
        raise SystemExit(f"{len(router.sent)} replies to {requests} requests")
    return spent / requests * 1e6


def main() -> None:
    """Alternate compiled and pure children, print each block and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--size", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(f"{child(args.requests, args.size):.2f}")
        return
    seen: dict[str, list[float]] = {"compiled": [], "pure": []}
    for block in range(args.blocks):
        for side in (("compiled", "pure") if block % 2 == 0 else ("pure", "compiled")):
            pure = "1" if side == "pure" else "0"
            env = {**os.environ, "PYTHONPATH": str(REPO), "KVSTORE_PURE_PYTHON": pure}
            out = subprocess.run([sys.executable, __file__, "--child", "--requests", str(args.requests),
                                  "--size", str(args.size)], env=env, capture_output=True, text=True,
                                 check=True, timeout=600)
            seen[side].append(float(out.stdout.split()[-1]))
            print(f"block {block + 1} {side:8} {seen[side][-1]:6.2f} us CPU per request", flush=True)
    compiled, pure = statistics.median(seen["compiled"]), statistics.median(seen["pure"])
    print(f"median: compiled {compiled:.2f} us, pure {pure:.2f} us per {args.size}-float PUSHPULL handled "
          f"({compiled / pure:.2f}x); load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""Same-host shared memory against TCP, alternated: 1w1s launches of a 64 MB push+pull loop.

Each round launches one cluster with shared memory (``KVSTORE_SHM=1``) and one with ``KVSTORE_SHM=0``, back
to back, so both see the same load; the raw pyzmq baseline and a 64 MB memcpy (``suite.py``'s) are
measured in the same run.  Per launch: 16 keys of 4 MB, pushed then pulled into outs, the best of five
blocks of four steps; GB/s = 2 x 64 MB x steps / seconds, as the suite's model test.  With
``--sweep``, each launch instead pushes then pulls one key of each size in SWEEP_KB (about 64 MB
each way per block, the best of three blocks), so that no value size is slower through shared memory.

    python benchmarks/shm_ab.py --rounds 3
    python benchmarks/shm_ab.py --rounds 2 --sweep
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite  # noqa: E402  (benchmarks/ is not a package)

KEYS, KEY_BYTES = 16, 4 << 20
SWEEP_KB = (64, 256, 1024, 4096, 16384, 65536, 262144)


def worker() -> None:
    """A worker's loop: print its best rate and whether shared memory carried the values."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    n = KEY_BYTES // 4
    keys = [f"layer{i}" for i in range(KEYS)]
    grads = [np.full(n, 1.0, np.float32) for _ in keys]
    outs = [np.empty(n, np.float32) for _ in keys]
    kv.init(keys, [np.zeros(n, np.float32)] * KEYS)
    for _ in range(2):
        kv.push(keys, grads)
        kv.pull(keys, out=outs)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(4):
            kv.push(keys, grads)
            kv.pull(keys, out=outs)
        best = min(best, time.perf_counter() - started)
    assert outs[0][0] == 1.0
    lanes = kv._io.lanes
    sent = 0 if lanes is None else lanes.sent
    print(f"RESULT {2 * KEYS * KEY_BYTES * 4 / best / 1e9:.3f} {sent}", flush=True)
    kv.close()


def sweep_worker() -> None:
    """A worker's sweep: for each size of SWEEP_KB, one key pushed then pulled; print each GB/s."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    rates = []
    for kb in SWEEP_KB:
        n, key = kb * 256, f"sweep{kb}"
        grad, out = np.full(n, 1.0, np.float32), np.empty(n, np.float32)
        kv.init(key, np.zeros(n, np.float32))
        steps = max(2, (64 << 10) // kb)

        def step(key: str = key, grad: Any = grad, out: Any = out, steps: int = steps) -> None:
            for _ in range(steps):
                kv.push(key, grad)
                kv.pull(key, out=out)
        rates.append(2 * kb * 1024 * steps / suite.timed(kv, step, 1) / 1e9)
    lanes = kv._io.lanes
    print(f"RESULT {' '.join(f'{r:.3f}' for r in rates)} {0 if lanes is None else lanes.sent}", flush=True)
    kv.close()


def launch(shm: bool, sweep: bool = False) -> tuple[list[float], int]:
    """One 1w1s launch of :func:`worker` (or :func:`sweep_worker`); its GB/s figures and the bytes it
    sent through shared memory."""
    env = {**os.environ, "KVSTORE_SHM": "1" if shm else "0"}
    env.pop("KVSTORE_SECRET", None)  # the launcher makes one: authentication as shipped
    role = "--sweep-worker" if sweep else "--worker"
    done = subprocess.run([sys.executable, "launch.py", "-n", "1", "-s", "1", __file__, role],
                          cwd=suite.REPO, env=env, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            *rates, sent = line.split("RESULT ", 1)[1].split()
            return [float(r) for r in rates], int(sent)
    raise SystemExit(f"the launch failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")


def main() -> None:
    """Alternate launches with and without shared memory; print each pair and the baselines."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="one key of each size, not the 64 MB model")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sweep-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    if args.sweep_worker:
        return sweep_worker()
    link = suite.RawLink()
    try:
        raw = link.rate(suite.MODEL_BYTES, 1.5)["gbps"]
    finally:
        link.close()
    memcpy = suite.memcpy_gbps()
    print(f"baseline: raw pyzmq 64 MB {raw:.2f} GB/s, 64 MB memcpy {memcpy:.2f} GB/s")
    for i in range(args.rounds):
        if args.sweep:
            (shm_rates, _), (tcp_rates, _) = launch(True, True), launch(False, True)
            print(f"round {i + 1}, GB/s shared memory / KVSTORE_SHM=0 (ratio): " + ", ".join(
                f"{kb >> 10 or kb}{'M' if kb >= 1024 else 'K'} {a:.2f}/{b:.2f} ({a / b:.2f})"
                for kb, a, b in zip(SWEEP_KB, shm_rates, tcp_rates)))
            continue
        ([shm], sent), ([tcp], _) = launch(True), launch(False)
        print(f"round {i + 1}: shared memory {shm:.3f} GB/s ({shm / raw:.2f}x raw, "
              f"{shm / memcpy:.2f}x memcpy, {sent >> 20} MiB through it), "
              f"KVSTORE_SHM=0 {tcp:.3f} GB/s ({tcp / raw:.2f}x raw)")


if __name__ == "__main__":
    main()

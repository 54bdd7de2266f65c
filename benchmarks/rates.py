"""What the 1-worker 1-server rate benchmarks share (``auth_cost.py``, ``encryption_cost.py``): the
worker that times push+pull round trips of one big key, and the launch of one such cluster.

Not a benchmark itself: run the scripts that import it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(mb: int, iters: int) -> None:
    """Inside the cluster: time push+pull round trips of an ``mb``-megabyte float32 key; print
    ``RATE <MB/s>`` (bytes each way counted)."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    n = mb * 1024 * 1024 // 4
    value, out = np.ones(n, np.float32), np.empty(n, np.float32)
    kv.init("w", value)
    for _ in range(2):  # warm-up
        kv.pushpull("w", value, out=out)
    started = time.perf_counter()
    for _ in range(iters):
        kv.pushpull("w", value, out=out)
    seconds = time.perf_counter() - started
    print(f"RATE {2 * mb * iters / seconds:.1f}", flush=True)
    kv.close()


def launch_rate(script: str, label: str, settings: Mapping[str, str], mb: int, iters: int,
                drop: tuple[str, ...] = ()) -> float:
    """Launch ``script --worker`` on a 1w1s cluster with ``settings`` added to the environment (and
    ``drop`` removed); return the MB/s it prints.  Exits naming ``label`` when the run fails."""
    env = {**os.environ, "KVSTORE_SECRET": "benchmark-secret", "KVSTORE_BIGARRAY_BOUND": str(1 << 40),
           **settings}
    for name in drop:
        env.pop(name, None)
    done = subprocess.run([sys.executable, "launch.py", "-n", "1", "-s", "1", script, "--worker",
                           "--mb", str(mb), "--iters", str(iters)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    match = re.search(r"RATE ([\d.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"the {label} run failed:\n{done.stdout}\n{done.stderr}")
    return float(match.group(1))

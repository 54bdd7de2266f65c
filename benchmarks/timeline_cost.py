"""What ``KVSTORE_TIMELINE`` costs a job of small operations, against the same job without it.

    python benchmarks/timeline_cost.py [--warm 110000] [--ops 30000] [--keys 1] [--repeat 2]

Starts a real 1-worker 1-server cluster through ``launch.py`` once per mode and repeat, alternating
(everything else equal).  The worker makes ``--warm`` push+pull calls of ``--keys`` one-float keys
first, enough that every role's ring holds its 100,000 events and each write has a full ring behind
it (a long job), then times ``--ops`` more and prints the calls per second and the CPU seconds the
job's processes (the launcher's children: scheduler, server, worker, every thread) spent on them.
The table gives each run's rate and CPU per call, and the ratios of the medians: the job's time, and
its CPU, with the timeline over without.  On a loaded machine the CPU ratio is the steadier figure
(the wall clock moves with whatever else runs).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(warm: int, ops: int, keys: int) -> None:
    """Inside the cluster: ``warm`` then ``ops`` timed push+pull calls of ``keys`` small keys; prints
    ``RATE <calls/s>``."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    names = [f"k{i}" for i in range(keys)]
    values = [np.ones(1, np.float32) for _ in names]
    outs = [np.empty(1, np.float32) for _ in names]
    kv.init(names, values)
    for _ in range(warm):
        kv.pushpull(names, values, out=outs)
    cpu, started = job_cpu(), time.perf_counter()
    for _ in range(ops):
        kv.pushpull(names, values, out=outs)
    seconds = time.perf_counter() - started
    print(f"RATE {ops / seconds:.1f} CPU {job_cpu() - cpu:.3f}", flush=True)
    kv.close()


def job_cpu() -> float:
    """CPU seconds (user + system) of this process's parent's children: the job's roles (Linux)."""
    parent = os.getppid()
    with open(f"/proc/{parent}/task/{parent}/children", encoding="ascii") as listing:
        pids = listing.read().split()
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def run(timeline: str | None, warm: int, ops: int, keys: int) -> tuple[float, float]:
    """Launch the cluster (with ``KVSTORE_TIMELINE=timeline`` when given); return its calls/s and
    the job's CPU microseconds per call."""
    env = {**os.environ, "KVSTORE_SECRET": "benchmark-secret"}
    env.pop("KVSTORE_TIMELINE", None)
    if timeline is not None:
        env["KVSTORE_TIMELINE"] = timeline
    done = subprocess.run([sys.executable, "launch.py", "-n", "1", "-s", "1", __file__, "--worker",
                           "--warm", str(warm), "--ops", str(ops), "--keys", str(keys)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=3600)
    match = re.search(r"RATE ([\d.]+) CPU ([\d.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"the run {'with' if timeline else 'without'} the timeline failed:\n"
                         f"{done.stdout}\n{done.stderr}")
    return float(match.group(1)), float(match.group(2)) * 1e6 / ops


def main(argv: list[str] | None = None) -> int:
    """Run both modes (alternating, ``--repeat`` times) and print the table; ``--worker``: be the worker."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=int, default=110_000, help="untimed calls first (fill the rings)")
    parser.add_argument("--ops", type=int, default=30_000, help="timed push+pull calls")
    parser.add_argument("--keys", type=int, default=1, help="one-float keys per call")
    parser.add_argument("--repeat", type=int, default=2, help="clusters per mode")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.warm, args.ops, args.keys)
        return 0
    print(f"1 worker 1 server: {args.warm} calls, then {args.ops} timed, of {args.keys} one-float "
          f"key(s) each", flush=True)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as folder:
        trace = os.path.join(folder, "trace.json")
        for _ in range(args.repeat):
            for mode in rates:
                rate, cpu = run(trace if mode == "on" else None, args.warm, args.ops, args.keys)
                rates[mode].append(rate)
                cpus[mode].append(cpu)
                print(f"KVSTORE_TIMELINE {mode:>3}: {rate:9.1f} calls/s, job CPU {cpu:7.1f} us a call",
                      flush=True)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    cpu_off, cpu_on = statistics.median(cpus["off"]), statistics.median(cpus["on"])
    print(f"median: off {off:.1f} calls/s, on {on:.1f} calls/s; the job takes {off / on:.3f}x as long "
          f"with the timeline ({100 * (off / on - 1):+.1f}%)")
    print(f"median job CPU a call: off {cpu_off:.1f} us, on {cpu_on:.1f} us; {cpu_on / cpu_off:.3f}x "
          f"({100 * (cpu_on / cpu_off - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

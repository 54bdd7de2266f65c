"""CPU per message on both sides (issue 39, targets 1 and 2): a small key's push then pull, and its
``pushpull``, through a real ``dist_sync`` cluster started by ``launch.py``, with each thread's CPU.

    python benchmarks/msg_cpu.py [--configs 1w1s,4w2s] [--rounds 2000] [--json out.json]

For each key (1 float32 element, then 1,024) every worker runs ``--rounds`` rounds of ``push`` then
``pull`` of the key, then as many ``pushpull`` rounds.  Around each block (between two barriers) every
worker reads the CPU time of each of its threads, and worker 0 that of each thread of every server
(its siblings under the launcher, found in ``/proc``): ``/proc/<pid>/task/<tid>/schedstat``'s time
on a CPU, in nanoseconds.  Printed per block: the wall p50 of one round, and microseconds of CPU per
round, per worker (summed over the workers' threads: the caller's, the heartbeat, libzmq's I/O
thread ...) and per worker-round on the servers (all servers' threads, divided by rounds x workers).
At 1w1s, in a cluster of its own (its servers logging each request's arrival,
``KVSTORE_TEST_ARRIVALS``), a lone push: how long after ``push`` was called a push that no call
follows reaches its server (:func:`lone_push`).  Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SIZES = (1, 1024)


def _ns(pid: int, tid: int) -> int:
    """Nanoseconds thread ``tid`` of ``pid`` has run on a CPU (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def threads(pid: int, names: dict[int, str] | None = None) -> dict[str, int]:
    """CPU nanoseconds of each thread of ``pid``, by a readable name: ``names`` (Python threads of this
    process, by native id), else ``main`` for the process's first thread, else the thread's comm
    (libzmq names its own ``ZMQbg/...``; other Python threads are ``python-N``)."""
    out: dict[str, int] = {}
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return out
    for n, tid in enumerate(tids):
        if names and tid in names:
            name = names[tid]
        elif tid == pid:
            name = "main"
        else:
            comm = _comm(pid, tid)
            name = comm if comm.startswith("ZMQ") else f"thread-{n}"
        out[name] = out.get(name, 0) + _ns(pid, tid)
    return out


def servers() -> list[int]:
    """The pids of the servers started beside this worker (its launcher's other children)."""
    parent = os.getppid()
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return []
    found = []
    for pid in map(int, children):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"DMLC_ROLE=server" in env:
            found.append(pid)
    return found


def snapshot(server_pids: list[int]) -> dict[str, dict[str, int]]:
    """This process's threads and every server's."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names[threading.main_thread().native_id] = "caller"
    out = {"worker": threads(os.getpid(), names)}
    for i, pid in enumerate(server_pids):
        out[f"server{i}"] = threads(pid)
    return out


def delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], per: float) -> dict:
    """Microseconds of CPU per ``per`` rounds of each thread that ran (and each process's total)."""
    out: dict[str, dict[str, float]] = {}
    for proc, now in after.items():
        was = before.get(proc, {})
        rows = {name: (ns - was.get(name, 0)) / per / 1e3 for name, ns in now.items()}
        rows = {name: round(us, 1) for name, us in rows.items() if us >= 0.05}
        rows["total"] = round(sum(rows.values()), 1)
        out[proc] = rows
    return out


def block(kv: Any, key: str, size: int, rounds: int, pushpull: bool, pids: list[int]) -> dict:
    """``rounds`` rounds of push then pull (or pushpull) of ``key``: wall p50 and CPU per round."""
    import numpy as np

    value, out = np.ones(size, np.float32), np.empty(size, np.float32)
    for _ in range(50):  # warm-up
        kv.push(key, value)
        kv.pull(key, out=out)
    kv.barrier()
    times = []
    before = snapshot(pids)
    for _ in range(rounds):
        started = time.perf_counter()
        if pushpull:
            kv.pushpull(key, value, out=out)
        else:
            kv.push(key, value)
            kv.pull(key, out=out)
        times.append(time.perf_counter() - started)
    after = snapshot(pids)
    kv.barrier()
    assert out[0] == kv.num_workers, out[0]
    cpu = delta({"worker": before["worker"]}, {"worker": after["worker"]}, rounds)
    if pids:  # worker 0: the servers served every worker's rounds
        cpu.update(delta({k: v for k, v in before.items() if k != "worker"},
                         {k: v for k, v in after.items() if k != "worker"}, rounds * kv.num_workers))
    return {"p50_us": round(statistics.median(times) * 1e6, 1), "cpu_us": cpu}


def _arrival(log: Path, key: str, since: float, deadline: float) -> float | None:
    """The server's stamp of the first PUSH or PUSHPULL of ``key`` it logged at or after ``since``
    (``KVSTORE_TEST_ARRIVALS``), polled until ``deadline``; None if none came."""
    while time.monotonic() < deadline:
        lines = log.read_text().split("\n")[:-1]  # whole lines only: the server may be writing one
        for line in reversed(lines):
            item = json.loads(line)
            if item["t"] < since:
                break
            if item["op"] in ("PUSH", "PUSHPULL") and item["keys"] == [key]:
                return item["t"]
        time.sleep(0.0001)
    return None


def lone_push(kv: Any, key: str, size: int, rounds: int, log: Path) -> dict:
    """How late a push with no call after it reaches its server: per round, the server's arrival stamp
    minus the wall clock just before ``push`` (p50 and p90, microseconds), while the caller sleeps
    1 ms (``idle``: it blocks, the GIL is free) and while it runs Python for 20 ms (``busy``: it holds
    the GIL); then it reads the log until the push is in, and a pull ends the round."""
    import numpy as np

    value, out = np.ones(size, np.float32), np.empty(size, np.float32)
    lags: dict[str, list[float]] = {"idle": [], "busy": []}
    kv.barrier()
    for i in range(2 * rounds):
        how = "busy" if i % 2 else "idle"
        began = time.time()
        kv.push(key, value)
        if how == "busy":
            until = time.perf_counter() + 0.02
            while time.perf_counter() < until:
                pass
        else:
            time.sleep(0.001)
        stamp = _arrival(log, key, began, time.monotonic() + 10)
        kv.pull(key, out=out)
        if stamp is not None:
            lags[how].append(stamp - began)
    kv.barrier()
    out_: dict[str, Any] = {}
    for how, seen in lags.items():
        seen.sort()
        out_[f"{how}_p50_us"] = round(seen[len(seen) // 2] * 1e6, 1) if seen else None
        out_[f"{how}_p90_us"] = round(seen[int(len(seen) * 0.9)] * 1e6, 1) if seen else None
    return out_


def worker(rounds: int, lone: bool) -> None:
    """A worker's body: every block in order (with ``lone``, only the lone pushes), one RESULT line
    each."""
    import numpy as np

    import kvstore

    kv = kvstore.create("dist_sync")
    pids = servers() if kv.rank == 0 else []
    for size in SIZES:
        key = f"k{size}"
        kv.init(key, np.zeros(size, np.float32))
        if lone:
            result = lone_push(kv, key, size, rounds, Path(os.environ["KVSTORE_TEST_ARRIVALS"]))
            print("RESULT " + json.dumps({"test": f"lone push {size}", "rank": kv.rank, **result}),
                  flush=True)
            continue
        for pushpull in (False, True):
            name = f"{'pushpull' if pushpull else 'push+pull'} {size}"
            result = block(kv, key, size, rounds, pushpull, pids)
            print("RESULT " + json.dumps({"test": name, "rank": kv.rank, **result}), flush=True)
    kv.close()


def launch(workers: int, servers_: int, rounds: int, arrivals: str | None = None) -> dict[str, list[dict]]:
    """Run one cluster (with ``arrivals``, a file: the lone pushes only, the servers logging each
    request's arrival there); return each test's per-worker results."""
    argv = [sys.executable, "launch.py", "-n", str(workers), "-s", str(servers_), __file__, "--worker",
            "--rounds", str(rounds)] + (["--lone-run"] if arrivals else [])
    env = {**os.environ, "KVSTORE_REQUEST_TIMEOUT": "120"}
    if arrivals:
        env["KVSTORE_TEST_ARRIVALS"] = arrivals
    env.pop("KVSTORE_SECRET", None)  # the launcher makes one: authentication as shipped
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                         f"{done.stderr[-2000:]}")
    results: dict[str, list[dict]] = {}
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            item = json.loads(line.split("RESULT ", 1)[1])
            results.setdefault(item.pop("test"), []).append(item)
    return results


def show(config: str, results: dict[str, list[dict]]) -> None:
    """Print one config's figures: p50 (worker 0), CPU per round by thread, worker 0 and the servers."""
    for test, items in results.items():
        items.sort(key=lambda r: r["rank"])
        first = items[0]
        if "cpu_us" not in first:
            print(f"{config} {test:16} " + " ".join(f"{k}={v}" for k, v in first.items() if k != "rank"))
            continue
        cpu = first["cpu_us"]
        workers = statistics.mean(r["cpu_us"]["worker"]["total"] for r in items)
        served = sum(v["total"] for k, v in cpu.items() if k.startswith("server"))
        print(f"{config} {test:16} p50 {first['p50_us']:7.1f} us | CPU/round: worker {workers:6.1f} us, "
              f"servers {served:6.1f} us")
        for proc, rows in cpu.items():
            ranked = sorted(rows.items(), key=lambda item: -item[1])
            parts = ", ".join(f"{k} {v}" for k, v in ranked if k != "total")
            print(f"{'':24}{proc:8} {parts}")


def main() -> None:
    """Parse the command line, run each config, print and (``--json``) save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="1w1s,4w2s")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--lone", type=int, default=100, help="rounds of the lone-push test (1w1s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lone-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.rounds, args.lone_run)
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg(), "configs": {}}
    for config in args.configs.split(","):
        w, s = (int(x) for x in config.rstrip("s").split("w"))
        results = launch(w, s, args.rounds)
        if (w, s) == (1, 1) and args.lone:
            with tempfile.TemporaryDirectory() as tmp:
                results.update(launch(1, 1, args.lone, str(Path(tmp) / "arrivals.jsonl")))
        out["configs"][config] = results
        show(config, results)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (start {out['load'][0]:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

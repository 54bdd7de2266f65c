"""The benchmark suite: real clusters through ``launch.py`` against raw pyzmq on this machine.

    python benchmarks/suite.py [--json results.json] [--configs 1w1s,2w1s,2w2s,4w1s,4w2s] [--quick] [--ddp]

For each cluster shape it launches real clusters (scheduler, servers, workers; the
launcher's own secret, so authentication is on as shipped) and measures, per worker:

* ``throughput``: a 64 MB model in 16 float32 keys, push then pull of every key per
  iteration; GB/s = 2 x model bytes x iterations / seconds;
* ``bigkey``: one 256 MB float32 key, split over the servers, push then pull (its own
  launch, so each server's peak RSS, which it logs at shutdown, is this test's);
* ``latency``: push then pull of a 1-element key, p50 and p99 in microseconds, then the same
  key's ``pushpull`` (one request) timed the same way;
* ``manykeys``: 10,000 keys of 100 floats pushed then pulled per iteration, keys/s,
  with batching on and off (``KVSTORE_BATCH_BYTES=0``: one request per key);
* ``train``: the Trainer's step (forward, backward, ``step`` through the servers) for
  a real torch model, against the same model trained in one process with torch's SGD;
* same-host shared memory is on by default, so every cluster here uses it; the 1w1s ``throughput``
  and ``bigkey`` tests run again with ``KVSTORE_SHM=0`` (``shm_figures.py``), and a server's memory
  is reported as its peak RSS and its own peak, without the workers' segment pages it maps;
* with ``--ddp``: ``benchmarks/trainer_step.py``'s comparison (issue 24): the Trainer's step (plain and
  overlapped) against one process and against torch DDP over gloo, for the 670k-parameter MLP and a
  20M-parameter one, at each worker count of ``--configs``.

Each rate is the best of three timed blocks (the unbatched many-keys run: one block), each worker
starting each block together; a worker prints its own figures and the table gives their mean.
In the same run, before any cluster, it measures the baseline: raw pyzmq round trips of
the same bytes between two processes (a DEALER and an echoing ROUTER, zero-copy sends,
``recv_into`` preallocated buffers, the best of several chunk sizes) and a 4-byte round
trip.  Every figure is printed with its ratio to that baseline, and ``KVSTORE_AUTH=full``
is measured at 1w1s.  Output: a table, and the JSON file of every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shm_figures  # noqa: E402  (benchmarks/ is not a package)
import trainer_step  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MB = 1 << 20
MODEL_KEYS, MODEL_BYTES = 16, 64 * MB
BIG_BYTES = 256 * MB
MANY_KEYS, MANY_FLOATS = 10_000, 100
CHUNKS = (256 * 1024, MB, 4 * MB, 16 * MB)


# -- the raw pyzmq baseline -------------------------------------------------------------------

def echo() -> None:
    """The baseline's far end: a ROUTER that receives every frame into a preallocated buffer and
    sends it straight back (zero-copy)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    buf = bytearray(BIG_BYTES + MB)
    view = memoryview(buf)
    while True:
        identity = sock.recv()
        frames, offset = [], 0
        while sock.getsockopt(zmq.RCVMORE):
            n = sock.recv_into(view[offset:])
            frames.append(view[offset:offset + n])
            offset += n
        if frames and frames[0].nbytes == 4 and bytes(frames[0]) == b"stop":
            return
        sock.send(identity, zmq.SNDMORE)
        for i, frame in enumerate(frames):
            sock.send(frame, flags=zmq.SNDMORE if i < len(frames) - 1 else 0, copy=frame.nbytes < 65536)


class RawLink:
    """The client end of the baseline: round trips of raw bytes to an :func:`echo` process."""

    def __init__(self) -> None:
        import zmq

        self.zmq = zmq
        self.proc = subprocess.Popen([sys.executable, __file__, "--echo"], stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def round_trip(self, data: memoryview, out: memoryview, chunk: int) -> None:
        """Send ``data`` in ``chunk``-byte frames of one message and receive it back into ``out``."""
        zmq, n = self.zmq, data.nbytes
        edges = list(range(0, n, chunk)) + [n]
        for lo, hi in zip(edges[:-1], edges[1:]):
            self.sock.send(data[lo:hi], flags=zmq.SNDMORE if hi < n else 0, copy=hi - lo < 65536)
        for lo in edges[:-1]:
            self.sock.recv_into(out[lo:])

    def rate(self, nbytes: int, seconds: float) -> dict[str, Any]:
        """GB/s of round trips of ``nbytes`` (both ways counted): for each of :data:`CHUNKS`, the
        best of three blocks of about ``seconds / 3``; the best chunk size wins."""
        data, out = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
        best: dict[str, Any] = {"gbps": 0.0}
        for chunk in CHUNKS:
            if chunk > nbytes:
                continue
            self.round_trip(data, out, chunk)  # warm-up
            for _ in range(3):
                count, started = 0, time.perf_counter()
                while count < 2 or time.perf_counter() - started < seconds / 3:
                    self.round_trip(data, out, chunk)
                    count += 1
                gbps = 2 * nbytes * count / (time.perf_counter() - started) / 1e9
                if gbps > best["gbps"]:
                    best = {"gbps": gbps, "chunk": chunk}
        return best

    def latency(self, count: int) -> dict[str, float]:
        """p50/p99 microseconds of a 4-byte round trip."""
        data, out = memoryview(bytearray(4)), memoryview(bytearray(4))
        times = []
        for i in range(count + 100):
            started = time.perf_counter()
            self.round_trip(data, out, 4)
            if i >= 100:
                times.append(time.perf_counter() - started)
        return percentiles(times)

    def close(self) -> None:
        """Stop the echo process and close the socket."""
        self.sock.send(b"stop")
        self.proc.wait(30)
        self.sock.close(linger=0)
        self.ctx.term()


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50 and p99 of ``seconds``, in microseconds."""
    ordered = sorted(seconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6  # noqa: E731
    return {"p50_us": pick(0.50), "p99_us": pick(0.99)}


def memcpy_gbps(nbytes: int = MODEL_BYTES, repeats: int = 10) -> float:
    """GB/s of one ``nbytes`` copy between two warm buffers in this process (the best of ``repeats``)."""
    import numpy as np

    source, target = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def baseline(quick: bool) -> dict[str, Any]:
    """The raw pyzmq figures every cluster figure is divided by, and a 64 MB memcpy's rate."""
    link = RawLink()
    try:
        seconds = 0.5 if quick else 1.5
        return {"memcpy_gbps": memcpy_gbps(),
                "model": link.rate(MODEL_BYTES, seconds), "big": link.rate(BIG_BYTES, seconds),
                "many": link.rate(MANY_KEYS * MANY_FLOATS * 4, seconds),
                "latency": link.latency(500 if quick else 3000)}
    finally:
        link.close()


# -- inside a cluster ------------------------------------------------------------------------

def report(test: str, **figures: Any) -> None:
    """Print one worker's result line for the parent to collect."""
    import kvstore

    kv = kvstore.create("dist_sync")
    print("RESULT " + json.dumps({"test": test, "rank": kv.rank, **figures}), flush=True)


def timed(kv: Any, step: Any, iters: int, warmup: int = 2, blocks: int = 3) -> float:
    """Seconds for ``iters`` calls of ``step`` (after ``warmup`` calls): the best of ``blocks``
    blocks, every worker starting each block together.  Best-of, like the baseline's, since
    other work on a shared machine only ever slows a block down."""
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(blocks):
        kv.barrier()
        started = time.perf_counter()
        for _ in range(iters):
            step()
        best = min(best, time.perf_counter() - started)
    return best


def run_throughput(kv: Any, iters: int) -> None:
    """16 keys of 4 MB: push all, pull all into outs."""
    import numpy as np

    n = MODEL_BYTES // MODEL_KEYS // 4
    keys = [f"layer{i}" for i in range(MODEL_KEYS)]
    grads = [np.full(n, 1.0, np.float32) for _ in keys]
    outs = [np.empty(n, np.float32) for _ in keys]
    kv.init(keys, [np.zeros(n, np.float32)] * len(keys))

    def step() -> None:
        kv.push(keys, grads)
        kv.pull(keys, out=outs)

    seconds = timed(kv, step, iters)
    assert outs[0][0] == kv.num_workers, outs[0][:2]
    lanes = kv._io.lanes  # same-host shared memory (kvstore.client.shmlanes), None when every byte is TCP
    report("throughput", gbps=2 * MODEL_BYTES * iters / seconds / 1e9, iters=iters,
           shm_bytes=0 if lanes is None else lanes.sent + lanes.received)


def run_bigkey(kv: Any, iters: int) -> None:
    """One 256 MB key split over the servers."""
    import numpy as np

    n = BIG_BYTES // 4
    grad, out = np.full(n, 1.0, np.float32), np.empty(n, np.float32)
    kv.init("big", np.zeros(n, np.float32))

    def step() -> None:
        kv.push("big", grad)
        kv.pull("big", out=out)

    seconds = timed(kv, step, iters)
    assert out[-1] == kv.num_workers
    report("bigkey", gbps=2 * BIG_BYTES * iters / seconds / 1e9, iters=iters)


def run_latency(kv: Any, count: int) -> None:
    """push + pull of a 1-element key, timed one by one."""
    import numpy as np

    value, out = np.ones(1, np.float32), np.empty(1, np.float32)
    kv.init("tiny", np.zeros(1, np.float32))
    for _ in range(50):
        kv.push("tiny", value)
        kv.pull("tiny", out=out)
    kv.barrier()
    times = []
    for _ in range(count):
        started = time.perf_counter()
        kv.push("tiny", value)
        kv.pull("tiny", out=out)
        times.append(time.perf_counter() - started)
    report("latency", **percentiles(times))
    times = []
    for _ in range(count):
        started = time.perf_counter()
        kv.pushpull("tiny", value, out=out)
        times.append(time.perf_counter() - started)
    report("pushpull", **percentiles(times))


def run_manykeys(kv: Any, iters: int, label: str, warmup: int = 2) -> None:
    """10,000 keys of 100 floats, push all then pull all."""
    import numpy as np

    keys = list(range(MANY_KEYS))
    grads = [np.ones(MANY_FLOATS, np.float32) for _ in keys]
    outs = [np.empty(MANY_FLOATS, np.float32) for _ in keys]
    kv.init(keys, [np.zeros(MANY_FLOATS, np.float32)] * len(keys))

    def step() -> None:
        kv.push(keys, grads)
        kv.pull(keys, out=outs)

    seconds = timed(kv, step, iters, warmup, blocks=1 if label.endswith("unbatched") else 3)
    assert outs[-1][0] == kv.num_workers
    report(label, keys_per_s=MANY_KEYS * iters / seconds, iters=iters)


def run_train(kv: Any, iters: int) -> None:
    """Trainer step time through the servers vs the same model with torch's SGD in this process
    (``trainer_step``'s 670k-parameter MLP, batch and step; one timed block each)."""
    import torch

    from kvstore import Trainer

    local = trainer_step.model("670k")
    sgd = torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9)
    local_ms = trainer_step.timed(local, sgd.step, kv.rank, iters, 1, kv.barrier)
    net = trainer_step.model("670k")
    trainer = Trainer(list(net.parameters()), "sgd", {"learning_rate": 0.01, "momentum": 0.9},
                      kvstore=kv, update_on_kvstore=True)
    dist_ms = trainer_step.timed(net, lambda: trainer.step(64), kv.rank, iters, 1, kv.barrier)
    params = sum(p.numel() for p in net.parameters())
    report("train", local_ms=local_ms, dist_ms=dist_ms, params=params)


def worker(tests: list[str], quick: bool) -> None:
    """A worker's body: run ``tests`` in order on this process's dist_sync store."""
    import kvstore

    kv = kvstore.create("dist_sync")
    scale = 1 if quick else 2
    for test in tests:
        if test == "throughput":
            run_throughput(kv, 3 * scale)
        elif test == "bigkey":
            run_bigkey(kv, 2 * scale)
        elif test == "latency":
            run_latency(kv, 300 * scale)
        elif test == "manykeys":
            run_manykeys(kv, 2 * scale, "manykeys")
        elif test == "manykeys_unbatched":
            run_manykeys(kv, 1, "manykeys_unbatched", warmup=1)  # one block of one: it is slow
        elif test == "train":
            run_train(kv, 20 * scale)
        kv.barrier()
    kv.close()


# -- the parent: launches and the table ------------------------------------------------------

def launch(workers: int, servers: int, tests: list[str], quick: bool, env: dict[str, str]) -> dict[str, Any]:
    """Run ``tests`` in one cluster; return ``{test: [per-worker result]}`` and the servers' memory."""
    argv = [sys.executable, "launch.py", "-n", str(workers), "-s", str(servers), __file__, "--worker",
            ",".join(tests)] + (["--quick"] if quick else [])
    # INFO: each server logs its peak RSS and the bytes it holds at shutdown (WARNING is the default)
    full_env = {**os.environ, "KVSTORE_REQUEST_TIMEOUT": "600", "KVSTORE_LOG_LEVEL": "INFO", **env}
    full_env.pop("KVSTORE_SECRET", None)  # the launcher makes one: authentication as shipped
    done = subprocess.run(argv, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n"
                         f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}")
    results: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            item = json.loads(line.split("RESULT ", 1)[1])
            results.setdefault(item.pop("test"), []).append(item)
    return {"results": results, "servers": shm_figures.servers(done.stdout)}


def mean(items: list[dict[str, Any]], name: str) -> float:
    """The mean of ``name`` over the workers' results."""
    return sum(item[name] for item in items) / len(items)


def progress(text: str) -> None:
    """One line of progress on stderr."""
    print(f"[suite {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main() -> None:
    """Parse the command line, run the baseline and every cluster, print the table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--configs", default="1w1s,2w1s,2w2s,4w1s,4w2s")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument("--tests", default="throughput,latency,manykeys,train,unbatched,bigkey",
                        help="which tests to run per config (a subset of the default)")
    parser.add_argument("--ddp", action="store_true", help="also the Trainer against DDP (trainer_step.py)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--echo", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo:
        return echo()
    if args.worker is not None:
        return worker(args.worker.split(","), args.quick)

    tests = args.tests.split(",")
    progress("baseline: raw pyzmq between two processes")
    base = baseline(args.quick)
    out: dict[str, Any] = {"machine": machine(), "baseline": base, "configs": {}}
    for name in args.configs.split(","):
        w, s = (int(x) for x in re.fullmatch(r"(\d+)w(\d+)s", name).groups())
        out["configs"][name] = run_config(w, s, tests, args.quick)
    if "4w2s" in out["configs"] and "bigkey" in tests:
        progress("4w2s: one 256 MB key, summed in rank order (KVSTORE_SUM_ORDER=rank)")
        out["bigkey_rank_order_4w2s"] = launch(4, 2, ["bigkey"], args.quick,
                                               {"KVSTORE_SUM_ORDER": "rank"})["servers"]
    if "1w1s" in out["configs"] and {"throughput", "bigkey"} & set(tests):
        progress("1w1s: the model and 256 MB tests without shared memory (KVSTORE_SHM=0)")
        out["shm_off_1w1s"] = shm_figures.run(launch, mean, tests, args.quick)
    if "1w1s" in out["configs"] and "throughput" in tests:
        progress("1w1s: throughput with KVSTORE_AUTH=full")
        full = launch(1, 1, ["throughput"], args.quick, {"KVSTORE_AUTH": "full"})
        out["auth_full_throughput_gbps"] = mean(full["results"]["throughput"], "gbps")
    print_table(out)
    if args.ddp:
        progress("the Trainer against one process and DDP (benchmarks/trainer_step.py)")
        out["trainer_vs_ddp"] = trainer_step.compare(
            sorted({int(n.split("w")[0]) for n in args.configs.split(",")}), args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def run_config(w: int, s: int, tests: list[str], quick: bool) -> dict[str, Any]:
    """Run ``tests`` (names of the ``--tests`` flag) at ``w`` workers and ``s`` servers; return the
    figures (NaN for a test not run)."""
    nan, r = float("nan"), {}
    main_tests = [t for t in ("throughput", "latency", "manykeys", "train") if t in tests]
    if main_tests:
        progress(f"{w}w{s}s: {', '.join(main_tests)}")
        r.update(launch(w, s, main_tests, quick, {})["results"])
    if "unbatched" in tests:
        progress(f"{w}w{s}s: many keys without batching")
        r.update(launch(w, s, ["manykeys_unbatched"], quick, {"KVSTORE_BATCH_BYTES": "0"})["results"])
    servers = []
    if "bigkey" in tests:
        progress(f"{w}w{s}s: one 256 MB key")
        big = launch(w, s, ["bigkey"], quick, {})
        r.update(big["results"])
        servers = big["servers"]
    get = lambda test, name: mean(r[test], name) if test in r else nan  # noqa: E731
    return {"throughput_gbps": get("throughput", "gbps"), "bigkey_gbps": get("bigkey", "gbps"),
            "latency_p50_us": get("latency", "p50_us"), "latency_p99_us": get("latency", "p99_us"),
            "pushpull_p50_us": get("pushpull", "p50_us"), "pushpull_p99_us": get("pushpull", "p99_us"),
            "manykeys_per_s": get("manykeys", "keys_per_s"),
            "manykeys_unbatched_per_s": get("manykeys_unbatched", "keys_per_s"),
            "train_local_ms": get("train", "local_ms"), "train_dist_ms": get("train", "dist_ms"),
            "throughput_shm_bytes": get("throughput", "shm_bytes"),
            "train_params": r["train"][0]["params"] if "train" in r else 0, "bigkey_servers": servers}


def machine() -> dict[str, Any]:
    """What this run ran on."""
    import numpy as np
    import zmq

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "numpy": np.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
            "date": time.strftime("%Y-%m-%d")}


def print_table(out: dict[str, Any]) -> None:
    """The figures and their ratios to the baseline (and the targets' ratios)."""
    base = out["baseline"]
    m = out["machine"]
    print(f"machine: {m['cpus']} CPUs, Python {m['python']}, numpy {m['numpy']}, pyzmq {m['pyzmq']} "
          f"(libzmq {m['libzmq']}), {m['platform']}")
    print(f"baseline (raw pyzmq round trips, best chunk): 64 MB {base['model']['gbps']:.2f} GB/s, "
          f"256 MB {base['big']['gbps']:.2f} GB/s, 4 MB {base['many']['gbps']:.2f} GB/s, "
          f"4-byte p50 {base['latency']['p50_us']:.0f} us p99 {base['latency']['p99_us']:.0f} us")
    many_base = MANY_KEYS / (2 * MANY_KEYS * MANY_FLOATS * 4 / (base["many"]["gbps"] * 1e9))
    head = (f"{'config':>6} {'model GB/s':>10} {'/raw':>5} {'256MB GB/s':>10} {'/raw':>5} {'p50 us':>7} "
            f"{'/raw':>5} {'p99 us':>7} {'pp p50':>6} {'/raw':>5} {'keys/s':>8} {'/raw':>5} {'unbatched':>9} "
            f"{'batch x':>7} "
            f"{'step ms':>7} {'1-proc':>6} {'x':>5}")
    print(head)
    for name, c in out["configs"].items():
        print(f"{name:>6} {c['throughput_gbps']:10.3f} {c['throughput_gbps'] / base['model']['gbps']:5.2f} "
              f"{c['bigkey_gbps']:10.3f} {c['bigkey_gbps'] / base['big']['gbps']:5.2f} "
              f"{c['latency_p50_us']:7.0f} {c['latency_p50_us'] / base['latency']['p50_us']:5.1f} "
              f"{c['latency_p99_us']:7.0f} {c['pushpull_p50_us']:6.0f} "
              f"{c['pushpull_p50_us'] / base['latency']['p50_us']:5.1f} {c['manykeys_per_s']:8.0f} "
              f"{c['manykeys_per_s'] / many_base:5.2f} "
              f"{c['manykeys_unbatched_per_s']:9.0f} "
              f"{c['manykeys_per_s'] / c['manykeys_unbatched_per_s']:7.1f} "
              f"{c['train_dist_ms']:7.2f} {c['train_local_ms']:6.2f} "
              f"{c['train_dist_ms'] / c['train_local_ms']:5.1f}")
    for name, c in out["configs"].items():
        for s in c["bigkey_servers"]:
            print(f"{name} 256 MB test: {shm_figures.memory_line(s)}")
    configs = out["configs"]
    if "4w1s" in configs and "4w2s" in configs:
        print(f"4w2s / 4w1s model throughput: "
              f"{configs['4w2s']['throughput_gbps'] / configs['4w1s']['throughput_gbps']:.2f}")
    for s in out.get("bigkey_rank_order_4w2s", []):
        print(f"4w2s 256 MB test, KVSTORE_SUM_ORDER=rank: {shm_figures.memory_line(s)}")
    if "shm_off_1w1s" in out:
        shm_figures.report(configs["1w1s"], out["shm_off_1w1s"], base)
    if "auth_full_throughput_gbps" in out:
        print(f"1w1s model throughput with KVSTORE_AUTH=full: {out['auth_full_throughput_gbps']:.3f} GB/s "
              f"({out['auth_full_throughput_gbps'] / configs['1w1s']['throughput_gbps']:.2f}x the default)")


if __name__ == "__main__":
    main()

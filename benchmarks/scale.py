"""Scale, measured (issue 45 item 2): light workers at W = 4, 16, 64, 128; the scheduler alone
against up to 1,000 simulated nodes; a 64 MB push+pull over a shaped link against loopback.

    python benchmarks/scale.py [--workers 4,16,64,128] [--barriers 50] [--rounds 50] [--idle 10]
                               [--nodes 100,250,500,1000] [--intervals 0.5,0.25,0.1,0.05] [--window 5]
                               [--parts cluster,scheduler,link] [--json out.json]
    python benchmarks/scale.py --plot benchmarks/results/DATE-scale.json [--out docs/images/scale.png]

1. **Light workers** (``launch.py -n W -s 1`` of this script's ``--worker``: numpy and one 1-float
   key, no torch).  Per W: the time to rendezvous (the launch to the last worker holding the cluster
   map, so Python's start and import are in it), barrier latency and a one-key ``dist_sync``
   ``pushpull`` round (p50/p95 pooled over every worker's calls), and the scheduler's CPU per
   heartbeat: every worker sleeps ``--idle`` seconds between two barriers (nothing but heartbeats
   reach the scheduler then, at ``KVSTORE_HEARTBEAT_INTERVAL=1``, the default, set explicitly);
   worker 0 reads the scheduler's CPU time before and after (``/proc/<pid>/task/*/schedstat``,
   nanoseconds, every thread, zmq's I/O thread included: ``/proc/<pid>/stat``'s 10 ms ticks are too
   coarse for a few dozen beats), divided by the beats sent in the window, (W + 1) x idle / interval.
   Each figure is printed with its ratio to W = 4 of the same run.  On a 2-core machine the W workers,
   the server and the scheduler share 2 cores: a barrier's latency is then mostly the time to
   schedule W processes, not the scheduler's work; the CPU per heartbeat is the figure that carries
   over to a real cluster.
2. **The scheduler alone** (``python -m kvstore.scheduler``, ``DMLC_NUM_WORKER=n-1``, one server)
   against n simulated nodes driven by one process: each node a DEALER socket with its own
   :class:`kvstore.net.auth.Channel` keyed by the cluster secret, registering as the real ones do
   (HELLO, CHALLENGE, REGISTER, MAP: :func:`kvstore.net.handshake.register`'s messages) and then
   sending HEARTBEAT ``{"role", "rank"}`` sealed with the session (without the stats snapshot a real
   node adds).  Per n at a 1 s interval, then at n = max with shorter intervals (offered load
   n / interval beats/s): beats answered per second, the scheduler's CPU %, and the reply latency
   p50/p99.  Where answered < offered or the latency grows, it is saturated; the driver's own CPU is
   printed too (when it is near 100 % the driver, not the scheduler, is the limit).  zmq's socket
   limit and ``RLIMIT_NOFILE`` are raised for this.
3. **A shaped link** (root and ``tests/hosts.py`` only, else skipped with the reason): 2 hosts, the
   worker on one, scheduler and server on the other.  The veth's unshaped rate (one raw TCP stream of
   512 MB), then the 64 MB push+pull rate unshaped, with ``tc htb`` at half that raw rate, and at
   1 Gbit/s (a rate the job cannot outrun), each against the same job on 127.0.0.1 over TCP
   (``KVSTORE_SHM=0``: across hosts there is no shared memory); shaped at half the raw rate, also
   through the harness's delay relay (100 us each way: the server binds and advertises 0.0.0.0, which
   the worker's connect takes for its own host, where the relay listens on the server's port).  The
   ``Trainer`` step (``benchmarks/trainer_step.py``'s 20m model, ``overlap``, one worker) on loopback,
   shaped, and shaped with the relay.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
INTERVAL = 1.0  # KVSTORE_HEARTBEAT_INTERVAL of every run here (the default, set explicitly)


# -- helpers (pure) -----------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (``/proc/<pid>/task/*/schedstat``)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total


def scheduler_pid(launcher: int) -> int:
    """The pid of the scheduler started by the launcher process ``launcher``; raises LookupError."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and b"kvstore.scheduler" in cmdline:
            return int(entry.name)
    raise LookupError(f"no kvstore.scheduler child of pid {launcher}")


# -- part 1: light workers ----------------------------------------------------------------------------

def worker(barriers: int, rounds: int, idle: float) -> None:
    """Under launch.py: time the rendezvous, barriers, one-key rounds and (worker 0) the scheduler's
    CPU over an idle window; print one ``RESULT`` line of JSON."""
    import numpy as np

    import kvstore

    started = time.time()
    kv = kvstore.create("dist_sync")
    joined = time.time()
    value, out = np.ones(1, np.float32), np.empty(1, np.float32)
    kv.init("k", np.zeros(1, np.float32))
    kv.pushpull("k", value, out=out)  # warm-up
    kv.barrier()
    waits = []
    for _ in range(barriers):
        t = time.perf_counter()
        kv.barrier()
        waits.append(time.perf_counter() - t)
    kv.barrier()
    trips = []
    for _ in range(rounds):
        t = time.perf_counter()
        kv.pushpull("k", value, out=out)
        trips.append(time.perf_counter() - t)
    kv.barrier()
    window = None
    if kv.rank == 0:
        pid = scheduler_pid(os.getppid())
        before, t = cpu_ns(pid), time.monotonic()
        time.sleep(idle)
        window = [cpu_ns(pid) - before, time.monotonic() - t]
    else:
        time.sleep(idle)
    kv.barrier()
    print("RESULT " + json.dumps({"rank": kv.rank, "started": started, "joined": joined,
                                  "barrier": waits, "round": trips, "window": window}), flush=True)
    kv.close()


def run_cluster(w: int, args: argparse.Namespace) -> dict[str, float]:
    """Launch W light workers and one server; return this W's figures (seconds, ns per beat)."""
    argv = [sys.executable, "launch.py", "-n", str(w), "-s", "1", __file__, "--worker",
            "--barriers", str(args.barriers), "--rounds", str(args.rounds), "--idle", str(args.idle)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVSTORE_HEARTBEAT_INTERVAL": str(INTERVAL)}
    env.pop("KVSTORE_SECRET", None)  # the launcher makes one: authentication as shipped
    launched = time.time()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode != 0 or len(rows) != w:
        raise SystemExit(f"W={w} failed ({done.returncode}, {len(rows)} results):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    window = next(r["window"] for r in rows if r["window"] is not None)
    beats = (w + 1) * window[1] / INTERVAL  # W workers and the server beat once an interval
    barrier = [x for r in rows for x in r["barrier"]]
    trips = [x for r in rows for x in r["round"]]
    return {"W": w, "beats_per_s": beats / window[1], "cpu_s_per_s": window[0] / 1e9 / window[1],
            "rendezvous_s": max(r["joined"] for r in rows) - launched,
            "register_s": max(r["joined"] for r in rows) - min(r["started"] for r in rows),
            "barrier_p50_ms": percentile(barrier, 50) * 1e3, "barrier_p95_ms": percentile(barrier, 95) * 1e3,
            "round_p50_ms": percentile(trips, 50) * 1e3, "round_p95_ms": percentile(trips, 95) * 1e3,
            "sched_cpu_us_per_beat": window[0] / 1e3 / beats, "sched_cpu_pct": window[0] / 1e7 / window[1],
            "job_s": time.time() - launched}


def part_cluster(args: argparse.Namespace) -> list[dict[str, float]]:
    """Part 1 for every W of ``--workers``; print each row and its ratios to the first W."""
    print(f"== light workers, 1 server, heartbeat interval {INTERVAL:g} s, idle window {args.idle:g} s; "
          f"p50/p95 pooled over every worker ({os.cpu_count()} CPU cores)")
    keys = ("rendezvous_s", "barrier_p50_ms", "barrier_p95_ms", "round_p50_ms", "round_p95_ms",
            "sched_cpu_us_per_beat")
    print(f"{'W':>4} {'rendezvous s':>12} {'barrier p50/p95 ms':>19} {'round p50/p95 ms':>17} "
          f"{'sched us/beat':>13} {'sched CPU %':>11}   ratios to W={args.workers[0]} (same order)")
    rows: list[dict[str, float]] = []
    for w in args.workers:
        row = run_cluster(w, args)
        rows.append(row)
        base = rows[0]
        ratios = " ".join(f"{row[k] / base[k]:.2f}x" for k in keys)
        r = row
        print(f"{w:>4} {r['rendezvous_s']:>12.2f} {r['barrier_p50_ms']:>9.2f}/{r['barrier_p95_ms']:<9.2f} "
              f"{r['round_p50_ms']:>8.2f}/{r['round_p95_ms']:<8.2f} {r['sched_cpu_us_per_beat']:>13.1f} "
              f"{r['sched_cpu_pct']:>11.2f}   {ratios}  (job {r['job_s']:.0f} s)", flush=True)
    if len(rows) > 1:  # the slope removes the scheduler's fixed cost (its poll loop's idle wake-ups)
        first, last = rows[0], rows[-1]
        slope = (last["cpu_s_per_s"] - first["cpu_s_per_s"]) / (last["beats_per_s"] - first["beats_per_s"])
        print(f"marginal scheduler CPU per heartbeat, W={first['W']} to W={last['W']}: {slope * 1e6:.1f} us "
              f"({first['beats_per_s']:.1f} -> {last['beats_per_s']:.1f} beats/s)")
    return rows


# -- part 2: the scheduler alone against simulated nodes ----------------------------------------------

class SimNode:
    """One simulated node: a DEALER socket to the scheduler and a channel of its own."""

    def __init__(self, index: int, address: str, key: bytes) -> None:
        from kvstore.net import transport
        from kvstore.net.auth import Channel, new_label

        self.index, self.role = index, "server" if index == 0 else "worker"
        self.rank: int | None = None  # from the map
        self.sock = transport.connect_dealer(address)
        self.channel = Channel(key, new_label(f"sim{index}"))
        self.nonce = secrets.token_hex(16)
        self.seq = 0
        self.sent: dict[int, float] = {}  # seq -> when sent (monotonic)

    def send(self, op: Any, body: dict, seq: int = 0) -> None:
        """Seal ``body`` as ``op`` to the scheduler and send it."""
        from kvstore.net import transport
        from kvstore.net.protocol import Message

        frames = self.channel.seal(Message(op, body, seq=seq, sender=self.rank), "scheduler")
        transport.send(self.sock, frames)

    def beat(self) -> None:
        """Send one HEARTBEAT, as :class:`kvstore.net.heartbeat.Heartbeat` does (without stats)."""
        from kvstore.net.protocol import Op

        self.seq += 1
        self.sent[self.seq] = time.monotonic()
        self.send(Op.HEARTBEAT, {"role": self.role, "rank": self.rank}, self.seq)


def start_scheduler(n: int, secret: str, workdir: Path) -> tuple[subprocess.Popen, int]:
    """Start ``python -m kvstore.scheduler`` for n nodes (n - 1 workers, 1 server); its process and port."""
    from kvstore.launch import portfile

    port_file = workdir / f"scheduler-{n}.port"
    env = {**os.environ, "DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "0",
           "DMLC_NUM_WORKER": str(n - 1), "DMLC_NUM_SERVER": "1", "KVSTORE_SECRET": secret,
           "KVSTORE_PORT_FILE": str(port_file), "KVSTORE_HEARTBEAT_INTERVAL": str(INTERVAL),
           "KVSTORE_CONNECT_TIMEOUT": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.scheduler"], cwd=REPO, env=env)
    deadline = time.monotonic() + 30
    while (port := portfile.read(str(port_file))) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the scheduler for {n} nodes did not start ({proc.poll()})")
        time.sleep(0.02)
    return proc, port


def replies(poller: Any, nodes: dict[Any, SimNode], timeout_s: float) -> list[tuple[SimNode, Any]]:
    """Every reply waiting (after up to ``timeout_s``), opened by its node's channel."""
    import zmq

    from kvstore.net import transport

    out = []
    for sock, _ in poller.poll(max(0, int(timeout_s * 1000))):
        node = nodes[sock]
        while sock.poll(0, zmq.POLLIN):
            out.append((node, node.channel.open(transport.recv(sock))))
    return out


def register_all(sims: list[SimNode], poller: Any, by_sock: dict[Any, SimNode], timeout: float) -> None:
    """HELLO, CHALLENGE, REGISTER and MAP for every node; raises TimeoutError past ``timeout`` s."""
    from kvstore.net.protocol import Op

    for node in sims:
        node.send(Op.HELLO, {"nonce": node.nonce})
    mapped, deadline = 0, time.monotonic() + timeout
    while mapped < len(sims):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{mapped} of {len(sims)} simulated nodes got the map in {timeout:g} s")
        for node, msg in replies(poller, by_sock, 0.1):
            if msg.op is Op.CHALLENGE:
                body = {"role": node.role, "host": "127.0.0.1", "rank": None, "incarnation": 0,
                        "challenge": msg.body["challenge"]}
                body.update({"port": 1} if node.role == "server" else {"mode": "dist_sync", "quorum": None})
                node.send(Op.REGISTER, body)
            elif msg.op is Op.MAP:
                node.rank = msg.body["rank"]
                node.channel.set_session(msg.body["session"])
                mapped += 1
            else:
                raise SystemExit(f"simulated node {node.index}: {msg.op.name} {msg.body}")


def drive(sims: list[SimNode], poller: Any, by_sock: dict[Any, SimNode], pid: int, interval: float,
          window: float) -> dict[str, float]:
    """Beat every node once per ``interval`` (spread evenly) for ``window`` s; the figures."""
    n, lat, answered, lost = len(sims), [], 0, 0
    start = time.monotonic() + 0.02
    end = start + window
    k = 0
    sched0, mine0 = cpu_ns(pid), time.process_time()
    while (now := time.monotonic()) < end:
        while (due := start + k * interval / n) <= now and due < end:
            sims[k % n].beat()
            k += 1
        for node, msg in replies(poller, by_sock, min(0.001, max(0.0, due - now))):
            sent = node.sent.pop(msg.seq, None)
            if sent is None:
                continue  # a reply to an earlier window's beat, past its drain
            lat.append(time.monotonic() - sent)
            answered += 1
            lost += bool(msg.body.get("lost"))
    sched, mine = (cpu_ns(pid) - sched0) / 1e9, time.process_time() - mine0
    drain = time.monotonic() + 3.0  # late replies count for latency only
    while any(node.sent for node in sims) and time.monotonic() < drain:
        for node, msg in replies(poller, by_sock, 0.05):
            if (sent := node.sent.pop(msg.seq, None)) is not None:
                lat.append(time.monotonic() - sent)
    unanswered = sum(len(node.sent) for node in sims)
    for node in sims:
        node.sent.clear()
    return {"nodes": n, "interval_s": interval, "offered_per_s": n / interval, "sent_per_s": k / window,
            "answered_per_s": answered / window, "sched_cpu_pct": 100 * sched / window,
            "sched_us_per_beat": 1e6 * sched / max(1, answered), "driver_cpu_pct": 100 * mine / window,
            "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
            "unanswered": unanswered, "lost_replies": lost}


def simulate(n: int, intervals: list[float], window: float, workdir: Path) -> list[dict[str, float]]:
    """One scheduler against ``n`` simulated nodes, driven at each of ``intervals``; the rows."""
    import zmq

    from kvstore.net.auth import derive_key

    secret = secrets.token_hex(16)
    proc, port = start_scheduler(n, secret, workdir)
    sims: list[SimNode] = []
    try:
        t = time.monotonic()
        sims = [SimNode(i, f"tcp://127.0.0.1:{port}", derive_key(secret)) for i in range(n)]
        poller = zmq.Poller()
        for node in sims:
            poller.register(node.sock, zmq.POLLIN)
        register_all(sims, poller, {node.sock: node for node in sims}, 120)
        registered = time.monotonic() - t
        rows = []
        for interval in intervals:
            row = drive(sims, poller, {node.sock: node for node in sims}, proc.pid, interval, window)
            row["register_s"] = registered
            rows.append(row)
        return rows
    finally:
        for node in sims:
            node.sock.close(0)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def part_scheduler(args: argparse.Namespace) -> list[dict[str, float]]:
    """Part 2: each node count at the default interval, then the largest at ``--intervals``."""
    import tempfile

    import zmq

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(args.nodes) * 4 + 256  # a DEALER's connection, its mailbox; the scheduler's side
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))  # the scheduler inherits it
    zmq.Context.instance().set(zmq.MAX_SOCKETS, max(args.nodes) + 256)
    print(f"\n== the scheduler alone against simulated nodes (one driver process; windows of "
          f"{args.window:g} s; RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})")
    print(f"{'nodes':>5} {'interval s':>10} {'offered/s':>9} {'sent/s':>8} {'answered/s':>10} "
          f"{'sched CPU %':>11} {'us/beat':>8} {'driver CPU %':>12} {'p50 ms':>7} {'p99 ms':>8} "
          f"{'unanswered':>10} {'register s':>10}")
    rows: list[dict[str, float]] = []
    plan = [(n, [INTERVAL]) for n in args.nodes[:-1]] + [(args.nodes[-1], [INTERVAL, *args.intervals])]
    with tempfile.TemporaryDirectory(prefix="kvscale-") as workdir:
        for n, intervals in plan:
            for row in simulate(n, intervals, args.window, Path(workdir)):
                rows.append(row)
                r = row
                print(f"{r['nodes']:>5} {r['interval_s']:>10g} {r['offered_per_s']:>9.0f} "
                      f"{r['sent_per_s']:>8.0f} {r['answered_per_s']:>10.0f} {r['sched_cpu_pct']:>11.1f} "
                      f"{r['sched_us_per_beat']:>8.1f} {r['driver_cpu_pct']:>12.1f} {r['p50_ms']:>7.2f} "
                      f"{r['p99_ms']:>8.2f} {r['unanswered']:>10} {r['register_s']:>10.2f}", flush=True)
    top = [r for r in rows if r["nodes"] == args.nodes[-1]]
    if len(top) > 1:  # CPU against beats answered at the largest n: the slope is the cost of a beat
        lo, hi = top[0], max(top, key=lambda r: r["answered_per_s"])
        cpu = (hi["sched_cpu_pct"] - lo["sched_cpu_pct"]) / 100
        slope = cpu / (hi["answered_per_s"] - lo["answered_per_s"])
        print(f"marginal scheduler CPU per heartbeat at {lo['nodes']} nodes: {slope * 1e6:.1f} us; one "
              f"core would answer about {1 / slope:,.0f} beats/s, {INTERVAL / slope:,.0f} nodes at a "
              f"{INTERVAL:g} s interval (a straight-line extrapolation of the cost per beat)")
    return rows


# -- part 3: a shaped link ----------------------------------------------------------------------------

RAW_SINK = ("import socket, sys\n"
            "s = socket.create_server((sys.argv[1], 7001)); print('up', flush=True)\n"
            "c, _ = s.accept()\n"
            "while c.recv(1 << 20):\n    pass\n"
            "c.sendall(b'x')")
RAW_SOURCE = ("import socket, sys, time\n"
              "c = socket.create_connection((sys.argv[1], 7001), timeout=30); data = bytes(1 << 20)\n"
              "t = time.perf_counter()\n"
              "for _ in range(int(sys.argv[2])):\n    c.sendall(data)\n"
              "c.shutdown(socket.SHUT_WR); c.recv(1); print(int(sys.argv[2]) / (time.perf_counter() - t))")


def raw_rate(sink: Any, source: Any, mb: int) -> float:
    """MB/s of one TCP stream of ``mb`` MB from host ``source`` to host ``sink`` (plain sockets)."""
    proc = sink.popen([sys.executable, "-c", RAW_SINK, sink.address], stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline() != "up\n":
            raise RuntimeError("the raw sink did not start")
        done = source.run([sys.executable, "-c", RAW_SOURCE, sink.address, str(mb)], timeout=120, check=True)
        return float(done.stdout)
    finally:
        proc.kill()
        proc.wait(10)


def rate_worker(mb: int, iters: int) -> None:
    """Under a cluster: the 64 MB push+pull rate (``benchmarks/rates.py``'s worker)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import rates

    rates.worker(mb, iters)


SERVER_PORT = 9200  # the server's port on host 0 (and the relay's on host 1)
TRAINER_MODEL = "20m"  # benchmarks/trainer_step.py's model for the Trainer step over the link


ECHO = ("import socket, sys\n"
        "s = socket.create_server((sys.argv[1], int(sys.argv[2]))); print('up', flush=True)\n"
        "c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        "while (b := c.recv(1)):\n    c.sendall(b)\n")
PING = ("import socket, statistics, sys, time\n"
        "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)\n"
        "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []\n"
        "for _ in range(300):\n"
        "    t = time.perf_counter(); c.sendall(b'x'); c.recv(1); times.append(time.perf_counter() - t)\n"
        "print(statistics.median(times[20:]) * 1e6)")


def round_trip_us(made: Any, relayed: bool) -> float:
    """The median round trip of one byte, host 1 to an echo on host 0's server port (through the relay
    with ``relayed``), in us; the echo serves that one connection and exits."""
    echo = made[0].popen([sys.executable, "-c", ECHO, made[0].address, str(SERVER_PORT)],
                         stdout=subprocess.PIPE, text=True)
    try:
        if echo.stdout.readline() != "up\n":
            raise RuntimeError("the echo did not start")
        target = "0.0.0.0" if relayed else made[0].address
        done = made[1].run([sys.executable, "-c", PING, target, str(SERVER_PORT)], timeout=60, check=True)
        return float(done.stdout)
    finally:
        echo.wait(10)


def relay_to_server(made: Any, delay: float) -> Any:
    """The harness's relay on host 1, listening on every address at the server's port and forwarding
    to host 0's, ``delay`` s added each way; it runs until the hosts go."""
    return made.relay(made[1], made[0], SERVER_PORT, delay, listen="0.0.0.0", port=SERVER_PORT)


def hosts_job(made: Any, worker_argv: list[str], relayed: bool = False) -> str:
    """A 1w1s job: scheduler and server on host 0, the worker (``worker_argv``) on host 1; its output.

    ``relayed``: the worker's traffic to the server goes through :func:`relay_to_server`'s relay: the
    server binds every address (``DMLC_NODE_HOST=0.0.0.0``) and advertises 0.0.0.0, which a worker's
    connect takes for its own host, where the relay listens on the server's port (no DNAT needed).
    The scheduler's traffic is direct."""
    server_host, worker_host = made[0], made[1]
    env = {"DMLC_PS_ROOT_URI": server_host.address, "DMLC_PS_ROOT_PORT": "9091",  # the netns's own ports
           "DMLC_NUM_WORKER": "1", "DMLC_NUM_SERVER": "1", "KVSTORE_SECRET": secrets.token_hex(16),
           "KVSTORE_BIGARRAY_BOUND": str(1 << 40), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "KVSTORE_SHM": "0", "KVSTORE_REQUEST_TIMEOUT": "600"}
    server_at = {"DMLC_NODE_HOST": "0.0.0.0" if relayed else server_host.address,
                 "KVSTORE_NODE_PORT": str(SERVER_PORT)}
    roles = [server_host.popen([sys.executable, "-m", f"kvstore.{role}"],
                               {**env, "DMLC_ROLE": role, "DMLC_NODE_HOST": server_host.address,
                                **(server_at if role == "server" else {})}, cwd=REPO)
             for role in ("scheduler", "server")]
    try:
        done = worker_host.run(worker_argv, {**env, "DMLC_ROLE": "worker",
                                             "DMLC_NODE_HOST": worker_host.address}, timeout=600, cwd=REPO)
    finally:
        for proc in roles:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    if done.returncode != 0:
        raise RuntimeError(f"the job across hosts failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


def hosts_rate(made: Any, mb: int, iters: int, relayed: bool = False) -> float:
    """The MB/s of :func:`rate_worker` in :func:`hosts_job`."""
    import re

    out = hosts_job(made, [sys.executable, __file__, "--rate-worker", "--mb", str(mb), "--iters", str(iters)],
                    relayed)
    match = re.search(r"RATE ([\d.]+)", out)
    if match is None:
        raise RuntimeError(f"no RATE in the worker's output:\n{out}")
    return float(match.group(1))


def trainer_argv(iters: int) -> list[str]:
    """benchmarks/trainer_step.py's worker: the ``overlap`` Trainer step of its 20m model, 1 worker."""
    return [sys.executable, str(REPO / "benchmarks" / "trainer_step.py"), "--worker", TRAINER_MODEL,
            "--variants", "overlap", "--iters", str(iters), "--blocks", "2"]


def step_ms(out: str) -> float:
    """The step ms a trainer_step.py worker printed."""
    for line in out.splitlines():
        if "RESULT " in line:
            return float(json.loads(line.split("RESULT ", 1)[1])["ms"])
    raise RuntimeError(f"no RESULT in the worker's output:\n{out}")


def loopback_step(iters: int) -> float:
    """The same Trainer step on a 1w1s job on 127.0.0.1 (TCP: KVSTORE_SHM=0)."""
    env = {**os.environ, "KVSTORE_SECRET": secrets.token_hex(16), "KVSTORE_SHM": "0", "OMP_NUM_THREADS": "1",
           "KVSTORE_BIGARRAY_BOUND": str(1 << 40), "KVSTORE_REQUEST_TIMEOUT": "600"}
    done = subprocess.run([sys.executable, "launch.py", "-n", "1", "-s", "1", *trainer_argv(iters)[1:]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the loopback Trainer run failed:\n{done.stdout}\n{done.stderr}")
    return step_ms(done.stdout + done.stderr)


def part_link(args: argparse.Namespace) -> dict[str, Any]:
    """Part 3: the 64 MB push+pull rate and the Trainer step on loopback (TCP), across 2 namespaced
    hosts unshaped, shaped to half the veth's unshaped rate, and shaped with the relay's 100 us each
    way; skipped with the reason where the harness cannot run."""
    sys.path.insert(0, str(REPO))
    from tests.hosts import Hosts, unavailable

    print(f"\n== a {args.mb} MB key, push+pull, {args.iters} round trips (MB/s, both directions counted), "
          f"and the Trainer step ({TRAINER_MODEL} model, overlap, 1 worker, ms)")
    why = unavailable()
    if why:
        print(f"shaped link: skipped ({why})")
        return {"skipped": why}
    sys.path.insert(0, str(REPO / "benchmarks"))
    import rates

    loop = rates.launch_rate(str(REPO / "benchmarks" / "auth_cost.py"), "loopback", {"KVSTORE_SHM": "0"},
                             args.mb, args.iters)
    loop_step = loopback_step(args.step_iters)
    print(f"{'loopback, 127.0.0.1, TCP (KVSTORE_SHM=0)':<58} {loop:>8.0f} MB/s  1.00x  "
          f"step {loop_step:>7.1f} ms  1.00x", flush=True)
    out: dict[str, Any] = {"loopback_MBps": loop, "loopback_step_ms": loop_step}
    with Hosts(2) as made:
        raw = raw_rate(made[0], made[1], 512)
        out["veth_raw_MBps"] = raw
        print(f"{'raw TCP stream host 1 -> host 0 (the veth unshaped)':<58} {raw:>8.0f} MB/s", flush=True)
        relay_to_server(made, 100e-6)  # on host 1 from now on; only the relayed runs connect to it
        direct, relayed = round_trip_us(made, False), round_trip_us(made, True)
        out.update(direct_rtt_us=direct, relay_rtt_us=relayed)
        print(f"{'1-byte round trip, direct / through the relay (100 us each way)':<58} {direct:>8.0f} us  "
              f"{relayed:>6.0f} us", flush=True)
        half = raw * 8 / 2
        runs = (("unshaped", None, False), ("shaped", half, False), ("shaped_relay", half, True),
                ("shaped_1gbit", 1000, False))
        for label, mbit, through in runs:
            if mbit is not None:
                made.link(made[0], made[1]).rate(round(mbit))
            rate = hosts_rate(made, args.mb, args.iters, through)
            out[f"{label}_MBps"] = rate
            shaped = f" (htb {round(mbit)} Mbit/s each way)" if mbit else ""
            what = f"2 hosts, {label.split('_')[0]}{shaped}{' + relay 100 us' if through else ''}"
            line = f"{what:<58} {rate:>8.0f} MB/s  {rate / loop:.2f}x"
            if label in ("shaped", "shaped_relay"):
                step = step_ms(hosts_job(made, trainer_argv(args.step_iters), through))
                out[f"{label}_step_ms"] = step
                line += f"  step {step:>7.1f} ms  {step / loop_step:.2f}x"
            print(line, flush=True)
    return out


# -- the figure ----------------------------------------------------------------------------------------

def draw(run: dict[str, Any], source: str, out: Path) -> None:
    """Two panels of a ``--json`` run into ``out`` (PNG; needs matplotlib): the light workers' figures
    against W, and the simulated scheduler's answered beats and reply latency against offered beats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (grow, sched) = plt.subplots(1, 2, figsize=(13, 4.6), constrained_layout=True)
    fig.suptitle(f"kvstore at scale on 2 CPU cores, no GPU ({source})", fontsize=11)
    rows = run.get("cluster", [])
    ws = [r["W"] for r in rows]
    for key, label in (("barrier_p50_ms", "barrier p50, ms"), ("round_p50_ms", "one-key round p50, ms"),
                       ("rendezvous_s", "rendezvous, s"),
                       ("sched_cpu_us_per_beat", "scheduler us / heartbeat")):
        grow.plot(ws, [r[key] for r in rows], marker="o", label=label)
    if ws:
        grow.plot(ws, [rows[0]["barrier_p50_ms"] * w / ws[0] for w in ws], color="#999999", linestyle=":",
                  label="linear in W from W=4's barrier")
    grow.set(xscale="log", yscale="log", xticks=ws, xticklabels=[str(w) for w in ws], xlabel="workers W",
             title="light workers, 1 server (all on 2 cores)")
    grow.legend(fontsize=8)
    top = [r for r in run.get("scheduler", []) if r["nodes"] == max(x["nodes"] for x in run["scheduler"])]
    offered = [r["offered_per_s"] for r in top]
    sched.plot(offered, [r["answered_per_s"] for r in top], marker="o", label="answered beats/s")
    sched.plot(offered, offered, color="#999999", linestyle=":", label="offered")
    sched.set(xscale="log", yscale="log", xlabel="offered heartbeats/s", ylabel="beats/s",
              title=f"the scheduler alone, {top[0]['nodes'] if top else 0} simulated nodes")
    latency = sched.twinx()
    latency.plot(offered, [r["p99_ms"] for r in top], marker="s", color="#d62728", label="reply p99, ms")
    latency.set(yscale="log", ylabel="reply p99, ms")
    sched.legend(fontsize=8, loc="upper left")
    latency.legend(fontsize=8, loc="lower right")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


# -- main ---------------------------------------------------------------------------------------------

def numbers(text: str, kind: Any = int) -> list:
    """A comma-separated list of numbers of ``kind``."""
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> None:
    """Run the parts asked for; print each table; write ``--json`` with every row."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=numbers, default=[4, 16, 64, 128],
                        help="W values (the first is the baseline)")
    parser.add_argument("--barriers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--idle", type=float, default=10.0, help="the heartbeat-only window, s")
    parser.add_argument("--nodes", type=numbers, default=[100, 250, 500, 1000])
    parser.add_argument("--intervals", type=lambda t: numbers(t, float), default=[0.5, 0.25, 0.1, 0.05],
                        help="shorter heartbeat intervals driven at the largest node count")
    parser.add_argument("--window", type=float, default=5.0, help="each simulated window, s")
    parser.add_argument("--mb", type=int, default=64, help="the shaped link's key, MB")
    parser.add_argument("--iters", type=int, default=5, help="push+pull round trips per link rate")
    parser.add_argument("--step-iters", type=int, default=5, help="Trainer steps per timed block (2 blocks)")
    parser.add_argument("--parts", default="cluster,scheduler,link")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, metavar="JSON",
                        help="draw a --json run's figure into --out instead of measuring")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "scale.png")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rate-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.barriers, args.rounds, args.idle)
        return
    if args.rate_worker:
        rate_worker(args.mb, args.iters)
        return
    if args.plot:
        draw(json.loads(args.plot.read_text()), args.plot.name, args.out)
        return
    parts = set(args.parts.split(","))
    print(f"scale.py, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} CPU cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    out: dict[str, Any] = {}
    if "cluster" in parts:
        out["cluster"] = part_cluster(args)
    if "scheduler" in parts:
        out["scheduler"] = part_scheduler(args)
    if "link" in parts:
        out["link"] = part_link(args)
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

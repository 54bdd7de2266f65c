"""Pipeline benchmark (issue 29): K = 2 stages, M micro-batches, per schedule, against one process and
against torch.distributed.pipelining (gloo, CPU) on the same model, stages and micro-batches.

    python benchmarks/pipeline.py [--chunks 1,2,4,8] [--iters 6] [--width 1024] [--batch 64] [--rounds 2]

Every process runs ``torch.set_num_threads(1)`` (and ``OMP_NUM_THREADS=1``): 2 stage processes
against 1 process on this 2-core machine.  The model: 8 Linear(width, width) layers with Tanh,
4 per stage.  Reported per (schedule, M): the mean step ms (best of the timed steps, after 2
warm-up steps), the bubble fraction measured as 1 - busy / step time per stage (busy: the
step's time outside waits for a neighbour) against the schedule's theoretical one (``theory``:
``schedule.bubble``, (K-1)/(Mv+K-1) for M >= K, v = 2 parts per stage under 'interleaved', 1 for the
others; it assumes every part costs the same and messages are free), the peak activation memory
per stage measured in the last timed step (``Pipeline.peak_saved_bytes``: the most bytes autograd
held for the stage's backwards at once, counted by saved-tensor hooks, weights not counted), and
``x1proc`` (one process's step ms, measured by stage 0 just before the row, / ours: > 1 is a
speed-up), ``x1proc/M`` (the same against one process running the batch as the row's M
micro-batches in turn: what micro-batches of this size cost without a pipeline) and ``/torch``
(ours / torch's step ms: <= 1 meets the target).  'pipedream' has no torch counterpart.
``cpu ms/stage`` is each stage process's CPU time in its least costly step (every thread: zmq's
I/O thread too) against ``1proc cpu``, one process's: unlike wall time it hardly changes with
the other engineers' load, so it shows what the pipeline costs in work.
``--rounds`` runs ours then torch's that many times and keeps each row's fastest round (the
shared machine's load comes and goes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCHEDULES = ("gpipe", "1f1b", "interleaved", "pipedream")
VIRTUAL = {"interleaved": 2}  # parts per stage: 'interleaved' cuts the 16 layers into 4 parts of 4


def model(width: int) -> Any:
    """8 Linear layers with Tanh, seeded."""
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def data(width: int, batch: int) -> tuple[Any, Any]:
    """A fixed random batch."""
    import torch

    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)


def one_process(width: int, batch: int, iters: int, chunks: int = 1) -> tuple[float, float]:
    """Best step ms of the whole model in this process (forward, backward, SGD), the batch run as
    ``chunks`` micro-batches one after the other (gradients accumulated) when chunks > 1; and the
    least CPU ms (this process's, every thread) a step took."""
    import torch

    torch.set_num_threads(1)
    net, (x, y) = model(width), data(width, batch)
    opt = torch.optim.SGD(net.parameters(), lr=0.001)
    best = cpu = float("inf")
    for i in range(iters + 2):
        start, cpu_start = time.perf_counter(), time.process_time()
        opt.zero_grad()
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            torch.nn.functional.mse_loss(net(xs), ys).backward()
        opt.step()
        if i >= 2:
            best = min(best, time.perf_counter() - start)
            cpu = min(cpu, time.process_time() - cpu_start)
    return best * 1e3, cpu * 1e3


def worker(args: argparse.Namespace) -> None:
    """Under launch.py -n 2: time each schedule and M on this stage; print RESULT lines."""
    import torch

    import kvstore

    torch.set_num_threads(1)
    with kvstore.create("dist_sync") as kv:
        for schedule in SCHEDULES:
            for m in [int(c) for c in args.chunks.split(",")]:
                # the baselines just before each row, on the same machine state (stage 1 waits meanwhile)
                base = baselines(args, m) if kv.rank == 0 else dict.fromkeys(("base", "base_cpu", "same"))
                print("RESULT " + json.dumps({**time_stage(kv, args, schedule, m), **base}), flush=True)


def baselines(args: argparse.Namespace, m: int) -> dict[str, float]:
    """One process's best step ms and CPU ms on the whole batch, and its step ms on m micro-batches."""
    base, base_cpu = one_process(args.width, args.batch, args.iters)
    same = one_process(args.width, args.batch, args.iters, m)[0]
    return {"base": base, "base_cpu": base_cpu, "same": same}


def time_stage(kv: Any, args: argparse.Namespace, schedule: str, m: int) -> dict[str, Any]:
    """This stage's best step of ``schedule`` with ``m`` micro-batches: its ms, the share of it spent
    waiting for a neighbour, the micro-batches held, and the measured peak of saved activations."""
    import torch

    from kvstore.pipeline import Pipeline

    x, y = data(args.width, args.batch)
    sgd = (lambda ps: torch.optim.SGD(ps, lr=0.001)) if schedule == "pipedream" else None
    virtual = VIRTUAL.get(schedule, 1)
    pipe = Pipeline(model(args.width), stages=2, chunks=m, schedule=schedule, checkpoint="never", kv=kv,
                    optimizer=sgd, balance=[16 // (2 * virtual)] * (2 * virtual), virtual=virtual)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.001)
    waited = [0.0]
    receive = pipe.link.receive

    def timed_receive(*a: Any) -> Any:
        start = time.perf_counter()
        try:
            return receive(*a)
        finally:
            waited[0] += time.perf_counter() - start

    pipe.link.receive = timed_receive
    best, cpu = (float("inf"), 0.0), float("inf")
    try:
        for i in range(args.iters + 2):
            kv.barrier()
            waited[0], start, cpu_start = 0.0, time.perf_counter(), time.process_time()
            opt.zero_grad()
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
            if schedule != "pipedream":
                opt.step()
            took = time.perf_counter() - start
            if i >= 2:
                best = min(best, (took, waited[0]))
                cpu = min(cpu, time.process_time() - cpu_start)
    finally:
        pipe.close()
    return {"schedule": schedule, "m": m, "stage": pipe.stage, "ms": best[0] * 1e3,
            "bubble": best[1] / best[0], "held": pipe.max_held, "act_kib": pipe.peak_saved_bytes / 2**10,
            "cpu": cpu * 1e3}


def ours(args: argparse.Namespace) -> dict[tuple[str, int], list[dict]]:
    """Launch 2 workers and a server; their RESULT lines by (schedule, M)."""
    argv = [sys.executable, "launch.py", "-n", "2", "-s", "1", __file__, "--worker", "--chunks", args.chunks,
            "--iters", str(args.iters), "--width", str(args.width), "--batch", str(args.batch)]
    env = {**os.environ, "KVSTORE_REQUEST_TIMEOUT": "600", "OMP_NUM_THREADS": "1"}
    env.pop("KVSTORE_SECRET", None)
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    found: dict[tuple[str, int], list[dict]] = {}
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            item = json.loads(line.split("RESULT ", 1)[1])
            found.setdefault((item["schedule"], item["m"]), []).append(item)
    return found


def _torch_rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One stage of torch.distributed.pipelining over gloo: each schedule's best step ms per M."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    try:
        x, y = data(args.width, args.batch)
        for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
            for m in [int(c) for c in args.chunks.split(",")]:
                try:
                    results[f"{name}/{m}"] = _torch_time(rank, cls, m, x, y, args)
                except Exception as exc:  # noqa: BLE001 - reported as the figure
                    results[f"{name}/{m}"] = f"{type(exc).__name__}: {exc}"[:200]
                dist.barrier()
    finally:
        Path(f"{out}.{rank}").write_text(json.dumps(results))
        dist.destroy_process_group()


def _torch_time(rank: int, cls: Any, m: int, x: Any, y: Any, args: argparse.Namespace) -> float:
    """Best step ms of torch's schedule ``cls`` with ``m`` micro-batches on this rank's stage."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    layers = list(model(args.width))
    sub = torch.nn.Sequential(*layers[:8] if rank == 0 else layers[8:])
    stage = PipelineStage(sub, rank, 2, torch.device("cpu"))
    sched = cls(stage, n_microbatches=m, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(sub.parameters(), lr=0.001)
    best = float("inf")
    for i in range(args.iters + 2):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        sched.step(x) if rank == 0 else sched.step(target=y)
        opt.step()
        if i >= 2:
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def theirs(args: argparse.Namespace) -> dict[str, Any]:
    """torch.distributed.pipelining's results by 'schedule/M' (the mean of the 2 ranks' ms)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="pp-") as tmp:
        out = os.path.join(tmp, "rank")
        ctx = mp.spawn(_torch_rank, args=(port, args, out), nprocs=2, join=False)
        deadline = time.monotonic() + args.torch_timeout
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                    proc.join()
                return {"error": f"no result within {args.torch_timeout} s (hung)"}
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    return {k: (sum(r[k] for r in ranks) / 2 if all(isinstance(r[k], float) for r in ranks) else ranks[0][k])
            for k in ranks[0]}


def best_rounds(rounds: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Per (schedule, M), the round whose step was fastest (its stages' items, baseline the best of all
    rounds); per torch key, the fastest round's figure."""
    mine: dict[tuple[str, int], list[dict]] = {}
    for ours_, _ in rounds:
        for key, items in ours_.items():
            first = {name: min(i[name] for i in items + mine.get(key, []) if i[name])
                     for name in ("base", "base_cpu", "same")}
            if key not in mine or _mean_ms(items) < _mean_ms(mine[key]):
                mine[key] = items
            mine[key] = [{**i, **(first if i["stage"] == 0 else dict.fromkeys(first))} for i in mine[key]]
    theirs_: dict[str, Any] = {}
    for _, torch_ in rounds:
        for key, value in torch_.items():
            old = theirs_.get(key)
            faster = isinstance(value, float) and (not isinstance(old, float) or value < old)
            theirs_[key] = value if faster or old is None else old
    return mine, theirs_


def _mean_ms(items: list[dict]) -> float:
    return sum(i["ms"] for i in items) / len(items)


def report(args: argparse.Namespace, mine: dict, torch_: dict) -> None:
    """Print the table."""
    from kvstore.pipeline.schedule import bubble as plan_bubble

    bases = [i["base"] for items in mine.values() for i in items if i["base"]]
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"one process: {min(bases):.1f} to {max(bases):.1f} ms/step, measured before each row (K = 2, "
          f"width {args.width}, batch {args.batch}, best of {args.rounds} rounds; load average {load})")
    print(f"{'schedule':11} {'M':>2} {'ms':>7} {'1proc ms':>8} {'1proc/M':>7} {'bubble':>11} "
          f"{'theory':>6} {'act KiB/stage':>14} {'x1proc':>6} {'x1proc/M':>8} {'torch ms':>9} "
          f"{'/torch':>6} {'cpu ms/stage':>12} {'1proc cpu':>9}")
    for (schedule, m), items in sorted(mine.items()):
        ms, base = _mean_ms(items), next(i["base"] for i in items if i["base"])
        same, base_cpu = next((i["same"], i["base_cpu"]) for i in items if i["same"])
        cpus = "/".join(f"{i['cpu']:.1f}" for i in sorted(items, key=lambda i: i["stage"]))
        by_stage = sorted(items, key=lambda i: i["stage"])
        bubbles = "/".join(f"{i['bubble']:.2f}" for i in by_stage)
        acts = "/".join(f"{i['act_kib']:.0f}" for i in by_stage)
        other = torch_.get(f"{schedule}/{m}")
        tms = f"{other:9.1f} {ms / other:6.2f}" if isinstance(other, float) else f"{'n/a':>9} {'':>6}"
        theory = plan_bubble(schedule, 2, m, VIRTUAL.get(schedule, 1))
        print(f"{schedule:11} {m:2d} {ms:7.1f} {base:8.1f} {same:7.1f} {bubbles:>11} {theory:6.2f} "
              f"{acts:>14} {base / ms:6.2f} {same / ms:8.2f} {tms} {cpus:>12} {base_cpu:9.1f}")
    for key, value in torch_.items():
        if not isinstance(value, float):
            print(f"torch {key}: {value}")


BALANCE_RULES = ("parameters", "time")  # the cut by parameter count, then by measured forward+backward time


def balance_model(width: int, hidden: int, longs: int, wides: int) -> list[Any]:
    """The balance part's layers, as factories on (batch, tokens, width) tensors: ``wides`` wide MLPs
    (width -> hidden -> width) applied to the first token only and added to every token (many parameters,
    little compute), then ``longs`` Linear(width, width) applied to every token (few parameters, much
    compute)."""
    import torch

    from kvstore.pipeline import LayerSpec

    class Wide(torch.nn.Module):
        """``x + mlp(x[:, 0])``: a wide layer whose compute does not grow with the tokens."""

        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.tanh(self.up(x[:, 0])))[:, None, :]

    return [LayerSpec(Wide)] * wides + [LayerSpec(torch.nn.Linear, width, width) for _ in range(longs)]


def balance_worker(args: argparse.Namespace) -> None:
    """Under launch.py -n K: cut the balance model by each rule (every rank alike: ``profile.choose`` for
    'parameters'; for 'time', what ``choose('time', ...)`` does, ``balance_by_weight`` of the costs
    ``agreed_costs`` measured, kept to be reported), run
    ``--rounds`` x ``--iters`` timed steps through a K-stage Pipeline per rule (the rules alternate by
    round), and print each rule's RESULT line for this stage: the median over those steps of its
    forward+backward ms per step, as wall time outside the waits for a neighbour and as the main thread's
    CPU time (the median, as the profile takes each layer's), and the profile's ms for the stage's
    layers."""
    import torch

    import kvstore
    from kvstore.pipeline import Pipeline
    from kvstore.pipeline.profile import SLACK, agreed_costs, choose
    from kvstore.pipeline.schedule import balance_by_weight

    torch.set_num_threads(1)
    timer = time.thread_time if args.balance_timer == "cpu" else time.perf_counter
    gen = torch.Generator().manual_seed(1)
    shape = (args.balance_batch, args.balance_tokens, args.balance_width)
    x, y = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    sample = x[:-(-args.balance_batch // args.balance_chunks)]  # the first micro-batch
    entries = balance_model(args.balance_width, args.balance_hidden, args.balance_longs, args.balance_wides)
    with kvstore.create("dist_sync") as kv:
        stages = kv.num_workers
        costs = agreed_costs(kv, entries, sample, "time", repeats=args.balance_repeats, timer=timer)
        cuts = {"parameters": choose("parameters", entries, stages, kv, sample),
                "time": balance_by_weight(costs, stages, slack=SLACK)}
        found: dict[str, dict[str, list[float]]] = {rule: {} for rule in cuts}
        for _ in range(args.rounds):
            for rule, balance in cuts.items():
                pipe = Pipeline(entries, stages=stages, balance=balance, chunks=args.balance_chunks,
                                checkpoint="never", kv=kv)
                for name, values in _balance_steps(kv, pipe, x, y, args.iters).items():
                    found[rule].setdefault(name, []).extend(values)
        for rule, balance in cuts.items():
            median = {name: statistics.median(values) for name, values in found[rule].items()}
            stage = kv.rank % stages
            offset = sum(balance[:stage])
            print("RESULT " + json.dumps({
                "rule": rule, "stages": stages, "stage": stage, "balance": balance, **median,
                "profile": sum(costs[offset:offset + balance[stage]]) * 1e3 * args.balance_chunks,
                "long": costs[-1] * 1e3, "wide": costs[1] * 1e3}), flush=True)


def _balance_steps(kv: Any, pipe: Any, x: Any, y: Any, iters: int) -> dict[str, list[float]]:
    """The stage's busy ms in each of ``iters`` steps after 2 warm-up ones, as wall time (a step's time
    less its waits for a neighbour) and as the main thread's CPU time, and each step's ms."""
    import torch

    waited = [0.0]
    receive = pipe.link.receive

    def timed_receive(*a: Any) -> Any:
        start = time.perf_counter()
        try:
            return receive(*a)
        finally:
            waited[0] += time.perf_counter() - start

    pipe.link.receive = timed_receive
    found: dict[str, list[float]] = {"busy": [], "cpu": [], "step": []}
    try:
        for i in range(iters + 2):
            kv.barrier()
            pipe.module.zero_grad()
            waited[0], start, cpu_start = 0.0, time.perf_counter(), time.thread_time()
            pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, torch.nn.functional.mse_loss)
            took, used = time.perf_counter() - start, time.thread_time() - cpu_start
            if i >= 2:
                for name, value in (("busy", took - waited[0]), ("cpu", used), ("step", took)):
                    found[name].append(value * 1e3)
    finally:
        pipe.close()
    return found


def balance_part(args: argparse.Namespace) -> None:
    """Launch K stage processes (and a server) per K of ``--balance-stages``; print each rule's balance and
    each stage's measured forward+backward ms per step (wall and CPU), with max/min."""
    width, hidden = args.balance_width, args.balance_hidden
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"balance by measured cost: {args.balance_wides} MLPs {width} -> {hidden} -> {width} on the first "
          f"token, then {args.balance_longs} Linear({width}, {width}) over {args.balance_tokens} tokens; "
          f"batch {args.balance_batch} as {args.balance_chunks} micro-batch(es), gpipe; "
          f"each stage's median of {args.rounds} rounds x {args.iters} steps; profile: median of "
          f"{args.balance_repeats} runs per layer on {args.balance_timer} time (load average {load})")
    print(f"{'K':>2} {'rule':10} {'balance':15} {'wall ms per stage':27} {'max/min':>7} "
          f"{'CPU ms per stage':27} {'max/min':>7} {'profile ms per stage':26} {'step ms':>7}")
    knobs = ("width", "hidden", "tokens", "batch", "chunks", "longs", "wides", "repeats", "timer")
    for stages in [int(k) for k in args.balance_stages.split(",")]:
        argv = [sys.executable, "launch.py", "-n", str(stages), "-s", "1", __file__, "--balance-worker",
                "--iters", str(args.iters), "--rounds", str(args.rounds),
                *(f"--balance-{k}={vars(args)['balance_' + k]}" for k in knobs)]
        env = {**os.environ, "KVSTORE_REQUEST_TIMEOUT": "600", "OMP_NUM_THREADS": "1"}
        env.pop("KVSTORE_SECRET", None)
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        lines = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line]
        items = [json.loads(line) for line in lines]
        for rule in BALANCE_RULES:
            rows = sorted((i for i in items if i["rule"] == rule), key=lambda i: i["stage"])
            wall, cpu = [i["busy"] for i in rows], [i["cpu"] for i in rows]
            profile = [i["profile"] for i in rows]
            cells = [" / ".join(f"{v:.1f}" for v in values) for values in (wall, cpu, profile)]
            step, cut = max(i["step"] for i in rows), str(rows[0]["balance"])
            print(f"{stages:2d} {rule:10} {cut:15} {cells[0]:27} {max(wall) / min(wall):7.2f} "
                  f"{cells[1]:27} {max(cpu) / min(cpu):7.2f} {cells[2]:26} {step:7.1f}")
        long, wide = items[0]["long"], items[0]["wide"]
        print(f"   profiled ms per layer: Linear over the tokens {long:.2f}, wide MLP {wide:.2f} "
              f"({long / wide:.1f}:1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="ours then torch's, this many times")
    parser.add_argument("--torch-timeout", type=float, default=120)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--balance", action="store_true",
                        help="run the balance part instead: stages cut by parameter count and by time")
    parser.add_argument("--balance-stages", default="2,4", help="K values of the balance part")
    parser.add_argument("--balance-width", type=int, default=512)
    parser.add_argument("--balance-hidden", type=int, default=1024, help="the wide MLPs' hidden width")
    parser.add_argument("--balance-tokens", type=int, default=96)
    parser.add_argument("--balance-batch", type=int, default=16)
    parser.add_argument("--balance-chunks", type=int, default=1)
    parser.add_argument("--balance-longs", type=int, default=8, help="Linear layers over every token")
    parser.add_argument("--balance-wides", type=int, default=64, help="wide MLPs on the first token")
    parser.add_argument("--balance-repeats", type=int, default=15, help="profiled runs per layer")
    parser.add_argument("--balance-timer", choices=("cpu", "wall"), default="cpu",
                        help="the profile's clock: this thread's CPU time (load hardly moves it), or wall")
    parser.add_argument("--balance-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.balance_worker:
        return balance_worker(args)
    if args.balance:
        return balance_part(args)
    report(args, *best_rounds([(ours(args), theirs(args)) for _ in range(args.rounds)]))


if __name__ == "__main__":
    main()

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

``--lm`` times the language model of examples/pipeline_lm.py instead (``--lm-d-model``, ``--lm-blocks``,
``--lm-context``, ``--lm-batch`` windows), 2 stages cut in half, 1F1B, per M: ours (``pipe.step``, then a
Trainer with SGD in the worker: the store sums each stage's gradients, the tied embedding's over the two
stages that hold it) against torch.distributed.pipelining's Schedule1F1B on the same model and cut, whose
stages each hold a copy of the embedding (it has no weights tied across stages): the benchmark sums the
copies' gradients by hand, a ``dist.all_reduce`` over gloo between the two stages, before SGD.

    python benchmarks/pipeline.py --lm [--chunks 2,4,8] [--iters 6] [--rounds 3]

``--balance`` cuts a model whose layers' parameters and compute disagree (wide MLPs, then Linear layers
over every token) into 2 and 4 stages by parameter count and by measured time (``balance='time'``'s
profile) and prints each stage's measured forward+backward per step and max/min:

    python benchmarks/pipeline.py --balance [--iters 6] [--rounds 3] [--balance-repeats 25]
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


def time_waits(pipe: Any) -> list[float]:
    """Make ``pipe``'s link add the seconds each receive waits to the returned cell (reset it per step)."""
    waited = [0.0]
    receive = pipe.link.receive

    def timed_receive(*a: Any) -> Any:
        start = time.perf_counter()
        try:
            return receive(*a)
        finally:
            waited[0] += time.perf_counter() - start

    pipe.link.receive = timed_receive
    return waited


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
    waited = time_waits(pipe)
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


def _torch_ranks(target: Any, args: argparse.Namespace, prefix: str) -> list[dict] | str:
    """Run ``target(rank, port, args, out)`` on 2 spawned processes (torch.distributed over gloo on a free
    port; each writes its JSON to ``out.<rank>``): each rank's results, or why there are none."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = os.path.join(tmp, "rank")
        ctx = mp.spawn(target, args=(port, args, out), nprocs=2, join=False)
        deadline = time.monotonic() + args.torch_timeout
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                    proc.join()
                return f"no result within {args.torch_timeout} s (hung)"
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


def theirs(args: argparse.Namespace) -> dict[str, Any]:
    """torch.distributed.pipelining's results by 'schedule/M' (the mean of the 2 ranks' ms)."""
    ranks = _torch_ranks(_torch_rank, args, "pp-")
    if isinstance(ranks, str):
        return {"error": ranks}
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

    waited = time_waits(pipe)
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


# ------------------------------------------------------------------------------- the language model (--lm)

def lm_example() -> Any:
    """examples/pipeline_lm.py as a module: its model is the one timed (the examples folder is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pipeline_lm", REPO / "examples" / "pipeline_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lm_layers(args: argparse.Namespace) -> list[Any]:
    """The example's layer factories at its default size (d_model 128, 4 blocks, 4 heads, context 64)."""
    return lm_example().layers(args.lm_d_model, args.lm_blocks, 4, args.lm_context)


def lm_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """A fixed batch of random byte windows: inputs (batch, context) and targets shifted by one."""
    import torch

    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 256, (args.lm_batch, args.lm_context + 1), generator=gen)
    return windows[:, :-1], windows[:, 1:]


def lm_cut(n: int) -> list[int]:
    """Layers per stage for both pipelines: the first half of the layers on stage 0."""
    return [n // 2, n - n // 2]


def lm_one_process(args: argparse.Namespace, chunks: int) -> tuple[float, float]:
    """Best step ms and least CPU ms of the whole model in this process (forward and backward of the batch as
    ``chunks`` micro-batches in turn, then SGD; the tied weight is one tensor here)."""
    import torch

    from kvstore.pipeline import build

    torch.set_num_threads(1)
    lm, (x, y) = lm_example(), lm_data(args)
    net = build(lm_layers(args), 0)
    opt = torch.optim.SGD(net.parameters(), lr=0.001)
    best = cpu = float("inf")
    for i in range(args.iters + 2):
        start, cpu_start = time.perf_counter(), time.process_time()
        opt.zero_grad()
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (lm.lm_loss(net(xs), ys) * len(xs) / len(x)).backward()
        opt.step()
        if i >= 2:
            best = min(best, time.perf_counter() - start)
            cpu = min(cpu, time.process_time() - cpu_start)
    return best * 1e3, cpu * 1e3


def lm_worker(args: argparse.Namespace) -> None:
    """Under launch.py -n 2: time the language model's 1F1B step on this stage for each M; print LMRESULT
    lines (stage 0 adds one process's figures, measured just before each row)."""
    import torch

    import kvstore
    from kvstore.pipeline import Pipeline
    from kvstore.trainer import Trainer

    torch.set_num_threads(1)
    lm, (x, y) = lm_example(), lm_data(args)
    with kvstore.create("dist_sync") as kv:
        for m in [int(c) for c in args.chunks.split(",")]:
            base = dict(zip(("base", "base_cpu"), lm_one_process(args, m))) if kv.rank == 0 else {}
            layers = lm_layers(args)
            pipe = Pipeline(layers, stages=2, balance=lm_cut(len(layers)), chunks=m, schedule="1f1b",
                            checkpoint="never", kv=kv, seed=0)
            # the optimizer in the worker, as torch's side has it; the store sums the stage's gradients
            # (the tied weight's over the two stages that hold it)
            trainer = Trainer(pipe, "sgd", {"learning_rate": 0.001}, update_on_kvstore=False,
                              key_prefix=f"m{m}.")  # each M's Pipeline its own keys
            best = {"pipe": float("inf"), "step": float("inf"), "cpu": float("inf")}
            try:
                for i in range(args.iters + 2):
                    kv.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    pipe.module.zero_grad()
                    pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, lm.lm_loss)
                    piped = time.perf_counter()
                    trainer.step(1)
                    if i >= 2:
                        best["pipe"] = min(best["pipe"], piped - start)
                        best["step"] = min(best["step"], time.perf_counter() - start)
                        best["cpu"] = min(best["cpu"], time.process_time() - cpu_start)
            finally:
                pipe.close()
            ms = {k: v * 1e3 for k, v in best.items()}
            print("LMRESULT " + json.dumps({"m": m, "stage": pipe.stage, **ms, **base}), flush=True)


def lm_ours(args: argparse.Namespace) -> dict[int, list[dict]]:
    """Launch 2 workers and a server running :func:`lm_worker`; their LMRESULT lines by M."""
    argv = [sys.executable, "launch.py", "-n", "2", "-s", "1", __file__, "--worker", "--lm", *lm_argv(args)]
    env = {**os.environ, "KVSTORE_REQUEST_TIMEOUT": "600", "OMP_NUM_THREADS": "1"}
    env.pop("KVSTORE_SECRET", None)
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    found: dict[int, list[dict]] = {}
    for line in done.stdout.splitlines():
        if "LMRESULT " in line:
            item = json.loads(line.split("LMRESULT ", 1)[1])
            found.setdefault(item["m"], []).append(item)
    return found


def lm_argv(args: argparse.Namespace) -> list[str]:
    """The language model's options, passed on to the launched workers."""
    return ["--chunks", args.chunks, "--iters", str(args.iters), "--lm-batch", str(args.lm_batch),
            "--lm-d-model", str(args.lm_d_model), "--lm-blocks", str(args.lm_blocks),
            "--lm-context", str(args.lm_context)]


def _lm_torch_rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One stage of the language model under torch.distributed.pipelining's 1F1B over gloo, for each M."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results: dict[str, Any] = {}
    try:
        for m in [int(c) for c in args.chunks.split(",")]:
            try:
                results[str(m)] = _lm_torch_time(rank, m, args)
            except Exception as exc:  # noqa: BLE001 - reported as the figure
                results[str(m)] = f"{type(exc).__name__}: {exc}"[:200]
            dist.barrier()
    finally:
        Path(f"{out}.{rank}").write_text(json.dumps(results))
        dist.destroy_process_group()


def _lm_torch_time(rank: int, m: int, args: argparse.Namespace) -> dict[str, float]:
    """Best ms of torch's 1F1B step with ``m`` micro-batches on this rank's stage: the schedule alone
    (``pipe``), and with the tied weight's gradient summed and SGD applied (``step``); least CPU ms.
    torch's pipelining has no weights tied across stages: each rank holds a copy of the embedding, and
    its gradient is summed by hand, an ``all_reduce`` over gloo between the two stages."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from kvstore.pipeline import build

    lm, (x, y) = lm_example(), lm_data(args)
    whole = list(build(lm_layers(args), 0))
    cut = lm_cut(len(whole))[0]
    sub = torch.nn.Sequential(*whole[:cut] if rank == 0 else whole[cut:])
    tied = (whole[0] if rank == 0 else whole[-1]).module.weight  # the embedding, this rank's copy
    stage = PipelineStage(sub, rank, 2, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lm.lm_loss)
    opt = torch.optim.SGD(sub.parameters(), lr=0.001)
    best = {"pipe": float("inf"), "step": float("inf"), "cpu": float("inf")}
    for i in range(args.iters + 2):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        opt.zero_grad()
        sched.step(x) if rank == 0 else sched.step(target=y)
        piped = time.perf_counter()
        dist.all_reduce(tied.grad)  # the tied weight's two gradients summed, by hand
        opt.step()
        if i >= 2:
            best["pipe"] = min(best["pipe"], piped - start)
            best["step"] = min(best["step"], time.perf_counter() - start)
            best["cpu"] = min(best["cpu"], time.process_time() - cpu_start)
    return {k: v * 1e3 for k, v in best.items()}


def lm_theirs(args: argparse.Namespace) -> dict[str, Any]:
    """torch.distributed.pipelining's figures by M: each rank's ``pipe``, ``step`` and ``cpu`` ms."""
    ranks = _torch_ranks(_lm_torch_rank, args, "pp-lm-")
    if isinstance(ranks, str):
        return {"error": ranks}
    return {m: [r[m] for r in ranks] if all(isinstance(r[m], dict) for r in ranks) else ranks[0][m]
            for m in ranks[0]}


def lm_best(rounds: list[tuple[dict, dict]]) -> tuple[dict[int, list[dict]], dict[str, Any]]:
    """Per M, ours and torch's fastest round (by the mean of the stages' step ms), with one process's best
    figures over every round on ours' stage 0."""
    mine: dict[int, list[dict]] = {}
    bases: dict[int, dict[str, float]] = {}
    theirs_: dict[str, Any] = {}
    for ours_, torch_ in rounds:
        for m, items in ours_.items():
            if m not in mine or _lm_ms(items) < _lm_ms(mine[m]):
                mine[m] = items
            seen = bases.setdefault(m, {})
            for name in ("base", "base_cpu"):
                best = min(i[name] for i in items if name in i)
                seen[name] = min(best, seen.get(name, best))
        for m, value in torch_.items():
            old = theirs_.get(m)
            if not isinstance(old, list) or (isinstance(value, list) and _lm_ms(value) < _lm_ms(old)):
                theirs_[m] = value
    return {m: [{**i, **bases[m]} for i in items] for m, items in mine.items()}, theirs_


def _lm_ms(items: list[dict], name: str = "step") -> float:
    return sum(i[name] for i in items) / len(items)


def lm_report(args: argparse.Namespace, mine: dict[int, list[dict]], torch_: dict[str, Any]) -> None:
    """Print the language model's table: per M, ours and torch's step (and schedule-only) ms per stage."""
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"language model (examples/pipeline_lm.py: d_model {args.lm_d_model}, {args.lm_blocks} blocks, "
          f"context {args.lm_context}, tied embedding), batch {args.lm_batch} windows, K = 2 stages "
          f"{lm_cut(args.lm_blocks + 4)}, 1F1B, best of {args.rounds} rounds; load average {load}")
    print("ours: pipe.step, then a Trainer (SGD in the worker) sums each stage's gradients through the "
          "store, the tied weight's over both stages;")
    print("torch: Schedule1F1B.step, then all_reduce of the tied weight's gradient over gloo (by hand: no "
          "tied weights across stages there), then SGD; ms are the mean of the 2 stages")
    print(f"{'M':>2} {'ours ms':>8} {'pipe only':>9} {'torch ms':>9} {'sched only':>10} {'/torch':>6} "
          f"{'1proc ms':>8} {'x1proc':>6} {'cpu ms/stage':>13} {'torch cpu':>13} {'1proc cpu':>9}")
    for m, items in sorted(mine.items()):
        step, piped = _lm_ms(items), _lm_ms(items, "pipe")
        cpus = "/".join(f"{i['cpu']:.0f}" for i in sorted(items, key=lambda i: i["stage"]))
        base, base_cpu = items[0]["base"], items[0]["base_cpu"]
        other = torch_.get(str(m))
        if isinstance(other, list):
            theirs_ = (f"{_lm_ms(other):9.1f} {_lm_ms(other, 'pipe'):10.1f} {step / _lm_ms(other):6.2f}",
                       "/".join(f"{r['cpu']:.0f}" for r in other))
        else:
            theirs_ = (f"{'n/a':>9} {'':>10} {'':>6}", "")
        print(f"{m:2d} {step:8.1f} {piped:9.1f} {theirs_[0]} {base:8.1f} {base / step:6.2f} {cpus:>13} "
              f"{theirs_[1]:>13} {base_cpu:9.1f}")
    for m, value in torch_.items():
        if not isinstance(value, list):
            print(f"torch M={m}: {value}")


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
    parser.add_argument("--lm", action="store_true", help="the language model of examples/pipeline_lm.py, "
                        "1F1B, against torch's (the tied gradient summed by hand there)")
    parser.add_argument("--lm-batch", type=int, default=32, help="--lm: windows per step")
    parser.add_argument("--lm-d-model", type=int, default=128)
    parser.add_argument("--lm-blocks", type=int, default=4)
    parser.add_argument("--lm-context", type=int, default=64)
    args = parser.parse_args()
    if args.lm:
        if args.worker:
            return lm_worker(args)
        return lm_report(args, *lm_best([(lm_ours(args), lm_theirs(args)) for _ in range(args.rounds)]))
    if args.worker:
        return worker(args)
    if args.balance_worker:
        return balance_worker(args)
    if args.balance:
        return balance_part(args)
    report(args, *best_rounds([(ours(args), theirs(args)) for _ in range(args.rounds)]))


if __name__ == "__main__":
    main()

"""What the collectives' agreement check (issue 40) costs, against a DistributedOptimizer step and a
pushpull, measured in the same run on 2 workers (``launch.py -n 2 -s 1``, authentication as shipped).

    python benchmarks/agreement_cost.py [--iters 30] [--blocks 3]

The check compares every worker's keys, shapes, dtypes and root through a digest carried on a
barrier: init's first barrier carries it (no extra message), a broadcast meets one barrier more.
The step and a pushpull carry nothing new: their code path is the one without the check, so their
per-step cost of it is zero by construction.  What this prints, per worker, best of ``--blocks``
blocks of ``--iters`` calls (this machine is shared):

* ``step``: one ``DistributedOptimizer.step`` (SGD) of an MLP of 670k parameters (6 keys);
* ``pushpull``: one pushpull of the same 6 gradient keys;
* ``barrier``: one plain barrier (``kv.barrier()``);
* ``agree``: one agreement barrier with this model's digest (what a broadcast adds, once);
* ``init collective``: the init's barrier pair with and without the digest (what init adds).

and the ratios ``agree / step`` (what the check would cost if it ran on every step: it does not) and
``(init with digest - without) / step``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SIZES = (784, 512, 512, 10)


def best_ms(fn: Any, iters: int, blocks: int, barrier: Any) -> float:
    """The best of ``blocks`` blocks of ``iters`` calls of ``fn``, in ms per call (workers in step)."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(blocks):
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e3)
    return best


def worker(iters: int, blocks: int) -> None:
    """Under launch.py: time each figure on this worker's dist_sync store and print it."""
    import torch

    import kvstore
    from kvstore.base import layer_calls
    from kvstore.core import agreement

    torch.set_num_threads(1)
    kv = kvstore.create("dist_sync")
    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    opt = kvstore.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                       named_parameters=net.named_parameters(), kv=kv)
    x, y = torch.randn(64, SIZES[0]), torch.randint(0, SIZES[-1], (64,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    grads = {f"bench/{n}": torch.zeros_like(p) for n, p in net.named_parameters()}
    kv.init(list(grads), list(grads.values()))
    keys, values = list(grads), list(grads.values())
    digest = agreement.digest(((n, tuple(p.shape), str(p.dtype)) for n, p in net.named_parameters()), root=0)
    init_digest = agreement.digest((k, tuple(v.shape), "float32") for k, v in grads.items())
    barriers = kv._barriers  # the init's collective, without sending any key (a benchmark may look in)
    figures = {
        "step": best_ms(step, iters, blocks, kv.barrier),
        "pushpull": best_ms(lambda: kv.pushpull(keys, values), iters, blocks, kv.barrier),
        "barrier": best_ms(kv.barrier, iters, blocks, kv.barrier),
        "agree": best_ms(lambda: layer_calls(kv).agree("bench", digest), iters, blocks, kv.barrier),
        "init collective": best_ms(lambda: barriers.collective("bench", lambda: None), iters, blocks,
                                   kv.barrier),
        "init collective + digest": best_ms(lambda: barriers.collective("bench", lambda: None, init_digest),
                                            iters, blocks, kv.barrier),
    }
    print("RESULT " + json.dumps({"rank": kv.rank, **figures}), flush=True)
    kv.close()


def main() -> None:
    """Launch 2 workers and a server running :func:`worker`; print the mean over workers and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iters, args.blocks)
        return
    argv = [sys.executable, "launch.py", "-n", "2", "-s", "1", __file__, "--worker",
            "--iters", str(args.iters), "--blocks", str(args.blocks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("KVSTORE_SECRET", None)  # the launcher makes one: authentication as shipped
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                         f"{done.stderr[-3000:]}")
    rows = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k != "rank"}
    for name, ms in mean.items():
        print(f"{name:<32} {ms:8.3f} ms")
    step = mean["step"]
    print(f"{'per-step cost (step, pushpull)':<32} 0 (nothing is added to their messages or path)")
    print(f"{'agree / step':<32} {mean['agree'] / step:8.1%}  (a broadcast's one added barrier)")
    added = mean["init collective + digest"] - mean["init collective"]
    print(f"{'init digest / step':<32} {added / step:8.1%}  (once, at the first step's init)")


if __name__ == "__main__":
    main()

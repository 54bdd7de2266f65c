"""The cost of KVSTORE_HISTOGRAM_EVERY (issue 43): one record of the weight and gradient histograms of
benchmarks/trainer_step.py's 670k MLP (6 tensors, 12 histograms), against one step of that model.

    python benchmarks/histogram_cost.py [--iters 20] [--blocks 5]

One thread (``torch.set_num_threads(1)``), as trainer_step.py.  A step is zero_grad, forward, backward
of a batch of 64 and torch's SGD (no store: the record's cost does not depend on it); a record is
:meth:`kvstore.client.meter.HistogramRecorder.step` with ``every=1``.  Each figure is the best block's
mean.  Output: ms per step, ms per record, and the per-step overhead at N = 1, 10 and 100.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from trainer_step import batch, model  # noqa: E402

from kvstore.client.meter import HistogramLog, HistogramRecorder  # noqa: E402


def best_ms(fn, iters: int, blocks: int) -> float:
    """The best of ``blocks`` blocks' mean ms of ``fn`` over ``iters`` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(blocks):
        started = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - started) / iters)
    return best * 1e3


def main() -> None:
    """Time a step and a record; print both and the overhead per step at N = 1, 10, 100."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = model("670k")
    sgd = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = batch(0)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        net.zero_grad()
        loss_fn(net(x), y).backward()
        sgd.step()

    step_ms = best_ms(step, args.iters, args.blocks)
    named = list(net.named_parameters())
    recorder = HistogramRecorder([n for n, _ in named], [p for _, p in named], every=1, log=HistogramLog())
    record_ms = best_ms(recorder.step, args.iters, args.blocks)
    print(f"670k MLP ({sum(p.numel() for _, p in named):,} parameters), 1 thread: step {step_ms:.2f} ms, "
          f"histogram record {record_ms:.2f} ms ({2 * len(named)} histograms)")
    for every in (1, 10, 100):
        print(f"  KVSTORE_HISTOGRAM_EVERY={every}: +{record_ms / every:.3f} ms a step "
              f"({100 * record_ms / every / step_ms:.2f} %)")


if __name__ == "__main__":
    main()

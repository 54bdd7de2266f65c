"""A model bigger than any of its workers (issue 41): K stages, each rank builds and holds only its own.

    python launch.py -n 4 -s 2 benchmarks/pipeline_memory.py [--width 4096] [--layers 32] [--steps 2]

The model is ``--layers`` Linear(width, width) layers (float32) with ReLU between them, described by
``LayerSpec``s: no rank ever builds another stage's layers.  Each rank trains its stage for ``--steps``
steps (1f1b, 4 micro-batches of 2 rows) through a Trainer whose SGD runs on the servers (its keys in
the stage's worker set), then prints one JSON line: its stage, the parameter bytes of its stage and of
the whole model, its peak resident memory (``VmHWM`` of /proc/self/status), the most bytes autograd
saved for its backwards (``Pipeline.peak_saved_bytes``) and the bytes it pushed in its last step.
Run once with ``--width 8`` for the empty-stage baseline (the same process with next to no
parameters); tests/integration/test_pipeline_stage_local.py (marked ``pipemem``) runs both and checks
each rank's peak <= baseline + 4 x its stage's parameter bytes + its activations, and < the model's
parameter bytes.
"""

from __future__ import annotations

import argparse
import json

import torch

import kvstore
from kvstore.pipeline import LayerSpec, Pipeline
from kvstore.trainer import Trainer


def peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    specs: list[LayerSpec] = []
    for i in range(args.layers):
        specs.append(LayerSpec(torch.nn.Linear, args.width, args.width))
        if i < args.layers - 1:
            specs.append(LayerSpec(torch.nn.ReLU))
    model_bytes = args.layers * (args.width + 1) * args.width * 4
    with kvstore.create("dist_sync") as kv:
        pipe = Pipeline(specs, stages=kv.num_workers, chunks=4, schedule="1f1b", kv=kv)
        trainer = Trainer(pipe, "sgd", {"learning_rate": 1e-4})
        gen = torch.Generator().manual_seed(kv.rank)
        pushed = 0
        try:
            for _ in range(args.steps):
                x = torch.randn(8, args.width, generator=gen)
                pipe.module.zero_grad(set_to_none=False)
                pipe.step(x if pipe.is_first else None, x if pipe.is_last else None,
                          torch.nn.functional.mse_loss)
                before = kv.stats()["bytes_out"]
                trainer.step(1)
                pushed = kv.stats()["bytes_out"] - before
        finally:
            pipe.close()
        stage_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters())
        print(json.dumps({"rank": kv.rank, "stage": pipe.stage, "stage_bytes": stage_bytes,
                          "model_bytes": model_bytes, "peak_rss": peak_rss(),
                          "saved_bytes": pipe.peak_saved_bytes, "pushed": pushed}), flush=True)


if __name__ == "__main__":
    main()

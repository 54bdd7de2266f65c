"""A language model trained through pipeline stages: a decoder-only transformer with tied embeddings.

Run a cluster of 4 workers (4 stages, the default: one stage per worker) and 1 server on this machine::

    python launch.py -n 4 -s 1 examples/pipeline_lm.py                   # 4 stages, 1.5-3 minutes on 2 cores
    python launch.py -n 2 -s 1 examples/pipeline_lm.py                   # 2 stages
    python examples/pipeline_lm.py --one-process                         # the same training in one process
    python launch.py -n 2 -s 1 examples/pipeline_lm.py --smoke           # the test suite's short run

The text is the standard library's own Python sources (nothing is downloaded): the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` (test directories and site-packages left out) sorted by path and
concatenated up to ``--bytes``, read as bytes (vocabulary 256: no tokenizer).  The corpus therefore depends
on the Python version's standard library; for one Python it is always the same.  The last 10% is the
validation text.

The model is a list of layer factories (``kvstore.pipeline.LayerSpec``) that a Pipeline cuts into stages
by parameter count: the byte embedding, a learned positional embedding added to it, ``--blocks`` pre-norm
transformer blocks (causal self-attention through torch's ``scaled_dot_product_attention`` and an MLP, each
with its residual), a final LayerNorm and the output projection.  The embedding and the output projection
are one module (``kvstore.pipeline.Tied("embed", ...)``): the logits are ``x @ embedding.weight.T``.  On a
pipeline they sit on the first and the last stage, whose gradients of the shared weight the store sums.
Every layer maps one tensor to one tensor: a stage boundary carries a (batch, time, d_model) activation.

Each step, ``pipe.step`` streams ``--chunks`` micro-batches of ``--batch-size`` random windows of the
training text through the stages under 1F1B, and ``trainer.step`` applies Adam (on the servers, with a
linear warm-up and a cosine decay).  After ``--steps`` steps the last stage measures the validation loss
through ``pipe.predict`` (forward only) and prints it next to a bigram model's (byte-pair counts of the
training text with add-k smoothing) on the same validation bytes, in nats and bits per byte; the exit code
is 1 unless the model's loss is below the bigram's.  ``--one-process`` trains the same model
(``kvstore.pipeline.build(layers, seed)``: the same weights) on the same batches with the same optimizer
in this process, the reference the pipeline is compared with.  Every process runs one torch thread.
``--device cuda`` runs the model on a GPU: in one process, or each stage (two stages may share a GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import kvstore
import kvstore.lr_scheduler
from kvstore.pipeline import LayerSpec, Pipeline, Tied, build
from kvstore.trainer import Trainer

VOCAB = 256  # bytes
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SMOKE = {"bytes": 1 << 18, "d_model": 128, "blocks": 2, "heads": 4, "context": 32, "steps": 500,
         "batch_size": 16, "chunks": 2, "lr": 2e-3, "warmup": 30}  # --smoke: the test suite's short run


# ----------------------------------------------------------------------------------------------- data

def corpus(budget: int, root: str | None = None) -> bytes:
    """The first ``budget`` bytes of the ``.py`` files under ``root`` (the standard library by default),
    sorted by path, test directories and site-packages left out.  Raises ValueError when they hold fewer
    than ``budget`` bytes."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        paths += [Path(folder, f) for f in files if f.endswith(".py")]
    text = bytearray()
    for path in sorted(paths, key=lambda p: p.relative_to(base).as_posix()):
        text += path.read_bytes()
        if len(text) >= budget:
            return bytes(text[:budget])
    raise ValueError(f"the .py files under {base} hold {len(text)} bytes, fewer than {budget}")


def split_text(data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte tokens (int64) of ``data``: the first 90% for training, the last 10% for validation."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = len(tokens) - len(tokens) // 10
    return tokens[:cut], tokens[cut:]


def batches(train: torch.Tensor, context: int, batch_size: int, steps: int,
            seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``batch_size`` random windows of ``train`` (seeded): inputs (batch, context)
    and targets, the inputs shifted by one byte."""
    windows = train.unfold(0, context + 1, 1)
    order = torch.Generator().manual_seed(seed)
    chosen = [windows[torch.randint(len(windows), (batch_size,), generator=order)] for _ in range(steps)]
    return [(w[:, :-1], w[:, 1:]) for w in chosen]


def validation_windows(val: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation text cut into consecutive windows: inputs (n, context) and targets (n, context), each
    target the byte after its input (the tail shorter than a window is left out)."""
    windows = val.unfold(0, context + 1, context)
    return windows[:, :-1], windows[:, 1:]


def bigram_loss(train: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, k: float = 0.1) -> float:
    """The mean cross-entropy in nats of ``targets`` given ``inputs`` (same shape, each target the byte after
    its input) under a bigram model of ``train``: P(b | a) = (count(a b) + k) / (count(a) + 256 k), counted
    over the consecutive byte pairs of ``train``."""
    counts = torch.bincount(train[:-1] * VOCAB + train[1:], minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)
    counts = counts.double()
    logp = torch.log((counts + k) / (counts.sum(1, keepdim=True) + VOCAB * k))
    return float(-logp[inputs.reshape(-1), targets.reshape(-1)].mean())


# ---------------------------------------------------------------------------------------------- model

class Positional(nn.Module):
    """A learned positional embedding added to its input: (batch, time, d) -> (batch, time, d)."""

    def __init__(self, context: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(context, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[:x.shape[1]]


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)); causal attention over
    ``heads`` heads (torch's ``scaled_dot_product_attention``)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def embedding(vocab: int, d_model: int) -> nn.Embedding:
    """The byte embedding, initialised N(0, 0.02) as GPT-2's: as the tied output projection, its logits
    start near zero (torch's N(0, 1) would start them at about sqrt(d_model))."""
    module = nn.Embedding(vocab, d_model)
    nn.init.normal_(module.weight, std=0.02)
    return module


def project(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output projection through the tied embedding: the logits ``x @ embedding.weight.T``."""
    return x @ embedding.weight.T


def layers(d_model: int, blocks: int, heads: int, context: int) -> list[Callable[[], nn.Module]]:
    """The model as a Pipeline's layer factories (each maps one tensor to one tensor)."""
    return [Tied("embed", LayerSpec(embedding, VOCAB, d_model)),
            LayerSpec(Positional, context, d_model),
            *[LayerSpec(Block, d_model, heads) for _ in range(blocks)],
            LayerSpec(nn.LayerNorm, d_model),
            Tied("embed", LayerSpec(embedding, VOCAB, d_model), forward=project)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy (nats) of every position's next byte."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ------------------------------------------------------------------------------------------- training

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; under ``--smoke`` the SMOKE preset's values are the defaults."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None, help="default: the number of workers")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32, help="windows per step (per replica)")
    parser.add_argument("--bytes", type=int, default=2 << 20, help="the corpus' size (>= 1 MB by default)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's peak learning rate")
    parser.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up, then a cosine")
    parser.add_argument("--seed", type=int, default=0, help="the initial weights' and the batches' seed")
    parser.add_argument("--one-process", action="store_true", help="train the same model in this process")
    parser.add_argument("--device", default=None,
                        help="where the model runs, e.g. 'cuda'; default: the CPU in one process, and each "
                        "stage the GPU the launcher gave its worker (--gpus-per-worker), else the CPU")
    parser.add_argument("--smoke", action="store_true", help="a short, small run (the test suite's)")
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**SMOKE)  # the preset replaces the defaults; flags given still win
    return parser.parse_args(argv)


def optimizer_params(args: argparse.Namespace) -> dict[str, Any]:
    """Adam with a linear warm-up to ``--lr`` (cut short for a run shorter than it) and a cosine decay to
    zero at the last step."""
    schedule = kvstore.lr_scheduler.CosineScheduler(max_update=args.steps, base_lr=args.lr,
                                                    warmup_steps=min(args.warmup, args.steps - 1))
    return {"learning_rate": args.lr, "lr_scheduler": schedule}


class Data:
    """The run's text: the training batches, the validation windows and the bigram baseline's loss."""

    def __init__(self, args: argparse.Namespace, replica: int = 0) -> None:
        train, val = split_text(corpus(args.bytes))
        self.train_bytes, self.val_bytes = len(train), len(val)
        self.batches = batches(train, args.context, args.batch_size, args.steps, args.seed + replica)
        self.val_x, self.val_y = validation_windows(val, args.context)
        self.bigram = bigram_loss(train, self.val_x, self.val_y)

    def describe(self) -> str:
        """Where the text comes from and how much of it there is."""
        return (f"Python {platform.python_version()}'s standard library: {self.train_bytes} training bytes, "
                f"{self.val_bytes} validation bytes")


EVAL_WINDOWS = 256  # validation windows per predict call: bounds the logits held at once


def report(args: argparse.Namespace, data: Data, loss: float, where: str, took: float) -> bool:
    """Print the model's and the bigram's validation losses; whether the model's is the lower."""
    print(f"{where}: {args.steps} steps in {took:.1f} s; validation ({data.val_y.numel()} bytes) "
          f"loss {loss:.4f} nats/byte = {loss / math.log(2):.4f} bits/byte; bigram "
          f"{data.bigram:.4f} nats/byte = {data.bigram / math.log(2):.4f} bits/byte", flush=True)
    return loss < data.bigram


def one_process(args: argparse.Namespace) -> bool:
    """Train ``build(layers, seed)`` in this process on the same batches with the same optimizer; report."""
    device = torch.device(args.device or "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch sees no CUDA device")
    data = Data(args)
    model = build(layers(args.d_model, args.blocks, args.heads, args.context), args.seed).to(device)
    trainer = Trainer(model.named_parameters(), "adam", optimizer_params(args), kvstore="local")
    print(f"one process on {device}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"{data.describe()}", flush=True)
    start = time.perf_counter()
    for step, (x, y) in enumerate(data.batches):
        model.zero_grad()
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        trainer.step(1)
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    took = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        total = sum(float(lm_loss(model(x.to(device)), y.to(device))) * len(x)
                    for x, y in zip(data.val_x.split(EVAL_WINDOWS), data.val_y.split(EVAL_WINDOWS)))
    return report(args, data, total / len(data.val_x), "one process", took)


def pipeline(args: argparse.Namespace, kv: kvstore.KVStore) -> bool | None:
    """Train this worker's stage; on the last stage of replica 0, report and return whether the model beat
    the bigram (None elsewhere)."""
    stages = args.stages or kv.num_workers
    pipe = Pipeline(layers(args.d_model, args.blocks, args.heads, args.context), stages=stages,
                    chunks=args.chunks, schedule="1f1b", checkpoint="never", kv=kv, seed=args.seed,
                    device=args.device)
    data = Data(args, pipe.replica)
    trainer = Trainer(pipe, "adam", optimizer_params(args))
    if kv.rank == 0:
        print(f"{kv.num_workers} workers: {stages} stages x {pipe.replicas} replicas, balance "
              f"{pipe.balance}, 1f1b, {args.chunks} micro-batches, on {pipe.device}, {data.describe()}",
              flush=True)
    start = time.perf_counter()
    try:
        for step, (x, y) in enumerate(data.batches):
            pipe.module.zero_grad()
            loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, lm_loss)
            trainer.step(pipe.replicas)  # each replica's gradient is its batch's mean: average them
            if loss is not None and pipe.replica == 0 and (step % 100 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss:.4f}", flush=True)
        took = time.perf_counter() - start
        total = 0.0
        for x, y in zip(data.val_x.split(EVAL_WINDOWS), data.val_y.split(EVAL_WINDOWS)):
            logits = pipe.predict(x if pipe.is_first else None)  # forward only, through every stage
            if logits is not None:
                total += float(lm_loss(logits, y.to(logits.device))) * len(x)
    finally:
        pipe.close()
    if not (pipe.is_last and pipe.replica == 0):
        return None
    return report(args, data, total / len(data.val_x), f"{stages} stages", took)


def main() -> None:
    """Train through the pipeline (under launch.py) or in one process; exit 1 unless the bigram is beaten."""
    args = parse_args()
    torch.set_num_threads(1)  # one core per process: the stages share the machine's cores
    if args.one_process:
        beat = one_process(args)
    else:
        with kvstore.create("dist_sync") as kv:
            beat = pipeline(args, kv)
    if beat is False:
        raise SystemExit("the model's validation loss is not below the bigram's")


if __name__ == "__main__":
    main()

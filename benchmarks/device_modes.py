"""Benchmark of the device modes on a GPU: several "devices" as tensors on one GPU, or on N GPUs.

    python benchmarks/device_modes.py [--devices 4] [--gpus 1|N|all] [--sizes 1,16,64] [--repeat 20]
                                      [--json out.json]

The ``--devices`` values of one key live on the first ``--gpus`` GPUs, dealt out in turn (the
default, 1: all on ``cuda:0``, several replicas on one GPU; ``--gpus all`` with 4 devices on 4 GPUs:
one per GPU, which the device store sums with one NCCL reduce).  For each value size (millions of
float32 elements) it times, in one run:

- ``raw``: the floor, in plain torch: sum the per-device tensors into a fresh tensor on the first
  device (a loop of additions), apply sgd (``w -= lr * g``) and copy ``w`` into one out per device;
- ``device``: the same through ``kvstore.create('device')`` with sgd set
  (``push`` of the per-device list, then ``pull`` into the per-device outs);
- ``local``: the same through ``kvstore.create('local')``, which sums on the CPU
  (every tensor copied off the GPU first) and updates in numpy;
- the sum alone: ``loop``, the Python loop of additions the device modes used before issue 47 (a
  copy of the first value, then ``+=`` of each other value brought to its GPU), against ``reduce``,
  the device store's one reduction call (``DeviceComm.reduce``: a stacked sum, or ``reduce_add``
  for one tensor per GPU; the ``call`` column says which);

and prints each as a ratio to ``raw`` (1.0 = as fast as hand-written torch), plus
``local / device`` and ``loop / reduce``.  It then times what a ``dist_*_device`` worker adds
around the network: the GPU sum copied off the GPU through pinned memory (``to_host``) against
a plain ``.cpu()`` copy, and a pulled value staged in pinned memory and copied to
every device on side streams (``deliver``) against one plain copy per device.
Exits 2 without CUDA, or when ``--gpus`` asks for more GPUs than there are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np


def timed(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after two warm-ups, synchronising the GPU."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(n: int, devices: int, repeat: int, gpus: int = 1) -> dict[str, float | str]:
    """Time every variant for values of ``n`` float32 elements on ``devices`` devices dealt out over
    the first ``gpus`` GPUs."""
    import torch
    from torch.cuda import nccl

    import kvstore
    from kvstore import device as D

    def sync() -> None:
        for index in range(gpus):  # torch.cuda.synchronize() waits for the current device only
            torch.cuda.synchronize(index)

    placed = [torch.device("cuda", i % gpus) for i in range(devices)]
    dev = placed[0]
    nbytes = 4 * n
    values = [torch.rand(n, device=d) for d in placed]
    outs = [torch.empty(n, device=d) for d in placed]
    weight = torch.zeros(n, device=dev)
    lr = 0.01

    def loop() -> torch.Tensor:
        total = values[0].clone()
        for v in values[1:]:
            total += v.to(dev, non_blocking=True)
        return total

    def raw() -> None:
        total = loop()
        total *= lr
        weight.sub_(total)
        for out in outs:
            out.copy_(weight)

    stores = {}
    for name in ("device", "local"):
        kv = kvstore.create(name)
        kv.init("w", torch.zeros(n, device=dev))
        kv.set_optimizer(kvstore.optimizer.create("sgd", learning_rate=lr))
        stores[name] = kv

    def through(kv: kvstore.KVStore) -> Callable[[], None]:
        def step() -> None:
            kv.push("w", values)
            kv.pull("w", out=outs)
        return step

    comm = stores["device"]._device()
    meta = stores["device"]._meta["w"]
    call = D.choose_reduction(placed, True, gpus > 1 and nccl.is_available([])).value
    wire = np.random.default_rng(0).random(n, dtype=np.float32)  # a pulled value, as numpy

    def plain_copies() -> None:
        source = torch.from_numpy(wire)
        for out in outs:
            out.copy_(source)

    t_raw = timed(raw, repeat, sync)
    t_dev = timed(through(stores["device"]), repeat, sync)
    t_loc = timed(through(stores["local"]), max(3, repeat // 4), sync)
    t_loop = timed(loop, repeat, sync)
    t_reduce = timed(lambda: comm.reduce("w", meta, values), repeat, sync)
    t_host = timed(lambda: comm.to_host(values[0]), repeat, sync)
    t_cpu = timed(lambda: values[0].cpu(), repeat, sync)
    t_deliver = timed(lambda: comm.deliver(wire, outs), repeat, sync)
    t_copies = timed(plain_copies, repeat, sync)
    return {"elements": n, "raw_ms": t_raw * 1e3, "device_ms": t_dev * 1e3, "local_ms": t_loc * 1e3,
            "device_over_raw": t_dev / t_raw, "local_over_device": t_loc / t_dev,
            "loop_ms": t_loop * 1e3, "reduce_ms": t_reduce * 1e3, "loop_over_reduce": t_loop / t_reduce,
            "reduction": call,
            "to_host_GBps": nbytes / t_host / 1e9, "cpu_copy_GBps": nbytes / t_cpu / 1e9,
            "deliver_GBps": nbytes * devices / t_deliver / 1e9,
            "plain_copies_GBps": nbytes * devices / t_copies / 1e9}


def _gpus(text: str) -> str:
    """``--gpus``: 'all' or a positive count (argparse reports anything else)."""
    if text != "all" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'all' nor a positive number of GPUs")
    return text


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table (and write JSON with ``--json``).  Returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="devices: one tensor of each value per device")
    parser.add_argument("--gpus", type=_gpus, default="1",
                        help="spread the devices over this many GPUs, in turn ('all': every GPU; default 1)")
    parser.add_argument("--sizes", default="1,16,64", help="value sizes in millions of float32 elements")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)

    import torch

    import kvstore

    if not torch.cuda.is_available():
        print("device_modes: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    present = torch.cuda.device_count()
    gpus = present if args.gpus == "all" else int(args.gpus)
    if not 1 <= gpus <= present:
        print(f"device_modes: --gpus {args.gpus}: this machine has {present} GPU(s)", file=sys.stderr)
        return 2
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    gpu = " + ".join(names)
    print(f"GPU: {gpu}; torch {torch.__version__}; kvstore {kvstore.__version__}; "
          f"{args.devices} devices on {gpus} GPU(s); median of {args.repeat}")
    print(f"{'size':>8} {'raw ms':>8} {'device ms':>10} {'local ms':>9} {'device/raw':>11} "
          f"{'local/device':>13} {'loop ms':>8} {'reduce ms':>10} {'loop/reduce':>12} {'call':>12} "
          f"{'to_host GB/s':>13} {'.cpu() GB/s':>12} {'deliver GB/s':>13} {'copies GB/s':>12}")
    rows = []
    for millions in (float(s) for s in args.sizes.split(",")):
        row = measure(int(millions * 1_000_000), args.devices, args.repeat, gpus)
        rows.append(row)
        print(f"{millions:>7g}M {row['raw_ms']:>8.2f} {row['device_ms']:>10.2f} {row['local_ms']:>9.1f} "
              f"{row['device_over_raw']:>11.2f} {row['local_over_device']:>13.1f} "
              f"{row['loop_ms']:>8.2f} {row['reduce_ms']:>10.2f} {row['loop_over_reduce']:>12.2f} "
              f"{row['reduction']:>12} "
              f"{row['to_host_GBps']:>13.1f} {row['cpu_copy_GBps']:>12.1f} {row['deliver_GBps']:>13.1f} "
              f"{row['plain_copies_GBps']:>12.1f}")
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"devices": args.devices, "gpus": gpus, "gpu": gpu, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The figure of docs/benchmarks.md, drawn from one suite run's JSON (``suite.py --ddp --json``).

    python benchmarks/plot.py [--json benchmarks/results/suite-2026-11-26-final.json]
                              [--out docs/images/benchmarks.png]

Three panels, per cluster shape (workers x servers): the 64 MB model's push+pull rate per worker
against raw pyzmq TCP of the same bytes; the small key's p50 round trip (push then pull, and one
pushpull) against a raw 4-byte round trip; and the Trainer's step (its fastest variant) over its
baseline, one process at 1 worker and torch DDP (gloo) at 2 and 4, with issue 24's targets drawn.
Needs matplotlib (``pip install matplotlib``), which nothing else in kvstore uses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "benchmarks" / "results" / "suite-2026-11-26-final.json"
DEFAULT_OUT = REPO / "docs" / "images" / "benchmarks.png"
OURS, RAW, TARGET = "#1f77b4", "#555555", "#d62728"


def trainer_ratios(run: dict[str, Any]) -> dict[str, list[float]]:
    """Per model, the fastest Trainer variant's step over its baseline at 1, 2 and 4 workers."""
    ratios: dict[str, list[float]] = {}
    for name, model in run["trainer_vs_ddp"]["models"].items():
        row = []
        for workers in (1, 2, 4):
            sides = model[f"{workers}w"]
            best = min(ms for variant, ms in sides.items() if variant != "ddp_ms")
            row.append(best / (model["one_process_ms"] if workers == 1 else sides["ddp_ms"]))
        ratios[name] = row
    return ratios


def draw(run: dict[str, Any], source: str, out: Path) -> None:
    """Draw the three panels of ``run`` into ``out`` (a PNG), naming ``source`` under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(run["configs"])
    base = run["baseline"]
    x = range(len(configs))
    fig, (rate, latency, step) = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    machine = run["machine"]
    fig.suptitle(f"kvstore on {machine['cpus']} CPU cores, no GPU, {machine['date']} ({source})", fontsize=11)

    gbps = [run["configs"][c]["throughput_gbps"] for c in configs]
    bars = rate.bar(x, gbps, color=OURS, label="kvstore, per worker (shared memory)")
    rate.bar_label(bars, fmt="%.2f", fontsize=8)
    rate.axhline(base["model"]["gbps"], color=RAW, linestyle="--",
                 label=f"raw pyzmq TCP, same bytes ({base['model']['gbps']:.2f})")
    rate.set(title="64 MB model, push + pull", ylabel="GB/s per worker", xticks=list(x), xticklabels=configs,
             xlabel="cluster: workers (w) x servers (s)")
    rate.legend(fontsize=8, loc="upper right")

    width = 0.38
    p50 = [run["configs"][c]["latency_p50_us"] for c in configs]
    pp = [run["configs"][c]["pushpull_p50_us"] for c in configs]
    bars = latency.bar([i - width / 2 for i in x], p50, width, color=OURS, label="push then pull")
    latency.bar_label(bars, fmt="%.0f", fontsize=8)
    bars = latency.bar([i + width / 2 for i in x], pp, width, color="#9ecae1", label="pushpull (one request)")
    latency.bar_label(bars, fmt="%.0f", fontsize=8)
    latency.axhline(base["latency"]["p50_us"], color=RAW, linestyle="--",
                    label=f"raw pyzmq round trip ({base['latency']['p50_us']:.0f})")
    latency.set(title="1-element key, p50 round trip", ylabel="microseconds", xticks=list(x),
                xticklabels=configs, xlabel="cluster: workers (w) x servers (s)")
    latency.legend(fontsize=8, loc="upper left")

    ratios = trainer_ratios(run)
    groups = ["1 worker\n/ one process", "2 workers\n/ DDP (gloo)", "4 workers\n/ DDP (gloo)"]
    width = 0.8 / len(ratios)
    for k, (name, row) in enumerate(ratios.items()):
        params = run["trainer_vs_ddp"]["models"][name]["params"]
        bars = step.bar([i - 0.4 + width * (k + 0.5) for i in range(3)], row, width,
                        color=[OURS, "#9ecae1"][k % 2], label=f"MLP {name} ({params:,} parameters)")
        step.bar_label(bars, fmt="%.2fx", fontsize=8, padding=-14, color="black")  # inside: clear of targets
    for i, target in enumerate((1.3, 1.0, 1.0)):
        step.hlines(target, i - 0.45, i + 0.45, color=TARGET, linestyle="--",
                    label="target (issue 24)" if i == 0 else None)
    step.set(title="Trainer step (fastest variant) over its baseline", ylabel="ratio (lower is faster)",
             xticks=range(3), xticklabels=groups)
    step.set_ylim(0, max(max(r) for r in ratios.values()) * 1.2)
    step.legend(fontsize=8, loc="upper right")

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    """Read the JSON named by ``--json`` and write the figure to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="a suite.py --ddp --json file")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG to write")
    args = parser.parse_args()
    run = json.loads(args.json.read_text())
    source = args.json.resolve().relative_to(REPO) if args.json.resolve().is_relative_to(REPO) else args.json
    draw(run, str(source), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

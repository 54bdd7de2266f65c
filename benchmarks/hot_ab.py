"""The compiled message path (``kvstore.net._hot``) against the pure-Python one, alternated in one run
(issue 39, targets 1-3): each block runs ``suite.py`` (latency and, unless left out, many keys) and
``msg_cpu.py`` once with ``KVSTORE_PURE_PYTHON=0`` and once with ``=1``, the order swapped every block.

    python benchmarks/hot_ab.py [--blocks 3] [--configs 1w1s,4w2s] [--rounds 2000] [--tests latency,manykeys]
                                [--env NAME=VALUE ...] [--sides A:VAR=VALUE B:VAR=VALUE] [--json out.json]

``--sides`` compares two other settings instead (e.g. ``header:KVSTORE_AUTH=header full:KVSTORE_AUTH=full``).
Printed: every block's figures, then the median over blocks of each figure per side and the ratio
first side / second side; the load average before and after each run is kept in the JSON.
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
SIDES = ["compiled:KVSTORE_PURE_PYTHON=0", "pure:KVSTORE_PURE_PYTHON=1"]


def run(script: str, args: list[str], side: dict[str, str], extra: dict[str, str]) -> dict[str, Any]:
    """One run of ``benchmarks/<script>`` with ``extra`` and ``side`` set; its JSON and the load."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, **extra, **side, "PYTHONPATH": str(REPO)}
        load = os.getloadavg()[0]
        began = time.monotonic()
        done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args, "--json", out.name],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return {"load": [load, os.getloadavg()[0]], "seconds": round(time.monotonic() - began, 1),
                "result": json.loads(Path(out.name).read_text())}


def figures(suite: dict[str, Any], cpu: dict[str, Any]) -> dict[str, float]:
    """The figures compared: the suite's p50s and rates, its raw round trip, and msg_cpu's CPU per round."""
    out = {"raw_p50_us": suite["baseline"]["latency"]["p50_us"]}
    for config, row in suite["configs"].items():
        for name in ("latency_p50_us", "pushpull_p50_us", "manykeys_per_s"):
            if isinstance(row.get(name), (int, float)) and row[name] == row[name]:  # not NaN
                out[f"{config} {name}"] = row[name]
    for config, tests in cpu["configs"].items():
        for test, items in tests.items():
            first = min(items, key=lambda r: r["rank"])
            if "cpu_us" not in first:
                continue
            out[f"{config} {test} p50_us"] = first["p50_us"]
            out[f"{config} {test} worker_cpu_us"] = statistics.mean(r["cpu_us"]["worker"]["total"]
                                                                    for r in items)
            for name, rows in first["cpu_us"]["worker"].items():
                if name in ("caller",) or name.startswith("ZMQ"):
                    out[f"{config} {test} worker0 {name}"] = rows
            out[f"{config} {test} server_cpu_us"] = sum(v["total"] for k, v in first["cpu_us"].items()
                                                        if k.startswith("server"))
            out[f"{config} {test} server main"] = sum(v.get("main", 0) for k, v in first["cpu_us"].items()
                                                      if k.startswith("server"))
    return out


def main() -> None:
    """Run the alternated blocks, print each and the medians, save everything with ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--configs", default="1w1s,4w2s")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--tests", default="latency,manykeys")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for every run (both sides)")
    parser.add_argument("--sides", nargs=2, default=SIDES, help="the two settings compared, NAME:VAR=VALUE")
    parser.add_argument("--json")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    sides = {name: dict([setting.split("=", 1)]) for name, setting in (s.split(":", 1) for s in args.sides)}
    first, second = sides
    blocks: list[dict[str, Any]] = []
    for block in range(args.blocks):
        order = list(sides) if block % 2 == 0 else list(reversed(sides))
        entry: dict[str, Any] = {}
        for side in order:
            suite = run("suite.py", ["--configs", args.configs, "--tests", args.tests], sides[side], extra)
            cpu = run("msg_cpu.py", ["--configs", args.configs, "--rounds", str(args.rounds), "--lone", "0"],
                      sides[side], extra)
            entry[side] = {"suite": suite, "msg_cpu": cpu,
                           "figures": figures(suite["result"], cpu["result"])}
            print(f"block {block + 1} {side}: load {suite['load'][0]:.1f}-{cpu['load'][1]:.1f}", flush=True)
            for name, value in entry[side]["figures"].items():
                print(f"    {name:42} {value:12.1f}", flush=True)
        blocks.append(entry)
    print(f"\nmedians of {args.blocks} blocks ({' '.join(args.env) or 'default settings'}):")
    names = list(dict.fromkeys(name for b in blocks for side in sides for name in b[side]["figures"]))
    summary = {}
    for name in names:
        # a thread one side lacks in a block (a link's worker has no zmq I/O thread) counts 0 there
        values = {side: statistics.median(b[side]["figures"].get(name, 0.0) for b in blocks)
                  for side in sides}
        ratio = values[first] / values[second] if values[second] else float("nan")
        summary[name] = {**values, "ratio": ratio}
        print(f"    {name:42} {first} {values[first]:10.1f}  {second} {values[second]:10.1f} {ratio:5.2f}x")
    if args.json:
        out = {"date": time.strftime("%Y-%m-%d %H:%M"), "env": extra, "sides": sides, "blocks": blocks,
               "medians": summary}
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

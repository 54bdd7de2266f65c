"""Make the screenshots docs/observability.md shows: TensorBoard's scalars and weight histograms of a
real training job, and that job's timeline drawn by a small viewer of our own (a static page, one
row per role).

    python docs/make_screenshots.py [--out docs/images] [--epochs 4]

Runs ``examples/train_digits.py`` on 2 workers and 1 server through ``launch.py`` with
``--tensorboard DIR --tensorboard-keep``, ``KVSTORE_HISTOGRAM_EVERY=20`` and ``KVSTORE_TIMELINE``
(worker 1 slowed by 20 ms a step, so its pushes come last in their rounds), then points headless
Chromium (Debian's ``chromium``) at the kept TensorBoard (scalars, histograms) and at the timeline
page, and stops TensorBoard. Needs the ``[tensorboard]`` extra and Chromium; nothing is downloaded
(the timeline page is self-contained). Outside the test suite: the pytest marker ``browser`` runs
the same Chromium check (docs/observability.md).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COLOURS = {"push": "#4e79a7", "pull": "#59a14f", "pushpull": "#76b7b2", "barrier": "#e15759",
           "round": "#f28e2b", "step": "#b07aa1", "init": "#9c755f"}
WIDTH, ROW, LEFT = 1200, 34, 130  # page width, row height and label column, in px


def run_job(workdir: Path, epochs: int) -> tuple[str, int, Path]:
    """Run the training job; return TensorBoard's URL and pid, and the merged timeline's path.
    Exits naming the job's output when it fails."""
    trace = workdir / "timeline.json"
    env = {**os.environ, "KVSTORE_TIMELINE": str(trace), "KVSTORE_HISTOGRAM_EVERY": "20"}
    argv = [sys.executable, "launch.py", "-n", "2", "-s", "1", "--tensorboard", str(workdir / "tb"),
            "--tensorboard-keep", "examples/train_digits.py", "--epochs", str(epochs),
            "--slow-rank", "1", "--slow-ms", "20"]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    found = re.search(r"TensorBoard at (\S+) \(logdir .*, pid (\d+)\)", out)
    if done.returncode != 0 or found is None or not trace.is_file():
        sys.exit(f"the training job failed (exit {done.returncode}):\n{out[-3000:]}")
    return found.group(1), int(found.group(2)), trace


def screenshot(chromium: str, url: str, shot: Path, height: int = 900) -> None:
    """Have headless Chromium render ``url`` into ``shot`` (PNG); exit when it makes none."""
    argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={WIDTH + 80},{height}",
            "--virtual-time-budget=15000", "--hide-scrollbars", f"--screenshot={shot}", url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if not shot.is_file():
        sys.exit(f"Chromium made no screenshot of {url}:\n{done.stderr[-2000:]}")


def tracks(trace: dict) -> tuple[dict[int, str], list[dict]]:
    """The trace's process names by pid, and its complete ("X") events."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return names, [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def window(events: list[dict], seconds: float) -> tuple[float, float]:
    """A ``seconds`` long window in the middle of the trace (µs), where every role is busy."""
    start = min(e["ts"] for e in events)
    end = max(e["ts"] + e.get("dur", 0) for e in events)
    middle = (start + end) / 2
    return middle - seconds * 5e5, middle + seconds * 5e5


def timeline_page(trace: dict, seconds: float = 0.4) -> str:
    """A self-contained HTML page drawing ``seconds`` of the trace: one row per role and rank, one
    box per event, coloured by its name, with a legend."""
    names, events = tracks(trace)
    lo, hi = window(events, seconds)
    scale = (WIDTH - LEFT) / (hi - lo)
    rows = sorted(names)
    parts = []
    for row, pid in enumerate(rows):
        y = 30 + row * ROW
        parts.append(f'<text x="4" y="{y + 20}" font-size="14">{html.escape(names[pid])}</text>')
        for e in events:
            if e["pid"] != pid or e["ts"] + e.get("dur", 0) < lo or e["ts"] > hi:
                continue
            x = LEFT + max(0.0, e["ts"] - lo) * scale
            w = max(1.0, min(e.get("dur", 0), hi - e["ts"]) * scale)
            kind = "round" if e["name"].startswith("round") else e["name"]
            top, tall = (y + 18, 10) if e.get("cat") == "trainer" else (y + 4, 13)  # steps: a lower band
            tip = html.escape(f"{e['name']} {json.dumps(e.get('args', {}))}")
            parts.append(f'<rect x="{x:.1f}" y="{top}" width="{w:.1f}" height="{tall}" '
                         f'fill="{COLOURS.get(kind, "#bab0ac")}"><title>{tip}</title></rect>')
    legend = "".join(f'<span style="background:{c};padding:2px 8px;margin-right:6px;color:white">{n}</span>'
                     for n, c in COLOURS.items())
    height = 40 + len(rows) * ROW
    rounds = [e for e in events if e["name"].startswith("round")]
    last = sum(1 for e in rounds if e.get("args", {}).get("last_worker") == 1)
    return (f"<!doctype html><meta charset=utf-8><body style='font-family:sans-serif;margin:16px'>"
            f"<div>kvstore timeline (KVSTORE_TIMELINE): {seconds * 1000:.0f} ms of a 2-worker job, worker 1 "
            f"slowed by 20 ms a step; worker 1 came last in {last} of the job's {len(rounds)} sync "
            f"rounds</div><div style='margin:8px 0'>{legend}</div>"
            f"<svg width='{WIDTH}' height='{height}'>{''.join(parts)}</svg></body>")


def main() -> None:
    """Run the job, take both screenshots, stop TensorBoard."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "images"))
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("needs headless Chromium: apt-get install chromium")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        url, pid, trace_path = run_job(Path(tmp), args.epochs)
        try:
            screenshot(chromium, url.rstrip("/") + "/#scalars&tagFilter=loss%7Caccuracy%7Ctrainer",
                       out / "tensorboard-scalars.png")
            screenshot(chromium, url.rstrip("/") + "/#histograms&tagFilter=weights%2F0%7Cgrads%2F0",
                       out / "tensorboard-histograms.png", height=1100)
        finally:
            os.kill(pid, signal.SIGTERM)
        page = Path(tmp) / "timeline.html"
        page.write_text(timeline_page(json.loads(trace_path.read_text())))
        screenshot(chromium, page.as_uri(), out / "timeline.png", height=360)
    print(f"wrote {out / 'tensorboard-scalars.png'}, {out / 'tensorboard-histograms.png'} and "
          f"{out / 'timeline.png'}")


if __name__ == "__main__":
    main()

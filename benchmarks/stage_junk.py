"""What small junk sent at full rate by a stranger (no secret) costs a pipeline stage's training, as a
ratio of the steps/s the same two stages make alone in the same run (issue 38: at least 80%).

Two in-process stages of a real cluster (1 server) train, a few ms of busy work a step, for
``--seconds`` alone, then as long again while a stranger process sends junk messages as fast as TCP
takes them; the run repeats ``--repeats`` times and prints each ratio and the median.  It reuses the
second-tier test's harness (tests/integration/test_hardening_stage.py), which also checks memory.

    python benchmarks/stage_junk.py [--seconds 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.conftest import Clusters  # noqa: E402
from tests.integration.test_hardening_stage import junk_during_training  # noqa: E402


def one_run(seconds: float) -> tuple[float, float]:
    """Steps/s alone and under junk, on a fresh cluster torn down after."""
    with tempfile.TemporaryDirectory() as tmp:
        clusters = Clusters(Path(tmp))
        try:
            return junk_during_training(clusters.make, Path(tmp), seconds, grow_limit=24)
        finally:
            clusters.close()


def main() -> None:
    """Run the comparison and print each ratio and the median."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's length (default 10)")
    parser.add_argument("--repeats", type=int, default=3, help="runs (default 3)")
    args = parser.parse_args()
    logging.getLogger("kvstore").setLevel(logging.ERROR)  # the stage logs each second's refused junk
    ratios = []
    for i in range(args.repeats):
        alone, junk = one_run(args.seconds)
        ratios.append(junk / alone)
        print(f"run {i + 1}: {alone:.1f} steps/s alone, {junk:.1f} under junk: {junk / alone:.2f}x",
              flush=True)
    print(f"median: {statistics.median(ratios):.2f}x the steps/s alone (target >= 0.80x)")


if __name__ == "__main__":
    main()

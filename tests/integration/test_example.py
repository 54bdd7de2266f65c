"""The README's first quick-start line: the digits example trains through launch.py -n 4 -s 2."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.timeout(240)
def test_example_reaches_accuracy_through_launcher() -> None:
    """4 workers and 2 servers in dist_sync train the digits MLP to >= 0.90 test accuracy and exit 0."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    result = subprocess.run([sys.executable, "launch.py", "-n", "4", "-s", "2", "examples/train_digits.py"],
                            cwd=REPO, capture_output=True, text=True, timeout=220)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    match = re.search(r"\[worker 0\] final test accuracy (\d\.\d+)", output)
    assert match, output
    assert float(match.group(1)) >= 0.90

"""examples/train_digits_torch_optim.py under launch.py -n 2 -s 1 (DistributedOptimizer over torch.optim)."""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers import finish, launch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_torch_optim_example_reaches_accuracy(optimizer: str) -> None:
    """2 workers and 1 server train the digits MLP with a wrapped torch optimizer to >= 0.90."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    rc, output = finish(launch(["-n", "2", "-s", "1", "examples/train_digits_torch_optim.py",
                                "--optimizer", optimizer, "--epochs", "10"], dict(os.environ)), 100)
    assert rc == 0, output
    match = re.search(r"\[worker 0\] final test accuracy (\d\.\d+)", output)
    assert match, output
    assert float(match.group(1)) >= 0.90
    assert output.count("test accuracy") <= 4, output  # a line per 5 epochs and the final one

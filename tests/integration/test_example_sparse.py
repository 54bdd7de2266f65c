"""examples/train_sparse.py through launch.py: a hashed-feature classifier whose table stays on servers."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.helpers import finish, launch


def _run(args: list[str], timeout: float) -> str:
    rc, output = finish(launch(["-n", "2", "-s", "2", "examples/train_sparse.py", *args], dict(os.environ)),
                        timeout)
    assert rc == 0, output
    return output


@pytest.mark.timeout(90)
def test_sparse_example_trains_a_200k_row_table_in_under_a_minute() -> None:
    """2 workers and 2 servers train the 200k x 16 hashed table to >= 0.85 test accuracy in under 60 s,
    each worker holding only the rows its batches use."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    began = time.monotonic()
    output = _run([], timeout=80)
    assert time.monotonic() - began < 60, output
    accuracy = float(re.search(r"\[worker 0\] final test accuracy (\d\.\d+)", output).group(1))
    assert accuracy >= 0.85, output
    held = [int(n) for n in re.findall(r"rows held (\d+)", output)]
    assert len(held) == 2 and max(held) < 200_000 // 10, output


@pytest.mark.bigtable
@pytest.mark.timeout(600)
def test_sparse_example_10m_rows_worker_rss_below_the_table() -> None:
    """The documented full run: a 10M x 16 table (610 MiB) on 2 servers; each worker's peak RSS stays below
    the table's size (the example's --check-rss exits 1 otherwise)."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    output = _run(["--rows", "10000000", "--check-rss", "--epochs", "2"], timeout=560)
    assert len(re.findall(r"peak RSS (\d+) MiB, table 610 MiB", output)) == 2, output

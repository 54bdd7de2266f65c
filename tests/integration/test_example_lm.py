"""examples/pipeline_lm.py: the language model's smoke run through 2 pipeline stages and in one process,
its bigram baseline and its corpus."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import REPO, finish, launch

pytest.importorskip("torch")


def _example() -> ModuleType:
    """examples/pipeline_lm.py imported as a module (the examples folder is no package)."""
    spec = importlib.util.spec_from_file_location("pipeline_lm", REPO / "examples" / "pipeline_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _losses(output: str, where: str) -> tuple[float, float]:
    """The validation loss and the bigram's (nats/byte) that the run named ``where`` printed."""
    match = re.search(rf"{where}: \d+ steps in [\d.]+ s; validation \(\d+ bytes\) loss (\d+\.\d+) nats/byte"
                      r" = [\d.]+ bits/byte; bigram (\d+\.\d+) nats/byte", output)
    assert match, output
    return float(match.group(1)), float(match.group(2))


def _first_loss(output: str) -> float:
    """The training loss the run printed for its first step (the initial weights on the first batch)."""
    match = re.search(r"step    0  loss (\d+\.\d+)", output)
    assert match, output
    return float(match.group(1))


@pytest.mark.examples  # second tier: the pipeline's parts are tested in test_pipeline_real_models.py
@pytest.mark.timeout(150)
def test_smoke_beats_the_bigram_through_two_stages_and_in_one_process() -> None:
    """--smoke through launch.py in 2 stages (1f1b, the embedding tied to the output projection) and the
    same preset in one process each exit 0 with a validation loss below the bigram's on the same bytes,
    and start from the same model: their first step's loss is the same (the tied output projection built
    on the last stage under the embedding's seed)."""
    env = dict(os.environ)
    staged = launch(["-n", "2", "-s", "1", "examples/pipeline_lm.py", "--smoke"], env)
    alone = subprocess.Popen([sys.executable, "examples/pipeline_lm.py", "--smoke", "--one-process"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # alongside: the two share the machine's cores
    try:
        rc, output = finish(staged, timeout=130)
        assert rc == 0, output
        rc_alone, output_alone = finish(alone, timeout=60)
        assert rc_alone == 0, output_alone
    finally:
        if alone.poll() is None:
            os.killpg(alone.pid, signal.SIGKILL)
            alone.communicate()
    assert "2 workers: 2 stages x 1 replicas, balance [3, 3], 1f1b" in output, output
    staged_loss, bigram = _losses(output, "2 stages")
    alone_loss, bigram_alone = _losses(output_alone, "one process")
    assert bigram == bigram_alone  # the same text, split the same way
    assert staged_loss < bigram and alone_loss < bigram, (staged_loss, alone_loss, bigram)
    assert abs(_first_loss(output) - _first_loss(output_alone)) <= 2e-4, (output, output_alone)


def test_bigram_loss_is_the_add_k_estimate_by_hand() -> None:
    """bigram_loss counts the training text's byte pairs and scores each target given its input byte with
    P(b | a) = (count(a b) + k) / (count(a .) + 256 k)."""
    torch = pytest.importorskip("torch")
    lm = _example()
    train = torch.tensor(list(b"abab"))  # pairs: ab, ba, ab
    inputs, targets = torch.tensor([list(b"ab")]), torch.tensor([list(b"bb")])  # scores P(b|a), P(b|b)
    by_hand = -(math.log((2 + 0.5) / (2 + 256 * 0.5)) + math.log((0 + 0.5) / (1 + 256 * 0.5))) / 2
    assert lm.bigram_loss(train, inputs, targets, k=0.5) == pytest.approx(by_hand, rel=1e-12)


def test_corpus_is_the_sorted_sources_outside_tests_and_site_packages(tmp_path: Path) -> None:
    """corpus concatenates the .py files under a root sorted by path, leaves out test directories,
    site-packages and other suffixes, cuts at the budget, and refuses a budget the files cannot fill."""
    lm = _example()
    for name, text in {"b.py": "B", "a/z.py": "Z", "a/c.py": "C", "a/tests/t.py": "T", "test/u.py": "U",
                       "site-packages/s.py": "S", "notes.txt": "N", "aa.py": "A"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert lm.corpus(4, str(tmp_path)) == b"CZAB"  # a/c.py, a/z.py, aa.py, b.py
    assert lm.corpus(3, str(tmp_path)) == b"CZA"
    with pytest.raises(ValueError, match="fewer than 5"):
        lm.corpus(5, str(tmp_path))

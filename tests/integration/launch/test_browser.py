"""A browser check of --tensorboard (marker ``browser``, deselected by default; run it with
``python -m pytest -m browser tests/integration/launch/test_browser.py``): headless Chromium (Debian's
``chromium``) opens the TensorBoard page of a finished run and renders it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import finish, launch, poll_for
from tests.integration.launch.test_tensorboard import ANNOUNCED, HISTOGRAM_SCRIPT, _alive, _run_job, _tags

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium (apt-get install chromium)")
def test_chromium_renders_the_scalars_of_a_finished_run(tmp_path: Path) -> None:
    """The kept TensorBoard of a finished job serves a page Chromium renders, with the run's scalars."""
    pytest.importorskip("tensorboard")
    url, pid, _ = _run_job(tmp_path / "tb", "--tensorboard-keep")
    try:
        poll_for(lambda: "loss" in _tags(url).get("worker-0", set()), 40, "the worker's loss", interval=0.5)
        shot = tmp_path / "scalars.png"
        argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                "--virtual-time-budget=15000", f"--screenshot={shot}", url.rstrip("/") + "/#timeseries"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=90)
        assert shot.is_file() and shot.stat().st_size > 10_000, done.stderr[-2000:]
        dom = subprocess.run([*argv[:5], "--virtual-time-budget=15000", "--dump-dom", url],
                             capture_output=True, text=True, timeout=90)
        assert "tensorboard" in dom.stdout.lower(), dom.stderr[-2000:]
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
        poll_for(lambda: not _alive(pid), 20, "TensorBoard to stop")


def _histogram_tags(url: str) -> set[str]:
    """worker-0's histogram tags as TensorBoard serves them; empty while it does not answer."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/data/plugin/histograms/tags", timeout=5) as reply:
            body = json.load(reply)
    except (urllib.error.URLError, OSError, ValueError):
        return set()
    return {tag for run, tags in body.items() if run.endswith("worker-0") for tag in tags}


@pytest.mark.skipif(CHROMIUM is None, reason="needs headless Chromium (apt-get install chromium)")
def test_chromium_renders_the_weight_histograms_of_a_finished_run(tmp_path: Path) -> None:
    """KVSTORE_HISTOGRAM_EVERY: the kept TensorBoard serves the workers' histograms, and Chromium renders
    its histograms page."""
    pytest.importorskip("tensorboard")
    env = {**os.environ, "KVSTORE_SHUTDOWN_TIMEOUT": "5", "KVSTORE_HISTOGRAM_EVERY": "2"}
    env.pop("TENSORBOARD_PORT", None)
    proc = launch(["-n", "2", "-s", "1", "--tensorboard", str(tmp_path / "tb"), "--tensorboard-keep",
                   HISTOGRAM_SCRIPT, "20"], env)
    code, out = finish(proc, timeout=60)
    found = ANNOUNCED.findall(out)
    pids = [int(pid) for _, pid in found]
    try:
        assert code == 0 and len(found) == 1, out
        url = found[0][0]
        poll_for(lambda: "weights/net.0.weight" in _histogram_tags(url), 40, "worker 0's histograms",
                 interval=0.5)
        assert "grads/net.2.bias" in _histogram_tags(url)
        shot = tmp_path / "histograms.png"
        argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                "--virtual-time-budget=15000", f"--screenshot={shot}", url.rstrip("/") + "/#histograms"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=90)
        assert shot.is_file() and shot.stat().st_size > 10_000, done.stderr[-2000:]
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
            poll_for(lambda pid=pid: not _alive(pid), 20, "TensorBoard to stop")

"""A browser check of --tensorboard (marker ``browser``, deselected by default; run it with
``python -m pytest -m browser tests/integration/launch/test_browser.py``): headless Chromium (Debian's
``chromium``) opens the TensorBoard page of a finished run and renders it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import poll_for
from tests.integration.launch.test_tensorboard import _alive, _run_job, _tags

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

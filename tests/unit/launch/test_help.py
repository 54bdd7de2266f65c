"""Every entry point answers --help with its own name and exit 0: launch.py, kvstore-launch,
python -m kvstore.node and kvstore-node (a worker command's own --help still reaches the command)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """Run ``argv`` in the repository, without the caller's DMLC_*/KVSTORE_* but with ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_"))}
    return subprocess.run(argv, cwd=REPO, env={**base, **env}, capture_output=True, text=True, timeout=30)


def _as(script_name: str, module: str, argv: list[str]) -> list[str]:
    """A command that runs ``module``'s main with ``sys.argv[0]`` set to ``script_name``, as an
    installed console script of that name would."""
    code = (f"import sys; sys.argv = [{script_name!r}] + {argv!r}; "
            f"from {module} import main; sys.exit(main())")
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_launch_py_help_names_launch_py(flag: str) -> None:
    """``python launch.py --help`` prints its usage under the name launch.py, and the new flags."""
    out = _run([sys.executable, "launch.py", flag])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: launch.py ")
    assert "--env-worker" in out.stdout and "--env-server" in out.stdout


def test_kvstore_launch_help_names_kvstore_launch() -> None:
    """The console script calls itself kvstore-launch (its argv[0]'s basename), not launch.py."""
    out = _run(_as("/usr/local/bin/kvstore-launch", "kvstore.launch.cli", ["--help"]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvstore-launch ")
    installed = shutil.which("kvstore-launch", path=os.path.dirname(sys.executable))
    if installed:  # the real console script, where the package is installed
        real = _run([installed, "--help"])
        assert real.returncode == 0 and real.stdout.startswith("usage: kvstore-launch "), real.stderr


def test_kvstore_launch_usage_error_names_kvstore_launch() -> None:
    """A usage error of kvstore-launch names kvstore-launch too (exit 2)."""
    out = _run(_as("kvstore-launch", "kvstore.launch.cli", ["-n", "0", "x.py"]))
    assert out.returncode == 2 and "kvstore-launch: error: -n and -s must be at least 1" in out.stderr


@pytest.mark.parametrize("role", [None, "worker", "server", "scheduler"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_node_help_with_or_without_dmlc_role(role: str | None, flag: str) -> None:
    """``python -m kvstore.node --help`` prints the usage and exits 0, whatever DMLC_ROLE says."""
    out = _run([sys.executable, "-m", "kvstore.node", flag], **({"DMLC_ROLE": role} if role else {}))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m kvstore.node [-h] [--gpus-per-worker N] CMD [ARGS ...]")
    assert "DMLC_ROLE" in out.stdout and out.stderr == ""


def test_kvstore_node_console_script_names_itself() -> None:
    """Run as the kvstore-node console script, the help says kvstore-node."""
    out = _run(_as("/usr/local/bin/kvstore-node", "kvstore.node", ["--help"]), DMLC_ROLE="worker")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvstore-node [-h] [--gpus-per-worker N] CMD [ARGS ...]")


def test_a_worker_commands_own_help_passes_through() -> None:
    """--help after the command belongs to the worker's command, which gets it unchanged."""
    out = _run([sys.executable, "-m", "kvstore.node", sys.executable, "-c",
                "import sys; print(sys.argv[1:])", "--help"], DMLC_ROLE="worker")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['--help']"


def test_setup_declares_the_kvstore_node_console_script() -> None:
    """setup.py installs kvstore-node (kvstore.node:main) beside kvstore-launch."""
    text = (REPO / "setup.py").read_text()
    assert re.search(r'"kvstore-node=kvstore\.node:main"', text)
    assert re.search(r'"kvstore-launch=kvstore\.launch\.cli:main"', text)

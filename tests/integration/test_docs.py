"""Every ```python block of README.md and docs/*.md runs as a reader would paste it, and every local
``python launch.py`` command in their other code blocks runs as typed.

A page's python blocks run in order, in one fresh interpreter; when one of them creates a dist store
they run as the worker script of ``launch.py -n 1 -s 1``, one cluster per page.  A block that cannot
run here (Slurm, Kubernetes, ssh, Spark, Ray, GPUs, a user's own files, a fragment) carries a
``<!-- no-run: reason -->`` comment on the line before its fence; a block with neither a successful
run nor that comment fails its page's test.  A command another test runs as typed (RUN_ELSEWHERE: the
README's quick start, test_example.py) is checked to be run there instead of twice.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.launch.options import parse_args

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(\S.*?)\s*-->$")
DIST = re.compile(r"""create\(\s*['"](dist_|horovod|byteps)""")
LAUNCH = re.compile(r"(?:^|&&|;)\s*((?:python3? (?:\S*/)?launch\.py|kvstore-launch)\s+-[^&;#]*)")
# Pages whose blocks are known to fail, each with why; they run, and xfail while they fail.
PENDING: dict[str, str] = {}  # page -> why its failure is expected for now (none today)
PAGE_TIMEOUT = 45.0  # seconds for one page's run; the whole file stays under a minute on 2 cores
# Commands another test runs exactly as typed, asserting more than their exit code: not run twice.
RUN_ELSEWHERE = {"python launch.py -n 4 -s 2 examples/train_digits.py":  # the README's quick start
                 ("tests/integration/test_example.py", "test_example_reaches_accuracy_through_launcher")}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page: where it starts, its language, text, and no-run reason."""

    page: Path
    line: int
    lang: str
    code: str
    no_run: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, each with the ``no-run`` reason on the line before its fence."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, lang = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            marker = NO_RUN.match(prev)
            found.append(Block(page, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n",
                               marker.group(1) if marker else None))
            i = end
        i += 1
    return found


def launch_commands(block: Block) -> list[str]:
    """The ``launch.py`` / ``kvstore-launch`` command lines in a shell block (comments dropped)."""
    text = block.code.replace("\\\n", " ")
    return [m.group(1).strip() for line in text.splitlines() for m in LAUNCH.finditer(line)]


def runnable_command(command: str) -> list[str] | None:
    """The launcher's arguments of ``command`` when it can run here: a local launch of a script that
    is in the repository; None for a synopsis, another launcher or a script the repository lacks."""
    words = shlex.split(command)
    args = words[words.index(next(w for w in words if w.endswith(("launch.py", "kvstore-launch")))) + 1:]
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            cfg = parse_args(args)
    except SystemExit:
        return None
    script = next((w for w in cfg.command if w.endswith(".py")), None)
    if cfg.launcher != "local" or script is None or not (REPO / script).is_file():
        return None
    return args


def run(argv: list[str], cwd: Path, timeout: float = PAGE_TIMEOUT) -> tuple[int, str]:
    """Run ``argv`` in its own session; return (exit code, output).  Past ``timeout`` it is sent
    SIGTERM (a launcher then stops its children), then SIGKILL, and the test fails."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVSTORE_CONNECT_TIMEOUT": "30"}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"{shlex.join(argv)} did not finish within {timeout} s:\n{out}") from None
    return proc.returncode, out


def page_script(blocks: list[Block]) -> str:
    """The python blocks of one page as one script, each announced on stderr so a failure names it."""
    parts = ["import sys as _docs_sys\n"]
    for block in blocks:
        parts.append(f"print('@@ block {block.where}', file=_docs_sys.stderr, flush=True)\n")
        parts.append(block.code)
    return "\n".join(parts)


def unmarked(blocks: list[Block]) -> list[str]:
    """Shell blocks with a launch.py command that cannot run here and no ``no-run`` comment."""
    return [f"{b.where}: {c!r}" for b in blocks if b.lang != "python" and b.no_run is None
            for c in launch_commands(b) if runnable_command(c) is None]


def runs_elsewhere(command: str, args: list[str]) -> bool:
    """Whether the test RUN_ELSEWHERE names for ``command`` exists and launches exactly ``args``."""
    path, name = RUN_ELSEWHERE[command]
    source = (REPO / path).read_text()
    return f"def {name}(" in source and "[" + ", ".join(f'"{a}"' for a in args) + "]" in source


def test_the_parser_sees_markers_commands_and_dist_pages():
    """blocks_of reads fences and their no-run comments; commands and dist stores are told apart."""
    readme = blocks_of(REPO / "README.md")
    assert readme[0].lang == "" and readme[1].lang == "python" and readme[1].no_run is None
    assert any(b.no_run for b in readme)
    quick = launch_commands(readme[0])
    assert quick == ["python launch.py -n 4 -s 2 examples/train_digits.py"]
    assert runnable_command(quick[0]) == ["-n", "4", "-s", "2", "examples/train_digits.py"]
    assert runnable_command("python launch.py -n W [-s S] CMD") is None
    assert runnable_command("python launch.py -n 2 --launcher ray train.py") is None
    assert runnable_command("python launch.py -n 2 no_such_script.py") is None
    assert DIST.search(readme[1].code) and not DIST.search("kvstore.create('local')")
    assert runs_elsewhere(quick[0], runnable_command(quick[0]))
    assert not runs_elsewhere(quick[0], ["-n", "2", "-s", "2", "examples/train_digits.py"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_page_runs(page: Path, tmp_path: Path) -> None:
    """The page's unmarked python blocks run in order without error, its local launch.py commands
    exit 0, and every block that cannot run here says why in a no-run comment."""
    blocks = blocks_of(page)
    assert unmarked(blocks) == [], "add <!-- no-run: reason --> before these blocks, or fix them"
    python = [b for b in blocks if b.lang == "python" and b.no_run is None]
    if python:
        script = tmp_path / "doc_blocks.py"
        script.write_text(page_script(python))
        argv = [sys.executable, str(script)]
        if any(DIST.search(b.code) for b in python):
            argv = [sys.executable, str(REPO / "launch.py"), "-n", "1", "-s", "1", str(script)]
        code, out = run(argv, tmp_path)
        name = str(page.relative_to(REPO))
        if code != 0 and name in PENDING:
            pytest.xfail(PENDING[name])
        assert code == 0, f"{page.relative_to(REPO)}'s python blocks failed (exit {code}):\n{out}"
    for block in blocks:
        for command in launch_commands(block) if block.no_run is None else ():
            args = runnable_command(command)
            if command in RUN_ELSEWHERE:
                assert runs_elsewhere(command, args), f"{block.where}: {command!r} is run by no test"
                continue
            code, out = run([sys.executable, "launch.py", *args], REPO)
            assert code == 0, f"{block.where}: {command!r} exited {code}:\n{out}"


def test_the_readme_second_tier_runs_every_marker_addopts_deselects():
    """README's second-tier command selects exactly the markers pyproject.toml's addopts deselects."""
    addopts = re.search(r"^addopts = .*-m '([^']*)'", (REPO / "pyproject.toml").read_text(), re.M)
    deselected = set(re.findall(r"\bnot (\w+)", addopts.group(1)))
    command = next(line.split("#")[0] for b in blocks_of(REPO / "README.md") for line in b.code.splitlines()
                   if line.endswith("# the second tier"))
    words = shlex.split(command)
    expression = words[len(words) - words[::-1].index("-m")]  # after the last -m (python -m pytest -m ...)
    assert deselected and set(expression.split()) - {"or"} == deselected

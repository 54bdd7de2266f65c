"""Shared test helpers (imported as tests.helpers): deadline polls and real child processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def poll_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Return ``predicate()`` once it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)  # polling interval of a deadline-bounded wait, not a wait for a condition


def run_parallel(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list[Any]:
    """Run each callable in its own thread; return their results in order (re-raising errors)."""
    with ThreadPoolExecutor(max_workers=max(1, len(fns))) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=timeout) for f in futures]


class Processes:
    """Child processes whose output goes to files, all killed and joined at teardown."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Start ``argv`` with ``env`` added to this environment; its output goes to a log file."""
        log = self.workdir / f"{name.replace(' ', '_')}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
        self.procs.append((name, proc, log))
        return proc

    def output(self) -> str:
        """Everything the children printed, each block headed by the child's name."""
        return "\n".join(f"--- {name} (rc={proc.poll()})\n{log.read_text(errors='replace')}"
                         for name, proc, log in self.procs if log.exists())

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` for the children to exit, then kill and join the rest."""
        deadline = time.monotonic() + timeout
        for _, proc, _ in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def python() -> str:
    """The interpreter running the tests (children use the same one)."""
    return sys.executable


def tagged_pids(tag: str) -> list[int]:
    """Pids of live processes (other than this one) whose environment carries ``tag``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return [p for p in pids if p != os.getpid()]


def launch(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python launch.py ARGS`` in the repository in a session of its own, output merged."""
    return subprocess.Popen([sys.executable, "launch.py", *args], cwd=REPO,
                            env=dict(os.environ) if env is None else env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    """Wait for a :func:`launch`; return (exit code, output).  Past ``timeout`` its whole process
    group is killed and the test fails with the output so far."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"launcher did not finish within {timeout} s:\n{out}") from None
    return proc.returncode, out


def cuda_devices(count: int) -> list[str]:
    """``count`` CUDA device names, cycling over the GPUs there are (several on one GPU if need be).

    Skips the calling test when torch has no CUDA.
    """
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    return [f"cuda:{i % torch.cuda.device_count()}" for i in range(count)]


def read_exactly(sock: socket.socket, n: int, closed: str = "the peer closed the connection") -> bytes:
    """The next ``n`` bytes of ``sock`` (its timeout applies to each read); ConnectionError(``closed``)
    when the peer closes first."""
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError(closed)
        data += more
    return data


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM ``proc``, wait up to ``timeout`` for it, then SIGKILL it and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

"""Start a whole cluster on this machine and supervise it: ``python launch.py -n W -s S CMD``.

parse -> :class:`LaunchConfig` -> start scheduler (port 0, reported through a
file), servers and workers, each in its own process group -> supervise: exit
0 when every worker exits 0; when any process fails, SIGTERM every group, wait
one shared deadline, SIGKILL the rest and exit with the failed process's code.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from . import config as kvconfig
from . import snapshot
from .errors import ConfigError
from .node import python_if_script

log = logging.getLogger("kvstore.launcher")


@dataclass(frozen=True)
class LaunchConfig:
    """What to start: ``num_workers`` workers running ``command`` and ``num_servers`` servers."""

    num_workers: int
    num_servers: int
    command: list[str]
    launcher: str = "local"
    env: dict[str, str] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Parse the command line (MXNet's tools/launch.py flags)."""
    parser = argparse.ArgumentParser(
        prog="launch.py", description="Start a kvstore cluster (1 scheduler, S servers, W workers) "
        "on this machine and run COMMAND on every worker.")
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers")
    parser.add_argument("-s", "--num-servers", type=int, help="number of servers (default: -n)")
    parser.add_argument("--launcher", choices=["local"], default="local",
                        help="how to start processes (only 'local' for now)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment variable for every process (repeatable)")
    parser.add_argument("--resume", metavar="DIR",
                        help="start from the snapshot kv.save_checkpoint(DIR) wrote (any number of servers)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker's command")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the command every worker runs, e.g. train.py")
    if args.num_workers < 1 or (args.num_servers is not None and args.num_servers < 1):
        parser.error("-n and -s must be at least 1")
    extra = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env {item!r} is not NAME=VALUE")
        extra[name] = value
    if args.resume is not None:
        if not os.path.isfile(os.path.join(args.resume, snapshot.POINTER)):
            parser.error(f"--resume {args.resume}: no snapshot there (no LATEST file); "
                         "take one with kv.save_checkpoint(dir)")
        extra["KVSTORE_RESUME"] = os.path.abspath(args.resume)
    return LaunchConfig(args.num_workers, args.num_servers or args.num_workers,
                        list(args.command), args.launcher, extra)


class Child:
    """One started process, its role and rank, and the thread that prefixes its output."""

    def __init__(self, role: str, rank: int | None, argv: list[str], env: dict[str, str],
                 out_lock: threading.Lock, exits: queue.SimpleQueue) -> None:
        self.role, self.rank = role, rank
        self.name = role if rank is None else f"{role} {rank}"
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._reader = threading.Thread(target=self._pump, args=(out_lock,), daemon=True)
        self._reader.start()
        # Exit is watched apart from the output: a grandchild may hold the pipe open for long.
        threading.Thread(target=self._watch, args=(exits,), daemon=True).start()

    def _pump(self, out_lock: threading.Lock) -> None:
        prefix = f"[{self.name}] ".encode()
        for line in iter(self.proc.stdout.readline, b""):
            with out_lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    def _watch(self, exits: queue.SimpleQueue) -> None:
        self.proc.wait()
        exits.put(self)

    @property
    def exit_code(self) -> int | None:
        """The shell-style exit code (128 + signal when killed by one), or None while running."""
        rc = self.proc.poll()
        return None if rc is None else (128 - rc if rc < 0 else rc)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (its own children too, even if it exited)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def join(self, timeout: float) -> None:
        """Wait for the output pump to finish."""
        self._reader.join(timeout)


class Cluster:
    """The children of one launch and their supervision."""

    def __init__(self, cfg: LaunchConfig, settings: kvconfig.Config) -> None:
        self.cfg, self.settings = cfg, settings
        self.children: list[Child] = []
        self.exits: queue.SimpleQueue = queue.SimpleQueue()
        self.out_lock = threading.Lock()
        self.base_env = {
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NUM_WORKER": str(cfg.num_workers),
            "DMLC_NUM_SERVER": str(cfg.num_servers), "PYTHONUNBUFFERED": "1",
            "KVSTORE_SECRET": settings.secret or secrets.token_hex(32), **cfg.env}

    def _start(self, role: str, rank: int | None, argv: list[str], extra: dict[str, str],
               defaults: dict[str, str] | None = None) -> Child:
        env = kvconfig.child_environ({**self.base_env, "DMLC_ROLE": role, **extra}, defaults=defaults)
        child = Child(role, rank, argv, env, self.out_lock, self.exits)
        self.children.append(child)
        return child

    def start(self, workdir: str) -> None:
        """Start the scheduler, learn its port, then start servers and workers."""
        port_file = os.path.join(workdir, "scheduler.port")
        scheduler = self._start("scheduler", None, [sys.executable, "-m", "scheduler"],
                                {"DMLC_PS_ROOT_PORT": "0", "KVSTORE_PORT_FILE": port_file})
        port = self._wait_port(port_file, scheduler)
        self.base_env["DMLC_PS_ROOT_PORT"] = str(port)
        log.info("scheduler on 127.0.0.1:%d; starting %d servers and %d workers",
                 port, self.cfg.num_servers, self.cfg.num_workers)
        for rank in range(self.cfg.num_servers):
            self._start("server", rank, [sys.executable, "-m", "kvstore.server"],
                        {"KVSTORE_SERVER_ID": str(rank)})
        worker_argv = python_if_script(self.cfg.command)
        for rank in range(self.cfg.num_workers):
            self._start("worker", rank, worker_argv, {"DMLC_WORKER_ID": str(rank)},
                        defaults={"OMP_NUM_THREADS": "1"})  # unless the launcher's env or --env sets it

    def _wait_port(self, path: str, scheduler: Child) -> int:
        deadline = time.monotonic() + self.settings.connect_timeout
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as fh:
                    return int(fh.read().strip())
            try:
                failed = self.exits.get(timeout=0.05)
            except queue.Empty:
                continue
            raise ChildFailed(failed)
        raise TimeoutError(f"the scheduler did not report its port within "
                           f"{self.settings.connect_timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")

    def supervise(self) -> int:
        """Wait until every worker exits 0 (return 0) or any process fails (raise ChildFailed)."""
        workers_left = self.cfg.num_workers
        while workers_left:
            child = self.exits.get()
            if child.exit_code != 0:
                raise ChildFailed(child)
            # the scheduler and servers exit 0 once every worker has left, maybe before they exit
            workers_left -= child.role == "worker"
        deadline = time.monotonic() + self.settings.shutdown_timeout
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit within %g s of the workers; stopping it",
                            child.name, self.settings.shutdown_timeout)
        return 0

    def stop_all(self) -> list[str]:
        """SIGTERM every group, wait one shared deadline, SIGKILL the rest; return who was killed."""
        for child in self.children:
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout
        killed = []
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.signal(signal.SIGKILL)
                child.proc.wait()
                killed.append(child.name)
        for child in self.children:
            child.join(5.0)
        return killed


class ChildFailed(Exception):
    """A child process exited when it should not have (or with a non-zero code)."""

    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with code {child.exit_code}")
        self.child = child


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signum)


def run(cfg: LaunchConfig, settings: kvconfig.Config | None = None) -> int:
    """Launch ``cfg`` and supervise it to the end; return the launcher's exit code."""
    settings = settings or kvconfig.load()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    cluster: Cluster | None = None
    code = 0
    try:
        cluster = Cluster(cfg, settings)
        with tempfile.TemporaryDirectory(prefix="kvstore-launch-") as workdir:
            cluster.start(workdir)
            code = cluster.supervise()
    except ChildFailed as exc:
        code = exc.child.exit_code
        log.error("%s; stopping the other processes", exc)
    except KeyboardInterrupt as exc:
        sig = exc.args[0] if exc.args else signal.SIGINT
        code = 128 + int(sig)
        log.error("interrupted; stopping every process")
    except TimeoutError as exc:
        code = 1
        log.error("%s", exc)
    except OSError as exc:  # the command does not exist or cannot be executed
        code = 127
        log.error("cannot start %s: %s", " ".join(cfg.command), exc)
    finally:
        killed = cluster.stop_all() if cluster is not None else []
        if killed:
            log.error("killed after %g s: %s", settings.shutdown_timeout, ", ".join(killed))
        signal.signal(signal.SIGTERM, previous)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``launch.py`` and ``kvstore-launch``."""
    logging.basicConfig(level=logging.INFO, format="[launcher] %(levelname)s %(message)s")
    cfg = parse_args(argv)
    try:
        settings = kvconfig.load()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    log.info("starting 1 scheduler, %d servers, %d workers: %s", cfg.num_servers, cfg.num_workers,
             " ".join(cfg.command))
    return run(cfg, settings)

"""Start a whole cluster and supervise it: ``python launch.py -n W -s S [--launcher ssh -H hosts] CMD``.

parse -> :class:`LaunchConfig` -> (ssh: rsync the working directory to the hosts when asked) ->
start the scheduler here (port 0, reported through a file), then servers and workers, each in its
own process group here, or on the hosts over ssh under a :mod:`kvstore.launch.tether` (at most
:data:`SSH_STARTING_PER_HOST` ssh logins to one host at a time) -> supervise: exit 0 when every
worker exits 0; when any process fails, stop every child (SIGTERM to a local group, EOF on a remote
tether's stdin), wait (``KVSTORE_SHUTDOWN_TIMEOUT`` from then for a local child; for a remote one
the longer of that and its tether's own grace, plus :data:`SSH_STOP_MARGIN`), SIGKILL the rest
and exit with the failed process's code.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import queue
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore import config as kvconfig
from kvstore.core import snapshot
from kvstore.errors import ConfigError
from kvstore.launch import envrules as roles
from kvstore.launch import tether
from kvstore.launch.node import python_if_script
from kvstore.net import address

log = logging.getLogger("kvstore.launcher")
H = TypeVar("H")

# sshd's default MaxStartups 10:30:100 drops new connections at random once 10 are not yet logged in:
# at most this many ssh clients to one host are started and not yet through (their tether said
# tether.STARTED, so the login is over); the next one starts when one of them is through or has exited.
SSH_STARTING_PER_HOST = 8
# How long past a remote tether's own grace the launcher waits before it kills the ssh client: the
# tether's grace runs from when the end of file reaches it, across the network.
SSH_STOP_MARGIN = 5.0
# Liveness of every ssh connection (and rsync's): a host that stops answering ends ssh with code 255
# after ServerAliveInterval * ServerAliveCountMax seconds (a minute) instead of TCP's hours.
SSH_ALIVE_INTERVAL, SSH_ALIVE_COUNT = 15, 4


@dataclass(frozen=True)
class LaunchConfig:
    """What to start: ``num_workers`` workers running ``command`` and ``num_servers`` servers."""

    num_workers: int
    num_servers: int
    command: list[str]
    launcher: str = "local"
    env: dict[str, str] = field(default_factory=dict)
    hosts: list[tuple[str, int | None]] = field(default_factory=list)  # ssh: (host, ssh port)
    sync_dst_dir: str | None = None  # ssh: rsync this directory there first and run from it
    ssh_args: list[str] = field(default_factory=list)  # ssh: extra options for ssh and rsync
    remote_python: str | None = None  # ssh: the Python on the hosts (default: this one's path)
    host_ip: str | None = None  # ssh: the scheduler's address as the hosts reach it
    ray_address: str | None = None  # ray: the cluster to join (default: start a local one)
    ray_options: dict[str, float] = field(default_factory=dict)  # ray: server_cpus, ..., placement_timeout


def parse_hostfile(path: str) -> list[tuple[str, int | None]]:
    """Read an MXNet-style host file: one ``host`` or ``host:port`` (ssh port) per line; an IPv6
    address with a port is written ``[addr]:port`` (``[addr]`` and a bare ``addr`` work too).

    Blank lines and ``#`` comments are skipped.  Raises ConfigError for an
    unreadable or empty file or a bad entry or port.
    """
    try:
        with open(path) as fh:
            lines = fh.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"-H {path}: {exc.strerror}") from None
    hosts: list[tuple[str, int | None]] = []
    for number, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            host, port = address.split_login(entry)
        except ValueError:
            port = ""  # reported below
        if port is None:
            hosts.append((host, None))
            continue
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"-H {path} line {number}: {entry!r} is not host, host:port or [addr]:port")
        hosts.append((host, int(port)))
    if not hosts:
        raise ConfigError(f"-H {path}: no hosts in it")
    return hosts


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Parse the command line (MXNet's tools/launch.py flags)."""
    parser = argparse.ArgumentParser(
        prog="launch.py", description="Start a kvstore cluster (1 scheduler, S servers, W workers) "
        "on this machine, or over ssh on the hosts of -H, and run COMMAND on every worker.")
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers")
    parser.add_argument("-s", "--num-servers", type=int, help="number of servers (default: -n)")
    parser.add_argument("--launcher", choices=["local", "ssh", "ray"], default="local",
                        help="how to start processes: 'local' (this machine, the default), 'ssh' "
                        "(the hosts of -H) or 'ray' (actors on a Ray cluster; needs the [ray] extra)")
    parser.add_argument("-H", "--hostfile", help="ssh: file of hosts, one 'host' or 'host:sshport' a line; "
                        "process i (servers first, then workers) runs on host i %% len(hosts)")
    parser.add_argument("--sync-dst-dir", metavar="DIR", help="ssh: rsync the current directory to DIR "
                        "on every host first, and run there")
    parser.add_argument("--ssh-args", default="", metavar="ARGS",
                        help="ssh: extra options for ssh and rsync, one string, "
                        "e.g. \"-i key -o BatchMode=yes\"")
    parser.add_argument("--remote-python", metavar="PATH",
                        help="ssh: the Python to run on the hosts (default: this one's path)")
    parser.add_argument("--host-ip", metavar="ADDR", help="ssh: the address the hosts reach this machine's "
                        "scheduler at (default: this machine's address on the route to the first host)")
    parser.add_argument("--ray-address", metavar="ADDR", help="ray: the cluster to join, as ray.init takes "
                        "it (default: start a local Ray instance for this job)")
    for flag, what in (("--ray-server-cpus", "CPUs each server's actor reserves (default 0.1)"),
                       ("--ray-worker-cpus", "CPUs each worker's actor reserves (default 0.1)"),
                       ("--ray-worker-gpus", "GPUs each worker's actor reserves (default 0)"),
                       ("--ray-placement-timeout", "seconds to place and create every role (default 60)")):
        parser.add_argument(flag, type=float, metavar="N", help=f"ray: {what}")
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
    hosts: list[tuple[str, int | None]] = []
    if args.launcher == "ssh":
        if not args.hostfile:
            parser.error("--launcher ssh needs -H HOSTFILE")
        try:
            hosts = parse_hostfile(args.hostfile)
        except ConfigError as exc:
            parser.error(str(exc))
    else:
        ssh_only = (("-H", args.hostfile), ("--sync-dst-dir", args.sync_dst_dir),
                    ("--ssh-args", args.ssh_args), ("--remote-python", args.remote_python),
                    ("--host-ip", args.host_ip))
        given = [flag for flag, value in ssh_only if value]
        if given:
            parser.error(f"{', '.join(given)} only apply to --launcher ssh")
    given = (("server_cpus", args.ray_server_cpus), ("worker_cpus", args.ray_worker_cpus),
             ("worker_gpus", args.ray_worker_gpus), ("placement_timeout", args.ray_placement_timeout))
    ray_options = {name: value for name, value in given if value is not None}
    if (args.ray_address or ray_options) and args.launcher != "ray":
        parser.error("--ray-* flags only apply to --launcher ray")
    positive = ("server_cpus", "worker_cpus", "placement_timeout")  # an actor needs some CPU to be placed
    if (any(not ray_options.get(name, 1) > 0 for name in positive)
            or not ray_options.get("worker_gpus", 0) >= 0):
        parser.error("--ray-server-cpus, --ray-worker-cpus and --ray-placement-timeout must be > 0, "
                     "--ray-worker-gpus >= 0")
    return LaunchConfig(args.num_workers, args.num_servers or args.num_workers,
                        list(args.command), args.launcher, extra, hosts=hosts,
                        sync_dst_dir=args.sync_dst_dir, ssh_args=shlex.split(args.ssh_args),
                        remote_python=args.remote_python, host_ip=args.host_ip,
                        ray_address=args.ray_address, ray_options=ray_options)


def placement(num_servers: int, num_workers: int, hosts: Sequence[H]) -> list[tuple[str, int, H]]:
    """Return ``(role, rank, host)`` for every server, then every worker: process i runs on
    ``hosts[i % len(hosts)]`` (dmlc's ssh launcher's order).  Raises ValueError without hosts."""
    if not hosts:
        raise ValueError("placement needs at least one host")
    roles = [("server", rank) for rank in range(num_servers)]
    roles += [("worker", rank) for rank in range(num_workers)]
    return [(role, rank, hosts[i % len(hosts)]) for i, (role, rank) in enumerate(roles)]


def _bracketed(name: str) -> str:
    """``user@addr`` with an IPv6 ``addr`` as ``user@[addr]`` (so a ``:`` after it is not read as its own)."""
    user, at, node = name.rpartition("@")
    return f"{user}{at}[{node}]" if ":" in node else name


def host_label(host: tuple[str, int | None]) -> str:
    """``host`` or ``host:port`` as the hostfile wrote it, ``[addr]:port`` for IPv6 (for messages)."""
    name, port = host
    return name if port is None else f"{_bracketed(name)}:{port}"


def node_name(host: str) -> str:
    """The machine part of an ssh destination: ``user@node`` -> ``node``."""
    return host.rpartition("@")[2]


def ssh_options(port: int | None, ssh_args: list[str], connect_timeout: float) -> list[str]:
    """``[-p PORT] SSH_ARGS`` and then the launcher's defaults: ``-o BatchMode=yes`` (never prompt),
    ``-o ConnectTimeout=`` ``connect_timeout`` rounded up (seconds to connect), ``-o ServerAliveInterval=15
    -o ServerAliveCountMax=4`` (a host that stops answering ends ssh after a minute).  ``ssh_args``
    come first, so the user's value of an option wins (ssh keeps the first value)."""
    return [*(["-p", str(port)] if port is not None else []), *ssh_args, "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={max(1, math.ceil(connect_timeout))}",
            "-o", f"ServerAliveInterval={SSH_ALIVE_INTERVAL}", "-o", f"ServerAliveCountMax={SSH_ALIVE_COUNT}"]


def ssh_command(host: tuple[str, int | None], ssh_args: list[str], remote: str,
                connect_timeout: float = kvconfig.DEFAULT_CONNECT_TIMEOUT) -> list[str]:
    """Return the ssh client's argv that runs the shell command ``remote`` on ``host``:
    ``ssh`` :func:`ssh_options` ``HOST REMOTE``."""
    name, port = host
    return ["ssh", *ssh_options(port, ssh_args, connect_timeout), name, remote]


def remote_command(directory: str, python: str, grace: float) -> str:
    """The shell command ssh runs on a host: a tether in ``directory`` under ``python``.

    Only the tether's own stop grace (``KVSTORE_SHUTDOWN_TIMEOUT``, not a secret) is on this line;
    the role's argv and environment travel on the tether's stdin.  Every word is shell-quoted.
    """
    return (f"cd {shlex.quote(directory)} && exec env KVSTORE_SHUTDOWN_TIMEOUT={grace:g} "
            f"{shlex.quote(python)} -m kvstore.launch.tether")


def remote_environ(extra: Mapping[str, str], node: str, environ: Mapping[str, str] | None = None,
                   defaults: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return what a remote role's environment gets on top of its host's own (the ssh login's).

    ``defaults`` < :func:`kvstore.roles.forwarded` of ``environ`` (default: the launcher's; its
    ``KVSTORE_*``, ``DMLC_*`` and ``OMP_NUM_THREADS`` but the per-role ones) < ``extra``; then
    ``DMLC_NODE_HOST=node``, unless ``DMLC_INTERFACE`` is set (the role then binds that interface's
    address).  Nothing else of ``environ`` is sent.
    """
    source = kvconfig.child_environ({}) if environ is None else environ  # {} -> the launcher's own
    env = kvconfig.child_environ(extra, environ=roles.forwarded(source), defaults=defaults)
    return roles.with_node_host(env, node)


def rsync_command(host: tuple[str, int | None], ssh_args: list[str], source: str, dest: str,
                  connect_timeout: float = kvconfig.DEFAULT_CONNECT_TIMEOUT) -> list[str]:
    """Return ``rsync -az`` of ``source``'s content into ``dest`` on ``host`` over the same ssh (with the
    same :func:`ssh_options`); an IPv6 address is bracketed in the destination, as rsync wants."""
    name, port = host
    shell = shlex.join(["ssh", *ssh_options(port, ssh_args, connect_timeout)])
    return ["rsync", "-az", "-e", shell, source.rstrip("/") + "/", f"{_bracketed(name)}:{dest}"]


def tether_grace(env: Mapping[str, str], default: float) -> float:
    """The grace a remote tether gives its role between SIGTERM and SIGKILL, given ``env``, the
    environment the launcher sends it: its ``KVSTORE_SHUTDOWN_TIMEOUT``, else ``default`` (the value
    :func:`remote_command` puts on the tether's command line).  An invalid value makes the tether
    refuse the request at once, so ``default`` is returned for it."""
    try:
        return kvconfig.load({"KVSTORE_SHUTDOWN_TIMEOUT": env.get("KVSTORE_SHUTDOWN_TIMEOUT")
                              or f"{default:g}"}).shutdown_timeout
    except ConfigError:
        return default


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for a ``with`` block, then deliver those that came (once each) to the
    handlers there were: e.g. a Ctrl-C then raises KeyboardInterrupt after the block, not inside it.

    Done by swapping the Python handlers (which always run in the main thread), not by a signal
    mask (which would not stop another thread from taking the signal).  Outside the main thread,
    where handlers cannot be set, nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous: dict[int, object] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):  # one at a time: a signal between them still restores
            previous[sig] = signal.signal(sig, lambda signum, _frame: held.append(signum))
        yield
    finally:
        interrupted = _restore_handlers(previous)
        if interrupted is not None:
            raise interrupted
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


def _restore_handlers(previous: dict[int, object]) -> BaseException | None:
    """Put back every handler of ``previous``; return the exception a restored handler raised for a
    signal that came meanwhile (the others are put back first), or None."""
    left = dict(previous)
    raised: BaseException | None = None
    while left:
        try:
            while left:
                sig, handler = next(iter(left.items()))
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
                del left[sig]
        except BaseException as exc:  # noqa: BLE001 -- e.g. KeyboardInterrupt from a restored handler
            raised = raised or exc
    return raised


class SyncFailed(Exception):
    """rsync of the working directory to a host failed; ``code`` is rsync's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def sync_dir(hosts: list[tuple[str, int | None]], ssh_args: list[str], source: str, dest: str,
             connect_timeout: float = kvconfig.DEFAULT_CONNECT_TIMEOUT) -> None:
    """rsync ``source`` into ``dest`` on every distinct host, in parallel.

    There is no overall deadline (a copy takes as long as its size needs); a stalled one is ended by
    the ssh options (:func:`ssh_options`: ``connect_timeout`` to connect, a minute of silence from
    the host), and an interrupt ends the wait.  Raises SyncFailed (with rsync's output and code) when
    any fails; rsync processes still running then (or on an interrupt) are killed and reaped.
    """
    procs: list[tuple[tuple[str, int | None], subprocess.Popen]] = []
    try:
        for host in dict.fromkeys(hosts):
            log.info("rsync %s/ to %s on %s", source.rstrip("/"), dest, host_label(host))
            try:
                with held_interrupts():  # an interrupt comes after the append, so the kill below sees it
                    procs.append((host, subprocess.Popen(
                        rsync_command(host, ssh_args, source, dest, connect_timeout),
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        start_new_session=True)))
            except OSError as exc:
                raise SyncFailed(f"cannot start rsync for --sync-dst-dir: {exc}", 127) from None
        for host, proc in procs:
            out = proc.communicate()[0].decode(errors="replace").strip()
            if proc.returncode:
                code = roles.exit_code(proc.returncode)
                raise SyncFailed(f"--sync-dst-dir: rsync to {dest} on {host_label(host)} exited with code "
                                 f"{code}: {out or '(no output)'}", code)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


class Child:
    """One started process (a local role, or the ssh client of a remote one), its role and rank,
    and the thread that prefixes its output.

    ``host`` is None for a local child: it is stopped with SIGTERM to its process group.  For a
    remote one it names the host, and ``proc`` is the ssh client running a tether there (asked to
    announce itself): it is stopped by closing the tether's stdin (the tether stops the role and
    exits, so ssh exits), and ``tether_grace`` is how long that tether gives the role before SIGKILL.
    ``started`` is set once the child is past starting: at once for a local child; for a remote one
    when the tether's :data:`kvstore.launch.tether.STARTED` line arrives (it is not printed), or ssh exits.
    """

    def __init__(self, role: str, rank: int | None, proc: subprocess.Popen, out_lock: threading.Lock,
                 exits: queue.SimpleQueue, host: tuple[str, int | None] | None = None,
                 tether_grace: float = 0.0) -> None:
        self.role, self.rank, self.proc, self.host = role, rank, proc, host
        self.tether_grace = tether_grace
        self.name = role if rank is None else f"{role} {rank}"
        self.started = threading.Event()
        if host is None:
            self.started.set()
        self.exited = threading.Event()
        self._code: int | None = None
        self._reader = threading.Thread(target=self._pump, args=(out_lock,), daemon=True)
        self._reader.start()
        # Exit is watched apart from the output: a grandchild may hold the pipe open for long.
        threading.Thread(target=self._watch, args=(exits,), daemon=True).start()

    def _pump(self, out_lock: threading.Lock) -> None:
        prefix = f"[{self.name}] ".encode()
        announced = self.host is None  # a remote tether's first line of its own is STARTED
        for line in iter(self.proc.stdout.readline, b""):
            if not announced and line.endswith(tether.STARTED):
                announced = True  # the tether's line, maybe after a partial line of the login's
                self.started.set()
                line = line[: -len(tether.STARTED)]
                if not line:
                    continue
                line += b"\n"
            with out_lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    def _watch(self, exits: queue.SimpleQueue) -> None:
        # WNOWAIT: the exit is seen but the child stays a zombie until reap(), so its pid (its process
        # group's id) cannot be reused meanwhile and signals to the group cannot reach a stranger
        info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        self._code = info.si_status if info.si_code == os.CLD_EXITED else 128 + info.si_status
        self.exited.set()
        self.started.set()
        exits.put(self)

    @property
    def exit_code(self) -> int | None:
        """The shell-style exit code (128 + signal when killed by one), or None while running."""
        return self._code

    def reap(self) -> None:
        """Collect the exited child (after its group has been dealt with); its pid may then be reused."""
        self.exited.wait()
        self.proc.wait()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (its own children too, even if it exited)."""
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def stop(self) -> None:
        """Ask the child to stop: SIGTERM to a local group; EOF on a remote tether's stdin."""
        if self.host is None:
            self.signal(signal.SIGTERM)
        else:
            tether.release(self.proc)

    def kill(self) -> None:
        """SIGKILL the local group (for a remote child: the ssh client's; the connection's end stops
        the remote tether, which stops the role)."""
        self.signal(signal.SIGKILL)

    def join(self, timeout: float) -> None:
        """Wait for the output pump to finish."""
        self._reader.join(timeout)


class Cluster:
    """The children of one launch and their supervision (local and ssh children alike)."""

    def __init__(self, cfg: LaunchConfig, settings: kvconfig.Config) -> None:
        self.cfg, self.settings = cfg, settings
        self.children: list[Child] = []
        self.exits: queue.SimpleQueue = queue.SimpleQueue()
        self.out_lock = threading.Lock()
        self.base_env = {
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NUM_WORKER": str(cfg.num_workers),
            "DMLC_NUM_SERVER": str(cfg.num_servers), "PYTHONUNBUFFERED": "1",
            "KVSTORE_SECRET": settings.secret or secrets.token_hex(32), **cfg.env}
        # a local child inherits the launcher's environment, but for what the launcher sets per role
        # (a KVSTORE_NODE_PORT exported here would make every server bind one port)
        self.inherited = roles.inherited(kvconfig.child_environ({}))

    def _start(self, role: str, rank: int | None, argv: list[str], extra: dict[str, str],
               defaults: dict[str, str] | None = None, host: tuple[str, int | None] | None = None) -> Child:
        """Start ``argv`` as ``role`` here, or on ``host`` over ssh under a tether (once
        :meth:`_wait_ssh_slot` allows).  SIGINT and SIGTERM are held from the start until the child is
        in ``children``, so an interrupt never leaves one unstopped.  Raises StartFailed, and for ssh
        what :meth:`_wait_ssh_slot` raises."""
        extra = {**self.base_env, "DMLC_ROLE": role, **extra}
        name = role if rank is None else f"{role} {rank}"
        piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "start_new_session": True}
        grace = 0.0
        if host is not None:
            env = remote_environ(extra, node_name(host[0]), defaults=defaults)
            grace = tether_grace(env, self.settings.shutdown_timeout)
            remote = remote_command(self.cfg.sync_dst_dir or os.getcwd(), self.cfg.remote_python
                                    or sys.executable, self.settings.shutdown_timeout)
            via = ssh_command(host, self.cfg.ssh_args, remote, self.settings.connect_timeout)
            self._wait_ssh_slot(host)
        with held_interrupts():
            try:
                if host is None:
                    env = kvconfig.child_environ(extra, environ=self.inherited, defaults=defaults)
                    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **piped)
                else:
                    proc = tether.spawn(argv, env, via=via, announce=True, **piped)
            except OSError as exc:
                what = shlex.join(argv) if host is None else "ssh"
                raise StartFailed(f"cannot start {what} ({name}): {exc}") from None
            child = Child(role, rank, proc, self.out_lock, self.exits, host=host, tether_grace=grace)
            self.children.append(child)
        return child

    def _wait_ssh_slot(self, host: tuple[str, int | None]) -> None:
        """Return once fewer than :data:`SSH_STARTING_PER_HOST` ssh clients to ``host``'s machine (its
        name without ``user@``, and port) are not yet ``started``, so sshd's MaxStartups is not hit.

        Raises ChildFailed when a child exits non-zero meanwhile, TimeoutError when no ssh client to
        that host gets through within ``KVSTORE_CONNECT_TIMEOUT``.
        """
        def machine(entry: tuple[str, int | None]) -> tuple[str, int | None]:
            return node_name(entry[0]), entry[1]

        deadline = time.monotonic() + self.settings.connect_timeout
        while True:
            starting = [child for child in self.children if child.host is not None
                        and machine(child.host) == machine(host) and not child.started.is_set()]
            if len(starting) < SSH_STARTING_PER_HOST:
                return
            failed = next((child for child in self.children if child.exit_code not in (None, 0)), None)
            if failed is not None:
                raise ChildFailed(failed)
            if time.monotonic() >= deadline:
                names = ", ".join(child.name for child in starting)
                raise TimeoutError(
                    f"{len(starting)} ssh connections to {host_label(host)} ({names}) "
                    f"did not start kvstore.launch.tether within {self.settings.connect_timeout:g} s "
                    "(KVSTORE_CONNECT_TIMEOUT), so no more were started there: is that host slow to log "
                    "in, or its kvstore older than the launcher's (one that does not announce itself)?")
            starting[0].started.wait(0.05)

    def start(self, workdir: str) -> None:
        """Start the scheduler here, learn its port, then start servers and workers (here, or on the
        hosts over ssh).  Raises ChildFailed, StartFailed, TimeoutError or ConfigError."""
        remote = self.cfg.launcher == "ssh"
        if remote:
            self.base_env["DMLC_PS_ROOT_URI"] = self.cfg.host_ip or address.route_address(
                node_name(self.cfg.hosts[0][0]), hint="fix the hostfile or give --host-ip")
        root = self.base_env["DMLC_PS_ROOT_URI"]
        port_file = os.path.join(workdir, "scheduler.port")
        scheduler = self._start("scheduler", None, [sys.executable, "-m", "kvstore.scheduler"],
                                {"DMLC_PS_ROOT_PORT": "0", "KVSTORE_PORT_FILE": port_file})
        port = self._wait_port(port_file, scheduler)
        self.base_env["DMLC_PS_ROOT_PORT"] = str(port)
        count = len(set(self.cfg.hosts))
        where = f" on {count} host{'s' * (count != 1)} over ssh" if remote else ""
        log.info("scheduler on %s:%d; starting %d servers and %d workers%s",
                 _bracketed(root), port, self.cfg.num_servers, self.cfg.num_workers, where)
        python = (self.cfg.remote_python or sys.executable) if remote else sys.executable
        worker_argv = python_if_script(self.cfg.command, python)
        hosts = self.cfg.hosts if remote else [None]
        for role, rank, host in placement(self.cfg.num_servers, self.cfg.num_workers, hosts):
            if role == "server":
                self._start("server", rank, [python, "-m", "kvstore.server"],
                            {"KVSTORE_SERVER_ID": str(rank)}, host=host)
            else:  # OMP_NUM_THREADS=1 unless the launcher's env or --env sets it
                self._start("worker", rank, list(worker_argv), {"DMLC_WORKER_ID": str(rank)},
                            defaults={"OMP_NUM_THREADS": "1"}, host=host)

    def _wait_port(self, path: str, scheduler: Child) -> int:
        """Return the port the scheduler wrote to ``path``.  Raises ChildFailed when it exits first
        (with any code: exit 0 is a failed launch too), TimeoutError after ``KVSTORE_CONNECT_TIMEOUT``."""
        deadline = time.monotonic() + self.settings.connect_timeout
        while time.monotonic() < deadline:
            port = roles.read_port_file(path)
            if port is not None:
                return port
            try:
                failed = self.exits.get(timeout=0.05)
            except queue.Empty:
                continue
            raise ChildFailed(failed, "before it reported its port")
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
            if not child.exited.wait(max(0.0, deadline - time.monotonic())):
                log.warning("%s did not exit within %g s of the workers; stopping it",
                            child.name, self.settings.shutdown_timeout)
        return 0

    def stop_wait(self, child: Child) -> float:
        """Seconds :meth:`stop_all` gives ``child`` after asking it to stop: ``KVSTORE_SHUTDOWN_TIMEOUT``
        for a local one; for a remote one the longer of that and its tether's grace (which runs from
        when the end of file reaches the tether), plus :data:`SSH_STOP_MARGIN`, so the tether has
        stopped the role (SIGKILL included) before its ssh client is killed."""
        if child.host is None:
            return self.settings.shutdown_timeout
        return max(self.settings.shutdown_timeout, child.tether_grace) + SSH_STOP_MARGIN

    def stop_all(self) -> list[str]:
        """Stop every child (SIGTERM to a local group, EOF to a remote tether), give each
        :meth:`stop_wait` from then, SIGKILL the rest (a remote child's ssh client); return who was
        killed, each with how long it was given."""
        for child in self.children:
            child.stop()
        start = time.monotonic()
        killed = []
        for child in self.children:
            wait = self.stop_wait(child)
            end = start + wait
            if not child.exited.wait(max(0.0, end - time.monotonic())):
                child.kill()
                child.reap()
                where = "" if child.host is None else f"the ssh client; host {host_label(child.host)}; "
                killed.append(f"{child.name} ({where}after {wait:g} s)")
                continue
            # Reaped now, not before: the pid stays the group's id while any member lives (Linux does
            # not hand out a pid in use as a group id), so what follows reaches only this group.
            child.reap()
            if child.host is None:  # what a local child left in its group gets the same deadline
                while tether.group_alive(child.proc.pid) and time.monotonic() < end:
                    time.sleep(0.05)  # polling interval of a wait bounded by ``end``
                if tether.group_alive(child.proc.pid):
                    child.kill()
                    killed.append(f"what {child.name} left in its process group (after {wait:g} s)")
        for child in self.children:
            child.join(5.0)
        return killed


class ChildFailed(Exception):
    """A child process exited when it should not have (or with a non-zero code).

    ``when`` says when, if that is part of the failure (``"before it reported its port"``).  ``code``
    is the launcher's exit code for it: the child's, or 1 when the child exited 0 (a launch that
    failed must not exit 0), which the message then says.
    """

    def __init__(self, child: Child, when: str = "") -> None:
        code = child.exit_code
        self.code = code or 1
        if child.host is None:
            message = f"{child.name} exited with code {code}"
        elif code == 255:
            where, name = host_label(child.host), node_name(child.host[0])
            message = (f"{child.name} on {where}: ssh exited with code 255 (is {name} reachable, "
                       f"and does passwordless ssh to it work? ssh's own message is above, "
                       f"prefixed [{child.name}])")
        else:
            message = f"{child.name} on {host_label(child.host)} exited with code {code}"
        if when:
            message += f" {when}"
        if code == 0:
            message += " (a failed launch: the launcher exits with code 1)"
        super().__init__(message)
        self.child = child


class StartFailed(Exception):
    """A process could not be started (the command does not exist or cannot be executed)."""


def run(cfg: LaunchConfig, settings: kvconfig.Config | None = None) -> int:
    """Launch ``cfg`` and supervise it to the end; return the launcher's exit code."""
    settings = settings or kvconfig.load()
    if cfg.launcher == "ray":
        try:
            from kvstore.launch.ray import launch as launch_on_ray  # imports ray: only for this launcher
        except ImportError as exc:
            log.error("--launcher ray needs the [ray] extra: pip install 'kvstore-ps[ray]' (%s)", exc)
            return 2
        return launch_on_ray(cfg, settings)
    previous = signal.signal(signal.SIGTERM, roles.raise_interrupt)
    cluster: Cluster | None = None
    code = 0
    try:
        if cfg.launcher == "ssh" and cfg.sync_dst_dir:
            sync_dir(cfg.hosts, cfg.ssh_args, os.getcwd(), cfg.sync_dst_dir, settings.connect_timeout)
        cluster = Cluster(cfg, settings)
        with tempfile.TemporaryDirectory(prefix="kvstore-launch-") as workdir:
            cluster.start(workdir)
            code = cluster.supervise()
    except ChildFailed as exc:
        code = exc.code
        log.error("%s; stopping the other processes", exc)
    except KeyboardInterrupt as exc:
        sig = exc.args[0] if exc.args else signal.SIGINT
        code = 128 + int(sig)
        log.error("interrupted; stopping every process")
    except TimeoutError as exc:
        code = 1
        log.error("%s", exc)
    except SyncFailed as exc:
        code = exc.code
        log.error("%s", exc)
    except ConfigError as exc:  # ssh: no address for the scheduler
        code = 1
        log.error("%s", exc)
    except StartFailed as exc:  # the command does not exist or cannot be executed
        code = 127
        log.error("%s", exc)
    finally:
        killed = cluster.stop_all() if cluster is not None else []
        if killed:
            log.error("killed after their stop timeout: %s", ", ".join(killed))
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

"""Start a whole cluster and supervise it: ``python launch.py -n W -s S [--launcher ssh -H hosts] CMD``.

parse -> :class:`LaunchConfig` -> (ssh: rsync the working directory to the hosts when asked) ->
start the scheduler here (port 0, reported through a file), then servers and workers, each in its
own process group here, or on the hosts over ssh under a :mod:`kvstore.tether` -> supervise: exit 0
when every worker exits 0; when any process fails, stop every child (SIGTERM to a local group, EOF
on a remote tether's stdin), wait one shared deadline, SIGKILL the rest and exit with the failed
process's code.
"""

from __future__ import annotations

import argparse
import logging
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from . import config as kvconfig
from . import roles, snapshot, tether
from .errors import ConfigError

log = logging.getLogger("kvstore.launcher")
H = TypeVar("H")


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
    """Read an MXNet-style host file: one ``host`` or ``host:port`` (ssh port) per line.

    Blank lines and ``#`` comments are skipped.  Raises ConfigError for an
    unreadable or empty file or a bad port.
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
        host, sep, port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if not sep:
            hosts.append((entry, None))
            continue
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"-H {path} line {number}: {entry!r} is not host or host:port")
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
                       ("--ray-placement-timeout", "seconds Ray may take to place every role (default 60)")):
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
    if any(value < 0 for value in ray_options.values()) or ray_options.get("placement_timeout") == 0:
        parser.error("--ray-*-cpus/gpus must be >= 0 and --ray-placement-timeout > 0")
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


def host_label(host: tuple[str, int | None]) -> str:
    """``host`` or ``host:port`` as the hostfile wrote it (for messages)."""
    name, port = host
    return name if port is None else f"{name}:{port}"


def node_name(host: str) -> str:
    """The machine part of an ssh destination: ``user@node`` -> ``node``."""
    return host.rpartition("@")[2]


def ssh_command(host: tuple[str, int | None], ssh_args: list[str], remote: str) -> list[str]:
    """Return the ssh client's argv that runs the shell command ``remote`` on ``host``.

    ``ssh [-p PORT] SSH_ARGS -o BatchMode=yes HOST REMOTE``: options in ``ssh_args`` come first,
    so they win over BatchMode (ssh keeps the first value of an option).
    """
    name, port = host
    return ["ssh", *(["-p", str(port)] if port is not None else []), *ssh_args, "-o", "BatchMode=yes",
            name, remote]


def remote_command(directory: str, python: str, grace: float) -> str:
    """The shell command ssh runs on a host: a tether in ``directory`` under ``python``.

    Only the tether's own stop grace (``KVSTORE_SHUTDOWN_TIMEOUT``, not a secret) is on this line;
    the role's argv and environment travel on the tether's stdin.  Every word is shell-quoted.
    """
    return (f"cd {shlex.quote(directory)} && exec env KVSTORE_SHUTDOWN_TIMEOUT={grace:g} "
            f"{shlex.quote(python)} -m kvstore.tether")


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


def rsync_command(host: tuple[str, int | None], ssh_args: list[str], source: str, dest: str) -> list[str]:
    """Return ``rsync -az`` of ``source``'s content into ``dest`` on ``host`` over the same ssh."""
    name, port = host
    shell = shlex.join(["ssh", *(["-p", str(port)] if port is not None else []), *ssh_args,
                        "-o", "BatchMode=yes"])
    return ["rsync", "-az", "-e", shell, source.rstrip("/") + "/", f"{name}:{dest}"]


class SyncFailed(Exception):
    """rsync of the working directory to a host failed; ``code`` is rsync's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def sync_dir(hosts: list[tuple[str, int | None]], ssh_args: list[str], source: str, dest: str) -> None:
    """rsync ``source`` into ``dest`` on every distinct host, in parallel.

    Raises SyncFailed (with rsync's output and code) when any fails; rsync processes still running
    then (or on an interrupt) are killed and reaped.
    """
    procs: list[tuple[tuple[str, int | None], subprocess.Popen]] = []
    try:
        for host in dict.fromkeys(hosts):
            log.info("rsync %s/ to %s on %s", source.rstrip("/"), dest, host_label(host))
            try:
                procs.append((host, subprocess.Popen(rsync_command(host, ssh_args, source, dest),
                                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, start_new_session=True)))
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
    remote one it names the host, and ``proc`` is the ssh client running a tether there: it is
    stopped by closing the tether's stdin (the tether stops the role and exits, so ssh exits).
    """

    def __init__(self, role: str, rank: int | None, proc: subprocess.Popen, out_lock: threading.Lock,
                 exits: queue.SimpleQueue, host: tuple[str, int | None] | None = None) -> None:
        self.role, self.rank, self.proc, self.host = role, rank, proc, host
        self.name = role if rank is None else f"{role} {rank}"
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
        return None if rc is None else roles.exit_code(rc)

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

    def _start(self, role: str, rank: int | None, argv: list[str], extra: dict[str, str],
               defaults: dict[str, str] | None = None, host: tuple[str, int | None] | None = None) -> Child:
        """Start ``argv`` as ``role`` here, or on ``host`` over ssh under a tether.  Raises StartFailed."""
        extra = {**self.base_env, "DMLC_ROLE": role, **extra}
        name = role if rank is None else f"{role} {rank}"
        piped = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "start_new_session": True}
        try:
            if host is None:
                env = kvconfig.child_environ(extra, defaults=defaults)
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **piped)
            else:
                env = remote_environ(extra, node_name(host[0]), defaults=defaults)
                remote = remote_command(self.cfg.sync_dst_dir or os.getcwd(), self.cfg.remote_python
                                        or sys.executable, self.settings.shutdown_timeout)
                proc = tether.spawn(argv, env, via=ssh_command(host, self.cfg.ssh_args, remote), **piped)
        except OSError as exc:
            what = shlex.join(argv) if host is None else "ssh"
            raise StartFailed(f"cannot start {what} ({name}): {exc}") from None
        child = Child(role, rank, proc, self.out_lock, self.exits, host=host)
        self.children.append(child)
        return child

    def start(self, workdir: str) -> None:
        """Start the scheduler here, learn its port, then start servers and workers (here, or on the
        hosts over ssh).  Raises ChildFailed, StartFailed, TimeoutError or ConfigError."""
        remote = self.cfg.launcher == "ssh"
        if remote:
            self.base_env["DMLC_PS_ROOT_URI"] = self.cfg.host_ip or kvconfig.route_address(
                node_name(self.cfg.hosts[0][0]), hint="fix the hostfile or give --host-ip")
        root = self.base_env["DMLC_PS_ROOT_URI"]
        port_file = os.path.join(workdir, "scheduler.port")
        scheduler = self._start("scheduler", None, [sys.executable, "-m", "scheduler"],
                                {"DMLC_PS_ROOT_PORT": "0", "KVSTORE_PORT_FILE": port_file})
        port = self._wait_port(port_file, scheduler)
        self.base_env["DMLC_PS_ROOT_PORT"] = str(port)
        count = len(set(self.cfg.hosts))
        where = f" on {count} host{'s' * (count != 1)} over ssh" if remote else ""
        log.info("scheduler on %s:%d; starting %d servers and %d workers%s",
                 root, port, self.cfg.num_servers, self.cfg.num_workers, where)
        python = (self.cfg.remote_python or sys.executable) if remote else sys.executable
        worker_argv = [python, *self.cfg.command] if self.cfg.command[0].endswith(".py") else self.cfg.command
        hosts = self.cfg.hosts if remote else [None]
        for role, rank, host in placement(self.cfg.num_servers, self.cfg.num_workers, hosts):
            if role == "server":
                self._start("server", rank, [python, "-m", "kvstore.server"],
                            {"KVSTORE_SERVER_ID": str(rank)}, host=host)
            else:  # OMP_NUM_THREADS=1 unless the launcher's env or --env sets it
                self._start("worker", rank, list(worker_argv), {"DMLC_WORKER_ID": str(rank)},
                            defaults={"OMP_NUM_THREADS": "1"}, host=host)

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
        """Stop every child (SIGTERM to a local group, EOF to a remote tether), wait one shared deadline,
        SIGKILL the rest (a remote child's ssh client); return who was killed."""
        for child in self.children:
            child.stop()
        deadline = time.monotonic() + self.settings.shutdown_timeout
        killed = []
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.proc.wait()
                where = "" if child.host is None else f" (the ssh client; host {host_label(child.host)})"
                killed.append(child.name + where)
        for child in self.children:
            child.join(5.0)
        return killed


class ChildFailed(Exception):
    """A child process exited when it should not have (or with a non-zero code)."""

    def __init__(self, child: Child) -> None:
        code = child.exit_code
        if child.host is None:
            message = f"{child.name} exited with code {code}"
        elif code == 255:
            where, name = host_label(child.host), node_name(child.host[0])
            message = (f"{child.name} on {where}: ssh exited with code 255 (is {name} reachable, "
                       f"and does passwordless ssh to it work? ssh's own message is above, "
                       f"prefixed [{child.name}])")
        else:
            message = f"{child.name} on {host_label(child.host)} exited with code {code}"
        super().__init__(message)
        self.child = child


class StartFailed(Exception):
    """A process could not be started (the command does not exist or cannot be executed)."""


def run(cfg: LaunchConfig, settings: kvconfig.Config | None = None) -> int:
    """Launch ``cfg`` and supervise it to the end; return the launcher's exit code."""
    settings = settings or kvconfig.load()
    if cfg.launcher == "ray":
        from .ray import launch as launch_on_ray  # imports ray: only for this launcher

        return launch_on_ray(cfg, settings)
    previous = signal.signal(signal.SIGTERM, roles.raise_interrupt)
    cluster: Cluster | None = None
    code = 0
    try:
        if cfg.launcher == "ssh" and cfg.sync_dst_dir:
            sync_dir(cfg.hosts, cfg.ssh_args, os.getcwd(), cfg.sync_dst_dir)
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

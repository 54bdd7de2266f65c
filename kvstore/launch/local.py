"""Start the processes of one launch and supervise them: the scheduler here, then servers and
workers, each in its own process group here, or on the hosts over ssh under a
:mod:`kvstore.launch.tether` (at most :data:`~kvstore.launch.ssh.SSH_STARTING_PER_HOST` ssh logins to
one host at a time).

:func:`run` exits 0 when every worker exits 0; when any process fails, it stops every child (SIGTERM
to a local group, EOF on a remote tether's stdin), waits (``KVSTORE_SHUTDOWN_TIMEOUT`` from then for
a local child; for a remote one the longer of that and its tether's own grace, plus
:data:`~kvstore.launch.ssh.SSH_STOP_MARGIN`), SIGKILLs the rest and exits with the failed process's code.
"""

from __future__ import annotations

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

from kvstore import config as kvconfig
from kvstore.errors import ChildFailed, ConfigError, StartFailed, SyncFailed
from kvstore.launch import envrules as roles
from kvstore.launch import portfile, tether
from kvstore.launch.interrupts import held_interrupts
from kvstore.launch.node import python_if_script
from kvstore.launch.options import LaunchConfig
from kvstore.launch.ssh import (
    SSH_STARTING_PER_HOST,
    SSH_STOP_MARGIN,
    bracketed,
    host_label,
    node_name,
    placement,
    remote_role,
    sync_dir,
)
from kvstore.net import address

log = logging.getLogger("kvstore.launcher")


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
        """Copy the child's output lines to stdout, each prefixed with its name; a remote tether's
        STARTED line sets ``started`` and is not printed."""
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
        """Wait for the child's exit (leaving it unreaped), record its code, set ``exited`` and
        ``started``, and put the child on ``exits``."""
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

    def failure(self, when: str = "") -> ChildFailed:
        """The ChildFailed of this exited child; ``when`` says when, if that is part of the failure
        (``"before it reported its port"``).  Its ``code`` is the launcher's exit code: the child's, or
        1 when the child exited 0 (a launch that failed must not exit 0), which the message then says."""
        code = self.exit_code
        if self.host is None:
            message = f"{self.name} exited with code {code}"
        elif code == 255:
            where, name = host_label(self.host), node_name(self.host[0])
            message = (f"{self.name} on {where}: ssh exited with code 255 (is {name} reachable, "
                       f"and does passwordless ssh to it work? ssh's own message is above, "
                       f"prefixed [{self.name}])")
        else:
            message = f"{self.name} on {host_label(self.host)} exited with code {code}"
        if when:
            message += f" {when}"
        if code == 0:
            message += " (a failed launch: the launcher exits with code 1)"
        return ChildFailed(message, code or 1, self)


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
        remote = None
        if host is not None:
            remote = remote_role(host, extra, defaults, directory=self.cfg.sync_dst_dir or os.getcwd(),
                                 python=self.cfg.remote_python or sys.executable,
                                 ssh_args=self.cfg.ssh_args, settings=self.settings)
            self._wait_ssh_slot(host)
        with held_interrupts():
            try:
                if remote is None:
                    env = kvconfig.child_environ(extra, environ=self.inherited, defaults=defaults)
                    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **piped)
                else:
                    proc = tether.spawn(argv, remote.env, via=remote.via, announce=True, **piped)
            except OSError as exc:
                what = shlex.join(argv) if host is None else "ssh"
                raise StartFailed(f"cannot start {what} ({name}): {exc}") from None
            child = Child(role, rank, proc, self.out_lock, self.exits, host=host,
                          tether_grace=0.0 if remote is None else remote.grace)
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
                raise failed.failure()
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
                 bracketed(root), port, self.cfg.num_servers, self.cfg.num_workers, where)
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
        failed: list[Child] = []

        def exited(seconds: float) -> bool:
            try:
                failed.append(self.exits.get(timeout=seconds))
            except queue.Empty:
                return False
            return True

        port = portfile.wait(path, self.settings.connect_timeout, exited)
        if port is not None:
            return port
        if failed:
            raise failed[0].failure("before it reported its port")
        raise TimeoutError(f"the scheduler did not report its port within "
                           f"{self.settings.connect_timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")

    def supervise(self) -> int:
        """Wait until every worker exits 0 (return 0) or any process fails (raise ChildFailed)."""
        workers_left = self.cfg.num_workers
        while workers_left:
            child = self.exits.get()
            if child.exit_code != 0:
                raise child.failure()
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


def run(cfg: LaunchConfig, settings: kvconfig.Config) -> int:
    """Launch ``cfg`` here (``--launcher local``) or over ssh and supervise it to the end; return the
    launcher's exit code: 0, the failed process's (1 if it exited 0 too early), 128 + n for signal n,
    127 when a command cannot be started, rsync's, or 1 for a timeout.  Raises nothing else."""
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


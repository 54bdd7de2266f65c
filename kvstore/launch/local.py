"""Start the processes of one launch and supervise them: the scheduler here, then servers and
workers, each in its own process group here, or on the hosts over ssh under a
:mod:`kvstore.launch.tether` (at most :data:`~kvstore.launch.ssh.SSH_STARTING_PER_HOST` ssh logins to
one host at a time).

Each process is a :class:`~kvstore.launch.roleprocess.RoleProcess` in one
:class:`~kvstore.launch.group.RoleGroup`; what is this module's own is where each role is placed and
how it is started (forked here, or ssh to a tether there) and what the launcher says about it.

:func:`run` exits 0 when every worker exits 0; when any process fails, it stops every child (SIGTERM
to a local group, EOF on a remote tether's stdin), waits (``KVSTORE_SHUTDOWN_TIMEOUT`` from then for
a local child; for a remote one the longer of that and its tether's own grace, plus
:data:`~kvstore.launch.ssh.SSH_STOP_MARGIN`), SIGKILLs the rest and exits with the failed process's code.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shlex
import signal
import sys
import tempfile
import time

from kvstore import config as kvconfig
from kvstore.core import storage
from kvstore.errors import ChildFailed, ConfigError, StartFailed, SyncFailed
from kvstore.launch import envrules as roles
from kvstore.launch import gpus, tether
from kvstore.launch import tensorboard as kvtensorboard
from kvstore.launch.elastic import CONTROL_VARIABLE, JoinControl, control_path, death_unseen, job_ending
from kvstore.launch.group import RoleGroup, SchedulerRestart
from kvstore.launch.interrupts import held_interrupts
from kvstore.launch.node import python_if_script
from kvstore.launch.options import LaunchConfig
from kvstore.launch.output import summary_line
from kvstore.launch.roleprocess import Killed, RoleProcess, RoleSpec, RoleState
from kvstore.launch.ssh import (
    SSH_STARTING_PER_HOST,
    SSH_STOP_MARGIN,
    bracketed,
    host_label,
    node_name,
    placement,
    remote_role,
    start_remote,
    sync_dir,
)
from kvstore.net import address, transport
from kvstore.net import timeline as kvtimeline
from kvstore.server.shards import shard_files

log = logging.getLogger("kvstore.launcher")
DEFAULT_SNAPSHOT_EVERY = "30s"  # servers' shards under --max-restarts when nothing else is set


def failure(child: RoleProcess, when: str = "") -> ChildFailed:
    """The ChildFailed of the exited ``child``; ``when`` says when, if that is part of the failure
    (``"before it reported its port"``).  Its ``code`` is the launcher's exit code: the child's, or
    1 when the child exited 0 (a launch that failed must not exit 0), which the message then says."""
    code, host = child.exit_code, child.spec.host
    if host is None:
        message = f"{child.name} exited with code {code}"
    elif code == 255:
        where, name = host_label(host), node_name(host[0])
        message = (f"{child.name} on {where}: ssh exited with code 255 (is {name} reachable, "
                   f"and does passwordless ssh to it work? ssh's own message is above, "
                   f"prefixed [{child.name}])")
    else:
        message = f"{child.name} on {host_label(host)} exited with code {code}"
    if when:
        message += f" {when}"
    if code == 0:
        message += " (a failed launch: the launcher exits with code 1)"
    return ChildFailed(message, code or 1, child)


def gpu_plan(cfg: LaunchConfig, environ: dict[str, str]) -> list[dict[str, str]] | None:
    """Every worker's GPU variables under ``--gpus-per-worker`` (None without it), by rank, its host
    as the local, ssh or mpi launcher places it.  Raises ConfigError when a host has too few GPUs."""
    if cfg.gpus_per_worker is None:
        return None
    hosts = cfg.hosts or [None]
    placed = placement(cfg.num_servers, cfg.num_workers, hosts)
    workers = [host for role, _, host in placed if role == "worker"]
    return gpus.plan(workers, cfg.gpus_per_worker, lambda host: gpus.devices_for(environ, host is not None),
                     label=lambda host: "localhost" if host is None else host_label(host))


def failure_summary(child: RoleProcess) -> str:
    """The last line of a failed launch: the role that failed first, its exit code and the last line
    of the last traceback it printed, if it printed one."""
    return summary_line(child.name, child.exit_code, child.printed.last_exception)


def killed_text(child: RoleProcess, killed: Killed, wait: float) -> str:
    """How the launcher names what a stop had to kill of ``child`` after ``wait`` seconds."""
    if killed is Killed.GROUP:
        return f"what {child.name} left in its process group (after {wait:g} s)"
    where = "" if child.spec.host is None else f"the ssh client; host {host_label(child.spec.host)}; "
    return f"{child.name} ({where}after {wait:g} s)"


class Cluster:
    """The children of one launch (local and ssh children alike): where each is placed and started,
    and their :class:`RoleGroup`."""

    def __init__(self, cfg: LaunchConfig, settings: kvconfig.Config) -> None:
        self.cfg, self.settings = cfg, settings
        self.group = RoleGroup()
        self.base_env = {
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_NUM_WORKER": str(cfg.num_workers),
            "DMLC_NUM_SERVER": str(cfg.num_servers), "PYTHONUNBUFFERED": "1",
            "KVSTORE_SECRET": settings.secret or secrets.token_hex(32), **cfg.env}
        # a local child inherits the launcher's environment, but for what the launcher sets per role
        # (a KVSTORE_NODE_PORT exported here would make every server bind one port)
        self.inherited = roles.inherited(kvconfig.child_environ({}))
        self.timeline = start_timeline(self.base_env, self.inherited)
        self.gpu_env = gpu_plan(cfg, self.inherited)  # before anything starts: too few GPUs fail here
        self.no_gpu = dict(gpus.NO_GPU) if self.gpu_env is not None else {}
        # last: nothing above may fail after it is made; run() removes it however the launch ends
        self.shard_dir = default_shards(cfg, self.base_env, self.inherited)
        self.scheduler_restart: SchedulerRestart | None = None  # --max-restarts, local: set by start()
        self.control: JoinControl | None = None  # --max-workers: the elastic control file, set by start()
        self._held_joins = 0  # joins asked while the scheduler was being restarted: asked again later
        self._unseen_since: float | None = None  # when the scheduler's port was first seen closed while
        # its process still counted as running (_scheduler_death_unseen)
        self.worker_argv: list[str] = []  # what every worker runs (a joining one too)
        if cfg.max_workers is not None:  # B slots, -n present at the start (docs/elastic.md)
            self.base_env["DMLC_NUM_WORKER"] = str(cfg.max_workers)
            self.base_env["KVSTORE_ELASTIC_WORKERS"] = str(cfg.num_workers)
        if cfg.min_workers is not None:  # a barrier with fewer present fails (docs/elastic.md)
            self.base_env["KVSTORE_MIN_WORKERS"] = str(cfg.min_workers)

    @property
    def children(self) -> list[RoleProcess]:
        """Every child started so far, in order."""
        return self.group.roles

    def _child(self, role: str, rank: int | None, argv: list[str], extra: dict[str, str],
               defaults: dict[str, str] | None, host: tuple[str, int | None] | None) -> RoleProcess:
        """The (unstarted) RoleProcess of ``argv`` as ``role``: forked here (``host`` None), or ssh to
        ``host`` running a tether that announces itself (stopped by closing its stdin, given its
        tether's grace plus :data:`SSH_STOP_MARGIN`)."""
        by_role = {"server": self.cfg.env_server, "worker": self.cfg.env_worker}.get(role, {})
        extra = {**self.base_env, **by_role, "DMLC_ROLE": role, **extra}
        if host is None:
            env = kvconfig.child_environ(extra, environ=self.inherited, defaults=defaults)
            return RoleProcess(RoleSpec(role, rank, argv, env), stop_wait=self.settings.shutdown_timeout)
        remote = remote_role(host, extra, defaults, directory=self.cfg.sync_dst_dir or os.getcwd(),
                             python=self.cfg.remote_python or sys.executable,
                             ssh_args=self.cfg.ssh_args, settings=self.settings)
        wait = max(self.settings.shutdown_timeout, remote.grace) + SSH_STOP_MARGIN
        return RoleProcess(RoleSpec(role, rank, argv, remote.env, host=host),
                           functools.partial(start_remote, via=remote.via), tethered=True,
                           announce=tether.STARTED, stop_wait=wait)

    def _start(self, role: str, rank: int | None, argv: list[str], extra: dict[str, str],
               defaults: dict[str, str] | None = None, host: tuple[str, int | None] | None = None
               ) -> RoleProcess:
        """Start ``argv`` as ``role`` here, or on ``host`` over ssh under a tether (once
        :meth:`_wait_ssh_slot` allows).  SIGINT and SIGTERM are held from the start until the child is
        in the group, so an interrupt never leaves one unstopped.  Raises StartFailed, and for ssh
        what :meth:`_wait_ssh_slot` raises."""
        child = self._child(role, rank, argv, extra, defaults, host)
        if host is not None:
            self._wait_ssh_slot(host)
        with held_interrupts():
            try:
                child.start()
            except OSError as exc:
                what = shlex.join(argv) if host is None else "ssh"
                raise StartFailed(f"cannot start {what} ({child.name}): {exc}") from None
            self.group.add(child)
        return child

    def _wait_ssh_slot(self, host: tuple[str, int | None]) -> None:
        """Return once fewer than :data:`SSH_STARTING_PER_HOST` ssh clients to ``host``'s machine (its
        name without ``user@``, and port) are still STARTING, so sshd's MaxStartups is not hit.

        Raises ChildFailed when a child fails meanwhile, TimeoutError when no ssh client to that host
        gets through within ``KVSTORE_CONNECT_TIMEOUT``.
        """
        def machine(entry: tuple[str, int | None]) -> tuple[str, int | None]:
            return node_name(entry[0]), entry[1]

        deadline = time.monotonic() + self.settings.connect_timeout
        while True:
            starting = [child for child in self.children if child.spec.host is not None
                        and machine(child.spec.host) == machine(host) and child.state is RoleState.STARTING]
            if len(starting) < SSH_STARTING_PER_HOST:
                return
            failed = self.group.failed()
            if failed is not None:
                raise failure(failed)
            if time.monotonic() >= deadline:
                names = ", ".join(child.name for child in starting)
                raise TimeoutError(
                    f"{len(starting)} ssh connections to {host_label(host)} ({names}) "
                    f"did not start kvstore.launch.tether within {self.settings.connect_timeout:g} s "
                    "(KVSTORE_CONNECT_TIMEOUT), so no more were started there: is that host slow to log "
                    "in, or its kvstore older than the launcher's (one that does not announce itself)?")
            starting[0].wait_started(0.05)

    def start(self, workdir: str) -> None:
        """Start the scheduler here, learn its port, then start servers and workers (here, or on the
        hosts over ssh).  Raises ChildFailed, StartFailed, TimeoutError or ConfigError."""
        remote = self.cfg.launcher == "ssh"
        if remote:
            self.base_env["DMLC_PS_ROOT_URI"] = self.cfg.host_ip or address.route_address(
                node_name(self.cfg.hosts[0][0]), hint="fix the hostfile or give --host-ip")
        root = self.base_env["DMLC_PS_ROOT_URI"]
        port_file = os.path.join(workdir, "scheduler.port")
        if self.cfg.max_workers is not None:
            self.control = JoinControl(control_path(workdir), self.cfg.max_workers)
            self.base_env[CONTROL_VARIABLE] = self.control.path
            log.info("elastic job of %d worker slots: append a line 'join' to %s to add a worker",
                     self.cfg.max_workers, self.control.path)
        if self.cfg.max_restarts > 0 and not remote:  # every node may ride over a scheduler's restart
            self.base_env["KVSTORE_SCHEDULER_RESTARTS"] = "1"
        scheduler = self._start("scheduler", None, [sys.executable, "-m", "kvstore.scheduler"],
                                {"DMLC_PS_ROOT_PORT": "0", "KVSTORE_PORT_FILE": port_file, **self.no_gpu})
        port = self._wait_port(port_file, scheduler)
        self.base_env["DMLC_PS_ROOT_PORT"] = str(port)
        if "KVSTORE_SCHEDULER_RESTARTS" in self.base_env:
            self.scheduler_restart = SchedulerRestart(port, port_file, self.settings.heartbeat_timeout)
        count = len(set(self.cfg.hosts))
        where = f" on {count} host{'s' * (count != 1)} over ssh" if remote else ""
        log.info("scheduler on %s:%d; starting %d servers and %d workers%s",
                 bracketed(root), port, self.cfg.num_servers, self.cfg.num_workers, where)
        python = (self.cfg.remote_python or sys.executable) if remote else sys.executable
        worker_argv = self.worker_argv = python_if_script(self.cfg.command, python)
        hosts = self.cfg.hosts if remote else [None]
        for role, rank, host in placement(self.cfg.num_servers, self.cfg.num_workers, hosts):
            if role == "server":
                self._start("server", rank, [python, "-m", "kvstore.server"],
                            {"KVSTORE_SERVER_ID": str(rank), **self.no_gpu}, host=host)
            else:  # OMP_NUM_THREADS=1 unless the launcher's env or --env sets it
                gpu = self.gpu_env[rank] if self.gpu_env is not None else {}
                self._start("worker", rank, list(worker_argv), {"DMLC_WORKER_ID": str(rank), **gpu},
                            defaults={"OMP_NUM_THREADS": "1"}, host=host)

    def join_workers(self) -> int:
        """Start a worker for each join asked in the control file since the last call (an elastic job;
        none otherwise), each in the lowest slot no live worker holds (a FAILED one holds its slot: it
        is being restarted, or the launch fails); return how many started.  A join with every slot
        held, or asked as the job ends (:func:`job_ending`), is logged and refused; one asked while a
        lost scheduler is being restarted waits until the restarted one has rebuilt the cluster.
        Raises StartFailed."""
        if self.control is None:
            return 0
        started, asked = 0, self._held_joins + self.control.asked()
        self._held_joins = 0
        for i in range(asked):
            workers = [c for c in self.children if c.spec.role == "worker"]
            held = {c.spec.rank for c in workers
                    if c.state in (RoleState.STARTING, RoleState.RUNNING, RoleState.FAILED)}
            incarnations: dict[int, int] = {}
            for c in workers:
                n = int(c.spec.env.get("KVSTORE_INCARNATION", "0"))
                incarnations[c.spec.rank] = max(n, incarnations.get(c.spec.rank, 0))
            gone = self._scheduler_gone()
            if not gone:
                self._unseen_since = None
            if gone and (self._scheduler_restarting() or self._scheduler_death_unseen(held)):
                # not the job's end: the scheduler comes back (or its death is yet to be seen)
                if not self._held_joins:
                    log.info("a worker's join waits until the restarted scheduler has rebuilt the cluster")
                self._held_joins = asked - i
                break
            found = self.control.join({r for r in held if r is not None}, incarnations, "--max-workers",
                                      ending=job_ending(len(held), gone))
            if found is None:
                continue
            slot, incarnation = found
            self._start("worker", slot, list(self.worker_argv),
                        {"DMLC_WORKER_ID": str(slot), "KVSTORE_JOIN": "1",
                         "KVSTORE_INCARNATION": str(incarnation)}, defaults={"OMP_NUM_THREADS": "1"})
            started += 1
        return started

    def _scheduler_gone(self) -> bool:
        """Whether the scheduler has exited or closed its port (it does once every worker has left):
        nothing listens where a worker started now would register."""
        if any(c.spec.role == "scheduler" and c.exit_code is not None for c in self.children):
            return True
        where = transport.address(self.base_env["DMLC_PS_ROOT_URI"], int(self.base_env["DMLC_PS_ROOT_PORT"]))
        return address.probe(where, 1.0) == address.REFUSED

    def _scheduler_death_unseen(self, held: set[int | None]) -> bool:
        """Whether the scheduler's closed port is a SIGKILLed scheduler whose exit the launcher has yet
        to see, under --max-restarts (:func:`kvstore.launch.elastic.death_unseen`)."""
        running = any(c.spec.role == "scheduler" and c.state in (RoleState.STARTING, RoleState.RUNNING)
                      for c in self.children)
        now = time.monotonic()
        if self._unseen_since is None:  # reset by join_workers once the port is open again
            self._unseen_since = now
        return death_unseen(self.scheduler_restart is not None, running, len(held), now - self._unseen_since)

    def _scheduler_restarting(self) -> bool:
        """Whether a lost scheduler is being restarted (--max-restarts): it failed and the launcher has
        yet to restart it, or the restarted one has not rebuilt the cluster (no port file yet)."""
        policy = self.scheduler_restart
        if policy is None:
            return False
        return policy.rebuilding() or any(c.spec.role == "scheduler" and c.state is RoleState.FAILED
                                          for c in self.children)

    def _has_shard(self, role: RoleProcess) -> bool:
        """Whether server ``role`` has written a shard it can be restarted from (here, not over ssh)."""
        if self.cfg.launcher != "local":
            return False
        env = kvconfig.child_environ({**self.base_env, **role.spec.env}, environ=self.inherited)
        try:
            settings = kvconfig.load(env)
        except ConfigError:
            return False
        folder, rank = settings.snapshot_dir, settings.server_id
        return bool(folder and rank is not None and shard_files(folder, rank))

    def _wait_port(self, path: str, scheduler: RoleProcess) -> int:
        """Return the port the scheduler wrote to ``path``.  Raises ChildFailed when it exits first
        (with any code: exit 0 is a failed launch too), TimeoutError after ``KVSTORE_CONNECT_TIMEOUT``."""
        port = scheduler.read_port(path, self.settings.connect_timeout)
        if port is not None:
            return port
        if scheduler.exit_code is not None:
            raise failure(scheduler, "before it reported its port")
        raise TimeoutError(f"the scheduler did not report its port within "
                           f"{self.settings.connect_timeout:g} s (KVSTORE_CONNECT_TIMEOUT)")

    def supervise(self) -> int:
        """Wait until every worker exits 0 (return 0) or any process fails (raise ChildFailed)."""
        failed = self.group.supervise(self.cfg.num_workers, self.settings.shutdown_timeout,
                                      restarts=self.cfg.max_restarts, restartable=self._has_shard,
                                      scheduler=self.scheduler_restart,
                                      joins=self.join_workers if self.control is not None else None)
        if failed is not None:
            raise failure(failed)
        return 0

    def stop_all(self) -> list[str]:
        """Stop every child (SIGTERM to a local group, EOF to a remote tether), give each its wait from
        then (``KVSTORE_SHUTDOWN_TIMEOUT`` here; over ssh the longer of that and its tether's grace,
        plus :data:`SSH_STOP_MARGIN`), SIGKILL the rest (a remote child's ssh client); return who was
        killed, each with how long it was given."""
        return [killed_text(child, killed, wait) for child, killed, wait in self.group.stop()]


def default_shards(cfg: LaunchConfig, base_env: dict[str, str], inherited: dict[str, str]) -> str | None:
    """Under ``--max-restarts`` (local launcher) servers are restartable with no settings: where neither
    the launcher's environment nor ``--env``/``--env-server`` sets them, ``KVSTORE_SNAPSHOT_EVERY`` is
    :data:`DEFAULT_SNAPSHOT_EVERY` and ``KVSTORE_SNAPSHOT_DIR`` a new folder of this job's own, set in
    ``base_env``.  Returns that folder (the launcher removes it after the job), or None.  Raises
    OSError when it cannot be made."""
    if cfg.max_restarts <= 0 or cfg.launcher != "local":
        return None
    env = {**inherited, **base_env, **cfg.env_server}
    if not env.get("KVSTORE_SNAPSHOT_EVERY"):
        base_env["KVSTORE_SNAPSHOT_EVERY"] = DEFAULT_SNAPSHOT_EVERY
    if env.get("KVSTORE_SNAPSHOT_DIR"):
        check_shard_folder(env["KVSTORE_SNAPSHOT_DIR"])
        return None
    folder = base_env["KVSTORE_SNAPSHOT_DIR"] = tempfile.mkdtemp(prefix="kvstore-shards-")
    log.info("servers' shards in %s (this job's own, for --max-restarts; removed after the job)", folder)
    return folder


def check_shard_folder(path: str) -> None:
    """A local ``KVSTORE_SNAPSHOT_DIR`` the servers of a ``--max-restarts`` job keep their shards in: made
    if missing and written once (a file made and removed) before any role starts, so that a folder no
    server could write fails the launch at once, named, not each server at its start, where the exit
    code raced a server's death (a storage URL is the servers' to check).  Raises ConfigError."""
    if "://" in path:
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".kvstore-write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"KVSTORE_SNAPSHOT_DIR={path!r} cannot be written ({exc.strerror or exc}): under "
                          "--max-restarts the servers keep their shards there") from None


def start_timeline(base_env: dict[str, str], inherited: dict[str, str]) -> str | None:
    """Under ``KVSTORE_TIMELINE`` (here or in ``--env``): its absolute path, set in ``base_env`` for
    every role, its folder of parts emptied of an earlier job's; None without it."""
    path = kvtimeline.timeline_path({**inherited, **base_env})
    if path is None:
        return None
    path = base_env[kvtimeline.VARIABLE] = storage.absolute(path)
    folder = kvtimeline.parts_dir(path)
    if storage.isdir(folder):
        for name in storage.listdir(folder):
            if name.endswith(".json"):
                storage.remove(storage.join(folder, name))
    return path


def finish_timeline(path: str | None) -> None:
    """Merge the roles' timeline parts into ``path`` (nothing when None); logs what it did."""
    if path is None:
        return
    try:
        merged = kvtimeline.merge_parts(path)
    except OSError as exc:
        log.error("cannot write the timeline %s: %s", path, exc)
        return
    if merged:
        log.info("timeline of %d roles written to %s", merged, path)
    else:
        log.warning("no timeline parts in %s to merge", kvtimeline.parts_dir(path))


def start_board(cfg: LaunchConfig, cluster: Cluster) -> kvtensorboard.JobBoard | None:
    """``--tensorboard``: TensorBoard started (None without the flag).  Raises ConfigError without
    the extra or for a bad TENSORBOARD_PORT, OSError when it cannot be started."""
    if not cfg.tensorboard:
        return None
    environ = {**cluster.inherited, **cluster.base_env}
    board = kvtensorboard.JobBoard(cfg.tensorboard, cfg.tensorboard_keep, environ,
                                   bind_all=cfg.launcher == "ssh")
    board.start()
    return board


def attach_board(board: kvtensorboard.JobBoard | None, cluster: Cluster) -> None:
    """Point the board's writer at the started cluster's scheduler (nothing without a board)."""
    if board is None:
        return
    env = cluster.base_env
    settings = kvconfig.load(kvconfig.child_environ(env, environ=cluster.inherited))
    where = transport.address(env["DMLC_PS_ROOT_URI"], int(env["DMLC_PS_ROOT_PORT"]))
    board.attach(settings, where)


def run(cfg: LaunchConfig, settings: kvconfig.Config) -> int:
    """Launch ``cfg`` here (``--launcher local``) or over ssh and supervise it to the end; return the
    launcher's exit code: 0, the failed process's (1 if it exited 0 too early), 128 + n for signal n,
    127 when a command cannot be started, rsync's, 1 for a timeout, or 2 when ``--gpus-per-worker``
    finds too few GPUs (before anything starts).  Raises nothing else."""
    previous = signal.signal(signal.SIGTERM, roles.raise_interrupt)
    cluster: Cluster | None = None
    try:
        cluster = Cluster(cfg, settings)  # checks the GPUs before anything starts
        board = start_board(cfg, cluster)
    except (ConfigError, OSError) as exc:
        log.error("%s", exc)
        if cluster is not None and cluster.shard_dir is not None:
            storage.remove_tree(cluster.shard_dir)
        signal.signal(signal.SIGTERM, previous)
        return 2
    failed: RoleProcess | None = None
    code = 0
    try:
        if cfg.launcher == "ssh" and cfg.sync_dst_dir:
            sync_dir(cfg.hosts, cfg.ssh_args, os.getcwd(), cfg.sync_dst_dir, settings.connect_timeout)
        with tempfile.TemporaryDirectory(prefix="kvstore-launch-") as workdir:
            cluster.start(workdir)
            attach_board(board, cluster)
            code = cluster.supervise()
    except ChildFailed as exc:
        code, failed = exc.code, exc.child
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
        finish(cluster, board, failed)
        signal.signal(signal.SIGTERM, previous)
    return code


def finish(cluster: Cluster, board: kvtensorboard.JobBoard | None, failed: RoleProcess | None) -> None:
    """The end of a launch: the scalar writer's last poll, every child stopped, the timeline merged,
    TensorBoard stopped (unless kept), and the failed role's summary last.  Raises nothing."""
    if board is not None:
        board.finish_writer()
    killed = cluster.stop_all()
    if killed:
        log.error("killed after their stop timeout: %s", ", ".join(killed))
    finish_timeline(cluster.timeline)
    if cluster.shard_dir is not None:  # this job's own: no later launch can restart from it
        storage.remove_tree(cluster.shard_dir)
    if board is not None:
        board.finish()
    if isinstance(failed, RoleProcess):  # after every role's output: the launch's last line
        print(failure_summary(failed), file=sys.stderr, flush=True)


"""``launch.py --launcher mpi``: one Open MPI ``mpirun`` of every role, each ``python -m kvstore.node``.

The ``1 + S + W`` ranks are one MPMD command line, one app context (``-n 1 [-H host] [-x NAME ...]
[-x NAME=VALUE ...] python -m kvstore.node CMD``) per process in the role plan's order: rank 0 the
scheduler, ranks 1..S the servers, the rest the workers, which is how
:mod:`kvstore.launch.managers.mpi` derives each rank's role.  A context's own ``-x NAME=VALUE``
carries what is only that role's (``--env-server``, ``--env-worker``, ``--gpus-per-worker``'s
variables); what every role shares is in mpirun's environment and forwarded by name (``-x NAME``,
in every context: Open MPI gives a ``-x`` to the context it is in, and ranks on other hosts get
nothing else of mpirun's environment), so no shared value, the secret included, is on a command
line.  With ``-H`` the scheduler runs on the first host and process i of the servers then the
workers on host i mod the number of hosts, as over ssh.

mpirun's ``--tag-output`` prefixes tell the ranks' output apart: each line is copied with its role's
prefix (``[worker 1] ``; a traceback kept together), mpirun's own lines with ``[mpirun] ``.  The exit
code is that of the rank mpirun names as the first to fail (else mpirun's), and a failed run ends
with the same summary line as the local launcher's.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import sys

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.launch import envrules as roles
from kvstore.launch import gpus
from kvstore.launch.local import gpu_plan
from kvstore.launch.managers import ADAPTERS
from kvstore.launch.options import LaunchConfig
from kvstore.launch.output import PrefixedOutput, summary_line
from kvstore.launch.roleprocess import RoleProcess, RoleSpec
from kvstore.launch.ssh import node_name, placement

log = logging.getLogger("kvstore.launcher")

TAG = re.compile(rb"\[\d+,(\d+)\]<std(?:out|err)>:")  # --tag-output's prefix: [jobid,rank]<stdout>:
FIRST_FAILED = re.compile(rb"Process name: \[\[\d+,\d+\],(\d+)\]")  # mpirun's "the first process to do so"
FAILED_CODE = re.compile(rb"^\s*Exit code:\s+(\d+)")
SIGNALLED = re.compile(rb"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")


def role_names(num_servers: int, num_workers: int) -> list[str]:
    """Every rank's role name, by MPI rank (the role plan: scheduler, servers, workers)."""
    return (["scheduler"] + [f"server {i}" for i in range(num_servers)]
            + [f"worker {i}" for i in range(num_workers)])


def shared_env(cfg: LaunchConfig, secret: str, environ: dict[str, str]) -> dict[str, str]:
    """What every rank gets, forwarded by name from mpirun's environment: the cluster's ``DMLC_*``,
    the secret, the launcher's ``KVSTORE_*``/``DMLC_*``/``OMP_NUM_THREADS`` and ``--env``."""
    root = node_name(cfg.hosts[0][0]) if cfg.hosts else "127.0.0.1"
    env = {**roles.forwarded(environ), "OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS", "1"),
           "DMLC_PS_ROOT_URI": root, "DMLC_NUM_SERVER": str(cfg.num_servers),
           "DMLC_NUM_WORKER": str(cfg.num_workers), "PYTHONUNBUFFERED": "1", "KVSTORE_SECRET": secret,
           **cfg.env}  # --env DMLC_PS_ROOT_PORT=P fixes the port; else the adapter's, from the job id
    return env


def mpirun_argv(cfg: LaunchConfig, mpirun: str, shared: list[str], python: str,
                gpu_env: list[dict[str, str]] | None) -> list[str]:
    """The mpirun command line: ``shared`` names forwarded to every rank, then one app context per
    process (see the module docstring).  Raises nothing."""
    argv = [mpirun, "--oversubscribe", "--tag-output"]
    # every context names the shared variables itself: Open MPI (4.1) gives a -x before the first
    # context to that context alone on other hosts (this host's ranks inherit mpirun's environment)
    forward = [word for name in shared for word in ("-x", name)]
    no_gpu = gpus.NO_GPU if gpu_env is not None else {}
    hosts = [node_name(name) for name, _ in cfg.hosts]
    contexts = [("scheduler", 0, hosts[0] if hosts else None)]
    contexts += placement(cfg.num_servers, cfg.num_workers, hosts or [None])
    node = [python, "-m", "kvstore.node", *cfg.command]
    for index, (role, rank, host) in enumerate(contexts):
        own = {"scheduler": dict(no_gpu), "server": {**cfg.env_server, **no_gpu}}.get(role)
        if own is None:
            own = {**cfg.env_worker, **(gpu_env[rank] if gpu_env is not None else {})}
        argv += [":"] if index else []
        argv += ["-n", "1", *(["-H", host] if host else []), *forward]
        for name, value in own.items():
            argv += ["-x", f"{name}={value}"]
        argv += node
    return argv


class TaggedOutput:
    """mpirun's merged output: each rank's lines to its role's :class:`PrefixedOutput`, mpirun's own
    to ``[mpirun] ``; the first failed rank and its code, as mpirun reports them, are kept."""

    def __init__(self, names: list[str]) -> None:
        self.roles = [PrefixedOutput(f"[{name}] ".encode()) for name in names]
        self.own = PrefixedOutput(b"[mpirun] ")
        self._partial: dict[int, bytes] = {}
        self.first_failed: int | None = None
        self.failed_code: int | None = None

    def write(self, line: bytes) -> None:
        """One line of mpirun's output: tagged fragments to their ranks, a line's end to the last one."""
        parts = TAG.split(line)
        head, pieces = parts[0], list(zip(parts[1::2], parts[2::2]))
        if head.strip():
            self._own(head if head.endswith(b"\n") else head + b"\n")
        for rank, text in pieces:
            index = int(rank)
            if index >= len(self.roles):
                self._own(text)
                continue
            buffered = self._partial.pop(index, b"") + text
            if buffered.endswith(b"\n"):
                for piece in buffered.splitlines(keepends=True):
                    self.roles[index].write(piece)
            elif buffered:
                self._partial[index] = buffered

    def _own(self, line: bytes) -> None:
        """One of mpirun's own lines: copied, and read for the first failed rank."""
        found = FIRST_FAILED.search(line)
        if found and self.first_failed is None:
            self.first_failed = int(found.group(1))
        code = FAILED_CODE.search(line)
        if code and self.failed_code is None:
            self.failed_code = int(code.group(1))
        signalled = SIGNALLED.search(line)
        if signalled and self.first_failed is None:
            self.first_failed, self.failed_code = int(signalled.group(1)), 128 + int(signalled.group(2))
        self.own.write(line)

    def flush(self) -> None:
        """At the end: write every rank's unfinished line and held traceback."""
        for index, rest in sorted(self._partial.items()):
            self.roles[index].write(rest + b"\n")
        self._partial.clear()
        for out in (*self.roles, self.own):
            out.flush()

    def summary(self, code: int) -> str:
        """The last line of a failed run (as :func:`kvstore.launch.local.failure_summary` writes it)."""
        if self.first_failed is None or self.first_failed >= len(self.roles):
            return f"launch.py: mpirun exited with code {code}"
        out = self.roles[self.first_failed]
        if out.last_exception is None:  # mpirun may see a peer that noticed the death exit first
            out = next((role for role in self.roles if role.last_exception is not None), out)
        return summary_line(out.prefix.decode()[1:-2], code, out.last_exception)


def run(cfg: LaunchConfig, settings: kvconfig.Config) -> int:
    """Run ``cfg`` as one mpirun (see the module docstring) and return the launcher's exit code: 0,
    the first failed rank's code (128 + n for signal n), 130/143 when interrupted, 127 without
    mpirun, 2 when ``--gpus-per-worker`` finds too few GPUs.  Raises nothing else."""
    manager_vars = {name for adapter in ADAPTERS for name in adapter.variables}  # mpirun sets its own
    environ = {name: value for name, value in roles.inherited(kvconfig.child_environ({})).items()
               if name not in manager_vars}
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        log.error("--launcher mpi needs Open MPI's mpirun on the PATH (Debian: apt install openmpi-bin)")
        return 127
    try:
        gpu_env = gpu_plan(cfg, environ)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    shared = shared_env(cfg, settings.secret or _fresh_secret(), environ)
    argv = mpirun_argv(cfg, mpirun, sorted(shared), sys.executable, gpu_env)
    tagged = TaggedOutput(role_names(cfg.num_servers, cfg.num_workers))
    proc = RoleProcess(RoleSpec("mpirun", None, argv, {**environ, **shared}), output=tagged.write,
                       stop_wait=settings.shutdown_timeout + 5.0)
    return _supervise(proc, tagged)


def _fresh_secret() -> str:
    """A new random ``KVSTORE_SECRET`` for this run."""
    import secrets

    return secrets.token_hex(32)


def _supervise(proc: RoleProcess, tagged: TaggedOutput) -> int:
    """Start mpirun, wait for it (stopping it on SIGINT/SIGTERM) and return the exit code."""
    previous = signal.signal(signal.SIGTERM, roles.raise_interrupt)
    try:
        try:
            proc.start()
        except OSError as exc:
            log.error("cannot start mpirun: %s", exc)
            return 127
        code = proc.wait()
        proc.join(5.0)
    except KeyboardInterrupt as exc:
        log.error("interrupted; stopping mpirun and every rank")
        proc.stop()
        return 128 + int(exc.args[0] if exc.args else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
        tagged.flush()
    code = code or 0
    if code:
        code = tagged.failed_code or code
        print(tagged.summary(code), file=sys.stderr, flush=True)
    return code

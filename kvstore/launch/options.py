"""What ``launch.py`` is asked to start: :class:`LaunchConfig`, and :func:`parse_args`, which reads it
from the command line (MXNet's tools/launch.py flags, plus the ssh and Ray launchers' own)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from kvstore import config as kvconfig
from kvstore.core import snapshot, storage
from kvstore.errors import ConfigError
from kvstore.launch.envrules import SET_BY_LAUNCHER
from kvstore.launch.gpus import GPU_NAMES
from kvstore.launch.ssh import parse_hostfile

# The flags of each launcher but 'local', by the LaunchConfig field (or ray_options key) they fill.
SSH_FLAGS = (("-H", "hostfile"), ("--sync-dst-dir", "sync_dst_dir"), ("--ssh-args", "ssh_args"),
             ("--remote-python", "remote_python"), ("--host-ip", "host_ip"))
RAY_SIZE_FLAGS = (("--ray-server-cpus", "server_cpus", "CPUs each server's actor reserves (default 0.1)"),
                  ("--ray-worker-cpus", "worker_cpus", "CPUs each worker's actor reserves (default 0.1)"),
                  ("--ray-worker-gpus", "worker_gpus", "GPUs each worker's actor reserves (default 0)"),
                  ("--ray-placement-timeout", "placement_timeout",
                   "seconds to place and create every role (default 60)"))
# MXNet's other launchers, refused with what to use instead.
NOT_LAUNCHERS = {
    "sge": "--launcher sge is not supported: use --launcher ssh -H HOSTFILE over the hosts the grid engine "
           "gave the job, or run `python -m kvstore.node CMD` in every task of a cluster manager it "
           "knows (Slurm: srun ... python -m kvstore.node, see docs/cluster-managers.md)",
    "yarn": "--launcher yarn is not supported: on YARN, train inside a Spark application with "
            "kvstore.spark.run (docs/spark.md), or on a Ray cluster with --launcher ray / kvstore.ray.run",
}


@dataclass(frozen=True)
class LaunchConfig:
    """What to start: ``num_workers`` workers running ``command`` and ``num_servers`` servers."""

    num_workers: int
    num_servers: int
    command: list[str]
    launcher: str = "local"
    env: dict[str, str] = field(default_factory=dict)  # every role (--env, --resume)
    env_server: dict[str, str] = field(default_factory=dict)  # servers only (--env-server), over env
    env_worker: dict[str, str] = field(default_factory=dict)  # workers only (--env-worker), over env
    hosts: list[tuple[str, int | None]] = field(default_factory=list)  # ssh: (host, ssh port)
    sync_dst_dir: str | None = None  # ssh: rsync this directory there first and run from it
    ssh_args: list[str] = field(default_factory=list)  # ssh: extra options for ssh and rsync
    remote_python: str | None = None  # ssh: the Python on the hosts (default: this one's path)
    host_ip: str | None = None  # ssh: the scheduler's address as the hosts reach it
    ray_address: str | None = None  # ray: the cluster to join (default: start a local one)
    ray_options: dict[str, float] = field(default_factory=dict)  # ray: server_cpus, ..., placement_timeout
    gpus_per_worker: int | None = None  # --gpus-per-worker: each worker's share of its host's GPUs
    tensorboard: str | None = None  # --tensorboard DIR: TensorBoard over DIR, the job's scalars under it
    tensorboard_keep: bool = False  # --tensorboard-keep: leave TensorBoard running after the job
    max_restarts: int = 0  # --max-restarts K: restart dead workers, at most K times in all
    min_workers: int | None = None  # --min-workers A: an elastic job's fewest workers (docs/elastic.md)
    max_workers: int | None = None  # --max-workers B: an elastic job's worker slots


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> LaunchConfig:
    """Parse the command line (``sys.argv[1:]`` when ``argv`` is None) into a :class:`LaunchConfig`;
    ``prog`` names the program in the usage (default: ``sys.argv[0]``'s basename, so ``launch.py`` or
    ``kvstore-launch``).  Raises SystemExit (code 2, the usage and the mistake on stderr) for a bad
    command line, and SystemExit (code 0, after printing the help) for ``-h``/``--help``."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("give the command every worker runs, e.g. train.py")
    if args.num_workers < 1 or (args.num_servers is not None and args.num_servers < 1):
        parser.error("-n and -s must be at least 1")
    extra = _extra_env(parser, args)
    env_server, env_worker = (_env_items(parser, flag, items) for flag, items
                              in (("--env-server", args.env_server), ("--env-worker", args.env_worker)))
    if (env_server or env_worker) and args.launcher == "ray":
        parser.error("--env-server and --env-worker apply to --launcher local and ssh; "
                     "with --launcher ray give --env (every role)")
    hosts = _ssh_hosts(parser, args)
    ray_options = _ray_options(parser, args)
    _check_gpus(parser, args, {**extra, **env_worker})
    _check_tensorboard(parser, args)
    return LaunchConfig(args.num_workers, args.num_servers or args.num_workers,
                        list(args.command), args.launcher, extra, env_server, env_worker, hosts=hosts,
                        sync_dst_dir=args.sync_dst_dir, ssh_args=shlex.split(args.ssh_args),
                        remote_python=args.remote_python, host_ip=args.host_ip,
                        ray_address=args.ray_address, ray_options=ray_options,
                        gpus_per_worker=args.gpus_per_worker, tensorboard=args.tensorboard,
                        tensorboard_keep=args.tensorboard_keep, max_restarts=args.max_restarts,
                        min_workers=args.min_workers, max_workers=args.max_workers)


def _parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``launch.py`` / ``kvstore-launch``, named ``prog`` (default: argparse's,
    ``sys.argv[0]``'s basename).  Raises nothing."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Start a kvstore cluster (1 scheduler, S servers, W workers) "
        "on this machine, over ssh on the hosts of -H, under mpirun or on Ray, and run COMMAND on every "
        "worker.")
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of workers")
    parser.add_argument("-s", "--num-servers", type=int, help="number of servers (default: -n)")
    parser.add_argument("--launcher", type=_launcher, choices=["local", "ssh", "mpi", "ray"], default="local",
                        help="how to start processes: 'local' (this machine, the default), 'ssh' "
                        "(the hosts of -H), 'mpi' (one Open MPI mpirun of every role, on the hosts of -H "
                        "if given) or 'ray' (actors on a Ray cluster; needs the [ray] extra)")
    parser.add_argument("-H", "--hostfile", help="ssh, mpi: file of hosts, one 'host' "
                        "(ssh: or 'host:sshport') a line; process i (servers first, then workers) "
                        "runs on host i %% len(hosts)")
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
    for flag, name, what in RAY_SIZE_FLAGS:
        parser.add_argument(flag, dest=name, type=float, metavar="N", help=f"ray: {what}")
    parser.add_argument("--gpus-per-worker", type=int, metavar="N",
                        help="local, ssh, mpi: give each worker N GPUs of its host (CUDA_VISIBLE_DEVICES) "
                        "and torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; servers and the "
                        "scheduler get CUDA_VISIBLE_DEVICES=''; fails before starting anything when a "
                        "host has too few GPUs (KVSTORE_HOST_GPUS overrides the count)")
    _add_env_flags(parser)
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="local, ssh: start TensorBoard over DIR (a free port, or TENSORBOARD_PORT) and "
                        "write every role's counters and the workers' kvstore.log_scalar values under "
                        "DIR/job-...; needs the [tensorboard] extra; stopped after the job")
    parser.add_argument("--tensorboard-keep", action="store_true",
                        help="with --tensorboard: leave TensorBoard running after the job "
                        "(its pid is printed)")
    parser.add_argument("--resume", metavar="DIR",
                        help="start from the snapshot kv.save_checkpoint(DIR) wrote (any number of servers)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="local, ray: restart a worker that dies (same rank, a new incarnation), at "
                        "most K times in all; the others go on without it meanwhile (docs/failures.md); "
                        "with --max-workers a joined worker's restart rejoins its slot (docs/elastic.md)")
    parser.add_argument("--min-workers", type=int, metavar="A",
                        help="local, ray: an elastic job (with --max-workers): A workers at least")
    parser.add_argument("--max-workers", type=int, metavar="B",
                        help="local, ray: an elastic job of B worker slots, -n of them started; a line "
                        "'join' appended to $KVSTORE_ELASTIC_CONTROL starts one more (docs/elastic.md); "
                        "with --max-restarts a worker that dies is restarted, one that exits 0 has left")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the worker's command")
    return parser


def _launcher(name: str) -> str:
    """``--launcher``'s value; argparse checks it is one of ours.  Raises ArgumentTypeError, which
    argparse reports as a usage error, for one of MXNet's launchers we do not have (sge, yarn),
    naming what to use instead."""
    if name in NOT_LAUNCHERS:
        raise argparse.ArgumentTypeError(NOT_LAUNCHERS[name])
    return name


def _add_env_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--env``, ``--env-server`` and ``--env-worker`` (MXNet's launcher flags) to ``parser``."""
    how = ("NAME=VALUE (or MXNet's NAME:VALUE) sets it, a bare NAME passes on its value here; repeatable")
    parser.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help=f"an environment variable for every process: {how}")
    parser.add_argument("--env-server", action="append", default=[], metavar="NAME[=VALUE]",
                        help=f"an environment variable for the servers only (over --env): {how}")
    parser.add_argument("--env-worker", action="append", default=[], metavar="NAME[=VALUE]",
                        help=f"an environment variable for the workers only (over --env): {how}")


def env_item(item: str, environ: dict[str, str], per_role: bool = False) -> tuple[str, str]:
    """``(name, value)`` of one ``--env*`` item: ``NAME=VALUE``, MXNet's ``NAME:VALUE``, or a bare
    ``NAME``, whose value is taken from ``environ``.  Raises ValueError for an empty name, a bare NAME
    that ``environ`` lacks, or, for one role's flag (``per_role``), a name the launcher sets for each
    role itself (:data:`~kvstore.launch.envrules.SET_BY_LAUNCHER`; ``--env`` may override the
    cluster-wide ones, as docs/env.md says)."""
    sep = "=" if "=" in item else ":" if ":" in item else ""
    name, _, value = item.partition(sep) if sep else (item, "", None)
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"{item!r} is not NAME, NAME=VALUE or NAME:VALUE")
    if per_role and name in SET_BY_LAUNCHER:
        raise ValueError(f"{name} is set by the launcher for each role; it cannot be given")
    if value is None:
        value = environ.get(name)
        if value is None:
            raise ValueError(f"{name} is not set here, so there is no value to pass on (give {name}=VALUE)")
    return name, value


def _env_items(parser: argparse.ArgumentParser, flag: str, items: list[str]) -> dict[str, str]:
    """The variables of the ``flag`` items, in order (a later one wins).  Raises SystemExit (through
    ``parser.error``) for a bad item (see :func:`env_item`)."""
    environ = kvconfig.child_environ({}) if items else {}  # a copy of the launcher's environment
    out = {}
    for item in items:
        try:
            name, value = env_item(item, environ, per_role=flag != "--env")
        except ValueError as exc:
            parser.error(f"{flag} {exc}")
        out[name] = value
    return out


def _extra_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """The variables ``--env`` and ``--resume`` add to every process.  Raises SystemExit (through
    ``parser.error``) for a bad ``--env`` (see :func:`env_item`) or a ``--resume`` with no snapshot."""
    extra = _env_items(parser, "--env", args.env)
    if args.resume is not None:
        try:
            found = storage.exists(storage.join(args.resume, snapshot.POINTER))
        except (OSError, ConfigError) as exc:
            parser.error(f"--resume {args.resume}: {exc}")
        if not found:
            parser.error(f"--resume {args.resume}: no snapshot there (no LATEST file); "
                         "take one with kv.save_checkpoint(dir)")
        extra["KVSTORE_RESUME"] = storage.absolute(args.resume)
    if args.max_restarts < 0:
        parser.error("--max-restarts must be at least 0")
    if args.max_restarts and args.launcher not in ("local", "ray"):
        parser.error(f"--max-restarts applies to --launcher local and ray; under --launcher {args.launcher} "
                     "restarts are not supported yet (docs/failures.md)")
    if args.max_restarts:
        extra["KVSTORE_MAX_RESTARTS"] = str(args.max_restarts)  # the scheduler's budget too
    _check_elastic(parser, args)
    return extra


def _check_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--min-workers A --max-workers B``: A <= -n <= B, the local or ray launcher (``--max-restarts``
    combines with them).  Raises SystemExit (through ``parser.error``) otherwise."""
    if args.min_workers is None and args.max_workers is None:
        return
    low = args.num_workers if args.min_workers is None else args.min_workers
    high = args.num_workers if args.max_workers is None else args.max_workers
    if not 1 <= low <= args.num_workers <= high:
        parser.error(f"--min-workers {low} <= -n {args.num_workers} <= --max-workers {high} must hold "
                     "(and at least 1)")
    if args.launcher not in ("local", "ray"):
        parser.error("--min-workers and --max-workers apply to --launcher local and ray, not "
                     f"{args.launcher} (docs/elastic.md)")


def _ssh_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, int | None]]:
    """The hosts of ``-H`` for ``--launcher ssh`` (and ``mpi``, where it is optional; none for the
    others).  Raises SystemExit (through ``parser.error``) for a missing or bad host file, an ssh port
    for mpi, or ssh flags given to another launcher."""
    if args.launcher == "ssh" or (args.launcher == "mpi" and args.hostfile):
        if not args.hostfile:
            parser.error("--launcher ssh needs -H HOSTFILE")
        try:
            hosts = parse_hostfile(args.hostfile)
        except ConfigError as exc:
            parser.error(str(exc))
        if args.launcher == "mpi" and any(port is not None for _, port in hosts):
            parser.error(f"{args.hostfile}: --launcher mpi takes host names without ssh ports "
                         "(mpirun reaches the hosts its own way)")
        other = [flag for flag, name in SSH_FLAGS[1:] if getattr(args, name)]
        if args.launcher == "mpi" and other:
            parser.error(f"{', '.join(other)} only apply to --launcher ssh")
        return hosts
    given = [flag for flag, name in SSH_FLAGS if getattr(args, name)]
    if given:
        parser.error(f"{', '.join(given)} only apply to --launcher ssh")
    return []


def _ray_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, float]:
    """The ``--ray-*`` sizes that were given, by RayJob's argument names.  Raises SystemExit (through
    ``parser.error``) for Ray flags given to another launcher, or a size out of range."""
    ray_options = {name: getattr(args, name) for _, name, _ in RAY_SIZE_FLAGS
                   if getattr(args, name) is not None}
    if (args.ray_address or ray_options) and args.launcher != "ray":
        parser.error("--ray-* flags only apply to --launcher ray")
    positive = ("server_cpus", "worker_cpus", "placement_timeout")  # an actor needs some CPU to be placed
    if (any(not ray_options.get(name, 1) > 0 for name in positive)
            or not ray_options.get("worker_gpus", 0) >= 0):
        parser.error("--ray-server-cpus, --ray-worker-cpus and --ray-placement-timeout must be > 0, "
                     "--ray-worker-gpus >= 0")
    return ray_options


def _check_tensorboard(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check ``--tensorboard`` and ``--tensorboard-keep``.  Raises SystemExit (through ``parser.error``)
    for ``--tensorboard-keep`` alone, or ``--tensorboard`` with a launcher other than local and ssh."""
    if args.tensorboard_keep and not args.tensorboard:
        parser.error("--tensorboard-keep needs --tensorboard DIR")
    if args.tensorboard and args.launcher not in ("local", "ssh"):
        parser.error("--tensorboard applies to --launcher local and ssh (on Spark: "
                     "kvstore.spark.run(..., tensorboard=DIR))")


def _check_gpus(parser: argparse.ArgumentParser, args: argparse.Namespace,
                worker_env: dict[str, str]) -> None:
    """Check ``--gpus-per-worker``.  Raises SystemExit (through ``parser.error``) for a negative count,
    ``--launcher ray`` (which has ``--ray-worker-gpus``), or an ``--env``/``--env-worker`` of a
    variable it sets."""
    if args.gpus_per_worker is None:
        return
    if args.gpus_per_worker < 0:
        parser.error("--gpus-per-worker must be >= 0")
    if args.launcher == "ray":
        parser.error("--gpus-per-worker applies to --launcher local, ssh and mpi; with --launcher ray "
                     "give --ray-worker-gpus (Ray sets CUDA_VISIBLE_DEVICES itself)")
    clash = [name for name in GPU_NAMES if name in worker_env]
    if clash:
        parser.error(f"--gpus-per-worker sets {', '.join(clash)} for each worker; do not give it with --env")

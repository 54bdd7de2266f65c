"""``python -m kvstore.node CMD ARGS`` (or ``kvstore-node CMD ARGS``): run this process's role, from
``DMLC_ROLE`` or a cluster manager.

The implementation is :mod:`kvstore.launch.node`; this module is the documented command, and answers
``--help`` / ``-h`` given as its first argument (a worker command's own ``--help`` further on is the
command's).
"""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.launch import node as _node

__all__ = ["main", "usage_parser"]


def usage_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The parser whose help ``--help`` prints, named ``prog`` (default: ``kvstore-node`` when run as
    that console script, else ``python -m kvstore.node``).  Raises nothing."""
    if prog is None:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        prog = "kvstore-node" if script == "kvstore-node" else "python -m kvstore.node"
    parser = argparse.ArgumentParser(
        prog=prog, usage="%(prog)s [-h] [--gpus-per-worker N] CMD [ARGS ...]",
        description="Become this process's kvstore role: the scheduler, a server, or a worker "
        "running CMD. The role comes from DMLC_ROLE (with DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, "
        "DMLC_NUM_SERVER, DMLC_NUM_WORKER), or, without it, from the cluster manager that started the "
        "process: MPI, Slurm, torchrun, TF_CONFIG or a Kubernetes indexed Job (rank 0 the scheduler, "
        "the next DMLC_NUM_SERVER the servers, the rest workers). Every role gets the same command line.",
        epilog="Exit codes: the role's own; 2 for a configuration error, 127 when CMD cannot be started. "
        "See docs/launching.md and docs/cluster-managers.md.")
    parser.add_argument("--gpus-per-worker", type=int, metavar="N",
                        help="give a worker N GPUs of its host (CUDA_VISIBLE_DEVICES, by its local rank "
                        "among the workers on the host) and torchrun's RANK, WORLD_SIZE, LOCAL_RANK, "
                        "LOCAL_WORLD_SIZE; the scheduler and servers get CUDA_VISIBLE_DEVICES=''; exit 2 "
                        "when the host has too few GPUs (KVSTORE_HOST_GPUS overrides the count). "
                        "Must come before CMD")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD [ARGS ...]",
                        help="what a worker runs (a first word ending in .py runs with this Python); "
                        "the scheduler and servers ignore it")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the usage and return 0 for ``-h``/``--help`` as the first argument; otherwise become this
    node's role (:func:`kvstore.launch.node.main`, which returns only on a failure), with
    ``--gpus-per-worker N`` first if given.  Raises SystemExit (code 2) for a bad ``--gpus-per-worker``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        usage_parser().print_help()
        return 0
    gpus_per_worker = None
    if argv[:1] and argv[0].startswith("--gpus-per-worker"):  # the node's own option, before CMD
        parser = usage_parser()
        args = parser.parse_args(argv)  # SystemExit(2) with the usage for a bad value
        if args.gpus_per_worker < 0:
            parser.error("--gpus-per-worker must be >= 0")
        gpus_per_worker, argv = args.gpus_per_worker, list(args.command)
    return _node.main(argv, gpus_per_worker)


if __name__ == "__main__":
    sys.exit(main())

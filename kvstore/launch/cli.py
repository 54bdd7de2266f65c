"""Start a whole cluster and supervise it: ``python launch.py -n W -s S [--launcher ssh -H hosts] CMD``.

parse (:mod:`kvstore.launch.options`) -> the ``KVSTORE_*`` settings -> dispatch: ``local`` and
``ssh`` to :mod:`kvstore.launch.local` (which rsyncs to the hosts first when asked, see
:mod:`kvstore.launch.ssh`), ``mpi`` to :mod:`kvstore.launch.mpirun`, ``ray`` to
:mod:`kvstore.ray`, imported only then (it imports
``ray``).  The launcher exits with the code the chosen launcher returns.
"""

from __future__ import annotations

import logging

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.launch import local, mpirun
from kvstore.launch.options import LaunchConfig, parse_args

log = logging.getLogger("kvstore.launcher")
# the one line the launcher prints at every level: what it starts (the rest follows KVSTORE_LOG_LEVEL)
summary = logging.getLogger("kvstore.launcher.summary")


def run(cfg: LaunchConfig, settings: kvconfig.Config | None = None) -> int:
    """Launch ``cfg`` with its launcher and supervise it to the end; return the launcher's exit code
    (2 for ``--launcher ray`` without the ``[ray]`` extra).  Raises ConfigError for a bad
    ``KVSTORE_*`` setting when ``settings`` is None."""
    settings = settings or kvconfig.load()
    if cfg.launcher == "ray":
        try:
            from kvstore.ray import launch as launch_on_ray  # imports ray: only for this launcher
        except ImportError as exc:
            log.error("--launcher ray needs the [ray] extra: pip install 'kvstore-ps[ray]' (%s)", exc)
            return 2
        return launch_on_ray(cfg, settings)
    if cfg.launcher == "mpi":
        return mpirun.run(cfg, settings)
    return local.run(cfg, settings)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``launch.py`` and ``kvstore-launch``: return the exit code (2 for a bad
    ``KVSTORE_*`` setting).  Raises SystemExit (code 2) for a bad command line."""
    logging.basicConfig(level=kvconfig.DEFAULT_LOG_LEVEL, format="[launcher] %(levelname)s %(message)s")
    cfg = parse_args(argv)
    try:
        settings = kvconfig.load()
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    logging.getLogger().setLevel(settings.log_level or kvconfig.DEFAULT_LOG_LEVEL)
    summary.setLevel(logging.INFO)
    summary.info("starting 1 scheduler, %d servers, %d workers: %s", cfg.num_servers, cfg.num_workers,
                 " ".join(cfg.command))
    return run(cfg, settings)

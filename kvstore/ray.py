"""``kvstore.ray``: run a kvstore cluster on Ray: ``launch.py --launcher ray``, :func:`run` and :func:`start`.

Importing this module imports ``ray`` (the ``[ray]`` extra); ``import kvstore`` never does.

One placement group (strategy ``SPREAD``) holds a bundle per role: the
scheduler, S servers and W workers, each asking for a fraction of a CPU by
default.  Every role is a Ray actor.  The scheduler's and servers' actors (and
a command worker's) run their role as a subprocess under :mod:`kvstore.launch.tether`,
so a role never outlives its actor; a function worker calls the user's function
in the actor's own process, with the role's environment set there while it runs
(the variables travel as an argument of the actor's method, never in its
``runtime_env``, which Ray logs), so ``kvstore.create('dist_sync')`` inside it
joins the cluster.  One supervision loop on the driver long-polls every actor for new
output lines and its exit code, prints the lines with the launcher's prefixes
(``[scheduler]``, ``[server 0]``, ``[worker 1]``), and stops everything when any
role fails or its actor dies.

Ray serialises the user's function, its arguments and its return value with its
own (cloud)pickle: that is Ray's transport between the driver and the actors,
not kvstore's wire, which stays msgpack between the roles.

The parts: :mod:`kvstore.launch.ray_plan` (the roles' bundles and environments, no Ray),
:mod:`kvstore.launch.ray_cluster` (connecting, placing), :mod:`kvstore.launch.ray_actor` (a role in
its actor) and :mod:`kvstore.launch.ray_job` (:class:`RayJob`, the driver); here :func:`run`,
:func:`start` and the CLI's :func:`launch`.

Importing this module imports ray (the ``[ray]`` extra); ``import kvstore`` never does.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import ray

from kvstore import config as kvconfig
from kvstore.errors import DeadlineExceededError, PlacementError, RoleFailed
from kvstore.launch import envrules as roles
from kvstore.launch.options import LaunchConfig
from kvstore.launch.output import summary_line
from kvstore.launch.ray_job import RayJob
from kvstore.launch.ray_plan import (
    DEFAULT_PLACEMENT_TIMEOUT,
    DEFAULT_SCHEDULER_CPUS,
    DEFAULT_SERVER_CPUS,
    DEFAULT_WORKER_CPUS,
)

log = logging.getLogger("kvstore.launcher")


def start(target: Sequence[str] | str | Callable[..., Any], num_workers: int, num_servers: int | None = None,
          **options: Any) -> RayJob:
    """Start a cluster on Ray and return its :class:`RayJob` once every role is started (see
    :func:`run` for the arguments and errors)."""
    return RayJob(target, num_workers, num_workers if num_servers is None else num_servers,
                  **options).start()


def run(target: Sequence[str] | str | Callable[..., Any], num_workers: int, num_servers: int | None = None,
        *, args: tuple = (), kwargs: Mapping[str, Any] | None = None, address: str | None = None,
        env: Mapping[str, str] | None = None, scheduler_cpus: float = DEFAULT_SCHEDULER_CPUS,
        server_cpus: float = DEFAULT_SERVER_CPUS, worker_cpus: float = DEFAULT_WORKER_CPUS,
        worker_gpus: float = 0.0, placement_timeout: float = DEFAULT_PLACEMENT_TIMEOUT,
        cwd: str | None = None, timeout: float | None = None, stdout: TextIO | None = None,
        min_workers: int | None = None, max_workers: int | None = None) -> list[Any]:
    """Run a kvstore cluster on Ray to its end: 1 scheduler, ``num_servers`` servers (default:
    ``num_workers``) and ``num_workers`` workers, each a Ray actor.

    ``target`` is the workers' command (an argv list, or a string split like a shell does; a first
    word ending in ``.py`` runs with the actor's Python) or a function, called as
    ``target(*args, **kwargs)`` in each worker's actor with the ``DMLC_*`` environment set, so
    ``kvstore.create('dist_sync')`` inside it joins the cluster.  Returns the workers' results in
    rank order: the function's return values, or the command workers' exit codes (all 0).

    ``address`` joins a running Ray cluster (as ``ray.init(address=...)``; ``"auto"`` finds one
    through ``RAY_ADDRESS`` or ``ray start`` on this machine) and leaves it running; None starts a
    new local Ray instance for this job (``ray.init(address="local")``, whatever ``RAY_ADDRESS``
    says) and shuts it down at the end.  If this process is connected to Ray already, that
    connection is used and kept.  ``env`` adds variables to every role (and the caller's
    ``KVSTORE_*``/``DMLC_*`` and ``OMP_NUM_THREADS`` are passed on).  ``*_cpus`` / ``worker_gpus``
    size each role's bundle; ``placement_timeout`` bounds the wait for them; ``cwd`` is the command
    roles' directory where it exists (default: this one); ``timeout`` bounds the whole run;
    role output lines go to ``stdout`` (default ``sys.stdout``) prefixed ``[worker 1] `` etc.

    ``max_workers`` B makes an elastic job (docs/elastic.md), as ``launch.py --max-workers``: B worker
    slots (``DMLC_NUM_WORKER=B``), ``num_workers`` of them started; a line ``join`` appended to
    ``$KVSTORE_ELASTIC_CONTROL`` (or :meth:`RayJob.add_worker`) starts a worker actor in the lowest free
    slot; the results are then by slot, None for a slot never held.  ``min_workers`` A
    (``KVSTORE_MIN_WORKERS``): a barrier with fewer workers present fails.

    Raises PlacementError, RoleFailed (with ``role``, ``rank``, ``exit_code``),
    DeadlineExceededError, or ValueError for bad counts or sizes (``min_workers <= num_workers <=
    max_workers`` must hold); every role, actor and the
    placement group are gone when it returns or raises.
    """
    job = RayJob(target, num_workers, num_workers if num_servers is None else num_servers, args=args,
                 kwargs=kwargs, address=address, env=env, scheduler_cpus=scheduler_cpus,
                 server_cpus=server_cpus, worker_cpus=worker_cpus, worker_gpus=worker_gpus,
                 placement_timeout=placement_timeout, cwd=cwd, stdout=stdout, min_workers=min_workers,
                 max_workers=max_workers)
    job.start()
    return job.wait(timeout)


def launch(cfg: LaunchConfig, settings: kvconfig.Config) -> int:
    """Run ``launch.py --launcher ray``: start ``cfg`` on Ray, supervise it, tear it down; return the
    launcher's exit code (0; the failed role's code, 1 when its actor died or the job could not be
    placed or started; 130 on Ctrl-C; 143 on SIGTERM)."""
    job: RayJob | None = None
    previous = signal.getsignal(signal.SIGTERM)
    code, failed = 0, None
    try:
        job = RayJob(cfg.command, cfg.num_workers, cfg.num_servers, address=cfg.ray_address, env=cfg.env,
                     settings=settings, max_restarts=cfg.max_restarts, min_workers=cfg.min_workers,
                     max_workers=cfg.max_workers, **cfg.ray_options)
        job.connect()
        signal.signal(signal.SIGTERM, roles.raise_interrupt)  # after ray.init, which sets its own
        job.start()
        job.supervise()
    except RoleFailed as exc:
        code = exc.exit_code or 1
        log.error("%s; stopping the other processes", exc)
        name = exc.role if exc.rank is None else f"{exc.role} {exc.rank}"
        tracker = job.exceptions.get(name) if job is not None else None
        failed = summary_line(name, exc.exit_code, tracker.last if tracker else None)
    except KeyboardInterrupt as exc:
        code = 128 + int(exc.args[0] if exc.args else signal.SIGINT)
        log.error("interrupted; stopping every process")
    except (PlacementError, DeadlineExceededError, ValueError) as exc:
        code = 1
        log.error("%s", exc)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
        code = 1
        log.error("Ray: %s", exc)
    finally:
        if job is not None:
            job.stop()
        signal.signal(signal.SIGTERM, previous)
    if failed is not None:  # the last line, as every launcher ends a failed run
        print(failed, file=sys.stderr, flush=True)
    return code


__all__ = ["run", "start", "RayJob", "PlacementError", "RoleFailed"]

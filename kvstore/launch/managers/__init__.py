"""Cluster-manager adapters: the ``DMLC_*`` contract from a cluster manager's own variables.

``python -m kvstore.node CMD`` started without ``DMLC_ROLE`` asks :func:`detect`
which cluster manager started it and derives every role's variables from that
manager's environment plus the **role plan**: the processes of a job, in the
manager's rank order, are

- rank 0: the scheduler,
- ranks 1..S: the servers (``KVSTORE_SERVER_ID`` 0..S-1),
- ranks S+1..S+W: the workers (``DMLC_WORKER_ID`` 0..W-1).

S is ``DMLC_NUM_SERVER`` (or the manager's own list of parameter servers, for
``TF_CONFIG``); W is ``DMLC_NUM_WORKER``, or else the world size - 1 - S.
``KVSTORE_RANK_OFFSET`` is added to the manager's rank so that several jobs can
share one rank order (a scheduler job at offset 0, a servers job at offset 1, a
workers job at offset 1 + S); a job with an offset is one part of the plan, so
``DMLC_NUM_WORKER`` must then be set.

Managers are tried in this order, the first whose variables are present wins
(a launcher started inside another manager's allocation is the inner, more
specific one: ``mpirun`` or ``torchrun`` inside a Slurm job inherits
``SLURM_PROCID=0`` for every process, a ``torchrun`` in a Kubernetes indexed
Job sees ``JOB_COMPLETION_INDEX`` of its pod, not of its process):

1. ``TF_CONFIG`` (TensorFlow's cluster spec, set per task),
2. torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` all set,
3. MPI: ``OMPI_COMM_WORLD_RANK`` (Open MPI), ``PMI_RANK`` (MPICH / Hydra, Intel MPI),
   or ``PMIX_RANK`` with ``OMPI_COMM_WORLD_SIZE`` or ``PMI_SIZE``,
4. Slurm: ``SLURM_PROCID``,
5. Kubernetes indexed Jobs: ``JOB_COMPLETION_INDEX``.

Everything here is pure: each function takes an ``environ`` mapping (a value
that is empty or only whitespace counts as unset, as in :mod:`kvstore.config`)
and returns a new ``dict`` of variables to add to it.  A variable the user set
already wins over a derived one: the returned dict carries the user's value.
Nothing here opens a socket or imports mpi4py or torch; ``kvstore/launch/node.py``
does the impure parts (mpi4py's broadcast of rank 0's address, the scheduler's
port through torchrun's store, the route to the scheduler, starting the scheduler
beside a ``TF_CONFIG`` chief).
See ``docs/cluster-managers.md``.

Modules: :mod:`~kvstore.launch.managers.common` (the :class:`Adapter` and
:class:`Derivation` types, the role plan), one per manager
(:mod:`~kvstore.launch.managers.tfconfig`, :mod:`~kvstore.launch.managers.torchrun`,
:mod:`~kvstore.launch.managers.mpi`, :mod:`~kvstore.launch.managers.slurm`,
:mod:`~kvstore.launch.managers.kubernetes`), and this one: detection.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.errors import ConfigError
from kvstore.launch.managers import kubernetes, mpi, slurm, tfconfig, torchrun
from kvstore.launch.managers.common import Adapter, Derivation

NO_MANAGER = (
    "DMLC_ROLE is not set, and no cluster manager was detected (kvstore.node looks for TF_CONFIG; "
    "torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; Open MPI's OMPI_COMM_WORLD_RANK; "
    "MPICH's PMI_RANK; Slurm's SLURM_PROCID; a Kubernetes indexed Job's JOB_COMPLETION_INDEX). "
    "Set DMLC_ROLE to scheduler, server or worker, start the job with launch.py, or start it "
    "under one of those managers (see docs/cluster-managers.md)")

# torchrun.torch_store relies on TF_CONFIG being the only manager tried before torchrun.
ADAPTERS: tuple[Adapter, ...] = (tfconfig.ADAPTER, torchrun.ADAPTER, mpi.ADAPTER, slurm.ADAPTER,
                                 kubernetes.ADAPTER)
"""The adapters in detection order (see the module's docstring for why this order)."""


def detect(environ: Mapping[str, str]) -> Adapter | None:
    """Return the first adapter, in :data:`ADAPTERS` order, whose variables ``environ`` has; else None.
    Raises nothing."""
    return next((adapter for adapter in ADAPTERS if adapter.matches(environ)), None)


def explain(environ: Mapping[str, str]) -> Derivation:
    """Detect the manager and derive this process's variables, with a summary for the log.

    Raises ConfigError when no manager is detected (naming the ones looked
    for) or when the manager's environment does not fit the plan.
    """
    adapter = detect(environ)
    if adapter is None:
        raise ConfigError(NO_MANAGER)
    return adapter.explain(environ)


def derive(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``DMLC_*`` / ``KVSTORE_*`` variables to add to ``environ`` for this process.

    Always sets ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
    ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER`` and ``KVSTORE_SERVER_ID`` or
    ``DMLC_WORKER_ID`` (for a scheduler, neither); a variable the user set keeps
    the user's value.  Raises ConfigError as :func:`explain` does.
    """
    return explain(environ).env

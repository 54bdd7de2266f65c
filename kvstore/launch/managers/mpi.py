"""MPI (Open MPI, MPICH / Hydra, Intel MPI, PMIx): the ``DMLC_*`` variables from an MPI rank and size."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.errors import ConfigError
from kvstore.launch.managers.common import (
    DEFAULT_ROOT_PORT,
    Adapter,
    Derivation,
    Job,
    job_port,
    place_rank,
    rank_and_size,
    read_text,
    root_port,
)

# The MPI launchers' job ids, in the order tried: Open MPI <= 4 (ORTE), then any PMIx launcher (Open MPI
# 4 and 5, Slurm's srun --mpi=pmix).  MPICH's and Intel MPI's Hydra set neither.
MPI_JOB_IDS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")


def _mpi_vars(env: Mapping[str, str]) -> tuple[str, str] | None:
    """The names of this process's rank and size variables, or None when no MPI launcher set them."""
    if read_text(env, "OMPI_COMM_WORLD_RANK") is not None:
        return "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
    if read_text(env, "PMI_RANK") is not None:
        return "PMI_RANK", "PMI_SIZE"
    if read_text(env, "PMIX_RANK") is not None:
        for size_var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
            if read_text(env, size_var) is not None:
                return "PMIX_RANK", size_var
    return None


def _explain_mpi(env: Mapping[str, str]) -> Derivation:
    """Derive an MPI rank's variables, as :func:`mpi` says.  Raises ConfigError."""
    names = _mpi_vars(env)
    if names is None:
        raise ConfigError("no MPI rank: neither OMPI_COMM_WORLD_RANK, PMI_RANK nor PMIX_RANK (with "
                          "OMPI_COMM_WORLD_SIZE or PMI_SIZE) is set; start the job with mpirun")
    job = Job("mpi", "rank", "processes", names[1], "mpirun -n {n}")
    rank, size = rank_and_size(env, *names, job)
    host = read_text(env, "DMLC_PS_ROOT_URI")
    if host is None:
        raise ConfigError(
            f"MPI rank {rank} of {size}: kvstore.node cannot tell where rank 0 (the scheduler) runs. "
            "Set DMLC_PS_ROOT_URI to the address of rank 0's host for every rank (mpirun -x "
            "DMLC_PS_ROOT_URI=HOST ...), or install mpi4py in this Python, with which rank 0 "
            "broadcasts its address to the others")
    port = root_port(env)
    if port is None:
        job_id = next((text for text in (read_text(env, name) for name in MPI_JOB_IDS) if text), None)
        port = DEFAULT_ROOT_PORT if job_id is None else job_port(job_id)
    return place_rank(env, job, rank, size, host, port)


def mpi(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a process's variables from Open MPI's or MPICH's rank and size.

    The root is ``DMLC_PS_ROOT_URI`` (node.py can fill it in with mpi4py); its
    port is ``DMLC_PS_ROOT_PORT``, else 10000 + CRC-32(job id) % 20000 from the
    launcher's job id (``OMPI_MCA_ess_base_jobid``, else ``PMIX_NAMESPACE``), else
    9091 (MPICH's and Intel MPI's Hydra give no job id).  Raises ConfigError when
    the root is unknown, ``DMLC_PS_ROOT_PORT`` is not in [1, 65535], or the plan
    does not fit the world size.
    """
    return _explain_mpi(environ).env


ADAPTER = Adapter("mpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "PMIX_RANK",
                          *MPI_JOB_IDS),
                  lambda env: _mpi_vars(env) is not None, _explain_mpi)
"""MPI: a rank variable (``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, or ``PMIX_RANK`` with a size) is set."""

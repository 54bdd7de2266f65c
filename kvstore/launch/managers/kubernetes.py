"""Kubernetes indexed Jobs: the ``DMLC_*`` variables from ``JOB_COMPLETION_INDEX`` and the pod's env."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.errors import ConfigError
from kvstore.launch.managers.common import (
    Adapter,
    Derivation,
    Job,
    has,
    place_rank,
    read_text,
    require_int,
    root_port,
)


def _explain_kubernetes(env: Mapping[str, str]) -> Derivation:
    """Derive a pod's variables, as :func:`kubernetes` says.  Raises ConfigError."""
    job = Job("kubernetes", "index", "pods", None, "{n} completions over the Jobs")
    index = require_int(env, "JOB_COMPLETION_INDEX", "Kubernetes sets it in the pods of an Indexed Job")
    missing = [n for n in ("DMLC_NUM_SERVER", "DMLC_NUM_WORKER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT")
               if read_text(env, n) is None]
    if missing:
        raise ConfigError(
            f"a Kubernetes indexed Job (JOB_COMPLETION_INDEX={index}) needs {', '.join(missing)}: set "
            "DMLC_NUM_SERVER and DMLC_NUM_WORKER to the whole plan's counts and DMLC_PS_ROOT_URI / "
            "DMLC_PS_ROOT_PORT to the scheduler Service's name and port, in every pod's env "
            "(see docs/kubernetes/kvstore-job.yaml)")
    port = root_port(env) or 0  # set: checked above
    return place_rank(env, job, index, None, read_text(env, "DMLC_PS_ROOT_URI") or "", port)


def kubernetes(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a pod's variables from ``JOB_COMPLETION_INDEX`` + ``KVSTORE_RANK_OFFSET``.

    ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``, ``DMLC_PS_ROOT_URI`` and
    ``DMLC_PS_ROOT_PORT`` (the scheduler Service) must be set.  Raises
    ConfigError when one is missing, the port is not in [1, 65535] or the rank
    falls outside the plan.
    """
    return _explain_kubernetes(environ).env


ADAPTER = Adapter("kubernetes", ("JOB_COMPLETION_INDEX",), has("JOB_COMPLETION_INDEX"), _explain_kubernetes)
"""Kubernetes indexed Jobs: ``JOB_COMPLETION_INDEX`` is set."""

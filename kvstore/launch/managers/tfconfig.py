"""TensorFlow's ``TF_CONFIG``: the ``DMLC_*`` variables from a task's cluster spec.

ps tasks are the servers, the chief (TensorFlow 1's ``master``) and the workers are the workers, and the
scheduler is the ``scheduler`` job's one task or else runs beside the chief (worker 0 without a chief).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from kvstore.errors import ConfigError
from kvstore.launch.managers.common import Adapter, Derivation, has, read_int, read_text, root_port, user_wins
from kvstore.net.address import parse_host_port


def _address(job: str, index: int, address: object) -> tuple[str, int]:
    """``(host, port)`` of ``cluster.job[index]``.  Raises ConfigError when it is not a 'host:port' string."""
    if not isinstance(address, str):
        raise ConfigError(f"TF_CONFIG: cluster.{job}[{index}] = {address!r} is not a 'host:port' string")
    try:
        return parse_host_port(address)
    except ValueError:
        raise ConfigError(f"TF_CONFIG: cluster.{job}[{index}] = {address!r} is not 'host:port'") from None


def _tf_cluster(env: Mapping[str, str]) -> tuple[dict[str, list], str, int]:
    """TF_CONFIG's cluster, task type and task index.  Raises ConfigError for invalid JSON, a missing
    cluster or task type, a bad index or a job that is not a list."""
    raw = read_text(env, "TF_CONFIG") or ""
    try:
        spec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON ({exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict):
        raise ConfigError("TF_CONFIG has no 'cluster' object: it must look like {\"cluster\": "
                          "{\"chief\": [...], \"worker\": [...], \"ps\": [...]}, \"task\": {\"type\": "
                          "\"worker\", \"index\": 0}}")
    task = spec.get("task")
    if not isinstance(task, dict) or not isinstance(task.get("type"), str):
        raise ConfigError("TF_CONFIG has no 'task' with a 'type': each process needs its own "
                          "{\"task\": {\"type\": ..., \"index\": ...}}")
    index = task.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ConfigError(f"TF_CONFIG: task.index = {index!r} is not an integer >= 0")
    cluster = spec["cluster"]
    for job, addresses in cluster.items():
        if not isinstance(addresses, list):
            raise ConfigError(f"TF_CONFIG: cluster.{job} is not a list of 'host:port' addresses")
    return cluster, task["type"], index


def _chief_name(cluster: dict[str, list]) -> str:
    """How this cluster spells the chief's job: ``master`` (TensorFlow 1) or ``chief``.  Raises
    ConfigError when it has both."""
    if "chief" in cluster and "master" in cluster:
        raise ConfigError("TF_CONFIG: the cluster has both a 'chief' and a 'master' job; 'master' is "
                          "TensorFlow 1's name of the chief, so list one of them")
    return "master" if "master" in cluster else "chief"


def _job_name(kind: str, chief_name: str) -> str:
    """The name in TF_CONFIG of job ``kind`` (``chief`` is spelled ``chief_name``), for the messages."""
    return chief_name if kind == "chief" else kind


def _check_task(jobs: dict[str, list], kind: str, given: str, index: int, chief_name: str,
                has_scheduler: bool) -> None:
    """Check that task ``given:index`` (``kind`` its job, the chief's for a master) is in the cluster.
    Raises ConfigError for an evaluator, an unknown task type or an index out of range."""
    if kind == "evaluator":
        raise ConfigError("TF_CONFIG: an 'evaluator' task is not part of the cluster (it is not in "
                          "cluster and takes no part in training); run it without kvstore.node")
    known = ("chief", "master", "worker", "ps") + (("scheduler",) if has_scheduler else ())
    if kind not in known:
        raise ConfigError(f"TF_CONFIG: task type {given!r} is not one of {', '.join(known)}"
                          + ("" if has_scheduler else " (or 'scheduler', with a scheduler job)"))
    if index >= len(jobs[kind]):
        raise ConfigError(f"TF_CONFIG: task {given}:{index} is out of range: cluster."
                          f"{_job_name(kind, chief_name)} has {len(jobs[kind])} "
                          f"address{'es' if len(jobs[kind]) != 1 else ''}")


def _check_jobs(jobs: dict[str, list], chief_name: str, scheduler: list | None) -> None:
    """Check the cluster's jobs: at most one chief, one scheduler if any, a ps and a chief or worker.
    Raises ConfigError saying which is wrong."""
    chief = jobs["chief"]
    if len(chief) > 1:
        raise ConfigError(f"TF_CONFIG: cluster.{chief_name} has {len(chief)} addresses; there is one "
                          f"{chief_name}")
    if scheduler is not None and len(scheduler) != 1:
        raise ConfigError(f"TF_CONFIG: cluster.scheduler has {len(scheduler)} addresses; give it one")
    if not jobs["ps"]:
        raise ConfigError("TF_CONFIG: the cluster has no 'ps' job; kvstore's servers run as ps tasks, "
                          "so list at least one")
    if not chief and not jobs["worker"]:
        raise ConfigError("TF_CONFIG: the cluster has neither a 'chief' nor a 'worker' job; list at "
                          "least one worker")


def _tf_counts(env: Mapping[str, str], jobs: dict[str, list], chief_name: str) -> dict[str, int]:
    """``DMLC_NUM_SERVER`` and ``DMLC_NUM_WORKER`` as TF_CONFIG tells them.  Raises ConfigError when a
    value the user set disagrees."""
    counts = {"DMLC_NUM_SERVER": len(jobs["ps"]), "DMLC_NUM_WORKER": len(jobs["chief"]) + len(jobs["worker"])}
    for name, count in counts.items():
        set_to = read_int(env, name, minimum=1)
        if set_to is not None and set_to != count:
            job = "ps" if name == "DMLC_NUM_SERVER" else f"{chief_name} + worker"
            raise ConfigError(f"{name}={set_to} but TF_CONFIG lists {count} {job} task"
                              f"{'s' if count != 1 else ''}; unset {name} (TF_CONFIG tells it) or make "
                              "them agree")
    return counts


def _task_role(env: Mapping[str, str], kind: str, index: int, chiefs: int, host: str,
               port: int) -> dict[str, str]:
    """The role variables of task ``kind:index`` at ``host:port`` (``chiefs`` chief tasks come first
    among the workers).  Raises nothing."""
    if kind == "scheduler":
        return {"DMLC_ROLE": "scheduler"}
    if kind == "ps":
        return {"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": str(index), "KVSTORE_NODE_PORT": str(port),
                **_node_host(env, host)}
    worker_id = index + (chiefs if kind == "worker" else 0)
    return {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": str(worker_id), **_node_host(env, host)}


def _node_host(env: Mapping[str, str], host: str) -> dict[str, str]:
    """``{"DMLC_NODE_HOST": host}``, or nothing when ``env`` names a ``DMLC_INTERFACE``: the rule of
    :func:`kvstore.launch.envrules.with_node_host` (the role then binds that interface's address)."""
    return {} if read_text(env, "DMLC_INTERFACE") else {"DMLC_NODE_HOST": host}


def _explain_tf_config(env: Mapping[str, str]) -> Derivation:
    """Derive a task's variables, and whether it hosts the scheduler, as :func:`tf_config` says.
    Raises ConfigError."""
    cluster, given, index = _tf_cluster(env)
    chief_name = _chief_name(cluster)
    kind = "chief" if given == "master" else given
    scheduler = cluster.get("scheduler")
    jobs = {"chief": cluster.get(chief_name, []), "worker": cluster.get("worker", []),
            "ps": cluster.get("ps", []), "scheduler": scheduler or []}
    _check_task(jobs, kind, given, index, chief_name, scheduler is not None)
    _check_jobs(jobs, chief_name, scheduler)
    counts = _tf_counts(env, jobs, chief_name)
    root_port(env)  # a DMLC_PS_ROOT_PORT of the user's wins below: check it
    root_job = "scheduler" if scheduler is not None else "chief" if jobs["chief"] else "worker"
    root = _address(_job_name(root_job, chief_name), 0, jobs[root_job][0])
    host, port = _address(_job_name(kind, chief_name), index, jobs[kind][index])
    derived = {"DMLC_PS_ROOT_URI": root[0], "DMLC_PS_ROOT_PORT": str(root[1]),
               **{name: str(count) for name, count in counts.items()},
               **_task_role(env, kind, index, len(jobs["chief"]), host, port)}
    runs_scheduler = scheduler is None and kind == root_job and index == 0
    return Derivation("tf_config", f"task {given}:{index}", user_wins(env, derived), runs_scheduler)


def tf_config(environ: Mapping[str, str]) -> dict[str, str]:
    """Derive a task's variables from ``TF_CONFIG``.

    ps tasks are the servers (``KVSTORE_SERVER_ID`` = index, binding their own
    address: ``DMLC_NODE_HOST`` and ``KVSTORE_NODE_PORT``); the chief is worker 0
    and worker i is worker i + 1 (worker i without a chief).  TensorFlow 1's
    ``master`` job and task type are the chief's other name.  A ps, chief or
    worker task gets ``DMLC_NODE_HOST`` = its host unless ``DMLC_INTERFACE`` is
    set (then the role binds that interface's address).  The scheduler is the
    ``scheduler`` job's one task, or else runs at the chief's address (worker 0's
    without a chief), started by that task's kvstore.node (see
    :attr:`Derivation.runs_scheduler`).  Raises ConfigError naming TF_CONFIG for
    invalid JSON, an unknown task type, an evaluator, an index out of range or
    both a chief and a master job, and for a ``DMLC_PS_ROOT_PORT`` not in [1, 65535].
    """
    return _explain_tf_config(environ).env


ADAPTER = Adapter("tf_config", ("TF_CONFIG",), has("TF_CONFIG"), _explain_tf_config)
"""TensorFlow's cluster spec: ``TF_CONFIG`` is set (per task)."""

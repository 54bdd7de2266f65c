"""The plan of a job on Ray, pure logic without Ray: its roles in bundle order and what each bundle
asks for, what to say when they cannot be placed, and each role's environment."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.launch import envrules as roles

DEFAULT_SCHEDULER_CPUS = 0.05
DEFAULT_SERVER_CPUS = 0.1
DEFAULT_WORKER_CPUS = 0.1
DEFAULT_PLACEMENT_TIMEOUT = 60.0


@dataclass(frozen=True)
class RoleSpec:
    """One role of the job and what its placement-group bundle asks for."""

    role: str
    rank: int | None
    cpus: float
    gpus: float = 0.0

    @property
    def name(self) -> str:
        """``scheduler``, ``server 0``, ``worker 1``: the prefix of its output lines."""
        return self.role if self.rank is None else f"{self.role} {self.rank}"

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of this role."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}


def role_specs(num_workers: int, num_servers: int, *, scheduler_cpus: float = DEFAULT_SCHEDULER_CPUS,
               server_cpus: float = DEFAULT_SERVER_CPUS, worker_cpus: float = DEFAULT_WORKER_CPUS,
               worker_gpus: float = 0.0) -> list[RoleSpec]:
    """Return the job's roles in bundle order: the scheduler, servers 0..S-1, workers 0..W-1.

    Raises ValueError for a count below 1, a CPU amount that is not > 0 or a
    negative GPU amount.
    """
    if num_workers < 1 or num_servers < 1:
        raise ValueError(f"num_workers and num_servers must be at least 1, not {num_workers} and "
                         f"{num_servers}")
    for what, cpus in (("scheduler_cpus", scheduler_cpus), ("server_cpus", server_cpus),
                       ("worker_cpus", worker_cpus)):
        if not cpus > 0:
            raise ValueError(f"{what}={cpus!r} must be > 0 (a fraction of a CPU is fine)")
    if worker_gpus < 0:
        raise ValueError(f"worker_gpus={worker_gpus!r} must be >= 0")
    return ([RoleSpec("scheduler", None, scheduler_cpus)]
            + [RoleSpec("server", rank, server_cpus) for rank in range(num_servers)]
            + [RoleSpec("worker", rank, worker_cpus, worker_gpus) for rank in range(num_workers)])


def _amount(value: float) -> str:
    """``value`` as a short number: 0.05, 2, 128.2."""
    return f"{value:g}"


def describe_request(roles: Sequence[RoleSpec]) -> str:
    """Say what ``roles`` ask for, e.g. ``1 scheduler x 0.05 CPU, 2 workers x 64 CPU (128.05 CPU in all)``."""
    groups: dict[tuple[str, float, float], int] = {}
    for spec in roles:
        key = (spec.role, spec.cpus, spec.gpus)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (role, cpus, gpus), count in groups.items():
        plural = role + ("s" if count > 1 and role != "scheduler" else "")
        gpu = f" + {_amount(gpus)} GPU" if gpus else ""
        parts.append(f"{count} {plural} x {_amount(cpus)} CPU{gpu}")
    total_cpu = sum(spec.cpus for spec in roles)
    total_gpu = sum(spec.gpus for spec in roles)
    total = f"{total_cpu:.4g} CPU" + (f" and {total_gpu:.4g} GPU" if total_gpu else "")
    return f"{', '.join(parts)} ({total} in all)"


def describe_cluster(total: Mapping[str, float], available: Mapping[str, float],
                     node_cpus: Iterable[float] = ()) -> str:
    """Say what a Ray cluster has: ``2 CPU in all, 1.5 available, on 1 node of at most 2 CPU``."""
    text = f"{_amount(total.get('CPU', 0.0))} CPU in all, {_amount(available.get('CPU', 0.0))} available"
    if total.get("GPU"):
        text += f"; {_amount(total['GPU'])} GPU in all, {_amount(available.get('GPU', 0.0))} available"
    sizes = list(node_cpus)
    if sizes:
        text += f", on {len(sizes)} node{'s' if len(sizes) != 1 else ''} of at most {_amount(max(sizes))} CPU"
    return text


def role_environ(spec: RoleSpec, *, num_workers: int, num_servers: int, secret: str, root_uri: str,
                 root_port: int, node_ip: str, forwarded: Mapping[str, str] | None = None,
                 extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a role's process gets on top of its actor's environment, lowest precedence first:
    ``OMP_NUM_THREADS=1`` (workers), the caller's ``forwarded`` variables, ``PYTHONUNBUFFERED=1`` and
    ``KVSTORE_SECRET``, the caller's ``extra`` (``--env``), and then the ones set per role: ``DMLC_ROLE``,
    ``DMLC_NUM_*``, ``DMLC_PS_ROOT_URI/PORT``, ``DMLC_NODE_HOST`` (left out when ``DMLC_INTERFACE`` is
    given, so the interface's address is used), ``KVSTORE_SERVER_ID`` / ``DMLC_WORKER_ID``."""
    forwarded = {k: v for k, v in (forwarded or {}).items() if k not in roles.PER_ROLE}
    extra = dict(extra or {})
    env: dict[str, str] = {"OMP_NUM_THREADS": "1"} if spec.role == "worker" else {}
    env.update(forwarded)
    env.update({"PYTHONUNBUFFERED": "1", "KVSTORE_SECRET": secret})
    env.update(extra)
    env.update({"DMLC_ROLE": spec.role, "DMLC_NUM_WORKER": str(num_workers),
                "DMLC_NUM_SERVER": str(num_servers), "DMLC_PS_ROOT_URI": root_uri,
                "DMLC_PS_ROOT_PORT": str(root_port)})
    env = roles.with_node_host(env, node_ip)
    if spec.role == "server":
        env["KVSTORE_SERVER_ID"] = str(spec.rank)
    elif spec.role == "worker":
        env["DMLC_WORKER_ID"] = str(spec.rank)
    return env


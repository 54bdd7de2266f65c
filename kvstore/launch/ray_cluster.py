"""A job's footing on Ray: connecting this process to a Ray cluster (or starting a local one), and
finding where the job's placement group put each role's bundle.

Importing this module imports ray (the ``[ray]`` extra).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group_table

from kvstore import config as kvconfig
from kvstore.errors import PlacementError
from kvstore.launch.ray_plan import RoleSpec, describe_cluster, describe_request


def connect(address: str | None) -> bool:
    """Connect this process to Ray: to ``address`` (as ``ray.init`` takes it), or to a new local Ray
    instance when it is None; keep the connection this process has, if any.  Return whether a new
    connection was made (the job then shuts it down).  Raises what ``ray.init`` raises."""
    if ray.is_initialized():
        return False  # this process is connected already: use that cluster and leave it be
    if address is None and "RAY_USAGE_STATS_ENABLED" not in kvconfig.child_environ({}):
        _disable_usage_stats()
    # "local": a new Ray for this job, even where RAY_ADDRESS or a `ray start` cluster on this
    # machine would make ray.init(address=None) join that cluster instead
    ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    return True


def _disable_usage_stats() -> None:
    """Turn off Ray's usage-stats reporting for the Ray instance this process starts."""
    for module in ("ray._common.usage.usage_lib", "ray._private.usage.usage_lib"):
        try:
            lib = __import__(module, fromlist=["set_usage_stats_enabled_via_env_var"])
            lib.set_usage_stats_enabled_via_env_var(False)
            return
        except (ImportError, AttributeError):
            continue


def bundle_nodes(pg: Any, specs: Sequence[RoleSpec], timeout: float) -> list[str]:
    """Wait up to ``timeout`` for the placement group ``pg`` of ``specs`` (one bundle each); return the
    IP of each bundle's node.  Raises PlacementError, saying what the job asks for and what the
    cluster has, when it is not placed in time; or when Ray does not say where a bundle is."""
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        have = describe_cluster(ray.cluster_resources(), ray.available_resources(),
                                [n.get("Resources", {}).get("CPU", 0.0) for n in nodes])
        raise PlacementError(
            f"Ray could not place the job within {timeout:g} s: it asks for "
            f"{describe_request(specs)}, one bundle per role (each must fit on one node), and "
            f"the cluster has {have}. Ask for less (scheduler_cpus, server_cpus, worker_cpus, "
            "worker_gpus) or add nodes.")
    table = placement_group_table(pg)
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    placed = table.get("bundles_to_node_id", {})
    try:
        return [addresses[placed[index]] for index in range(len(specs))]
    except KeyError as exc:
        raise PlacementError(f"Ray placed the job but did not say where bundle {exc} is") from None

"""What the tests of kvstore.launch.managers share: environments and the check of a whole role plan."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from types import MappingProxyType

from kvstore import config as kvconfig
from kvstore.launch import managers

TF = json.dumps({"cluster": {"worker": ["w:1"], "ps": ["p:2"]}, "task": {"type": "worker", "index": 0}})
TORCH = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "m", "MASTER_PORT": "29500"}


Derive = Callable[[Mapping[str, str]], dict[str, str]]


def check_plan(envs: list[Mapping[str, str]], servers: int, workers: int,
               derive: Derive = managers.derive) -> list[dict[str, str]]:
    """Derive every process's variables; assert one scheduler, servers 0..S-1, workers 0..W-1 by rank,
    one root for all, the counts everywhere, and that config accepts the result.  Returns them."""
    results = [derive(MappingProxyType(dict(env))) for env in envs]
    roles = [(r["DMLC_ROLE"], r.get("KVSTORE_SERVER_ID"), r.get("DMLC_WORKER_ID")) for r in results]
    expected = ([("scheduler", None, None)] + [("server", str(i), None) for i in range(servers)]
                + [("worker", None, str(i)) for i in range(workers)])
    assert roles == expected
    assert len({(r["DMLC_PS_ROOT_URI"], r["DMLC_PS_ROOT_PORT"]) for r in results}) == 1
    for env, result in zip(envs, results):
        assert (result["DMLC_NUM_SERVER"], result["DMLC_NUM_WORKER"]) == (str(servers), str(workers))
        cfg = kvconfig.load({**env, **result})
        assert cfg.missing_cluster_vars() == []
    return results


def tf_env(cluster: dict, kind: str, index: int, **extra: str) -> dict[str, str]:
    """An environment with TF_CONFIG for task ``kind:index`` of ``cluster``."""
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}), **extra}

"""The environment the local and ssh launcher build for each role (kvstore.launch.local.Cluster):
--env reaches every role, --env-server only the servers, --env-worker only the workers, and the
launcher's own per-role variables win over all of them.  Nothing is started."""

from __future__ import annotations

import pytest

from kvstore import config as kvconfig
from kvstore.launch.local import Cluster
from kvstore.launch.options import parse_args

FLAGS = ["--env", "ALL=1", "--env", "BOTH=env",
         "--env-server", "ONLY_SERVER=s", "--env-server", "BOTH=server",
         "--env-worker", "ONLY_WORKER=w", "--env-worker", "BOTH=worker", "--env-worker", "OMP_NUM_THREADS=4"]


def _envs(argv: list[str], host: tuple[str, int | None] | None) -> dict[str, dict[str, str]]:
    """The environment of the scheduler, server 0 and worker 0 of ``argv``, placed here or on ``host``."""
    cluster = Cluster(parse_args(argv), kvconfig.Config(secret="s" * 64))
    built = {"scheduler": cluster._child("scheduler", None, ["python"], {}, None, None),
             "server": cluster._child("server", 0, ["python"], {"KVSTORE_SERVER_ID": "0"}, None, host),
             "worker": cluster._child("worker", 0, ["python"], {"DMLC_WORKER_ID": "0"},
                                      {"OMP_NUM_THREADS": "1"}, host)}
    return {role: child.spec.env for role, child in built.items()}


@pytest.mark.parametrize("host", [None, ("node1", 2222)], ids=["local", "ssh"])
def test_per_role_env_reaches_only_its_role(host: tuple[str, int | None] | None) -> None:
    """ONLY_SERVER is on the servers alone, ONLY_WORKER on the workers alone, ALL everywhere; a
    per-role value wins over --env's, and --env-worker OMP_NUM_THREADS over the workers' default."""
    envs = _envs(["-n", "1", "-s", "1", *FLAGS, "x.py"], host)  # ssh: the host is given, no -H read
    assert {role: env.get("ALL") for role, env in envs.items()} == dict.fromkeys(envs, "1")
    assert {role: env.get("ONLY_SERVER") for role, env in envs.items()} == {
        "scheduler": None, "server": "s", "worker": None}
    assert {role: env.get("ONLY_WORKER") for role, env in envs.items()} == {
        "scheduler": None, "server": None, "worker": "w"}
    assert {role: env["BOTH"] for role, env in envs.items()} == {
        "scheduler": "env", "server": "server", "worker": "worker"}
    assert envs["worker"]["OMP_NUM_THREADS"] == "4"
    assert [env["DMLC_ROLE"] for env in envs.values()] == ["scheduler", "server", "worker"]

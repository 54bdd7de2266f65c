"""Unit tests of kvstore.launch.managers.torchrun: torchrun's ranks, its port rule and its shared store."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.launch import managers
from kvstore.launch.managers.torchrun import TorchStore, torch_store, torchrun
from tests.unit.launch.managers.helpers import TF, TORCH, check_plan


def test_torchrun_every_rank_and_port_plus_one():
    """torchrun's ranks follow the plan; the scheduler is at MASTER_ADDR, port MASTER_PORT + 1."""
    base = {"WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "DMLC_NUM_SERVER": "1",
            "LOCAL_RANK": "0"}
    results = check_plan([{**base, "RANK": str(r)} for r in range(4)], 1, 2)
    assert (results[0]["DMLC_PS_ROOT_URI"], results[0]["DMLC_PS_ROOT_PORT"]) == ("node0", "29501")
    given = torchrun({**base, "RANK": "3", "DMLC_PS_ROOT_PORT": "6000"})
    assert given["DMLC_PS_ROOT_PORT"] == "6000"


def test_torchrun_port_limits():
    """MASTER_PORT=65535 leaves no port above it; a bad MASTER_PORT is named."""
    base = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "a", "DMLC_NUM_SERVER": "1"}
    with pytest.raises(ConfigError, match="MASTER_PORT=65535 leaves no port"):
        torchrun({**base, "MASTER_PORT": "65535"})
    with pytest.raises(ConfigError, match="MASTER_PORT='http' is not an integer"):
        torchrun({**base, "MASTER_PORT": "http"})


def test_torchrun_shared_store_carries_the_port():
    """With torchrun's agent store shared (TORCHELASTIC_USE_AGENT_STORE=True, torch >= 2.4), rank 0 binds
    any free port and publishes it; the others must read it (a pure derive says so)."""
    base = {"WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "DMLC_NUM_SERVER": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    store = torch_store({**base, "RANK": "0"})
    key = "kvstore/scheduler_port/none/restart2/nodes1/world4"  # torchrun's defaults for the rest
    assert store == TorchStore("node0", 29500, key, publishes=True)
    assert torch_store({**base, "RANK": "3"}).publishes is False
    scheduler = managers.explain({**base, "RANK": "0"})
    assert (scheduler.role, scheduler.env["DMLC_PS_ROOT_PORT"]) == ("scheduler", "0")
    with pytest.raises(ConfigError, match=r"torchrun rank 3: rank 0 publishes the scheduler's port in "
                       r"torchrun's store at node0:29500 \(key kvstore/scheduler_port/none/restart2/"
                       r"nodes1/world4\)"
                       r".*DMLC_PS_ROOT_PORT"):
        torchrun({**base, "RANK": "3"})
    read = torchrun({**base, "RANK": "3", "DMLC_PS_ROOT_PORT": "41234"})  # as kvstore.node fills it
    assert (read["DMLC_ROLE"], read["DMLC_PS_ROOT_PORT"]) == ("worker", "41234")


ROUND = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "DMLC_NUM_SERVER": "1",
         "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job42",
         "TORCHELASTIC_RESTART_COUNT": "0", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "6"}


def test_torchrun_port_key_names_the_round():
    """Every rank of one rendezvous round uses one key; a restart after a failure, a node joining (more
    nodes and processes), another job's run id each give another key: the store outlives a round."""
    key = "kvstore/scheduler_port/job42/restart0/nodes2/world6"
    for rank, group_rank in ((0, 0), (4, 1), (5, 1)):
        env = {**ROUND, "RANK": str(rank), "GROUP_RANK": str(group_rank), "LOCAL_RANK": str(rank % 3)}
        assert torch_store(env).key == key
    keys = {torch_store({**ROUND, "RANK": "1", **change}).key
            for change in ({}, {"TORCHELASTIC_RESTART_COUNT": "1"}, {"TORCHELASTIC_RUN_ID": "job43"},
                           {"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "9"},  # a node joined, no retry
                           {"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "6"}, {"WORLD_SIZE": "7"})}
    assert len(keys) == 6
    with pytest.raises(ConfigError, match="GROUP_WORLD_SIZE='two' is not an integer"):
        torch_store({**ROUND, "RANK": "1", "GROUP_WORLD_SIZE": "two"})


@pytest.mark.parametrize("change", [{"TORCHELASTIC_USE_AGENT_STORE": "False"},
                                    {"TORCHELASTIC_USE_AGENT_STORE": ""},
                                    {"DMLC_PS_ROOT_PORT": "6000"},
                                    {"KVSTORE_RANK_OFFSET": "0", "DMLC_NUM_WORKER": "2"},
                                    {"TF_CONFIG": TF}])
def test_torchrun_without_a_shared_store_keeps_master_port_plus_one(change):
    """No shared store (older torch, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), a port of the user's, a plan
    split over jobs or another manager: no store; torchrun's port is then DMLC_PS_ROOT_PORT or + 1."""
    env = {**TORCH, "RANK": "1", "DMLC_NUM_SERVER": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", **change}
    assert torch_store(env) is None
    if managers.detect(env).name == "torchrun":
        assert torchrun(env)["DMLC_PS_ROOT_PORT"] == change.get("DMLC_PS_ROOT_PORT", "29501")

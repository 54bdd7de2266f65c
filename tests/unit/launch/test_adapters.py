"""Unit tests of kvstore.adapters: the DMLC_* contract derived from each cluster manager's environment."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import types
import zlib
from collections.abc import Callable, Mapping
from types import MappingProxyType

import pytest

from kvstore import config as kvconfig
from kvstore.errors import ConfigError
from kvstore.launch import adapters, node
from kvstore.net import address

ROLE_IDS = ("DMLC_ROLE", "KVSTORE_SERVER_ID", "DMLC_WORKER_ID")
TF = json.dumps({"cluster": {"worker": ["w:1"], "ps": ["p:2"]}, "task": {"type": "worker", "index": 0}})
TORCH = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "m", "MASTER_PORT": "29500"}


Derive = Callable[[Mapping[str, str]], dict[str, str]]


def check_plan(envs: list[Mapping[str, str]], servers: int, workers: int,
               derive: Derive = adapters.derive) -> list[dict[str, str]]:
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


# -- MPI ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank_var,size_var", [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                               ("PMI_RANK", "PMI_SIZE"),
                                               ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"),
                                               ("PMIX_RANK", "PMI_SIZE")])
def test_mpi_every_rank_gets_its_role(rank_var, size_var):
    """Open MPI, MPICH and PMIx ranks 0..4 with S=2 give the scheduler, servers 0-1 and workers 0-1."""
    base = {size_var: "5", "DMLC_NUM_SERVER": "2", "DMLC_PS_ROOT_URI": "10.0.0.1"}
    results = check_plan([{**base, rank_var: str(r)} for r in range(5)], 2, 2)
    assert results[0]["DMLC_PS_ROOT_URI"] == "10.0.0.1"
    assert results[0]["DMLC_PS_ROOT_PORT"] == "9091"  # MXNet's dmlc tracker's first port
    assert adapters.detect({**base, rank_var: "0"}).name == "mpi"


def test_mpi_workers_default_to_the_rest_and_explicit_counts_are_checked():
    """W = size - 1 - S when DMLC_NUM_WORKER is unset; a DMLC_NUM_WORKER that does not add up is refused."""
    base = {"OMPI_COMM_WORLD_SIZE": "7", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "h"}
    check_plan([{**base, "OMPI_COMM_WORLD_RANK": str(r)} for r in range(7)], 1, 5)
    with pytest.raises(ConfigError, match=r"OMPI_COMM_WORLD_SIZE=7 but DMLC_NUM_SERVER=1 \+ "
                       r"DMLC_NUM_WORKER=2 \+ 1 scheduler = 4 processes; start 4 processes \(mpirun -n 4\)"):
        adapters.mpi({**base, "OMPI_COMM_WORLD_RANK": "0", "DMLC_NUM_WORKER": "2"})


def test_mpi_without_root_names_both_fixes():
    """Without DMLC_PS_ROOT_URI (and so without mpi4py's help) the error says to set it or install mpi4py."""
    with pytest.raises(ConfigError) as info:
        adapters.mpi({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "DMLC_NUM_SERVER": "1"})
    assert "DMLC_PS_ROOT_URI" in str(info.value) and "mpi4py" in str(info.value)


def test_mpi_port_comes_from_the_job_id():
    """Open MPI's job id (OMPI_MCA_ess_base_jobid, else PMIx's namespace) gives every rank one port in
    10000..29999, different for two jobs sharing a node; DMLC_PS_ROOT_PORT wins; no job id: 9091."""
    base = {"OMPI_COMM_WORLD_SIZE": "3", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "h"}

    def port(**extra: str) -> str:
        ports = {adapters.mpi({**base, **extra, "OMPI_COMM_WORLD_RANK": str(r)})["DMLC_PS_ROOT_PORT"]
                 for r in range(3)}
        assert len(ports) == 1  # every rank agrees
        return ports.pop()

    # job ids as the real Open MPI 4.1 mpirun sets them (two concurrent runs on one node)
    one, two = port(OMPI_MCA_ess_base_jobid="1974599681"), port(OMPI_MCA_ess_base_jobid="1974927361")
    assert one == str(10000 + zlib.crc32(b"1974599681") % 20000) and one != two
    assert all(10000 <= int(p) <= 29999 for p in (one, two))
    assert port(PMIX_NAMESPACE="prterun-n01-4242@1") == str(10000 + zlib.crc32(b"prterun-n01-4242@1") % 20000)
    assert port(OMPI_MCA_ess_base_jobid="1974599681", PMIX_NAMESPACE="other") == one  # ORTE's id first
    assert port(OMPI_MCA_ess_base_jobid="1974599681", DMLC_PS_ROOT_PORT="7000") == "7000"
    assert port() == "9091"  # MPICH's Hydra: no job id


@pytest.mark.parametrize("value,match", [("abc", "DMLC_PS_ROOT_PORT='abc' is not an integer"),
                                         ("0", r"DMLC_PS_ROOT_PORT=0 must be in \[1, 65535\]"),
                                         ("65536", r"DMLC_PS_ROOT_PORT=65536 must be in \[1, 65535\]"),
                                         ("-1", r"DMLC_PS_ROOT_PORT=-1 must be in \[1, 65535\]")])
def test_root_port_is_checked_under_every_manager(value, match):
    """A DMLC_PS_ROOT_PORT that is not an int in [1, 65535] is refused by every adapter: under a cluster
    manager nobody reads the port file that 0 (any free port) would need."""
    envs = {
        "mpi": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "DMLC_NUM_SERVER": "1",
                "DMLC_PS_ROOT_URI": "h"},
        "slurm": {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1",
                  "DMLC_NUM_SERVER": "1"},
        "torchrun": {**TORCH, "RANK": "1", "WORLD_SIZE": "3", "DMLC_NUM_SERVER": "1"},
        "kubernetes": {"JOB_COMPLETION_INDEX": "1", "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1",
                       "DMLC_PS_ROOT_URI": "s"},
        "tf_config": tf_env({"chief": ["c:1"], "ps": ["p:2"]}, "ps", 0),
    }
    for name, env in envs.items():
        assert adapters.detect(env).name == name
        with pytest.raises(ConfigError, match=match):
            adapters.derive({**env, "DMLC_PS_ROOT_PORT": value})
        assert adapters.derive({**env, "DMLC_PS_ROOT_PORT": "1"})["DMLC_PS_ROOT_PORT"] == "1"


def test_mpi_rank_and_size_must_be_consistent():
    """A rank at or above the size, a missing size and a non-integer rank are ConfigErrors naming them."""
    base = {"DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "h"}
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_RANK=3 is not below OMPI_COMM_WORLD_SIZE=3"):
        adapters.mpi({**base, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "3"})
    with pytest.raises(ConfigError, match="PMI_SIZE is not set"):
        adapters.mpi({**base, "PMI_RANK": "0"})
    with pytest.raises(ConfigError, match="PMI_RANK='x' is not an integer"):
        adapters.mpi({**base, "PMI_RANK": "x", "PMI_SIZE": "3"})


# -- the plan's errors ----------------------------------------------------------------------------------

def test_world_size_mismatch_says_what_to_start():
    """The brief's example: 4 Slurm tasks for S=2, W=2 asks for 5 tasks (srun -n 5) or other counts."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n01", "DMLC_NUM_SERVER": "2",
           "DMLC_NUM_WORKER": "2"}
    with pytest.raises(ConfigError) as info:
        adapters.slurm(env)
    message = str(info.value)
    assert message.startswith("SLURM_NTASKS=4 but DMLC_NUM_SERVER=2 + DMLC_NUM_WORKER=2 + 1 scheduler = 5 "
                              "tasks; start 5 tasks (srun -n 5)")
    assert "unset DMLC_NUM_WORKER" in message


def test_too_few_processes_for_any_worker():
    """S servers need at least S + 2 processes; fewer is an error asking for that many."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1", "DMLC_NUM_SERVER": "2"}
    with pytest.raises(ConfigError, match=r"SLURM_NTASKS=3 leaves no worker .* 4 tasks \(srun -n 4\)"):
        adapters.slurm(env)


def test_missing_num_server_is_explained():
    """DMLC_NUM_SERVER is required (only TF_CONFIG can tell it); the message shows how to pass it."""
    with pytest.raises(ConfigError, match=r"DMLC_NUM_SERVER is not set.*srun --export=ALL,DMLC_NUM_SERVER=2"):
        adapters.slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(ConfigError, match="DMLC_NUM_SERVER=0 must be >= 1"):
        adapters.slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1",
                        "DMLC_NUM_SERVER": "0"})


def test_rank_offset_splits_a_plan_over_several_jobs():
    """With KVSTORE_RANK_OFFSET a job is part of the plan: three MPI jobs (1, S, W processes) make one."""
    base = {"DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3", "DMLC_PS_ROOT_URI": "sched"}
    envs = [{**base, "KVSTORE_RANK_OFFSET": str(offset), "PMI_RANK": str(r), "PMI_SIZE": str(size)}
            for offset, size in ((0, 1), (1, 2), (3, 3)) for r in range(size)]
    check_plan(envs, 2, 3)


def test_rank_offset_errors():
    """An offset job must set DMLC_NUM_WORKER and fit inside the plan."""
    base = {"PMI_RANK": "0", "PMI_SIZE": "2", "DMLC_NUM_SERVER": "2", "DMLC_PS_ROOT_URI": "h"}
    with pytest.raises(ConfigError, match="DMLC_NUM_WORKER is not set: with KVSTORE_RANK_OFFSET=1"):
        adapters.mpi({**base, "KVSTORE_RANK_OFFSET": "1"})
    with pytest.raises(ConfigError, match=r"KVSTORE_RANK_OFFSET=4 \+ PMI_SIZE=2 = 6 ranks"):
        adapters.mpi({**base, "KVSTORE_RANK_OFFSET": "4", "DMLC_NUM_WORKER": "2"})
    with pytest.raises(ConfigError, match="KVSTORE_RANK_OFFSET=-1 must be >= 0"):
        adapters.mpi({**base, "KVSTORE_RANK_OFFSET": "-1", "DMLC_NUM_WORKER": "2"})


@pytest.mark.parametrize("rank,servers,expected", [
    (0, 2, {"DMLC_ROLE": "scheduler"}), (1, 2, {"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": "0"}),
    (2, 2, {"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": "1"}),
    (3, 2, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0"}),
    (9, 1, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "7"})])
def test_role_for_rank(rank, servers, expected):
    """Rank 0 is the scheduler, 1..S the servers, then the workers."""
    assert adapters.role_for_rank(rank, servers) == expected


# -- Slurm ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,hosts", [
    ("n01", ["n01"]),
    ("n[01-04,7]", ["n01", "n02", "n03", "n04", "n7"]),
    ("a[1-2],b3,c[08-10]", ["a1", "a2", "b3", "c08", "c09", "c10"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[008-010]", ["n008", "n009", "n010"]),
    ("gpu-node[1-2].cluster", ["gpu-node1.cluster", "gpu-node2.cluster"]),
    ("node-1.example.org,node-2.example.org", ["node-1.example.org", "node-2.example.org"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    # three groups, as Slurm's _push_range_list recurses: the middle group slowest, the last fastest
    ("a[1-2]b[1-2]c[1-2]", ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"]),
    ("x[3]", ["x3"]),
    ("n[1-2],,m1", ["n1", "n2", "m1"]),
    ("[1-2]", ["1", "2"]),
])
def test_expand_hostlist(spec, hosts):
    """Slurm's compressed host lists expand in Slurm's order, keeping zero padding."""
    assert adapters.expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec,match", [
    ("n[1-2", "'\\[' without a matching '\\]'"),
    ("n1-2]", "'\\]' without a matching '\\['"),
    ("n[1-[2]]", "nested"),
    ("n[]", "must hold numbers"),
    ("n[a-b]", "must hold numbers"),
    ("n[1-]", "must hold numbers"),
    ("n[3-1]", "runs backwards"),
    ("", "names no host"),
    (" , ", "names no host"),
])
def test_bad_hostlists_are_config_errors(spec, match):
    """Unbalanced or nested brackets, non-numeric or backward ranges and empty lists name the variable."""
    with pytest.raises(ConfigError, match=match) as info:
        adapters.expand_hostlist(spec, "SLURM_STEP_NODELIST")
    assert "SLURM_STEP_NODELIST" in str(info.value)


def test_slurm_every_task_gets_its_role_and_the_first_node():
    """Tasks 0..5 with S=2 give scheduler, 2 servers, 3 workers; the scheduler is on the first node."""
    base = {"SLURM_NTASKS": "6", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_JOB_ID": "4242",
            "DMLC_NUM_SERVER": "2"}
    results = check_plan([{**base, "SLURM_PROCID": str(r)} for r in range(6)], 2, 3)
    assert results[0]["DMLC_PS_ROOT_URI"] == "gpu07"
    assert results[0]["DMLC_PS_ROOT_PORT"] == str(10000 + 4242 % 20000)


def test_slurm_port_rule():
    """The port is DMLC_PS_ROOT_PORT, else 10000 + SLURM_JOB_ID % 20000, else 9091."""
    base = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1", "DMLC_NUM_SERVER": "1"}
    assert adapters.slurm({**base, "SLURM_JOB_ID": "123456"})["DMLC_PS_ROOT_PORT"] == "13456"
    assert adapters.slurm({**base, "SLURM_JOB_ID": "20000"})["DMLC_PS_ROOT_PORT"] == "10000"
    assert adapters.slurm(base)["DMLC_PS_ROOT_PORT"] == "9091"
    given = adapters.slurm({**base, "SLURM_JOB_ID": "7", "DMLC_PS_ROOT_PORT": "5555"})
    assert given["DMLC_PS_ROOT_PORT"] == "5555"
    one, two = (adapters.slurm({**base, "SLURM_JOB_ID": j})["DMLC_PS_ROOT_PORT"] for j in ("100", "101"))
    assert one != two  # two jobs sharing a node do not collide


def test_slurm_step_values_win_over_the_job_allocation():
    """Inside srun the step's node list and task count describe the job, not the allocation's."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "3",
           "SLURM_JOB_NODELIST": "big[1-4]", "SLURM_STEP_NODELIST": "big[3-4]", "DMLC_NUM_SERVER": "1"}
    result = adapters.slurm(env)
    assert (result["DMLC_PS_ROOT_URI"], result["DMLC_NUM_WORKER"]) == ("big3", "1")


def test_slurm_needs_a_node_list_or_a_root():
    """Without a node list the scheduler's host is unknown unless DMLC_PS_ROOT_URI is set."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "DMLC_NUM_SERVER": "1"}
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        adapters.slurm(env)
    assert adapters.slurm({**env, "DMLC_PS_ROOT_URI": "10.1.1.1"})["DMLC_PS_ROOT_URI"] == "10.1.1.1"
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST="):
        adapters.slurm({**env, "SLURM_JOB_NODELIST": "n[1-"})


def test_user_set_variables_win():
    """DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT / DMLC_NODE_HOST set by the user are kept, not derived."""
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "9",
           "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": " 10.9.9.9 ", "DMLC_PS_ROOT_PORT": "7000"}
    result = adapters.slurm(env)
    assert (result["DMLC_PS_ROOT_URI"], result["DMLC_PS_ROOT_PORT"]) == ("10.9.9.9", "7000")
    tf = tf_env({"chief": ["c:1"], "ps": ["p:2"]}, "ps", 0, DMLC_NODE_HOST="10.0.0.7")
    assert adapters.tf_config(tf)["DMLC_NODE_HOST"] == "10.0.0.7"


def test_empty_values_count_as_unset():
    """A blank variable is unset, as in kvstore.config: it neither selects a manager nor wins."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1", "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "  ", "OMPI_COMM_WORLD_RANK": "", "TF_CONFIG": " "}
    assert adapters.detect(env).name == "slurm"
    assert adapters.derive(env)["DMLC_PS_ROOT_URI"] == "n1"


# -- torchrun -------------------------------------------------------------------------------------------

def test_torchrun_every_rank_and_port_plus_one():
    """torchrun's ranks follow the plan; the scheduler is at MASTER_ADDR, port MASTER_PORT + 1."""
    base = {"WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "DMLC_NUM_SERVER": "1",
            "LOCAL_RANK": "0"}
    results = check_plan([{**base, "RANK": str(r)} for r in range(4)], 1, 2)
    assert (results[0]["DMLC_PS_ROOT_URI"], results[0]["DMLC_PS_ROOT_PORT"]) == ("node0", "29501")
    given = adapters.torchrun({**base, "RANK": "3", "DMLC_PS_ROOT_PORT": "6000"})
    assert given["DMLC_PS_ROOT_PORT"] == "6000"


def test_torchrun_port_limits():
    """MASTER_PORT=65535 leaves no port above it; a bad MASTER_PORT is named."""
    base = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "a", "DMLC_NUM_SERVER": "1"}
    with pytest.raises(ConfigError, match="MASTER_PORT=65535 leaves no port"):
        adapters.torchrun({**base, "MASTER_PORT": "65535"})
    with pytest.raises(ConfigError, match="MASTER_PORT='http' is not an integer"):
        adapters.torchrun({**base, "MASTER_PORT": "http"})


def test_torchrun_shared_store_carries_the_port():
    """With torchrun's agent store shared (TORCHELASTIC_USE_AGENT_STORE=True, torch >= 2.4), rank 0 binds
    any free port and publishes it; the others must read it (a pure derive says so)."""
    base = {"WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "DMLC_NUM_SERVER": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    store = adapters.torch_store({**base, "RANK": "0"})
    key = "kvstore/scheduler_port/none/restart2/nodes1/world4"  # torchrun's defaults for the rest
    assert store == adapters.TorchStore("node0", 29500, key, publishes=True)
    assert adapters.torch_store({**base, "RANK": "3"}).publishes is False
    scheduler = adapters.explain({**base, "RANK": "0"})
    assert (scheduler.role, scheduler.env["DMLC_PS_ROOT_PORT"]) == ("scheduler", "0")
    with pytest.raises(ConfigError, match=r"torchrun rank 3: rank 0 publishes the scheduler's port in "
                       r"torchrun's store at node0:29500 \(key kvstore/scheduler_port/none/restart2/"
                       r"nodes1/world4\)"
                       r".*DMLC_PS_ROOT_PORT"):
        adapters.torchrun({**base, "RANK": "3"})
    read = adapters.torchrun({**base, "RANK": "3", "DMLC_PS_ROOT_PORT": "41234"})  # as kvstore.node fills it
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
        assert adapters.torch_store(env).key == key
    keys = {adapters.torch_store({**ROUND, "RANK": "1", **change}).key
            for change in ({}, {"TORCHELASTIC_RESTART_COUNT": "1"}, {"TORCHELASTIC_RUN_ID": "job43"},
                           {"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "9"},  # a node joined, no retry
                           {"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "6"}, {"WORLD_SIZE": "7"})}
    assert len(keys) == 6
    with pytest.raises(ConfigError, match="GROUP_WORLD_SIZE='two' is not an integer"):
        adapters.torch_store({**ROUND, "RANK": "1", "GROUP_WORLD_SIZE": "two"})


@pytest.mark.parametrize("change", [{"TORCHELASTIC_USE_AGENT_STORE": "False"},
                                    {"TORCHELASTIC_USE_AGENT_STORE": ""},
                                    {"DMLC_PS_ROOT_PORT": "6000"},
                                    {"KVSTORE_RANK_OFFSET": "0", "DMLC_NUM_WORKER": "2"},
                                    {"TF_CONFIG": TF}])
def test_torchrun_without_a_shared_store_keeps_master_port_plus_one(change):
    """No shared store (older torch, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), a port of the user's, a plan
    split over jobs or another manager: no store; torchrun's port is then DMLC_PS_ROOT_PORT or + 1."""
    env = {**TORCH, "RANK": "1", "DMLC_NUM_SERVER": "1", "TORCHELASTIC_USE_AGENT_STORE": "True", **change}
    assert adapters.torch_store(env) is None
    if adapters.detect(env).name == "torchrun":
        assert adapters.torchrun(env)["DMLC_PS_ROOT_PORT"] == change.get("DMLC_PS_ROOT_PORT", "29501")


# -- Kubernetes -----------------------------------------------------------------------------------------

def test_kubernetes_three_jobs_with_offsets_make_one_plan():
    """A scheduler job (offset 0), a servers job (offset 1) and a workers job (offset 1 + S)."""
    base = {"DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3", "DMLC_PS_ROOT_URI": "kvstore-scheduler",
            "DMLC_PS_ROOT_PORT": "9091"}
    envs = [{**base, "KVSTORE_RANK_OFFSET": str(offset), "JOB_COMPLETION_INDEX": str(i)}
            for offset, completions in ((0, 1), (1, 2), (3, 3)) for i in range(completions)]
    results = check_plan(envs, 2, 3)
    roots = {(r["DMLC_PS_ROOT_URI"], r["DMLC_PS_ROOT_PORT"]) for r in results}
    assert roots == {("kvstore-scheduler", "9091")}


def test_kubernetes_requires_the_service_and_counts():
    """JOB_COMPLETION_INDEX alone is not enough: the error names every missing variable."""
    with pytest.raises(ConfigError) as info:
        adapters.kubernetes({"JOB_COMPLETION_INDEX": "0", "DMLC_NUM_SERVER": "1"})
    for name in ("DMLC_NUM_WORKER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"):
        assert name in str(info.value)
    assert "DMLC_NUM_SERVER," not in str(info.value)


def test_kubernetes_index_outside_the_plan():
    """An index + offset beyond 1 + S + W (too many completions, a wrong offset) is refused."""
    env = {"JOB_COMPLETION_INDEX": "2", "KVSTORE_RANK_OFFSET": "3", "DMLC_NUM_SERVER": "2",
           "DMLC_NUM_WORKER": "2", "DMLC_PS_ROOT_URI": "s", "DMLC_PS_ROOT_PORT": "9091"}
    with pytest.raises(ConfigError, match=r"index 2 \+ KVSTORE_RANK_OFFSET=3 = rank 5, but .*\(ranks 0..4\)"):
        adapters.kubernetes(env)


# -- TF_CONFIG ------------------------------------------------------------------------------------------

def tf_env(cluster: dict, kind: str, index: int, **extra: str) -> dict[str, str]:
    """An environment with TF_CONFIG for task ``kind:index`` of ``cluster``."""
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}), **extra}


def test_tf_config_with_chief():
    """ps tasks are servers binding their own address; the chief is worker 0, worker i is i + 1; the
    scheduler runs at the chief's address, hosted by the chief's node."""
    cluster = {"chief": ["c0:2222"], "worker": ["w0:2223", "w1:2224"], "ps": ["p0:3000", "p1:3001"]}
    tasks = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1)]
    found = {task: adapters.explain(tf_env(cluster, *task)) for task in tasks}
    for derivation in found.values():
        assert derivation.env["DMLC_PS_ROOT_URI"] == "c0" and derivation.env["DMLC_PS_ROOT_PORT"] == "2222"
        assert (derivation.env["DMLC_NUM_SERVER"], derivation.env["DMLC_NUM_WORKER"]) == ("2", "3")
    assert [found[t].env["DMLC_WORKER_ID"] for t in tasks[:3]] == ["0", "1", "2"]
    assert all(found[t].role == "worker" for t in tasks[:3])
    assert found[("ps", 1)].env == {"DMLC_PS_ROOT_URI": "c0", "DMLC_PS_ROOT_PORT": "2222",
                                    "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3", "DMLC_ROLE": "server",
                                    "KVSTORE_SERVER_ID": "1", "DMLC_NODE_HOST": "p1",
                                    "KVSTORE_NODE_PORT": "3001"}
    assert [t for t, d in found.items() if d.runs_scheduler] == [("chief", 0)]
    assert found[("chief", 0)].summary() == ("tf_config task chief:0 -> worker 0 and the scheduler, "
                                             "scheduler c0:2222")


def test_tf_config_without_chief():
    """Without a chief worker i is worker i, and worker 0 hosts the scheduler at its address."""
    cluster = {"worker": ["w0:5000", "w1:5001"], "ps": ["[::1]:6000"]}
    results = [adapters.explain(tf_env(cluster, "worker", i)) for i in range(2)]
    assert [r.env["DMLC_WORKER_ID"] for r in results] == ["0", "1"]
    assert [r.runs_scheduler for r in results] == [True, False]
    assert {(r.env["DMLC_PS_ROOT_URI"], r.env["DMLC_PS_ROOT_PORT"]) for r in results} == {("w0", "5000")}
    ps = adapters.tf_config(tf_env(cluster, "ps", 0))
    assert (ps["DMLC_NODE_HOST"], ps["KVSTORE_NODE_PORT"]) == ("::1", "6000")


def test_tf_config_with_a_scheduler_job():
    """A 'scheduler' job runs the scheduler at its one address; then no task hosts it beside a worker."""
    cluster = {"scheduler": ["s:7000"], "chief": ["c:1"], "worker": ["w:2"], "ps": ["p:3"]}
    sched = adapters.explain(tf_env(cluster, "scheduler", 0))
    assert sched.role == "scheduler" and not sched.runs_scheduler
    assert (sched.env["DMLC_PS_ROOT_URI"], sched.env["DMLC_PS_ROOT_PORT"]) == ("s", "7000")
    chief = adapters.explain(tf_env(cluster, "chief", 0))
    assert chief.env["DMLC_WORKER_ID"] == "0" and not chief.runs_scheduler
    assert chief.env["DMLC_PS_ROOT_URI"] == "s"


@pytest.mark.parametrize("raw,match", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ('["a"]', "TF_CONFIG has no 'cluster'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}}', "TF_CONFIG has no 'task'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "trainer", "index": 0}}',
     "TF_CONFIG: task type 'trainer' is not one of chief, master, worker, ps"),
    ('{"cluster": {"ps": ["p:1"], "chief": ["c:1"], "master": ["m:1"]}, "task": {"type": "ps", "index": 0}}',
     "both a 'chief' and a 'master' job"),
    ('{"cluster": {"ps": ["p:1"], "master": ["m:1"]}, "task": {"type": "master", "index": 1}}',
     "TF_CONFIG: task master:1 is out of range: cluster.master has 1 address"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "worker", "index": 1}}',
     "TF_CONFIG: task worker:1 is out of range"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "worker", "index": -1}}',
     "TF_CONFIG: task.index = -1"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "evaluator", "index": 0}}',
     "TF_CONFIG: an 'evaluator' task is not part of the cluster"),
    ('{"cluster": {"worker": ["w:2"]}, "task": {"type": "worker", "index": 0}}', "TF_CONFIG: .* no 'ps'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w"]}, "task": {"type": "worker", "index": 0}}',
     "TF_CONFIG: cluster.worker\\[0\\] = 'w' is not 'host:port'"),
    ('{"cluster": {"ps": ["p:1"], "worker": ["w:2"]}, "task": {"type": "scheduler", "index": 0}}',
     "or 'scheduler', with a scheduler job"),
    ('{"cluster": {"ps": ["p:1"], "scheduler": ["a:1", "b:2"], "worker": ["w:2"]}, '
     '"task": {"type": "worker", "index": 0}}', "cluster.scheduler has 2 addresses"),
])
def test_tf_config_errors_name_tf_config(raw, match):
    """Invalid JSON, unknown task types, evaluators and out-of-range indexes are ConfigErrors."""
    with pytest.raises(ConfigError, match=match):
        adapters.derive({"TF_CONFIG": raw})


def test_tf_config_master_is_the_chief():
    """TensorFlow 1's 'master' job and task type are the chief's other name: worker 0, hosting the
    scheduler at its address."""
    cluster = {"master": ["m0:2222"], "worker": ["w0:2223"], "ps": ["p0:3000"]}
    master = adapters.explain(tf_env(cluster, "master", 0))
    assert (master.role, master.env["DMLC_WORKER_ID"], master.runs_scheduler) == ("worker", "0", True)
    assert master.summary() == "tf_config task master:0 -> worker 0 and the scheduler, scheduler m0:2222"
    worker = adapters.tf_config(tf_env(cluster, "worker", 0))
    assert (worker["DMLC_WORKER_ID"], worker["DMLC_PS_ROOT_URI"]) == ("1", "m0")
    assert worker["DMLC_NUM_WORKER"] == "2"
    # a 'chief' task type in a TF1-style cluster, and the reverse, mean the same task
    assert adapters.tf_config(tf_env(cluster, "chief", 0))["DMLC_WORKER_ID"] == "0"
    assert adapters.tf_config(tf_env({"chief": ["c:1"], "ps": ["p:2"]}, "master", 0))["DMLC_NODE_HOST"] == "c"


def test_tf_config_interface_wins_over_the_derived_node_host():
    """With DMLC_INTERFACE set, no task gets a derived DMLC_NODE_HOST (it would win over the interface);
    a DMLC_NODE_HOST of the user's is left as the user set it."""
    cluster = {"chief": ["c0:2222"], "worker": ["w0:2223"], "ps": ["p0:3000"]}
    for kind in ("ps", "chief", "worker"):
        plain = adapters.tf_config(tf_env(cluster, kind, 0))
        assert plain["DMLC_NODE_HOST"] == f"{kind[0]}0"
        derived = adapters.tf_config(tf_env(cluster, kind, 0, DMLC_INTERFACE="eth0"))
        assert "DMLC_NODE_HOST" not in derived
        cfg = kvconfig.load({**tf_env(cluster, kind, 0, DMLC_INTERFACE="eth0"), **derived})
        assert (cfg.interface, cfg.node_host) == ("eth0", None)
        assert node.node_host_env({**tf_env(cluster, kind, 0, DMLC_INTERFACE="eth0"), **derived}) == {}
    ps = adapters.tf_config(tf_env(cluster, "ps", 0, DMLC_INTERFACE=" "))  # blank: unset
    assert ps["DMLC_NODE_HOST"] == "p0" and ps["KVSTORE_NODE_PORT"] == "3000"


def test_tf_config_counts_must_agree_with_dmlc_variables():
    """DMLC_NUM_SERVER / DMLC_NUM_WORKER that contradict TF_CONFIG are refused; agreeing ones are fine."""
    cluster = {"chief": ["c:1"], "worker": ["w:2"], "ps": ["p:3"]}
    with pytest.raises(ConfigError, match="DMLC_NUM_SERVER=2 but TF_CONFIG lists 1 ps task"):
        adapters.tf_config(tf_env(cluster, "ps", 0, DMLC_NUM_SERVER="2"))
    assert adapters.tf_config(tf_env(cluster, "worker", 0, DMLC_NUM_WORKER="2"))["DMLC_WORKER_ID"] == "1"


# -- detection ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env,name", [
    ({"TF_CONFIG": TF, **TORCH, "OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0"}, "tf_config"),
    ({**TORCH, "OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0", "JOB_COMPLETION_INDEX": "0"}, "torchrun"),
    ({"RANK": "1", "WORLD_SIZE": "4", "PMI_RANK": "1", "SLURM_PROCID": "0"}, "mpi"),  # no MASTER_*
    ({"OMPI_COMM_WORLD_RANK": "0", "SLURM_PROCID": "0", "JOB_COMPLETION_INDEX": "0"}, "mpi"),
    ({"PMIX_RANK": "2", "PMI_SIZE": "4", "SLURM_PROCID": "2"}, "mpi"),
    ({"PMIX_RANK": "2", "SLURM_PROCID": "2"}, "slurm"),  # PMIx gives no size: Slurm's variables do
    ({"SLURM_PROCID": "0", "JOB_COMPLETION_INDEX": "0"}, "slurm"),
    ({"JOB_COMPLETION_INDEX": "0"}, "kubernetes"),
    ({"PATH": "/bin", "HOME": "/root"}, None),
])
def test_detection_order(env, name):
    """TF_CONFIG, torchrun, MPI, Slurm, Kubernetes: the first manager whose variables are set wins."""
    found = adapters.detect(env)
    assert (found.name if found else None) == name


def test_detection_order_is_documented():
    """The module's docstring and ADAPTERS list the same order."""
    assert [a.name for a in adapters.ADAPTERS] == ["tf_config", "torchrun", "mpi", "slurm", "kubernetes"]
    doc = adapters.__doc__ or ""
    positions = [doc.index(word) for word in ("1. ``TF_CONFIG``", "2. torchrun", "3. MPI", "4. Slurm",
                                               "5. Kubernetes")]
    assert positions == sorted(positions)


def test_no_manager_keeps_the_dmlc_role_error():
    """Without any manager derive raises the old 'DMLC_ROLE is not set' error, naming the managers."""
    with pytest.raises(ConfigError) as info:
        adapters.derive({"PATH": "/bin"})
    message = str(info.value)
    assert message.startswith("DMLC_ROLE is not set")
    for word in ("TF_CONFIG", "MASTER_ADDR", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                 "JOB_COMPLETION_INDEX"):
        assert word in message


def test_derive_is_pure():
    """derive reads only its argument (a read-only mapping works) and returns a new dict each time."""
    env = MappingProxyType({"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1",
                            "DMLC_NUM_SERVER": "1", "KVSTORE_SECRET": "s3cret"})
    first, second = adapters.derive(env), adapters.derive(env)
    assert first == second and first is not second
    assert "KVSTORE_SECRET" not in first


def test_summary_line_and_no_secret():
    """The log line names manager, position, role and root, and never the secret."""
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_JOB_NODELIST": "n[01-02]", "SLURM_JOB_ID": "42",
           "DMLC_NUM_SERVER": "2", "KVSTORE_SECRET": "hunter2"}
    line = adapters.explain(env).summary()
    assert line == "slurm task 3 of 5 -> worker 0, scheduler n01:10042"
    assert "hunter2" not in line
    k8s = {"JOB_COMPLETION_INDEX": "1", "KVSTORE_RANK_OFFSET": "1", "DMLC_NUM_SERVER": "2",
           "DMLC_NUM_WORKER": "1", "DMLC_PS_ROOT_URI": "fd00::1", "DMLC_PS_ROOT_PORT": "9091"}
    assert adapters.explain(k8s).summary() == ("kubernetes index 1 (rank 2 with KVSTORE_RANK_OFFSET=1) -> "
                                               "server 1, scheduler [fd00::1]:9091")


def test_adapter_objects_derive_like_the_module_functions():
    """Each Adapter's derive equals the module-level function of the same manager."""
    env = {**TORCH, "DMLC_NUM_SERVER": "1"}
    torch_adapter = next(a for a in adapters.ADAPTERS if a.name == "torchrun")
    assert torch_adapter.derive(env) == adapters.torchrun(env) == adapters.derive(env)


# -- kvstore.node's helpers around the adapters -----------------------------------------------------------

def test_rank0_address():
    """Every rank on rank 0's host: 127.0.0.1; else rank 0's address on the route to another host."""
    assert node.rank0_address(["h1", "h1", "h1"]) == "127.0.0.1"
    assert node.rank0_address(["h1", "h1", "localhost"]) == address.route_address("localhost")
    with pytest.raises(ConfigError, match="DMLC_NODE_HOST"):
        node.rank0_address(["h1", "no-such-host.invalid"])


def fake_routes(monkeypatch, routes: dict[str, str]) -> None:
    """Make address.route_address answer from ``routes`` (host -> source address); a host missing from
    it has no route (ConfigError, as the real one raises)."""
    def route_address(host: str, hint: str | None = None) -> str:
        if host not in routes:
            raise ConfigError(f"no route to {host!r}")
        return routes[host]

    monkeypatch.setattr(address, "route_address", route_address)


SERVER = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "n01", "DMLC_PS_ROOT_PORT": "1", "DMLC_NUM_SERVER": "1",
          "DMLC_NUM_WORKER": "1"}


def test_node_host_env_never_advertises_loopback_for_a_named_scheduler(monkeypatch):
    """On the scheduler's node, where /etc/hosts maps the node's own name (Slurm's first host, torchrun's
    MASTER_ADDR) to 127.0.1.1, a server advertises the machine's outward address instead."""
    fake_routes(monkeypatch, {"n01": "127.0.1.1", "192.0.2.1": "10.1.2.3"})
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "10.1.2.3"}
    assert node.node_host_env({**SERVER, "DMLC_ROLE": "worker"}) == {"DMLC_NODE_HOST": "10.1.2.3"}
    fake_routes(monkeypatch, {"n01": "::1", "2001:db8::1": "fd00::7"})  # IPv6 only: the second probe
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "fd00::7"}


def test_node_host_env_keeps_loopback_without_a_default_route(monkeypatch):
    """An isolated machine (no default route) runs every role itself: the loopback address is right."""
    fake_routes(monkeypatch, {"n01": "127.0.1.1"})
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "127.0.1.1"}
    assert address.outward_address() is None


def test_node_host_env_uses_a_real_route_and_leaves_loopback_roots_alone(monkeypatch):
    """A route to another machine gives that address (not the outward one); a root that is itself
    loopback (127.x, ::1, localhost) keeps config's 127.0.0.1 rule and asks for no route at all."""
    fake_routes(monkeypatch, {"n01": "10.9.8.7", "192.0.2.1": "10.1.2.3"})
    assert node.node_host_env(SERVER) == {"DMLC_NODE_HOST": "10.9.8.7"}
    fake_routes(monkeypatch, {})
    for root in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"):
        assert node.node_host_env({**SERVER, "DMLC_PS_ROOT_URI": root}) == {}


def test_outward_address_is_not_loopback_where_there_is_a_default_route():
    """The real probe: this machine's address on its default route, never loopback (or None)."""
    outward = address.outward_address()
    assert outward is None or not address.is_loopback(outward)


def test_node_host_env():
    """A server or worker with a non-loopback root and no address gets the route's; others get nothing."""
    name = socket.gethostname()  # resolvable, and not a loopback *name*, so config has no rule for it
    base = {"DMLC_PS_ROOT_URI": name, "DMLC_PS_ROOT_PORT": "1", "DMLC_NUM_SERVER": "1",
            "DMLC_NUM_WORKER": "1"}
    route = address.route_address(name)  # loopback where /etc/hosts maps this host's name to 127.x
    outward = address.outward_address() or route
    expected = {"DMLC_NODE_HOST": outward if address.is_loopback(route) else route}
    assert node.node_host_env({**base, "DMLC_ROLE": "server"}) == expected
    assert node.node_host_env({**base, "DMLC_ROLE": "worker"}) == expected
    assert node.node_host_env({**base, "DMLC_ROLE": "scheduler"}) == {}
    assert node.node_host_env({**base, "DMLC_ROLE": "server", "DMLC_NODE_HOST": "10.0.0.2"}) == {}
    assert node.node_host_env({**base, "DMLC_ROLE": "server", "DMLC_INTERFACE": "lo"}) == {}
    assert node.node_host_env({**base, "DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1"}) == {}
    unknown = {**base, "DMLC_PS_ROOT_URI": "no-such-host.invalid"}
    assert node.node_host_env({**unknown, "DMLC_ROLE": "worker"}) == {}  # a worker falls back to its name
    with pytest.raises(ConfigError, match="no-such-host.invalid"):
        node.node_host_env({**unknown, "DMLC_ROLE": "server"})


STORE = adapters.TorchStore("127.0.0.1", 1, "kvstore/scheduler_port/none/restart0/nodes1/world4", True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts this process's fds in /proc")
@pytest.mark.parametrize("failing_fork", [1, 2])
def test_publish_port_reports_a_failed_fork(monkeypatch, tmp_path, failing_fork):
    """No first fork, or no second one (in the first child, a real process, joined): an OSError naming
    the helper, fork's reason and the fix; the pipe is closed and the port file's directory removed."""
    real_fork, calls = os.fork, []

    def fork() -> int:
        calls.append(1)  # the first child inherits the parent's one call
        if len(calls) == failing_fork:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return real_fork()

    monkeypatch.setattr(os, "fork", fork)
    port_dir = tmp_path / "kvstore-node"
    port_dir.mkdir()
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match=r"^cannot fork the helper that publishes the scheduler's port in "
                       rf"torchrun's store \({os.strerror(errno.EAGAIN)}\); set DMLC_PS_ROOT_PORT"):
        node.publish_port(STORE, str(port_dir / "scheduler.port"), 1.0)
    assert set(os.listdir("/proc/self/fd")) == fds
    assert not port_dir.exists()


def test_node_main_reports_an_os_error_in_one_line(monkeypatch, capsys):
    """An OSError out of the derivation (a fork refused) is one kvstore.node line and exit 1."""
    def refuse(argv: list[str], env: dict[str, str]) -> int:
        raise OSError("cannot fork the helper that publishes the scheduler's port in torchrun's store")

    monkeypatch.setattr(kvconfig, "child_environ", lambda extra: {})
    monkeypatch.setattr(node, "_run_derived", refuse)
    assert node.main(["train.py"]) == 1
    assert capsys.readouterr().err == ("kvstore.node: cannot fork the helper that publishes the scheduler's "
                                       "port in torchrun's store\n")


def fake_mpi(monkeypatch, names: list[str], allgather_error: Exception | None = None) -> list[str]:
    """Install an in-process stand-in for mpi4py.MPI at rank 0 of ``names`` (every rank's host name);
    returns the list its Finalize appends to."""
    calls: list[str] = []

    class Comm:
        def Get_rank(self) -> int:  # noqa: N802 -- mpi4py's names
            return 0

        def Get_size(self) -> int:  # noqa: N802
            return len(names)

        def Allgather(self, send, recv) -> None:  # noqa: N802
            if allgather_error is not None:
                raise allgather_error
            for row, name in zip(recv, names):
                row[: len(name)] = list(name.encode())

        def Bcast(self, buf, root: int = 0) -> None:  # noqa: N802
            pass

    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = Comm()
    mpi.Get_processor_name = lambda: names[0]
    mpi.Finalize = lambda: calls.append("finalized")
    package = types.ModuleType("mpi4py")
    package.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    return calls


def test_mpi_root_uri_finalizes_on_every_path(monkeypatch):
    """After MPI_Init, MPI is finalized when the exchange fails or rank 0 cannot tell its address; on
    success the caller gets Finalize to call before its exec."""
    calls = fake_mpi(monkeypatch, ["h1", "h1"])
    root, finalize = node._mpi_root_uri()
    assert (root, calls) == ("127.0.0.1", [])
    finalize()
    assert calls == ["finalized"]
    calls = fake_mpi(monkeypatch, ["h1", "no-such-host.invalid"])
    with pytest.raises(ConfigError, match="no-such-host.invalid"):
        node._mpi_root_uri()
    assert calls == ["finalized"]
    calls = fake_mpi(monkeypatch, ["h1", "h2"], allgather_error=RuntimeError("MPI_ERR_COMM"))
    with pytest.raises(RuntimeError, match="MPI_ERR_COMM"):
        node._mpi_root_uri()
    assert calls == ["finalized"]


def test_mpi4py_that_cannot_be_imported_is_a_config_error(monkeypatch):
    """mpi4py found but failing to import (its libmpi missing): a ConfigError saying to set
    DMLC_PS_ROOT_URI, not a traceback."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py raises ImportError
    with pytest.raises(ConfigError, match="mpi4py is installed but cannot be imported .*DMLC_PS_ROOT_URI"):
        node._mpi_root_uri()

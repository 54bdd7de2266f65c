"""Unit tests of kvstore.launch.managers.common: the role plan, its errors, and the rules every adapter
shares (the root port, the user's values winning, blank values, the summary line)."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.launch import managers
from kvstore.launch.managers.common import role_for_rank
from kvstore.launch.managers.mpi import mpi
from kvstore.launch.managers.slurm import slurm
from kvstore.launch.managers.tfconfig import tf_config
from tests.unit.launch.managers.helpers import TORCH, check_plan, tf_env


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
        assert managers.detect(env).name == name
        with pytest.raises(ConfigError, match=match):
            managers.derive({**env, "DMLC_PS_ROOT_PORT": value})
        assert managers.derive({**env, "DMLC_PS_ROOT_PORT": "1"})["DMLC_PS_ROOT_PORT"] == "1"


# -- the plan's errors ----------------------------------------------------------------------------------

def test_world_size_mismatch_says_what_to_start():
    """The brief's example: 4 Slurm tasks for S=2, W=2 asks for 5 tasks (srun -n 5) or other counts."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n01", "DMLC_NUM_SERVER": "2",
           "DMLC_NUM_WORKER": "2"}
    with pytest.raises(ConfigError) as info:
        slurm(env)
    message = str(info.value)
    assert message.startswith("SLURM_NTASKS=4 but DMLC_NUM_SERVER=2 + DMLC_NUM_WORKER=2 + 1 scheduler = 5 "
                              "tasks; start 5 tasks (srun -n 5)")
    assert "unset DMLC_NUM_WORKER" in message


def test_too_few_processes_for_any_worker():
    """S servers need at least S + 2 processes; fewer is an error asking for that many."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1", "DMLC_NUM_SERVER": "2"}
    with pytest.raises(ConfigError, match=r"SLURM_NTASKS=3 leaves no worker .* 4 tasks \(srun -n 4\)"):
        slurm(env)


def test_missing_num_server_is_explained():
    """DMLC_NUM_SERVER is required (only TF_CONFIG can tell it); the message shows how to pass it."""
    with pytest.raises(ConfigError, match=r"DMLC_NUM_SERVER is not set.*srun --export=ALL,DMLC_NUM_SERVER=2"):
        slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(ConfigError, match="DMLC_NUM_SERVER=0 must be >= 1"):
        slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1",
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
        mpi({**base, "KVSTORE_RANK_OFFSET": "1"})
    with pytest.raises(ConfigError, match=r"KVSTORE_RANK_OFFSET=4 \+ PMI_SIZE=2 = 6 ranks"):
        mpi({**base, "KVSTORE_RANK_OFFSET": "4", "DMLC_NUM_WORKER": "2"})
    with pytest.raises(ConfigError, match="KVSTORE_RANK_OFFSET=-1 must be >= 0"):
        mpi({**base, "KVSTORE_RANK_OFFSET": "-1", "DMLC_NUM_WORKER": "2"})


@pytest.mark.parametrize("rank,servers,expected", [
    (0, 2, {"DMLC_ROLE": "scheduler"}), (1, 2, {"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": "0"}),
    (2, 2, {"DMLC_ROLE": "server", "KVSTORE_SERVER_ID": "1"}),
    (3, 2, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "0"}),
    (9, 1, {"DMLC_ROLE": "worker", "DMLC_WORKER_ID": "7"})])
def test_role_for_rank(rank, servers, expected):
    """Rank 0 is the scheduler, 1..S the servers, then the workers."""
    assert role_for_rank(rank, servers) == expected


def test_user_set_variables_win():
    """DMLC_PS_ROOT_URI / DMLC_PS_ROOT_PORT / DMLC_NODE_HOST set by the user are kept, not derived."""
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_ID": "9",
           "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": " 10.9.9.9 ", "DMLC_PS_ROOT_PORT": "7000"}
    result = slurm(env)
    assert (result["DMLC_PS_ROOT_URI"], result["DMLC_PS_ROOT_PORT"]) == ("10.9.9.9", "7000")
    tf = tf_env({"chief": ["c:1"], "ps": ["p:2"]}, "ps", 0, DMLC_NODE_HOST="10.0.0.7")
    assert tf_config(tf)["DMLC_NODE_HOST"] == "10.0.0.7"


def test_empty_values_count_as_unset():
    """A blank variable is unset, as in kvstore.config: it neither selects a manager nor wins."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1", "DMLC_NUM_SERVER": "1",
           "DMLC_PS_ROOT_URI": "  ", "OMPI_COMM_WORLD_RANK": "", "TF_CONFIG": " "}
    assert managers.detect(env).name == "slurm"
    assert managers.derive(env)["DMLC_PS_ROOT_URI"] == "n1"


def test_summary_line_and_no_secret():
    """The log line names manager, position, role and root, and never the secret."""
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "5", "SLURM_JOB_NODELIST": "n[01-02]", "SLURM_JOB_ID": "42",
           "DMLC_NUM_SERVER": "2", "KVSTORE_SECRET": "hunter2"}
    line = managers.explain(env).summary()
    assert line == "slurm task 3 of 5 -> worker 0, scheduler n01:10042"
    assert "hunter2" not in line
    k8s = {"JOB_COMPLETION_INDEX": "1", "KVSTORE_RANK_OFFSET": "1", "DMLC_NUM_SERVER": "2",
           "DMLC_NUM_WORKER": "1", "DMLC_PS_ROOT_URI": "fd00::1", "DMLC_PS_ROOT_PORT": "9091"}
    assert managers.explain(k8s).summary() == ("kubernetes index 1 (rank 2 with KVSTORE_RANK_OFFSET=1) -> "
                                               "server 1, scheduler [fd00::1]:9091")

"""Unit tests of kvstore.launch.managers.slurm: Slurm's host lists and the DMLC_* contract of a task."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.launch.managers.slurm import expand_hostlist, slurm
from tests.unit.launch.managers.helpers import check_plan


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
    assert expand_hostlist(spec) == hosts


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
        expand_hostlist(spec, "SLURM_STEP_NODELIST")
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
    assert slurm({**base, "SLURM_JOB_ID": "123456"})["DMLC_PS_ROOT_PORT"] == "13456"
    assert slurm({**base, "SLURM_JOB_ID": "20000"})["DMLC_PS_ROOT_PORT"] == "10000"
    assert slurm(base)["DMLC_PS_ROOT_PORT"] == "9091"
    given = slurm({**base, "SLURM_JOB_ID": "7", "DMLC_PS_ROOT_PORT": "5555"})
    assert given["DMLC_PS_ROOT_PORT"] == "5555"
    one, two = (slurm({**base, "SLURM_JOB_ID": j})["DMLC_PS_ROOT_PORT"] for j in ("100", "101"))
    assert one != two  # two jobs sharing a node do not collide


def test_slurm_step_values_win_over_the_job_allocation():
    """Inside srun the step's node list and task count describe the job, not the allocation's."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "3",
           "SLURM_JOB_NODELIST": "big[1-4]", "SLURM_STEP_NODELIST": "big[3-4]", "DMLC_NUM_SERVER": "1"}
    result = slurm(env)
    assert (result["DMLC_PS_ROOT_URI"], result["DMLC_NUM_WORKER"]) == ("big3", "1")


def test_slurm_needs_a_node_list_or_a_root():
    """Without a node list the scheduler's host is unknown unless DMLC_PS_ROOT_URI is set."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "DMLC_NUM_SERVER": "1"}
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        slurm(env)
    assert slurm({**env, "DMLC_PS_ROOT_URI": "10.1.1.1"})["DMLC_PS_ROOT_URI"] == "10.1.1.1"
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST="):
        slurm({**env, "SLURM_JOB_NODELIST": "n[1-"})

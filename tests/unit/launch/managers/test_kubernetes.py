"""Unit tests of kvstore.launch.managers.kubernetes: indexed Jobs and their offsets."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.launch.managers.kubernetes import kubernetes
from tests.unit.launch.managers.helpers import check_plan


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
        kubernetes({"JOB_COMPLETION_INDEX": "0", "DMLC_NUM_SERVER": "1"})
    for name in ("DMLC_NUM_WORKER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT"):
        assert name in str(info.value)
    assert "DMLC_NUM_SERVER," not in str(info.value)


def test_kubernetes_index_outside_the_plan():
    """An index + offset beyond 1 + S + W (too many completions, a wrong offset) is refused."""
    env = {"JOB_COMPLETION_INDEX": "2", "KVSTORE_RANK_OFFSET": "3", "DMLC_NUM_SERVER": "2",
           "DMLC_NUM_WORKER": "2", "DMLC_PS_ROOT_URI": "s", "DMLC_PS_ROOT_PORT": "9091"}
    with pytest.raises(ConfigError, match=r"index 2 \+ KVSTORE_RANK_OFFSET=3 = rank 5, but .*\(ranks 0..4\)"):
        kubernetes(env)

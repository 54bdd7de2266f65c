"""Unit tests of kvstore.launch.managers' entry module: detection order, explain and derive."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kvstore.errors import ConfigError
from kvstore.launch import managers
from kvstore.launch.managers.torchrun import torchrun
from tests.unit.launch.managers.helpers import TF, TORCH


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
    found = managers.detect(env)
    assert (found.name if found else None) == name


def test_detection_order_is_documented():
    """The module's docstring and ADAPTERS list the same order."""
    assert [a.name for a in managers.ADAPTERS] == ["tf_config", "torchrun", "mpi", "slurm", "kubernetes"]
    doc = managers.__doc__ or ""
    positions = [doc.index(word) for word in ("1. ``TF_CONFIG``", "2. torchrun", "3. MPI", "4. Slurm",
                                               "5. Kubernetes")]
    assert positions == sorted(positions)


def test_no_manager_keeps_the_dmlc_role_error():
    """Without any manager derive raises the old 'DMLC_ROLE is not set' error, naming the managers."""
    with pytest.raises(ConfigError) as info:
        managers.derive({"PATH": "/bin"})
    message = str(info.value)
    assert message.startswith("DMLC_ROLE is not set")
    for word in ("TF_CONFIG", "MASTER_ADDR", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID",
                 "JOB_COMPLETION_INDEX"):
        assert word in message


def test_derive_is_pure():
    """derive reads only its argument (a read-only mapping works) and returns a new dict each time."""
    env = MappingProxyType({"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_JOB_NODELIST": "n1",
                            "DMLC_NUM_SERVER": "1", "KVSTORE_SECRET": "s3cret"})
    first, second = managers.derive(env), managers.derive(env)
    assert first == second and first is not second
    assert "KVSTORE_SECRET" not in first


def test_adapter_objects_derive_like_the_module_functions():
    """Each Adapter's derive equals the module-level function of the same manager."""
    env = {**TORCH, "DMLC_NUM_SERVER": "1"}
    torch_adapter = next(a for a in managers.ADAPTERS if a.name == "torchrun")
    assert torch_adapter.derive(env) == torchrun(env) == managers.derive(env)

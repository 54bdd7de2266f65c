"""Unit tests of kvstore.launch.managers.mpi: the DMLC_* contract from an MPI rank and size."""

from __future__ import annotations

import zlib

import pytest

from kvstore.errors import ConfigError
from kvstore.launch import managers
from kvstore.launch.managers.mpi import mpi
from tests.unit.launch.managers.helpers import check_plan


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
    assert managers.detect({**base, rank_var: "0"}).name == "mpi"


def test_mpi_workers_default_to_the_rest_and_explicit_counts_are_checked():
    """W = size - 1 - S when DMLC_NUM_WORKER is unset; a DMLC_NUM_WORKER that does not add up is refused."""
    base = {"OMPI_COMM_WORLD_SIZE": "7", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "h"}
    check_plan([{**base, "OMPI_COMM_WORLD_RANK": str(r)} for r in range(7)], 1, 5)
    with pytest.raises(ConfigError, match=r"OMPI_COMM_WORLD_SIZE=7 but DMLC_NUM_SERVER=1 \+ "
                       r"DMLC_NUM_WORKER=2 \+ 1 scheduler = 4 processes; start 4 processes \(mpirun -n 4\)"):
        mpi({**base, "OMPI_COMM_WORLD_RANK": "0", "DMLC_NUM_WORKER": "2"})


def test_mpi_without_root_names_both_fixes():
    """Without DMLC_PS_ROOT_URI (and so without mpi4py's help) the error says to set it or install mpi4py."""
    with pytest.raises(ConfigError) as info:
        mpi({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "DMLC_NUM_SERVER": "1"})
    assert "DMLC_PS_ROOT_URI" in str(info.value) and "mpi4py" in str(info.value)


def test_mpi_port_comes_from_the_job_id():
    """Open MPI's job id (OMPI_MCA_ess_base_jobid, else PMIx's namespace) gives every rank one port in
    10000..29999, different for two jobs sharing a node; DMLC_PS_ROOT_PORT wins; no job id: 9091."""
    base = {"OMPI_COMM_WORLD_SIZE": "3", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "h"}

    def port(**extra: str) -> str:
        ports = {mpi({**base, **extra, "OMPI_COMM_WORLD_RANK": str(r)})["DMLC_PS_ROOT_PORT"]
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


def test_mpi_rank_and_size_must_be_consistent():
    """A rank at or above the size, a missing size and a non-integer rank are ConfigErrors naming them."""
    base = {"DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "h"}
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_RANK=3 is not below OMPI_COMM_WORLD_SIZE=3"):
        mpi({**base, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "3"})
    with pytest.raises(ConfigError, match="PMI_SIZE is not set"):
        mpi({**base, "PMI_RANK": "0"})
    with pytest.raises(ConfigError, match="PMI_RANK='x' is not an integer"):
        mpi({**base, "PMI_RANK": "x", "PMI_SIZE": "3"})

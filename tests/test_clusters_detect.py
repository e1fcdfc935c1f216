"""Detection against the exact environments that real launchers set on this machine (tests/cluster/envs/).

Recorded from ``srun -n 2`` (Slurm 22.05), ``mpirun -n 2`` of Open MPI 4.1 (ORTE, ``--mca oob_tcp_if_include lo``)
and Open MPI 5.0 (PRRTE/PMIx), rank 0 and rank 1 each: every rank must agree on the coordinator and get its own id.
Also the same environments as a multi-node placement would give them (several nodes in the Slurm step, ranks spread
over nodes for Open MPI 5).
"""

from __future__ import annotations

import os

import pytest

from shardax.runtime import detect_launch

ENVS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster", "envs")


def recorded(name: str, rank: int) -> dict[str, str]:
    with open(os.path.join(ENVS, f"{name}-rank{rank}.env")) as f:
        return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)


@pytest.mark.parametrize(("name", "source", "host"), [("slurm", "slurm", "vm"), ("openmpi4", "openmpi4", "127.0.0.1"),
                                                      ("openmpi5", "openmpi5", "127.0.0.1")])
def test_recorded_launcher_environment(name: str, source: str, host: str) -> None:
    infos = [detect_launch(recorded(name, rank)) for rank in (0, 1)]
    assert [i.source for i in infos] == [source, source]
    assert [(i.num_processes, i.process_id) for i in infos] == [(2, 0), (2, 1)]
    assert infos[0].coordinator_address == infos[1].coordinator_address
    address = infos[0].coordinator_address
    assert address is not None and address.rsplit(":", 1)[0] == host
    assert 61440 <= int(address.rsplit(":", 1)[1]) < 65536


def test_recorded_slurm_environment_on_several_nodes() -> None:
    nodes = {"SLURM_STEP_NODELIST": "node[007-008]", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "4"}
    infos = [detect_launch(recorded("slurm", 0) | nodes | {"SLURM_PROCID": str(r)}) for r in range(4)]
    assert {i.coordinator_address.rsplit(":", 1)[0] for i in infos if i.coordinator_address} == {"node007"}
    assert [i.process_id for i in infos] == [0, 1, 2, 3] and {i.num_processes for i in infos} == {4}


def test_recorded_openmpi5_environment_on_several_nodes() -> None:
    spread = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    info = detect_launch(recorded("openmpi5", 1) | spread | {"OMPI_COMM_WORLD_RANK": "3"})
    assert info.source == "openmpi5" and (info.num_processes, info.process_id) == (4, 3)
    assert info.coordinator_address is not None and info.coordinator_address.startswith("vm:")
    pinned = detect_launch(recorded("openmpi5", 1) | spread | {"SHARDAX_COORDINATOR_ADDRESS": "10.0.0.5:1234"})
    assert pinned.coordinator_address == "10.0.0.5:1234"

"""The foundation at the third scale: 2 processes x 4 CPU devices, through `shardax launch` and through `mpirun`.

One launch runs many checks (each launch costs a few seconds): every collective of tests/comm_checks.py on the flat
and the process x device meshes, the expanding smap, and the workflows users come from (multihost psum, mpi4jax-style allreduce
inside jit, pmap-style global axis size). This module must not import conftest: the children import it by path and
must keep the device count of the launcher.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx
from comm_checks import run_all_in_world, to_numpy


def _mpi4jax_style(arr):
    """The mpi4jax talk: `arr + rank`, then an allreduce, inside jit (one rank per device instead of per process)."""
    rank = sx.rank_info().rank
    return sx.comm.allreduce(arr + rank)


def core_world_checks() -> dict:
    w = sx.world()
    done = run_all_in_world()
    mesh = sx.flat_mesh()
    # The same code with mpi4jax would be `mpi4jax.allreduce(arr + rank, op=MPI.SUM, comm=comm)`.
    summed = sx.smap(_mpi4jax_style, in_specs=P(), out_specs=P(), mesh=mesh, jit=True)(jnp.zeros((3, 3)))
    # JAX's multihost pmap: the global axis size is the psum of ones over every device of every host.
    axis_size = sx.smap(lambda: sx.comm.allreduce(jnp.int32(1)), in_specs=(), out_specs=P(), mesh=mesh)()
    # JAX's multi-host guide: psum over all devices of every process of per-device ones.
    xs = jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, P("d")),
                                                np.ones((w.local_device_count,), np.float32))
    psum = sx.smap(lambda x: sx.comm.allreduce(x), in_specs=P("d"), out_specs=P("d"), mesh=mesh,
                   expand=False)(xs)
    ranks = sx.smap(lambda: sx.rank_info().rank, in_specs=(), out_specs=P(sx.ALL), mesh=sx.grid_mesh())()
    return {"world": w, "grid": [[d.id for d in row] for row in sx.device_grid()], "done": done,
            "mpi4jax": to_numpy(summed), "axis_size": int(axis_size), "psum": to_numpy(psum),
            "ranks": to_numpy(ranks)}


def _check(results: list[dict]) -> None:
    assert len(results) == 2
    for pid, res in enumerate(results):
        w = res["world"]
        assert (w.process_id, w.num_processes, w.local_device_count, w.device_count) == (pid, 2, 4, 8)
        assert w.mode == "spmd" and w.num_hosts == 1 and w.platform == "cpu"
        assert np.asarray(res["grid"]).shape == (2, 4)
        assert len(res["done"]) == 20, res["done"]
        np.testing.assert_array_equal(res["mpi4jax"], np.full((3, 3), sum(range(8)), np.float32))
        assert res["axis_size"] == 8
        np.testing.assert_array_equal(res["psum"], np.full(8, 8.0, np.float32))
        np.testing.assert_array_equal(res["ranks"], np.arange(8))
    assert results[0]["grid"] == results[1]["grid"]


@pytest.mark.multiprocess
def test_foundation_two_processes_by_four_devices():
    _check(sx.testing.run_distributed(core_world_checks, num_processes=2, cpu_devices=4, timeout_s=600))


@pytest.mark.multiprocess
@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
def test_foundation_under_mpirun():
    _check(sx.testing.run_distributed(core_world_checks, num_processes=2, cpu_devices=4, timeout_s=600,
                                      launcher="mpirun"))

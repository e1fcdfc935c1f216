"""sx.comm collectives against NumPy references on meshes (1,) ... (2, 4), and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx
from comm_checks import CHECKS
from conftest import make_mesh


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_collective(check, mesh):
    check(mesh)


def test_identity_outside_smap():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(sx.comm.allreduce(x, "max"), x)
    np.testing.assert_array_equal(sx.comm.allgather(x), x[None])
    np.testing.assert_array_equal(sx.comm.allgather(x, tiled=True), x)
    np.testing.assert_array_equal(sx.comm.alltoall(x[:1]), x[:1])
    np.testing.assert_array_equal(sx.comm.bcast(x), x)
    np.testing.assert_array_equal(sx.comm.scan(x, inclusive=False), jnp.zeros_like(x))
    np.testing.assert_array_equal(sx.comm.shift(x, 1), x)
    np.testing.assert_array_equal(sx.comm.shift(x, 1, periodic=False), jnp.zeros_like(x))
    np.testing.assert_array_equal(sx.comm.halo_exchange(x, 1, axes=("d",)), np.pad(np.asarray(x), ((1, 1), (0, 0)),
                                                                                   mode="wrap"))
    data, recv, overflow = sx.comm.alltoallv(jnp.arange(5), jnp.array([3]), capacity=4)
    np.testing.assert_array_equal(data, [0, 1, 2, 0])
    assert recv.tolist() == [3] and not bool(overflow)
    tree, num, overflow = sx.comm.exchange({"pos": jnp.ones((4, 3))}, jnp.zeros(4, jnp.int32), num=3, capacity=2)
    assert int(num) == 2 and bool(overflow) and tree["pos"].shape == (2, 3)


def _in_mesh(f, mesh=None):
    mesh = mesh or make_mesh((4,))
    return sx.smap(f, in_specs=(), out_specs=P(), mesh=mesh)()


def test_bad_input():
    with pytest.raises(ValueError, match=r"leading dimension equal to the number of ranks \(4\)"):
        _in_mesh(lambda: sx.comm.alltoall(jnp.zeros((3, 2))))
    with pytest.raises(ValueError, match="op must be one of"):
        sx.comm.allreduce(jnp.zeros(2), "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"root=4 is outside \[0, 4\)"):
        _in_mesh(lambda: sx.comm.bcast(jnp.zeros(2), root=4))
    with pytest.raises(ValueError, match="'nope' is not a manual mesh axis"):
        _in_mesh(lambda: sx.comm.allreduce(jnp.zeros(2), axis="nope"))
    with pytest.raises(ValueError, match="capacity must be a positive Python int"):
        sx.comm.alltoallv(jnp.zeros(4), jnp.array([4]), capacity=0)
    with pytest.raises(ValueError, match=r"send_counts must have shape \(4,\)"):
        _in_mesh(lambda: sx.comm.alltoallv(jnp.zeros(4), jnp.array([4]), capacity=4)[1].sum())
    with pytest.raises(ValueError, match=r"dest must have shape \(4,\)"):
        sx.comm.exchange({"pos": jnp.zeros((4, 3))}, jnp.zeros(3, jnp.int32), num=4, capacity=4)
    with pytest.raises(TypeError, match="dest must be an integer array"):
        sx.comm.exchange({"pos": jnp.zeros((4, 3))}, jnp.zeros(4), num=4, capacity=4)
    with pytest.raises(ValueError, match="each rank may send once"):
        _in_mesh(lambda: sx.comm.sendrecv(jnp.zeros(2), [(0, 1), (0, 2)]))
    with pytest.raises(ValueError, match="halo width 3 along dimension 0 is larger than the local block"):
        sx.smap(lambda a: sx.comm.halo_exchange(a, 3, axes=("x",)), in_specs=P("x"), out_specs=P("x"),
                mesh=make_mesh((4,)), expand=False)(jnp.zeros(8))


def test_exchange_bad_destination_is_overflow():
    """A valid row addressed to a rank that does not exist is not silently dropped: overflow is raised as data."""
    mesh = make_mesh((2,))

    def f():
        dest = jnp.array([0, 5, 1, 0], jnp.int32)
        _, num, overflow = sx.comm.exchange({"pos": jnp.zeros((4, 2))}, dest, num=4, capacity=8)
        return num[None], overflow[None]

    num, overflow = sx.smap(f, in_specs=(), out_specs=P("x"), mesh=mesh, expand=False)()
    assert overflow.tolist() == [True, True]
    assert num.tolist() == [4, 2]


def test_alltoallv_memory_is_order_capacity():
    """Temporaries of the CPU path stay O(capacity) per device, not O(size * capacity) like a padded all_to_all."""
    mesh = make_mesh((8,))
    capacity, width = 4096, 16

    def f(x, counts):
        return sx.comm.alltoallv(x, counts, capacity=capacity)[0]

    g = jax.jit(sx.smap(f, in_specs=(P(sx.ALL), P(sx.ALL)), out_specs=P(sx.ALL), mesh=mesh))
    compiled = g.lower(jnp.zeros((8, capacity, width)), jnp.zeros((8, 8), jnp.int32)).compile()
    row_bytes = capacity * width * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 4 * row_bytes, f"alltoallv temporaries {temp / row_bytes:.1f}x the receive buffer"

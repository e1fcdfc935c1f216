"""sx.comm collectives against NumPy references on meshes (1,) ... (2, 4), and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx
from comm_checks import CHECKS
from conftest import USER_COMPILER_OPTIONS, make_mesh


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


def test_group_and_count_by_rank_one_device():
    """Outside smap (one device): against NumPy, with keys outside [0, size) (count_by_rank skips them) and the
    compare-and-sort paths of count_by_rank beyond COMPARE_RANKS ranks."""
    rng = np.random.default_rng(3)
    for size, n in ((1, 7), (3, 50), (40, 300)):
        key = rng.integers(0, size + 1, n).astype(np.int32)
        perm, counts = sx.comm.group_by_rank(jnp.asarray(key), size)
        np.testing.assert_array_equal(perm, np.argsort(key, kind="stable"))
        np.testing.assert_array_equal(counts, np.bincount(key, minlength=size + 1)[:size])
        wild = rng.integers(-3, size + 3, n)
        np.testing.assert_array_equal(sx.comm.count_by_rank(jnp.asarray(wild), size),
                                      np.bincount(wild[(wild >= 0) & (wild < size)], minlength=size))
    assert sx.comm.group_by_rank(jnp.zeros((0,), jnp.int32), 2)[1].tolist() == [0, 0]


def test_group_and_count_by_rank_bad_input():
    for fn in (sx.comm.group_by_rank, sx.comm.count_by_rank):
        with pytest.raises(ValueError, match=r"key must have shape \(n,\)"):
            fn(jnp.zeros((2, 3), jnp.int32), 4)
        with pytest.raises(TypeError, match="key must be an integer array of ranks"):
            fn(jnp.zeros(3), 4)
        for size in (0, 2.0, True):
            with pytest.raises(ValueError, match="size must be a positive Python int"):
                fn(jnp.zeros(3, jnp.int32), size)  # type: ignore[arg-type]


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
    for chunk in (0, -2, (), (4, 0), 2.5, True):
        with pytest.raises(ValueError, match="chunk must be None, a positive int or a non-empty tuple"):
            sx.comm.alltoallv(jnp.zeros(4), jnp.array([4]), capacity=4, chunk=chunk)  # type: ignore[arg-type]
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

    num, overflow = sx.smap(f, in_specs=(), out_specs=P("x"), mesh=mesh, expand=False, jit=True)()
    assert overflow.tolist() == [True, True]
    assert num.tolist() == [4, 2]


def test_alltoallv_memory_is_order_capacity():
    """Temporaries of the CPU path stay O(capacity) per device, not O(size * capacity) like a padded all_to_all."""
    mesh = make_mesh((8,))
    capacity, width = 4096, 16

    def f(x, counts):
        return sx.comm.alltoallv(x, counts, capacity=capacity)[0]

    g = jax.jit(sx.smap(f, in_specs=(P(sx.ALL), P(sx.ALL)), out_specs=P(sx.ALL), mesh=mesh))
    compiled = g.lower(jnp.zeros((8, capacity, width)), jnp.zeros((8, 8), jnp.int32)).compile(USER_COMPILER_OPTIONS)
    row_bytes = capacity * width * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 4 * row_bytes, f"alltoallv temporaries {temp / row_bytes:.1f}x the receive buffer"


def test_ragged_path_plan_and_lowering():
    """The GPU path (lax.ragged_all_to_all) cannot run on XLA:CPU; check its offsets by emulating the primitive's
    documented semantics in NumPy against the chunked CPU path, and that it lowers."""
    from shardax import _alltoallv

    mesh = make_mesh((4,))
    size, capacity = 4, 7
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 4, (size, size)).astype(np.int32)
    counts[:, 1] = [3, 3, 2, 1]                      # rank 1 overflows (9 > 7)
    n = int(counts.sum(1).max())
    rows = rng.integers(1, 100, (size, n, 2)).astype(np.int32)

    def plan(c):
        axes = sx.rank_info().axis_names
        return _alltoallv.ragged_plan(c, _alltoallv._exchange_counts(c, axes), capacity, axes)

    io, ss, oo, rs = (np.asarray(a) for a in sx.smap(plan, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh,
                                                       jit=True)(jnp.asarray(counts)))
    emulated = np.zeros((size, capacity, 2), np.int32)
    for s in range(size):
        for j in range(size):
            block = rows[s, io[s, j]: io[s, j] + ss[s, j]]
            emulated[j, oo[s, j]: oo[s, j] + len(block)] = block
    for j in range(size):
        assert rs[j].sum() == min(counts[:, j].sum(), capacity)
    chunked = sx.smap(lambda x, c: sx.comm.alltoallv(x, c, capacity=capacity, impl="chunked")[0],
                      in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh, jit=True)(jnp.asarray(rows),
                                                                                    jnp.asarray(counts))
    np.testing.assert_array_equal(emulated, chunked)

    def ragged(x, c):
        axes = sx.rank_info().axis_names
        return _alltoallv._ragged([x], c, _alltoallv._exchange_counts(c, axes), capacity, axes)[0]

    lowered = jax.jit(sx.smap(ragged, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh)).lower(
        jnp.asarray(rows), jnp.asarray(counts))
    assert "ragged_all_to_all" in lowered.as_text()
    with pytest.raises(ValueError, match="impl='ragged' needs a GPU or TPU backend"):
        sx.smap(lambda x, c: sx.comm.alltoallv(x, c, capacity=capacity, impl="ragged")[0],
                in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh)(jnp.asarray(rows), jnp.asarray(counts))

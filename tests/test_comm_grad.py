"""Gradients through sx.comm.alltoallv and sx.comm.exchange (a permutation of rows: the gradient is the reverse
exchange) against NumPy references of the transposed permutation, on 1 and 8 devices in one process and on 2
processes x 4 CPU devices (through gloo, and through the MPI transport under mpirun).

This module must not import conftest: the children of ``sx.testing.run_distributed`` import it by path and keep the
device count of the launcher. Module-level code stays free of JAX computations.
"""

from __future__ import annotations

import importlib.util
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import shardax as sx
from shardax._alltoallv import alltoallv_many

MESHES = [(1,), (8,), (2, 4)]


def make_mesh(shape: tuple[int, ...]) -> Mesh:
    """A mesh over the first prod(shape) CPU devices, axes named x, y."""
    count = int(np.prod(shape))
    return Mesh(np.asarray(jax.devices()[:count]).reshape(shape), ("x", "y")[:len(shape)])


def _alltoallv_reference(counts: np.ndarray, weights: np.ndarray, rows: int) -> np.ndarray:
    """d/dx of sum_d <data_d, weights_d>: row j of the block rank s sends to rank d lands at row
    ``offset + j`` of d's buffer (blocks packed by source), and gets that row's weight if it fits."""
    size, capacity = weights.shape[:2]
    grad = np.zeros((size, rows, *weights.shape[2:]), weights.dtype)
    for d in range(size):
        at = 0
        for s in range(size):
            start = int(counts[s, :d].sum())
            for j in range(int(counts[s, d])):
                if at + j < capacity:
                    grad[s, start + j] = weights[d, at + j]
            at += int(counts[s, d])
    return grad


def _counts(rng: np.random.Generator, size: int, rows: int) -> np.ndarray:
    counts = rng.multinomial(rows - 2, np.full(size, 1 / size), size=size)  # two rows not sent
    return counts.astype(np.int32)


@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("chunk,capacity", [(None, 48), (3, 48), (2, 20)], ids=["default", "rounds", "overflow"])
def test_alltoallv_grad(shape, chunk, capacity):
    mesh = make_mesh(shape)
    size, rows = mesh.size, 24
    rng = np.random.default_rng(size + capacity)
    x = rng.normal(size=(size, rows, 2)).astype(np.float32)
    counts = _counts(rng, size, rows)
    weights = rng.normal(size=(size, capacity, 2)).astype(np.float32)

    def body(x, counts, weights):
        data, _, _ = sx.comm.alltoallv(x, counts, capacity=capacity, chunk=chunk)
        return jnp.sum(data * weights)[None]

    f = sx.smap(body, in_specs=(P(sx.ALL), P(sx.ALL), P(sx.ALL)), out_specs=P(sx.ALL), mesh=mesh)

    def loss(x):
        return jnp.sum(f(x, counts, weights))

    grad = jax.jit(jax.grad(loss))(x)
    expected = _alltoallv_reference(counts, weights, rows)
    assert np.abs(expected).sum() > 0
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=0, atol=0)
    if capacity < rows * size // 4:  # some rank overflowed: its rows past the buffer have no gradient
        assert (counts.sum(axis=0) > capacity).any()


def test_alltoallv_check_grads():
    mesh = make_mesh((8,))
    rng = np.random.default_rng(1)
    counts = _counts(rng, 8, 12)
    x = jnp.asarray(rng.normal(size=(8, 12, 3)).astype(np.float32))

    def body(x, counts):
        data, _, _ = sx.comm.alltoallv(x, counts, capacity=16, chunk=2)
        return jnp.sin(data)

    f = sx.smap(body, in_specs=(P(sx.ALL), P(sx.ALL)), out_specs=P(sx.ALL), mesh=mesh)
    fn = jax.jit(lambda x: f(x, counts))  # compiled: eager, every operation of the differentiation compiles alone
    check_grads(fn, (x,), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)
    grad = np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(fn(x))))(x))
    assert np.all(np.isfinite(grad)) and np.count_nonzero(grad) > 0   # the bug this guards against: all zeros


def _exchange_reference(dest: np.ndarray, num: np.ndarray, weights: dict[str, np.ndarray],
                        capacity: int) -> dict[str, np.ndarray]:
    """d/d(leaf) of sum_d <leaf'_d, weights_d>: rank d receives the valid rows sent to it, grouped by source rank,
    each source's rows in their order; a row gets the weight of the row it lands at, if that fits."""
    size, n = dest.shape
    grads = {k: np.zeros((size, n, *w.shape[2:]), w.dtype) for k, w in weights.items()}
    for d in range(size):
        at = 0
        for s in range(size):
            for i in range(int(num[s])):
                if dest[s, i] == d:
                    if at < capacity:
                        for k, w in weights.items():
                            grads[k][s, i] = w[d, at]
                    at += 1
    return grads


@pytest.mark.parametrize("shape", MESHES, ids=str)
@pytest.mark.parametrize("capacity", [40, 9], ids=["fits", "overflow"])
def test_exchange_grad(shape, capacity):
    mesh = make_mesh(shape)
    size, n = mesh.size, 16
    rng = np.random.default_rng(7 * size + capacity)
    pos = rng.normal(size=(size, n, 3)).astype(np.float32)
    mass = rng.normal(size=(size, n)).astype(np.float32)
    ids = np.arange(size * n, dtype=np.int32).reshape(size, n)
    dest = rng.integers(0, size, (size, n)).astype(np.int32)
    num = rng.integers(n // 2, n + 1, size).astype(np.int32)
    weights = {"pos": rng.normal(size=(size, capacity, 3)).astype(np.float32),
               "mass": rng.normal(size=(size, capacity)).astype(np.float32)}

    def body(tree, dest, num, wpos, wmass):
        moved, _, _ = sx.comm.exchange(tree, dest, num=num[0], capacity=capacity)
        loss = jnp.sum(moved["pos"] * wpos) + jnp.sum(moved["mass"] * wmass)
        return (loss + jnp.sum(moved["ids"]).astype(jnp.float32) * 0)[None]

    spec = P(sx.ALL)
    f = sx.smap(body, in_specs=(spec,) * 5, out_specs=spec, mesh=mesh)

    def loss(tree):
        return jnp.sum(f(tree, dest, num[:, None], weights["pos"], weights["mass"]))

    tree = {"pos": pos, "mass": mass, "ids": ids}
    grads = jax.jit(jax.grad(loss, allow_int=True))(tree)
    expected = _exchange_reference(dest, num, weights, capacity)
    assert grads["ids"].dtype == jax.dtypes.float0  # integer leaves: no cotangent
    for k in ("pos", "mass"):
        assert np.abs(expected[k]).sum() > 0
        np.testing.assert_array_equal(np.asarray(grads[k]), expected[k], err_msg=k)


def test_exchange_forward_unchanged_by_grad():
    """The value from jax.value_and_grad equals the plain forward (same rows, same order)."""
    mesh = make_mesh((8,))
    rng = np.random.default_rng(3)
    pos = rng.normal(size=(8, 10, 3)).astype(np.float32)
    dest = rng.integers(0, 8, (8, 10)).astype(np.int32)

    def body(pos, dest):
        moved, num, _ = sx.comm.exchange({"pos": pos}, dest, num=10, capacity=30)
        return moved["pos"], num[None]

    f = sx.smap(body, in_specs=(P(sx.ALL), P(sx.ALL)), out_specs=P(sx.ALL), mesh=mesh, jit=True)
    plain, num = f(pos, dest)
    (value, aux), _ = jax.jit(jax.value_and_grad(lambda p: (jnp.sum(f(p, dest)[0] ** 2), f(p, dest)),
                                                 has_aux=True))(pos)
    np.testing.assert_array_equal(np.asarray(aux[0]), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(aux[1]), np.asarray(num))
    np.testing.assert_allclose(float(value), float(np.sum(np.asarray(plain) ** 2)), rtol=1e-6)


def test_placed_exchange_grad_raises():
    """Internal exchanges that place rows by target have no gradient rule: a clear error, not zeros."""
    mesh = make_mesh((8,))
    x = jnp.ones((8, 4), jnp.float32)

    def body(x):
        counts = jnp.full((8,), 0, jnp.int32).at[0].set(4)
        rank = sx.rank_info()[0]
        (out,), _, _ = alltoallv_many([x], counts, 32, ("x",), "auto", None,
                                      target=rank * 4 + jnp.arange(4, dtype=jnp.int32))
        return jnp.sum(out)[None]

    f = sx.smap(body, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh, jit=True)
    assert float(jnp.sum(f(x))) == 32.0  # forward still works
    with pytest.raises(NotImplementedError, match="no gradient through an exchange that places rows"):
        jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(x)


def _paint_grad(mesh_shape, pos: np.ndarray, mass: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, ...]:
    mesh = make_mesh(mesh_shape)
    size = mesh.size
    n = pos.shape[0] // size
    spec = P(*mesh.axis_names)

    def body(pos, mass, weights):
        part = sx.particles.Particles(pos=pos, num=jnp.int32(n), mass=mass)
        rho, _ = sx.fields.local_paint(part, (8, 8, 8), box=1.0, spec=spec, capacity=4 * n)
        return sx.comm.allreduce(jnp.sum(rho * weights))

    f = sx.smap(body, in_specs=(P(sx.ALL), P(sx.ALL), spec), out_specs=P(), mesh=mesh, expand=False)
    grad = jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(pos), jnp.asarray(mass), jnp.asarray(weights))
    return tuple(np.asarray(g) for g in grad)


def test_local_paint_grad_8_devices_matches_1():
    rng = np.random.default_rng(5)
    pos = rng.uniform(0, 1, (64, 3)).astype(np.float32)
    mass = rng.uniform(0.5, 1.5, (64,)).astype(np.float32)
    weights = rng.normal(size=(8, 8, 8)).astype(np.float32)
    one = _paint_grad((1,), pos, mass, weights)
    eight = _paint_grad((8,), pos, mass, weights)
    for g1, g8 in zip(one, eight, strict=True):
        assert np.abs(g1).sum() > 0
        np.testing.assert_allclose(g8, g1, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- 2 processes x 4


def _global(a: np.ndarray, mesh: Mesh) -> jax.Array:
    """``a`` (the same in every process) sharded along its leading axis over every device of ``mesh``."""
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, P(mesh.axis_names)), lambda index: a[index])


def _host(x: jax.Array) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _problem(size: int) -> dict:
    rng = np.random.default_rng(11)
    rows, capacity = 12, 20
    return {"x": rng.normal(size=(size, rows, 2)).astype(np.float32), "counts": _counts(rng, size, rows),
            "weights": rng.normal(size=(size, capacity, 2)).astype(np.float32),
            "dest": rng.integers(0, size, (size, rows)).astype(np.int32), "capacity": capacity}


def _distributed_body() -> dict:
    """alltoallv (chunk 2: several rounds) and exchange gradients on every device of the run."""
    from shardax.runtime import cpu_collectives

    mesh = sx.flat_mesh()
    data = _problem(mesh.size)
    capacity = data["capacity"]
    x, counts, weights, dest = (_global(data[k], mesh) for k in ("x", "counts", "weights", "dest"))

    def body(x, counts, weights, dest):
        got, _, _ = sx.comm.alltoallv(x, counts, capacity=capacity, chunk=2)
        moved, _, _ = sx.comm.exchange({"v": x}, dest, num=x.shape[0], capacity=capacity)
        return (jnp.sum(got * weights) + 2 * jnp.sum(moved["v"] * weights))[None]

    spec = P(sx.ALL)
    f = sx.smap(body, in_specs=(spec,) * 4, out_specs=spec, mesh=mesh)
    grad = jax.jit(jax.grad(lambda x, *rest: jnp.sum(f(x, *rest))))(x, counts, weights, dest)
    return {"grad": _host(grad), "transport": cpu_collectives(), "size": mesh.size}


def _distributed_expected(size: int) -> np.ndarray:
    data = _problem(size)
    n = data["x"].shape[1]
    moved = _exchange_reference(data["dest"], np.full(size, n), {"v": data["weights"]}, data["capacity"])["v"]
    return _alltoallv_reference(data["counts"], data["weights"], n) + 2 * moved


@pytest.mark.multiprocess
def test_grad_two_processes_gloo(tmp_path) -> None:
    (first, second) = sx.testing.run_distributed(_distributed_body, num_processes=2, cpu_devices=4)
    assert first["size"] == 8 and first["transport"] == "gloo"
    np.testing.assert_array_equal(first["grad"], second["grad"])
    np.testing.assert_array_equal(first["grad"], _distributed_expected(8))


@pytest.mark.multiprocess
@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs Open MPI's mpirun and mpi4py")
def test_grad_two_processes_mpi(tmp_path) -> None:
    (first, second) = sx.testing.run_distributed(_distributed_body, num_processes=2, cpu_devices=4,
                                                 launcher="mpirun")
    assert first["size"] == 8 and first["transport"] == "mpi"
    np.testing.assert_array_equal(first["grad"], second["grad"])
    np.testing.assert_array_equal(first["grad"], _distributed_expected(8))

"""Gradients through sx.comm.alltoallv and sx.comm.exchange (a permutation of rows: the gradient is the reverse
exchange) against NumPy references of the transposed permutation, on 1 and 8 devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import shardax as sx
from conftest import make_mesh
from shardax.comm._alltoallv import alltoallv_many

MESHES = [(1,), (8,), (2, 4)]


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
    check_grads(lambda x: f(x, counts), (x,), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


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

    f = sx.smap(body, in_specs=(P(sx.ALL), P(sx.ALL)), out_specs=P(sx.ALL), mesh=mesh)
    plain, num = f(pos, dest)
    (value, aux), _ = jax.value_and_grad(lambda p: (jnp.sum(f(p, dest)[0] ** 2), f(p, dest)), has_aux=True)(pos)
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

    f = sx.smap(body, in_specs=P(sx.ALL), out_specs=P(sx.ALL), mesh=mesh)
    assert float(jnp.sum(f(x))) == 32.0  # forward still works
    with pytest.raises(NotImplementedError, match="no gradient through an exchange that places rows"):
        jax.grad(lambda x: jnp.sum(f(x)))(x)


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

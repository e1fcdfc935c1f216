"""The order of collectives (shardax._order): ``after`` keeps every bit and orders two collectives; the checker finds
the pairs a compiled program leaves unordered; zsort's and the domain's global programs leave none (which is what lets
the CLI jobs load them from a compilation cache, or from another process, on CPU; the other kernels' tests check
theirs with conftest's ``collectives_ordered``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardax as sx
from conftest import collectives_ordered
from shardax._order import after, unordered_collectives
from shardax.particles import zsort


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.uint8, np.float16, jnp.bfloat16, np.bool_, np.int64,
                                   np.float64, np.complex64])
def test_after_keeps_every_bit(dtype) -> None:
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        words = rng.integers(0, 256, size=64 * np.dtype(dtype).itemsize, dtype=np.uint8)
        x = words.view(dtype) if dtype != np.bool_ else words.astype(bool)
        if np.issubdtype(np.dtype(dtype), np.floating):
            x[:4] = np.array([-0.0, np.inf, -np.inf, np.nan], dtype)
        deps = (jnp.float32(-1.5), jnp.arange(3, dtype=jnp.int64), jnp.array([], jnp.float32))
        got = np.asarray(jax.jit(after)(jnp.asarray(x), *deps))
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(x).view(np.uint8))


def test_after_is_the_identity_for_derivatives() -> None:
    def f(x, y):
        return jnp.sum(after(x * y, y) ** 2)

    x, y = jnp.arange(1.0, 4.0), jnp.array([2.0, -1.0, 0.5])
    grads = jax.grad(f, argnums=(0, 1))(x, y)
    want = jax.grad(lambda x, y: jnp.sum((x * y) ** 2), argnums=(0, 1))(x, y)
    for got, expected in zip(grads, want, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    _, tangent = jax.jvp(lambda x: after(x * 2, y), (x,), (jnp.ones(3),))
    np.testing.assert_array_equal(np.asarray(tangent), [2.0, 2.0, 2.0])


def test_checker_finds_an_unordered_pair_and_after_orders_it() -> None:
    mesh = sx.flat_mesh("d")

    def compiled(body):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        return f.lower(jnp.ones((8, 4), jnp.float32)).compile().as_text()

    def independent(x):
        return lax.psum(x, "d") + lax.pmax(x * 2, "d")

    def ordered(x):
        total = lax.psum(x, "d")
        return total + lax.pmax(after(x * 2, total), "d")

    pairs = list(unordered_collectives(compiled(independent)))
    assert len(pairs) == 1, pairs
    assert not list(unordered_collectives(compiled(ordered)))


def test_zsort_and_domain_leave_no_pair_of_collectives_unordered() -> None:
    """zsort with its domain, and the domain of sorted particles, on 8 devices: every pair of collectives of their
    compiled programs is ordered by data (FoF, kNN, paint, readout and the PM force are checked in their own
    tests, on the programs those compile)."""
    mesh = sx.flat_mesh("d")
    part = sx.particles.from_numpy(np.random.default_rng(1).random((8 * 701, 3)).astype(np.float32), mesh=mesh)
    with collectives_ordered() as texts:
        out, _, _ = zsort.smap(mesh)(part, box=1.0, return_domain=True, num_cells=4)
        sx.particles.domain.smap(mesh)(out, box=1.0, num_cells=4)
    assert len(texts) >= 2

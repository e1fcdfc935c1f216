"""Triangular solves on the distributed Cholesky factor, the log-determinant and the SPD inverse (local view)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..comm import allgather, allreduce
from ..core import rank_info
from ._layout import BlockCyclic, gather_columns, global_columns
from ._vary import index, vary_like


def _factor_column(factor: jax.Array, k: jax.Array, layout: BlockCyclic) -> jax.Array:
    """This device's copy of global column block ``k`` (meaningful on its owner), `(padded, tile)`."""
    t = layout.tile
    return lax.dynamic_slice(factor, index(0, (k // layout.nproc) * t), (layout.padded, t))


def cho_solve_local(factor: jax.Array, b: jax.Array, layout: BlockCyclic) -> jax.Array:
    """Solve ``(L L^H) x = b`` with the distributed factor.

    Both solves read the factor by row blocks: row block ``k`` of the local columns is contiguous, and every device
    multiplies its own part of it at once (a `(tile, width)` matrix-vector product), so each step is one small
    all-reduce and no device reads a whole column block alone. The forward solve is left-looking: the devices sum
    ``L[k, :k] y[:k]`` over their columns and the owner of block ``k`` solves its diagonal block; ``y`` stays
    distributed like the columns. The backward solve is right-looking: the owner of block ``k`` solves for ``x_k``,
    which is broadcast, and every device subtracts ``L[k, :]^H x_k`` from its share of the right-hand side. No
    masking is needed: the factor's upper triangle is zero, the unsolved entries of ``y`` are zero, and the
    backward update reaches block ``k``'s own entries only after they are read.

    Args:
        factor: `(padded, width)` local columns of the lower factor (from ``potrf_local``; upper triangle zero).
        b: `(padded, nrhs)` right-hand sides, the same on every device (zero in the padding rows).
        layout: the block-cyclic layout.

    Returns:
        `x: (padded, nrhs)`, the same on every device.
    """
    rank, size, _ = rank_info()
    t, width = layout.tile, layout.width
    nrhs = b.shape[1]

    def row_block(k):
        return lax.dynamic_slice(factor, index(k * t, 0), (t, width))

    def diagonal(row, k):
        return lax.dynamic_slice(row, index(0, (k // size) * t), (t, t))

    def forward(k, y):
        row = row_block(k)
        reduced = allreduce(row @ y)

        def own(y):
            rhs = lax.dynamic_slice(b, index(k * t, 0), (t, nrhs)) - reduced
            yk = lax.linalg.triangular_solve(diagonal(row, k), rhs, left_side=True, lower=True)
            return lax.dynamic_update_slice(y, yk, index((k // size) * t, 0))

        return lax.cond(rank == k % size, own, lambda y: y, y)

    # y: (width, nrhs), the entries of the forward solution at this device's columns.
    y = lax.fori_loop(jnp.int32(0), jnp.int32(layout.blocks), forward,
                      vary_like(jnp.zeros((width, nrhs), b.dtype), factor))

    def backward(i, carry):
        rhs, x = carry
        k = layout.blocks - 1 - i
        row = row_block(k)

        def own(rhs):
            rk = lax.dynamic_slice(rhs, index((k // size) * t, 0), (t, nrhs))
            return lax.linalg.triangular_solve(diagonal(row, k), rk, left_side=True, lower=True, transpose_a=True,
                                               conjugate_a=True)

        xk = lax.cond(rank == k % size, own, lambda rhs: vary_like(jnp.zeros((t, nrhs), rhs.dtype), factor), rhs)
        xk = allreduce(xk)
        return rhs - jnp.conj(row).T @ xk, lax.dynamic_update_slice(x, xk, index(k * t, 0))

    _, x = lax.fori_loop(jnp.int32(0), jnp.int32(layout.blocks), backward, (y, jnp.zeros_like(b)))
    return x


def logdet_local(factor: jax.Array, layout: BlockCyclic) -> jax.Array:
    """``log det(L L^H) = 2 sum log diag(L)`` (real), the same on every device; NaN if ``factor`` is NaN."""
    rank = rank_info().rank
    cols = global_columns(rank, layout)
    diag = jnp.real(factor[jnp.minimum(cols, layout.padded - 1), jnp.arange(layout.width, dtype=jnp.int32)])
    terms = jnp.where(cols < layout.n, 2 * jnp.log(diag), jnp.zeros_like(diag))
    return allreduce(jnp.sum(terms))


def inverse_local(factor: jax.Array, layout: BlockCyclic) -> jax.Array:
    """Local columns `(padded, width)` of ``(L L^H)^{-1} = L^{-H} L^{-1}``.

    ``W = L^{-1}`` is computed with its columns distributed like ``L``'s (a right-looking solve against the local
    columns of the identity, one panel broadcast per step), then gathered so that each device forms its columns of
    ``W^H W``: ``2 N^3 / P`` flops per device for each of the two stages.
    """
    rank, size, _ = rank_info()
    t, npad = layout.tile, layout.padded
    rows = jnp.arange(npad, dtype=jnp.int32)[:, None]
    cols = global_columns(rank, layout)
    w = (rows == cols[None, :]).astype(factor.dtype)

    def step(k, w):
        column = _factor_column(factor, k, layout)
        panel = allreduce(jnp.where(rank == k % size, column, jnp.zeros_like(column)))
        diag = lax.dynamic_slice(panel, index(k * t, 0), (t, t))
        wk = lax.linalg.triangular_solve(diag, lax.dynamic_slice(w, index(k * t, 0), (t, layout.width)),
                                         left_side=True, lower=True)
        w = lax.dynamic_update_slice(w, wk, index(k * t, 0))
        below = jnp.where(rows >= (k + 1) * t, panel, jnp.zeros_like(panel))
        return w - below @ wk

    w = lax.fori_loop(jnp.int32(0), jnp.int32(layout.blocks), step, vary_like(w, factor))
    full = gather_columns(w, layout, allgather)
    return jnp.conj(full).T @ w

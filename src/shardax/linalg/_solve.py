"""Triangular solves on the distributed Cholesky factor, the log-determinant and the SPD inverse (local view)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..comm import allgather, allreduce
from ..core import rank_info
from ._layout import BlockCyclic, gather_columns, global_columns
from ._vary import index, vary_like


def _factor_column(factor: jax.Array, k: jax.Array, layout: BlockCyclic) -> tuple[jax.Array, jax.Array]:
    """This device's copy of global column block ``k`` (meaningful on its owner) as ``(column, diagonal block)``."""
    t = layout.tile
    column = lax.dynamic_slice(factor, index(0, (k // layout.nproc) * t), (layout.padded, t))
    return column, lax.dynamic_slice(column, index(k * t, 0), (t, t))


def cho_solve_local(factor: jax.Array, b: jax.Array, layout: BlockCyclic) -> jax.Array:
    """Solve ``(L L^H) x = b`` with the distributed factor.

    Each step sends one ``(tile, nrhs)`` block over the devices: the forward solve is left-looking (every device
    accumulates the products of its own columns and the owner of block ``k`` reduces them), the backward solve
    broadcasts each solved block.

    Args:
        factor: `(padded, width)` local columns of the lower factor (from ``potrf_local``).
        b: `(padded, nrhs)` right-hand sides, the same on every device (zero in the padding rows).
        layout: the block-cyclic layout.

    Returns:
        `x: (padded, nrhs)`, the same on every device.
    """
    rank, size, _ = rank_info()
    t, npad = layout.tile, layout.padded
    rows = jnp.arange(npad, dtype=jnp.int32)[:, None]
    nrhs = b.shape[1]

    def forward(k, carry):
        partial, y = carry
        reduced = allreduce(lax.dynamic_slice(partial, index(k * t, 0), (t, nrhs)))

        def own(carry):
            partial, y = carry
            column, diag = _factor_column(factor, k, layout)
            yk = lax.linalg.triangular_solve(diag, lax.dynamic_slice(b, index(k * t, 0), (t, nrhs)) - reduced,
                                             left_side=True, lower=True)
            below = jnp.where(rows >= (k + 1) * t, column, jnp.zeros_like(column))
            return partial + below @ yk, lax.dynamic_update_slice(y, yk, index(k * t, 0))

        return lax.cond(rank == k % size, own, lambda carry: carry, (partial, y))

    zeros = vary_like(jnp.zeros_like(b), factor)
    _, y = lax.fori_loop(jnp.int32(0), jnp.int32(layout.blocks), forward, (zeros, zeros))

    def backward(i, x):
        k = layout.blocks - 1 - i

        def own(x):
            column, diag = _factor_column(factor, k, layout)
            below = jnp.where(rows >= (k + 1) * t, column, jnp.zeros_like(column))
            rhs = lax.dynamic_slice(y, index(k * t, 0), (t, nrhs)) - jnp.conj(below).T @ x
            return lax.linalg.triangular_solve(diag, rhs, left_side=True, lower=True, transpose_a=True,
                                               conjugate_a=True)

        xk = lax.cond(rank == k % size, own, lambda x: vary_like(jnp.zeros((t, nrhs), x.dtype), factor), x)
        return lax.dynamic_update_slice(x, allreduce(xk), index(k * t, 0))

    return lax.fori_loop(jnp.int32(0), jnp.int32(layout.blocks), backward, jnp.zeros_like(b))


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
        column, _ = _factor_column(factor, k, layout)
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

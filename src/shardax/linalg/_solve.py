"""Triangular solves on the distributed Cholesky factor, the log-determinant and the SPD inverse (local view)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..comm import allreduce
from ..core import rank_info, vary_like
from ._layout import BlockCyclic, global_columns
from ._potrf import phase_bounds, solve_diagonal
from ._slice_index import index


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

    Two distributed triangular solves with the identity's columns as right-hand sides, each device on its own
    columns, the column blocks of ``L`` broadcast by one all-reduce per step (their rows from the phase's first block
    down; the loops split into ``phase_bounds`` phases with static windows, as in ``potrf_local``):

    1. ``W = L^{-1}``, right-looking: row block ``k`` of ``W`` is ``L_kk^{-1}`` times itself, then the rows below take
       ``-= L[below k, k] W[k, :]``. Only the columns that can be nonzero by the phase's end take part (``W`` is lower
       triangular): ``N^3 / (3P)`` flops per device, phase-rounded.
    2. ``X = L^{-H} W``, left-looking from the last block: ``X[k, :] = L_kk^{-H} (W[k, :] - L[below k, k]^H
       X[below k, :])``, one ``(tile, rows) x (rows, width)`` product per step: ``N^3 / P`` flops per device.

    Together ``4 N^3 / (3P)`` flops per device, a third of what updating all of ``W`` every step and then forming
    ``W^H W`` would take.
    """
    rank, size, _ = rank_info()
    t, npad, width = layout.tile, layout.padded, layout.width
    cols = global_columns(rank, layout)
    w = vary_like((jnp.arange(npad, dtype=jnp.int32)[:, None] == cols[None, :]).astype(factor.dtype), factor)
    bounds = phase_bounds(layout.blocks)

    def column_block(k, row0, height):
        """Column block ``k`` of ``L`` from row ``row0`` down, on every device, and its diagonal block."""
        column = lax.dynamic_slice(factor, index(row0, (k // size) * t), (height, t))
        panel = allreduce(jnp.where(rank == k % size, column, jnp.zeros_like(column)))
        return panel, lax.dynamic_slice(panel, index(k * t - row0, 0), (t, t))

    for q in range(len(bounds) - 1):
        first, last = bounds[q], bounds[q + 1]
        # Columns whose global index is below the phase's last block: the others are still zero in these rows.
        row0, live = first * t, -(-last // size) * t
        rows = jnp.arange(npad - row0, dtype=jnp.int32)[:, None]

        def forward(k, win, row0=row0, rows=rows, live=live):
            panel, diag = column_block(k, row0, npad - row0)
            wk = solve_diagonal(diag, lax.dynamic_slice(win, index(k * t - row0, 0), (t, live)))
            win = lax.dynamic_update_slice(win, wk, index(k * t - row0, 0))
            below = jnp.where(rows >= k * t - row0 + t, panel, jnp.zeros_like(panel))
            return win - below @ wk

        win = lax.fori_loop(jnp.int32(first), jnp.int32(last), forward, w[row0:, :live])
        w = w.at[row0:, :live].set(win)

    x = jnp.zeros_like(w)
    for q in reversed(range(len(bounds) - 1)):
        first, last = bounds[q], bounds[q + 1]
        row0 = first * t
        rows = jnp.arange(npad - row0, dtype=jnp.int32)[:, None]

        def backward(i, win, first=first, last=last, row0=row0, rows=rows):
            k = first + last - 1 - i
            panel, diag = column_block(k, row0, npad - row0)
            below = jnp.where(rows >= k * t - row0 + t, panel, jnp.zeros_like(panel))
            rhs = lax.dynamic_slice(w, index(k * t, 0), (t, width)) - jnp.conj(below).T @ win
            return lax.dynamic_update_slice(win, solve_diagonal(diag, rhs, adjoint=True), index(k * t - row0, 0))

        win = lax.fori_loop(jnp.int32(first), jnp.int32(last), backward, x[row0:])
        x = x.at[row0:].set(win)
    return x

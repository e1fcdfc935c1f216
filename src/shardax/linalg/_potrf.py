"""Blocked right-looking Cholesky factorisation in the local view (block-cyclic columns, see ``_layout``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..comm import allreduce
from ..core import rank_info
from ._layout import BlockCyclic, global_columns
from ._vary import index, vary_like

# The fori_loop over factorisation steps is split into at most this many phases with static, shrinking windows:
# phase q only touches rows and local columns past its start, its update skips the column groups' upper triangles,
# and the phase's own group is skipped once it is factored (the dense products would otherwise do up to 6x the
# flops of an exact Cholesky).
MAX_PHASES = 16


def phase_bounds(local_blocks: int, max_phases: int = MAX_PHASES) -> list[int]:
    """Boundaries (in local blocks) of at most ``max_phases`` phases of a loop over the local blocks."""
    count = min(local_blocks, max_phases)
    return sorted({round(i * local_blocks / count) for i in range(count + 1)})


# Diagonal blocks are factored by recursive halving down to blocks of at most this order, which run one fori_loop
# step per column.
LEAF = 32


def _leaf_factor(d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(L, L^{-1})`` of the Hermitian ``d: (n, n)`` (lower triangle read) by an unblocked Cholesky whose step ``j``
    also forms row ``j`` of the inverse (it needs only rows ``<= j`` of ``L``). NaN where ``d`` is not positive
    definite."""
    n = d.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    eye = jnp.eye(n, dtype=d.dtype)

    def body(j, carry):
        m, factor, inverse = carry
        # Only the real part of the diagonal is read, as LAPACK does.
        root = jnp.sqrt(jnp.real(lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(m, j, 0, False), j, 0, False)))
        column = lax.dynamic_index_in_dim(m, j, 1, False) / root.astype(m.dtype)
        column = jnp.where(rows > j, column, jnp.where(rows == j, root.astype(m.dtype), jnp.zeros_like(column)))
        factor = lax.dynamic_update_index_in_dim(factor, column, j, 1)
        row = lax.dynamic_index_in_dim(factor, j, 0, False)
        inverse_row = (lax.dynamic_index_in_dim(eye, j, 0, False) - row @ inverse) / row[j]
        inverse = lax.dynamic_update_index_in_dim(inverse, inverse_row, j, 0)
        return m - column[:, None] * jnp.conj(column)[None, :], factor, inverse

    zeros = jnp.zeros_like(d)
    _, factor, inverse = lax.fori_loop(jnp.int32(0), jnp.int32(n), body, (jnp.tril(d), zeros, zeros))
    return factor, inverse


def diagonal_factor(d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(L, L^{-1})`` of the Hermitian ``d: (n, n)`` (lower triangle read), by recursive halving: matrix products
    only, no LAPACK call (a multithreaded BLAS call inside the loop competes with XLA's threads for the cores). NaN
    where ``d`` is not positive definite."""
    n = d.shape[0]
    if n <= LEAF:
        return _leaf_factor(d)
    h = n // 2
    l11, w11 = diagonal_factor(d[:h, :h])
    l21 = d[h:, :h] @ jnp.conj(w11).T
    l22, w22 = diagonal_factor(d[h:, h:] - l21 @ jnp.conj(l21).T)
    w21 = -(w22 @ (l21 @ w11))
    zeros = jnp.zeros((h, n - h), d.dtype)
    return jnp.block([[l11, zeros], [l21, l22]]), jnp.block([[w11, zeros], [w21, w22]])


def _times_inverse_h(b: jax.Array, w: jax.Array) -> jax.Array:
    """``b W^H`` for the lower triangular ``w: (t, t)``, skipping the zero quarter of ``W^H`` (3/4 of the dense
    product's flops)."""
    h = w.shape[0] // 2
    if h == 0:
        return b @ jnp.conj(w).T
    left = b[:, :h] @ jnp.conj(w[:h, :h]).T
    right = b[:, :h] @ jnp.conj(w[h:, :h]).T + b[:, h:] @ jnp.conj(w[h:, h:]).T
    return jnp.concatenate([left, right], axis=1)


def solver_library() -> bool:
    """Whether diagonal blocks go to the backend's solver library. On GPUs (and TPUs) it is the fast path (cuSOLVER's
    potrf and a triangular solve: 2.3x / 1.6x faster than ``diagonal_factor`` for f32 / f64 ``potrs`` at N=8192 on
    one H100); on XLA:CPU a LAPACK/BLAS call inside the loop spins threads that fight XLA's own for the cores, so the
    blocks are factored with matrix products only."""
    return jax.default_backend() != "cpu"


def first_failure(diag: jax.Array) -> jax.Array:
    """1-based index of the first non-positive pivot of the Hermitian ``diag: (t, t)`` (its lower triangle), by an
    unblocked Cholesky; 0 if there is none. Only run on a block whose factor came out non-finite."""
    t = diag.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)

    def body(j, carry):
        m, fail = carry
        pivot = jnp.real(m[j, j])
        bad = jnp.logical_not(pivot > 0)
        fail = jnp.where((fail == 0) & bad, j + 1, fail)
        column = m[:, j] / jnp.sqrt(jnp.where(bad, jnp.ones_like(pivot), pivot)).astype(m.dtype)
        column = jnp.where(rows > j, column, jnp.zeros_like(column))
        return m - column[:, None] * jnp.conj(column)[None, :], fail

    return lax.fori_loop(jnp.int32(0), jnp.int32(t), body, (jnp.tril(diag), vary_like(jnp.int32(0), diag)))[1]


def potrf_local(a: jax.Array, layout: BlockCyclic) -> tuple[jax.Array, jax.Array]:
    """Cholesky factor of the distributed Hermitian matrix whose local columns are ``a``.

    Args:
        a: `(padded, width)` this device's block-cyclic columns (only the lower triangle is read).
        layout: the block-cyclic layout.

    Returns:
        ``(l, info)``: `l: (padded, width)` the local columns of the lower factor (upper triangle zero), all NaN if
        the matrix is not positive definite; ``info`` the LAPACK status (0, or the 1-based order of the first
        leading minor that is not positive definite), identical on every device.
    """
    rank, size, _ = rank_info()
    t, nbl, npad = layout.tile, layout.local_blocks, layout.padded
    library = solver_library()
    bounds = phase_bounds(nbl)
    ngroups = len(bounds) - 1
    # Column group g (local blocks bounds[g]..bounds[g + 1]) is kept as its own array of the rows it can hold
    # nonzeros in (>= its first global column): the loop carries the live groups, and each update is one product
    # subtracted in place from a whole carry buffer, with no slicing of (and copying into) one big matrix.
    groups = [a[bounds[g] * size * t:, bounds[g] * t:bounds[g + 1] * t] for g in range(ngroups)]
    info = vary_like(jnp.int32(0), a)
    for q in range(ngroups):
        start = bounds[q]
        row0 = start * size * t

        def step(k, carry, start=start, row0=row0, q=q):
            live_groups, info = carry
            own = live_groups[0]
            kl, owner = k // size, k % size
            is_owner = rank == owner
            col = lax.dynamic_slice(own, index(0, (kl - start) * t), (npad - row0, t))
            offset = k * t - row0
            rows = jnp.arange(npad - row0, dtype=jnp.int32)[:, None]

            def factor(col):
                diag = lax.dynamic_slice(col, index(offset, 0), (t, t))
                if library:
                    lkk = jnp.tril(lax.linalg.cholesky(diag, symmetrize_input=False))
                    panel = lax.linalg.triangular_solve(lkk, col, left_side=False, lower=True, transpose_a=True,
                                                        conjugate_a=True)
                else:
                    lkk, wkk = diagonal_factor(diag)
                    panel = _times_inverse_h(col, wkk)
                ok = jnp.all(jnp.isfinite(lkk))
                panel = jnp.where(rows >= offset + t, panel, jnp.zeros_like(panel))
                panel = lax.dynamic_update_slice(panel, lkk, index(offset, 0))
                fail = lax.cond(ok, lambda d: vary_like(jnp.int32(0), d), first_failure, diag)
                return panel, jnp.where(fail > 0, fail + k * t, 0).astype(jnp.int32)

            def idle(col):
                return jnp.zeros_like(col), vary_like(jnp.int32(0), col)

            panel, fail = lax.cond(is_owner, factor, idle, col)
            info = jnp.where((info == 0) & (fail > 0), fail, info)
            own = lax.dynamic_update_slice(own, jnp.where(is_owner, panel, col), index(0, (kl - start) * t))
            panel = allreduce(panel)
            # Rows of the panel that multiply this device's columns; blocks <= k are zeroed, so factored columns
            # (and column k itself) receive no update.
            right = jnp.where(rows >= offset + t, panel, jnp.zeros_like(panel))
            right = right.reshape(nbl - start, size, t, t)
            right = lax.dynamic_index_in_dim(right, rank, axis=1, keepdims=False).reshape((nbl - start) * t, t)
            right = jnp.conj(right)
            updated = []
            for g in range(q, ngroups):
                c0, c1 = (bounds[g] - start) * t, (bounds[g + 1] - start) * t
                rg = bounds[g] * size * t

                def apply(block, rg=rg, c0=c0, c1=c1):
                    return block - panel[rg - row0:] @ right[c0:c1].T

                if g == q:
                    # This phase's own column group is factored during the phase: once its last block (global
                    # index (bounds[q + 1] - 1) * size + rank) is done the whole product would be masked, so skip it.
                    live = (bounds[q + 1] - 1) * size + rank > k
                    updated.append(lax.cond(live, apply, lambda block: block, own))
                else:
                    updated.append(apply(live_groups[g - q]))
            return tuple(updated), info

        done, info = lax.fori_loop(jnp.int32(bounds[q] * size), jnp.int32(bounds[q + 1] * size), step,
                                   (tuple(groups[q:]), info))
        groups[q:] = list(done)
    a = jnp.concatenate([jnp.pad(g, ((bounds[i] * size * t, 0), (0, 0))) for i, g in enumerate(groups)], axis=1)
    info = allreduce(jnp.where(info > 0, info, jnp.iinfo(jnp.int32).max), "min")
    info = jnp.where(info == jnp.iinfo(jnp.int32).max, 0, info)
    cols = global_columns(rank, layout)
    lower = jnp.arange(npad, dtype=jnp.int32)[:, None] >= cols[None, :]
    a = jnp.where(lower, a, jnp.zeros_like(a))
    return jnp.where(info > 0, jnp.full_like(a, jnp.nan), a), info

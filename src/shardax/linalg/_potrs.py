"""``potrs`` in the local view: factor, solve and log-determinant as one differentiable step, with a custom VJP.

Only the lower triangle of ``a`` is read (LAPACK's convention), so the VJP is the transpose of the map from that
triangle to the Hermitian matrix it stands for: ``a_bar = tril(G, -1) + tril(G^H, -1) + diag(Re diag G)`` where
``G`` is the cotangent for the full matrix (``-b_bar x^T`` from the solve, ``logdet_bar A^{-T}`` from the
log-determinant).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..core import rank_info, vary_like
from ._layout import BlockCyclic, global_columns
from ._potrf import potrf_local
from ._solve import cho_solve_local, inverse_local, logdet_local


def _real_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.finfo(dtype).dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def solve_local(a: jax.Array, b: jax.Array, layout: BlockCyclic, with_logdet: bool
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(x, logdet, info)`` for the distributed Hermitian positive definite ``a``.

    Args:
        a: `(padded, width)` local block-cyclic columns (lower triangle read); with a 2D ``layout`` only the
            factorisation runs on the process grid (``potrf_local`` moves the matrix there and back).
        b: `(padded, nrhs)` right-hand sides, replicated.
        layout: the block-cyclic layout.
        with_logdet: also compute ``log det a`` (else ``logdet`` is 0); its gradient needs ``a^{-1}``.

    Returns:
        `x: (padded, nrhs)` replicated, the real scalar ``logdet`` and the int32 LAPACK ``info``.
    """
    return _solve_fwd(a, b, layout, with_logdet)[0]


def _solve_fwd(a, b, layout, with_logdet):
    factor, info = potrf_local(a, layout)
    # The triangular solves (O(N^2) per right-hand side, one small all-reduce per block) run on the 1D columns.
    layout = layout.columns()
    x = cho_solve_local(factor, b, layout)
    logdet = logdet_local(factor, layout) if with_logdet else jnp.zeros((), _real_dtype(a.dtype))
    return (x, logdet, info), (factor, x)


def _solve_bwd(layout, with_logdet, residuals, cotangents):
    layout = layout.columns()
    factor, x = residuals
    x_bar, logdet_bar, _ = cotangents
    b_bar = jnp.conj(cho_solve_local(factor, jnp.conj(x_bar), layout))
    rank = rank_info().rank
    cols = global_columns(rank, layout)
    # G[:, cols] and conj(G^T)[:, cols] for G = -b_bar x^T (both are rank-nrhs products of replicated factors).
    g = -(b_bar @ x[cols].T)
    g_h = -(jnp.conj(x) @ jnp.conj(b_bar[cols]).T)
    if with_logdet:
        inverse = inverse_local(factor, layout)
        g = g + logdet_bar.astype(inverse.dtype) * jnp.conj(inverse)
        g_h = g_h + logdet_bar.astype(inverse.dtype) * jnp.conj(inverse)
    rows = jnp.arange(layout.padded, dtype=jnp.int32)[:, None]
    a_bar = jnp.where(rows > cols[None, :], g + g_h, jnp.zeros_like(g))
    a_bar = jnp.where(rows == cols[None, :], jnp.real(g).astype(g.dtype), a_bar)
    return vary_like(a_bar, factor), b_bar


solve_local.defvjp(_solve_fwd, _solve_bwd)

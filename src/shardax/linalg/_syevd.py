"""Hermitian eigensolver in the local view: two-sided block Jacobi with a round-robin tournament over devices.

Why Jacobi: every step is dense local work (one ``2b x 2b`` ``eigh`` per device, then matrix products with its own
columns) and the communication is a fixed pattern (an all-gather of the small rotations and neighbour exchanges of
column blocks), so it maps directly onto collectives on any backend; it is accurate (each subproblem is an
``eigh`` of a block of ``A`` itself, not of a Gram matrix); and on one device it reduces to a single LAPACK ``eigh``.
QDWH spectral divide and conquer needs data-dependent subproblem sizes, which fixed-shape SPMD code cannot follow
without padding every level.

Device ``d`` holds column blocks ``2d`` and ``2d + 1`` (of width ``b``) of the current iterate ``M = Q^H A Q`` and
of ``Q``. Rows of ``M`` are kept in the same block order as the columns, so after every device has diagonalised its
``2x2`` block pair (``J_d``) the row update ``J^H M`` is one batched product, and the round-robin move of column
blocks is a fixed permutation of row blocks plus three neighbour exchanges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..comm import allgather, allreduce
from ..core import rank_info
from ._vary import vary_like


def _tournament_source(size: int) -> np.ndarray:
    """Round-robin move as a block permutation: new position ``p`` takes the block from ``source[p]``.

    Block 0 stays; the others rotate through the positions, so ``2 size - 1`` steps pair every two blocks once.
    """
    source = np.empty(2 * size, dtype=np.int32)
    for d in range(size):
        source[2 * d] = 0 if d == 0 else 1 if d == 1 else 2 * (d - 1)
        source[2 * d + 1] = 2 * (d + 1) + 1 if d < size - 1 else 2 * (size - 1)
    return source


def _ppermute(x: jax.Array, pairs: list[tuple[int, int]], axes: tuple[str, ...]) -> jax.Array:
    if not pairs:
        return jnp.zeros_like(x)
    return lax.ppermute(x, axes, pairs)


def _rotate_blocks(blocks: jax.Array, rank: jax.Array | int, size: int, axes: tuple[str, ...]) -> jax.Array:
    """Move ``blocks: (2, ..., rows, 2b)`` (top = first ``b`` columns, bottom = last) one round-robin step."""
    b = blocks.shape[-1] // 2
    top, bottom = blocks[..., :b], blocks[..., b:]
    from_left = _ppermute(top, [(d - 1, d) for d in range(2, size)], axes)
    first_bottom = _ppermute(bottom, [(0, 1)], axes)
    new_top = jnp.where(rank == 0, top, jnp.where(rank == 1, first_bottom, from_left))
    from_right = _ppermute(bottom, [(d + 1, d) for d in range(size - 1)], axes)
    new_bottom = jnp.where(rank == size - 1, top, from_right)
    return jnp.concatenate([new_top, new_bottom], axis=-1)


def _near_identity_eigenvectors(block: jax.Array) -> jax.Array:
    """Eigenvectors of the Hermitian ``block``, ordered like its diagonal (not by eigenvalue).

    A nearly diagonal block then gets a nearly identity rotation: sorting by eigenvalue would permute columns
    between the two blocks of the pair, and Jacobi can then cycle entries through pairs that are never visited.
    """
    _, vectors = jnp.linalg.eigh(block, symmetrize_input=True)
    ranks = jnp.argsort(jnp.argsort(jnp.real(jnp.diagonal(block))))
    return vectors[:, ranks]


def jacobi_eigh_local(m: jax.Array, max_sweeps: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Eigen-decomposition of the distributed Hermitian matrix whose local columns are ``m``.

    Args:
        m: `(npad, 2b)` this device's columns ``[2 b d, 2 b (d + 1))`` of the full Hermitian matrix
            (``npad = 2 b size``).
        max_sweeps: the most sweeps (of ``2 size - 1`` steps) before giving up.

    Returns:
        ``(w, v, sweeps, converged)``: `w: (2b,)` eigenvalues (unsorted) of this device's final columns,
        `v: (npad, 2b)` the matching eigenvectors, the number of sweeps done and whether the off-diagonal norm fell
        below ``eps * sqrt(npad) * ||A||_F``.
    """
    rank, size, axes = rank_info()
    npad, width = m.shape
    real = jnp.finfo(m.dtype).dtype
    source = _tournament_source(size)
    identity = jnp.arange(npad, dtype=jnp.int32)[:, None] == rank * width + jnp.arange(width, dtype=jnp.int32)[None, :]
    v = vary_like(identity.astype(m.dtype), m)

    def pair_block(m):
        start = jnp.asarray(rank * width, jnp.int32)
        return lax.dynamic_slice(m, (start, jnp.zeros_like(start)), (width, width))

    def off_norm(m):
        # Summed apart, not as total minus diagonal: that difference carries the rounding error of the total,
        # far above the threshold, and a converged matrix could then never pass the test.
        squares = jnp.abs(m) ** 2
        return allreduce(jnp.sum(jnp.where(identity, 0, squares))), allreduce(jnp.sum(squares))

    def step(_, carry):
        m, v = carry
        rotation = _near_identity_eigenvectors(pair_block(m))
        m = m @ rotation
        v = v @ rotation
        rotations = allgather(rotation)  # (size, 2b, 2b)
        rows = m.reshape(size, width, width)
        m = jnp.einsum("pji,pjk->pik", jnp.conj(rotations), rows).reshape(npad, width)
        if size == 1:
            return m, v
        m = m.reshape(2 * size, width // 2, width)[source].reshape(npad, width)
        moved = _rotate_blocks(jnp.stack([m, v]), rank, size, axes)
        return moved[0], moved[1]

    def sweep(carry):
        m, v, count, _ = carry
        m, v = lax.fori_loop(jnp.int32(0), jnp.int32(2 * size - 1), step, (m, v))
        return m, v, count + 1, off_norm(m)[0]

    off, total = off_norm(m)
    threshold = (jnp.finfo(real).eps ** 2) * npad * total

    def go_on(carry):
        return (carry[2] < max_sweeps) & (carry[3] > threshold)

    m, v, count, off = lax.while_loop(go_on, sweep, (m, v, jnp.int32(0), off))
    w = jnp.real(jnp.diagonal(pair_block(m)))
    # An infinite entry makes the threshold infinite: nothing was diagonalised, whatever off is.
    return w, v, count, (off <= threshold) & jnp.isfinite(threshold)

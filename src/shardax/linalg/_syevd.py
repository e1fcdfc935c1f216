"""Hermitian eigensolvers in the local view: tridiagonal reduction + bisection + inverse iteration (the default),
and two-sided block Jacobi (``method="jacobi"``).

Why the tridiagonal route: it does LAPACK's flops (``4/3 N^3`` for the reduction, ``2 N^3`` for the
back-transformation, ``O(N^2)`` in between), where Jacobi needs about 10-20x that in sweeps and QDWH spectral divide
and conquer about 10-30x (and data-dependent subproblem sizes that fixed-shape SPMD code must pad at every level).
Every stage maps onto collectives with fixed shapes:

1. Reduction ``Q^H A Q = T`` (``_tridiag.tridiagonalize_local``) on the block-cyclic column layout of ``potrf``: per
   panel of ``t`` columns (the layout's tile, 32 by default) one all-reduce broadcasts the panel, per column one
   all-reduce completes ``y = A v`` from each device's columns (LAPACK ``latrd``), and the trailing rank-``2t``
   update is local BLAS3. Complex Householder reflectors are chosen (``larfg``) so that ``T`` is real.
2. Eigenvalues of ``T``: Sturm-count multisection, distributed by eigenvalue slot (``O(N^2 / P)`` per device), after
   splitting ``T`` where ``|e_k| <= eps ||T||``; slot ``j`` is an eigenvalue of the unreduced block holding row
   ``j``, so exact multiplicities (the identity) become ``1 x 1`` blocks. One all-gather of the ``N`` eigenvalues.
3. Eigenvectors of ``T`` for this device's slots by inverse iteration (LAPACK ``stein``), reorthogonalised inside
   clusters (eigenvalues closer than ``CLUSTER_GAP ||T||``) over a window of ``CLUSTER_WINDOW`` earlier slots; each
   device also computes the window's slots of the previous device, from slot-seeded starts, so clusters that cross
   devices come out the same on both. A cluster longer than the window (every device sees it from the gathered
   eigenvalues) sends the eigenvectors of ``T`` to a local dense ``eigh`` of ``T`` instead: correct, ``O(N^3)``
   per device, taken by near-multiple-of-identity blocks. Stages 2 and 3 run in float64 for float32 and complex64
   input (mixed precision, on ``T``'s ``2 N`` numbers only), so single precision takes the fast path as often as
   double.
4. Back-transformation ``Q Z`` by the compact-WY panels, distributed by eigenvector columns (local BLAS3).

Eigenvalues come back per slot (ascending within each block); the caller sorts them. On one device ``syevd`` is a
single LAPACK ``eigh`` instead.

Jacobi: device ``d`` holds column blocks ``2d`` and ``2d + 1`` (of width ``b``) of the current iterate
``M = Q^H A Q`` and of ``Q``. Rows of ``M`` are kept in the same block order as the columns, so after every device has
diagonalised its ``2x2`` block pair (``J_d``) the row update ``J^H M`` is one batched product, and the round-robin
move of column blocks is a fixed permutation of row blocks plus three neighbour exchanges.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..comm import allgather, allreduce
from ..core import rank_info, vary_like
from ._layout import BlockCyclic, LinalgTuning
from ._slice_index import index
from ._tridiag import (
    back_transform_local,
    bisect_eigenvalues,
    inverse_iteration,
    split_blocks,
    tridiagonalize_local,
)

# Reorthogonalisation window: a cluster of close eigenvalues longer than this takes the fallback path.
CLUSTER_WINDOW = 32
# Eigenvalues closer than this times ||T|| form a cluster, whose inverse-iteration vectors are reorthogonalised.
# Outside clusters, inverse iteration leaves vectors orthogonal to about eps ||T|| / gap: 1e-11 (float64) and 1e-6
# (float32) at these gaps.
CLUSTER_GAP = {"float32": 5e-2, "float64": 1e-5}


def tridiagonal_layout(n: int, size: int, tile: int | None = None) -> BlockCyclic:
    """The block-cyclic layout of the reduction for an ``(n, n)`` matrix over ``size`` devices, with ``tile``
    columns per block and reflector panel (default ``LinalgTuning``'s ``reduction_tile``; reduced for small
    ``n`` as the factorisations' tile is)."""
    return BlockCyclic.create(n, LinalgTuning().reduction_tile if tile is None else tile, size)


def tridiagonal_eigh_local(a: jax.Array, layout: BlockCyclic, vectors: bool
                           ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Eigen-decomposition of the distributed Hermitian matrix whose block-cyclic local columns are ``a``.

    Args:
        a: `(npad, width)` this device's columns (full Hermitian columns, both triangles; ``npad = layout.padded``).
        layout: the block-cyclic layout (``tridiagonal_layout``).
        vectors: also compute the eigenvectors.

    Returns:
        ``(w, v, fallback)``: `w: (width,)` the eigenvalues of this device's slots ``[rank width, (rank + 1) width)``
        (ascending within each unreduced block of ``T``, not globally); `v: (npad, width)` their eigenvectors (or
        ``None``); ``fallback`` whether a cluster longer than ``CLUSTER_WINDOW`` sent the eigenvectors of ``T`` to
        the local dense ``eigh`` of ``T``.
    """
    npad, m = layout.padded, layout.width
    real = jnp.finfo(a.dtype).dtype
    d, e, v_all, wy = tridiagonalize_local(a, layout)
    # Single precision: the O(N^2) middle stages run in float64 (under a scoped x64, for T's 2N numbers only). Their
    # eigenvectors of T are then orthogonal to ~1e-11 except inside float64-sized clusters, so float32 inputs keep
    # the fast path instead of treating every eigenvalue gap below 5e-2 ||T|| as a cluster.
    promote = real == jnp.float32
    with jax.enable_x64(True) if promote else contextlib.nullcontext():
        work = jnp.float64 if promote else real
        w, z, fallback = _tridiagonal_stages(d.astype(work), e.astype(work), npad, m, vectors)
        w = w.astype(real)
        z = None if z is None else z.astype(a.dtype)
    if z is None:
        return w, None, fallback
    v = back_transform_local(z, v_all, wy, layout)
    return w, v, fallback


def _tridiagonal_stages(d: jax.Array, e: jax.Array, npad: int, m: int, vectors: bool
                        ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Stages 2 and 3: this device's eigenvalue slots of ``T`` and, with ``vectors``, their eigenvectors of ``T``."""
    rank, _, _ = rank_info()
    real = d.dtype
    e, start, stop, norm = split_blocks(d, e)
    first = rank * m
    own = first + jnp.arange(m, dtype=jnp.int32)
    w_own = bisect_eigenvalues(d, e, start, stop, norm, own)
    if not vectors:
        return w_own, None, jnp.zeros((), bool)
    w_all = allgather(w_own, tiled=True)
    slots = jnp.arange(npad, dtype=jnp.int32)
    gap = CLUSTER_GAP[jnp.dtype(real).name] * norm
    boundary = slots == 0
    boundary = boundary | (start != jnp.roll(start, 1)) | (w_all - jnp.roll(w_all, 1) >= gap)
    label = jnp.cumsum(boundary.astype(jnp.int32))
    position = slots - lax.cummax(jnp.where(boundary, slots, 0), axis=0)
    fallback = jnp.any(position >= CLUSTER_WINDOW)
    window = CLUSTER_WINDOW

    def fast(_):
        ext = first - window + jnp.arange(m + window, dtype=jnp.int32)
        valid = ext >= 0
        ext_c = jnp.maximum(ext, 0)
        labels = jnp.where(valid, label[ext_c], -1 - jnp.arange(m + window, dtype=jnp.int32))
        z = inverse_iteration(d, e, start, stop, norm, w_all[ext_c], ext_c, labels, window)
        return w_own, z[:, window:]

    def dense(_):
        t = jnp.diag(d) + jnp.diag(e[:-1], -1) + jnp.diag(e[:-1], 1)
        wt, zt = jnp.linalg.eigh(t, symmetrize_input=False)
        return (lax.dynamic_slice(wt, index(first), (m,)), lax.dynamic_slice(zt, index(0, first), (npad, m)))

    w, z = lax.cond(fallback, dense, fast, None)
    return w, z, fallback


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

"""Building blocks of the tridiagonal Hermitian eigensolver, in the local view (see ``_syevd`` for the algorithm).

* ``tridiagonalize_local``: blocked Householder reduction ``Q^H A Q = T`` on the block-cyclic column layout
  (LAPACK ``sytrd``/``latrd`` with one all-reduce per column and one per panel).
* ``bisect_eigenvalues``: eigenvalues of the unreduced blocks of ``T`` by Sturm-count multisection.
* ``inverse_iteration``: eigenvectors of ``T`` for a range of eigenvalue slots (LAPACK ``stein``: partial-pivoting
  tridiagonal LU, pivot perturbation, reorthogonalisation inside clusters of close eigenvalues).
* ``back_transform_local``: ``Q Z`` by the compact-WY panels of the reduction.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..comm import allreduce
from ..core import rank_info, vary_like
from ._layout import BlockCyclic, global_columns
from ._potrf import phase_bounds
from ._slice_index import index

# Static row/column windows of the reduction and back-transformation loops (as in ``_potrf``): phase q only touches
# rows and local columns past its start. More phases cut the flops and memory traffic; fewer cut compile time.
MAX_PHASES = 8
# Shifts per eigenvalue and multisection step (``log2(K + 1)`` bits each).
MULTISECTION = 3
# Inverse-iteration steps (each a factored solve, normalisation and, where there are clusters, reorthogonalisation).
INVERSE_STEPS = 4


def _householder(col: jax.Array, jr: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """LAPACK ``larfg`` on ``col[jr + 1:]``: ``(v, tau, beta)`` with ``H^H col[jr+1:] = beta e_1``, ``H = I - tau v v^H``.

    ``v: (rows,)`` is zero up to row ``jr``, 1 at ``jr + 1``; ``beta`` is real. ``tau = 0`` (and ``v = 0``) when the
    column is already reduced.
    """
    rows = jnp.arange(col.shape[0], dtype=jnp.int32)
    real = jnp.finfo(col.dtype).dtype
    head = rows == jr + 1
    alpha = jnp.sum(jnp.where(head, col, jnp.zeros_like(col)))
    below = jnp.where(rows > jr + 1, col, jnp.zeros_like(col))
    xnorm2 = jnp.sum(jnp.abs(below) ** 2)
    ar, ai = jnp.real(alpha), jnp.imag(alpha)
    trivial = (xnorm2 == 0) & (ai == 0)
    beta = -jnp.where(ar >= 0, 1, -1).astype(real) * jnp.sqrt(ar * ar + ai * ai + xnorm2)
    safe_beta = jnp.where(trivial, jnp.ones_like(beta), beta)
    tau = jnp.where(trivial, jnp.zeros_like(alpha), (safe_beta.astype(col.dtype) - alpha) / safe_beta.astype(col.dtype))
    denom = jnp.where(trivial, jnp.ones_like(alpha), alpha - safe_beta.astype(col.dtype))
    v = below / denom + head.astype(col.dtype)
    v = jnp.where(trivial, jnp.zeros_like(v), v)
    return v, tau, jnp.where(trivial, ar, beta)


def _wy_factor(v: jax.Array, tau: jax.Array) -> jax.Array:
    """Upper triangular ``T: (t, t)`` with ``H_1 ... H_t = I - V T V^H`` (LAPACK ``larft``, forward, columnwise)."""
    t = v.shape[1]
    gram = jnp.conj(v).T @ v
    cols = jnp.arange(t, dtype=jnp.int32)

    def body(i, tm):
        z = jnp.where(cols < i, gram[:, i], jnp.zeros_like(gram[:, i]))
        column = -tau[i] * (tm @ z)
        column = jnp.where(cols == i, tau[i], column)
        return lax.dynamic_update_slice(tm, column[:, None], index(0, i))

    return lax.fori_loop(jnp.int32(0), jnp.int32(t), body, vary_like(jnp.zeros((t, t), v.dtype), v))


def tridiagonalize_local(a: jax.Array, layout: BlockCyclic
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Householder reduction of the distributed Hermitian matrix whose block-cyclic local columns are ``a``.

    Panel ``K`` (global columns ``[K t, (K + 1) t)``) is reduced LAPACK ``latrd``-style: its original columns are
    broadcast by one all-reduce; for each column the reflector comes from the column updated by the panel's earlier
    reflectors, and ``y = A v`` is this device's columns times ``v`` plus one all-reduce; the trailing matrix then
    takes the rank-``2t`` update ``A -= V W^H + W V^H`` (local BLAS3 on full columns, both triangles).

    Args:
        a: `(npad, width)` this device's columns (full Hermitian columns, both triangles).
        layout: the block-cyclic layout (``npad = layout.padded``).

    Returns:
        ``(d, e, v, wy)``, replicated: `d: (npad,)` real diagonal of ``T``; `e: (npad,)` real off-diagonal
        (``e[k] = T[k + 1, k]``, ``e[-1] = 0``); `v: (npad, npad)` the reflectors (column ``k`` reduces column
        ``k``, zero up to row ``k``); `wy: (blocks, t, t)` the compact-WY factors of the panels.
    """
    rank, size, _ = rank_info()
    t, nbl, npad = layout.tile, layout.local_blocks, layout.padded
    real = jnp.finfo(a.dtype).dtype
    cols = global_columns(rank, layout)
    bounds = phase_bounds(nbl, MAX_PHASES)
    d = vary_like(jnp.zeros(npad, real), a)
    e = vary_like(jnp.zeros(npad, real), a)
    v_all = vary_like(jnp.zeros((npad, npad), a.dtype), a)
    wy = vary_like(jnp.zeros((layout.blocks, t, t), a.dtype), a)
    s = a
    prev_row0, prev_c0 = 0, 0
    for q in range(len(bounds) - 1):
        row0, c0 = bounds[q] * size * t, bounds[q] * t
        s = s[row0 - prev_row0:, c0 - prev_c0:]
        prev_row0, prev_c0 = row0, c0
        hq = npad - row0
        cols_rel = cols[c0:] - row0
        rows = jnp.arange(hq, dtype=jnp.int32)

        def panel(k, carry, row0=row0, c0=c0, hq=hq, cols_rel=cols_rel, rows=rows):
            s, d, e, v_all, wy = carry
            owner, kl = k % size, k // size
            pr = k * t - row0
            orig = lax.dynamic_slice(s, index(0, kl * t - c0), (hq, t))
            orig = allreduce(jnp.where(rank == owner, orig, jnp.zeros_like(orig)))

            def column(i, carry):
                vp, wp, taus, d, e = carry
                jr = pr + i
                vrow = jnp.conj(lax.dynamic_index_in_dim(vp, jr, 0, keepdims=False))
                wrow = jnp.conj(lax.dynamic_index_in_dim(wp, jr, 0, keepdims=False))
                col = lax.dynamic_index_in_dim(orig, i, 1, keepdims=False) - vp @ wrow - wp @ vrow
                dj = jnp.real(jnp.sum(jnp.where(rows == jr, col, jnp.zeros_like(col))))
                v, tau, beta = _householder(col, jr)
                y = allreduce(s @ v[cols_rel])
                y = y - vp @ (jnp.conj(wp).T @ v) - wp @ (jnp.conj(vp).T @ v)
                y = jnp.where(rows > jr, y, jnp.zeros_like(y))
                w = tau * y - (0.5 * jnp.abs(tau) ** 2 * jnp.real(jnp.vdot(v, y))).astype(y.dtype) * v
                vp = lax.dynamic_update_slice(vp, v[:, None], index(0, i))
                wp = lax.dynamic_update_slice(wp, w[:, None], index(0, i))
                taus = lax.dynamic_update_slice(taus, tau[None], index(i))
                d = lax.dynamic_update_slice(d, dj[None], index(row0 + jr))
                e = lax.dynamic_update_slice(e, beta[None], index(row0 + jr))
                return vp, wp, taus, d, e

            zeros = jnp.zeros((hq, t), s.dtype)
            vp, wp, taus, d, e = lax.fori_loop(jnp.int32(0), jnp.int32(t), column,
                                               (vary_like(zeros, s), vary_like(zeros, s),
                                                vary_like(jnp.zeros(t, s.dtype), s), d, e))
            s = s - vp @ jnp.conj(wp[cols_rel]).T - wp @ jnp.conj(vp[cols_rel]).T
            v_all = lax.dynamic_update_slice(v_all, vp, index(row0, k * t))
            wy = lax.dynamic_update_slice(wy, _wy_factor(vp, taus)[None], index(k, 0, 0))
            return s, d, e, v_all, wy

        s, d, e, v_all, wy = lax.fori_loop(jnp.int32(bounds[q] * size), jnp.int32(bounds[q + 1] * size), panel,
                                           (s, d, e, v_all, wy))
    e = e.at[npad - 1].set(0)
    return d, e, v_all, wy


def back_transform_local(z: jax.Array, v_all: jax.Array, wy: jax.Array, layout: BlockCyclic) -> jax.Array:
    """``Q z`` for ``Q = H_0 H_1 ... = prod_K (I - V_K T_K V_K^H)``, applied panel by panel from the last.

    Args:
        z: `(npad, m)` this device's eigenvectors of ``T``.
        v_all: `(npad, npad)` the reflectors from ``tridiagonalize_local``.
        wy: `(blocks, t, t)` the panels' compact-WY factors.
        layout: the block-cyclic layout of the reduction.

    Returns:
        `(npad, m)` the eigenvectors of ``A``.
    """
    _, size, _ = rank_info()
    t = layout.tile
    bounds = phase_bounds(layout.local_blocks, MAX_PHASES)
    for q in reversed(range(len(bounds) - 1)):
        row0 = bounds[q] * size * t
        k0, k1 = bounds[q] * size, bounds[q + 1] * size

        def panel(j, zt, row0=row0, k1=k1):
            k = k1 - 1 - j
            vp = lax.dynamic_slice(v_all, index(row0, k * t), (v_all.shape[0] - row0, t))
            tm = lax.dynamic_index_in_dim(wy, k, 0, keepdims=False)
            return zt - vp @ (tm @ (jnp.conj(vp).T @ zt))

        zt = lax.fori_loop(jnp.int32(0), jnp.int32(k1 - k0), panel, z[row0:])
        z = z.at[row0:].set(zt)
    return z


def split_blocks(d: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Split ``T`` where ``|e_k| <= eps ||T||`` (a backward-stable perturbation) into unreduced blocks.

    Returns:
        ``(e, start, stop, norm)``: `e: (n,)` with the negligible entries zeroed; `start, stop: (n,)` int32 the
        rows ``[start, stop)`` of the block that holds each row; ``norm`` the Gershgorin bound of ``||T||``.
    """
    n = d.shape[0]
    real = d.dtype
    eps = jnp.finfo(real).eps
    ae = jnp.abs(e)
    ae_prev = jnp.concatenate([jnp.zeros(1, real), ae[:-1]])
    norm = jnp.max(jnp.abs(d) + ae + ae_prev)
    norm = jnp.where(norm > 0, norm, jnp.ones_like(norm))
    e = jnp.where(ae <= eps * norm, jnp.zeros_like(e), e)
    rows = jnp.arange(n, dtype=jnp.int32)
    is_start = jnp.concatenate([jnp.ones(1, bool), e[:-1] == 0])
    start = lax.cummax(jnp.where(is_start, rows, 0), axis=0)
    is_stop = e == 0  # row k ends its block when e[k] = 0 (e[-1] = 0 always)
    stop = lax.cummin(jnp.where(is_stop, rows + 1, n), axis=0, reverse=True)
    return e, start, stop, norm


def bisect_eigenvalues(d: jax.Array, e: jax.Array, start: jax.Array, stop: jax.Array, norm: jax.Array,
                       slots: jax.Array) -> jax.Array:
    """Eigenvalue of each slot: slot ``j`` is the ``(j - start[j])``-th smallest eigenvalue of its block.

    Sturm counts restricted to the block's rows (the ``LDL^T`` pivots restart where ``e = 0``), ``MULTISECTION``
    shifts per step, down to ``eps ||T||``.

    Args:
        d, e: `(n,)` the split tridiagonal matrix; start, stop: `(n,)` its blocks (``split_blocks``).
        norm: Gershgorin bound of ``||T||``.
        slots: `(s,)` int32 slot indices.

    Returns:
        `(s,)` the eigenvalues.
    """
    n = d.shape[0]
    real = d.dtype
    info = jnp.finfo(real)
    k = MULTISECTION
    e2 = jnp.concatenate([jnp.zeros(1, real), e[:-1] ** 2])
    pivmin = info.tiny * jnp.maximum(1, jnp.max(e2))
    lo_row, hi_row = start[slots], stop[slots]
    target = slots - lo_row
    ae = jnp.abs(e)
    ae_prev = jnp.concatenate([jnp.zeros(1, real), ae[:-1]])
    margin = 2 * info.eps * norm * n + 2 * pivmin
    lo = jnp.full(slots.shape, jnp.min(d - ae - ae_prev) - margin, real)
    hi = jnp.full(slots.shape, jnp.max(d + ae + ae_prev) + margin, real)
    frac = jnp.arange(1, k + 1, dtype=real) / (k + 1)
    bits = math.ceil(math.log2(4.0 / float(info.eps))) + 1
    steps = -(-bits // int(math.log2(k + 1)))
    rows = jnp.arange(n, dtype=jnp.int32)

    def counts(x):  # x: (s, k) -> eigenvalues of each slot's block below x
        def row(carry, xs):
            q, c = carry
            di, e2i, i = xs
            term = jnp.where(e2i == 0, jnp.zeros_like(q), e2i / q)
            q = (di - x) - term
            q = jnp.where(jnp.abs(q) < pivmin, -pivmin, q)
            inside = ((i >= lo_row) & (i < hi_row))[:, None]
            return (q, c + (inside & (q < 0)).astype(jnp.int32)), None

        init = (vary_like(jnp.ones_like(x), x), vary_like(jnp.zeros(x.shape, jnp.int32), x))
        (_, c), _ = lax.scan(row, init, (d, e2, rows), unroll=4)
        return c

    def step(_, bounds):
        lo, hi = bounds
        x = lo[:, None] + (hi - lo)[:, None] * frac[None, :]
        c = counts(x)
        below = c <= target[:, None]
        lo = jnp.maximum(lo, jnp.max(jnp.where(below, x, -jnp.inf), axis=1))
        hi = jnp.minimum(hi, jnp.min(jnp.where(below, jnp.inf, x), axis=1))
        return lo, hi

    lo, hi = lax.fori_loop(jnp.int32(0), jnp.int32(steps), step, (lo, hi))
    return (lo + hi) / 2


def _factor(a: jax.Array, b: jax.Array) -> tuple[jax.Array, ...]:
    """Partial-pivoting LU of the tridiagonal matrices with diagonal ``a`` and off-diagonal ``b`` (LAPACK ``lagtf``).

    Args:
        a: `(n, s)` diagonals (one matrix per column); b: `(n, s)` ``b[k] = M[k, k+1] = M[k+1, k]`` (``b[-1] = 0``).

    Returns:
        ``(u1, u2, u3, l, piv)``, each `(n, s)`: the three diagonals of ``U``, the multipliers and the row
        interchanges (``piv[k]``: rows ``k`` and ``k + 1`` swapped).
    """
    a_next = jnp.concatenate([a[1:], jnp.ones_like(a[:1])])
    b_next = jnp.concatenate([b[1:], jnp.zeros_like(b[:1])])

    def row(carry, xs):
        p, q = carry
        c, an, bn = xs
        piv = jnp.abs(c) > jnp.abs(p)
        safe_p = jnp.where(p == 0, jnp.ones_like(p), p)
        safe_c = jnp.where(c == 0, jnp.ones_like(c), c)
        mult = jnp.where(piv, p / safe_c, jnp.where(p == 0, jnp.zeros_like(c), c / safe_p))
        u1 = jnp.where(piv, c, p)
        u2 = jnp.where(piv, an, q)
        u3 = jnp.where(piv, bn, jnp.zeros_like(bn))
        new_p = jnp.where(piv, q - mult * an, an - mult * q)
        new_q = jnp.where(piv, -mult * bn, bn)
        return (new_p, new_q), (u1, u2, u3, mult, piv)

    _, out = lax.scan(row, (vary_like(a[0], b), vary_like(b[0], a)), (b, a_next, b_next), unroll=4)
    return out


def _solve(factors: tuple[jax.Array, ...], r: jax.Array, tiny: jax.Array) -> jax.Array:
    """Solve with ``_factor``'s LU; pivots below ``tiny`` are replaced by ``+-tiny`` (LAPACK ``lagts``)."""
    u1, u2, u3, mult, piv = factors
    u1 = jnp.where(jnp.abs(u1) < tiny, jnp.where(u1 < 0, -tiny, tiny), u1)
    r_next = jnp.concatenate([r[1:], jnp.zeros_like(r[:1])])

    def forward(cur, xs):
        rn, lk, pk = xs
        y = jnp.where(pk, rn, cur)
        cur = jnp.where(pk, cur - lk * rn, rn - lk * cur)
        return cur, y

    _, y = lax.scan(forward, vary_like(r[0], mult), (r_next, mult, piv), unroll=4)

    def backward(carry, xs):
        x1, x2 = carry
        yk, a1, a2, a3 = xs
        x = (yk - a2 * x1 - a3 * x2) / a1
        return (x, x1), x

    zero = vary_like(jnp.zeros_like(r[0]), y)
    _, x = lax.scan(backward, (zero, zero), (y, u1, u2, u3), reverse=True, unroll=4)
    return x


def _reorthogonalize(z: jax.Array, cluster: jax.Array, window: int) -> jax.Array:
    """Orthonormalise each column of ``z: (n, s)`` against the up to ``window`` columns before it in its cluster.

    Classical Gram-Schmidt twice, column by column in order; ``cluster: (s,)`` int32 labels (equal for members of a
    cluster, which are consecutive).
    """
    n, s = z.shape
    zp = jnp.concatenate([jnp.zeros((n, window), z.dtype), z], axis=1)
    cp = jnp.concatenate([jnp.full((window,), -1, cluster.dtype), cluster])

    def body(k, zp):
        x = lax.dynamic_index_in_dim(zp, k + window, 1, keepdims=False)
        prev = lax.dynamic_slice(zp, index(0, k), (n, window))
        member = lax.dynamic_slice(cp, index(k), (window,)) == lax.dynamic_index_in_dim(cp, k + window, 0, False)
        for _ in range(2):
            coef = jnp.where(member, prev.T @ x, jnp.zeros((window,), z.dtype))
            x = x - prev @ coef
        x = x / jnp.maximum(jnp.linalg.norm(x), jnp.finfo(z.dtype).tiny)
        return lax.dynamic_update_slice(zp, x[:, None], index(0, k + window))

    return lax.fori_loop(jnp.int32(0), jnp.int32(s), body, zp)[:, window:]


def inverse_iteration(d: jax.Array, e: jax.Array, start: jax.Array, stop: jax.Array, norm: jax.Array,
                      w: jax.Array, slots: jax.Array, cluster: jax.Array, window: int) -> jax.Array:
    """Eigenvectors of the split tridiagonal ``T`` for the given slots (LAPACK ``stein``, all slots at once).

    Each slot solves ``(T_b - w_j I) x = r`` on its block's rows only (identity elsewhere), from a pseudo-random
    start that depends on the slot alone (so that two devices computing the same slot agree), ``INVERSE_STEPS``
    times; after each solve the vectors are normalised and, where the device has clusters, reorthogonalised against
    the earlier members of their cluster.

    Args:
        d, e, start, stop, norm: the split matrix (``split_blocks``).
        w: `(s,)` the slots' eigenvalues (ascending within each block).
        slots: `(s,)` int32 the slot indices (consecutive).
        cluster: `(s,)` int32 cluster labels (consecutive members, at most ``window`` before any slot that matters).
        window: the reorthogonalisation window.

    Returns:
        `(n, s)` real orthonormal eigenvectors of ``T`` (zero outside each slot's block).
    """
    n = d.shape[0]
    real = d.dtype
    eps = jnp.finfo(real).eps
    rows = jnp.arange(n, dtype=jnp.int32)[:, None]
    inside = (rows >= start[slots][None, :]) & (rows < stop[slots][None, :])
    a = jnp.where(inside, d[:, None] - w[None, :], jnp.ones_like(inside, real))
    b = jnp.where(inside, e[:, None], jnp.zeros_like(inside, real))
    factors = _factor(a, b)
    tiny = eps * norm
    # A hash of (row, slot) in [-1, 1), not jax.random: its 64-bit path fails to lower under the scoped x64 that
    # single-precision input runs this stage in.
    h = jnp.sin(rows.astype(real) * 12.9898 + slots.astype(real)[None, :] * 78.233 + 0.5) * 43758.5453
    x = 2 * (h - jnp.floor(h)) - 1
    x = jnp.where(inside, x, jnp.zeros_like(x))
    clustered = jnp.any(cluster[1:] == cluster[:-1])

    def normalise(x):
        scale = jnp.max(jnp.abs(x), axis=0, keepdims=True)
        x = x / jnp.where(scale > 0, scale, jnp.ones_like(scale))
        return x / jnp.linalg.norm(x, axis=0, keepdims=True)

    x = normalise(x) * tiny
    for it in range(INVERSE_STEPS):
        x = normalise(_solve(factors, x, tiny))
        x = lax.cond(clustered, lambda z: _reorthogonalize(z, cluster, window), lambda z: z, x)
        if it < INVERSE_STEPS - 1:
            x = x * tiny
    return x

"""One certified grid pass of the local kNN: dense distance blocks over row-aligned blocks of queries.

The data are sorted by cell key. Active queries, sorted the same way, are cut into blocks of at most ``block``
consecutive queries that never cross a grid row (nor, in a compacted pass, skip an empty cell of it). A block's
candidates are the cells ``[x0 - 1, x1 + 1]`` of the ``3**(d-1)`` rows around it: contiguous runs of the sorted
data, packed into ``capacity`` slots and gathered once for the whole block. One dense `(block, capacity)` distance
tile and ``lax.top_k`` then give every query of the block its ``k + 1`` nearest candidates.

A query's answer is certified exact when no candidate run was cut off by ``capacity``, its k-th distance is below
the distance to the outside of the searched cells, and its k-th and (k+1)-th distances differ (so the tie-break by
index cannot depend on which candidates were searched). A pass given the tie-break ``order`` also certifies a
query whose k-th distance is tied: every point at that distance lies within the searched cells, so the pass takes
the tied candidates of smallest ``order`` itself. Uncertified queries are left for a later pass.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._nonzero import true_positions
from .._wordsort import sort_words
from ..core import vary_like
from ._grid import SENTINEL_KEY, Domain, Grid, axis_margin, cell_coords, cell_keys
from ._knn_tuning import Tiles


class PassResult(NamedTuple):
    """Per query, in the query order: squared distances `(m, k)`, data rows `(m, k)`, flags `(m,)`; and the
    sequential steps (batches) the pass ran."""

    dist2: jax.Array
    rows: jax.Array
    certified: jax.Array
    truncated: jax.Array
    steps: jax.Array


def pair_dist2(q: jax.Array, c: jax.Array, domain: Domain) -> jax.Array:
    """Squared distances `(..., Q, C)` between `q: (..., Q, d)` and `c: (..., C, d)` (minimum image if periodic;
    positions wrapped into the box, see :func:`~shardax.spatial._grid.wrap`).

    Every code path computes distances with this one function, so equal pairs give bit-equal distances.
    """
    def axis_dist2(axis: int) -> jax.Array:
        dx = q[..., :, None, axis] - c[..., None, :, axis]
        if domain.periodic:
            # Wrapped coordinates differ by less than a box: the nearest image is at most one box away. (Without
            # a division: XLA:CPU keeps a divided tile in memory of its own, one per axis.)
            box = domain.extent[axis]
            half = box * 0.5
            dx = jnp.where(dx > half, dx - box, jnp.where(dx < -half, dx + box, dx))
        # max(., 0) changes no value; it keeps each square rounded on its own. Without it, a compiler may fuse a
        # square into the next sum as one fused multiply-add in one program and not in another (XLA:CPU's
        # older per-op emitters do), and the same pair would get distances an ulp apart.
        return jnp.maximum(dx * dx, 0)

    total = axis_dist2(0)
    for axis in range(1, q.shape[-1]):
        total = total + axis_dist2(axis)
    return total


# Counting bins per pass of the threshold selection: log-spaced (factors of two in squared distance), then linear
# within the bin that holds the (k+1)-th value.
_SELECT_BINS = 16


def smallest(d2: jax.Array, kk: int, *, select: str, width: int, exact: jax.Array | None = None
             ) -> tuple[jax.Array, jax.Array]:
    """The ``kk`` smallest values along the last axis of ``d2 (..., C)``, ascending, and their positions: exactly
    ``lax.top_k(-d2, kk)`` (equal values in position order), values negated back.

    ``select="threshold"``: two counting passes (:func:`_threshold`) find, per row, a value that at least ``kk``
    finite entries reach; the entries within it are packed in position order into ``width`` slots and
    ``lax.top_k`` runs over those. A GPU sorts a whole row for ``lax.top_k``, so this replaces a sort of ``C``
    entries by a few passes over them and a sort of ``width``. A step where some row holds more than ``width``
    entries within its threshold (many equal distances) takes ``lax.top_k`` over every entry instead; the result is
    the same either way. ``exact`` (shape ``d2.shape[:-1]``): the rows whose answer must be exact; the others
    (padding queries, overflowing candidate runs) never send a step the ``lax.top_k`` way, and get ``kk`` of their
    entries within the threshold, in order (their real candidates, or ``inf`` where a row has fewer).
    """
    c = d2.shape[-1]
    if select == "top_k" or width >= c:
        return _top_k(d2, kk)
    lead = d2.shape[:-1]
    flat = d2.reshape(-1, c)
    rows = flat.shape[0]
    limit, count = _threshold(flat, kk)

    def packed(flat: jax.Array) -> tuple[jax.Array, jax.Array]:
        keep = flat <= limit[:, None]
        rank = jnp.cumsum(keep, axis=1, dtype=jnp.int32) - 1
        slot = jnp.arange(rows, dtype=jnp.int32)[:, None] * width + rank
        # Entries left out go past the end, each to a slot of its own while that fits int32: every index is then
        # distinct and the scatter needs no atomics.
        distinct = rows * (width + c) < 2**31
        past = rows * width + (jnp.arange(rows * c, dtype=jnp.int32).reshape(rows, c) if distinct else 0)
        slot = jnp.where(keep & (rank < width), slot, past)
        # Position c marks an empty slot; it reads as +inf, after every kept (finite) entry.
        where = jnp.full((rows * width,), c, jnp.int32).at[slot.reshape(-1)].set(
            jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), flat.shape).reshape(-1), mode="drop",
            unique_indices=distinct).reshape(rows, width)
        values = jnp.where(where < c, jnp.take_along_axis(flat, jnp.minimum(where, c - 1), axis=1), jnp.inf)
        best, pick = _top_k(values, kk)
        # A row with fewer than kk finite entries fills its tail with +inf entries; lax.top_k over the whole row
        # would name the first infinite positions, which these are not: they are only read through invalid slots.
        return best, jnp.minimum(jnp.take_along_axis(where, pick, axis=1), c - 1)

    fits = count <= width
    if exact is not None:
        fits = fits | ~exact.reshape(-1)
    best, pick = lax.cond(jnp.all(fits), packed, lambda flat: _top_k(flat, kk), flat)
    return best.reshape(*lead, kk), pick.reshape(*lead, kk)


def _boundary_ties(d2: jax.Array, cand_order: jax.Array, best: jax.Array, pick: jax.Array, k: int,
                   exact: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ``k`` nearest of each query `(B, Q, k)` with ties at the k-th distance broken by rank: from
    :func:`smallest`'s ``k + 1`` nearest ``best, pick`` of ``d2 (B, Q, C)``, the entries below the k-th distance
    ``v``, then the entries equal to ``v`` of smallest ``cand_order`` `(B, C)` (the rank of each candidate).

    ``smallest`` keeps equal values in position order, which is not rank order. Only a step where an ``exact`` row
    has its k-th and (k+1)-th distances equal pays for the second selection, over the rows' entries equal to ``v``.
    Returns ``k + 1`` columns like ``smallest`` (the last one unchanged).
    """
    v = best[..., k - 1]
    # (Rows with fewer than k + 1 candidates hold inf there: not a tie, and not certifiable either.)
    tied = exact & (v == best[..., k]) & jnp.isfinite(v)

    def by_rank(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        best, pick = args
        below = jnp.sum(best[..., :k] < v[..., None], axis=-1, dtype=jnp.int32)
        key = jnp.where(d2 == v[..., None], cand_order[:, None, :], jnp.iinfo(jnp.int32).max)
        _, at_v = lax.top_k(-key, k)  # equal to v, smallest rank first (ranks are >= 0: no overflow)
        j = jnp.arange(k, dtype=jnp.int32)[None, None, :]
        first = j < below[..., None]
        pick = jnp.where(first, pick[..., :k], jnp.take_along_axis(at_v, jnp.maximum(j - below[..., None], 0),
                                                                   axis=-1))
        return (jnp.concatenate([jnp.where(first, best[..., :k], v[..., None]), best[..., k:]], axis=-1),
                jnp.concatenate([pick, args[1][..., k:]], axis=-1))

    return lax.cond(jnp.any(tied), by_rank, lambda args: args, (best, pick))


def _top_k(d2: jax.Array, kk: int) -> tuple[jax.Array, jax.Array]:
    """The ``kk`` smallest values along the last axis, ascending, and their positions (``lax.top_k`` of ``-d2``)."""
    neg, pick = lax.top_k(-d2, kk)
    return -neg, pick


def _threshold(d2: jax.Array, kk: int) -> tuple[jax.Array, jax.Array]:
    """Per row of ``d2 (R, C)``: a value ``t`` with at least ``kk`` entries ``<= t`` where the row has ``kk`` finite
    entries (else its largest finite entry), and the number of entries ``<= t``.

    The first pass counts the entries under ``max * 2**(j - 16)`` for ``j = 1..16``; the second splits the bin
    holding the ``kk``-th entry into 16 equal parts. For near-uniform points a bin then holds a few entries, so
    ``t`` passes the ``kk``-th entry by a few.
    """
    dtype = d2.dtype
    top = jnp.max(jnp.where(jnp.isfinite(d2), d2, -jnp.inf), axis=1)
    top = jnp.where(jnp.isfinite(top), top, jnp.asarray(0, dtype))  # no finite entry: nothing is kept below

    def counts(edges: jax.Array) -> jax.Array:  # (R, B) entries <= each edge
        # The bins last: on one H200 (1e7 points, k=30) kNN ran 416 ms this way, 471 ms with the comparison laid
        # out `(R, B, C)` and 432 ms as one reduction per bin.
        return jnp.sum(d2[:, :, None] <= edges[:, None, :], axis=1, dtype=jnp.int32)

    def first_reaching(edges: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
        j = jnp.argmax(n >= kk, axis=1)[:, None]
        return j[:, 0], jnp.take_along_axis(edges, j, axis=1)[:, 0]

    scale = jnp.asarray(2.0, dtype) ** jnp.arange(1 - _SELECT_BINS, 1, dtype=dtype)
    edges = top[:, None] * scale[None, :]
    edges = edges.at[:, -1].set(top)
    n1 = counts(edges)
    j, upper = first_reaching(edges, n1)
    lower = jnp.where(j > 0, jnp.take_along_axis(edges, jnp.maximum(j - 1, 0)[:, None], axis=1)[:, 0], 0)
    frac = jnp.arange(1, _SELECT_BINS + 1, dtype=dtype) / _SELECT_BINS
    edges = lower[:, None] + (upper - lower)[:, None] * frac[None, :]
    edges = edges.at[:, -1].set(upper)
    n2 = counts(edges)
    i, limit = first_reaching(edges, n2)
    enough = n1[:, -1] >= kk
    limit = jnp.where(enough, limit, top)
    count = jnp.where(enough, jnp.take_along_axis(n2, i[:, None], axis=1)[:, 0], n1[:, -1])
    return limit, count


def positions_of(mask: jax.Array, size: int, fill: jax.Array | int) -> jax.Array:
    """int32 positions `(size,)` of the true entries of ``mask``, then ``fill``."""
    found = true_positions(mask, size, 0)
    count = jnp.sum(mask, dtype=jnp.int32)
    return jnp.where(jnp.arange(size, dtype=jnp.int32) < count, found.astype(jnp.int32), fill)


def _axis_offsets(reach: int) -> tuple[int, ...]:
    # 0, -1, 1, -2, 2, ...: on a short periodic axis the duplicates of a cell are always the later offsets.
    return (0, *(o for j in range(1, reach + 1) for o in (-j, j)))


def _row_offsets(dim: int, reach: int) -> list[tuple[int, ...]]:
    return list(itertools.product(_axis_offsets(reach), repeat=dim - 1))


class _Answers(NamedTuple):
    """A grid pass's loop carry, per query in the query order: squared distances and data rows `(m, k)`, whether
    the answer is certified and whether a candidate run was cut off `(m,)`."""

    dist2: jax.Array
    rows: jax.Array
    certified: jax.Array
    truncated: jax.Array


class SortedData(NamedTuple):
    """Data sorted by the cell keys of one grid: keys `(n,)`, original rows `(n,)`, positions `(n, d)`."""

    keys: jax.Array
    rows: jax.Array
    pos: jax.Array


def sort_data(data_pos: jax.Array, data_valid: jax.Array, domain: Domain, grid: Grid) -> SortedData:
    """The valid data rows sorted by cell key (invalid rows last, with the sentinel key)."""
    keys = jnp.where(data_valid, cell_keys(cell_coords(data_pos, domain, grid), grid), SENTINEL_KEY)
    keys, rows = sort_words(keys)
    return SortedData(keys, rows, data_pos[rows])


def grid_pass(data: SortedData, query_pos: jax.Array, active: jax.Array, *, domain: Domain, grid: Grid,
              reach: int, k: int, tiles: Tiles, into: tuple[jax.Array, jax.Array] | None = None,
              order: jax.Array | None = None) -> PassResult:
    """Answer the ``active`` queries whose result this grid certifies (see the module docstring).

    Args:
        data: the data sorted on ``grid`` (see :func:`sort_data`).
        query_pos: `(m, d)` query positions (wrapped).
        active: `(m,)` queries to answer.
        domain: the search domain.
        grid: the cell grid of this pass.
        reach: cells searched on each side of a block's cells along every axis.
        k: neighbours per query.
        tiles: queries per block, candidate slots per block (at least ``k + 1``), blocks per sequential step and
            the ``jnp.searchsorted`` methods (see :class:`~shardax.spatial._knn_tuning.Tiles`).
        into: `(m, k)` squared distances and rows to write the certified results into (the other rows keep their
            values; one set of result buffers for all passes); None: fresh ones, with every active query's
            candidates, certified or not.
        order: `(n,)` int32 tie-break rank of each data row (by original row): with it, a query whose k-th distance
            is tied with the (k+1)-th is certified too, taking the tied candidates of smallest rank (the answer a
            search over all data in ``order`` gives); None: such a query is left uncertified.

    Returns:
        ``PassResult`` for every query (meaningful where ``certified``); ``rows`` are data row numbers.
    """
    block, capacity = tiles.block, tiles.capacity
    dim = data.pos.shape[1]
    m = query_pos.shape[0]
    dtype = data.pos.dtype
    kk = k + 1
    dkeys, dperm, dpos = data

    qcoords = cell_coords(query_pos, domain, grid)
    qkeys = jnp.where(active, cell_keys(qcoords, grid), SENTINEL_KEY)
    qkeys, qperm = sort_words(qkeys)
    qpos = query_pos[qperm]
    qcoords = qcoords[qperm]
    num_active = jnp.sum(active, dtype=jnp.int32)

    # Row-aligned blocks: a block starts at a new row or every `block` queries into a row. With `tiles.split_gaps`
    # (compacted passes) also after a gap of an empty cell along the row: the few scattered queries of a compacted
    # pass would otherwise share blocks that span a whole row, whose candidates overflow any capacity. (In a full
    # pass the gaps of sparse regions would only add blocks: clustered data ran 1.4x slower on CPU with them.)
    idx = jnp.arange(m, dtype=jnp.int32)
    row = qkeys // grid.cells[0]
    new_run = row[1:] != row[:-1]
    if tiles.split_gaps:
        new_run = new_run | (qcoords[1:, 0] - qcoords[:-1, 0] > 1)
    row_start = lax.cummax(jnp.where(jnp.concatenate([jnp.ones((1,), bool), new_run]), idx, 0))
    starts_flag = ((idx - row_start) % block == 0) & (idx < num_active)
    num_blocks = jnp.sum(starts_flag, dtype=jnp.int32)
    block_starts = positions_of(starts_flag, m + 1, num_active)

    offsets = _row_offsets(dim, reach)
    inf = jnp.asarray(jnp.inf, dtype)

    def run_batch(batch: int, b: jax.Array, out: _Answers) -> _Answers:
        bid = b * batch + jnp.arange(batch, dtype=jnp.int32)
        start = block_starts[jnp.minimum(bid, m)]
        end = jnp.where(bid < num_blocks, block_starts[jnp.minimum(bid + 1, m)], start)
        qi = start[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
        qvalid = qi < end[:, None]
        qi = jnp.minimum(qi, m - 1)
        qp = qpos[qi]
        first = qcoords[jnp.minimum(start, m - 1)]
        x0 = first[:, 0]
        x1 = qcoords[jnp.clip(end - 1, 0, m - 1), 0]

        range_start, range_len = _candidate_runs(dkeys, first, x0, x1, grid=grid, offsets=offsets, reach=reach,
                                                 periodic=domain.periodic, search=tiles.search)
        cum = jnp.cumsum(range_len, axis=1)
        total = cum[:, -1]
        truncated = total > capacity
        slot = jnp.arange(capacity, dtype=jnp.int32)
        which = jax.vmap(lambda ends: jnp.searchsorted(ends, slot, side="right", method=tiles.slot_search))(cum)
        which = jnp.minimum(which.astype(jnp.int32), range_len.shape[1] - 1)
        before = jnp.take_along_axis(cum - range_len, which, axis=1)
        drow = jnp.take_along_axis(range_start, which, axis=1) + slot[None, :] - before
        cvalid = slot[None, :] < total[:, None]
        drow = jnp.where(cvalid, drow, 0)

        d2 = pair_dist2(qp, dpos[drow], domain)
        d2 = jnp.where(cvalid[:, None, :], d2, inf)
        # Only rows that can be certified need the exact selection (the others keep real candidates).
        exact = qvalid & ~truncated[:, None]
        best, pick = smallest(d2, kk, select=tiles.select, width=tiles.select_width, exact=exact)
        kth = best[..., k - 1]
        if order is None:
            distinct = kth < best[..., k]
        else:
            best, pick = _boundary_ties(d2, order[dperm[drow]], best, pick, k, exact)
            distinct = jnp.ones_like(exact)
        # The whole (k + 1)-wide pick, sliced after the gather: gathering with a slice of it ran XLA:CPU's first
        # pass 12x slower (2e5 points, k=9: 0.6 -> 7.6 s).
        rows = jnp.take_along_axis(drow, pick.reshape(batch, block * kk), axis=1).reshape(pick.shape)[..., :k]
        best = best[..., :k]

        margin = axis_margin(qp[..., 0], (x0 - reach)[:, None], (x1 + reach)[:, None], 0, domain, grid)
        for axis in range(1, dim):
            c = first[:, axis, None]
            margin = jnp.minimum(margin, axis_margin(qp[..., axis], c - reach, c + reach, axis, domain, grid))
        # With ties resolved here every point at the k-th distance must lie inside: the margin is strict.
        within = (kth <= margin * margin) if order is None else (kth < margin * margin)
        ok = qvalid & ~truncated[:, None] & distinct & (margin > 0) & within

        # Written straight to the input order: no sorted-order copy of the results.
        target = jnp.where(qvalid, qperm[qi], m)
        answer = target if into is None else jnp.where(ok, target, m)
        return _Answers(dist2=out.dist2.at[answer].set(best, mode="drop"),
                        rows=out.rows.at[answer].set(dperm[rows], mode="drop"),
                        certified=out.certified.at[target].set(ok, mode="drop"),
                        truncated=out.truncated.at[target].set(jnp.broadcast_to(truncated[:, None], qvalid.shape),
                                                               mode="drop"))

    dist2, rows = (jnp.full((m, k), jnp.inf, dtype), jnp.zeros((m, k), jnp.int32)) if into is None else into
    init = _Answers(dist2, rows, certified=jnp.zeros((m,), bool), truncated=jnp.zeros((m,), bool))
    def run(batch: int, init: _Answers) -> tuple[_Answers, jax.Array]:
        num_batches = (num_blocks + batch - 1) // batch
        return lax.fori_loop(0, num_batches, functools.partial(run_batch, batch), init), num_batches

    init = vary_like(init, qpos)
    if 0 < tiles.few_batch < tiles.batch:
        # Few blocks (a compacted pass over the last uncertified queries): one step of few_batch blocks instead of
        # a whole step of padding blocks.
        out, steps = lax.cond(num_blocks <= tiles.few_batch, functools.partial(run, tiles.few_batch),
                              functools.partial(run, tiles.batch), init)
    else:
        out, steps = run(tiles.batch, init)
    return PassResult(out.dist2, out.rows, out.certified, out.truncated, steps=steps)


def _candidate_runs(dkeys: jax.Array, first: jax.Array, x0: jax.Array, x1: jax.Array, *, grid: Grid,
                    offsets: list[tuple[int, ...]], reach: int, periodic: bool,
                    search: str) -> tuple[jax.Array, jax.Array]:
    """Start and length `(B, R)` in the sorted data of every run of candidate cells of each block (`first: (B, d)`
    the cell of a block's first query, `x0, x1: (B,)` its first and last cell along axis 0)."""
    gx = grid.cells[0]
    a, b = x0 - reach, x1 + reach
    if periodic:
        full = b - a + 1 >= gx
        lo_part = jnp.where(full, 0, jnp.where(a < 0, a + gx, a))
        hi_part = jnp.where(full, gx - 1, jnp.where(a < 0, gx - 1, jnp.minimum(b, gx - 1)))
        # The wrapped remainder: [0, b] when a < 0, [0, b - gx] when b >= gx, else empty.
        wrap_hi = jnp.where(full, -1, jnp.where(a < 0, b, jnp.where(b >= gx, b - gx, -1)))
        x_parts = [(lo_part, hi_part), (jnp.zeros_like(wrap_hi), wrap_hi)]
    else:
        x_parts = [(jnp.maximum(a, 0), jnp.minimum(b, gx - 1))]

    # Every candidate row of every block at once, `(B, R)` (no Python loop over the rows: one set of operations
    # whatever the reach, so the program stays small).
    table = np.asarray(offsets, dtype=np.int32).reshape(len(offsets), -1)
    # A periodic axis of g cells holds an offset's cell only once when g >= 2 |off| + (off > 0).
    least = 2 * np.abs(table) + (table > 0)
    base = jnp.zeros((x0.shape[0], len(offsets)), x0.dtype)
    ok = jnp.ones(base.shape, dtype=bool)
    for axis in range(1, first.shape[1]):
        g = grid.cells[axis]
        c = first[:, axis, None] + table[None, :, axis - 1]
        if periodic:
            ok = ok & (g >= least[None, :, axis - 1])
            c = jnp.mod(c, g)
        else:
            ok = ok & (c >= 0) & (c < g)
        base = base + c * grid.stride[axis]
    # Runs ordered by candidate row, then by x part.
    xa = jnp.stack([xa for xa, _ in x_parts], axis=1)[:, None, :]
    xb = jnp.stack([xb for _, xb in x_parts], axis=1)[:, None, :]
    runs = (x0.shape[0], len(offsets) * len(x_parts))
    lo_k = (base[:, :, None] + xa).reshape(runs)
    hi_k = (base[:, :, None] + xb + 1).reshape(runs)
    valid = (ok[:, :, None] & (xb >= xa)).reshape(runs)
    found = jnp.searchsorted(dkeys, jnp.stack([lo_k, hi_k]), side="left", method=search).astype(jnp.int32)
    length = jnp.where(valid, found[1] - found[0], 0)
    return found[0], length

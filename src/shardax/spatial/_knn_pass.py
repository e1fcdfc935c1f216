"""One certified grid pass of the local kNN: dense distance blocks over row-aligned blocks of queries.

The data are sorted by cell key. Active queries, sorted the same way, are cut into blocks of at most ``block``
consecutive queries that never cross a grid row (nor, in a compacted pass, skip an empty cell of it). A block's
candidates are the cells ``[x0 - 1, x1 + 1]`` of the ``3**(d-1)`` rows around it: contiguous runs of the sorted
data (read from a table of each cell's first row in the first pass, else found by binary search),
packed into ``capacity`` slots and gathered once for the whole block. One dense `(block, capacity)` distance
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
from ._grid import SENTINEL_KEY, Domain, Grid, axis_margin, cell_coords, cell_keys, cell_starts
from ._knn_tuning import Tiles


class PassResult(NamedTuple):
    """Per query, in the query order: squared distances `(m, k)`, data rows (or their labels) `(m, k)`, flags
    `(m,)`; and the sequential steps (batches) the pass ran."""

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
            box = domain.metric_box[axis]
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


# Counting edges of the threshold selection: 16 edges a quarter of an octave apart in squared distance, the last at
# the row's bound. Between two edges a ball's volume grows by 1.3x, so the edge that first holds k + 1 entries holds
# about 1.3 (k + 1) of them (at a third of an octave, 1.4x, 3 of 1e6 uniform queries at k=30 overflowed 64 slots).
# The lowest edge is 2**-3.75 of the bound: a k-th neighbour closer than that is in a region denser than the grid
# was made for, and a finer grid answers it.
_SELECT_EDGES = 16
_SELECT_STEP = 4


class Selected(NamedTuple):
    """:func:`smallest`'s answer: values `(..., kk)` ascending, their positions `(..., kk)`, and `(...)` whether a
    row's selection is exact within its bound (``ok``) and whether a row failed for too many entries near its k-th
    (``dense``: a finer grid suits it)."""

    best: jax.Array
    pick: jax.Array
    ok: jax.Array
    dense: jax.Array


def smallest(d2: jax.Array, kk: int, *, select: str, width: int, bound: jax.Array,
             exact: jax.Array | None = None) -> Selected:
    """The ``kk`` smallest values along the last axis of ``d2 (..., C)`` that lie within ``bound (...)``, ascending,
    and their positions: where ``ok``, exactly ``lax.top_k(-d2, kk)`` (equal values in position order, values negated
    back) for every value ``<= bound``, and ``inf`` after them.

    ``select="top_k"``: ``lax.top_k`` over the whole row (``ok`` everywhere). ``select="threshold"``: one counting
    pass counts, per row, the entries under 16 edges spaced a quarter of an octave apart below ``bound``; the entries
    within the first edge that holds ``kk`` of them (else within ``bound``, if it holds ``kk - 1``) are packed in
    position order into ``width`` slots and ``lax.top_k`` runs over those. A GPU sorts a whole row for
    ``lax.top_k``, so this replaces a sort of ``C`` entries by one pass over them and a sort of ``width``. A row is
    not ``ok`` when fewer than ``kk - 1`` entries lie within its bound, when its edge holds more than ``width``
    entries (many equal or very close values: ``dense``), or when it is not ``exact`` (shape ``d2.shape[:-1]``;
    padding queries, overflowing candidate runs). Every row that is not ``ok`` gets ``kk`` of its finite entries
    in position order among its first ``width`` ones (real candidates, or ``inf`` where a row has fewer).

    ``select="union"`` (``d2`` of shape `(B, Q, C)`: blocks of queries sharing their candidates): as
    ``"threshold"``, but the positions any row of a block keeps are first packed once per block into ``4 width``
    slots, and each row packs its own from those: the per-row work runs over ``4 width`` entries instead of ``C``.
    A block whose rows keep more is not ``ok`` (``dense``) and keeps its first ones.
    """
    c = d2.shape[-1]
    lead = d2.shape[:-1]
    if select == "top_k" or width >= c:
        best, pick = _top_k(d2, kk)
        ok = jnp.ones(lead, bool)
        return Selected(best, pick, ok, ~ok)
    flat = d2.reshape(-1, c)
    dtype = d2.dtype
    top = bound.reshape(-1).astype(dtype)
    scale = jnp.asarray(2.0, dtype) ** (jnp.arange(1 - _SELECT_EDGES, 1, dtype=dtype) / _SELECT_STEP)
    edges = (top[:, None] * scale[None, :]).at[:, -1].set(top)
    # (R, E) entries <= each edge, the edges last: on one H200 (1e7 points, k=30) the whole kNN ran 416 ms this
    # way, 471 ms with the comparison laid out `(R, E, C)` and 432 ms as one reduction per edge.
    counts = jnp.sum(flat[:, :, None] <= edges[:, None, :], axis=1, dtype=jnp.int32)
    j = jnp.argmax(counts >= kk, axis=1)
    reached = counts[:, -1] >= kk
    limit = jnp.where(reached, jnp.take_along_axis(edges, j[:, None], axis=1)[:, 0], top)
    count = jnp.where(reached, jnp.take_along_axis(counts, j[:, None], axis=1)[:, 0], counts[:, -1])
    enough = counts[:, -1] >= kk - 1
    fits = count <= width
    ok = enough & fits & (top >= 0)
    if exact is not None:
        ok = ok & exact.reshape(-1)
    dense = enough & ~fits
    if select == "union" and len(lead) == 2 and 4 * width < c:
        best, pick, ok, dense = _union_pack(d2, limit.reshape(lead), ok.reshape(lead), dense.reshape(lead), kk,
                                            width)
        return Selected(best, pick, ok, dense)
    # The other rows keep their first finite entries (a row's finite entries never exceed the largest float).
    best, pick = _pack(flat, jnp.where(ok, limit, jnp.finfo(dtype).max), kk, width)
    return Selected(best.reshape(*lead, kk), pick.reshape(*lead, kk), ok.reshape(lead), dense.reshape(lead))


def _pack(flat: jax.Array, limit: jax.Array, kk: int, width: int) -> tuple[jax.Array, jax.Array]:
    """The ``kk`` smallest of each row of ``flat (R, C)`` among its first ``width`` entries ``<= limit (R,)`` (in
    position order), ascending, and their positions: the entries are packed into ``width`` slots
    (:func:`_compact`), and ``lax.top_k`` runs over those."""
    c = flat.shape[1]
    where = _compact(flat <= limit[:, None], width)
    values = jnp.where(where < c, jnp.take_along_axis(flat, jnp.minimum(where, c - 1), axis=1), jnp.inf)
    best, pick = _top_k(values, kk)
    # A row with fewer than kk kept entries fills its tail with +inf; lax.top_k over the whole row would name the
    # first infinite positions, which these are not: they are only read through empty slots.
    return best, jnp.minimum(jnp.take_along_axis(where, pick, axis=1), c - 1)


def _compact(keep: jax.Array, size: int) -> jax.Array:
    """`(R, size)` int32: the positions of the first ``size`` true entries of each row of ``keep (R, C)``, in order,
    then ``C`` (empty slots), by one scatter."""
    rows, c = keep.shape
    rank = _kept_before(keep)
    slot = jnp.arange(rows, dtype=jnp.int32)[:, None] * size + rank
    # Entries left out go past the end, each to a slot of its own while that fits int32: every index is then
    # distinct and the scatter needs no atomics.
    distinct = rows * (size + c) < 2**31
    past = rows * size + (jnp.arange(rows * c, dtype=jnp.int32).reshape(rows, c) if distinct else 0)
    slot = jnp.where(keep & (rank < size), slot, past)
    return jnp.full((rows * size,), c, jnp.int32).at[slot.reshape(-1)].set(
        jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), keep.shape).reshape(-1), mode="drop",
        unique_indices=distinct).reshape(rows, size)


def _union_pack(d2: jax.Array, limit: jax.Array, ok: jax.Array, dense: jax.Array, kk: int,
                width: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``select="union"`` of :func:`smallest` after its counting pass: ``d2 (B, Q, C)``, the rows' ``limit``,
    ``ok`` and ``dense`` `(B, Q)`."""
    blocks, queries, c = d2.shape
    union = 4 * width
    # Every position an exact row keeps; a block with rows that are not exact also keeps its first `width`
    # positions, so those rows get real candidates (the valid candidates come first).
    keep = jnp.any((d2 <= limit[..., None]) & ok[..., None], axis=1)
    keep = keep | (jnp.any(~ok, axis=1)[:, None] & (jnp.arange(c) < width)[None, :])
    fits = jnp.sum(keep, axis=1, dtype=jnp.int32) <= union
    where = _compact(keep, union)
    at = jnp.minimum(where, c - 1)
    gathered = jnp.where((where < c)[:, None, :], jnp.take_along_axis(d2, at[:, None, :], axis=2), jnp.inf)
    # A block whose rows keep more than `union` positions: its rows are not ok (dense) and keep their first entries.
    dense = dense | (ok & ~fits[:, None])
    ok = ok & fits[:, None]
    rows_limit = jnp.where(ok, limit, jnp.finfo(d2.dtype).max).reshape(-1)
    best, pick = _pack(gathered.reshape(-1, union), rows_limit, kk, width)
    pick = jnp.take_along_axis(at, pick.reshape(blocks, queries * kk), axis=1)
    return best.reshape(blocks, queries, kk), pick.reshape(blocks, queries, kk), ok, dense


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


# Positions per group of the kept-entry count (:func:`_kept_before`).
_RANK_GROUP = 32


def _kept_before(keep: jax.Array) -> jax.Array:
    """`(R, C)` int32: the true entries of ``keep (R, C)`` before each position of its row (an exclusive prefix
    sum), as two matrix products of 0/1 values: within groups of 32 positions, then over the groups' totals.

    Exact (bfloat16 holds 0 and 1, the sums are accumulated in float32 and stay below 2**24). A GPU runs the
    products on its matrix units; XLA:GPU makes ``jnp.cumsum`` of the same rows a windowed reduction that reads
    each entry many times.
    """
    rows, c = keep.shape
    size = min(_RANK_GROUP, c)
    groups = -(-c // size)
    x = jnp.pad(keep, ((0, 0), (0, groups * size - c))).astype(jnp.bfloat16).reshape(rows, groups, size)
    before = (jnp.arange(size)[:, None] < jnp.arange(size)[None, :]).astype(jnp.bfloat16)
    within = jnp.einsum("rgj,ji->rgi", x, before, preferred_element_type=jnp.float32)
    totals = jnp.sum(x, axis=2, dtype=jnp.float32)
    earlier = (jnp.arange(groups)[:, None] < jnp.arange(groups)[None, :]).astype(jnp.float32)
    offsets = jnp.einsum("rh,hg->rg", totals, earlier, precision=lax.Precision.HIGHEST)
    return (within + offsets[:, :, None]).reshape(rows, groups * size)[:, :c].astype(jnp.int32)


def _searched_width2(span: jax.Array, reach: int, domain: Domain, grid: Grid) -> jax.Array:
    """`(B,)` the squared diagonal of each block's searched cells (``span + 1 + 2 reach`` cells along axis 0, ``1 +
    2 reach`` along the others, half a periodic box at most): no candidate lies farther from a query of the block,
    up to the rounding of the cell assignment."""
    total = jnp.zeros(span.shape, grid.size.dtype)
    for axis in range(grid.size.shape[0]):
        cells = span + 1 + 2 * reach if axis == 0 else jnp.full(span.shape, 1 + 2 * reach)
        width = cells.astype(grid.size.dtype) * grid.size[axis]
        if domain.periodic:
            width = jnp.minimum(width, 0.5 * domain.metric_box[axis])
        total = total + width * width
    return total


def _top_k(d2: jax.Array, kk: int) -> tuple[jax.Array, jax.Array]:
    """The ``kk`` smallest values along the last axis, ascending, and their positions (``lax.top_k`` of ``-d2``)."""
    neg, pick = lax.top_k(-d2, kk)
    return -neg, pick


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
    """A grid pass's loop carry, per query in the query order: squared distances and data rows (or their labels)
    `(m, k)`, whether the answer is certified and whether a candidate run was cut off `(m,)`."""

    dist2: jax.Array
    rows: jax.Array
    certified: jax.Array
    truncated: jax.Array


class SortedData(NamedTuple):
    """Data sorted by the cell keys of one grid: keys `(n,)`, original rows `(n,)`, positions `(n, d)`, and for a
    grid of at most ``max_cells`` cells the first row of every cell (`(max_cells + 1,)`, see
    :func:`~shardax.spatial._grid.cell_starts`), else None (the runs are searched for)."""

    keys: jax.Array
    rows: jax.Array
    pos: jax.Array
    starts: jax.Array | None = None


def sort_data(data_pos: jax.Array, data_valid: jax.Array, domain: Domain, grid: Grid,
              grid_pos: jax.Array | None = None, max_cells: int | None = None) -> SortedData:
    """The valid data rows sorted by cell key (invalid rows last, with the sentinel key); the cells of ``grid_pos``
    (default ``data_pos``: see :class:`~shardax.spatial._grid.Piece`). With ``max_cells`` (a grid made with that
    cap at a level <= 0) also the table of each cell's first row."""
    at = data_pos if grid_pos is None else grid_pos
    keys = jnp.where(data_valid, cell_keys(cell_coords(at, domain, grid), grid), SENTINEL_KEY)
    keys, rows = sort_words(keys)
    starts = None if max_cells is None else cell_starts(keys, max_cells, jnp.sum(data_valid, dtype=jnp.int32))
    return SortedData(keys, rows, data_pos[rows], starts)


def grid_pass(data: SortedData, query_pos: jax.Array, active: jax.Array, *, domain: Domain, grid: Grid,
              reach: int, k: int, tiles: Tiles, into: tuple[jax.Array, jax.Array] | None = None,
              order: jax.Array | None = None, query_grid_pos: jax.Array | None = None,
              labels: jax.Array | None = None) -> PassResult:
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
        query_grid_pos: `(m, d)` the queries' positions on the grid, where they differ from ``query_pos`` (a
            device's piece unwrapped, see :class:`~shardax.spatial._grid.Piece`).
        labels: `(n,)` int32 label of each data row (by original row), written to the results instead of the row
            numbers (so a search that answers with labels needs no gather of its results at the end).

    Returns:
        ``PassResult`` for every query (meaningful where ``certified``); ``rows`` are data row numbers, or their
        ``labels``.
    """
    block, capacity = tiles.block, tiles.capacity
    dim = data.pos.shape[1]
    m = query_pos.shape[0]
    dtype = data.pos.dtype
    kk = k + 1
    dkeys, dperm, dpos, dstarts = data

    qcoords = cell_coords(query_pos if query_grid_pos is None else query_grid_pos, domain, grid)
    qkeys = jnp.where(active, cell_keys(qcoords, grid), SENTINEL_KEY)
    qkeys, qperm = sort_words(qkeys)
    qpos = query_pos[qperm]
    qgrid = None if query_grid_pos is None else query_grid_pos[qperm]
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
        qg = qp if qgrid is None else qgrid[qi]
        first = qcoords[jnp.minimum(start, m - 1)]
        x0 = first[:, 0]
        x1 = qcoords[jnp.clip(end - 1, 0, m - 1), 0]

        range_start, range_len = _candidate_runs(dkeys, first, x0, x1, grid=grid, offsets=offsets, reach=reach,
                                                 domain=domain, search=tiles.search, starts=dstarts)
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

        margin = axis_margin(qg[..., 0], (x0 - reach)[:, None], (x1 + reach)[:, None], 0, domain, grid)
        for axis in range(1, dim):
            c = first[:, axis, None]
            margin = jnp.minimum(margin, axis_margin(qg[..., axis], c - reach, c + reach, axis, domain, grid))
        # Only rows that can be certified need the exact selection (the others keep real candidates), and only
        # within their margin: a k-th neighbour beyond it certifies nothing. Where nothing lies beyond the searched
        # cells (a small grid), their width bounds the candidates' distances. (Any bound keeps the answers exact:
        # a row is only certified with its k nearest within it.)
        exact = qvalid & ~truncated[:, None]
        width2 = _searched_width2(x1 - x0, reach, domain, grid)[:, None]
        bound = jnp.where(margin > 0, jnp.where(jnp.isfinite(margin), margin * margin, width2), -1)
        sel = smallest(d2, kk, select=tiles.select, width=tiles.select_width, bound=bound, exact=exact)
        best, pick = sel.best, sel.pick
        kth = best[..., k - 1]
        if order is None:
            distinct = kth < best[..., k]
        else:
            best, pick = _boundary_ties(d2, order[dperm[drow]], best, pick, k, exact & sel.ok)
            distinct = jnp.ones_like(exact)
        # The whole (k + 1)-wide pick, sliced after the gather: gathering with a slice of it ran XLA:CPU's first
        # pass 12x slower (2e5 points, k=9: 0.6 -> 7.6 s).
        rows = jnp.take_along_axis(drow, pick.reshape(batch, block * kk), axis=1).reshape(pick.shape)[..., :k]
        best = best[..., :k]

        # With ties resolved here every point at the k-th distance must lie inside: the margin is strict.
        within = (kth <= margin * margin) if order is None else (kth < margin * margin)
        ok = exact & sel.ok & distinct & (margin > 0) & within
        # A row whose selection met too many close entries fails like an overflowing run (a finer grid suits it).
        truncated = truncated[:, None] | (exact & sel.dense)

        found_rows = dperm[rows] if labels is None else labels[dperm[rows]]
        # Written straight to the input order: no sorted-order copy of the results.
        target = jnp.where(qvalid, qperm[qi], m)
        answer = target if into is None else jnp.where(ok, target, m)
        return _Answers(dist2=out.dist2.at[answer].set(best, mode="drop"),
                        rows=out.rows.at[answer].set(found_rows, mode="drop"),
                        certified=out.certified.at[target].set(ok, mode="drop"),
                        truncated=out.truncated.at[target].set(truncated, mode="drop"))

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
                    offsets: list[tuple[int, ...]], reach: int, domain: Domain, search: str,
                    starts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Start and length `(B, R)` in the sorted data of every run of candidate cells of each block (`first: (B, d)`
    the cell of a block's first query, `x0, x1: (B,)` its first and last cell along axis 0): read from the table
    of cell ``starts`` where the data have one, else searched for in the sorted keys by ``search``."""
    gx = grid.cells[0]
    a, b = x0 - reach, x1 + reach
    wraps_x = domain.wraps(0)
    open_x = (jnp.maximum(a, 0), jnp.minimum(b, gx - 1))
    if wraps_x is not False:
        full = b - a + 1 >= gx
        lo_part = jnp.where(full, 0, jnp.where(a < 0, a + gx, a))
        hi_part = jnp.where(full, gx - 1, jnp.where(a < 0, gx - 1, jnp.minimum(b, gx - 1)))
        # The wrapped remainder: [0, b] when a < 0, [0, b - gx] when b >= gx, else empty.
        wrap_hi = jnp.where(full, -1, jnp.where(a < 0, b, jnp.where(b >= gx, b - gx, -1)))
        if wraps_x is not True:  # an open axis on this grid: the open range, no remainder
            lo_part, hi_part = jnp.where(wraps_x, lo_part, open_x[0]), jnp.where(wraps_x, hi_part, open_x[1])
            wrap_hi = jnp.where(wraps_x, wrap_hi, -1)
        x_parts = [(lo_part, hi_part), (jnp.zeros_like(wrap_hi), wrap_hi)]
    else:
        x_parts = [open_x]

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
        wraps = domain.wraps(axis)
        if wraps is True:
            ok = ok & (g >= least[None, :, axis - 1])
            c = jnp.mod(c, g)
        elif wraps is False:
            ok = ok & (c >= 0) & (c < g)
        else:
            ok = ok & jnp.where(wraps, g >= least[None, :, axis - 1], (c >= 0) & (c < g))
            c = jnp.where(wraps, jnp.mod(c, g), c)
        base = base + c * grid.stride[axis]
    # Runs ordered by candidate row, then by x part.
    xa = jnp.stack([xa for xa, _ in x_parts], axis=1)[:, None, :]
    xb = jnp.stack([xb for _, xb in x_parts], axis=1)[:, None, :]
    runs = (x0.shape[0], len(offsets) * len(x_parts))
    lo_k = (base[:, :, None] + xa).reshape(runs)
    hi_k = (base[:, :, None] + xb + 1).reshape(runs)
    valid = (ok[:, :, None] & (xb >= xa)).reshape(runs)
    bounds = jnp.stack([lo_k, hi_k])
    if starts is not None:
        found = starts[jnp.clip(bounds, 0, starts.shape[0] - 1)]
    else:
        found = jnp.searchsorted(dkeys, bounds, side="left", method=search).astype(jnp.int32)
    length = jnp.where(valid, found[1] - found[0], 0)
    return found[0], length

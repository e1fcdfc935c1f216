"""One certified grid pass of the local kNN: dense distance blocks over row-aligned blocks of queries.

The data are sorted by cell key. Active queries, sorted the same way, are cut into blocks of at most ``block``
consecutive queries that never cross a grid row. A block's candidates are the cells ``[x0 - 1, x1 + 1]`` of the
``3**(d-1)`` rows around it: contiguous runs of the sorted data, packed into ``capacity`` slots and gathered once
for the whole block. One dense `(block, capacity)` distance tile and ``lax.top_k`` then give every query of the
block its ``k + 1`` nearest candidates.

A query's answer is certified exact when no candidate run was cut off by ``capacity``, its k-th distance is below
the distance to the outside of the searched cells, and its k-th and (k+1)-th distances differ (so the tie-break by
index cannot depend on which candidates were searched). Uncertified queries are left for a later pass.
"""

from __future__ import annotations

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
        return dx * dx

    total = axis_dist2(0)
    for axis in range(1, q.shape[-1]):
        total = total + axis_dist2(axis)
    return total


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
              reach: int, k: int, tiles: Tiles, into: tuple[jax.Array, jax.Array] | None = None) -> PassResult:
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

    Returns:
        ``PassResult`` for every query (meaningful where ``certified``); ``rows`` are data row numbers.
    """
    block, capacity, batch = tiles.block, tiles.capacity, tiles.batch
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

    # Row-aligned blocks: a block starts at a new row or every `block` queries into a row.
    idx = jnp.arange(m, dtype=jnp.int32)
    row = qkeys // grid.cells[0]
    new_row = jnp.concatenate([jnp.ones((1,), bool), row[1:] != row[:-1]])
    row_start = lax.cummax(jnp.where(new_row, idx, 0))
    starts_flag = ((idx - row_start) % block == 0) & (idx < num_active)
    num_blocks = jnp.sum(starts_flag, dtype=jnp.int32)
    block_starts = positions_of(starts_flag, m + 1, num_active)

    offsets = _row_offsets(dim, reach)
    inf = jnp.asarray(jnp.inf, dtype)

    def run_batch(b: jax.Array, out: _Answers) -> _Answers:
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
        neg, pick = lax.top_k(-d2, kk)
        best = -neg
        rows = jnp.take_along_axis(drow, pick.reshape(batch, block * kk), axis=1).reshape(pick.shape)

        margin = axis_margin(qp[..., 0], (x0 - reach)[:, None], (x1 + reach)[:, None], 0, domain, grid)
        for axis in range(1, dim):
            c = first[:, axis, None]
            margin = jnp.minimum(margin, axis_margin(qp[..., axis], c - reach, c + reach, axis, domain, grid))
        kth = best[..., k - 1]
        ok = (qvalid & ~truncated[:, None] & (kth < best[..., k]) & (margin > 0) & (kth <= margin * margin))

        # Written straight to the input order: no sorted-order copy of the results.
        target = jnp.where(qvalid, qperm[qi], m)
        answer = target if into is None else jnp.where(ok, target, m)
        return _Answers(dist2=out.dist2.at[answer].set(best[..., :k], mode="drop"),
                        rows=out.rows.at[answer].set(dperm[rows[..., :k]], mode="drop"),
                        certified=out.certified.at[target].set(ok, mode="drop"),
                        truncated=out.truncated.at[target].set(jnp.broadcast_to(truncated[:, None], qvalid.shape),
                                                               mode="drop"))

    dist2, rows = (jnp.full((m, k), jnp.inf, dtype), jnp.zeros((m, k), jnp.int32)) if into is None else into
    init = _Answers(dist2, rows, certified=jnp.zeros((m,), bool), truncated=jnp.zeros((m,), bool))
    num_batches = (num_blocks + batch - 1) // batch
    out = lax.fori_loop(0, num_batches, run_batch, vary_like(init, qpos))
    return PassResult(out.dist2, out.rows, out.certified, out.truncated, steps=num_batches)


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

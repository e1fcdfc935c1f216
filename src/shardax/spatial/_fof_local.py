"""Local friends-of-friends linking: every pair closer than the linking length, then connected components.

Pairs. Points are sorted by the row-major key of a cell grid whose cells are at least the linking length wide, so a
point's friends lie in the ``3**d`` cells around its own. Sorted points are cut into blocks of at most ``block``
consecutive points of one grid row. A block's candidates are the cells ``[x0 - 1, x1 + 1]`` of its own row and of
the "forward" half of the neighbouring rows (the other half finds the same pairs from the other side): contiguous
runs of the sorted points, packed into chunks of ``capacity`` slots. Every (block, chunk) work item gives one dense
`(block, capacity)` distance tile; its pairs within the linking length are compacted with a cumulative sum and a
binary search (no scatter over the whole tile) and appended to a fixed-size edge list. Dense regions simply give more
chunks, so every pair is found whatever the clustering; only the edge list has a capacity.

Components. Hook-and-compress label propagation over the edge list (the FastSV scheme): every edge lowers the
parent of its larger label to its smaller label by a scatter-min, then pointer jumping flattens the trees, until
both ends of every edge share a label. Labels converge to the smallest sorted row of each component.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._grid import SENTINEL_KEY, Domain, Grid

# Cell keys are int32: the product of the cell counts must stay below 2**31.
_MAX_CELLS = {2: 2**15 - 1, 3: 2**10 - 1}


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` marked as varying over the manual mesh axes ``like`` varies over (loop carries must agree)."""

    def varying(a: jax.Array) -> frozenset[str]:
        return frozenset(getattr(getattr(jax.typeof(a), "manual_axis_type", None), "varying", ()))

    missing = tuple(sorted(varying(like) - varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


class Tuning(NamedTuple):
    """Static sizes of the pair search (changing them recompiles)."""

    per_cell: float = 2.0  # points per cell when the linking length allows cells that large
    block: int = 8  # points per block
    capacity: int = 64  # candidate slots per chunk
    batch: int = 1024  # work items per dense tile
    tile_edges: int = 512  # pairs compacted per step (a tile with more takes several steps)


DEFAULT_TUNING = Tuning()


class Links(NamedTuple):
    """Pairs found by :func:`find_links` in sorted-row numbering."""

    first: jax.Array  # (edge_capacity,) int32, -1 past num_edges
    second: jax.Array  # (edge_capacity,) int32
    num_edges: jax.Array  # int32 pairs found (may exceed edge_capacity: overflow)


class SortedPoints(NamedTuple):
    """Valid points sorted by cell key (padding last): keys `(n,)`, original rows `(n,)`, positions `(n, d)`."""

    keys: jax.Array
    rows: jax.Array
    pos: jax.Array
    coords: jax.Array


def link_grid(domain: Domain, num: jax.Array, linking_length: jax.Array, per_cell: float,
              volume: jax.Array | None = None) -> Grid:
    """A grid of about ``per_cell`` points per cell whose cells are never narrower than the linking length.

    ``volume`` is the volume the ``num`` points occupy (default: the whole domain); a device holding a small piece
    of a periodic box sizes its cells by its own piece while the grid still spans the box.
    """
    dim = domain.extent.shape[0]
    ext = jnp.maximum(domain.extent, jnp.max(domain.extent) * 1e-6).astype(jnp.float32)
    volume = jnp.prod(ext) if volume is None else jnp.clip(volume.astype(jnp.float32), 1e-30, jnp.prod(ext))
    side = (volume * per_cell / jnp.maximum(num, 1).astype(jnp.float32)) ** (1.0 / dim)
    side = jnp.maximum(side, linking_length.astype(jnp.float32))
    cells = jnp.clip(jnp.floor(ext / side), 1, _MAX_CELLS[dim]).astype(jnp.int32)
    stride = jnp.concatenate([jnp.ones((1,), jnp.int32), jnp.cumprod(cells)[:-1]])
    return Grid(cells, domain.extent / cells.astype(domain.extent.dtype), stride)


def cell_coords(pos: jax.Array, domain: Domain, grid: Grid) -> jax.Array:
    """Integer cell coordinates `(n, d)` of positions `(n, d)`, clipped into the grid."""
    c = jnp.floor((pos - domain.lo[None, :]) / grid.size[None, :]).astype(jnp.int32)
    return jnp.clip(c, 0, grid.cells[None, :] - 1)


def cell_keys(coords: jax.Array, grid: Grid) -> jax.Array:
    """Row-major cell keys `(n,)` with axis 0 fastest."""
    return jnp.sum(coords * grid.stride[None, :], axis=-1)


def sort_points(pos: jax.Array, valid: jax.Array, domain: Domain, grid: Grid) -> SortedPoints:
    """Valid rows of ``pos`` sorted by cell key (stable: equal keys keep row order)."""
    coords = cell_coords(pos, domain, grid)
    keys = jnp.where(valid, cell_keys(coords, grid), SENTINEL_KEY)
    keys, rows = lax.sort((keys, jnp.arange(pos.shape[0], dtype=jnp.int32)), num_keys=1, is_stable=True)
    return SortedPoints(keys, rows, pos[rows], coords[rows])


def dist2(a: jax.Array, b: jax.Array, domain: Domain) -> jax.Array:
    """Squared distances `(..., A, B)` between `a: (..., A, d)` and `b: (..., B, d)` (minimum image if periodic)."""
    total = None
    for axis in range(a.shape[-1]):
        dx = a[..., :, None, axis] - b[..., None, :, axis]
        if domain.periodic:
            box = domain.extent[axis]
            dx = dx - box * jnp.round(dx * (1 / box))
        total = dx * dx if total is None else total + dx * dx
    assert total is not None
    return total


def _forward_rows(dim: int) -> list[tuple[int, ...]]:
    """Row offsets searched from each block: its own row, then half of the neighbouring rows."""
    others = [o for o in itertools.product((-1, 0, 1), repeat=dim - 1) if any(o)]
    forward = [o for o in others if o[::-1] > tuple(0 for _ in o)]
    return [tuple(0 for _ in range(dim - 1)), *forward]


def _candidate_runs(keys: jax.Array, first: jax.Array, x0: jax.Array, x1: jax.Array, grid: Grid,
                    periodic: bool) -> tuple[jax.Array, jax.Array]:
    """Start and length `(B, R)` in the sorted points of every run of candidate cells of each block."""
    dim = first.shape[1]
    gx = grid.cells[0]
    a, b = x0 - 1, x1 + 1
    if periodic:
        full = b - a + 1 >= gx
        lo_part = jnp.where(full, 0, jnp.where(a < 0, a + gx, a))
        hi_part = jnp.where(full, gx - 1, jnp.where(a < 0, gx - 1, jnp.minimum(b, gx - 1)))
        wrap_hi = jnp.where(full, -1, jnp.where(a < 0, b, jnp.where(b >= gx, b - gx, -1)))
        x_parts = [(lo_part, hi_part), (jnp.zeros_like(wrap_hi), wrap_hi)]
    else:
        x_parts = [(jnp.maximum(a, 0), jnp.minimum(b, gx - 1))]
    lo_keys, hi_keys, valid = [], [], []
    for offset in _forward_rows(dim):
        base = jnp.zeros_like(x0)
        ok = jnp.ones_like(x0, dtype=bool)
        for axis, off in enumerate(offset, start=1):
            g = grid.cells[axis]
            c = first[:, axis] + off
            if periodic:
                # On an axis of one cell every offset is the row itself, which offset 0 already covers. (On two
                # cells -1 and +1 coincide: a pair may be found twice, which linking does not mind.)
                ok = ok & ((g >= 2) | (off == 0))
                c = jnp.mod(c, g)
            else:
                ok = ok & (c >= 0) & (c < g)
            base = base + c * grid.stride[axis]
        for xa, xb in x_parts:
            lo_keys.append(base + xa)
            hi_keys.append(base + xb + 1)
            valid.append(ok & (xb >= xa))
    bounds = jnp.stack([jnp.stack(lo_keys, axis=1), jnp.stack(hi_keys, axis=1)])
    found = jnp.searchsorted(keys, bounds, side="left").astype(jnp.int32)
    return found[0], jnp.where(jnp.stack(valid, axis=1), found[1] - found[0], 0)


def find_links(points: SortedPoints, num: jax.Array, linking_length: jax.Array, domain: Domain, grid: Grid, *,
               edge_capacity: int, tuning: Tuning = DEFAULT_TUNING) -> Links:
    """All pairs of the first ``num`` sorted points closer than (or at) the linking length, each pair at least once.

    Args:
        points: points sorted on ``grid`` (:func:`sort_points`).
        num: number of valid points.
        linking_length: scalar linking length (at most the cell width of ``grid``).
        domain: the domain of ``grid``.
        grid: a grid from :func:`link_grid`.
        edge_capacity: length of the edge list (static).
        tuning: static sizes of the search.

    Returns:
        :class:`Links` in sorted-row numbering; ``num_edges > edge_capacity`` means pairs were lost.
    """
    n = points.pos.shape[0]
    block, capacity, batch = tuning.block, tuning.capacity, tuning.batch
    ll2 = (linking_length * linking_length).astype(points.pos.dtype)
    idx = jnp.arange(n, dtype=jnp.int32)

    # Row-aligned blocks: a block starts at a new row or every `block` points into a row.
    row = points.keys // grid.cells[0]
    new_row = jnp.concatenate([jnp.ones((1,), bool), row[1:] != row[:-1]])
    row_start = lax.cummax(jnp.where(new_row, idx, 0))
    starts_flag = ((idx - row_start) % block == 0) & (idx < num)
    num_blocks = jnp.sum(starts_flag, dtype=jnp.int32)
    (block_start,) = jnp.nonzero(starts_flag, size=n, fill_value=num)
    block_start = block_start.astype(jnp.int32)
    block_end = jnp.concatenate([block_start[1:], jnp.reshape(num, (1,)).astype(jnp.int32)])
    block_end = jnp.where(idx < num_blocks, block_end, block_start)
    first = points.coords[jnp.minimum(block_start, n - 1)]
    x1 = points.coords[jnp.clip(block_end - 1, 0, n - 1), 0]
    run_start, run_len = _candidate_runs(points.keys, first, first[:, 0], x1, grid, domain.periodic)
    total = jnp.where(idx < num_blocks, jnp.sum(run_len, axis=1), 0)

    # Work items: chunk c of block b covers candidate slots [c * capacity, (c + 1) * capacity).
    chunks = jnp.where(idx < num_blocks, jnp.maximum(1, -(-total // capacity)), 0)
    chunk_end = jnp.cumsum(chunks)
    num_items = chunk_end[-1]
    slot = jnp.arange(capacity, dtype=jnp.int32)
    run_cum = jnp.cumsum(run_len, axis=1)
    step_edges = tuning.tile_edges

    def tile(t: jax.Array, state: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        first_out, second_out, count = state
        item = t * batch + jnp.arange(batch, dtype=jnp.int32)
        blk = jnp.minimum(jnp.searchsorted(chunk_end, item, side="right").astype(jnp.int32), n - 1)
        chunk = item - (chunk_end[blk] - chunks[blk])
        live = item < num_items
        qi = block_start[blk][:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
        qvalid = live[:, None] & (qi < block_end[blk][:, None])
        qi = jnp.minimum(qi, n - 1)
        s = chunk[:, None] * capacity + slot[None, :]
        cum = run_cum[blk]
        which = jnp.minimum(jnp.sum(s[:, :, None] >= cum[:, None, :], axis=-1, dtype=jnp.int32), cum.shape[1] - 1)
        before = jnp.take_along_axis(cum - run_len[blk], which, axis=1)
        cj = jnp.take_along_axis(run_start[blk], which, axis=1) + s - before
        cvalid = s < total[blk][:, None]
        cj = jnp.where(cvalid, cj, 0)
        d2 = dist2(points.pos[qi], points.pos[cj], domain)
        # Own-row pairs are seen from both ends: keep them once (i < j); other rows are searched from one side.
        own_row = which < (2 if domain.periodic else 1)
        keep = jnp.where(own_row[:, None, :], qi[:, :, None] < cj[:, None, :], qi[:, :, None] != cj[:, None, :])
        hit = qvalid[:, :, None] & cvalid[:, None, :] & keep & (d2 <= ll2)
        # Two-level compaction: the k-th pair is found by a binary search over per-query counts, then a count
        # within that query's row of the tile.
        hit = hit.reshape(-1, capacity)
        row_hits = jnp.cumsum(hit.astype(jnp.int32), axis=1)
        row_total = jnp.cumsum(row_hits[:, -1])
        found = row_total[-1]
        qflat = qi.reshape(-1)

        def compact(step: jax.Array, out: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            rank = step * step_edges + jnp.arange(step_edges, dtype=jnp.int32)
            q = jnp.searchsorted(row_total, rank + 1, side="left", method="scan_unrolled").astype(jnp.int32)
            q = jnp.minimum(q, row_total.shape[0] - 1)
            within = rank - (row_total[q] - row_hits[q, -1])
            col = jnp.minimum(jnp.sum(row_hits[q] <= within[:, None], axis=1, dtype=jnp.int32), capacity - 1)
            take = rank < found
            at = jnp.minimum(count + step * step_edges, edge_capacity)
            return (lax.dynamic_update_slice(out[0], jnp.where(take, qflat[q], -1), (at,)),
                    lax.dynamic_update_slice(out[1], jnp.where(take, cj[q // block, col], -1), (at,)))

        steps = (found + step_edges - 1) // step_edges
        first_out, second_out = lax.fori_loop(0, steps, compact, (first_out, second_out))
        return first_out, second_out, count + found

    pad = edge_capacity + step_edges
    init = tuple(vary_like(x, points.pos) for x in (jnp.full((pad,), -1, jnp.int32), jnp.full((pad,), -1, jnp.int32),
                                                     jnp.int32(0)))
    num_tiles = (num_items + batch - 1) // batch
    first_out, second_out, count = lax.fori_loop(0, num_tiles, tile, init)
    live = jnp.arange(edge_capacity, dtype=jnp.int32) < count
    return Links(jnp.where(live, first_out[:edge_capacity], -1), jnp.where(live, second_out[:edge_capacity], -1),
                 count)


def components(links: Links, n: int) -> jax.Array:
    """Smallest node of each node's connected component, `(n,)` int32 (nodes are ``0..n-1``)."""
    valid = links.first >= 0
    a = jnp.where(valid, links.first, 0)
    b = jnp.where(valid, links.second, 0)

    def compress(parent: jax.Array) -> jax.Array:
        return lax.while_loop(lambda p: jnp.any(p[p] != p), lambda p: p[p], parent)

    def unsettled(parent: jax.Array) -> jax.Array:
        return jnp.any(parent[a] != parent[b])

    def hook(parent: jax.Array) -> jax.Array:
        pa, pb = parent[a], parent[b]
        lo, hi = jnp.minimum(pa, pb), jnp.maximum(pa, pb)
        parent = parent.at[hi].min(lo)
        return compress(parent)

    return lax.while_loop(unsettled, hook, vary_like(jnp.arange(n, dtype=jnp.int32), links.first))

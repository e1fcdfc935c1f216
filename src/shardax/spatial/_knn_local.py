"""Exact local k-nearest neighbours: certified grid passes, then brute force for what no grid certified.

The first pass uses a grid of a few points per cell and small candidate tiles, sized for near-uniform data; it
certifies almost every query. Later passes take only the remaining queries, on grids refined where candidate runs
overflowed (dense regions) or coarsened where the k-th neighbour lay beyond the searched cells (sparse regions), with
larger tiles. Whatever is still uncertified (e.g. many exactly tied distances) is answered by brute force against
all data, in index order, so ties always go to the smaller index.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core._vary import vary_like
from ._grid import Domain, make_grid, open_domain, periodic_domain, wrap
from ._knn_pass import grid_pass, pair_dist2, positions_of, sort_data


class Tuning(NamedTuple):
    """Static sizes of the search (changing them recompiles)."""

    per_cell: float = 4.0  # points per cell of the first grid
    block: int = 8  # queries per block
    capacity: int = 256  # candidate slots per block, first pass
    batch: int = 256  # blocks per dense tile, first pass
    later_capacity: int = 1024  # candidate slots per block, later passes
    later_batch: int = 32  # blocks per dense tile, later passes
    later_queries: int = 2048  # queries per later pass (at least; more for many queries)
    max_passes: int = 12  # full passes (three times as many compacted passes) before brute force
    brute_chunk: int = 64  # queries per brute-force chunk
    brute_tile: int = 2048  # data rows per brute-force tile


def _tuning(dim: int, k: int) -> Tuning:
    per_cell = max(4.0, 0.5 * k) if dim == 3 else max(3.0, 0.4 * k)
    base = Tuning(per_cell=per_cell)
    need = 9 * (base.block + 3 * per_cell) if dim == 3 else 3 * (base.block + 3 * per_cell)
    capacity = max(base.capacity if dim == 3 else 96, int(1.6 * need) // 32 * 32 + 32, k + 1)
    return base._replace(capacity=capacity, later_capacity=max(6 * capacity, k + 1),
                         batch=max(8, 65536 // (base.block * capacity)))


@functools.partial(jax.jit, static_argnames=("k",))
def local_knn(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, query_valid: jax.Array,
              order: jax.Array, k: int, box: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Exact kNN of the valid query rows among the valid data rows.

    Args:
        pos: `(n, d)` data positions.
        data_valid: `(n,)` which data rows exist.
        query_pos: `(m, d)` query positions.
        query_valid: `(m,)` which query rows exist.
        order: `(n,)` int32 tie-break rank of each data row (its global index); equal distances are ordered by it.
        k: neighbours per query.
        box: `(d,)` periodic box, or None for open boundaries.

    Returns:
        ``(dist2, rows)``: `(m, k)` squared distances (ascending, ties by ``order``) and data row numbers;
        invalid query rows, and neighbours missing when fewer than ``k`` data rows exist, hold ``inf`` and ``-1``.
    """
    dim = pos.shape[1]
    m = query_pos.shape[0]
    tuning = _tuning(dim, k)
    domain = open_domain(pos, data_valid) if box is None else periodic_domain(box.astype(pos.dtype))
    pos = wrap(pos, domain)
    query_pos = wrap(query_pos, domain)
    count = jnp.sum(data_valid, dtype=jnp.int32)

    grid0 = make_grid(domain, count, tuning.per_cell, jnp.int32(0))
    data0 = sort_data(pos, data_valid, domain, grid0)
    first = grid_pass(data0, query_pos, query_valid, domain, grid0, 1, k=k, block=tuning.block,
                      capacity=tuning.capacity, batch=tuning.batch)
    active = query_valid & ~first.certified
    subset = min(m, max(tuning.later_queries, m // 16))

    def many_left(state: tuple) -> jax.Array:
        passes, _, _, active, *_ = state
        return (passes < tuning.max_passes) & (jnp.sum(active) > subset)

    def adapt(state: tuple) -> tuple:
        # Many uncertified queries (clustered data): a full pass on a grid refined four-fold where most failures
        # are overflowing candidate runs (dense clumps), else coarsened (voids).
        passes, finest, coarsest, active, truncated, dist2, rows = state
        finer = 2 * jnp.sum(active & truncated) >= jnp.sum(active)
        level = jnp.where(finer, finest + 2, coarsest - 1)
        grid = make_grid(domain, count, tuning.per_cell, level)
        res = grid_pass(sort_data(pos, data_valid, domain, grid), query_pos, active, domain, grid, 1, k=k,
                        block=tuning.block, capacity=tuning.capacity, batch=tuning.batch)
        done = active & res.certified
        return (passes + 1, jnp.maximum(finest, level), jnp.minimum(coarsest, level), active & ~done,
                jnp.where(active, res.truncated, truncated), jnp.where(done[:, None], res.dist2, dist2),
                jnp.where(done[:, None], res.rows, rows))

    state = (jnp.int32(0), jnp.int32(0), jnp.int32(0), active, first.truncated, first.dist2, first.rows)
    _, finest, coarsest, active, _, dist2, rows = lax.while_loop(many_left, adapt,
                                                                vary_like(state, query_pos))
    start = jnp.where(finest == 0, 0, jnp.maximum(coarsest - 1, -3))
    state = (jnp.int32(0), start, finest, coarsest, active, jnp.zeros_like(active), dist2, rows)

    def cond(state: tuple) -> jax.Array:
        passes, level, finest, _, active, *_ = state
        return (passes < 3 * tuning.max_passes) & jnp.any(active) & (level <= finest + 3)

    def body(state: tuple) -> tuple:
        passes, level, finest, coarsest, active, tried, dist2, rows = state
        # Few queries left: compacted passes searching two cells wide (a density window of about 50 per query),
        # sweeping from coarse grids to the finest used so far in two-fold steps, so every query meets a grid
        # that suits it; a level repeats until it has tried every active query.
        grid = make_grid(domain, count, tuning.per_cell, level)
        data = lax.cond(level == 0, lambda: vary_like(data0, query_pos),
                        lambda: vary_like(sort_data(pos, data_valid, domain, grid), query_pos))
        untried = active & ~tried
        picked = positions_of(untried, subset, m)
        sub = jnp.minimum(picked, m - 1)
        res = grid_pass(data, query_pos[sub], picked < m, domain, grid, 2, k=k, block=tuning.block,
                        capacity=tuning.later_capacity, batch=tuning.later_batch)
        done = jnp.where((picked < m) & res.certified, picked, m)
        dist2 = dist2.at[done].set(res.dist2, mode="drop")
        rows = rows.at[done].set(res.rows, mode="drop")
        active = active.at[done].set(False, mode="drop")
        tried = tried.at[picked].set(True, mode="drop")
        level_done = ~jnp.any(active & ~tried)
        level = jnp.where(level_done, level + 1, level)
        tried = tried & ~level_done
        return (passes + 1, level, finest, coarsest, active, tried, dist2, rows)

    *_, active, _, dist2, rows = lax.while_loop(cond, body, vary_like(state, query_pos))
    dist2, rows = _brute_force(pos, data_valid, order, query_pos, active, domain, dist2, rows, k, tuning)
    dist2, rows = _order_ties(dist2, rows, order)
    found = query_valid[:, None] & jnp.isfinite(dist2)
    return jnp.where(found, dist2, jnp.inf), jnp.where(found, rows, -1)


@functools.partial(jax.jit, static_argnames=("k",))
def kth_distance_bound(pos: jax.Array, data_valid: jax.Array, k: int, box: jax.Array | None) -> jax.Array:
    """An upper bound `(n,)` on each valid row's squared k-th neighbour distance among the valid rows.

    One first-grid pass: any k real candidates bound the k-th distance from above, certified or not (``inf``
    where a row saw fewer than k candidates).
    """
    tuning = _tuning(pos.shape[1], k)
    domain = open_domain(pos, data_valid) if box is None else periodic_domain(box.astype(pos.dtype))
    pos = wrap(pos, domain)
    grid = make_grid(domain, jnp.sum(data_valid, dtype=jnp.int32), tuning.per_cell, jnp.int32(0))
    res = grid_pass(sort_data(pos, data_valid, domain, grid), pos, data_valid, domain, grid, 1, k=k,
                    block=tuning.block, capacity=tuning.capacity, batch=tuning.batch)
    return jnp.where(data_valid, res.dist2[:, k - 1], jnp.inf)


def _brute_force(pos: jax.Array, data_valid: jax.Array, order: jax.Array, query_pos: jax.Array,
                 active: jax.Array, domain: Domain, dist2: jax.Array, rows: jax.Array, k: int,
                 tuning: Tuning) -> tuple[jax.Array, jax.Array]:
    """Replace the results of the ``active`` queries by a scan over all data in ``order``."""
    n, dim = pos.shape
    m = query_pos.shape[0]
    tile, chunk = tuning.brute_tile, tuning.brute_chunk
    num_tiles = -(-n // tile)
    pad = num_tiles * tile - n
    # Data in tie-break order: top_k keeps the earlier of equal values, and the kept best come first.
    _, by_order = lax.sort((jnp.where(data_valid, order, jnp.iinfo(jnp.int32).max),
                            jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)
    tiles_pos = jnp.pad(pos[by_order], ((0, pad), (0, 0))).reshape(num_tiles, tile, dim)
    tiles_valid = jnp.pad(data_valid[by_order], (0, pad)).reshape(num_tiles, tile)
    tiles_row = jnp.pad(by_order, (0, pad)).reshape(num_tiles, tile)
    num_active = jnp.sum(active, dtype=jnp.int32)
    todo = jnp.pad(positions_of(active, m, m), (0, chunk), constant_values=m)

    def run_chunk(c: jax.Array, out: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        qi = lax.dynamic_slice_in_dim(todo, c * chunk, chunk)
        qp = query_pos[jnp.minimum(qi, m - 1)]

        def scan_tile(t: jax.Array, best: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            d2 = pair_dist2(qp, tiles_pos[t], domain)
            d2 = jnp.where(tiles_valid[t][None, :], d2, jnp.inf)
            both_d2 = jnp.concatenate([best[0], d2], axis=1)
            both_rows = jnp.concatenate([best[1], jnp.broadcast_to(tiles_row[t], d2.shape)], axis=1)
            neg, pick = lax.top_k(-both_d2, k)
            return -neg, jnp.take_along_axis(both_rows, pick, axis=1)

        init = (jnp.full((chunk, k), jnp.inf, pos.dtype), jnp.zeros((chunk, k), jnp.int32))
        best_d2, best_rows = lax.fori_loop(0, num_tiles, scan_tile, vary_like(init, qp))
        return out[0].at[qi].set(best_d2, mode="drop"), out[1].at[qi].set(best_rows, mode="drop")

    return lax.fori_loop(0, (num_active + chunk - 1) // chunk, run_chunk, vary_like((dist2, rows), query_pos))


def _order_ties(dist2: jax.Array, rows: jax.Array, order: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Order equal distances within each result row by ``order`` (only when some row has a tie)."""

    def resort(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        d2, r = args
        _, _, r = lax.sort((d2, order[jnp.maximum(r, 0)], r), dimension=1, num_keys=2)
        return jnp.sort(d2, axis=1), r

    tied = jnp.any((dist2[:, 1:] == dist2[:, :-1]) & jnp.isfinite(dist2[:, 1:]))
    return lax.cond(tied, resort, lambda args: args, (dist2, rows))

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

from ..core import vary_like
from ._grid import Domain, make_grid, open_domain, periodic_domain, wrap
from ._knn_pass import grid_pass, pair_dist2, positions_of, sort_data
from ._knn_tuning import KnnTuning, Sizes, resolve, sizes


class Steps(NamedTuple):
    """Sequential loop steps one local search ran (int32 scalars; diagnostics).

    Attributes:
        first: batches of the first grid pass.
        adapt: full passes on adapted grids, plus their batches.
        later: compacted passes, plus their batches.
        brute: brute-force query chunks, plus their data tiles.
    """

    first: jax.Array
    adapt: jax.Array
    later: jax.Array
    brute: jax.Array

    @property
    def total(self) -> jax.Array:
        return self.first + self.adapt + self.later + self.brute


class _AdaptState(NamedTuple):
    passes: jax.Array  # full passes run
    finest: jax.Array  # finest and coarsest grid level used so far
    coarsest: jax.Array
    active: jax.Array  # (m,) queries still uncertified
    truncated: jax.Array  # (m,) whether a query's last failure was an overflowing candidate run
    dist2: jax.Array  # (m, k)
    rows: jax.Array  # (m, k)
    steps: jax.Array


class _SweepState(NamedTuple):
    passes: jax.Array  # compacted passes run
    level: jax.Array  # the grid level of this pass
    finest: jax.Array
    coarsest: jax.Array
    active: jax.Array  # (m,) queries still uncertified
    tried: jax.Array  # (m,) queries this level has already tried
    dist2: jax.Array  # (m, k)
    rows: jax.Array  # (m, k)
    steps: jax.Array


@functools.partial(jax.jit, static_argnames=("k", "tuning"))
def local_knn(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, query_valid: jax.Array,
              order: jax.Array, k: int, box: jax.Array | None,
              tuning: KnnTuning | None = None) -> tuple[jax.Array, jax.Array]:
    """Exact kNN of the valid query rows among the valid data rows.

    Args:
        pos: `(n, d)` data positions.
        data_valid: `(n,)` which data rows exist.
        query_pos: `(m, d)` query positions.
        query_valid: `(m,)` which query rows exist.
        order: `(n,)` int32 tie-break rank of each data row (its global index); equal distances are ordered by it.
        k: neighbours per query.
        box: `(d,)` periodic box, or None for open boundaries.
        tuning: the kernel's static sizes (None: the backend's preset).

    Returns:
        ``(dist2, rows)``: `(m, k)` squared distances (ascending, ties by ``order``) and data row numbers;
        invalid query rows, and neighbours missing when fewer than ``k`` data rows exist, hold ``inf`` and ``-1``.
    """
    return _search(pos, data_valid, query_pos, query_valid, order, k, box, tuning)[:2]


@functools.partial(jax.jit, static_argnames=("k", "tuning"))
def local_knn_steps(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, query_valid: jax.Array,
                    order: jax.Array, k: int, box: jax.Array | None,
                    tuning: KnnTuning | None = None) -> tuple[jax.Array, jax.Array, Steps]:
    """:func:`local_knn` and the sequential loop :class:`Steps` it ran (a diagnostic for the tuning).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pos = jax.random.uniform(jax.random.key(0), (1000, 3))
        >>> ok, ids = jnp.ones(1000, bool), jnp.arange(1000, dtype=jnp.int32)
        >>> d2, rows, steps = local_knn_steps(pos, ok, pos, ok, ids, 4, jnp.ones(3), tuning=KnnTuning(preset="gpu"))
        >>> rows[:3, 0].tolist(), int(steps.first)
        ([0, 1, 2], 1)
    """
    return _search(pos, data_valid, query_pos, query_valid, order, k, box, tuning)


def _search(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, query_valid: jax.Array,
            order: jax.Array, k: int, box: jax.Array | None,
            tuning: KnnTuning | None) -> tuple[jax.Array, jax.Array, Steps]:
    """The search of :func:`local_knn`, with its :class:`Steps`."""
    dim = pos.shape[1]
    m = query_pos.shape[0]
    size = sizes(resolve(tuning, "local_knn"), dim, k, m, pos.shape[0])
    domain = open_domain(pos, data_valid) if box is None else periodic_domain(box.astype(pos.dtype))
    pos = wrap(pos, domain)
    query_pos = wrap(query_pos, domain)
    count = jnp.sum(data_valid, dtype=jnp.int32)
    full_pass = functools.partial(grid_pass, k=k, block=size.block, capacity=size.capacity, batch=size.batch,
                                  search=size.search, slot_search=size.slot_search)

    grid0 = make_grid(domain, count, size.per_cell, jnp.int32(0))
    data0 = sort_data(pos, data_valid, domain, grid0)
    first = full_pass(data0, query_pos, query_valid, domain, grid0, 1)
    subset = min(m, max(size.later_queries, m // 16))

    def many_left(state: _AdaptState) -> jax.Array:
        return (state.passes < size.max_passes) & (jnp.sum(state.active) > subset)

    def adapt(state: _AdaptState) -> _AdaptState:
        # Many uncertified queries (clustered data): a full pass on a grid refined four-fold where most failures
        # are overflowing candidate runs (dense clumps), else coarsened (voids).
        active = state.active
        finer = 2 * jnp.sum(active & state.truncated) >= jnp.sum(active)
        level = jnp.where(finer, state.finest + 2, state.coarsest - 1)
        grid = make_grid(domain, count, size.per_cell, level)
        res = full_pass(sort_data(pos, data_valid, domain, grid), query_pos, active, domain, grid, 1,
                        into=(state.dist2, state.rows))
        return _AdaptState(state.passes + 1, jnp.maximum(state.finest, level), jnp.minimum(state.coarsest, level),
                           active & ~res.certified, jnp.where(active, res.truncated, state.truncated), res.dist2,
                           res.rows, state.steps + 1 + res.steps)

    zero = jnp.int32(0)
    state = _AdaptState(zero, zero, zero, query_valid & ~first.certified, first.truncated, first.dist2, first.rows,
                        zero)
    adapted = lax.while_loop(many_left, adapt, vary_like(state, query_pos))

    def sweep_left(state: _SweepState) -> jax.Array:
        return ((state.passes < 3 * size.max_passes) & jnp.any(state.active) & (state.level <= state.finest + 3))

    def sweep(state: _SweepState) -> _SweepState:
        # Few queries left: compacted passes searching two cells wide (a density window of about 50 per query),
        # sweeping from coarse grids to the finest used so far in two-fold steps, so every query meets a grid
        # that suits it; a level repeats until it has tried every active query.
        level = state.level
        grid = make_grid(domain, count, size.per_cell, level)
        data = lax.cond(level == 0, lambda: vary_like(data0, query_pos),
                        lambda: vary_like(sort_data(pos, data_valid, domain, grid), query_pos))
        picked = positions_of(state.active & ~state.tried, subset, m)
        sub = jnp.minimum(picked, m - 1)
        res = grid_pass(data, query_pos[sub], picked < m, domain, grid, 2, k=k, block=size.block,
                        capacity=size.later_capacity, batch=size.later_batch, search=size.search,
                        slot_search=size.slot_search)
        done = jnp.where((picked < m) & res.certified, picked, m)
        active = state.active.at[done].set(False, mode="drop")
        tried = state.tried.at[picked].set(True, mode="drop")
        level_done = ~jnp.any(active & ~tried)
        return _SweepState(state.passes + 1, jnp.where(level_done, level + 1, level), state.finest, state.coarsest,
                           active, tried & ~level_done, state.dist2.at[done].set(res.dist2, mode="drop"),
                           state.rows.at[done].set(res.rows, mode="drop"), state.steps + 1 + res.steps)

    start = jnp.where(adapted.finest == 0, 0, jnp.maximum(adapted.coarsest - 1, -3))
    state = _SweepState(zero, start, adapted.finest, adapted.coarsest, adapted.active,
                        jnp.zeros_like(adapted.active), adapted.dist2, adapted.rows, zero)
    swept = lax.while_loop(sweep_left, sweep, vary_like(state, query_pos))
    dist2, rows, brute_steps = _brute_force(pos, data_valid, order, query_pos, swept.active, domain, swept.dist2,
                                            swept.rows, k, size)
    dist2, rows = _order_ties(dist2, rows, order)
    found = query_valid[:, None] & jnp.isfinite(dist2)
    return (jnp.where(found, dist2, jnp.inf), jnp.where(found, rows, -1),
            Steps(first.steps, adapted.steps, swept.steps, brute_steps))


@functools.partial(jax.jit, static_argnames=("k", "tuning"))
def kth_distance_bound(pos: jax.Array, data_valid: jax.Array, k: int, box: jax.Array | None,
                       tuning: KnnTuning | None = None) -> jax.Array:
    """An upper bound `(n,)` on each valid row's squared k-th neighbour distance among the valid rows.

    One first-grid pass: any k real candidates bound the k-th distance from above, certified or not (``inf``
    where a row saw fewer than k candidates).
    """
    size = sizes(resolve(tuning, "kth_distance_bound"), pos.shape[1], k, pos.shape[0], pos.shape[0])
    domain = open_domain(pos, data_valid) if box is None else periodic_domain(box.astype(pos.dtype))
    pos = wrap(pos, domain)
    grid = make_grid(domain, jnp.sum(data_valid, dtype=jnp.int32), size.per_cell, jnp.int32(0))
    res = grid_pass(sort_data(pos, data_valid, domain, grid), pos, data_valid, domain, grid, 1, k=k,
                    block=size.block, capacity=size.capacity, batch=size.batch, search=size.search,
                    slot_search=size.slot_search)
    return jnp.where(data_valid, res.dist2[:, k - 1], jnp.inf)


def _brute_force(pos: jax.Array, data_valid: jax.Array, order: jax.Array, query_pos: jax.Array,
                 active: jax.Array, domain: Domain, dist2: jax.Array, rows: jax.Array, k: int,
                 size: Sizes) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Replace the results of the ``active`` queries by a scan over all data in ``order``; also the steps run."""
    n, dim = pos.shape
    m = query_pos.shape[0]
    tile, chunk = min(size.brute_tile, n), min(size.brute_queries, m)
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
            # The tile's own best first (the earlier row of equal distances), then merged behind the best so far.
            d2 = pair_dist2(qp, tiles_pos[t], domain)
            neg, pick = lax.top_k(-jnp.where(tiles_valid[t][None, :], d2, jnp.inf), min(k, tile))
            both_d2 = jnp.concatenate([best[0], -neg], axis=1)
            both_rows = jnp.concatenate([best[1], tiles_row[t][pick]], axis=1)
            neg, pick = lax.top_k(-both_d2, k)
            return -neg, jnp.take_along_axis(both_rows, pick, axis=1)

        init = (jnp.full((chunk, k), jnp.inf, pos.dtype), jnp.zeros((chunk, k), jnp.int32))
        best_d2, best_rows = lax.fori_loop(0, num_tiles, scan_tile, vary_like(init, qp))
        return out[0].at[qi].set(best_d2, mode="drop"), out[1].at[qi].set(best_rows, mode="drop")

    num_chunks = (num_active + chunk - 1) // chunk
    dist2, rows = lax.fori_loop(0, num_chunks, run_chunk, vary_like((dist2, rows), query_pos))
    return dist2, rows, num_chunks * (1 + num_tiles)


def _order_ties(dist2: jax.Array, rows: jax.Array, order: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Order equal distances within each result row by ``order`` (only when some row has a tie)."""

    def resort(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        d2, r = args
        d2, _, r = lax.sort((d2, order[jnp.maximum(r, 0)], r), dimension=1, num_keys=2)
        return d2, r

    tied = jnp.any((dist2[:, 1:] == dist2[:, :-1]) & jnp.isfinite(dist2[:, 1:]))
    return lax.cond(tied, resort, lambda args: args, (dist2, rows))

"""Exact local k-nearest neighbours: certified grid passes, then brute force for what no grid certified.

The first pass uses a grid of a few points per cell and small candidate tiles, sized for near-uniform data; it
certifies almost every query. Later passes take only the remaining queries, on grids refined where candidate runs
overflowed (dense regions) or coarsened where the k-th neighbour lay beyond the searched cells (sparse regions), with
larger tiles; the compacted ones also certify queries tied at their k-th neighbour, breaking the tie by index.
Whatever is still uncertified (e.g. more exact copies of a point than a pass has candidate slots) is answered by
brute force against all data, in index order, so ties always go to the smaller index.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core import vary_like
from ._grid import Domain, Grid, make_grid, open_domain, periodic_domain, wrap
from ._knn_pass import PassResult, SortedData, grid_pass, pair_dist2, positions_of, sort_data
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
    """The loop carry of the adaptive full passes."""

    passes: jax.Array  # full passes run
    finest: jax.Array  # finest and coarsest grid level used so far
    coarsest: jax.Array
    active: jax.Array  # (m,) queries still uncertified
    truncated: jax.Array  # (m,) whether a query's last failure was an overflowing candidate run
    dist2: jax.Array  # (m, k)
    rows: jax.Array  # (m, k)
    steps: jax.Array


class _SweepState(NamedTuple):
    """The loop carry of the compacted level sweep."""

    passes: jax.Array  # compacted passes run
    level: jax.Array  # the grid level of this pass
    finest: jax.Array
    coarsest: jax.Array
    active: jax.Array  # (m,) queries still uncertified
    tried: jax.Array  # (m,) queries this level has already tried
    dist2: jax.Array  # (m, k)
    rows: jax.Array  # (m, k)
    steps: jax.Array


class PieceGrid(NamedTuple):
    """A device's piece of a periodic box, gridded open on the axes where it need not wrap (see
    :func:`~shardax.spatial._grid.unwrapped_piece`): the grid's ``lo``, ``extent`` and ``wrap`` `(d,)`, and the
    data's and queries' positions on it, `(n, d)` and `(m, d)` (distances stay minimum-image in the positions)."""

    lo: jax.Array
    extent: jax.Array
    wrap: jax.Array
    grid_pos: jax.Array
    query_grid_pos: jax.Array


class _Problem(NamedTuple):
    """What every pass of one search reads: the data and queries wrapped into the domain (and their positions on
    the grid, where they differ), the data sorted on the first grid, and the static sizes."""

    pos: jax.Array  # (n, d)
    data_valid: jax.Array  # (n,)
    query_pos: jax.Array  # (m, d)
    grid_pos: jax.Array | None  # (n, d)
    query_grid_pos: jax.Array | None  # (m, d)
    domain: Domain
    count: jax.Array  # valid data rows
    grid0: Grid  # the first grid (level 0)
    data0: SortedData  # the data sorted on it
    order: jax.Array  # (n,) tie-break rank of each data row
    k: int
    size: Sizes
    subset: int  # queries per compacted pass
    table: int  # cells of the grids of level <= 0 at most (the first pass looks its runs up in a table of them)


@functools.partial(jax.jit, static_argnames=("k", "tuning"))
def local_knn(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, query_valid: jax.Array,
              order: jax.Array, *, k: int, box: jax.Array | None, tuning: KnnTuning | None = None,
              piece: PieceGrid | None = None) -> tuple[jax.Array, jax.Array]:
    """Exact kNN of the valid query rows among the valid data rows.

    Args:
        pos: `(n, d)` data positions.
        data_valid: `(n,)` which data rows exist.
        query_pos: `(m, d)` query positions.
        query_valid: `(m,)` which query rows exist.
        order: `(n,)` int32 tie-break rank of each data row (its global index); equal distances are ordered by it.
        k: neighbours per query.
        box: `(d,)` periodic box, or None for open boundaries.
        tuning: the kernel's static sizes (None: the backend's preset). A small tuning sends small inputs through
            every phase (adaptive passes, compacted passes, brute-force tiles); results are identical for every
            tuning.
        piece: with a periodic ``box``, grid a device's piece of it (and its ghosts) instead of the whole box.

    Returns:
        ``(dist2, labels)``: `(m, k)` squared distances (ascending, ties by ``order``) and the neighbours'
        ``order`` values (their global indices: the passes write them in place of row numbers, so the results need
        no gather at the end); invalid query rows, and neighbours missing when fewer than ``k`` data rows exist,
        hold ``inf`` and ``-1``.
    """
    return _search(pos, data_valid, query_pos, query_valid, order, k=k, box=box, tuning=tuning, piece=piece)[:2]


@functools.partial(jax.jit, static_argnames=("k", "tuning"))
def local_knn_steps(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, query_valid: jax.Array,
                    order: jax.Array, *, k: int, box: jax.Array | None, tuning: KnnTuning | None = None,
                    piece: PieceGrid | None = None) -> tuple[jax.Array, jax.Array, Steps]:
    """:func:`local_knn` and the sequential loop :class:`Steps` it ran (a diagnostic for the tuning).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> pos = jax.random.uniform(jax.random.key(0), (1000, 3))
        >>> ok, ids = jnp.ones(1000, bool), jnp.arange(1000, dtype=jnp.int32)
        >>> d2, rows, steps = local_knn_steps(pos, ok, pos, ok, ids, k=4, box=jnp.ones(3),
        ...                                   tuning=KnnTuning(preset="gpu"))
        >>> rows[:3, 0].tolist(), int(steps.first)
        ([0, 1, 2], 1)
    """
    return _search(pos, data_valid, query_pos, query_valid, order, k=k, box=box, tuning=tuning, piece=piece)


def _search(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, query_valid: jax.Array,
            order: jax.Array, *, k: int, box: jax.Array | None, tuning: KnnTuning | None,
            piece: PieceGrid | None) -> tuple[jax.Array, jax.Array, Steps]:
    """The search of :func:`local_knn`, with its :class:`Steps`: a first grid pass, adaptive full passes, a
    compacted level sweep, brute force for the rest, and ties ordered by ``order``."""
    m = query_pos.shape[0]
    size = sizes(resolve(tuning, "local_knn"), pos.shape[1], k, m, pos.shape[0])
    problem = _prepare(pos, data_valid, query_pos, order, k=k, box=box, size=size, piece=piece)
    first = grid_pass(problem.data0, problem.query_pos, query_valid, domain=problem.domain, grid=problem.grid0,
                      reach=1, k=k, tiles=size.full, query_grid_pos=problem.query_grid_pos, labels=order)
    adapted = _adaptive_passes(problem, first, query_valid)
    swept = _level_sweep(problem, adapted)
    dist2, rows, brute_steps = _brute_force(problem, swept.active, into=(swept.dist2, swept.rows))
    dist2, rows = _order_ties(dist2, rows)
    found = query_valid[:, None] & jnp.isfinite(dist2)
    return (jnp.where(query_valid[:, None], dist2, jnp.inf), jnp.where(found, rows, -1),
            Steps(first.steps, adapted.steps, swept.steps, brute_steps))


def _domain(pos: jax.Array, data_valid: jax.Array, box: jax.Array | None, piece: PieceGrid | None = None) -> Domain:
    if piece is not None:
        if box is None:
            raise ValueError("a piece of a periodic box needs the box")
        box = box.astype(pos.dtype)
        return Domain(piece.lo.astype(pos.dtype), piece.extent.astype(pos.dtype), True, piece.wrap, box)
    return open_domain(pos, data_valid) if box is None else periodic_domain(box.astype(pos.dtype))


def _prepare(pos: jax.Array, data_valid: jax.Array, query_pos: jax.Array, order: jax.Array, *, k: int,
             box: jax.Array | None, size: Sizes, piece: PieceGrid | None = None) -> _Problem:
    """The domain, the wrapped positions and the data sorted on the first grid."""
    domain = _domain(pos, data_valid, box, piece)
    pos = wrap(pos, domain)
    query_pos = wrap(query_pos, domain)
    grid_pos, query_grid_pos = (None, None) if piece is None else (piece.grid_pos, piece.query_grid_pos)
    count = jnp.sum(data_valid, dtype=jnp.int32)
    table = table_cells(pos.shape[0], size.per_cell)
    grid0 = make_grid(domain, count, size.per_cell, jnp.int32(0), max_cells=table)
    data0 = sort_data(pos, data_valid, domain, grid0, grid_pos, max_cells=table)
    m = query_pos.shape[0]
    return _Problem(pos, data_valid, query_pos, grid_pos, query_grid_pos, domain, count, grid0, data0, order, k=k,
                    size=size, subset=min(m, max(size.later_queries, m // 16)), table=table)


def table_cells(n: int, per_cell: float) -> int:
    """Cells of the cell-start table of a first grid over ``n`` data rows (static): twice the cells the grid is
    sized for, so the floor of the cell counts never reaches it but in nearly flat domains (where
    :func:`~shardax.spatial._grid.make_grid` caps the grid to it)."""
    return max(64, 2 * int(n / per_cell) + 2)


def _adaptive_passes(problem: _Problem, first: PassResult, query_valid: jax.Array) -> _AdaptState:
    """Full passes on refined or coarsened grids while many queries are uncertified (up to ``max_passes``)."""
    zero = jnp.int32(0)
    state = _AdaptState(passes=zero, finest=zero, coarsest=zero, active=query_valid & ~first.certified,
                        truncated=first.truncated, dist2=first.dist2, rows=first.rows, steps=zero)
    return lax.while_loop(functools.partial(_many_left, problem), functools.partial(_adapt, problem),
                          vary_like(state, problem.query_pos))


def _many_left(problem: _Problem, state: _AdaptState) -> jax.Array:
    return (state.passes < problem.size.max_passes) & (jnp.sum(state.active) > problem.subset)


def _adapt(problem: _Problem, state: _AdaptState) -> _AdaptState:
    # Many uncertified queries (clustered data): a full pass on a grid refined four-fold where most failures are
    # overflowing candidate runs (dense clumps), else coarsened (voids).
    active = state.active
    finer = 2 * jnp.sum(active & state.truncated) >= jnp.sum(active)
    level = jnp.where(finer, state.finest + 2, state.coarsest - 1)
    grid = make_grid(problem.domain, problem.count, problem.size.per_cell, level, max_cells=problem.table)
    data = sort_data(problem.pos, problem.data_valid, problem.domain, grid, problem.grid_pos)
    res = grid_pass(data, problem.query_pos, active, domain=problem.domain, grid=grid, reach=1, k=problem.k,
                    tiles=problem.size.full, into=(state.dist2, state.rows), query_grid_pos=problem.query_grid_pos,
                    labels=problem.order)
    return _AdaptState(passes=state.passes + 1, finest=jnp.maximum(state.finest, level),
                       coarsest=jnp.minimum(state.coarsest, level), active=active & ~res.certified,
                       truncated=jnp.where(active, res.truncated, state.truncated), dist2=res.dist2, rows=res.rows,
                       steps=state.steps + 1 + res.steps)


def _level_sweep(problem: _Problem, adapted: _AdaptState) -> _SweepState:
    """Compacted passes over the queries still uncertified, sweeping the grid levels from coarse to fine."""
    zero = jnp.int32(0)
    start = jnp.where(adapted.finest == 0, 0, jnp.maximum(adapted.coarsest - 1, -3))
    state = _SweepState(passes=zero, level=start, finest=adapted.finest, coarsest=adapted.coarsest,
                        active=adapted.active, tried=jnp.zeros_like(adapted.active), dist2=adapted.dist2,
                        rows=adapted.rows, steps=zero)
    return lax.while_loop(functools.partial(_sweep_left, problem), functools.partial(_sweep, problem),
                          vary_like(state, problem.query_pos))


def _sweep_left(problem: _Problem, state: _SweepState) -> jax.Array:
    return ((state.passes < 3 * problem.size.max_passes) & jnp.any(state.active)
            & (state.level <= state.finest + 3))


def _sweep(problem: _Problem, state: _SweepState) -> _SweepState:
    # Few queries left: compacted passes searching two cells wide (a density window of about 50 per query),
    # sweeping from coarse grids to the finest used so far in two-fold steps, so every query meets a grid that
    # suits it; a level repeats until it has tried every active query.
    m = problem.query_pos.shape[0]
    level = state.level
    grid = make_grid(problem.domain, problem.count, problem.size.per_cell, level, max_cells=problem.table)
    data = lax.cond(level == 0, lambda: vary_like(problem.data0._replace(starts=None), problem.query_pos),
                    lambda: vary_like(sort_data(problem.pos, problem.data_valid, problem.domain, grid,
                                                problem.grid_pos), problem.query_pos))
    picked = positions_of(state.active & ~state.tried, problem.subset, m)
    sub = jnp.minimum(picked, m - 1)
    res = grid_pass(data, problem.query_pos[sub], picked < m, domain=problem.domain, grid=grid, reach=2,
                    k=problem.k, tiles=problem.size.compacted, order=problem.order,
                    query_grid_pos=None if problem.query_grid_pos is None else problem.query_grid_pos[sub],
                    labels=problem.order)
    done = jnp.where((picked < m) & res.certified, picked, m)
    active = state.active.at[done].set(False, mode="drop")
    tried = state.tried.at[picked].set(True, mode="drop")
    level_done = ~jnp.any(active & ~tried)
    return _SweepState(passes=state.passes + 1, level=jnp.where(level_done, level + 1, level), finest=state.finest,
                       coarsest=state.coarsest, active=active, tried=tried & ~level_done,
                       dist2=state.dist2.at[done].set(res.dist2, mode="drop"),
                       rows=state.rows.at[done].set(res.rows, mode="drop"), steps=state.steps + 1 + res.steps)


@functools.partial(jax.jit, static_argnames=("k", "tuning"))
def kth_distance_bound(pos: jax.Array, data_valid: jax.Array, *, k: int, box: jax.Array | None,
                       tuning: KnnTuning | None = None, piece: PieceGrid | None = None) -> jax.Array:
    """An upper bound `(n,)` on each valid row's squared k-th neighbour distance among the valid rows.

    One first-grid pass: any k real candidates bound the k-th distance from above, certified or not (``inf``
    where a row saw fewer than k candidates). ``piece``: as :func:`local_knn`'s (the rows are their own queries).
    """
    size = sizes(resolve(tuning, "kth_distance_bound"), pos.shape[1], k, pos.shape[0], pos.shape[0])
    domain = _domain(pos, data_valid, box, piece)
    pos = wrap(pos, domain)
    grid_pos = None if piece is None else piece.grid_pos
    table = table_cells(pos.shape[0], size.per_cell)
    grid = make_grid(domain, jnp.sum(data_valid, dtype=jnp.int32), size.per_cell, jnp.int32(0), max_cells=table)
    res = grid_pass(sort_data(pos, data_valid, domain, grid, grid_pos, max_cells=table), pos, data_valid,
                    domain=domain, grid=grid, reach=1, k=k, tiles=size.full, query_grid_pos=grid_pos)
    return jnp.where(data_valid, res.dist2[:, k - 1], jnp.inf)


class _Best(NamedTuple):
    """The brute force's loop carry: squared distances and the neighbours' labels `(queries, k)`."""

    dist2: jax.Array
    rows: jax.Array


class _DataTiles(NamedTuple):
    """The data in tie-break order, cut into brute-force tiles: positions `(tiles, tile, d)`, valid `(tiles, tile)`,
    the rows' ``order`` labels `(tiles, tile)`."""

    pos: jax.Array
    valid: jax.Array
    rows: jax.Array


# Queries of the brute force's small chunk: when no more are left (e.g. a few queries on a point with many exact
# copies), the brute force scans the data for that many queries instead of a whole chunk, in larger tiles.
_BRUTE_FEW = 8


def _brute_force(problem: _Problem, active: jax.Array, *,
                 into: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Replace the results ``into`` of the ``active`` queries by a scan over all data in tie-break order, in chunks of
    ``brute_queries`` queries against tiles of ``brute_tile`` rows (at most ``_BRUTE_FEW`` active queries: one
    chunk of that many, against tiles as much larger); also the steps run.

    The results never pass through a conditional (XLA gives a conditional's outputs buffers of their own, so an
    ``(m, k)`` result carried through one is copied: 72 bytes per query at k = 9): a conditional prepares the data
    in tie-break order only when a query is left, and the chunks run in loops whose trip counts are 0 otherwise."""
    n, dim = problem.pos.shape
    m = problem.query_pos.shape[0]
    tile, chunk = min(problem.size.brute_tile, n), min(problem.size.brute_queries, m)
    num_active = jnp.sum(active, dtype=jnp.int32)
    few = min(chunk, _BRUTE_FEW)
    # The few-query chunk's tiles: as much larger as the chunk is smaller, a whole number of the other tiles.
    few_tile = tile if few == chunk else min(tile * (chunk // few), -(-n // tile) * tile)
    length = -(-n // few_tile) * few_tile  # rows of both tilings (a multiple of either tile)

    def prepare() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        by_order = _tie_break_order(problem)
        pad = length - n
        return vary_like((jnp.pad(positions_of(active, m, m), (0, chunk), constant_values=m),
                          jnp.pad(problem.pos[by_order], ((0, pad), (0, 0))),
                          jnp.pad(problem.data_valid[by_order], (0, pad)),
                          jnp.pad(problem.order[by_order], (0, pad))), problem.query_pos)

    def skip() -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return vary_like((jnp.full((m + chunk,), m, jnp.int32), jnp.zeros((length, dim), problem.pos.dtype),
                          jnp.zeros((length,), bool), jnp.zeros((length,), jnp.int32)), problem.query_pos)

    # Nothing left (uniform data, nearly always): no tie-break sort of the data, and no chunk runs.
    todo, pos, valid, rows = lax.cond(num_active > 0, prepare, skip)

    def scan(chunk: int, tile: int, trips: jax.Array, out: _Best) -> tuple[_Best, jax.Array]:
        num_tiles = length // tile
        tiles = _DataTiles(pos.reshape(num_tiles, tile, dim), valid.reshape(num_tiles, tile),
                           rows.reshape(num_tiles, tile))

        def run_chunk(c: jax.Array, out: _Best) -> _Best:
            qi = lax.dynamic_slice_in_dim(todo, c * chunk, chunk)
            qp = problem.query_pos[jnp.minimum(qi, m - 1)]
            best = _Best(jnp.full((chunk, problem.k), jnp.inf, problem.pos.dtype),
                         jnp.zeros((chunk, problem.k), jnp.int32))
            best = lax.fori_loop(0, num_tiles, functools.partial(_scan_tile, tiles, qp, problem.domain, problem.k),
                                 vary_like(best, qp))
            return _Best(out.dist2.at[qi].set(best.dist2, mode="drop"),
                         out.rows.at[qi].set(best.rows, mode="drop"))

        return lax.fori_loop(0, trips, run_chunk, out), trips * (1 + num_tiles)

    out = vary_like(_Best(*into), problem.query_pos)
    if few == chunk:
        out, steps = scan(chunk, tile, (num_active + chunk - 1) // chunk, out)
    else:
        out, few_steps = scan(few, few_tile, ((num_active > 0) & (num_active <= few)).astype(jnp.int32), out)
        out, chunk_steps = scan(chunk, tile, jnp.where(num_active > few, (num_active + chunk - 1) // chunk, 0), out)
        steps = few_steps + chunk_steps
    return out.dist2, out.rows, steps


def _tie_break_order(problem: _Problem) -> jax.Array:
    """The data rows in tie-break order, invalid rows last."""
    n = problem.pos.shape[0]
    # Data in tie-break order: top_k keeps the earlier of equal values, and the kept best come first.
    _, by_order = lax.sort((jnp.where(problem.data_valid, problem.order, jnp.iinfo(jnp.int32).max),
                            jnp.arange(n, dtype=jnp.int32)), num_keys=1, is_stable=True)
    return by_order


def _scan_tile(tiles: _DataTiles, qp: jax.Array, domain: Domain, k: int, t: jax.Array, best: _Best) -> _Best:
    # The tile's own best first (the earlier row of equal distances), then merged behind the best so far.
    tile = tiles.pos.shape[1]
    d2 = pair_dist2(qp, tiles.pos[t], domain)
    neg, pick = lax.top_k(-jnp.where(tiles.valid[t][None, :], d2, jnp.inf), min(k, tile))
    both_d2 = jnp.concatenate([best.dist2, -neg], axis=1)
    both_rows = jnp.concatenate([best.rows, tiles.rows[t][pick]], axis=1)
    neg, pick = lax.top_k(-both_d2, k)
    return _Best(-neg, jnp.take_along_axis(both_rows, pick, axis=1))


def _order_ties(dist2: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Order equal distances within each result row by label: only the rows with a tie are sorted, in chunks of
    ``max(1024, m / 16)`` rows (a loop of no step when no row has one; no conditional carries the results)."""
    m = dist2.shape[0]
    tied = jnp.any((dist2[:, 1:] == dist2[:, :-1]) & jnp.isfinite(dist2[:, 1:]), axis=1)
    count = jnp.sum(tied, dtype=jnp.int32)
    few = min(m, max(1024, m // 16))

    def chunk(c: jax.Array, args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        d2, r = args
        rank = jnp.cumsum(tied, dtype=jnp.int32) - 1
        which = positions_of(tied & (rank // few == c), few, m)
        at = jnp.minimum(which, m - 1)
        sub_d2, sub_r = lax.sort((d2[at], r[at]), dimension=1, num_keys=2)
        return d2.at[which].set(sub_d2, mode="drop"), r.at[which].set(sub_r, mode="drop")

    return lax.fori_loop(0, (count + few - 1) // few, chunk, (dist2, rows))

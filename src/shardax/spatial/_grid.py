"""Cell grids for neighbour search: geometry, cell keys and certified search margins.

A grid divides the search domain into ``g[i]`` cells along each axis. Points are ordered by a row-major cell key
whose fastest axis is axis 0 ("x"), so the cells ``[xa, xb]`` of one row (fixed cell coordinates on the other axes)
are one contiguous run of the sorted points. Grids of several refinement levels share one domain; a level's cell
counts are traced values, so every level runs the same compiled code.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Cell keys are int32: the product of the cell counts must stay below 2**31.
MAX_CELLS_PER_AXIS = {1: 2**30, 2: 2**15 - 1, 3: 2**10 - 1}
SENTINEL_KEY = np.int32(2**31 - 1)


class Domain(NamedTuple):
    """The region covered by the grids: lower corner, extent and periodicity (traced per-axis arrays).

    ``periodic`` (static) says whether distances are periodic. With ``wrap`` (`(d,)` traced bool) and ``box``
    (`(d,)`) the grid may cover less than the periodic box: on the axes marked in ``wrap`` it covers the whole box
    (``lo = 0``, ``extent = box``), elsewhere ``[lo, lo + extent)`` of positions unwrapped next to a device's piece
    (see :func:`unwrapped_piece`), while distances stay minimum-image in ``box`` on every axis. Without them a
    periodic domain is the whole box (``extent``) on every axis.
    """

    lo: jax.Array  # (d,)
    extent: jax.Array  # (d,)
    periodic: bool
    wrap: jax.Array | None = None  # (d,) bool
    box: jax.Array | None = None  # (d,)

    @property
    def metric_box(self) -> jax.Array:
        """The periodic box of the distances (``periodic`` domains only)."""
        return self.extent if self.box is None else self.box

    def wraps(self, axis: int) -> jax.Array | bool:
        """Whether the grid is periodic along ``axis`` (static where it can be)."""
        if not self.periodic:
            return False
        return True if self.wrap is None else self.wrap[axis]


class Grid(NamedTuple):
    """One refinement level: cell counts, cell sizes and key strides per axis (traced)."""

    cells: jax.Array  # (d,) int32
    size: jax.Array  # (d,) float
    stride: jax.Array  # (d,) int32


def open_domain(pos: jax.Array, valid: jax.Array) -> Domain:
    """The bounding box of the valid rows of ``pos`` (`(n, d)`), slightly enlarged so every point is inside.

    The box stays finite: where the points span more than the largest float (coordinates of both signs near it),
    ``lo`` and ``extent`` are clamped to it, and :func:`cell_coords` clips the points past the far edge into the
    last cell (cells are then far wider than any linking length, so no neighbour is missed).
    """
    big = jnp.asarray(jnp.finfo(pos.dtype).max, pos.dtype)
    lo = jnp.min(jnp.where(valid[:, None], pos, big), axis=0)
    hi = jnp.max(jnp.where(valid[:, None], pos, -big), axis=0)
    lo = jnp.where(hi >= lo, lo, jnp.zeros_like(lo))
    hi = jnp.where(hi >= lo, hi, jnp.ones_like(hi))
    span = jnp.minimum(hi - lo, big)  # hi - lo overflows to inf for coordinates of both signs near the maximum
    pad = jnp.maximum(span, jnp.max(span)) * jnp.asarray(1e-5, pos.dtype) + jnp.asarray(1e-30, pos.dtype)
    return Domain(jnp.maximum(lo - pad, -big), jnp.minimum(span + 2 * pad, big), periodic=False)


def periodic_domain(box: jax.Array) -> Domain:
    """The periodic box ``[0, box)`` (`box: (d,)`)."""
    return Domain(jnp.zeros_like(box), box, periodic=True)


def wrap(pos: jax.Array, domain: Domain) -> jax.Array:
    """Positions mapped into the periodic box (identity for an open domain)."""
    if not domain.periodic:
        return pos
    box = domain.metric_box[None, :]
    # An exact remainder: ``pos - box * floor(pos / box)`` overflows to -inf once ``pos / box`` does (|pos| near the
    # float32 maximum and a box below 1).
    rel = jnp.mod(pos, box)
    return jnp.where(rel >= box, rel - box, rel)  # mod of a tiny negative can round up to box


def make_grid(domain: Domain, num: jax.Array, per_cell: float, level: jax.Array,
              max_cells: int | None = None) -> Grid:
    """The grid of refinement ``level`` (0: about ``per_cell`` of ``num`` points per cell; +1 halves the cell volume).

    ``max_cells`` (static) caps the total cell count of the grids of ``level <= 0``, so a table of that many cells
    covers them (see :func:`cell_starts`): it binds only where the domain is nearly flat along an axis, whose cell
    count the floor of one cell per axis would otherwise inflate. Each axis in turn keeps at most what the cap
    leaves it; any grid gives the same answers.
    """
    dim = domain.extent.shape[0]
    ext = jnp.maximum(domain.extent, jnp.max(domain.extent) * 1e-6)
    volume = jnp.prod(ext.astype(jnp.float32))
    side = (volume * per_cell / jnp.maximum(num, 1).astype(jnp.float32)) ** (1.0 / dim)
    side = side * jnp.exp2(-level.astype(jnp.float32) / 3)
    cells = jnp.clip(jnp.floor(ext.astype(jnp.float32) / side), 1, MAX_CELLS_PER_AXIS[dim]).astype(jnp.int32)
    if max_cells is not None:
        capped, room = [], jnp.int32(max_cells)
        for axis in range(dim):
            c = jnp.where(level <= 0, jnp.clip(cells[axis], 1, jnp.maximum(room, 1)), cells[axis])
            capped.append(c)
            room = room // c
        cells = jnp.stack(capped)
    stride = jnp.concatenate([jnp.ones((1,), jnp.int32), jnp.cumprod(cells, dtype=jnp.int32)[:-1]])
    return Grid(cells, (domain.extent / cells.astype(domain.extent.dtype)), stride)


def cell_starts(keys: jax.Array, table_cells: int, num: jax.Array) -> jax.Array:
    """The cell-start table `(table_cells + 1,)` int32 of ``keys`` `(n,)` sorted ascending, whose ``num`` valid rows
    come first (the others hold a key of at least ``table_cells``): entry ``c`` is the first row at or after key
    ``c`` (``jnp.searchsorted(keys, c)`` for ``c`` up to the last valid key, ``num`` past it), so the rows of the
    cells ``[a, b]`` are ``starts[a] : starts[b + 1]``: one gather instead of a binary search per run.

    Each cell's first row is written once by the row that opens it (distinct addresses: no atomics, nothing that
    serialises on a GPU), and a reverse running minimum gives the empty cells the start of the next occupied one.
    """
    n = keys.shape[0]
    opens = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]]) & (keys < table_cells)
    first = jnp.full((table_cells + 1,), num, jnp.int32)
    first = first.at[jnp.where(opens, keys, table_cells + 1)].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return lax.cummin(first, reverse=True)


def cell_coords(pos: jax.Array, domain: Domain, grid: Grid) -> jax.Array:
    """Integer cell coordinates `(n, d)` of positions `(n, d)` (clipped into the grid)."""
    # Clipped before the conversion: a point past a clamped open domain's edge (see :func:`open_domain`) is at an
    # infinite cell coordinate, whose conversion to an integer is not defined on every backend.
    c = jnp.floor((pos - domain.lo[None, :]) / grid.size[None, :])
    return jnp.clip(c, 0, (grid.cells[None, :] - 1).astype(c.dtype)).astype(jnp.int32)


def cell_keys(coords: jax.Array, grid: Grid) -> jax.Array:
    """Row-major keys `(n,)` with axis 0 fastest."""
    return jnp.sum(coords * grid.stride[None, :], axis=-1, dtype=jnp.int32)


def axis_margin(x: jax.Array, first: jax.Array, last: jax.Array, axis: int, domain: Domain,
                grid: Grid) -> jax.Array:
    """Distance from coordinate ``x`` to the outside of the searched cells ``[first, last]`` along ``axis``.

    Cells beyond an open domain's edge hold no points, and a periodic axis searched over its whole length has no
    outside, so those sides count as infinitely far. The margin is shrunk by a few rounding errors of the cell
    assignment, so a certified search never misses a point that rounding put into a neighbouring cell.
    """
    g = grid.cells[axis]
    h = grid.size[axis]
    lo = domain.lo[axis]
    inf = jnp.asarray(jnp.inf, x.dtype)
    lower = lo + first.astype(x.dtype) * h
    upper = lo + (last + 1).astype(x.dtype) * h
    wraps = domain.wraps(axis)
    full = last - first + 1 >= g
    edge_lo, edge_hi = first <= 0, last >= g - 1
    if wraps is True:
        edge_lo, edge_hi = full, full
    elif wraps is not False:  # traced: periodic on some devices' grids, open on others'
        edge_lo = jnp.where(wraps, full, edge_lo)
        edge_hi = jnp.where(wraps, full, edge_hi)
    lower = jnp.where(edge_lo, -inf, lower)
    upper = jnp.where(edge_hi, inf, upper)
    reach = jnp.abs(lo) + domain.extent[axis]
    if domain.box is not None:
        reach = reach + domain.box[axis]  # grid coordinates unwrapped by a box: one more rounding of that size
    slack = 16 * jnp.finfo(x.dtype).eps * reach
    return jnp.minimum(x - lower, upper - x) - slack


def _widest_gap_middle(lower: jax.Array, upper: jax.Array, occupied: jax.Array, box: jax.Array) -> jax.Array:
    """Per axis, the middle of the widest circular gap between the intervals ``[lower, upper]`` `(m, d)` of the
    occupied rows `(m,)` in ``[0, box)``."""
    big = jnp.asarray(jnp.inf, lower.dtype)
    # Each axis's intervals by their lower ends (one sort carrying the upper ends: a small program).
    lo, hi = lax.sort((jnp.where(occupied[:, None], lower, big), jnp.where(occupied[:, None], upper, -big)),
                      dimension=0, num_keys=1)
    hi = lax.cummax(hi, axis=0)
    if lo.shape[0] < 2:
        middle = hi[-1] + 0.5 * (lo[0] + box - hi[-1])
        middle = middle - box * jnp.floor(middle / box)
        return jnp.where(jnp.isfinite(middle), middle, jnp.zeros_like(middle))
    live = occupied.sum() - 1 > jnp.arange(lo.shape[0] - 1)  # gap between sorted intervals i and i + 1
    inner = jnp.where(live[:, None], lo[1:] - hi[:-1], -big)
    around = lo[0] + box - hi[-1]  # across the box edge
    inner_best = jnp.max(inner, axis=0)
    best = jnp.arange(inner.shape[0])[:, None] == jnp.argmax(inner, axis=0)[None, :]
    middle_inner = 0.5 * (jnp.sum(jnp.where(best, hi[:-1], 0), axis=0) + jnp.sum(jnp.where(best, lo[1:], 0), axis=0))
    middle_around = hi[-1] + 0.5 * around
    middle = jnp.where(inner_best > around, middle_inner, middle_around)
    middle = middle - box * jnp.floor(middle / box)
    return jnp.where(jnp.isfinite(middle), middle, jnp.zeros_like(middle))


class Piece(NamedTuple):
    """A grid over one device's piece of a periodic box: the :class:`Domain` (``wrap`` and ``box`` set), the
    per-axis ``wrap`` `(d,)` and the positions to grid `(n, d)`."""

    domain: Domain
    wrap: jax.Array
    grid_pos: jax.Array


def unwrapped_piece(pos: jax.Array, valid: jax.Array, box: jax.Array, reach: jax.Array, lower: jax.Array,
                    upper: jax.Array, occupied: jax.Array) -> Piece:
    """An open grid over one device's piece of a periodic box (with its ghosts), periodic only where it must be.

    On each axis the positions `(n, d)` (in ``[0, box)``) are unwrapped across a cut in the widest gap between the
    piece's boxes ``[lower, upper]`` `(m, d)` (occupied rows `(m,)`), so a piece touching both ends of the box lies
    in one interval. Where the unwrapped points span less than ``box - reach`` (with a margin for rounding), two
    points within ``reach`` of each other (minimum image) are as close in unwrapped coordinates, so a search of
    that radius over their bounding box need not wrap; elsewhere the axis keeps the periodic grid over the whole
    box. Distances stay minimum-image in the given positions (the domain's ``box``).
    """
    cut = _widest_gap_middle(lower, upper, occupied, box)
    unwrapped = jnp.where(pos < cut[None, :], pos + box[None, :], pos)
    bounds = open_domain(unwrapped, valid)
    slack = 1e-3 * reach + 16 * jnp.finfo(pos.dtype).eps * box
    wrap = ~(bounds.extent <= box - reach - slack)  # an infinite or NaN reach wraps
    lo = jnp.where(wrap, jnp.zeros_like(bounds.lo), bounds.lo)
    extent = jnp.where(wrap, box, bounds.extent)
    return Piece(Domain(lo, extent, True, wrap, box), wrap, jnp.where(wrap[None, :], pos, unwrapped))

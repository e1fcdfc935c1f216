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

# Cell keys are int32: the product of the cell counts must stay below 2**31.
MAX_CELLS_PER_AXIS = {1: 2**30, 2: 2**15 - 1, 3: 2**10 - 1}
SENTINEL_KEY = np.int32(2**31 - 1)


class Domain(NamedTuple):
    """The region covered by the grids: lower corner, extent and periodicity (traced per-axis arrays)."""

    lo: jax.Array  # (d,)
    extent: jax.Array  # (d,)
    periodic: bool


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
    box = domain.extent[None, :]
    # An exact remainder: ``pos - box * floor(pos / box)`` overflows to -inf once ``pos / box`` does (|pos| near the
    # float32 maximum and a box below 1).
    rel = jnp.mod(pos, box)
    return jnp.where(rel >= box, rel - box, rel)  # mod of a tiny negative can round up to box


def make_grid(domain: Domain, num: jax.Array, per_cell: float, level: jax.Array) -> Grid:
    """The grid of refinement ``level`` (0: about ``per_cell`` of ``num`` points per cell; +1 halves the cell volume)."""
    dim = domain.extent.shape[0]
    ext = jnp.maximum(domain.extent, jnp.max(domain.extent) * 1e-6)
    volume = jnp.prod(ext.astype(jnp.float32))
    side = (volume * per_cell / jnp.maximum(num, 1).astype(jnp.float32)) ** (1.0 / dim)
    side = side * jnp.exp2(-level.astype(jnp.float32) / 3)
    cells = jnp.clip(jnp.floor(ext.astype(jnp.float32) / side), 1, MAX_CELLS_PER_AXIS[dim]).astype(jnp.int32)
    stride = jnp.concatenate([jnp.ones((1,), jnp.int32), jnp.cumprod(cells, dtype=jnp.int32)[:-1]])
    return Grid(cells, (domain.extent / cells.astype(domain.extent.dtype)), stride)


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
    if domain.periodic:
        full = last - first + 1 >= g
        lower = jnp.where(full, -inf, lower)
        upper = jnp.where(full, inf, upper)
    else:
        lower = jnp.where(first <= 0, -inf, lower)
        upper = jnp.where(last >= g - 1, inf, upper)
    slack = 16 * jnp.finfo(x.dtype).eps * (jnp.abs(lo) + domain.extent[axis])
    return jnp.minimum(x - lower, upper - x) - slack

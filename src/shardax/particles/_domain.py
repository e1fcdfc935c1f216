"""The domain decomposition left by :func:`zsort`: which keys, rows and volume of space each device holds.

Everything in a :class:`Domain` is replicated: every device holds the description of every device, so a kernel
(kNN, FoF, painting) can decide locally which devices a search region touches, without communicating.

Top-level cells: each device's key range is cut at the Morton cells of one level (the finest level at which the
device's particles fall into at most ``num_cells`` cells); a cell is the contiguous run of the device's rows in one
such Morton cell, and its box is the tight bounding box of those particles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from .._flags import gather_together
from .._morton import INVALID_KEY, KEY_BITS_PER_DIM, Box, KeyBox, key_box, morton_key
from .._pytree import check_positions, particle_set
from .._tuning import tuning_backend
from ..core import distributed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Domain:
    """Per-device key ranges, row ranges and bounding boxes after a z-order sort (replicated on every device).

    ``ndev`` is the number of devices of the context (1 outside ``smap``), ``M = num_cells``, ``d`` the dimension.
    A Morton key is the pair of uint32 words ``(hi, lo)`` of :func:`morton_keys`, compared lexicographically.
    Empty devices have ``count 0``, ``first_key = (2**32-1, 2**32-1)``, ``last_key = (0, 0)`` and empty boxes
    (``lower = +inf``, ``upper = -inf``).

    Attributes:
        origin: `(d,)` lower corner of the key box.
        extent: `(d,)` edge lengths of the key box (the periodic box size when ``periodic``).
        counts: `(ndev,)` int32 particles held by each device.
        offsets: `(ndev,)` int32 global index (in the sorted order) of each device's first particle.
        first_key: `(ndev, 2)` uint32 smallest key on each device.
        last_key: `(ndev, 2)` uint32 largest key on each device (keys of device ``r`` lie in
            ``[first_key[r], last_key[r]]``; ranges of consecutive devices touch only where keys are duplicated).
        lower: `(ndev, d)` bounding-box lower corner of each device's particles.
        upper: `(ndev, d)` bounding-box upper corner.
        cell_level: `(ndev,)` int32 Morton level of each device's top-level cells (cells are ``extent / 2**level``
            wide).
        cell_start: `(ndev, M)` int32 first local row of each top-level cell (cells ``>= cell count`` are empty).
        cell_count: `(ndev, M)` int32 particles in each cell.
        cell_lower: `(ndev, M, d)` bounding-box lower corner of each cell's particles (``+inf`` if empty).
        cell_upper: `(ndev, M, d)` bounding-box upper corner (``-inf`` if empty).
        periodic: whether the key box is periodic (static).
    """

    origin: jax.Array
    extent: jax.Array
    counts: jax.Array
    offsets: jax.Array
    first_key: jax.Array
    last_key: jax.Array
    lower: jax.Array
    upper: jax.Array
    cell_level: jax.Array
    cell_start: jax.Array
    cell_count: jax.Array
    cell_lower: jax.Array
    cell_upper: jax.Array
    periodic: bool = dataclasses.field(default=False, metadata={"static": True})


def _clz64(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """Leading zero bits of the 64-bit words ``(hi, lo)`` (64 for zero)."""
    return jnp.where(hi != 0, lax.clz(hi), 32 + lax.clz(lo)).astype(jnp.int32)


def _cells(hi: jax.Array, lo: jax.Array, num: jax.Array, dim: int, num_cells: int
           ) -> tuple[jax.Array, jax.Array]:
    """Cell level and the `(n,)` cell index of each sorted row (``num_cells`` for padding rows)."""
    n = hi.shape[0]
    bits = KEY_BITS_PER_DIM[dim]
    rows = jnp.arange(n, dtype=jnp.int32)
    # Level at which rows i-1 and i fall into different cells: the common key prefix, in whole levels.
    prefix = _clz64(hi[1:] ^ hi[:-1], lo[1:] ^ lo[:-1]) - (64 - dim * bits)
    split = jnp.minimum(prefix // dim, bits)
    boundary = rows[1:] < num
    if tuning_backend() == "cpu":
        hist = jnp.zeros((bits + 2,), jnp.int32).at[jnp.where(boundary, split, bits + 1)].add(1)[:bits]
    else:  # a GPU would serialise n adds onto ~20 addresses: every level counts its boundaries in one fused pass
        levels = jnp.arange(bits, dtype=split.dtype)
        hist = jnp.sum(boundary[:, None] & (split[:, None] == levels[None, :]), axis=0, dtype=jnp.int32)
    # Cells at level l = 1 + boundaries that split above l; take the finest level with at most num_cells cells.
    cells_at = 1 + jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(hist)])
    level = jnp.sum(cells_at <= num_cells).astype(jnp.int32) - 1
    new = jnp.concatenate([jnp.zeros((1,), bool), boundary & (split < level)])
    index = jnp.cumsum(new.astype(jnp.int32))
    return level, jnp.where(rows < num, index, num_cells)


def _cell_stats(pos: jax.Array, cell: jax.Array, num: jax.Array, num_cells: int
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """First row, row count and per-axis bounds of each of ``num_cells`` cells of rows sorted by ``cell``
    (padding rows: ``num_cells``); an empty cell starts at ``num`` and has bounds ``(inf, -inf)``.

    XLA:CPU adds the rows into their cells one after another. A GPU would serialise those adds (about n / num_cells
    per address), so there the starts are counts of the rows in earlier cells (one fused compare-and-sum) and the
    bounds a segmented min/max scan of the sorted rows, read at each cell's last row.
    """
    n = pos.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    if tuning_backend() == "cpu":
        segments = num_cells + 1
        lower = jax.ops.segment_min(pos, cell, segments, indices_are_sorted=True)[:num_cells]
        upper = jax.ops.segment_max(pos, cell, segments, indices_are_sorted=True)[:num_cells]
        count = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), cell, segments, indices_are_sorted=True)[:num_cells]
        start = jax.ops.segment_min(rows, cell, segments, indices_are_sorted=True)[:num_cells]
        return jnp.where(count > 0, start, num), count, lower, upper
    edges = jnp.arange(num_cells + 1, dtype=cell.dtype)
    before = jnp.sum(cell[:, None] < edges[None, :], axis=0, dtype=jnp.int32)  # rows in cells below each edge
    count = before[1:] - before[:-1]
    opens = ((rows == 0) | (cell != jnp.roll(cell, 1)))[:, None]  # the first row of each run of a cell

    def scan(op: Any) -> jax.Array:
        def combine(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            return a[0] | b[0], jnp.where(b[0], b[1], op(a[1], b[1]))
        return lax.associative_scan(combine, (jnp.broadcast_to(opens, pos.shape), pos))[1]

    last = jnp.clip(before[1:] - 1, 0, max(n - 1, 0))
    has = (count > 0)[:, None]
    lower = jnp.where(has, scan(jnp.minimum)[last], jnp.asarray(jnp.inf, pos.dtype))
    upper = jnp.where(has, scan(jnp.maximum)[last], jnp.asarray(-jnp.inf, pos.dtype))
    return jnp.where(count > 0, before[:-1], num), count, lower, upper


def domain_of(part: Any, kbox: KeyBox, num_cells: int) -> Domain:
    """The :class:`Domain` of z-sorted particles whose keys were computed over ``kbox``."""
    if not isinstance(num_cells, int) or isinstance(num_cells, bool) or num_cells < 1:
        raise ValueError(f"num_cells must be a positive Python int (top-level cells per device), got {num_cells!r}")
    n, dim = check_positions(part, "domain")
    pos = jnp.asarray(part.pos)
    num = jnp.clip(jnp.asarray(part.num, jnp.int32), 0, n)
    rows = jnp.arange(n, dtype=jnp.int32)
    valid = rows < num
    hi, lo = morton_key(pos, kbox, valid)
    level, cell = _cells(hi, lo, num, dim, num_cells)
    big = jnp.asarray(jnp.inf, pos.dtype)
    inside = valid[:, None]
    lower = jnp.min(jnp.where(inside, pos, big), axis=0)
    upper = jnp.max(jnp.where(inside, pos, -big), axis=0)
    cell_start, cell_count, cell_lower, cell_upper = _cell_stats(pos, cell, num, num_cells)
    last = jnp.maximum(num - 1, 0)
    empty = num == 0
    first_key = jnp.where(empty, jnp.uint32(INVALID_KEY), jnp.stack([hi[0], lo[0]]))
    last_key = jnp.where(empty, jnp.uint32(0), jnp.stack([hi[last], lo[last]]))
    # One all-gather for every field (each would be a collective of its own).
    (counts, first_key, last_key, lower, upper, level, cell_start, cell_count, cell_lower,
     cell_upper) = gather_together([num, first_key, last_key, lower, upper, level, cell_start, cell_count,
                                    cell_lower, cell_upper], deps=(part.pos,))
    return Domain(
        origin=kbox.origin, extent=kbox.extent, counts=counts, offsets=jnp.cumsum(counts) - counts,
        first_key=first_key, last_key=last_key, lower=lower, upper=upper, cell_level=level,
        cell_start=cell_start, cell_count=cell_count, cell_lower=cell_lower, cell_upper=cell_upper,
        periodic=kbox.periodic)


def domain(part: Any, *, box: Box | None = None, num_cells: int = 64) -> Domain:
    """The :class:`Domain` of particles already in global z-order (the output of :func:`zsort`), local view
    (``domain.smap(mesh)(part, box=...)`` for global ``(ndev, n, d)`` arrays).

    Pass the ``box`` that :func:`zsort` was given, so the keys are the same. Equivalent to
    ``zsort(..., return_domain=True)``'s third output.

    Args:
        part: z-sorted particle pytree (``.pos (n, d)``, ``.num``), or a plain `(n, d)` array of z-sorted
            positions.
        box: periodic box size or ``None`` (bounding box of the particles), as in :func:`zsort`.
        num_cells: top-level cells per device (static).

    Returns:
        The replicated :class:`Domain`.

    Example:
        >>> from shardax.particles import domain, uniform, zsort
        >>> zpart, _ = zsort(uniform(1000), box=1.0)
        >>> dom = domain(zpart, box=1.0, num_cells=8)
        >>> dom.counts.tolist(), int(dom.cell_count.sum())
        ([1000], 1000)
    """
    part = particle_set(part, "domain", global_view="domain.smap")
    n, _ = check_positions(part, "domain")
    valid = jnp.arange(n, dtype=jnp.int32) < jnp.asarray(part.num, jnp.int32)
    return domain_of(part, key_box(jnp.asarray(part.pos), valid, box), num_cells)


distributed(domain, in_specs={"part": P(-1)}, out_specs=P(), name="domain.smap")  # box, num_cells: static

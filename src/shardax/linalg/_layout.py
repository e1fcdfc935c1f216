"""The internal layout: a 1D block-cyclic distribution of matrix columns over every device of the mesh.

Column block ``j`` (of ``tile`` columns) lives on device ``j % nproc`` as that device's local block ``j // nproc``,
so every device holds all ``padded`` rows and ``padded / nproc`` columns. The columns factored before step ``k`` are
then a contiguous prefix of every device's local columns, and the columns still to factor a contiguous suffix, which
keeps the work balanced to the last step and lets each step's product be one dense matrix product per device.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The default block size, halved (down to MIN_TILE) while that leaves fewer than MIN_LOCAL_BLOCKS blocks per device:
# with few local blocks the factorisation's phases (``_potrf.MAX_PHASES``) are coarse, its products do more flops than
# an exact Cholesky, and fewer steps leave the owners' diagonal blocks a larger share. `potrs` f64 with the
# left-looking `potrf` (2026-11-25, `benchmarks/linalg.py --tile T`): N = 4096 on 4 devices 0.48 s with tile 64,
# 0.55 s with 128; N = 8192 on 4 devices 3.17 s with 64, 2.97 s with 128. N = 4096 on 1 device (round-robin in one
# process): 0.42 s with 256, 0.46 s with 128, 0.44 s with 64.
DEFAULT_TILE = 256
MIN_TILE = 64
MIN_LOCAL_BLOCKS = 16


def default_tile(n: int, nproc: int) -> int:
    """Block size used when none is given: 256, halved down to 64 while ``n`` leaves fewer than 16 blocks per
    device."""
    tile = DEFAULT_TILE
    while tile > MIN_TILE and n < MIN_LOCAL_BLOCKS * tile * nproc:
        tile //= 2
    return tile


@dataclasses.dataclass(frozen=True)
class BlockCyclic:
    """Shape of the block-cyclic layout of an ``(n, n)`` matrix over ``nproc`` devices (static: changing it
    recompiles).

    Attributes:
        n: the matrix order given by the user.
        tile: the block size actually used (the requested tile, reduced for small matrices so that padding stays
            below one block per device).
        nproc: number of devices the columns are dealt to.
    """

    n: int
    tile: int
    nproc: int

    @classmethod
    def create(cls, n: int, tile: int | None, nproc: int) -> BlockCyclic:
        """The layout for a requested ``tile`` (``None``: :func:`default_tile`)."""
        tile = default_tile(n, nproc) if tile is None else tile
        return cls(n, max(1, min(tile, math.ceil(n / nproc))), nproc)

    @property
    def local_blocks(self) -> int:
        """Number of column blocks per device."""
        return math.ceil(self.n / (self.tile * self.nproc))

    @property
    def width(self) -> int:
        """Local columns per device."""
        return self.local_blocks * self.tile

    @property
    def padded(self) -> int:
        """Padded matrix order (rows, and columns over all devices)."""
        return self.width * self.nproc

    @property
    def blocks(self) -> int:
        """Total number of column blocks (steps of the factorisation)."""
        return self.local_blocks * self.nproc


def to_cyclic(a: jax.Array, layout: BlockCyclic) -> jax.Array:
    """Pad ``a: (n, n)`` with the identity to ``(padded, padded)`` and reorder its columns so that device ``r``'s
    contiguous share of columns (``P(None, axes)``) holds the blocks ``r, r + nproc, r + 2 nproc, ...``."""
    pad = layout.padded - layout.n
    a = jnp.pad(a, ((0, pad), (0, pad)))
    if pad:
        idx = jnp.arange(layout.n, layout.padded, dtype=jnp.int32)
        a = a.at[idx, idx].set(jnp.ones((), a.dtype))
    return _deal_columns(a, layout)


def _deal_columns(a: jax.Array, layout: BlockCyclic) -> jax.Array:
    rows = a.shape[0]
    a = a.reshape(rows, layout.local_blocks, layout.nproc, layout.tile)
    return a.transpose(0, 2, 1, 3).reshape(rows, layout.padded)


def from_cyclic(a: jax.Array, layout: BlockCyclic) -> jax.Array:
    """Inverse of :func:`to_cyclic` for a ``(padded, padded)`` matrix: natural column order, padding removed."""
    rows = a.shape[0]
    a = a.reshape(rows, layout.nproc, layout.local_blocks, layout.tile)
    a = a.transpose(0, 2, 1, 3).reshape(rows, layout.padded)
    return a[: layout.n, : layout.n]


def global_columns(rank: jax.Array | int, layout: BlockCyclic) -> jax.Array:
    """Global column index of each of this device's ``width`` local columns."""
    local = jnp.arange(layout.width, dtype=jnp.int32)
    return (local // layout.tile * layout.nproc + rank) * layout.tile + local % layout.tile


def cyclic_spec(mesh: Mesh) -> PartitionSpec:
    """The internal spec: columns split over every mesh axis (row-major rank order, as ``rank_info``)."""
    return PartitionSpec(None, tuple(mesh.axis_names))


def user_sharding(x: object, mesh: Mesh) -> NamedSharding | None:
    """``x``'s NamedSharding when it lives on ``mesh`` (the layout results are returned in), else ``None``."""
    if isinstance(x, Tracer):
        return None
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding
    return None

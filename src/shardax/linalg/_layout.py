"""The internal layouts: block-cyclic distributions of a matrix over a 1D or 2D process grid.

1D (the default): column block ``j`` (of ``tile`` columns) lives on device ``j % nproc`` as that device's local block
``j // nproc``, so every device holds all ``padded`` rows and ``padded / nproc`` columns. The columns factored before
step ``k`` are then a contiguous prefix of every device's local columns, and the columns still to factor a
contiguous suffix, which keeps the work balanced to the last step and lets each step's product be one dense matrix
product per device.

2D (``rows > 1``, ScaLAPACK's layout, used by the factorisation only): the devices form a ``rows x cols`` grid
(row-major in the mesh's device order) and block ``(i, j)`` lives on grid position ``(i % rows, j % cols)``, as local
block ``(i // rows, j // cols)``. Each device holds ``padded / rows`` rows and ``padded / cols`` columns; a
factorisation step broadcasts along process columns and reduces along process rows, ``N^2 (1/rows + 1/cols) / 2``
words per device in all instead of the 1D layout's ``N^2 / 2``. The kernels take and return the 1D layout;
``to_grid_local`` and ``to_columns_local`` move a matrix to the grid and back in the local view (one
all-to-all along the process columns each). XLA's global-view redistribution straight to the 2D blocks was no
faster (it gathers the whole matrix on every device first), and this keeps the solves and the VJP on the 1D columns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._tuning import resolve_tuning
from ..comm import alltoall


@dataclasses.dataclass(frozen=True)
class LinalgTuning:
    """Block sizes of the factorisations and of the eigensolver's reduction (static: changing them recompiles).

    The factorisations' default block size is ``tile``, halved (down to ``min_tile``) while that leaves fewer than
    ``min_local_blocks`` blocks per device: with few local blocks the factorisation's phases (``_potrf.MAX_PHASES``)
    are coarse, its products do more flops than an exact Cholesky, and fewer steps leave the owners' diagonal blocks
    a larger share. Every block is one sequential step of a ``fori_loop``: on a GPU each step costs its launches
    whatever it holds, so the GPU preset takes blocks twice as large (half the steps).

    On one device the matrices of a dtype in ``whole_dtypes`` are factored as a single block, that is by the
    backend's solver library on the whole matrix: on a GPU cuSOLVER's float64 Cholesky is twice as fast as the
    blocked factorisation at N=8192 (one H100), while in float32 the blocked one, whose products run on the tensor
    cores, is faster than cuSOLVER's.

    ``shardax.linalg.syevd`` reduces the matrix to tridiagonal form one column at a time whatever the block
    size (one all-reduce per column), so its block, ``reduction_tile``, only sets the panel width of the
    reflectors: 32, LAPACK's ``sytrd`` choice, on every backend.

    Attributes:
        tile: the largest default block size of the factorisations.
        min_tile: the smallest block the halving reaches.
        min_local_blocks: blocks per device below which the tile is halved.
        reduction_tile: the default block size (reflector panel width) of ``syevd``'s tridiagonal reduction.
        whole_dtypes: dtype names (e.g. ``"float64"``) whose matrices one device factors as one block.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> a = 2.0 * jnp.eye(8) + 0.1
        >>> x = sx.linalg.potrs(a, jnp.ones(8), tuning=sx.linalg.LinalgTuning(tile=4))
        >>> bool(jnp.allclose(a @ x, 1.0, atol=1e-5))
        True
    """

    tile: int = 256
    min_tile: int = 64
    min_local_blocks: int = 16
    reduction_tile: int = 32
    whole_dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("tile", "min_tile", "min_local_blocks", "reduction_tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LinalgTuning.{name} must be a positive int, got {value!r}")
        names = self.whole_dtypes
        if not isinstance(names, tuple) or not all(isinstance(x, str) for x in names):
            raise ValueError(f"LinalgTuning.whole_dtypes must be a tuple of dtype names such as ('float64',), got "
                             f"{names!r}")
        for x in names:
            try:
                np.dtype(x)
            except TypeError:
                raise ValueError(f"LinalgTuning.whole_dtypes: {x!r} is not a dtype name") from None


PRESETS = {"cpu": LinalgTuning(),
           "gpu": LinalgTuning(tile=512, min_tile=128, min_local_blocks=8, whole_dtypes=("float64", "complex128"))}


def linalg_tuning(tuning: LinalgTuning | str | None = None, devices: Any = None) -> LinalgTuning:
    """The ``LinalgTuning`` a call runs with: ``tuning`` itself, a named preset, or the preset of ``devices``'s
    backend for ``None``."""
    return resolve_tuning(tuning, PRESETS, LinalgTuning, "linalg", devices)


def default_tile(n: int, nproc: int, tuning: LinalgTuning | str | None = None, devices: Any = None,
                 dtype: Any = None) -> int:
    """Block size used when none is given: the tuning's ``tile`` (256 on CPU, 512 on GPU), halved down to its
    ``min_tile`` while ``n`` leaves fewer than ``min_local_blocks`` blocks per device; ``n`` (one block) on one
    device for a ``dtype`` in the tuning's ``whole_dtypes``."""
    t = linalg_tuning(tuning, devices)
    if nproc == 1 and dtype is not None and np.dtype(dtype).name in t.whole_dtypes:
        return n
    tile = t.tile
    while tile > t.min_tile and n < t.min_local_blocks * tile * nproc:
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
        nproc: number of devices.
        rows: process rows of the grid (1: the 1D column layout); ``nproc / rows`` process columns.
    """

    n: int
    tile: int
    nproc: int
    rows: int = 1

    @classmethod
    def create(cls, n: int, tile: int | None, nproc: int, rows: int = 1,
               tuning: LinalgTuning | str | None = None, devices: Any = None, dtype: Any = None) -> BlockCyclic:
        """The layout for a requested ``tile`` (``None``: ``default_tile`` of ``tuning`` for ``dtype``) on a
        ``rows x (nproc / rows)`` process grid; ``devices``: those it runs on (they choose the preset)."""
        if rows < 1 or nproc % rows:
            raise ValueError(f"{rows} process rows do not divide {nproc} devices")
        tile = default_tile(n, nproc, tuning, devices, dtype) if tile is None else tile
        return cls(n, max(1, min(tile, math.ceil(n / nproc))), nproc, rows)

    @property
    def cols(self) -> int:
        """Process columns of the grid."""
        return self.nproc // self.rows

    def columns(self) -> BlockCyclic:
        """The 1D column layout with the same tile and padding."""
        return dataclasses.replace(self, rows=1)

    @property
    def local_blocks(self) -> int:
        """Number of column blocks per device in the 1D layout."""
        return math.ceil(self.n / (self.tile * self.nproc))

    @property
    def width(self) -> int:
        """Local columns per device in the 1D layout."""
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
    contiguous share of columns (``P(None, axes)``) holds the blocks ``r, r + nproc, r + 2 nproc, ...`` (the 1D
    layout, also for a 2D ``layout``: the kernels move to the grid and back inside, see ``to_grid_local``)."""
    pad = layout.padded - layout.n
    a = jnp.pad(a, ((0, pad), (0, pad)))
    if pad:
        idx = jnp.arange(layout.n, layout.padded, dtype=jnp.int32)
        a = a.at[idx, idx].set(jnp.ones((), a.dtype))
    return _deal(a, layout.nproc, layout.tile)


def _deal(a: jax.Array, parts: int, tile: int, *, back: bool = False) -> jax.Array:
    """``a``'s column blocks dealt round-robin to ``parts`` contiguous groups (``back``: gathered again)."""
    rows, cols = a.shape
    shape = (rows, parts, cols // (parts * tile), tile) if back else (rows, cols // (parts * tile), parts, tile)
    return a.reshape(shape).transpose(0, 2, 1, 3).reshape(rows, cols)


def from_cyclic(a: jax.Array, layout: BlockCyclic) -> jax.Array:
    """Inverse of ``to_cyclic`` for a ``(padded, padded)`` matrix: natural column order, padding removed."""
    return _deal(a, layout.nproc, layout.tile, back=True)[: layout.n, : layout.n]


def global_columns(rank: jax.Array | int, layout: BlockCyclic) -> jax.Array:
    """Global column index of each of this device's ``width`` local columns."""
    local = jnp.arange(layout.width, dtype=jnp.int32)
    return (local // layout.tile * layout.nproc + rank) * layout.tile + local % layout.tile


# Axis names of the process grid (``grid_mesh``).
ROW, COL = "_sx_grid_row", "_sx_grid_col"


def cyclic_spec(mesh: Mesh) -> PartitionSpec:
    """The internal spec: columns split over every mesh axis (row-major rank order, as ``rank_info``)."""
    return PartitionSpec(None, tuple(mesh.axis_names))


def grid_mesh(mesh: Mesh, layout: BlockCyclic) -> Mesh:
    """``mesh``'s devices as the layout's process grid: ``rows x cols`` in row-major device order (the same device
    order, so arrays on ``mesh`` go in and out of one ``jit`` with it), axes ``(ROW, COL)``; ``mesh`` itself for a 1D
    layout."""
    if layout.rows == 1:
        return mesh
    return Mesh(mesh.devices.reshape(layout.rows, layout.cols), (ROW, COL))


def to_columns_local(x: jax.Array, layout: BlockCyclic) -> jax.Array:
    """This device's 1D local columns ``(padded, width)`` of the matrix whose 2D local blocks are ``x: (padded /
    rows, padded / cols)`` (inside a map over ``grid_mesh``; ``x`` itself for a 1D layout).

    Device ``(p, q)`` is rank ``p cols + q`` of the 1D layout, whose column blocks ``m nproc + p cols + q`` are its
    local column blocks ``m rows + p`` in the 2D layout, held by every device of its process column: one
    all-to-all along the process column brings their rows to it."""
    if layout.rows == 1:
        return x
    r, t = layout.rows, layout.tile
    height = x.shape[0]
    # (height, m, r, t) -> (r, height, m, t): the columns bound for process row p first.
    x = x.reshape(height, -1, r, t).transpose(2, 0, 1, 3).reshape(r, height, -1)
    x = alltoall(x, axis=ROW)  # the local rows of every process row, in process-row order
    # Local row block i of process row p is global row block i rows + p.
    return x.reshape(r, height // t, t, -1).transpose(1, 0, 2, 3).reshape(layout.padded, -1)


def to_grid_local(x: jax.Array, layout: BlockCyclic) -> jax.Array:
    """Inverse of ``to_columns_local``: the 2D local blocks from the 1D local columns ``x: (padded, width)``."""
    if layout.rows == 1:
        return x
    r, t = layout.rows, layout.tile
    height = layout.padded // r
    width = x.shape[1]
    # Global row block i rows + p goes to process row p as its local row block i.
    x = x.reshape(height // t, r, t, width).transpose(1, 0, 2, 3).reshape(r, height, width)
    # After the exchange, part s holds the 1D columns of the device in process row s: its 2D column blocks m rows + s.
    x = alltoall(x, axis=ROW)
    return x.reshape(r, height, width // t, t).transpose(1, 2, 0, 3).reshape(height, r * width)


def user_sharding(x: object, mesh: Mesh) -> NamedSharding | None:
    """``x``'s NamedSharding when it lives on ``mesh`` (the layout results are returned in), else ``None``."""
    if isinstance(x, Tracer):
        return None
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding
    return None

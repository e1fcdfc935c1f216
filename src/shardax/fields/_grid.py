"""A distributed 3D grid in the local view: which block this device holds and which device owns a grid point."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._layout import local_layout, manual_axis_sizes
from ..core import default_mesh
from ..fft import Layout

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _box3(box: Any) -> tuple[float, float, float]:
    if isinstance(box, bool):
        raise TypeError(f"box must be a number or three numbers (the periodic box size), got {box!r}")
    if isinstance(box, int | float):
        values = (float(box),) * 3
    else:
        try:
            values = tuple(float(b) for b in box)
        except (TypeError, ValueError):
            raise TypeError(f"box must be a number or three numbers (the periodic box size), got {box!r}") from None
    # Normal float32 numbers: XLA flushes subnormal ones to zero.
    if len(values) != 3 or not all(math.isfinite(v) and v >= _FLOAT32_TINY for v in values):
        raise ValueError(f"box must be a positive finite number or three positive finite numbers, got {box!r}")
    return values  # type: ignore[return-value]


def _shape3(shape: Sequence[int]) -> tuple[int, int, int]:
    try:
        values = tuple(operator.index(n) for n in shape)
    except TypeError:
        raise TypeError(f"shape must be three ints (the global grid shape), got {shape!r}") from None
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"shape must be three positive ints (the global grid shape), got {shape!r}")
    return values  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Grid:
    """A periodic 3D grid of ``shape`` points over ``box``, split over mesh axes as ``layout`` says.

    Grid point ``i`` of axis ``d`` sits at ``i * box[d] / shape[d]``.
    """

    layout: Layout
    box: tuple[float, float, float]

    @classmethod
    def local(cls, shape: Sequence[int], spec: Any, box: Any, where: str) -> Grid:
        """The grid as seen from inside ``smap`` (``spec`` ignored outside, where the block is the whole grid)."""
        shape3 = _shape3(shape)
        sizes = manual_axis_sizes()
        if not sizes:
            return cls(Layout(shape3, ((),) * 3, ()), _box3(box))
        layout = Layout.from_spec(spec, shape3, sizes, f"{where}: spec")
        used = {name for g in layout.groups for name in g}
        missing = [name for name, size in sizes.items() if size > 1 and name not in used]
        if missing:
            raise ValueError(f"{where}: the field spec {layout.spec} does not split over mesh axes {missing}; a "
                             f"distributed field must be split over every mesh axis of size > 1 (e.g. "
                             f"P{tuple(sizes)} or P({tuple(sizes)},))")
        return cls(layout, _box3(box))

    @classmethod
    def from_block(cls, block: Sequence[int], spec: Any, box: Any, where: str) -> Grid:
        """The grid whose block on this device has shape ``block`` (local view)."""
        layout = local_layout(spec, _shape3(block), f"{where}: spec")
        return cls.local(layout.shape, spec, box, where)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def block(self) -> tuple[int, ...]:
        """Shape of this device's block."""
        return self.layout.local_shape

    @property
    def split(self) -> tuple[tuple[str, ...], ...]:
        """The mesh axes splitting each array axis, ``()`` where they hold one device between them (such an axis
        is whole on every device: no halo plane, no neighbour exchange)."""
        sizes = dict(self.layout.axis_sizes)
        return tuple(g if math.prod(sizes[a] for a in g) > 1 else () for g in self.layout.groups)

    def spacing(self, dtype: Any) -> jax.Array:
        """Grid spacing per axis, `(3,)`."""
        return jnp.asarray([b / n for b, n in zip(self.box, self.shape, strict=True)], dtype)

    def block_start(self) -> list[jax.Array | int]:
        """Global index of this device's first grid point along each axis."""
        starts: list[jax.Array | int] = []
        for dim, group in enumerate(self.layout.groups):
            starts.append(jax.lax.axis_index(group) * self.block[dim] if group else 0)
        return starts

    def owner(self, index: jax.Array) -> jax.Array:
        """Linear rank (over the manual mesh axes, in mesh order) of the device owning grid points `index: (n, 3)`."""
        sizes = dict(self.layout.axis_sizes)
        coords = {name: jnp.zeros(index.shape[:1], jnp.int32) for name in sizes}
        for dim, group in enumerate(self.layout.groups):
            block = index[:, dim] // self.block[dim]
            for name in reversed(group):
                coords[name] = block % sizes[name]
                block = block // sizes[name]
        rank = jnp.zeros(index.shape[:1], jnp.int32)
        for name in sizes:
            rank = rank * sizes[name] + coords[name]
        return rank


def cell_index(pos: jax.Array, grid: Grid) -> tuple[jax.Array, jax.Array]:
    """Lower grid point `(n, 3)` int32 (wrapped into the box) and CIC fraction `(n, 3)` of each position."""
    box = jnp.asarray(grid.box, pos.dtype)[None, :]
    pos = pos - box * jnp.floor(pos / box)  # into the box first: far-away positions would overflow int32 cells
    scaled = pos / grid.spacing(pos.dtype)[None, :]
    lower = jnp.floor(scaled)
    frac = scaled - lower
    shape = jnp.asarray(grid.shape, jnp.int32)[None, :]
    return jnp.mod(lower.astype(jnp.int32), shape), frac


def default_spec(mesh: Mesh) -> PartitionSpec:
    """Slabs on a 1D mesh, pencils on a 2D mesh: every mesh axis splits one array axis, in order."""
    return PartitionSpec(*mesh.axis_names[:3])


def field_sharding(field: Any, mesh: Mesh | None, spec: Any, name: str) -> tuple[Mesh, PartitionSpec]:
    """Mesh and spec of a global field: given, else its ``NamedSharding``'s, else the default mesh's slabs."""
    sharding = getattr(field, "sharding", None)
    if spec is None and isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        if mesh is not None and mesh != sharding.mesh:
            raise ValueError(f"{name}: the field is sharded over mesh {dict(sharding.mesh.shape)} but mesh="
                             f"{dict(mesh.shape)} was passed")
        return sharding.mesh, sharding.spec
    the_mesh = default_mesh(mesh)
    return the_mesh, default_spec(the_mesh) if spec is None else spec

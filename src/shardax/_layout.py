"""Layouts of distributed arrays: which mesh axes split which array axis (mpi4py-fft's ``Pencil``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .core import ALL, manual_axes

Group = tuple[str, ...]


def _entry_group(entry: Any, available: tuple[str, ...], where: str) -> Group:
    if entry is None:
        return ()
    if entry is ALL or (isinstance(entry, int) and not isinstance(entry, bool) and entry == -1):
        return available
    if isinstance(entry, str):
        names: Group = (entry,)
    elif isinstance(entry, tuple | list):
        names = tuple(entry)
    else:
        raise TypeError(f"{where}: a PartitionSpec entry must be a mesh axis name, a tuple of names or None, "
                        f"got {entry!r}")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"{where}: a PartitionSpec entry must be a mesh axis name, a tuple of names or None, "
                            f"got {entry!r}")
        if name not in available:
            raise ValueError(f"{where}: the spec names mesh axis {name!r}, but the available mesh axes are "
                             f"{available}")
    return names


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a global array is split over mesh axes: mpi4py-fft's ``Pencil`` for JAX meshes.

    Attributes:
        shape: the global shape.
        groups: for each array axis, the mesh axes that split it (major first; ``()`` = not split).
        axis_sizes: ``(name, size)`` of every mesh axis the layout may use.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> lay = Layout.from_spec(P("x", "y"), (32, 32, 32), {"x": 2, "y": 4})
        >>> lay.local_shape, lay.spec
        ((16, 8, 32), P('x', 'y'))
    """

    shape: tuple[int, ...]
    groups: tuple[Group, ...]
    axis_sizes: tuple[tuple[str, int], ...]

    @classmethod
    def from_spec(cls, spec: Any, shape: tuple[int, ...], axis_sizes: Mapping[str, int],
                  where: str = "spec") -> Layout:
        """The layout of an array of global ``shape`` sharded by ``spec`` over mesh axes of ``axis_sizes``."""
        if spec is ALL or (isinstance(spec, int) and not isinstance(spec, bool) and spec == -1):
            spec = PartitionSpec(ALL)
        if spec is None:
            spec = PartitionSpec()
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"{where} must be a jax.sharding.PartitionSpec, got {type(spec).__name__}")
        if len(spec) > len(shape):
            raise ValueError(f"{where} {spec} has {len(spec)} entries but the array has rank {len(shape)}")
        available = tuple(axis_sizes)
        groups = [_entry_group(e, available, where) for e in spec]
        groups += [()] * (len(shape) - len(groups))
        used = [name for g in groups for name in g]
        if len(set(used)) != len(used):
            raise ValueError(f"{where} {spec} uses a mesh axis more than once")
        sizes = tuple((name, int(axis_sizes[name])) for name in available)
        layout = cls(tuple(int(n) for n in shape), tuple(groups), sizes)
        for dim, group in enumerate(layout.groups):
            parts = layout.parts(dim)
            if layout.shape[dim] % parts:
                raise ValueError(f"{where} {spec} maps array axis {dim} (of size {layout.shape[dim]}) to mesh axes "
                                 f"{group} (of size {parts}), but {parts} does not evenly divide "
                                 f"{layout.shape[dim]}; choose a shape divisible by the mesh or another mesh")
        return layout

    def group_size(self, group: Group) -> int:
        """Number of devices along the mesh axes ``group``."""
        sizes = dict(self.axis_sizes)
        return math.prod(sizes[name] for name in group)

    def parts(self, dim: int) -> int:
        """Number of blocks array axis ``dim`` is split into."""
        return self.group_size(self.groups[dim])

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of one device's block."""
        return tuple(n // self.parts(d) for d, n in enumerate(self.shape))

    def entry(self, dim: int) -> str | Group | None:
        """The ``PartitionSpec`` entry of array axis ``dim``."""
        group = self.groups[dim]
        return None if not group else group[0] if len(group) == 1 else group

    @property
    def spec(self) -> PartitionSpec:
        """The layout as a ``PartitionSpec`` (trailing unsplit axes left out, as JAX writes specs)."""
        entries = [self.entry(dim) for dim in range(len(self.groups))]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def stripped(self) -> Layout:
        """The same data layout without mesh axes of size 1 (they split nothing)."""
        sizes = dict(self.axis_sizes)
        groups = tuple(tuple(name for name in g if sizes[name] > 1) for g in self.groups)
        return dataclasses.replace(self, groups=groups)

    def with_groups(self, groups: tuple[Group, ...], shape: tuple[int, ...] | None = None) -> Layout:
        """This layout with other groups (and optionally another global shape)."""
        return dataclasses.replace(self, groups=groups, shape=self.shape if shape is None else shape)


def manual_axis_sizes() -> dict[str, int]:
    """Sizes of the manual mesh axes of the current trace (empty outside ``smap``)."""
    names = manual_axes()
    if not names:
        return {}
    shape = jax.sharding.get_abstract_mesh().shape
    return {name: int(shape[name]) for name in names}


def local_layout(spec: Any, local_shape: tuple[int, ...], where: str) -> Layout:
    """The layout of the global array whose block on this device has ``local_shape`` (local view).

    Outside any ``smap`` the spec is ignored: the block is the whole array, on one device.
    """
    sizes = manual_axis_sizes()
    if not sizes:
        if not isinstance(spec, PartitionSpec | type(None)) and spec is not ALL:
            raise TypeError(f"{where} must be a jax.sharding.PartitionSpec, got {type(spec).__name__}")
        return Layout(tuple(local_shape), ((),) * len(local_shape), ())
    probe = Layout.from_spec(spec, tuple(local_shape), {n: 1 for n in sizes}, where)
    lay = dataclasses.replace(probe, axis_sizes=tuple(sizes.items()))
    return dataclasses.replace(lay, shape=tuple(n * lay.parts(d) for d, n in enumerate(local_shape)))

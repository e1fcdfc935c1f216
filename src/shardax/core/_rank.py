"""Rank information from inside (or outside) a shard_map: the MPI ``comm.rank``/``comm.size`` of shardax."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax import lax

AxisSpec = str | tuple[str, ...] | None


class RankInfo(NamedTuple):
    """Linear rank over the manual mesh axes of the current context.

    Attributes:
        rank: this device's linear index over ``axis_names`` (row-major in mesh order); a traced int32 inside
            ``smap``, the Python int 0 outside.
        size: number of devices along ``axis_names`` (a Python int).
        axis_names: the manual mesh axes, in mesh order; ``()`` outside any ``smap``.
    """

    rank: jax.Array | int
    size: int
    axis_names: tuple[str, ...]


def manual_axes() -> tuple[str, ...]:
    """The mesh axes that are manual (inside ``shard_map``) in the current trace, in mesh order."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    return tuple(a for a in mesh.axis_names if a in manual)


def resolve_axes(axis: AxisSpec) -> tuple[str, ...]:
    """``axis`` as a tuple of manual axes in mesh order; ``None`` is every manual axis of the context.

    Outside any ``smap``/``shard_map`` every axis has size 1, so any ``axis`` resolves to ``()`` (identity
    semantics for collectives); inside, unknown names are an error.
    """
    available = manual_axes()
    if axis is None:
        return available
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"axis must be a mesh axis name, a tuple of names or None, got {axis!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"axis {axis!r} names an axis twice")
    if not available:
        return ()
    for name in names:
        if name not in available:
            raise ValueError(f"axis {name!r} is not a manual mesh axis here; the manual axes are {available}")
    return tuple(a for a in available if a in names)


def axes_size(axes: tuple[str, ...]) -> int:
    """Number of devices along ``axes`` in the current context (1 for ``()``)."""
    if not axes:
        return 1
    shape = jax.sharding.get_abstract_mesh().shape
    return math.prod(shape[a] for a in axes)


def axes_index(axes: tuple[str, ...]) -> jax.Array | int:
    """Linear index of this device along ``axes`` (row-major in mesh order); 0 for ``()``."""
    if not axes:
        return 0
    return lax.axis_index(axes)


def rank_info(axis: AxisSpec = None) -> RankInfo:
    """Rank, size and axis names of this device over all manual mesh axes (or over ``axis``).

    Outside any ``smap``/``shard_map`` it returns ``RankInfo(0, 1, ())``, so that the same local-view code runs on one
    device without a mesh.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> sx.rank_info()
        RankInfo(rank=0, size=1, axis_names=())
        >>> ranks = sx.smap(lambda: sx.rank_info().rank, in_specs=(), out_specs=P(sx.ALL))()
        >>> ranks.shape == (sx.world().device_count,)
        True
    """
    axes = resolve_axes(axis)
    return RankInfo(axes_index(axes), axes_size(axes), axes)

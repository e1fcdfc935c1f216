"""Halo exchange for fields split over mesh axes (one neighbour on each side per split dimension)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ..core import manual_axes
from ._collectives import shift


def halo_exchange(x: jax.Array, width: int | Sequence[int], *, axes: Sequence[str | tuple[str, ...] | None],
                  periodic: bool = True) -> jax.Array:
    """Pad the local block of a distributed field with ``width`` cells of its neighbours' data on each side.

    Dimension ``i`` of ``x`` is split over mesh axis ``axes[i]`` (``None``: not split, not padded). Dimensions are
    exchanged one after another, each with the already padded block, so edge and corner cells come from the
    diagonal neighbours too. The transpose of this linear map (``jax.linear_transpose`` or the VJP) is the
    reverse operation that adds halo contributions back to their owners, as cloud-in-cell painting needs.

    Args:
        x: the local block, ``(n_0, n_1, ...)``.
        width: halo cells per side: an int (the same for every split dimension), or one int per entry of ``axes``
            (entries whose axis is ``None`` are ignored). At most the local block's length along that dimension.
        axes: for each leading dimension of ``x``, the mesh axis (or tuple of axes) it is split over, or ``None``.
        periodic: wrap around at the ends; else the outer halos are zeros.

    Returns:
        ``x`` with every split dimension ``i`` grown to ``n_i + 2 * width_i``.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> field = jnp.arange(16.0).reshape(16, 1)
        >>> out = sx.smap(lambda f: sx.comm.halo_exchange(f, 1, axes=("d",)), in_specs=P("d"), out_specs=P("d"),
        ...               mesh=sx.flat_mesh("d"), expand=False)(field)
        >>> out.shape[0] == 16 + 2 * sx.world().device_count
        True
    """
    x = jnp.asarray(x)
    axes = tuple(axes)
    if len(axes) > x.ndim:
        raise ValueError(f"axes has {len(axes)} entries but x has only {x.ndim} dimensions")
    widths = (width,) * len(axes) if isinstance(width, int) else tuple(width)
    if len(widths) != len(axes):
        raise ValueError(f"width must be an int or one int per entry of axes ({len(axes)}), got {width!r}")
    manual = manual_axes()
    for dim, (name, w) in enumerate(zip(axes, widths, strict=True)):
        if name is None:
            continue
        if not isinstance(w, int) or w < 0:
            raise ValueError(f"width for dimension {dim} must be a non-negative int, got {w!r}")
        names = (name,) if isinstance(name, str) else tuple(name)
        if manual and any(n not in manual for n in names):
            raise ValueError(f"axes[{dim}]={name!r} is not a manual mesh axis here; the manual axes are {manual}")
        if w > x.shape[dim]:
            raise ValueError(f"halo width {w} along dimension {dim} is larger than the local block ({x.shape[dim]} "
                             "cells): use fewer devices along that axis or a narrower halo")
        if w == 0:
            continue
        n = x.shape[dim]
        low = lax.slice_in_dim(x, 0, w, axis=dim)
        high = lax.slice_in_dim(x, n - w, n, axis=dim)
        left = shift(high, 1, periodic=periodic, axis=name)   # from the rank before me: its last cells
        right = shift(low, -1, periodic=periodic, axis=name)  # from the rank after me: its first cells
        x = jnp.concatenate([left, x, right], axis=dim)
    return x

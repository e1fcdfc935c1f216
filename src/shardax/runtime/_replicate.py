"""Host replication: the jaxmg multi-node recipe (every host holds the whole array, split over its own devices)."""

from __future__ import annotations

import functools

import jax
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


def _drop_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    entries = []
    for entry in spec:
        if entry is None:
            entries.append(None)
            continue
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(n for n in names if n != axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


@functools.lru_cache(maxsize=64)
def _resharder(sharding: NamedSharding):
    return jax.jit(lambda a: a, out_shardings=sharding)


def host_replicate(x: jax.Array, mesh: Mesh, axis: str = "hosts") -> jax.Array:
    """Reshard ``x`` so that mesh axis ``axis`` no longer splits it: every host then holds the whole of what the
    other axes split, spread over its own devices.

    This is jaxmg's ``with_sharding_constraint(A, P(None, "y"))`` step, for any spec: a matrix sharded by columns
    over ``("hosts", "d")`` becomes sharded by columns over ``"d"`` only, replicated across hosts.

    Args:
        x: a global array sharded with a :class:`~jax.sharding.NamedSharding` on ``mesh`` (or a tracer inside jit).
        mesh: the mesh (e.g. :func:`shardax.grid_mesh`).
        axis: the mesh axis to drop from ``x``'s sharding.

    Returns:
        ``x`` with sharding ``NamedSharding(mesh, spec without axis)``.

    Example:
        >>> import jax, jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = sx.grid_mesh()
        >>> a = jax.device_put(jnp.eye(8), NamedSharding(mesh, P(None, ("hosts", "d"))))
        >>> tuple(sx.host_replicate(a, mesh).sharding.spec)
        (None, 'd')
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    if isinstance(x, Tracer):
        spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or PartitionSpec()
        target = NamedSharding(mesh, _drop_axis(spec, axis))
        if AxisType.Explicit in mesh.axis_types:  # jax.make_mesh's default: a sharding is changed by reshard
            return jax.sharding.reshard(x, target)
        return jax.lax.with_sharding_constraint(x, target)
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise TypeError("x must be a jax.Array with a NamedSharding on `mesh` (use jax.device_put(x, "
                        f"NamedSharding(mesh, spec)) first); got sharding {sharding!r}")
    target = NamedSharding(mesh, _drop_axis(sharding.spec, axis))
    return _resharder(target)(x)

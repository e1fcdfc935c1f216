"""The particle data model: the ``Particles`` pytree (the duck-typed interface is :mod:`shardax._pytree`).

A particle set is any pytree with a ``.pos`` leaf of shape ``(n, d)`` and a ``.num`` count of valid rows; rows
``>= num`` are padding. Every leaf whose leading length equals ``n`` is a per-particle field and travels with its
particle; other leaves (``num``, a scalar mass, a box size, ...) stay where they are.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._pytree import row_count
from ..comm import scan
from ..core import rank_info


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Particles:
    """A padded set of particles on one device (local view) or on all devices (global view).

    In the local view the per-particle fields have a leading length ``n`` (the capacity: valid rows first, then
    padding) and ``num`` is a scalar. In the global view (the output of :func:`from_numpy` or of a ``.smap``
    function) every field has an extra leading ``ndev`` axis and ``num`` has shape ``(ndev,)``.

    Attributes:
        pos: `(n, d)` float positions, ``d`` in {2, 3}.
        num: int32 number of valid rows (the rest is padding).
        mass: `(n,)` masses, or ``None``.
        vel: `(n, d)` velocities, or ``None``.
        ids: `(n,)` int32 global input index of each particle (the numbering kNN and FoF report), or ``None``.

    Any other pytree with ``.pos`` and ``.num`` works wherever ``Particles`` does; use ``dataclasses.replace`` to
    change a field.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.particles import Particles
        >>> part = Particles(pos=jnp.zeros((4, 3)), num=jnp.int32(2))
        >>> part.pos.shape, int(part.num)
        ((4, 3), 2)
    """

    pos: jax.Array
    num: jax.Array
    mass: jax.Array | None = None
    vel: jax.Array | None = None
    ids: jax.Array | None = None


def with_ids(part: Particles) -> Particles:
    """``part`` with ``ids`` set to each particle's global index in (device, row) order; padding rows get -1.

    Local view: device ``r`` numbers its rows from the total count of devices ``0..r-1``, so the numbering is the
    one :func:`squeeze` returns rows in.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.particles import Particles, with_ids
        >>> with_ids(Particles(pos=jnp.zeros((3, 3)), num=jnp.int32(2))).ids.tolist()
        [0, 1, -1]
    """
    if not isinstance(part, Particles):
        raise TypeError(f"with_ids needs a shardax.particles.Particles, got {type(part).__name__}")
    n = row_count(part)
    num = jnp.asarray(part.num, jnp.int32)
    offset = scan(num, inclusive=False) if rank_info().size > 1 else jnp.int32(0)
    rows = jnp.arange(n, dtype=jnp.int32)
    return dataclasses.replace(part, ids=jnp.where(rows < num, offset + rows, -1))

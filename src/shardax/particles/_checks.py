"""Conservation checks: the particle count and an order-independent checksum of the ids, over all devices."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .._pytree import row_count
from ..comm import allreduce
from ..core import distributed


class Conservation(NamedTuple):
    """Global invariants of a particle set that every exchange must preserve.

    Attributes:
        count: int32 total number of particles over all devices.
        checksum: uint32 sum (mod ``2**32``) of a 32-bit hash of every particle's id: independent of order and
            placement, changed by a lost, duplicated or altered id.
    """

    count: jax.Array
    checksum: jax.Array


def _hash32(x: jax.Array) -> jax.Array:
    """A bijective 32-bit mix (lowbias32), so that different ids rarely cancel in the sum."""
    x = x.astype(jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def ids_checksum_numpy(ids: np.ndarray) -> int:
    """The :attr:`Conservation.checksum` of host ids (e.g. the input of :func:`from_numpy`)."""
    x = np.asarray(ids).astype(np.uint32).astype(np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    x = ((x ^ (x >> np.uint64(16))) * np.uint64(0x7FEB352D)) & mask
    x = ((x ^ (x >> np.uint64(15))) * np.uint64(0x846CA68B)) & mask
    x = x ^ (x >> np.uint64(16))
    return int(np.sum(x, dtype=np.uint64) & mask)


def conservation(part: Any) -> Conservation:
    """Total particle count and ids checksum over every device (local view; ``conservation.smap()`` for global).

    Compare the values before and after any redistribution (``zsort``, exchanges): they must be equal.

    Args:
        part: particle pytree with an ``ids`` field (see :func:`with_ids`).

    Returns:
        :class:`Conservation`, replicated.

    Example:
        >>> from shardax.particles import conservation, uniform, zsort
        >>> part = uniform(100)
        >>> conservation(zsort(part)[0]) == conservation(part)
        True
    """
    n = row_count(part)
    ids = getattr(part, "ids", None)
    if ids is None:
        raise TypeError("conservation needs particles with an ids field; add one with "
                        "shardax.particles.with_ids(part) or from_numpy")
    valid = jnp.arange(n, dtype=jnp.int32) < jnp.asarray(part.num, jnp.int32)
    count = allreduce(jnp.sum(valid).astype(jnp.int32))
    checksum = allreduce(jnp.sum(jnp.where(valid, _hash32(jnp.asarray(ids)), jnp.uint32(0)), dtype=jnp.uint32))
    return Conservation(count, checksum)


distributed(conservation, in_specs={"part": P(-1)}, out_specs=P(), name="conservation.smap")

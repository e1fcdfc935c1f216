"""Initial conditions in the local view: uniform particles and Gaussian blobs with known membership.

Each device draws ``n`` particles from its own random stream (``fold_in(key(seed), rank)``), so the global set has
``n * ndev`` particles and depends on the number of devices; ``ids`` number them in (device, row) order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .._morton import Box, periodic_box, wrap
from ..core import ALL, distributed, rank_info
from ._particles import Particles


def _capacity(n: int, capacity: int | None) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative Python int (particles per device), got {n!r}")
    if capacity is None:
        return max(1, n + -(-n // 4))
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < n or capacity < 1:
        raise ValueError(f"capacity must be a Python int >= n = {n} (and >= 1), got {capacity!r}")
    return capacity


def _finish(pos: jax.Array, n: int, cap: int, mass: float | None) -> Particles:
    rank, size, _ = rank_info()
    extra = cap - n
    pos = jnp.concatenate([pos, jnp.zeros((extra, pos.shape[1]), pos.dtype)])
    rows = jnp.arange(cap, dtype=jnp.int32)
    ids = jnp.where(rows < n, rank * n + rows, -1)
    masses = None
    if mass is not None:
        masses = jnp.where(rows < n, jnp.asarray(mass / max(n * size, 1), pos.dtype), 0)
    return Particles(pos=pos, num=jnp.int32(n), mass=masses, ids=ids.astype(jnp.int32))


def _dtype(dtype: jnp.dtype | type | str) -> jnp.dtype:
    dt = jnp.dtype(dtype)
    if dt not in (jnp.float32, jnp.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dt}")
    if dt == jnp.float64 and not jax.config.read("jax_enable_x64"):
        raise TypeError("dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True)); "
                        "use float32 otherwise")
    return dt


def uniform(n: int, *, box: Box = 1.0, seed: int = 0, capacity: int | None = None, dim: int = 3,
            total_mass: float | None = 1.0, dtype: jnp.dtype | type | str = jnp.float32) -> Particles:
    """Uniformly random particles in ``[0, box)`` (local view; ``uniform.smap()(...)`` for global).

    Args:
        n: particles per device.
        box: box size, scalar or per axis.
        seed: random seed (device ``r`` uses ``fold_in(key(seed), r)``).
        capacity: rows per device (padding after the ``n`` particles); default ``n + ceil(n / 4)``.
        dim: 2 or 3.
        total_mass: total mass over all devices, split equally; ``None`` for no ``mass`` field.
        dtype: float32, or float64 with ``jax_enable_x64``.

    Returns:
        :class:`Particles` with ``pos (capacity, dim)``, ``num = n``, ``mass``, and ``ids = rank * n + row``.

    Example:
        >>> from shardax.particles import uniform
        >>> part = uniform(100, capacity=128)
        >>> part.pos.shape, int(part.num), int(part.ids[99])
        ((128, 3), 100, 99)
        >>> glob = uniform.smap()(n=100)   # global: (ndev, 125, 3)
    """
    if dim not in (2, 3):
        raise ValueError(f"dim must be 2 or 3, got {dim!r}")
    dt = _dtype(dtype)
    cap = _capacity(n, capacity)
    kbox = periodic_box(box, dim, dt)
    key = jax.random.fold_in(jax.random.key(seed), rank_info().rank)
    pos = wrap(jax.random.uniform(key, (n, dim), dt) * kbox.extent[None, :], kbox)
    return _finish(pos, n, cap, total_mass)


def gaussian_blobs(n: int, *, centers: jax.Array, sigma: jax.Array | float, box: Box = 1.0, seed: int = 0,
                   capacity: int | None = None, background: float = 0.0, total_mass: float | None = 1.0,
                   periodic: bool = True) -> tuple[Particles, jax.Array]:
    """Particles in Gaussian clumps around ``centers``, with each particle's clump as ground truth (local view).

    Particle with global id ``g`` belongs to clump ``g % k`` (``k`` centers), except a fraction ``background`` of
    the particles per device (the last rows) that are uniform in the box and belong to no clump (-1).

    Args:
        n: particles per device.
        centers: `(k, d)` clump centres (``d`` = 2 or 3), replicated.
        sigma: clump width, scalar or `(k,)`.
        box: box size, scalar or per axis.
        seed: random seed (device ``r`` uses ``fold_in(key(seed), r)``).
        capacity: rows per device; default ``n + ceil(n / 4)``.
        background: fraction of uniform background particles, in ``[0, 1]``.
        total_mass: total mass over all devices, split equally; ``None`` for no ``mass`` field.
        periodic: wrap positions into ``[0, box)``; else they may fall outside the box.

    Returns:
        ``(part, clump)``: :class:`Particles` (float32 positions, ``ids = rank * n + row``) and `(capacity,)`
        int32 clump index of each row (-1 for background and padding).

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.particles import gaussian_blobs
        >>> part, clump = gaussian_blobs(90, centers=jnp.array([[0.2, 0.2, 0.2], [0.7, 0.7, 0.7]]), sigma=0.01)
        >>> clump[:4].tolist()
        [0, 1, 0, 1]
    """
    centers = jnp.asarray(centers)
    if centers.ndim != 2 or centers.shape[1] not in (2, 3) or centers.shape[0] < 1:
        raise ValueError(f"centers must have shape (k, 2) or (k, 3) with k >= 1, got {centers.shape}")
    if not 0.0 <= background <= 1.0:
        raise ValueError(f"background must be a fraction in [0, 1], got {background!r}")
    k, dim = centers.shape
    dt = jnp.float32
    centers = centers.astype(dt)
    sigma = jnp.asarray(sigma, dt)
    if sigma.shape not in ((), (k,)):
        raise ValueError(f"sigma must be a scalar or have shape ({k},) (one width per centre), got {sigma.shape}")
    cap = _capacity(n, capacity)
    kbox = periodic_box(box, dim, dt)
    rank = rank_info().rank
    key_blob, key_bg = jax.random.split(jax.random.fold_in(jax.random.key(seed), rank))
    n_bg = int(np.floor(background * n))
    ids = rank * n + jnp.arange(n, dtype=jnp.int32)
    clump = jnp.where(jnp.arange(n) < n - n_bg, ids % k, -1).astype(jnp.int32)
    width = jnp.broadcast_to(sigma, (k,))[clump % k][:, None]
    pos = centers[clump % k] + width * jax.random.normal(key_blob, (n, dim), dt)
    uniform_pos = jax.random.uniform(key_bg, (n, dim), dt) * kbox.extent[None, :]
    pos = jnp.where((clump < 0)[:, None], uniform_pos, pos)
    if periodic:
        pos = wrap(pos, kbox)
    clump = jnp.concatenate([clump, jnp.full((cap - n,), -1, jnp.int32)])
    return _finish(pos, n, cap, total_mass), clump


distributed(uniform, out_specs=ALL, name="uniform.smap")
distributed(gaussian_blobs, in_specs={"centers": P(), "sigma": P()}, out_specs=ALL, name="gaussian_blobs.smap")

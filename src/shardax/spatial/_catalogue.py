"""Group catalogues: the ``Catalogue`` pytree and the per-group sums that build it from pieces on many devices.

A group split over devices is summarised on each device by a :class:`Partial` (count, mass, centre of mass, momentum
and the second moment about that centre). Partials combine exactly: centres are unwrapped next to the first piece's
centre (minimum image in a periodic box, so a group across the box edge gets the right centre) and second moments
add with the parallel-axis theorem. Every scale (1 device or many) builds its catalogue through the same sums.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from .._nonzero import true_positions
from .._wordsort import argsort_words


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Catalogue:
    """Friends-of-friends groups with at least ``min_members`` members, padded (local view: one device's rows).

    Rows ``< num`` are groups, sorted by label on each device; the rest is padding (label -1). In the global view
    every field has a leading ``ndev`` axis and ``num`` has shape ``(ndev,)``. Each group is on exactly one device;
    :meth:`to_numpy` gathers them in label order, which is the same at every scale.

    Attributes:
        num: int32 number of valid rows.
        count: `(g,)` int32 members.
        mass: `(g,)` total mass (the member count when the particles have no masses).
        com: `(g, d)` centre of mass (wrapped into ``[0, box)`` in a periodic box).
        vel: `(g, d)` mass-weighted mean velocity (zeros when the particles have no velocities).
        radius: `(g,)` mass-weighted rms distance of the members from ``com``.
        label: `(g,)` int32 group label: the smallest global input index (``ids``) among the members.

    Example:
        >>> import numpy as np, shardax as sx
        >>> from shardax.spatial import fof
        >>> part = sx.particles.from_numpy(np.zeros((30, 3), np.float32))
        >>> cat = fof.smap()(part, 0.1, min_members=20).catalogue
        >>> cat.to_numpy()["count"].tolist()
        [30]
    """

    num: jax.Array
    count: jax.Array
    mass: jax.Array
    com: jax.Array
    vel: jax.Array
    radius: jax.Array
    label: jax.Array

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Dense host arrays of all groups (every device's valid rows), sorted by label; collective across processes.

        Returns:
            ``{"count", "mass", "com", "vel", "radius", "label"}``, each with one row per group.
        """
        num = _to_host(self.num).astype(np.int64)
        local = num.ndim == 0
        num = num.reshape(-1)
        out: dict[str, np.ndarray] = {}
        for name in ("count", "mass", "com", "vel", "radius", "label"):
            arr = _to_host(getattr(self, name))
            if local:
                arr = arr[None]
            out[name] = np.concatenate([arr[r, : num[r]] for r in range(num.shape[0])])
        order = np.argsort(out["label"], kind="stable")
        return {name: arr[order] for name, arr in out.items()}


def _to_host(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


class Partial(NamedTuple):
    """Sums over the members of (a piece of) a group, one row per piece."""

    count: jax.Array  # (g,) int32
    mass: jax.Array  # (g,)
    com: jax.Array  # (g, d) centre of mass of the piece (not wrapped)
    momentum: jax.Array  # (g, d) sum of m * v
    moment2: jax.Array  # (g,) sum of m |x - com|^2


def min_image(dx: jax.Array, box: jax.Array | None) -> jax.Array:
    """Displacements mapped to the nearest periodic image (identity without a box)."""
    if box is None:
        return dx
    box = box.reshape((1,) * (dx.ndim - 1) + (-1,))
    return dx - box * jnp.round(dx / box)


def partial_sums(pos: jax.Array, mass: jax.Array, vel: jax.Array, segment: jax.Array, valid: jax.Array,
                 num_segments: int, box: jax.Array | None) -> Partial:
    """Per-segment sums of the rows with ``valid`` (rows elsewhere are ignored).

    Args:
        pos: `(n, d)` positions.
        mass: `(n,)` masses.
        vel: `(n, d)` velocities.
        segment: `(n,)` int32 segment of each row, in ``[0, num_segments)``.
        valid: `(n,)` rows to include.
        num_segments: number of segments (static).
        box: `(d,)` periodic box or None.

    Returns:
        A :class:`Partial` with ``num_segments`` rows (empty segments have count 0).
    """
    n = pos.shape[0]
    # Rows outside every segment get an index past the last and are dropped: one extra segment would collect them
    # all, and a GPU serialises millions of adds onto its one address.
    seg = jnp.where(valid, segment, num_segments)
    segs = num_segments
    m = jnp.where(valid, mass, 0).astype(pos.dtype)
    first_row = jax.ops.segment_min(jnp.arange(n, dtype=jnp.int32), seg, segs)[:num_segments]
    ref = pos[jnp.clip(first_row, 0, n - 1)]
    dx = min_image(pos - ref[jnp.minimum(seg, num_segments - 1)], box)
    count = jax.ops.segment_sum(valid.astype(jnp.int32), seg, segs)[:num_segments]
    total = jax.ops.segment_sum(m, seg, segs)[:num_segments]
    shift = jax.ops.segment_sum(m[:, None] * dx, seg, segs)[:num_segments]
    com = ref + shift / jnp.where(total > 0, total, 1)[:, None]
    momentum = jax.ops.segment_sum(m[:, None] * vel, seg, segs)[:num_segments]
    dc = min_image(pos - com[jnp.minimum(seg, num_segments - 1)], box)
    moment2 = jax.ops.segment_sum(m * jnp.sum(dc * dc, axis=1), seg, segs)[:num_segments]
    return Partial(count, total, com, momentum, moment2)


def combine(parts: Partial, segment: jax.Array, valid: jax.Array, num_segments: int,
            box: jax.Array | None) -> Partial:
    """Combine rows of ``parts`` (pieces of groups) by ``segment``; rows without ``valid`` are ignored."""
    n = parts.count.shape[0]
    seg = jnp.where(valid, segment, num_segments)  # invalid rows dropped, as in partial_sums
    segs = num_segments
    first_row = jax.ops.segment_min(jnp.arange(n, dtype=jnp.int32), seg, segs)[:num_segments]
    ref = parts.com[jnp.clip(first_row, 0, n - 1)]
    seg_row = jnp.minimum(seg, num_segments - 1)
    com_piece = ref[seg_row] + min_image(parts.com - ref[seg_row], box)
    m = jnp.where(valid, parts.mass, 0)
    count = jax.ops.segment_sum(jnp.where(valid, parts.count, 0), seg, segs)[:num_segments]
    total = jax.ops.segment_sum(m, seg, segs)[:num_segments]
    safe = jnp.where(total > 0, total, 1)
    com = jax.ops.segment_sum(m[:, None] * (com_piece - ref[seg_row]), seg, segs)[:num_segments] / safe[:, None]
    com = ref + com
    momentum = jax.ops.segment_sum(jnp.where(valid[:, None], parts.momentum, 0), seg, segs)[:num_segments]
    dc = com_piece - com[seg_row]
    spread = jnp.where(valid, parts.moment2 + m * jnp.sum(dc * dc, axis=1), 0)
    moment2 = jax.ops.segment_sum(spread, seg, segs)[:num_segments]
    return Partial(count, total, com, momentum, moment2)


def finish(parts: Partial, label: jax.Array, keep: jax.Array, capacity: int,
           box: jax.Array | None) -> tuple[Catalogue, jax.Array]:
    """The :class:`Catalogue` of the rows with ``keep`` (sorted by label) and the number of such rows.

    The returned count may exceed ``capacity`` (rows were dropped: overflow).
    """
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(keep, label, big)
    needed = jnp.sum(keep, dtype=jnp.int32)
    # Only the kept rows are sorted (at most `capacity` of them, in row order: ties stay in row order), by one
    # single-operand sort (``argsort_words``; a sort with a payload is several times slower on XLA:CPU). The sign bit
    # is flipped so that the unsigned order of the words is the int32 order of the labels.
    order = true_positions(keep, min(capacity, key.shape[0]), key.shape[0] - 1)
    word = jnp.where(jnp.arange(order.shape[0]) < needed, key[order], big).astype(jnp.uint32) ^ jnp.uint32(1 << 31)
    order = order[argsort_words(word)]
    num = jnp.minimum(needed, capacity).astype(jnp.int32)
    pad = capacity - order.shape[0]
    rows = jnp.arange(capacity, dtype=jnp.int32)
    live = rows < num

    def take(x: jax.Array, fill: Any) -> jax.Array:
        y = x[order]
        if pad:
            y = jnp.concatenate([y, jnp.zeros((pad, *y.shape[1:]), y.dtype)])
        return jnp.where(live.reshape(-1, *([1] * (y.ndim - 1))), y, jnp.asarray(fill, y.dtype))

    mass = take(parts.mass, 0)
    safe = jnp.where(mass > 0, mass, 1)
    com = take(parts.com, 0)
    if box is not None:
        com = com - box[None, :] * jnp.floor(com / box[None, :])
    cat = Catalogue(num=num, count=take(parts.count, 0), mass=mass, com=com,
                    vel=take(parts.momentum, 0) / safe[:, None],
                    radius=jnp.sqrt(jnp.maximum(take(parts.moment2, 0), 0) / safe),
                    label=take(label, -1).astype(jnp.int32))
    return cat, needed

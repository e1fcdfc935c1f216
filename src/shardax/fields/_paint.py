"""Cloud-in-cell mass assignment of distributed particles onto a distributed grid, and interpolation back."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import comm
from .._bounds import check_bounds, check_part, mapped_checks
from .._errors import CapacityError
from .._pytree import check_count, check_positions, row_count
from .._tuning import tuning_backend
from ..comm import count_by_rank
from ..core import ALL, default_mesh, rank_info, smap
from ..particles import Particles
from ._grid import Grid, _box3, _shape3, cell_index, default_spec, field_sharding

_CORNERS = tuple(itertools.product((0, 1), repeat=3))


def _resized(a: jax.Array, rows: int) -> jax.Array:
    """``a`` cut or padded with zero rows to ``rows`` rows."""
    return jnp.pad(a, [(0, max(rows - a.shape[0], 0))] + [(0, 0)] * (a.ndim - 1))[:rows]


def _to_owners(part: Any, grid: Grid, capacity: int, extra: dict[str, jax.Array]
               ) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    """Send every valid particle (with ``extra`` per-row leaves) to the device owning its lower grid point.

    Returns the received rows, their count and the largest count any device had to receive (for the error). On one
    device (decided at trace time) the rows stay in place: no destinations, counts or exchange.
    """
    n = row_count(part)
    valid = jnp.arange(n, dtype=jnp.int32) < part.num
    # Padding rows may hold anything (NaN included): zeros keep them finite here, in the exchange and in gradients.
    tree = {"pos": jnp.where(valid[:, None], part.pos, 0), **extra}
    _, size, _ = rank_info()
    if size == 1:
        num = jnp.asarray(part.num, jnp.int32)
        needed = comm.allreduce(num, "max")  # (the same value, typed as replicated over a size-1 mesh axis)
        return {name: _resized(a, capacity) for name, a in tree.items()}, jnp.minimum(num, capacity), needed
    lower, _ = cell_index(tree["pos"], grid)
    dest = grid.owner(lower)
    # Counted by compare-and-sum (no histogram scatter-add: a GPU serialises adds onto the same few addresses).
    needed = jnp.max(comm.allreduce(count_by_rank(jnp.where(valid, dest, size), size)))
    moved, num, _ = comm.exchange(tree, dest, num=part.num, capacity=capacity)
    return moved, num, needed


def _flat_corner(lower: jax.Array, corner: tuple[int, ...], grid: Grid, starts: list[jax.Array | int],
                 padded: Sequence[int]) -> jax.Array:
    """Row-major index of a CIC corner in the block padded by one halo plane on the high side of every split axis,
    ``prod(padded)`` where it falls outside.

    XLA scatters and gathers with one index per update several times faster than with three (CPU: a 128^3 paint
    of 2M particles 180 -> 93 ms, a readout 145 -> 27 ms); the bits are the same, as updates keep their order."""
    flat = jnp.zeros_like(lower[:, 0])
    inside = jnp.ones(lower.shape[:1], bool)
    for dim, (group, extent) in enumerate(zip(grid.split, padded, strict=True)):
        i = lower[:, dim] + corner[dim]
        i = i - starts[dim] if group else jnp.mod(i, grid.shape[dim])
        flat = flat * extent + i
        inside = inside & (i >= 0) & (i < extent)
    return jnp.where(inside, flat, math.prod(padded))


def fold_halo(padded: jax.Array, grid: Grid) -> jax.Array:
    """Add the high halo plane of every split axis to the first plane of the next device (periodic), then drop it.

    Axes are folded one after another on the still padded block, so edge and corner cells reach the diagonal
    neighbour: the transpose of :func:`extend_halo`.
    """
    for dim, group in enumerate(grid.split):
        if not group:
            continue
        n = padded.shape[dim] - 1
        body, halo = jax.lax.split(padded, (n, 1), axis=dim)
        received = comm.shift(halo, 1, axis=group)  # rank r gets rank r - 1's halo plane
        padded = jax.lax.dynamic_update_slice_in_dim(body, jax.lax.slice_in_dim(body, 0, 1, axis=dim) + received, 0,
                                                    axis=dim)
    return padded


def extend_halo(block: jax.Array, grid: Grid) -> jax.Array:
    """Append to every split axis the first plane of the next device (periodic): the high halo CIC reads."""
    for dim, group in enumerate(grid.split):
        if not group:
            continue
        received = comm.shift(jax.lax.slice_in_dim(block, 0, 1, axis=dim), -1, axis=group)
        block = jnp.concatenate([block, received], axis=dim)
    return block


def _padded_shape(grid: Grid) -> tuple[int, ...]:
    """This device's block with one halo plane on the high side of every split axis."""
    shape = tuple(b + (1 if g else 0) for b, g in zip(grid.block, grid.split, strict=True))
    if math.prod(shape) >= 2**31:
        raise ValueError(f"a device's block of {shape} grid points (halo included) is too large for int32 indices; "
                         "spread the field over more devices")
    return shape


def _weights(frac: jax.Array, corner: tuple[int, ...]) -> jax.Array:
    w = jnp.ones(frac.shape[:1], frac.dtype)
    for dim, c in enumerate(corner):
        w = w * (frac[:, dim] if c else 1 - frac[:, dim])
    return w


def _check(part: Any, where: str) -> None:
    check_positions(part, where)
    if jnp.shape(part.pos)[1] != 3:
        raise ValueError(f"{where}: part.pos must have 3 columns (3D positions), got {jnp.shape(part.pos)}")
    if not isinstance(part.pos, Tracer) and not isinstance(part.num, Tracer):
        _raise_nonfinite(where, int(_nonfinite(part)))


def _nonfinite(part: Any) -> jax.Array:
    """Valid rows with a NaN or infinite coordinate, over every device of the context."""
    valid = jnp.arange(row_count(part), dtype=jnp.int32) < part.num
    return comm.allreduce(jnp.sum(valid & ~jnp.all(jnp.isfinite(part.pos), axis=1), dtype=jnp.int32))


def _check_global(part: Any, where: str) -> None:
    """Clear errors for global particles that the mapped kernels could not take."""
    if getattr(part, "pos", None) is None or not hasattr(part, "num"):
        raise TypeError(f"{where}: part must be a global particle pytree with .pos and .num (e.g. from "
                        f"shardax.particles.from_numpy), got {type(part).__name__}")
    shape = jnp.shape(part.pos)
    if len(shape) != 3 or shape[2] != 3:
        raise ValueError(f"{where}: part.pos must have shape (ndev, n, 3) (e.g. from shardax.particles.from_numpy), "
                         f"got {shape}; local_{where} takes the local view")
    if jnp.result_type(part.pos) not in (jnp.float32, jnp.float64):
        raise TypeError(f"{where}: part.pos must be float32 or float64, got dtype {jnp.result_type(part.pos)}")
    if jnp.shape(part.num) != shape[:1]:
        raise ValueError(f"{where}: part.num must have shape {shape[:1]} (one count per device), got "
                         f"{jnp.shape(part.num)}")
    check_count(part.num, shape[1], where)
    mass = getattr(part, "mass", None)
    if mass is not None and jnp.shape(mass) != shape[:2]:
        raise ValueError(f"{where}: part.mass must have shape {shape[:2]} (one mass per row of part.pos), got "
                         f"{jnp.shape(mass)}")


def _capacity(capacity: int | None, part: Any) -> int:
    if capacity is None:
        return row_count(part)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int (particles a device may receive), got {capacity!r}")
    return capacity


def local_paint(part: Any, shape: Sequence[int], *, box: Any, spec: Any = None, capacity: int | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Cloud-in-cell mass assignment onto this device's block of a distributed grid (local view).

    Particles first travel to the device owning their lower grid point (``sx.comm.exchange``); each deposits its
    mass on the 8 surrounding grid points of its block padded by one halo plane on the high side of every split
    axis, and the halo contributions are added to the next device's first plane (a one-sided halo exchange with
    ``sx.comm.shift``, diagonal neighbours included). The box is periodic.

    Args:
        part: particles (`pos (n, 3)`, `num`, optional `mass (n,)`; unit masses without it).
        shape: global grid shape ``(n0, n1, n2)``; grid point ``i`` sits at ``i * box / n``.
        box: periodic box size, one number or three.
        spec: the field's split over mesh axes (every axis of size > 1 must appear); ignored outside ``smap``.
        capacity: particles a device may receive (default: the capacity of ``part``).

    Returns:
        ``(block, needed)``: this device's block of the mass field and the most particles any device had to
        receive (greater than ``capacity`` means particles were dropped: retry with a larger ``capacity``).

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> part = sx.particles.Particles(pos=jnp.array([[0.25, 0.5, 0.5]]), num=jnp.int32(1))
        >>> rho, _ = sx.fields.local_paint(part, (4, 4, 4), box=1.0)
        >>> float(rho.sum()), float(rho[1, 2, 2])
        (1.0, 1.0)
    """
    _check(part, "local_paint")
    check_part(part, box, "local_paint")
    grid = Grid.local(shape, spec, box, "local_paint")
    capacity = _capacity(capacity, part)
    n = row_count(part)
    mass = jnp.ones((n,), part.pos.dtype) if getattr(part, "mass", None) is None else \
        jnp.broadcast_to(jnp.asarray(part.mass, part.pos.dtype), (n,))
    moved, num, needed = _to_owners(part, grid, capacity, {"mass": mass})
    received = jnp.arange(capacity, dtype=jnp.int32) < num
    lower, frac = cell_index(jnp.where(received[:, None], moved["pos"], 0), grid)
    weight = jnp.where(received, moved["mass"], 0)
    padded_shape = _padded_shape(grid)
    starts = grid.block_start()
    size = math.prod(padded_shape)
    padded = jnp.zeros((size,), part.pos.dtype)
    for corner in _CORNERS:
        # Empty rows of the receive buffer point past the block and are dropped: at index 0 their zeros would pile
        # onto one address, which a GPU serialises (tens of milliseconds for millions of rows).
        index = jnp.where(received, _flat_corner(lower, corner, grid, starts, padded_shape), size)
        padded = padded.at[index].add(weight * _weights(frac, corner), mode="drop")
    return fold_halo(padded.reshape(padded_shape), grid), needed


def local_readout(field: jax.Array, part: Any, *, box: Any, spec: Any = None, capacity: int | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Cloud-in-cell interpolation of a distributed field at this device's particles (local view).

    Particles travel to the device owning their lower grid point, read the 8 surrounding grid points from the
    block extended by the next device's first plane along every split axis, and the values travel back to the
    particles' rows. Trailing axes of ``field`` are components read together: one trip of the particles for all of
    them (e.g. the three components of a force, stacked on the last axis).

    Args:
        field: this device's block of the field, `(b0, b1, b2)` or `(b0, b1, b2, *components)`.
        part: particles (`pos (n, 3)`, `num`).
        box: periodic box size, one number or three.
        spec: the field's split over mesh axes (of its first three axes); ignored outside ``smap``.
        capacity: particles a device may receive (default: the capacity of ``part``).

    Returns:
        ``(values, needed)``: `values (n, *components)` aligned with ``part``'s rows (0 on padding rows) and the
        most particles any device had to receive.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> part = sx.particles.Particles(pos=jnp.array([[0.125, 0.0, 0.0]]), num=jnp.int32(1))
        >>> field = jnp.arange(64.0).reshape(4, 4, 4)
        >>> values, _ = sx.fields.local_readout(field, part, box=1.0)
        >>> float(values[0])
        8.0
    """
    _check(part, "local_readout")
    check_part(part, box, "local_readout")
    if np.ndim(field) < 3:
        raise ValueError(f"local_readout: field must be this device's 3D block (with optional trailing component "
                         f"axes), got shape {np.shape(field)}")
    grid = Grid.from_block(np.shape(field)[:3], spec, box, "local_readout")
    components = tuple(np.shape(field)[3:])
    capacity = _capacity(capacity, part)
    n = row_count(part)
    rank, size, _ = rank_info()
    extra = {} if size == 1 else {"row": jnp.arange(n, dtype=jnp.int32), "origin": jnp.full((n,), rank, jnp.int32)}
    moved, num, needed = _to_owners(part, grid, capacity, extra)
    padded_shape = _padded_shape(grid)
    padded = extend_halo(field, grid).reshape(math.prod(padded_shape), *components)
    received = jnp.arange(capacity, dtype=jnp.int32) < num
    lower, frac = cell_index(jnp.where(received[:, None], moved["pos"], 0), grid)
    starts = grid.block_start()
    values = jnp.zeros((capacity, *components), jnp.result_type(field))
    for corner in _CORNERS:
        index = _flat_corner(lower, corner, grid, starts, padded_shape)
        weight = _weights(frac, corner).reshape((capacity,) + (1,) * len(components))
        values = values + jnp.take(padded, index, axis=0, mode="fill", fill_value=0) * weight
    if size == 1:  # the rows never left
        kept = (jnp.arange(n, dtype=jnp.int32) < num).reshape((n,) + (1,) * len(components))
        return jnp.where(kept, _resized(values, n), 0), needed
    back, _, _ = comm.exchange({"value": values, "row": moved["row"]}, moved["origin"], num=num, capacity=n)
    rows = jnp.where(jnp.arange(n, dtype=jnp.int32) < part.num, back["row"], n)
    out = jnp.zeros((n, *components), values.dtype).at[rows].set(back["value"], mode="drop")
    return out, needed


def _rows(part: Any) -> dict[str, jax.Array]:
    """The global particle arrays the kernels need (``None`` fields left out)."""
    rows = {"pos": part.pos, "num": part.num}
    if getattr(part, "mass", None) is not None:
        rows["mass"] = part.mass
    return rows


def _local_part(rows: dict[str, jax.Array]) -> Particles:
    """One device's particles from its ``(1, ...)`` slices of the global arrays."""
    local = {name: a.reshape(a.shape[1:]) for name, a in rows.items()}
    return Particles(pos=local["pos"], num=local["num"], mass=local.get("mass"))


def _raise_nonfinite(name: str, count: int) -> None:
    if count:
        raise ValueError(f"{name}: {count} particle(s) have NaN or infinite coordinates in part.pos; remove or fix them")


def _raise_capacity(name: str, needed: int, capacity: int) -> None:
    if needed > capacity:
        raise CapacityError(f"{name}: a device had to receive {needed} particles but capacity is {capacity}; pass "
                            f"capacity={needed} or more", needed=needed, available=capacity, argument="capacity")


def _particle_mesh(part: Any, mesh: Mesh | None) -> Mesh:
    sharding = getattr(part.pos, "sharding", None)
    if mesh is None and isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        return sharding.mesh
    return default_mesh(mesh)


def _checks(local: Particles, needed: jax.Array) -> tuple[jax.Array, ...]:
    """The kernel's replicated error flags: particles a device had to receive, non-finite rows, the positions'
    span (:func:`_raise_errors` reads them after the call)."""
    return (needed, *mapped_checks(local.pos, local.num))


def _raise_errors(name: str, checks: tuple[jax.Array, ...], box: Any, capacity: int) -> None:
    """The errors of a call of ``name`` from its :func:`_checks` (one transfer); the box first, as a box that does
    not fit the data makes the other counts meaningless."""
    needed, nonfinite, lower, upper = jax.device_get(checks)
    check_bounds(lower, upper, box, name)
    _raise_nonfinite(name, int(nonfinite))
    _raise_capacity(name, int(needed), capacity)


@functools.lru_cache(maxsize=64)
def _paint_fn(mesh: Mesh, shape: tuple[int, ...], box: Any, spec: PartitionSpec, capacity: int | None,
              backend: str) -> Any:
    """The mapped kernel; ``backend`` (the tuning preset, read at trace time) keys the cache: one trace per preset."""
    def body(rows: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        local = _local_part(rows)
        field, needed = local_paint(local, shape, box=box, spec=spec, capacity=capacity)
        return field, _checks(local, needed)
    return smap(body, in_specs=(PartitionSpec(ALL),), out_specs=(spec, PartitionSpec()), mesh=mesh, expand=False,
                jit=True)


def paint(part: Any, shape: Sequence[int], *, box: Any, mesh: Mesh | None = None, spec: Any = None,
          capacity: int | None = None) -> jax.Array:
    """Cloud-in-cell mass field of distributed particles on a distributed periodic grid.

    Args:
        part: global particles (fields `(ndev, cap, ...)`, `num (ndev,)`, as from ``sx.particles.from_numpy``).
        shape: global grid shape ``(n0, n1, n2)``; grid point ``i`` sits at ``i * box / n``.
        box: periodic box size, one number or three.
        mesh: the mesh (default: that of ``part.pos``, else the context mesh, else ``sx.flat_mesh()``).
        spec: the field's ``PartitionSpec`` (default: ``P(*mesh.axis_names)``, slabs on 1D meshes and pencils on
            2D ones); it must split over every mesh axis of size > 1.
        capacity: particles a device may receive (default: the particle capacity).

    Returns:
        The mass assigned to each grid point, `(n0, n1, n2)`, sharded by ``spec``; it sums to the total mass.

    Raises:
        CapacityError: a device had to receive more than ``capacity`` particles (nothing is returned half done).
            Under an outer ``jax.jit`` nothing is checked: pass a ``capacity`` that holds every particle.

    Example:
        >>> import numpy as np, shardax as sx
        >>> part = sx.particles.from_numpy(np.random.default_rng(0).random((1000, 3)), mesh=sx.flat_mesh("d"))
        >>> rho = sx.fields.paint(part, (16, 16, 16), box=1.0)
        >>> round(float(rho.sum()))
        1000
    """
    _check_global(part, "paint")
    the_mesh = _particle_mesh(part, mesh)
    the_spec = default_spec(the_mesh) if spec is None else spec
    shape3 = _shape3(shape)
    box_key = box if isinstance(box, int | float) else _box3(box)
    backend = tuning_backend(the_mesh.devices)
    field, checks = _paint_fn(the_mesh, shape3, box_key, the_spec, capacity, backend)(_rows(part))
    if not isinstance(checks[0], Tracer):  # (under an outer jit nothing can be checked)
        _raise_errors("paint", checks, box, capacity or part.pos.shape[1])
    return field


@functools.lru_cache(maxsize=64)
def _readout_fn(mesh: Mesh, box: Any, spec: PartitionSpec, capacity: int | None, backend: str) -> Any:
    """As :func:`_paint_fn`."""
    def body(field: jax.Array, rows: dict[str, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        local = _local_part(rows)
        values, needed = local_readout(field, local, box=box, spec=spec, capacity=capacity)
        return values[None], _checks(local, needed)
    return smap(body, in_specs=(spec, PartitionSpec(ALL)), out_specs=(PartitionSpec(ALL), PartitionSpec()), mesh=mesh,
                expand=False, jit=True)


def readout(field: jax.Array, part: Any, *, box: Any, mesh: Mesh | None = None, spec: Any = None,
            capacity: int | None = None) -> jax.Array:
    """Cloud-in-cell interpolation of a distributed field at distributed particles (the transpose of :func:`paint`).

    Args:
        field: global field `(n0, n1, n2)`, or `(n0, n1, n2, *components)` to read several components in one trip
            of the particles (its sharding gives the mesh and spec unless passed).
        part: global particles (fields `(ndev, cap, ...)`, `num (ndev,)`).
        box: periodic box size, one number or three.
        mesh: the mesh (default: the field's).
        spec: the field's ``PartitionSpec`` (default: the field's own).
        capacity: particles a device may receive (default: the particle capacity).

    Returns:
        `(ndev, cap, *components)` interpolated values aligned with ``part``'s rows (0 on padding rows), sharded
        like ``part``.

    Example:
        >>> import numpy as np, shardax as sx
        >>> part = sx.particles.from_numpy(np.random.default_rng(0).random((1000, 3)), mesh=sx.flat_mesh("d"))
        >>> rho = sx.fields.paint(part, (16, 16, 16), box=1.0)
        >>> sx.fields.readout(rho, part, box=1.0).shape == part.pos.shape[:2]
        True
    """
    _check_global(part, "readout")
    the_mesh, the_spec = field_sharding(field, mesh, spec, "readout")
    box_key = box if isinstance(box, int | float) else _box3(box)
    backend = tuning_backend(the_mesh.devices)
    values, checks = _readout_fn(the_mesh, box_key, the_spec, capacity, backend)(field, _rows(part))
    if not isinstance(checks[0], Tracer):
        _raise_errors("readout", checks, box, capacity or part.pos.shape[1])
    return values

"""Cloud-in-cell mass assignment of distributed particles onto a distributed grid, and interpolation back."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _flags, comm
from .._alltoallv import alltoallv_many, exchange_counts_and_max
from .._bounds import bounds_layout, check_bounds, check_part, local_checks, split_span
from .._errors import CapacityError
from .._exchange import default_chunk
from .._order import after
from .._pytree import check_count, check_global, check_positions, particle_set, row_count
from .._tuning import tuning_backend
from ..core import ALL, default_mesh, rank_info, smap
from ..particles import Particles
from ._grid import Grid, _box3, _shape3, cell_index, default_spec, field_sharding

_CORNERS = tuple(itertools.product((0, 1), repeat=3))


def _resized(a: jax.Array, rows: int) -> jax.Array:
    """``a`` cut or padded with zero rows to ``rows`` rows."""
    return jnp.pad(a, [(0, max(rows - a.shape[0], 0))] + [(0, 0)] * (a.ndim - 1))[:rows]


#: The global functions' checks, computed from ``needed`` among the kernel's collectives (see :func:`_to_owners`):
#: the packed flags, and an output of their collective (what the next collectives wait for).
Checks = Callable[[jax.Array], tuple[jax.Array, jax.Array]]


class _Owned(NamedTuple):
    """Particles at the device owning their lower grid point (:func:`_to_owners`)."""

    rows: dict[str, jax.Array]  # received rows, `(capacity, ...)` each
    num: jax.Array  # rows held (at most ``capacity``)
    needed: jax.Array  # the most rows any device had to receive (above ``capacity`` some were dropped)
    back: tuple[jax.Array, ...] | None  # the return trip: perm, send and receive counts, largest count; one device: None
    flags: jax.Array | None = None  # the global function's checks (``checks`` of :func:`_to_owners`)


def _to_owners(part: Any, grid: Grid, capacity: int, extra: dict[str, jax.Array],
               checks: Checks | None = None) -> _Owned:
    """Send every valid particle (with ``extra`` per-row leaves) to the device owning its lower grid point.

    The route is kept, so values computed there go back to the particles' rows (:func:`_send_back`) without sorting
    them again or exchanging counts. On one device (decided at trace time) the rows stay in place: no
    destinations, counts or exchange. Each collective follows the one before it (the count exchange, the largest
    count received, ``checks(needed)``, the rounds): collectives that do not depend on each other could run in
    different orders on different devices of a program read back from a compilation cache.
    """
    n = row_count(part)
    valid = jnp.arange(n, dtype=jnp.int32) < part.num
    # Padding rows may hold anything (NaN included): zeros keep them finite here, in the exchange and in gradients.
    tree = {"pos": jnp.where(valid[:, None], part.pos, 0), **extra}
    _, size, axes = rank_info()
    if size == 1:
        num = jnp.asarray(part.num, jnp.int32)
        needed = comm.allreduce(num, "max")  # (the same value, typed as replicated over a size-1 mesh axis)
        return _Owned({name: _resized(a, capacity) for name, a in tree.items()}, jnp.minimum(num, capacity), needed,
                      None, None if checks is None else checks(needed)[0])
    lower, _ = cell_index(tree["pos"], grid)
    # Grouped by a sort of one word per row: no histogram scatter-add (a GPU serialises adds onto a few addresses).
    perm, send_counts = comm.group_by_rank(jnp.where(valid, grid.owner(lower), size), size)
    recv_counts, largest = exchange_counts_and_max(send_counts, axes)
    needed = comm.allreduce(jnp.sum(recv_counts).astype(jnp.int32), "max")
    flags, checked = (None, None) if checks is None else checks(needed)
    largest = after(largest, (needed, checked))  # (the rounds, whose number it sets, after those)
    names = list(tree)
    outs, _, _ = alltoallv_many([tree[name] for name in names], send_counts, capacity, axes, "auto",
                                default_chunk(capacity, size), perm=perm, plan=(recv_counts, largest))
    num = jnp.minimum(jnp.sum(recv_counts), capacity).astype(jnp.int32)
    return _Owned(dict(zip(names, outs, strict=True)), num, needed, (perm, send_counts, recv_counts, largest), flags)


def _send_back(values: jax.Array, owned: _Owned, part: Any) -> jax.Array:
    """Per-row ``values`` `(capacity, ...)` of the owned rows back to the rows of ``part`` they came from, `(n, ...)`
    (zeros on padding rows and on rows that did not fit at their owner)."""
    n = row_count(part)
    trailing = (1,) * (values.ndim - 1)
    if owned.back is None:  # the rows never left
        kept = (jnp.arange(n, dtype=jnp.int32) < owned.num).reshape((n, *trailing))
        return jnp.where(kept, _resized(values, n), 0)
    perm, send_counts, recv_counts, largest = owned.back
    _, size, axes = rank_info()
    # Each owner returns what it got from each device in the order it came, i.e. in that device's send order; the
    # counts are the forward ones the other way round. A zero row past the buffer answers rows that did not fit
    # (the chunked rounds read it for them; ragged_all_to_all would read past the buffer, as in the exchange's
    # own gradient, shardax._alltoallv_ad).
    padded = jnp.concatenate([values, jnp.zeros((1, *values.shape[1:]), values.dtype)])
    (back,), _, _ = alltoallv_many([padded], recv_counts, n, axes, "chunked", default_chunk(n, size),
                                   plan=(send_counts, largest))
    at = jnp.where(jnp.arange(n, dtype=jnp.int32) < jnp.sum(send_counts), perm, n)
    return jnp.zeros((n, *values.shape[1:]), values.dtype).at[at].set(back, mode="drop")


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


def extend_halo(block: jax.Array, grid: Grid, deps: Any = ()) -> jax.Array:
    """Append to every split axis the first plane of the next device (periodic): the high halo CIC reads. Its
    collectives follow those that made ``deps`` (collectives that do not depend on each other could run in different
    orders on different devices of a program read back from a compilation cache)."""
    for dim, group in enumerate(grid.split):
        if not group:
            continue
        received = comm.shift(after(jax.lax.slice_in_dim(block, 0, 1, axis=dim), deps), -1, axis=group)
        deps = ()
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


# What takes a global (ndev, n, 3) array instead of each local view (named in its errors).
_GLOBAL_VIEWS = {"local_paint": "sx.fields.paint", "local_readout": "sx.fields.readout",
                 "local_paint_readout": "an sx.smap of local_paint_readout"}


def _local_set(part: Any, where: str) -> Any:
    """``part`` as a particle pytree (a plain `(n, 3)` position array: every row a particle of unit mass), checked:
    3D positions, finite valid rows."""
    part = particle_set(part, where, dims=(3,), global_view=_GLOBAL_VIEWS[where])
    check_positions(part, where)
    if jnp.shape(part.pos)[1] != 3:
        raise ValueError(f"{where}: part.pos must have 3 columns (3D positions), got {jnp.shape(part.pos)}")
    if not isinstance(part.pos, Tracer) and not isinstance(part.num, Tracer):
        _raise_nonfinite(where, int(_nonfinite(part)))
    return part


def _nonfinite(part: Any) -> jax.Array:
    """Valid rows with a NaN or infinite coordinate, over every device of the context."""
    valid = jnp.arange(row_count(part), dtype=jnp.int32) < part.num
    return comm.allreduce(jnp.sum(valid & ~jnp.all(jnp.isfinite(part.pos), axis=1), dtype=jnp.int32))


def _check_global(part: Any, where: str) -> Any:
    """The positions ``(ndev, n, 3)`` of global particles (a pytree, or a plain array of positions), with clear
    errors for what the mapped kernels could not take."""
    pos = check_global(part, where, f"local_{where}")
    shape = jnp.shape(pos)
    if shape[2] != 3:
        raise ValueError(f"{where}: positions must have shape (ndev, n, 3) (e.g. from shardax.particles.from_numpy), "
                         f"got {shape}; local_{where} takes the local view")
    if jnp.result_type(pos) not in (jnp.float32, jnp.float64):
        raise TypeError(f"{where}: part.pos must be float32 or float64, got dtype {jnp.result_type(pos)}")
    if pos is part:
        return pos
    if jnp.shape(part.num) != shape[:1]:
        raise ValueError(f"{where}: part.num must have shape {shape[:1]} (one count per device), got "
                         f"{jnp.shape(part.num)}")
    check_count(part.num, shape[1], where)
    mass = getattr(part, "mass", None)
    if mass is not None and jnp.shape(mass) != shape[:2]:
        raise ValueError(f"{where}: part.mass must have shape {shape[:2]} (one mass per row of part.pos), got "
                         f"{jnp.shape(mass)}")
    return pos


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
        part: particles (`pos (n, 3)`, `num`, optional `mass (n,)`; unit masses without it), or a plain `(n, 3)`
            array of positions.
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
    field, needed, _ = _paint(part, shape, box, spec, capacity)
    return field, needed


def _paint(part: Any, shape: Sequence[int], box: Any, spec: Any, capacity: int | None,
           checks: Checks | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """:func:`local_paint`, and ``checks(needed)`` computed in its place among the collectives."""
    part = _local_set(part, "local_paint")
    check_part(part, box, "local_paint")
    grid = Grid.local(shape, spec, box, "local_paint")
    owned = _to_owners(part, grid, _capacity(capacity, part), {"mass": _masses(part)}, checks=checks)
    return _deposit(owned, grid, part.pos.dtype), owned.needed, owned.flags


def _masses(part: Any) -> jax.Array:
    """`(n,)` the particles' masses in the positions' dtype (ones without a ``mass`` field)."""
    n = row_count(part)
    if getattr(part, "mass", None) is None:
        return jnp.ones((n,), part.pos.dtype)
    return jnp.broadcast_to(jnp.asarray(part.mass, part.pos.dtype), (n,))


def _deposit(owned: _Owned, grid: Grid, dtype: Any) -> jax.Array:
    """This device's block of the CIC mass field of the owned rows (halo contributions folded in)."""
    capacity = owned.rows["pos"].shape[0]
    received = jnp.arange(capacity, dtype=jnp.int32) < owned.num
    lower, frac = cell_index(jnp.where(received[:, None], owned.rows["pos"], 0), grid)
    weight = jnp.where(received, owned.rows["mass"], 0)
    padded_shape = _padded_shape(grid)
    starts = grid.block_start()
    size = math.prod(padded_shape)
    padded = jnp.zeros((size,), dtype)
    for corner in _CORNERS:
        # Empty rows of the receive buffer point past the block and are dropped: at index 0 their zeros would pile
        # onto one address, which a GPU serialises (tens of milliseconds for millions of rows).
        index = jnp.where(received, _flat_corner(lower, corner, grid, starts, padded_shape), size)
        padded = padded.at[index].add(weight * _weights(frac, corner), mode="drop")
    return fold_halo(padded.reshape(padded_shape), grid)


def _interpolate(padded: jax.Array, owned: _Owned, grid: Grid) -> jax.Array:
    """`(capacity, *components)` the CIC interpolation at the owned rows of this device's block of a field, with its
    halo planes (:func:`extend_halo`)."""
    components = padded.shape[3:]
    capacity = owned.rows["pos"].shape[0]
    padded_shape = _padded_shape(grid)
    padded = padded.reshape(math.prod(padded_shape), *components)
    received = jnp.arange(capacity, dtype=jnp.int32) < owned.num
    lower, frac = cell_index(jnp.where(received[:, None], owned.rows["pos"], 0), grid)
    starts = grid.block_start()
    values = jnp.zeros((capacity, *components), padded.dtype)
    for corner in _CORNERS:
        index = _flat_corner(lower, corner, grid, starts, padded_shape)
        weight = _weights(frac, corner).reshape((capacity,) + (1,) * len(components))
        values = values + jnp.take(padded, index, axis=0, mode="fill", fill_value=0) * weight
    return values


def local_readout(field: jax.Array, part: Any, *, box: Any, spec: Any = None, capacity: int | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """Cloud-in-cell interpolation of a distributed field at this device's particles (local view).

    Particles travel to the device owning their lower grid point, read the 8 surrounding grid points from the
    block extended by the next device's first plane along every split axis, and the values travel back to the
    particles' rows. Trailing axes of ``field`` are components read together: one trip of the particles for all of
    them (e.g. the three components of a force, stacked on the last axis).

    Args:
        field: this device's block of the field, `(b0, b1, b2)` or `(b0, b1, b2, *components)`.
        part: particles (`pos (n, 3)`, `num`), or a plain `(n, 3)` array of positions.
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
    values, needed, _ = _readout(field, part, box, spec, capacity)
    return values, needed


def _readout(field: jax.Array, part: Any, box: Any, spec: Any, capacity: int | None,
             checks: Checks | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """:func:`local_readout`, and ``checks(needed)`` computed in its place among the collectives."""
    part = _local_set(part, "local_readout")
    check_part(part, box, "local_readout")
    if np.ndim(field) < 3:
        raise ValueError(f"local_readout: field must be this device's 3D block (with optional trailing component "
                         f"axes), got shape {np.shape(field)}")
    grid = Grid.from_block(np.shape(field)[:3], spec, box, "local_readout")
    owned = _to_owners(part, grid, _capacity(capacity, part), {}, checks=checks)
    # The halo's collectives after the particles' exchange (the two do not depend on each other).
    padded = extend_halo(jnp.asarray(field), grid, owned.rows["pos"])
    return _send_back(_interpolate(padded, owned, grid), owned, part), owned.needed, owned.flags


def local_paint_readout(part: Any, shape: Sequence[int], solve: Callable[[jax.Array], jax.Array], *, box: Any,
                        spec: Any = None, capacity: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Paint particles, turn the mass field into other fields, and read those at the same particles (local view).

    The same as :func:`local_paint`, ``solve`` and :func:`local_readout` in a row, with the particles sent once to
    the devices owning their grid points and their values once back (instead of twice there and once back), and
    no second sort: the values return by the route the particles came (the particle-mesh pattern: a density
    through a Poisson solve to forces, or a smoothed density at each particle). The results are the same bits.

    Args:
        part: particles (`pos (n, 3)`, `num`, optional `mass (n,)`; unit masses without it), or a plain `(n, 3)`
            array of positions.
        shape: global grid shape ``(n0, n1, n2)``; grid point ``i`` sits at ``i * box / n``.
        solve: maps this device's block of the mass field `(b0, b1, b2)` to the block of the fields to read,
            `(b0, b1, b2)` or `(b0, b1, b2, *components)`, split like the mass field (it may call collectives:
            ``sx.fft.local_rfftn`` and friends, with the same ``spec``).
        box: periodic box size, one number or three.
        spec: the fields' split over mesh axes (every axis of size > 1 must appear); ignored outside ``smap``.
        capacity: particles a device may receive (default: the capacity of ``part``).

    Returns:
        ``(values, needed)``: `values (n, *components)` aligned with ``part``'s rows (0 on padding rows) and the most
        particles any device had to receive (greater than ``capacity`` means particles were dropped: retry with a
        larger ``capacity``).

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> part = sx.particles.Particles(pos=jnp.array([[0.25, 0.5, 0.5], [0.5, 0.5, 0.5]]), num=jnp.int32(2))
        >>> values, _ = sx.fields.local_paint_readout(part, (4, 4, 4), lambda rho: 2 * rho, box=1.0)
        >>> values.tolist()
        [2.0, 2.0]
    """
    part = _local_set(part, "local_paint_readout")
    check_part(part, box, "local_paint_readout")
    grid = Grid.local(shape, spec, box, "local_paint_readout")
    owned = _to_owners(part, grid, _capacity(capacity, part), {"mass": _masses(part)})
    field = jnp.asarray(solve(_deposit(owned, grid, part.pos.dtype)))
    if field.ndim < 3 or field.shape[:3] != grid.block:
        raise ValueError(f"local_paint_readout: solve must return this device's block {grid.block} of the fields "
                         f"(with optional trailing component axes), got shape {field.shape}")
    # (as in readout, so that the values are the same bits: the solve already follows the exchange)
    padded = extend_halo(field, grid, owned.rows["pos"])
    return _send_back(_interpolate(padded, owned, grid), owned, part), owned.needed


def _rows(part: Any) -> dict[str, jax.Array]:
    """The global particle arrays the kernels need (``None`` fields left out; a plain position array alone)."""
    if isinstance(part, jax.Array | np.ndarray):
        return {"pos": jnp.asarray(part)}
    rows = {"pos": part.pos, "num": part.num}
    if getattr(part, "mass", None) is not None:
        rows["mass"] = part.mass
    return rows


def _local_part(rows: dict[str, jax.Array]) -> Particles:
    """One device's particles from its ``(1, ...)`` slices of the global arrays."""
    local = {name: a.reshape(a.shape[1:]) for name, a in rows.items()}
    if "num" not in local:  # a plain position array: every row a particle of unit mass
        return particle_set(local["pos"], "paint", dims=(3,))
    return Particles(pos=local["pos"], num=local["num"], mass=local.get("mass"))


def _raise_nonfinite(name: str, count: int) -> None:
    if count:
        raise ValueError(f"{name}: {count} particle(s) have NaN or infinite coordinates in part.pos; remove or fix them")


def _raise_capacity(name: str, needed: int, capacity: int) -> None:
    if needed > capacity:
        raise CapacityError(f"{name}: a device had to receive {needed} particles but capacity is {capacity}; pass "
                            f"capacity={needed} or more", needed=needed, available=capacity, argument="capacity")


def _particle_mesh(pos: Any, mesh: Mesh | None) -> Mesh:
    sharding = getattr(pos, "sharding", None)
    if mesh is None and isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        return sharding.mesh
    return default_mesh(mesh)


def _checks(local: Particles) -> Checks:
    """The kernel's replicated error flags, packed, from ``needed`` (the particles a device had to receive): that,
    the non-finite rows and the positions' span (:func:`_raise_errors` reads them after the call). Their one
    collective runs after the all-reduce of ``needed``, before the particles travel (:func:`_to_owners`)."""
    def checks(needed: jax.Array) -> tuple[jax.Array, jax.Array]:
        bad, span = local_checks(local.pos, local.num)
        _, (nonfinite,), (both,) = _flags.across(needed, total=[bad], minimum=[span])
        return _flags.pack(needed, nonfinite, *split_span(both)), nonfinite  # (the latter: the all-gather's output)

    return checks


def _raise_errors(name: str, checks: jax.Array, pos: Any, box: Any, capacity: int) -> None:
    """The errors of a call of ``name`` on positions ``pos`` from its :func:`_checks` (one transfer); the box
    first, as a box that does not fit the data makes the other counts meaningless."""
    needed, nonfinite, lower, upper = _flags.unpack(checks, 1, 1, *bounds_layout(pos))
    check_bounds(lower, upper, box, name)
    _raise_nonfinite(name, int(nonfinite[0]))
    _raise_capacity(name, int(needed[0]), capacity)


@functools.lru_cache(maxsize=64)
def _paint_fn(mesh: Mesh, shape: tuple[int, ...], box: Any, spec: PartitionSpec, capacity: int | None,
              backend: str) -> Any:
    """The mapped kernel; ``backend`` (the tuning preset, read at trace time) keys the cache: one trace per preset."""
    def body(rows: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        local = _local_part(rows)
        field, _, flags = _paint(local, shape, box, spec, capacity, checks=_checks(local))
        assert flags is not None  # (given checks, there are flags)
        return field, flags
    return smap(body, in_specs=(PartitionSpec(ALL),), out_specs=(spec, PartitionSpec()), mesh=mesh, expand=False,
                jit=True)


def paint(part: Any, shape: Sequence[int], *, box: Any, mesh: Mesh | None = None, spec: Any = None,
          capacity: int | None = None) -> jax.Array:
    """Cloud-in-cell mass field of distributed particles on a distributed periodic grid.

    Args:
        part: global particles (fields `(ndev, cap, ...)`, `num (ndev,)`, as from ``sx.particles.from_numpy``),
            or a plain `(ndev, cap, 3)` array of positions (every row a particle of unit mass).
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
    pos = _check_global(part, "paint")
    the_mesh = _particle_mesh(pos, mesh)
    the_spec = default_spec(the_mesh) if spec is None else spec
    shape3 = _shape3(shape)
    box_key = box if isinstance(box, int | float) else _box3(box)
    backend = tuning_backend(the_mesh.devices)
    field, checks = _paint_fn(the_mesh, shape3, box_key, the_spec, capacity, backend)(_rows(part))
    if not _flags.is_traced(checks):  # (under an outer jit nothing can be checked)
        _raise_errors("paint", checks, pos, box, capacity or pos.shape[1])
    return field


@functools.lru_cache(maxsize=64)
def _readout_fn(mesh: Mesh, box: Any, spec: PartitionSpec, capacity: int | None, backend: str) -> Any:
    """As :func:`_paint_fn`."""
    def body(field: jax.Array, rows: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        local = _local_part(rows)
        values, _, flags = _readout(field, local, box, spec, capacity, checks=_checks(local))
        assert flags is not None  # (given checks, there are flags)
        return values[None], flags
    return smap(body, in_specs=(spec, PartitionSpec(ALL)), out_specs=(PartitionSpec(ALL), PartitionSpec()), mesh=mesh,
                expand=False, jit=True)


def readout(field: jax.Array, part: Any, *, box: Any, mesh: Mesh | None = None, spec: Any = None,
            capacity: int | None = None) -> jax.Array:
    """Cloud-in-cell interpolation of a distributed field at distributed particles (the transpose of :func:`paint`).

    Args:
        field: global field `(n0, n1, n2)`, or `(n0, n1, n2, *components)` to read several components in one trip
            of the particles (its sharding gives the mesh and spec unless passed).
        part: global particles (fields `(ndev, cap, ...)`, `num (ndev,)`), or a plain `(ndev, cap, 3)` array of
            positions.
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
    pos = _check_global(part, "readout")
    the_mesh, the_spec = field_sharding(field, mesh, spec, "readout")
    box_key = box if isinstance(box, int | float) else _box3(box)
    backend = tuning_backend(the_mesh.devices)
    values, checks = _readout_fn(the_mesh, box_key, the_spec, capacity, backend)(field, _rows(part))
    if not _flags.is_traced(checks):
        _raise_errors("readout", checks, pos, box, capacity or pos.shape[1])
    return values

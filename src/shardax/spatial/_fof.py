"""Friends-of-friends groups: ``fof`` in the local view (its global version ``fof.smap`` is in ``_fof_smap``).

``fof`` checks its input (:func:`_checked_problem`) and takes one of two paths, which share their named steps:

- one device (:func:`_one_device`): wrap the rows into the box, link them (:func:`_link`), sum the groups into a
  catalogue and label the members (:func:`_members`);
- several devices (:func:`_several_devices`): sort the rows into global z-order, a compact piece of space per
  device (:func:`_sort_into_pieces`); receive the boundary particles of the other pieces as ghosts
  (:func:`_add_ghosts`, ``_fof_ghosts``); link own rows and ghosts on a grid over the piece (:func:`_piece_space`,
  :func:`_link`); settle labels across devices (``merge_labels``); sum the groups, those that cross devices on a
  home device (:func:`_catalogue_across`); send the labels back to the rows they came from (:func:`_labels_home`).

Both end in :func:`_result`, which sets ``needed`` and ``overflow`` against the buffers of :func:`device_buffers`.
Groups are summarised into a :class:`Catalogue` by exact, order-independent sums (``_catalogue``). Sizes and algorithm
choices of the kernels come from a per-backend ``FofTuning``, passed as data.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from .._bounds import check_local
from .._eager import is_concrete, run_compiled
from .._exchange import share_chunk
from .._morton import box_vector
from .._order import after
from .._pytree import check_positions, particle_set
from .._zorder import bucket_sort
from ..core import rank_info
from ._catalogue import Catalogue, Partial, finish, partial_sums
from ._fof_ghosts import (
    INT_MAX,
    Ghosts,
    Pieces,
    boundary_totals,
    exchange_ghosts,
    merge_labels,
    piece_cells,
    segment_min_labels,
    send_grouped,
)
from ._fof_local import LinkSpace, components, find_links, link_grid, piece_space, sort_points, whole_space
from ._fof_tuning import Steps, Tuning, resolve, step_sizes

TuningName = Literal["cpu", "gpu"]


class FofResult(NamedTuple):
    """Result of :func:`fof`.

    Attributes:
        labels: `(n,)` int32 group label of each input row (smallest global input index of the group's members),
            -1 for rows in groups smaller than ``min_members`` and for padding rows.
        catalogue: the :class:`Catalogue` of the groups with at least ``min_members`` members; None when the
            call asked for labels only (``catalogue=False``).
        overflow: bool, true when a buffer was too small (results incomplete; the global wrapper raises
            :class:`shardax.CapacityError` instead).
        needed: `(4,)` int32 rows needed by ``edge_capacity``, ``halo_capacity``, ``max_groups`` and
            ``sort_capacity``, on this device.
    """

    labels: jax.Array
    catalogue: Catalogue | None
    overflow: jax.Array
    needed: jax.Array


class Buffers(NamedTuple):
    """The four buffers of a call, in the order of :attr:`FofResult.needed`: sizes (ints) or rows needed (arrays),
    or as requested by the caller (None: the default)."""

    edge_capacity: Any
    halo_capacity: Any
    max_groups: Any
    sort_capacity: Any


class _Rows(NamedTuple):
    """What travels with each particle through the z-order sort: only the fields the particles have."""

    pos: jax.Array
    num: jax.Array
    ids: jax.Array | None  # None while the sort numbers the rows
    mass: jax.Array | None
    vel: jax.Array | None


class _Problem(NamedTuple):
    """A checked call of :func:`fof`: the rows, the linking length and box in the positions' dtype, the options."""

    rows: _Rows
    linking_length: jax.Array
    box: jax.Array | None  # (d,) periodic box, or None for open boundaries
    box_arg: Any  # the box as the caller gave it (the z-order sort keys by it)
    min_members: int
    requested: Buffers  # buffer sizes as passed (None: the default)
    tuning: Tuning
    catalogue: bool  # False: labels only (the rows carry no masses or velocities, no group sums but the counts)


# ---- input ---------------------------------------------------------------------------------------------------------


def _positive_int(value: Any, name: str, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive Python int, got {value!r}")
    return value


def requested_buffers(**sizes: int | None) -> Buffers:
    """The buffer sizes a caller passed, each None or a positive int."""
    return Buffers(**{name: _positive_int(value, name, allow_none=True) for name, value in sizes.items()})


def _check_linking_length(linking_length: Any, box: Any, dtype: Any) -> jax.Array:
    """``linking_length`` as a ``dtype`` scalar; a concrete value (and ``box``, the user's box) is checked first."""
    if isinstance(linking_length, bool | str) or jnp.ndim(linking_length) != 0:
        raise TypeError(f"linking_length must be a positive scalar (absolute length), got {linking_length!r}")
    if not isinstance(linking_length, Tracer):
        # Checked on the given value: inside jit even a jnp copy of a Python number is a tracer.
        value = float(linking_length)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"linking_length must be positive and finite, got {linking_length!r}")
        info = np.finfo(dtype)
        if not np.sqrt(info.tiny) <= value <= np.sqrt(info.max):
            # Pairs are compared by squared distance: its square must be a normal number of the positions' dtype.
            raise ValueError(f"linking_length {value:g} is out of range for {info.dtype.name} positions (squared "
                             f"distances need {np.sqrt(info.tiny):.3g} <= linking_length <= {np.sqrt(info.max):.3g}); "
                             "rescale the positions (e.g. to box units) or use float64")
        if box is not None and not isinstance(box, Tracer) and value > 0.5 * float(np.min(box)):
            raise ValueError(f"linking_length {value} is larger than half the periodic box (the box is "
                             f"{np.asarray(box).tolist()}, half of it {0.5 * float(np.min(box)):g}); use a smaller "
                             "linking length or a larger box")
    return jnp.asarray(linking_length, dtype)


def _checked_problem(part: Any, linking_length: Any, *, box: Any, min_members: int, requested: Buffers,
                     tuning: Tuning | TuningName | None, catalogue: bool = True) -> _Problem:
    """The arguments of :func:`fof` checked (clear errors naming the argument) and gathered into a :class:`_Problem`."""
    if not isinstance(catalogue, bool):
        raise TypeError(f"fof: catalogue must be True or False (False: labels only), got {catalogue!r}")
    part = particle_set(part, "fof")
    n, dim = check_positions(part, "fof")
    if n == 0:
        raise ValueError("fof: part has no rows (part.pos has shape (0, d)); give it at least one padding row: the "
                         "empty set is one row with num=0")
    _positive_int(min_members, "min_members")
    pos = jnp.asarray(part.pos)
    dtype = pos.dtype
    boxv = box_vector(box, dim, dtype)
    ll = _check_linking_length(linking_length, box, dtype)
    resolved = resolve(tuning, "fof")
    num = jnp.clip(jnp.asarray(part.num, jnp.int32), 0, n)
    valid = jnp.arange(n, dtype=jnp.int32) < num
    if not isinstance(pos, Tracer) and not bool(jnp.all(jnp.isfinite(jnp.where(valid[:, None], pos, 0)))):
        raise ValueError("fof: part.pos has NaN or infinite coordinates; remove or fix those particles")
    check_local(pos, valid, box, "fof")
    # Labels only: masses and velocities enter no sum, so they do not travel with the rows.
    mass = getattr(part, "mass", None) if catalogue else None
    mass = None if mass is None else jnp.broadcast_to(jnp.asarray(mass, dtype), (n,))
    vel = getattr(part, "vel", None) if catalogue else None
    vel = None if vel is None else jnp.asarray(vel, dtype)
    ids = getattr(part, "ids", None)
    rows = _Rows(pos, num, None if ids is None else jnp.asarray(ids, jnp.int32), mass, vel)
    return _Problem(rows, ll, boxv, box, min_members, requested, resolved, catalogue)


# ---- the local view ------------------------------------------------------------------------------------------------


def fof(part: Any, linking_length: float | jax.Array, *, box: Any = None, min_members: int = 20,
        max_groups: int | None = None, edge_capacity: int | None = None, halo_capacity: int | None = None,
        sort_capacity: int | None = None, tuning: Tuning | TuningName | None = None,
        catalogue: bool = True) -> FofResult:
    """Friends-of-friends groups of a particle set (local view; ``fof.smap()`` for global arrays).

    Two particles closer than (or exactly at) ``linking_length`` are friends; groups are the transitive closure.
    Exact at every scale: labels are identical on 1 device and on any number of devices and processes.

    Args:
        part: particle pytree (``.pos (n, d)`` with ``d`` in {2, 3}, ``.num``; optional ``.mass (n,)``,
            ``.vel (n, d)``, ``.ids (n,)``), or a plain `(n, d)` position array (particles without fields, every
            row valid). Without ``ids``, rows are numbered in global (device, row) order.
        linking_length: absolute linking length (positive; at most half the periodic box).
        box: periodic box size (scalar or per axis), or None for open boundaries.
        min_members: smallest group that gets a label and a catalogue row.
        max_groups: catalogue rows per device (static); default ``(m + halo_capacity) // min_members + 16``, ``m``
            the rows after the sort (``sort_capacity``).
        edge_capacity: pairs per device the linking may hold (static); default ``e (m + halo_capacity) + 4096``
            with ``e`` the tuning's ``edges_per_row`` (8 in the CPU preset, 3 in the GPU one).
        halo_capacity: boundary particles per device sent and received (static, ignored on one device);
            default ``max(n // 4, 1024)``.
        sort_capacity: rows per device after the spatial sort (static, ignored on one device); default ``n``. The
            sort's pieces of space hold a device's share within a few percent (its splitters come from samples
            and sit on coarse cell boundaries), so particles filling their rows to the last need a few more.
        tuning: static sizes and algorithm choices of the linking (:class:`~shardax.spatial.FofTuning`): None
            for the backend's preset (``SHARDAX_TUNING`` overrides), ``"cpu"`` or ``"gpu"`` for a preset, or a
            ``FofTuning``. Labels are the same with every tuning.
        catalogue: False for labels only: no group sums but the member counts, ``catalogue`` None and
            ``max_groups`` unused (a smaller program that compiles and runs faster when the groups are summed
            elsewhere, e.g. by :func:`shardax.io.write_fof_table`). Labels are the same either way.

    Returns:
        :class:`FofResult`: ``labels (n,)`` aligned with the input rows, the ``catalogue``, ``overflow``, ``needed``.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.particles import Particles
        >>> from shardax.spatial import fof
        >>> pos = jnp.array([[0.0, 0, 0], [0.1, 0, 0], [0.5, 0, 0], [0.55, 0, 0]])
        >>> res = fof(Particles(pos=pos, num=jnp.int32(4)), 0.2, min_members=2)
        >>> res.labels.tolist(), res.catalogue.count[:2].tolist()
        ([0, 0, 2, 2], [2, 2])

    Global version: buffers left unset grow by themselves; one set explicitly raises on overflow::

        res = fof.smap()(part, 0.2 * spacing, box=1.0)
        try:
            res = fof.smap()(part, 0.2 * spacing, box=1.0, halo_capacity=4096)
        except sx.CapacityError as err:          # err.argument names the buffer, err.needed its size
            res = fof.smap()(part, 0.2 * spacing, box=1.0, **{err.argument: err.needed})
    """
    return _fof(part, linking_length, box=box, min_members=min_members, max_groups=max_groups,
                edge_capacity=edge_capacity, halo_capacity=halo_capacity, sort_capacity=sort_capacity,
                tuning=tuning, catalogue=catalogue)[0]


def _fof(part: Any, linking_length: float | jax.Array, *, box: Any, min_members: int, max_groups: int | None,
         edge_capacity: int | None, halo_capacity: int | None, sort_capacity: int | None,
         tuning: Tuning | TuningName | None, catalogue: bool = True) -> tuple[FofResult, Steps]:
    """:func:`fof`, and the sequential loop steps it took (:func:`fof_steps`): checks, then one of the two paths."""
    requested = requested_buffers(edge_capacity=edge_capacity, halo_capacity=halo_capacity, max_groups=max_groups,
                           sort_capacity=sort_capacity)
    problem = _checked_problem(part, linking_length, box=box, min_members=min_members, requested=requested,
                               tuning=tuning, catalogue=catalogue)
    rank, size, _ = rank_info()
    if size == 1:
        arrays = (problem.rows, problem.linking_length, problem.box)
        if is_concrete(arrays):  # called outside any trace: one program, not one dispatch per operation
            options = problem._replace(rows=None, linking_length=None, box=None, box_arg=None)
            return run_compiled(_one_device_of, arrays, options)
        return _one_device(problem)
    return _several_devices(problem, rank=rank, size=size)


def _one_device_of(arrays: tuple[_Rows, jax.Array, jax.Array | None], options: _Problem) -> tuple[FofResult, Steps]:
    """:func:`_one_device` of the problem made of ``arrays`` (rows, linking length, box) and the static
    ``options`` (the one-device path does not use ``box_arg``)."""
    rows, linking_length, box = arrays
    return _one_device(options._replace(rows=rows, linking_length=linking_length, box=box))


# ---- steps both paths share ----------------------------------------------------------------------------------------


def device_buffers(requested: Buffers, *, n: int, devices: int, min_members: int, tuning: Tuning) -> Buffers:
    """The buffer sizes of a device of ``n`` rows among ``devices``, the defaults of those ``requested`` as None
    resolved (on one device no rows travel: the rows are the particles' and there are no ghosts)."""
    if devices == 1:
        rows, ghosts = n, 0
    else:
        rows, ghosts = requested.sort_capacity or n, requested.halo_capacity or max(n // 4, 1024)
    edges = requested.edge_capacity or int(tuning.edges_per_row * (rows + ghosts)) + 4096
    return Buffers(edge_capacity=edges, halo_capacity=ghosts,
                   max_groups=requested.max_groups or (rows + ghosts) // min_members + 16, sort_capacity=rows)


class _Linked(NamedTuple):
    """The local groups of one device's rows (own rows, then ghosts on several devices)."""

    component: jax.Array  # (rows,) int32 smallest row of each row's local component
    labels: jax.Array  # (rows,) int32 smallest id of each row's local component
    num_edges: jax.Array  # pairs found (more than the edge capacity: overflow)
    steps: Steps


def _link(pos: jax.Array, valid: jax.Array, ids: jax.Array, *, space: LinkSpace, grid_pos: jax.Array,
          problem: _Problem, volume: jax.Array | None, edge_capacity: int) -> _Linked:
    """Link the valid rows of ``pos`` (`(r, d)`): a cell grid, the sort into it, the pairs, their components."""
    rows = pos.shape[0]
    ll, tuning = problem.linking_length, problem.tuning
    count = jnp.sum(valid, dtype=jnp.int32)
    table_cells = int(tuning.table * rows) + 64
    grid = link_grid(space, count, ll, tuning.per_cell, table_cells, volume)
    points = sort_points(pos, valid, space, grid, table_cells, tuning.rank_rounds, grid_pos)
    links = find_links(points, count, ll, space, grid, edge_capacity=edge_capacity, tuning=tuning)
    root, (sweeps, hooks, jumps) = components(links, rows, step_sizes(tuning, rows)[1])
    # Made once the components are known (``after``): XLA would otherwise hold them through the search.
    zeros, own_ids = after((jnp.zeros((rows,), jnp.int32), jnp.where(valid, ids, INT_MAX)), root)
    component = zeros.at[points.rows].set(points.rows[root])
    labels = segment_min_labels(own_ids, component)
    steps = Steps(points.rounds, links.steps, sweeps, hooks, jumps, jnp.int32(0), jnp.int32(0))
    return _Linked(component, labels, links.num_edges, steps)


def _mass_vel(rows: _Rows, m: int) -> tuple[jax.Array, jax.Array]:
    """Masses `(m,)` and velocities `(m, d)` of the rows: ones and zeros for the fields the particles lack."""
    dtype = rows.pos.dtype
    mass = jnp.ones((m,), dtype) if rows.mass is None else rows.mass
    vel = jnp.zeros((m, rows.pos.shape[1]), dtype) if rows.vel is None else rows.vel
    return mass, vel


def _members(labels: jax.Array, member: jax.Array) -> jax.Array:
    """The labels of the rows of groups with enough members, -1 elsewhere."""
    return jnp.where(member, labels, -1)


def _result(labels: jax.Array, catalogue: Catalogue | None, needed: Buffers, buffers: Buffers,
            exchange_overflow: jax.Array | None = None) -> FofResult:
    """The :class:`FofResult`: ``needed`` rows of each buffer, and overflow when one of them exceeds its size (or
    an exchange between devices overflowed)."""
    counts = jnp.stack([jnp.asarray(k) for k in needed]).astype(jnp.int32)
    overflow = jnp.any(counts > jnp.array(buffers, jnp.int32))
    if exchange_overflow is not None:
        overflow = exchange_overflow | overflow
    return FofResult(labels, catalogue, overflow, counts)


# ---- one device ----------------------------------------------------------------------------------------------------


def _wrap_into_box(pos: jax.Array, box: jax.Array | None) -> jax.Array:
    """Positions wrapped into ``[0, box)`` (unchanged without a box)."""
    return pos if box is None else pos - box[None, :] * jnp.floor(pos / box[None, :])


def _group_numbers(root: jax.Array, component: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """Each row's group number `(n,)` (groups numbered ``0, 1, ...`` in the order of their ``root (n,)`` rows;
    ``capacity`` for rows whose component has no root or whose group lies past ``capacity``: below ``capacity``
    exactly the members the sums take) and the number of groups."""
    number = jnp.cumsum(root, dtype=jnp.int32) - 1
    group = number[component]
    return jnp.where(root[component] & (group < capacity), group, capacity), jnp.sum(root, dtype=jnp.int32)


def _one_device(problem: _Problem) -> tuple[FofResult, Steps]:
    """FoF of the particles of one device: link them (in the box, wrapped), label, summarise the groups."""
    rows, box, min_members = problem.rows, problem.box, problem.min_members
    n = rows.pos.shape[0]
    buffers = device_buffers(problem.requested, n=n, devices=1, min_members=min_members, tuning=problem.tuning)
    pos = _wrap_into_box(rows.pos, box)
    index = jnp.arange(n, dtype=jnp.int32)
    valid = index < rows.num
    ids = index if rows.ids is None else rows.ids
    linked = _link(pos, valid, ids, space=whole_space(pos, valid, box), grid_pos=pos, problem=problem, volume=None,
                   edge_capacity=buffers.edge_capacity)
    # Only the members of groups large enough to keep enter the sums: with most particles in small groups (b = 0.2:
    # nearly all) the other rows are dropped from the sums' eight scatters instead of each adding to its own group.
    size = jax.ops.segment_sum(valid.astype(jnp.int32), jnp.where(valid, linked.component, n), n)
    member = valid & (size[linked.component] >= min_members)
    labels = _members(linked.labels, member)
    catalogue, groups_needed = None, jnp.int32(0)
    if problem.catalogue:
        # The groups kept are numbered in the order of their root rows, so the sums have a row per catalogue row,
        # not one per particle (the same rows in the same order: the same sums); groups past the catalogue are
        # dropped.
        mass, vel = _mass_vel(rows, n)
        root = member & (linked.component == index)
        groups, groups_needed = _group_numbers(root, linked.component, buffers.max_groups)
        parts = partial_sums(pos, mass, vel, groups, groups < buffers.max_groups, buffers.max_groups, box)
        label = jnp.full((buffers.max_groups,), -1, jnp.int32).at[jnp.where(root, groups, buffers.max_groups)].set(
            linked.labels, mode="drop")
        catalogue, _ = finish(parts, label, jnp.arange(buffers.max_groups) < groups_needed, buffers.max_groups, box)
    needed = Buffers(edge_capacity=linked.num_edges, halo_capacity=jnp.int32(0), max_groups=groups_needed,
                     sort_capacity=rows.num)
    return _result(labels, catalogue, needed, buffers), linked.steps


# ---- several devices -----------------------------------------------------------------------------------------------


class _Piece(NamedTuple):
    """A device's compact piece of space: its rows in global z-order, and every device's piece as cell boxes."""

    rows: _Rows  # (m,) rows held after the sort
    ids: jax.Array  # (m,) global id of each held row
    valid: jax.Array  # (m,) held rows that are particles
    routes: Any  # the sort's Routes: how the rows came, to send results back
    pieces: Pieces  # every device's piece (replicated)
    needed: jax.Array  # rows the sort needed on this device
    overflow: jax.Array


def _sort_into_pieces(problem: _Problem, *, capacity: int) -> _Piece:
    """Sort the rows into global z-order, ``capacity`` rows per device (numbered in global (device, row) order by
    the sort when the particles have no ids: the devices' counts travel with its samples, no scan)."""
    rows = problem.rows
    dtype = rows.pos.dtype
    result = bucket_sort(rows, box=problem.box_arg, capacity=capacity, number=rows.ids is None, host_sort=True)
    index = result.index
    held, routes = result.part, result.routes
    ids = held.ids if index is None else index
    assert ids is not None and routes is not None
    pieces = piece_cells(held.pos, held.num, result.key_box.origin.astype(dtype),
                         result.key_box.extent.astype(dtype), 64)
    valid = jnp.arange(capacity, dtype=jnp.int32) < held.num
    return _Piece(held, ids, valid, routes, pieces, result.needed, result.overflow)


class _WithGhosts(NamedTuple):
    """Own rows, then the ghosts received from the other devices."""

    pos: jax.Array  # (m + h, d)
    ids: jax.Array  # (m + h,)
    valid: jax.Array  # (m + h,)
    ghost_valid: jax.Array  # (h,) ghost rows received
    ghosts: Ghosts  # the routes they came by


def _add_ghosts(piece: _Piece, problem: _Problem, *, rank: Any, size: int, capacity: int) -> _WithGhosts:
    """Receive every other device's particles within the linking length of this piece, after the own rows."""
    ghosts = exchange_ghosts(piece.rows.pos, piece.ids, piece.pieces, problem.linking_length, problem.box, rank,
                             size, capacity, problem.tuning.ghost_chunk)
    ghost_valid = jnp.arange(capacity, dtype=jnp.int32) < ghosts.num
    return _WithGhosts(jnp.concatenate([piece.rows.pos, ghosts.pos]), jnp.concatenate([piece.ids, ghosts.ids]),
                       jnp.concatenate([piece.valid, ghost_valid]), ghost_valid, ghosts)


def _piece_space(local: _WithGhosts, pieces: Pieces, problem: _Problem, *,
                 rank: Any) -> tuple[LinkSpace, jax.Array, jax.Array]:
    """The link grid's space over this device's piece (ghosts unwrapped next to it) rather than the whole box:
    small cells and the counting sort of one device. Returns ``(space, grid_pos, volume)``, the volume the piece's
    cell boxes (widened by the linking length) occupy."""
    ll, box = problem.linking_length, problem.box
    lower, upper = pieces.lower[rank], pieces.upper[rank]
    occupied = pieces.count[rank] > 0
    extent = jnp.where(occupied[:, None], upper - lower + ll, 0).astype(jnp.float32)
    volume = jnp.sum(jnp.prod(extent, axis=1))
    if box is None:
        return whole_space(local.pos, local.valid, None), local.pos, volume
    space, grid_pos = piece_space(local.pos, local.valid, box, ll, lower, upper, occupied)
    return space, grid_pos, volume


class _Groups(NamedTuple):
    """The groups of one device's components, those crossing devices summed on their home device."""

    catalogue: Catalogue | None  # None for labels only
    count: jax.Array  # (m + h,) members of each component's whole group
    needed: jax.Array  # catalogue rows needed
    boundary_needed: jax.Array  # rows the exchange of pieces of groups needed
    overflow: jax.Array


def _catalogue_across(piece: _Piece, local: _WithGhosts, component: jax.Array, labels: jax.Array,
                      problem: _Problem, *, rank: Any, size: int, buffers: Buffers) -> _Groups:
    """Per-component sums of own members; components with ghosts are pieces of groups that cross devices, summed
    on their home device (``boundary_totals``)."""
    box, min_members = problem.box, problem.min_members
    m, hc = buffers.sort_capacity, buffers.halo_capacity
    dtype, dim = piece.rows.pos.dtype, piece.rows.pos.shape[1]
    big = m + hc
    own_rows = jnp.concatenate([piece.valid, jnp.zeros((hc,), bool)])
    has_ghost = jax.ops.segment_max(jnp.concatenate([jnp.zeros((m,), jnp.int32), local.ghost_valid.astype(jnp.int32)]),
                                    component, big) > 0
    if not problem.catalogue:  # labels only: the member counts are all the groups need
        count = jax.ops.segment_sum(own_rows.astype(jnp.int32), jnp.where(own_rows, component, big), big)
        boundary = has_ghost & (count > 0)
        totals, _, _, _, piece_needed, piece_overflow = boundary_totals(count, labels, boundary, rank, size, hc, box)
        return _Groups(None, jnp.where(boundary, totals, count), jnp.int32(0), piece_needed, piece_overflow)
    mass, vel = _mass_vel(piece.rows, m)
    mass_all = jnp.concatenate([mass, jnp.zeros((hc,), dtype)])
    vel_all = jnp.concatenate([vel, jnp.zeros((hc, dim), dtype)])
    parts = partial_sums(local.pos, mass_all, vel_all, component, own_rows, big, box)
    boundary = has_ghost & (parts.count > 0)
    totals, home, home_label, home_first, piece_needed, piece_overflow = boundary_totals(
        parts, labels, boundary, rank, size, hc, box)
    assert home is not None
    local_keep = ~boundary & (parts.count >= min_members)
    cat_parts = Partial(*(jnp.concatenate([a, b]) for a, b in zip(parts, home, strict=True)))
    cat_label = jnp.concatenate([labels, home_label])
    keep = jnp.concatenate([local_keep, home_first & (home.count >= min_members)])
    catalogue, groups_needed = finish(cat_parts, cat_label, keep, buffers.max_groups, box)
    return _Groups(catalogue, jnp.where(boundary, totals, parts.count), groups_needed, piece_needed, piece_overflow)


def _labels_home(labels: jax.Array, routes: Any, *, n: int, size: int) -> tuple[jax.Array, jax.Array]:
    """The held rows' labels back to the `(n,)` input rows along the reverse routes of the sort, and an overflow
    flag: regrouped by sender (no sort), they arrive packed by device in the order the rows left (``routes.perm``)."""
    m = labels.shape[0]
    back, _, overflow = send_grouped({"label": labels}, routes.received, capacity=n, perm=routes.back,
                                     plan=(routes.sent, routes.largest), chunk=share_chunk(m, size))
    returned = jnp.arange(n, dtype=jnp.int32) < jnp.sum(routes.sent)
    home = jnp.full((n,), -1, jnp.int32).at[jnp.where(returned, routes.perm, n)].set(back["label"], mode="drop")
    return home, overflow


def _several_devices(problem: _Problem, *, rank: Any, size: int) -> tuple[FofResult, Steps]:
    """FoF across ``size`` devices: sort into pieces of space, add ghosts, link, merge labels across devices, sum
    the groups, send the labels home."""
    n = problem.rows.pos.shape[0]
    buffers = device_buffers(problem.requested, n=n, devices=size, min_members=problem.min_members,
                             tuning=problem.tuning)
    m, hc = buffers.sort_capacity, buffers.halo_capacity
    piece = _sort_into_pieces(problem, capacity=m)
    local = _add_ghosts(piece, problem, rank=rank, size=size, capacity=hc)
    space, grid_pos, volume = _piece_space(local, piece.pieces, problem, rank=rank)
    linked = _link(local.pos, local.valid, local.ids, space=space, grid_pos=grid_pos, problem=problem,
                   volume=volume, edge_capacity=buffers.edge_capacity)
    labels, merges = merge_labels(linked.labels, linked.component, local.ghosts, m, hc)
    groups = _catalogue_across(piece, local, linked.component, labels, problem, rank=rank, size=size,
                               buffers=buffers)
    member = piece.valid & (groups.count[linked.component[:m]] >= problem.min_members)
    home_labels, back_overflow = _labels_home(_members(labels[:m], member), piece.routes, n=n, size=size)
    needed = Buffers(edge_capacity=linked.num_edges,
                     halo_capacity=jnp.maximum(local.ghosts.needed, groups.boundary_needed),
                     max_groups=groups.needed, sort_capacity=piece.needed)
    overflow = piece.overflow | local.ghosts.overflow | groups.overflow | back_overflow
    steps = linked.steps._replace(ghosts=local.ghosts.steps, merges=merges)
    return _result(home_labels, groups.catalogue, needed, buffers, overflow), steps


def fof_steps(part: Any, linking_length: float, **options: Any) -> tuple[dict[str, int], FofResult]:
    """The sequential loop steps of one :func:`fof` call on one device, and its result (a diagnostic for tests and
    benchmarks).

    On a GPU every loop step costs a fixed fraction of a millisecond whatever it holds, so these counts, not the
    work, set the time of a large call. Runs ``fof`` under ``jax.jit`` with the given keyword ``options`` (``box``,
    ``tuning``, capacities, ``catalogue``, ...).

    Returns:
        ``(steps, result)``: ``steps`` is ``{"sort", "links", "sweeps", "hooks", "jumps", "ghosts", "merges"}``,
        the rounds of the counting sort, the steps of the link search, the passes of the component search with
        their hooking and pointer-jumping steps, and (on several devices, else 0) the steps of the ghost selection
        and the rounds of the label merge; ``result`` is the call's :class:`FofResult`.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.particles import Particles
        >>> pos = jnp.array([[0.0, 0, 0], [0.1, 0, 0], [0.5, 0, 0], [0.55, 0, 0]])
        >>> steps, res = fof_steps(Particles(pos=pos, num=jnp.int32(4)), 0.2, min_members=2, tuning="gpu")
        >>> steps["links"], res.labels.tolist()
        (1, [0, 0, 2, 2])
    """
    defaults = {"box": None, "min_members": 20, "max_groups": None, "edge_capacity": None, "halo_capacity": None,
                "sort_capacity": None, "tuning": None, "catalogue": True}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"fof_steps: unexpected options {unknown}; it takes {sorted(defaults)}")
    kw = {**defaults, **options}
    result, steps = jax.jit(lambda p: _fof(p, linking_length, **kw))(part)
    return {name: int(value) for name, value in steps._asdict().items()}, result

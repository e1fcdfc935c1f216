"""Friends-of-friends groups: ``fof`` in the local view and its global version ``fof.smap``.

One code path at every scale. On one device the particles are linked directly (``_fof_local``). On several, they are
first sorted into global z-order (compact pieces of space per device), boundary particles are exchanged as ghosts and
labels merged across devices (``_fof_ghosts``), and the labels travel back to the rows they came from. Groups are
summarised into a :class:`Catalogue` by exact, order-independent sums (``_catalogue``). ``fof`` checks its input and
takes the one-device path (:func:`_one_device`) or the distributed one (:func:`_several_devices`); both link their
rows by :func:`_link`. Sizes and algorithm choices of the kernels come from a per-backend ``FofTuning``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .._bounds import check_bounds, check_local, mapped_bounds
from .._errors import CapacityError
from .._morton import given_box_values
from .._pytree import check_count, check_positions, pad_global
from ..comm import allgather
from ..comm._alltoallv import share_chunk
from ..core import ALL, rank_info, smap
from ..particles._zsort import bucket_sort
from ._catalogue import Catalogue, Partial, finish, partial_sums
from ._fof_ghosts import (
    INT_MAX,
    boundary_totals,
    exchange_ghosts,
    merge_labels,
    piece_cells,
    segment_min_labels,
    send_grouped,
)
from ._fof_local import LinkSpace, components, find_links, link_grid, piece_space, sort_points, whole_space
from ._fof_tuning import Steps, Tuning, resolve, step_sizes

_CAPACITIES = ("edge_capacity", "halo_capacity", "max_groups", "sort_capacity")
TuningName = Literal["cpu", "gpu"]


class FofResult(NamedTuple):
    """Result of :func:`fof`.

    Attributes:
        labels: `(n,)` int32 group label of each input row (smallest global input index of the group's members),
            -1 for rows in groups smaller than ``min_members`` and for padding rows.
        catalogue: the :class:`Catalogue` of the groups with at least ``min_members`` members.
        overflow: bool, true when a buffer was too small (results incomplete; the global wrapper raises
            :class:`shardax.CapacityError` instead).
        needed: `(4,)` int32 rows needed by ``edge_capacity``, ``halo_capacity``, ``max_groups`` and
            ``sort_capacity``, on this device.
    """

    labels: jax.Array
    catalogue: Catalogue
    overflow: jax.Array
    needed: jax.Array


class _Rows(NamedTuple):
    """What travels with each particle through the z-order sort: only the fields the particles have."""

    pos: jax.Array
    num: jax.Array
    ids: jax.Array | None  # None while the sort numbers the rows
    mass: jax.Array | None
    vel: jax.Array | None


def _positive_int(value: Any, name: str, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive Python int, got {value!r}")
    return value


def _box_vector(box: Any, dim: int, dtype: Any) -> jax.Array | None:
    if box is None:
        return None
    if isinstance(box, bool) or not isinstance(box, int | float | tuple | list | jax.Array | np.ndarray | np.generic):
        raise TypeError(f"box must be None, a positive number or a sequence of {dim} numbers, got "
                        f"{type(box).__name__}")
    values = given_box_values(box, dtype,
                              f"box must be None, a positive number or a sequence of {dim} numbers, got {box!r}")
    if values is not None and values.size in (1, dim) and \
            not np.all(np.isfinite(values) & (values >= np.finfo(values.dtype).tiny)):
        raise ValueError(f"box must be positive and finite in {np.dtype(dtype).name} (the periodic box size per "
                         f"axis; XLA flushes subnormal numbers to zero), got {box!r}")
    vec = jnp.asarray(box, dtype)
    vec = jnp.broadcast_to(vec, (dim,)) if vec.ndim == 0 else vec
    if vec.shape != (dim,):
        raise ValueError(f"box must be a scalar or have {dim} entries (one per axis), got shape {vec.shape}")
    return vec


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


def fof(part: Any, linking_length: float | jax.Array, *, box: Any = None, min_members: int = 20,
        max_groups: int | None = None, edge_capacity: int | None = None, halo_capacity: int | None = None,
        sort_capacity: int | None = None, tuning: Tuning | TuningName | None = None) -> FofResult:
    """Friends-of-friends groups of a particle set (local view; ``fof.smap()`` for global arrays).

    Two particles closer than (or exactly at) ``linking_length`` are friends; groups are the transitive closure.
    Exact at every scale: labels are identical on 1 device and on any number of devices and processes.

    Args:
        part: particle pytree (``.pos (n, d)`` with ``d`` in {2, 3}, ``.num``; optional ``.mass (n,)``,
            ``.vel (n, d)``, ``.ids (n,)``). Without ``ids``, rows are numbered in global (device, row) order.
        linking_length: absolute linking length (positive; at most half the periodic box).
        box: periodic box size (scalar or per axis), or None for open boundaries.
        min_members: smallest group that gets a label and a catalogue row.
        max_groups: catalogue rows per device (static); default ``(m + halo_capacity) // min_members + 16``, ``m``
            the rows after the sort (``sort_capacity``).
        edge_capacity: pairs per device the linking may hold (static); default ``8 (m + halo_capacity) + 4096``.
        halo_capacity: boundary particles per device sent and received (static, ignored on one device);
            default ``max(n // 4, 1024)``.
        sort_capacity: rows per device after the spatial sort (static, ignored on one device); default ``n``. The
            sort's pieces of space hold a device's share within a few percent (its splitters come from samples
            and sit on coarse cell boundaries), so particles filling their rows to the last need a few more.
        tuning: static sizes and algorithm choices of the linking (:class:`~shardax.spatial.FofTuning`): None
            for the backend's preset (``SHARDAX_TUNING`` overrides), ``"cpu"`` or ``"gpu"`` for a preset, or a
            ``FofTuning``. Labels are the same with every tuning.

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
                tuning=tuning)[0]


def _fof(part: Any, linking_length: float | jax.Array, *, box: Any, min_members: int, max_groups: int | None,
         edge_capacity: int | None, halo_capacity: int | None, sort_capacity: int | None,
         tuning: Tuning | TuningName | None) -> tuple[FofResult, Steps]:
    """:func:`fof`, and the sequential loop steps it took (:func:`fof_steps`): checks, then the one-device or the
    distributed path."""
    n, dim = check_positions(part, "fof")
    if n == 0:
        raise ValueError("fof: part has no rows (part.pos has shape (0, d)); give it at least one padding row: the "
                         "empty set is one row with num=0")
    _positive_int(min_members, "min_members")
    pos = jnp.asarray(part.pos)
    dtype = pos.dtype
    boxv = _box_vector(box, dim, dtype)
    ll = _check_linking_length(linking_length, box, dtype)
    tuning = resolve(tuning, "fof")
    groups = _positive_int(max_groups, "max_groups", allow_none=True)
    edges = _positive_int(edge_capacity, "edge_capacity", allow_none=True)

    num = jnp.clip(jnp.asarray(part.num, jnp.int32), 0, n)
    valid = jnp.arange(n, dtype=jnp.int32) < num
    if not isinstance(pos, Tracer) and not bool(jnp.all(jnp.isfinite(jnp.where(valid[:, None], pos, 0)))):
        raise ValueError("fof: part.pos has NaN or infinite coordinates; remove or fix those particles")
    check_local(pos, valid, box, "fof")
    mass = getattr(part, "mass", None)
    mass = None if mass is None else jnp.broadcast_to(jnp.asarray(mass, dtype), (n,))
    vel = getattr(part, "vel", None)
    vel = None if vel is None else jnp.asarray(vel, dtype)
    ids = getattr(part, "ids", None)
    rows = _Rows(pos, num, None if ids is None else jnp.asarray(ids, jnp.int32), mass, vel)
    rank, size, _ = rank_info()
    if size == 1:
        return _one_device(rows, ll, boxv, min_members, groups, edges, tuning)
    hc = _positive_int(halo_capacity, "halo_capacity", allow_none=True) or max(n // 4, 1024)
    m = _positive_int(sort_capacity, "sort_capacity", allow_none=True) or n
    return _several_devices(rows, ll, box, boxv, min_members, groups, edges, hc, m, rank, size, tuning)


class _Linked(NamedTuple):
    """The local groups of one device's rows (own rows, then ghosts on several devices)."""

    component: jax.Array  # (rows,) int32 smallest row of each row's local component
    labels: jax.Array  # (rows,) int32 smallest id of each row's local component
    num_edges: jax.Array  # pairs found (more than the edge capacity: overflow)
    steps: Steps


def _link(pos: jax.Array, valid: jax.Array, ids: jax.Array, space: LinkSpace, grid_pos: jax.Array,
          ll: jax.Array, volume: jax.Array | None, edge_capacity: int, tuning: Tuning) -> _Linked:
    """Link the valid rows of ``pos`` (`(r, d)`): a cell grid, the sort into it, the pairs, their components."""
    rows = pos.shape[0]
    count = jnp.sum(valid, dtype=jnp.int32)
    table_cells = int(tuning.table * rows) + 64
    grid = link_grid(space, count, ll, tuning.per_cell, table_cells, volume)
    points = sort_points(pos, valid, space, grid, table_cells, tuning.rank_rounds, grid_pos)
    links = find_links(points, count, ll, space, grid, edge_capacity=edge_capacity, tuning=tuning)
    root, (sweeps, hooks, jumps) = components(links, rows, step_sizes(tuning, rows)[1])
    component = jnp.zeros((rows,), jnp.int32).at[points.rows].set(points.rows[root])
    labels = segment_min_labels(jnp.where(valid, ids, INT_MAX), component)
    steps = Steps(points.rounds, links.steps, sweeps, hooks, jumps, jnp.int32(0), jnp.int32(0))
    return _Linked(component, labels, links.num_edges, steps)


def _mass_vel(rows: _Rows, m: int) -> tuple[jax.Array, jax.Array]:
    """Masses `(m,)` and velocities `(m, d)` of the rows: ones and zeros for the fields the particles lack."""
    dtype = rows.pos.dtype
    mass = jnp.ones((m,), dtype) if rows.mass is None else rows.mass
    vel = jnp.zeros((m, rows.pos.shape[1]), dtype) if rows.vel is None else rows.vel
    return mass, vel


def _one_device(rows: _Rows, ll: jax.Array, box: jax.Array | None, min_members: int, max_groups: int | None,
                edge_capacity: int | None, tuning: Tuning) -> tuple[FofResult, Steps]:
    """FoF of the particles of one device: link them (in the box, wrapped), label, summarise the groups."""
    n = rows.pos.shape[0]
    available = _available(n, max_groups, edge_capacity, 0, min_members)
    edge_cap, _, group_cap, _ = available
    pos = rows.pos if box is None else rows.pos - box[None, :] * jnp.floor(rows.pos / box[None, :])
    index = jnp.arange(n, dtype=jnp.int32)
    valid = index < rows.num
    ids = index if rows.ids is None else rows.ids
    linked = _link(pos, valid, ids, whole_space(pos, valid, box), pos, ll, None, edge_cap, tuning)
    mass, vel = _mass_vel(rows, n)
    parts = partial_sums(pos, mass, vel, linked.component, valid, n, box)
    catalogue, groups_needed = finish(parts, linked.labels, parts.count >= min_members, group_cap, box)
    member = valid & (parts.count[linked.component] >= min_members)
    labels = jnp.where(member, linked.labels, -1)
    needed = jnp.stack([linked.num_edges, jnp.int32(0), groups_needed, rows.num]).astype(jnp.int32)
    overflow = jnp.any(needed > jnp.array(available, jnp.int32))
    return FofResult(labels, catalogue, overflow, needed), linked.steps


def _several_devices(rows: _Rows, ll: jax.Array, box_arg: Any, box: jax.Array | None, min_members: int,
                     max_groups: int | None, edge_capacity: int | None, hc: int, m: int, rank: Any, size: int,
                     tuning: Tuning) -> tuple[FofResult, Steps]:
    """FoF across ``size`` devices, ``m`` rows per device after the sort and ``hc`` ghost rows (see the module)."""
    n, dim = rows.pos.shape
    dtype = rows.pos.dtype
    big = m + hc
    available = _available(m, max_groups, edge_capacity, hc, min_members)
    edge_cap, _, group_cap, _ = available

    # A compact piece of space per device: the rows in global z-order (numbered in global (device, row) order by
    # the sort when the particles have no ids: the devices' counts travel with its samples, no scan).
    result, index = bucket_sort(rows, box_arg, m, number=rows.ids is None, host_sort=True)
    held, routes = result.part, result.routes
    ids = held.ids if index is None else index
    assert ids is not None and routes is not None
    pieces = piece_cells(held.pos, held.num, result.key_box.origin.astype(dtype),
                         result.key_box.extent.astype(dtype), 64)
    own_valid = jnp.arange(m, dtype=jnp.int32) < held.num

    # Own rows, then ghosts from the other devices, linked together on a grid over this device's piece (ghosts
    # unwrapped next to it) rather than the whole box: small cells and the counting sort of one device.
    halo = exchange_ghosts(held.pos, ids, pieces, ll, box, rank, size, hc, tuning.ghost_chunk)
    ghost_valid = jnp.arange(hc, dtype=jnp.int32) < halo.num
    pos_all = jnp.concatenate([held.pos, halo.pos])
    ids_all = jnp.concatenate([ids, halo.ids])
    valid_all = jnp.concatenate([own_valid, ghost_valid])
    lower, upper = pieces.lower[rank], pieces.upper[rank]
    occupied = pieces.count[rank] > 0
    extent = jnp.where(occupied[:, None], upper - lower + ll, 0).astype(jnp.float32)
    volume = jnp.sum(jnp.prod(extent, axis=1))
    if box is not None:
        space, grid_pos = piece_space(pos_all, valid_all, box, ll, lower, upper, occupied)
    else:
        space, grid_pos = whole_space(pos_all, valid_all, None), pos_all
    linked = _link(pos_all, valid_all, ids_all, space, grid_pos, ll, volume, edge_cap, tuning)
    component = linked.component
    labels, merges = merge_labels(linked.labels, component, halo, m, hc)

    # Per-component sums of own members; components with ghosts are pieces of groups that cross devices, summed
    # on their home device.
    mass, vel = _mass_vel(held, m)
    own_rows = jnp.concatenate([own_valid, jnp.zeros((hc,), bool)])
    mass_all = jnp.concatenate([mass, jnp.zeros((hc,), dtype)])
    vel_all = jnp.concatenate([vel, jnp.zeros((hc, dim), dtype)])
    parts = partial_sums(pos_all, mass_all, vel_all, component, own_rows, big, box)
    has_ghost = jax.ops.segment_max(jnp.concatenate([jnp.zeros((m,), jnp.int32), ghost_valid.astype(jnp.int32)]),
                                    component, big) > 0
    boundary = has_ghost & (parts.count > 0)
    totals, home, home_label, home_first, piece_needed, piece_overflow = boundary_totals(
        parts, labels, boundary, rank, size, hc, box)
    group_count = jnp.where(boundary, totals, parts.count)
    local_keep = ~boundary & (parts.count >= min_members)
    cat_parts = Partial(*(jnp.concatenate([a, b]) for a, b in zip(parts, home, strict=True)))
    cat_label = jnp.concatenate([labels, home_label])
    keep = jnp.concatenate([local_keep, home_first & (home.count >= min_members)])
    catalogue, groups_needed = finish(cat_parts, cat_label, keep, group_cap, box)

    # Labels home along the reverse routes of the sort: regrouped by sender (no sort), they arrive packed by
    # device in the order the rows left, i.e. ``routes.perm``.
    member = own_valid & (group_count[component[:m]] >= min_members)
    own_label = jnp.where(member, labels[:m], -1)
    back, _, back_overflow = send_grouped({"label": own_label}, routes.received, capacity=n, perm=routes.back,
                                          plan=(routes.sent, routes.largest), chunk=share_chunk(m, size))
    returned = jnp.arange(n, dtype=jnp.int32) < jnp.sum(routes.sent)
    home_labels = jnp.full((n,), -1, jnp.int32).at[jnp.where(returned, routes.perm, n)].set(back["label"],
                                                                                            mode="drop")
    needed = jnp.stack([linked.num_edges, jnp.maximum(halo.needed, piece_needed), groups_needed,
                        result.needed]).astype(jnp.int32)
    overflow = result.overflow | halo.overflow | piece_overflow | back_overflow | \
        jnp.any(needed > jnp.array(available, jnp.int32))
    steps = linked.steps._replace(ghosts=halo.steps, merges=merges)
    return FofResult(home_labels, catalogue, overflow, needed), steps


def fof_steps(part: Any, linking_length: float, **options: Any) -> tuple[dict[str, int], FofResult]:
    """The sequential loop steps of one :func:`fof` call on one device, and its result (a diagnostic for tests and
    benchmarks).

    On a GPU every loop step costs a fixed fraction of a millisecond whatever it holds, so these counts, not the
    work, set the time of a large call. Runs ``fof`` under ``jax.jit`` with the given keyword ``options`` (``box``,
    ``tuning``, capacities, ...).

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
                "sort_capacity": None, "tuning": None}
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"fof_steps: unexpected options {unknown}; it takes {sorted(defaults)}")
    kw = {**defaults, **options}
    result, steps = jax.jit(lambda p: _fof(p, linking_length, **kw))(part)
    return {name: int(value) for name, value in steps._asdict().items()}, result


_CONSTRUCTED: dict[tuple[Mesh | None, bool], Callable[..., FofResult]] = {}


# The ghost buffer ``fof.smap`` starts from when ``halo_capacity`` is left unset. Boundary rows are a few percent of
# a device's particles at the usual sizes (1e6 uniform points on 8 devices: 3% at b = 0.2, 9% at b = 0.7), and the
# linking and the catalogue hold the own rows plus this buffer: at 1e6 points on 8 devices the compiled working set
# per device is 67 MiB with a buffer of n / 16 rows and 80 MiB with ``fof``'s default (n / 4), at the
# same speed. A device that needs more grows it (see ``_global_fof``).
_AUTO_HALO_FRACTION = 16
# Runs of one call while automatic buffers grow (each growth compiles the kernel for the new sizes once).
_AUTO_ROUNDS = 4


def _global_fof(mesh: Mesh | None = None, *, jit: bool = True) -> Callable[..., FofResult]:
    """``fof.smap(mesh=None, jit=True)``: :func:`fof` over global ``(ndev, n, ...)`` particle arrays.

    The returned function takes the arguments of :func:`fof` (``linking_length`` and ``box`` as Python numbers: a
    new value recompiles) and returns a :class:`FofResult` in the global view (``labels (ndev, n)``, catalogue
    fields ``(ndev, g, ...)``).

    Buffers left unset are sized automatically: ``halo_capacity`` starts at ``max(n // 16, 1024)`` rows and
    ``sort_capacity`` at ``n``, and when a device needs more of any unset buffer (``edge_capacity``,
    ``halo_capacity``, ``max_groups``, ``sort_capacity``) the call runs again with a quarter more than it needed, and
    later calls with the same arguments start from the grown sizes (each new size compiles once). A buffer given
    explicitly is never changed: its overflow raises :class:`shardax.CapacityError` naming it and the size needed.
    ``ValueError`` for NaN or infinite positions. Constructors are cached per ``(mesh, jit)``, so calling
    ``fof.smap(mesh)(...)`` repeatedly compiles once per argument structure.
    """
    constructed = _CONSTRUCTED.get((mesh, jit))
    if constructed is not None:
        return constructed
    cache: dict[tuple, Callable[..., Any]] = {}
    grown: dict[tuple, dict[str, int]] = {}

    def compiled(treedef: Any, options: tuple, sizes: tuple[int | None, int | None, int, int | None]
                 ) -> Callable[..., Any]:
        linking_length, static_box, min_members, tuning = options
        max_groups, edge_capacity, halo_capacity, sort_capacity = sizes
        key = (treedef, *options, *sizes)
        fn = cache.get(key)
        if fn is None:
            def body(leaves: list[jax.Array]) -> tuple[FofResult, tuple[jax.Array, ...]]:
                local = jax.tree.unflatten(treedef, leaves)
                n = local.pos.shape[0]
                valid = jnp.arange(n) < local.num
                bad = jnp.sum(valid & ~jnp.all(jnp.isfinite(local.pos), axis=1)).astype(jnp.int32)
                res = fof(local, linking_length, box=static_box, min_members=min_members, max_groups=max_groups,
                          edge_capacity=edge_capacity, halo_capacity=halo_capacity, sort_capacity=sort_capacity,
                          tuning=tuning)
                # One all-gather for the three flags (across processes each collective costs milliseconds).
                every = allgather(jnp.concatenate([res.overflow.astype(jnp.int32)[None], res.needed, bad[None]]))
                worst = jnp.max(every[:, :-1], axis=0)
                span = mapped_bounds(local.pos, local.num) if static_box is not None else ()  # checked after the call
                return res, (worst[0], worst[1:], jnp.sum(every[:, -1]), *span)

            fn = smap(body, in_specs=(ALL,), out_specs=(ALL, P()), mesh=mesh, jit=jit, name="fof.smap")
            cache[key] = fn
        return fn

    def call(part: Any, linking_length: float, *, box: Any = None, min_members: int = 20,
             max_groups: int | None = None, edge_capacity: int | None = None, halo_capacity: int | None = None,
             sort_capacity: int | None = None, tuning: Tuning | TuningName | None = None) -> FofResult:
        tuning = resolve(tuning, "fof.smap", None if mesh is None else mesh.devices)
        if getattr(part, "pos", None) is None or not hasattr(part, "num") or jnp.ndim(part.pos) != 3:
            raise ValueError("fof.smap: part must be a global particle pytree with pos of shape (ndev, n, d) "
                             "(e.g. from shardax.particles.from_numpy); call fof() for the local view")
        ndev, n = (int(k) for k in jnp.shape(part.pos)[:2])
        check_count(part.num, n, "fof.smap")
        if isinstance(linking_length, bool) or not isinstance(linking_length, int | float | np.floating):
            raise TypeError(f"fof.smap: linking_length must be a Python number, got {type(linking_length).__name__}")
        if jnp.issubdtype(jnp.result_type(part.pos), jnp.floating):
            _box_vector(box, int(jnp.shape(part.pos)[-1]), jnp.result_type(part.pos))
        for name, value in (("max_groups", max_groups), ("edge_capacity", edge_capacity),
                            ("halo_capacity", halo_capacity), ("sort_capacity", sort_capacity)):
            _positive_int(value, name, allow_none=True)
        if ndev == 1 and n == 1:  # the one-device pair search needs two rows: add a padding row, drop its label
            res = call(pad_global(part, 1), linking_length, box=box, min_members=min_members, max_groups=max_groups,
                       edge_capacity=edge_capacity, halo_capacity=halo_capacity, sort_capacity=sort_capacity,
                       tuning=tuning)
            return res._replace(labels=res.labels[:, :1])
        static_box = None if box is None else (float(box) if np.ndim(box) == 0 else tuple(np.asarray(box).tolist()))
        options = (float(linking_length), static_box, min_members, tuning)
        leaves, treedef = jax.tree.flatten(part)
        given = {"max_groups": max_groups, "edge_capacity": edge_capacity, "halo_capacity": halo_capacity,
                 "sort_capacity": sort_capacity}
        auto = grown.setdefault((treedef, n, *options, *given.values()), {})
        for _ in range(_AUTO_ROUNDS):
            hc = halo_capacity or auto.get("halo_capacity") or max(n // _AUTO_HALO_FRACTION, 1024)
            sizes = (max_groups or auto.get("max_groups"), edge_capacity or auto.get("edge_capacity"), hc,
                     sort_capacity or auto.get("sort_capacity"))
            res, checks = compiled(treedef, options, sizes)(leaves)
            if isinstance(checks[0], Tracer):
                return res
            any_overflow, needed, bad, *span = jax.device_get(checks)  # one transfer
            if span:  # before the other checks: counts of data in another box mean nothing
                check_bounds(span[0], span[1], box, "fof.smap")
            if int(bad):
                raise ValueError(f"fof: {int(bad)} particle(s) have NaN or infinite coordinates in part.pos; "
                                 "remove or fix them")
            if not int(any_overflow):
                return res
            short = _short_buffers(np.asarray(needed), sizes, n, ndev, min_members)
            if not short or any(given.get(name) is not None for name in short):
                break
            auto.update(short)
        held = (sizes[3] or n) if ndev > 1 else n
        _raise_capacity(np.asarray(needed), held, sizes[0], sizes[1], hc if ndev > 1 else 0, min_members)

    _CONSTRUCTED[(mesh, jit)] = call
    return call


def _short_buffers(needed: np.ndarray, sizes: tuple[int | None, int | None, int, int | None], n: int, ndev: int,
                   min_members: int) -> dict[str, int]:
    """The buffers of ``sizes`` (``max_groups, edge_capacity, halo_capacity, sort_capacity``) that a call of
    ``fof.smap`` on ``ndev`` devices of ``n`` rows overflowed, each with a quarter more than a device ``needed``;
    the ghost buffer doubled when an exchange overflowed without a count over its buffer."""
    max_groups, edge_capacity, hc, sort_capacity = sizes
    held = (sort_capacity or n) if ndev > 1 else n
    have = _available(held, max_groups, edge_capacity, hc if ndev > 1 else 0, min_members)
    short = {name: k + k // 4 + 1 for name, k, h in zip(_CAPACITIES, needed.tolist(), have, strict=True) if k > h}
    if not short and ndev > 1:
        short = {"halo_capacity": 2 * hc}
    return short


def _available(m: int, max_groups: int | None, edge_capacity: int | None, halo_capacity: int,
               min_members: int) -> list[int]:
    """The sizes of the four buffers of ``FofResult.needed`` (edges, halo rows, catalogue rows, rows after the
    sort), the defaults of those left ``None`` resolved, for ``m`` rows per device after the sort (on one device
    the particle rows, and the halo is 0)."""
    return [edge_capacity or 8 * (m + halo_capacity) + 4096, halo_capacity,
            max_groups or (m + halo_capacity) // min_members + 16, m]


def _raise_capacity(needed: np.ndarray, m: int, max_groups: int | None, edge_capacity: int | None,
                    halo_capacity: int, min_members: int) -> NoReturn:
    available = _available(m, max_groups, edge_capacity, halo_capacity, min_members)
    # The sorted rows first: when a device overflows them, the other counts are of incomplete data.
    for name, need, have in sorted(zip(_CAPACITIES, needed.tolist(), available, strict=True),
                                   key=lambda item: item[0] != "sort_capacity"):
        if need > have:
            raise CapacityError(f"fof: a device needed {need} rows of {name} but has {have}; pass "
                                f"{name}={need + need // 4 + 1}",
                                needed=need + need // 4 + 1, available=have, argument=name)
    raise CapacityError("fof: an exchange between devices overflowed; raise halo_capacity",
                        needed=2 * max(halo_capacity, 1), available=halo_capacity, argument="halo_capacity")


fof.smap = _global_fof  # type: ignore[attr-defined]

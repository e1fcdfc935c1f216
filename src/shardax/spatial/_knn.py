"""``sx.spatial.knn``: exact k nearest neighbours in the local view, and its global ``.smap`` version."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Literal, NamedTuple, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .. import _flags
from .._bounds import bounds_layout, check_bounds, check_local, local_span, split_span
from .._compile import particle_compiler_options
from .._eager import is_concrete, run_compiled
from .._errors import CapacityError
from .._morton import as_vector, check_box
from .._pytree import check_count, check_global, particle_set, spare_rows
from ..comm import scan
from ..core import ALL, attach_global, rank_info, smap
from ..particles import Particles
from ._knn_dist import Flags, default_ghost_capacity, distributed_knn
from ._knn_local import local_knn
from ._knn_tuning import KnnTuning, resolve

Box = float | tuple[float, ...] | jax.Array | None
Reduce = Callable[..., Any]
TuningName = Literal["cpu", "gpu"]


class KnnResult(NamedTuple):
    """Result of :func:`knn`, rows aligned with the query rows.

    Attributes:
        distances: `(n, k)` Euclidean distances, ascending (``inf`` on padding rows).
        indices: `(n, k)` int32 global index of each neighbour (the ``ids`` numbering; ``-1`` on padding rows), or
            the output of ``reduce``.
    """

    distances: jax.Array
    indices: Any


def _positions(x: Any, name: str) -> tuple[jax.Array, jax.Array]:
    """Positions and valid-row mask of a particle pytree (``.pos``, ``.num``) or of a plain `(n, d)` array."""
    part = particle_set(x, "knn", name=name, dims=(1, 2, 3))
    pos = jnp.asarray(part.pos)
    if pos.ndim != 2 or pos.shape[1] not in (1, 2, 3):
        raise ValueError(f"knn: {name} positions must have shape (n, d) with d in {{1, 2, 3}} (local view), got "
                         f"{pos.shape}; global (ndev, n, d) arrays go through knn.smap")
    if pos.dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"knn: {name} positions must be float32 or float64, got {pos.dtype}; cast them with "
                        f"pos.astype(jnp.float32)")
    n = pos.shape[0]
    if part is not x:  # a plain array: every row valid
        return pos, jnp.ones((n,), bool)
    num = part.num
    if jnp.ndim(num) != 0:
        raise ValueError(f"knn: {name}.num must be a scalar count in the local view, got shape {jnp.shape(num)}")
    check_count(num, n, "knn", f"{name}.num")
    return pos, jnp.arange(n, dtype=jnp.int32) < jnp.asarray(num, jnp.int32)


def extent_range(dtype: Any, dim: int) -> tuple[float, float]:
    """The extents of positions (or periodic boxes) whose squared distances ``dtype`` represents: below the
    upper bound a sum of ``dim`` squares stays finite; above the lower bound only distances below the positions' own
    resolution (``extent * eps``) underflow to zero."""
    info = np.finfo(dtype)
    return float(np.sqrt(info.tiny) / info.eps), float(np.sqrt(info.max / dim)) / 2


def _check_box(box: Box, dim: int, dtype: Any) -> None:
    check_box(box, dim, dtype, where="knn: ", extent=extent_range(dtype, dim))


def _check_finite(pos: jax.Array, valid: jax.Array, name: str) -> None:
    if isinstance(pos, Tracer) or isinstance(valid, Tracer):
        return
    bad = np.asarray(valid) & ~np.all(np.isfinite(np.asarray(pos)), axis=-1)
    if bad.any():
        raise ValueError(f"knn: {name} has {int(bad.sum())} row(s) with NaN or infinite coordinates (first: row "
                         f"{int(np.argmax(bad.reshape(-1)))}); remove or fix them")


def _local_reach(pos: jax.Array, valid: jax.Array) -> jax.Array:
    """``[lower, -upper]`` (`(2 d,)`) of this device's valid rows (``finfo.max`` without rows): their minimum over
    the devices gives :func:`_extent`."""
    big = jnp.asarray(jnp.finfo(pos.dtype).max, pos.dtype)
    lo = jnp.min(jnp.where(valid[:, None], pos, big), axis=0)
    hi = jnp.max(jnp.where(valid[:, None], pos, -big), axis=0)
    return jnp.concatenate([lo, -hi])


def _extent(reach: jax.Array) -> jax.Array:
    """Largest per-axis extent from the minimum over the devices of :func:`_local_reach` (0 without rows)."""
    d = reach.shape[0] // 2
    lo, hi = reach[:d], -reach[d:]
    return jnp.max(jnp.where(hi >= lo, hi - lo, 0))


def _check_extent(extent: Any, dtype: Any, dim: int, name: str) -> None:
    low, high = extent_range(dtype, dim)
    value = float(extent)
    if value != 0 and not low <= value <= high:
        raise ValueError(f"knn: {name} positions span {value:.3g}, but squared {np.dtype(dtype).name} distances need "
                         f"a span between {low:.3g} and {high:.3g} (or all positions equal); rescale the positions "
                         "(e.g. to box units) or use float64")


def _check_k(k: Any, n: int, count: int | None) -> None:
    """``k`` against the ``n`` rows of ``part`` and, when known (``None`` when traced), its ``count`` of valid
    rows; only outside a mesh (inside one, the rows of this device are not all the particles)."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise TypeError(f"knn: k must be a Python int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"knn: k must be >= 1, got {k}")
    if rank_info().size == 1:
        if count is not None and k > count:
            raise ValueError(f"knn: k={k} is larger than the number of particles ({count}); lower k")
        if k > n:
            raise ValueError(f"knn: k={k} is larger than the {n} rows of part (padding included), hence than its "
                             "number of particles; lower k")


@overload
def knn(part: Any, k: int, *, box: Box = None, query: Any = None, reduce: Reduce | None = None,
        ghost_capacity: int | None = None, zorder: Literal[False] = False,
        tuning: KnnTuning | TuningName | None = None) -> KnnResult: ...


@overload
def knn(part: Any, k: int, *, box: Box = None, query: Any = None, reduce: Reduce | None = None,
        ghost_capacity: int | None = None, zorder: Literal[True],
        tuning: KnnTuning | TuningName | None = None) -> tuple[KnnResult, Any]: ...


def knn(part: Any, k: int, *, box: Box = None, query: Any = None, reduce: Reduce | None = None,
        ghost_capacity: int | None = None, zorder: bool = False,
        tuning: KnnTuning | TuningName | None = None) -> KnnResult | tuple[KnnResult, Any]:
    """Exact k nearest neighbours of each particle (local view; ``knn.smap`` gives the global version).

    Runs the same code outside any mesh (one device) and inside ``sx.smap``. Every particle is its own nearest
    neighbour (distance 0 first). Equal distances are ordered by global index, so integer results are identical on
    any number of devices and processes.

    Args:
        part: the data, a particle pytree (``.pos (n, d)``, ``.num``; ``.ids`` if present gives the global
            numbering) or a plain `(n, d)` array (all rows valid). ``d`` in {1, 2, 3}, float32 or float64.
        k: neighbours per query (``1 <= k <=`` number of particles).
        box: periodic box size, a scalar or one size per axis (positions are wrapped into ``[0, box)``);
            ``None`` for open boundaries.
        query: points to find neighbours for, instead of the particles themselves: a particle pytree or an
            `(m, d)` array. Each device answers its own query rows.
        reduce: optional ``reduce(distances=, indices=, part=)`` applied to the `(m, k)` results before they are
            returned (``part`` is the query pytree, or ``part`` itself); its output replaces ``indices``. On a mesh
            it runs where the particles are after the z-order sort, before the results travel home, so its
            outputs must be per-row arrays (leading length ``n``).
        ghost_capacity: rows of the buffer for particles received from other devices (static; default twice the
            rows per device, at least 65536, at most all other devices' rows). On overflow the local view returns
            NaN distances; ``knn.smap`` raises :class:`shardax.CapacityError` saying how much is needed.
        zorder: skip the trip home: return the results where the search ran, in global z-order, together with
            the particles in that order (one exchange fewer on a mesh). Not with ``query``.
        tuning: the kernel's static tile and loop sizes: ``None`` for the backend's preset (``SHARDAX_TUNING``
            overrides), ``"cpu"`` (cache-sized tiles), ``"gpu"`` (few large sequential steps) or a
            :class:`KnnTuning` (e.g. the ``"gpu"`` preset with one size replaced, or small capacities and tiles
            that send a few hundred points through every phase of the search). Results are identical for every
            tuning; only speed and memory change. Static: a new value compiles again.

    Returns:
        ``KnnResult(distances (m, k), indices (m, k))`` with rows aligned with the query rows (``m = n`` without
        ``query``). Indices are global input indices: ``part.ids`` when present, else the position in (device,
        row) order of the valid rows. Padding rows get distance ``inf`` and index ``-1``.

        With ``zorder=True``: ``(KnnResult, zpart)``, where ``zpart`` is ``part`` sorted into global z-order as by
        :func:`shardax.particles.zsort` (every per-particle field moved, ``num`` the rows now held, ``ids`` the
        global input index of each row; a plain array ``part`` becomes :class:`~shardax.particles.Particles`) and
        the result rows are aligned with ``zpart``'s rows.

    Raises:
        TypeError: ``k`` not an int, positions not float, ``zorder`` not a bool, ``zorder=True`` for a pytree
            without an ``ids`` field.
        ValueError: ``k < 1``, ``k`` larger than the number of particles, NaN positions, ``query`` with another
            dimension than ``part``, a bad ``box``, ``zorder=True`` together with ``query``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from shardax.spatial import KnnTuning, knn
        >>> pos = jax.random.uniform(jax.random.key(0), (1000, 3))
        >>> res = knn(pos, 4, box=1.0)
        >>> res.distances.shape, res.indices[:3, 0].tolist()
        ((1000, 4), [0, 1, 2])
        >>> small = KnnTuning(capacity=16, brute_queries=8, brute_tile=64)  # small steps, later passes: same answer
        >>> bool(jnp.all(knn(pos, 4, box=1.0, tuning=small).indices == res.indices))
        True
        >>> rmean = knn(pos, 9, reduce=lambda distances, indices, part: jnp.mean(distances[:, 1:], axis=1))
        >>> rmean.indices.shape
        (1000,)
        >>> res, zpart = knn(pos, 4, box=1.0, zorder=True)     # rows in z-order, zpart.ids says which particle
        >>> bool(jnp.all(res.indices[:, 0] == zpart.ids))
        True
    """
    result, flags, zpart = _knn(part, k, box=box, query=query, reduce=reduce, ghost_capacity=ghost_capacity,
                                zorder=zorder, tuning=resolve(tuning, "knn"))
    overflow = flags.ghost_overflow | flags.sort_overflow
    if isinstance(overflow, Tracer) or bool(overflow):
        bad = jnp.asarray(overflow)
        result = KnnResult(jnp.where(bad, jnp.nan, result.distances), result.indices)
    return (result, zpart) if zorder else result


def _knn(part: Any, k: int, *, box: Box, query: Any, reduce: Reduce | None, ghost_capacity: int | None,
         zorder: bool = False, tuning: KnnTuning | None = None) -> tuple[KnnResult, Flags, Any]:
    """:func:`knn` plus this device's buffer :class:`Flags` and, with ``zorder``, the z-sorted particles."""
    pos, valid = _positions(part, "part")
    n, dim = pos.shape
    _check_k(k, n, None if isinstance(valid, Tracer) or rank_info().size > 1 else int(jnp.sum(valid)))
    _check_finite(pos, valid, "part")
    if box is None and not isinstance(pos, Tracer) and not isinstance(valid, Tracer) and rank_info().size == 1:
        _check_extent(_extent(_local_reach(pos, valid)), pos.dtype, dim, "part")
    if ghost_capacity is not None and (isinstance(ghost_capacity, bool) or not isinstance(ghost_capacity, int)
                                       or ghost_capacity < 1):
        raise ValueError(f"knn: ghost_capacity must be a positive int or None, got {ghost_capacity!r}")
    if not isinstance(zorder, bool):
        raise TypeError(f"knn: zorder must be a bool, got {zorder!r}")
    if zorder and query is not None:
        raise ValueError("knn: zorder=True returns the particles' own rows in z-order and cannot be combined with "
                         "query=; drop one of them")
    if zorder and hasattr(part, "pos") and not hasattr(part, "ids"):
        raise TypeError(f"knn: zorder=True needs a particle pytree with an ids field (e.g. shardax.particles."
                        f"Particles) to say which particle each sorted row is; {type(part).__name__} has none")
    qpos, qvalid = pos, valid
    if query is not None:
        qpos, qvalid = _positions(query, "query")
        if qpos.shape[1] != dim:
            raise ValueError(f"knn: query has {qpos.shape[1]}-dimensional positions but part has {dim}; pass points "
                             "of the same dimension")
        if qpos.dtype != pos.dtype:
            raise TypeError(f"knn: query dtype {qpos.dtype} differs from part dtype {pos.dtype}; cast one of them")
        _check_finite(qpos, qvalid, "query")
        if box is None and not any(isinstance(x, Tracer) for x in (pos, valid, qpos, qvalid)) and \
                rank_info().size == 1:
            reach = _local_reach(jnp.concatenate([pos, qpos]), jnp.concatenate([valid, qvalid]))
            _check_extent(_extent(reach), pos.dtype, dim, "part and query")
    _check_box(box, dim, pos.dtype)
    check_local(pos, valid, box, "knn: part")
    if query is not None:
        check_local(qpos, qvalid, box, "knn: query")
    if reduce is not None and not callable(reduce):
        raise TypeError(f"knn: reduce must be a callable reduce(distances=, indices=, part=), got {reduce!r}")
    options = _Search(k=k, box=None, ghost_capacity=ghost_capacity, zorder=zorder, tuning=tuning)
    # Called outside any trace on one device: one program, not one dispatch per operation (with a reduce callable
    # it stays eager: a new function object on each call would compile again).
    if reduce is None and rank_info().size == 1 and is_concrete((part, query, box)):
        return run_compiled(_search_of, (part, query), options._replace(box=_static_box(box)))
    return _search(part, query, box, reduce, options)


class _Search(NamedTuple):
    """The static options of the search that follows :func:`_knn`'s checks (``box`` as Python numbers, for
    :func:`_search_of`)."""

    k: int
    box: float | tuple[float, ...] | None
    ghost_capacity: int | None
    zorder: bool
    tuning: KnnTuning | None


def _search_of(arrays: tuple[Any, Any], options: _Search) -> tuple[KnnResult, Flags, Any]:
    """:func:`_search` of ``arrays`` (the particles, and the query or None) and the static ``options``."""
    part, query = arrays
    return _search(part, query, options.box, None, options)


def _search(part: Any, query: Any, box: Box, reduce: Reduce | None, options: _Search
            ) -> tuple[KnnResult, Flags, Any]:
    """The search of :func:`_knn` on checked arguments: this device's results, buffer flags and z-sorted rows."""
    k, ghost_capacity, zorder, tuning = options.k, options.ghost_capacity, options.zorder, options.tuning
    pos, valid = _positions(part, "part")
    n, dim = pos.shape
    if query is None:
        qpos, qvalid, qpart = pos, valid, part
    else:
        qpos, qvalid = _positions(query, "query")
        qpart = query if hasattr(query, "pos") else Particles(pos=qpos, num=jnp.sum(qvalid, dtype=jnp.int32))
    boxv = None if box is None else as_vector(box, dim, pos.dtype, "box")  # checked by _knn
    ids = getattr(part, "ids", None)
    size = rank_info().size
    if ids is None:
        offset = scan(jnp.sum(valid, dtype=jnp.int32), inclusive=False) if size > 1 else jnp.int32(0)
        ids = offset + jnp.arange(n, dtype=jnp.int32)
    ids = jnp.where(valid, jnp.asarray(ids, jnp.int32), jnp.iinfo(jnp.int32).max)
    if (size > 1 or zorder) and query is None:
        if size > 1 and not hasattr(part, "pos"):
            # A plain array has no rows to spare for the z-order sort's uneven pieces: add some, answer for n.
            room = spare_rows(n)
            pos = jnp.concatenate([pos, jnp.zeros((room, dim), pos.dtype)])
            valid = jnp.concatenate([valid, jnp.zeros((room,), bool)])
            ids = jnp.concatenate([ids, jnp.full((room,), jnp.iinfo(jnp.int32).max, jnp.int32)])
            part = pos
        out = distributed_knn(part, pos, valid, ids, k, _static_box(box), boxv, reduce, ghost_capacity,
                              home=not zorder, tuning=tuning)
        if not zorder and out.distances.shape[0] > n:  # (with zorder the rows are zpart's, spare rows too)
            out = out._replace(distances=out.distances[:n], indices=jax.tree.map(lambda x: x[:n], out.indices))
        return KnnResult(out.distances, out.indices), out.flags, out.zpart
    if size > 1:
        # Separate query points on a mesh: every device searches all particles (exact, not scalable).
        # (One all-gather for the three: collectives that do not depend on each other must not be left unordered.)
        pos, valid, ids = (x.reshape(-1, *x.shape[2:]) for x in _flags.gather_together([pos, valid, ids]))

    dist2, indices = local_knn(pos, valid, qpos, qvalid, ids, k=k, box=boxv, tuning=tuning)  # (ids, -1 for none)
    distances = jnp.sqrt(dist2)
    if reduce is not None:
        indices = reduce(distances=distances, indices=indices, part=qpart)
    no, zero = jnp.zeros((), bool), jnp.zeros((), jnp.int32)
    return KnnResult(distances, indices), Flags(no, zero, no, zero), None


def _static_box(box: Box) -> float | tuple[float, ...] | None:
    if box is None or isinstance(box, int | float):
        return None if box is None else float(box)
    if isinstance(box, tuple | list):
        return tuple(float(b) for b in box)
    return tuple(np.asarray(box, np.float64).reshape(-1).tolist())


def _knn_smap(mesh: Mesh | None = None, *, jit: bool = True) -> Callable[..., Any]:
    """``knn.smap(mesh=None, jit=True)``: :func:`knn` on global ``(ndev, n, ...)`` particle arrays.

    The returned function takes the arguments of :func:`knn`; ``part`` and ``query`` are global pytrees (e.g. from
    :func:`shardax.particles.from_numpy`) or plain ``(ndev, n, d)`` position arrays (every row a point), the
    results have shape ``(ndev, m, k)`` aligned with the query rows.
    Called outside an outer ``jax.jit`` it raises ``ValueError`` for NaN positions or ``k`` larger than the total
    number of particles, and :class:`shardax.CapacityError` when a buffer was too small: ``err.argument ==
    "ghost_capacity"`` and ``err.needed`` the rows to pass, or ``err.argument is None`` when the z-order sort needed
    more rows per device than ``part`` has (``err.needed`` of them; build ``part`` with a larger
    ``capacity_factor``). With ``zorder=True`` it returns ``(KnnResult, zpart)`` in the global view. The constructor is cached per ``(mesh, jit)``: ``knn.smap(mesh)(...)`` in a loop compiles once per
    set of static arguments.
    """
    cache: dict[Hashable, Callable[..., Any]] = {}

    def call(part: Any, k: int, *, box: Box = None, query: Any = None, reduce: Reduce | None = None,
             ghost_capacity: int | None = None, zorder: bool = False,
             tuning: KnnTuning | TuningName | None = None) -> KnnResult | tuple[KnnResult, Any]:
        pos = check_global(part, "knn.smap", "knn")
        if query is not None:
            check_global(query, "knn.smap", "knn", name="query")
        rows = int(np.prod(jnp.shape(pos)[:2]))
        num = None if pos is part else part.num
        if num is None or isinstance(num, Tracer) or (isinstance(num, jax.Array) and not num.is_fully_addressable):
            count = rows  # only the rows are known here
        else:
            count = int(np.sum(np.asarray(num)))  # (check_count: every count lies in [0, rows per device])
        _check_k(k, rows, count)  # before compiling a search for an impossible k
        if box is not None and jnp.issubdtype(jnp.result_type(pos), jnp.floating):
            _check_box(box, int(jnp.shape(pos)[-1]), jnp.result_type(pos))
        static_box = _static_box(box)
        # Pytrees travel as flat leaf lists: smap's spec broadcasting would give an absent (None) field a spec.
        part_leaves, part_def = jax.tree.flatten(part)
        query_leaves, query_def = jax.tree.flatten(query)
        resolved = resolve(tuning, "knn.smap", None if mesh is None else mesh.devices)
        key = (k, static_box, reduce, ghost_capacity, zorder, resolved, part_def, query_def)
        fn = cache.get(key)
        if fn is None:
            def body(part_leaves: list[jax.Array], query_leaves: list[jax.Array]) -> tuple:
                part = jax.tree.unflatten(part_def, part_leaves)  # (a plain array stays one: see _search)
                query = jax.tree.unflatten(query_def, query_leaves)
                # Data checks inside the mapped function: the host cannot read other processes' rows.
                pos, valid = _positions(part, "part")
                finite = jnp.all(jnp.isfinite(pos), axis=-1)
                if static_box is None:  # the extent of the data and the queries
                    reach = _local_reach(pos, valid & finite)
                    if query is not None:
                        qpos, qvalid = _positions(query, "query")
                        reach = _local_reach(jnp.concatenate([pos, qpos]), jnp.concatenate([valid & finite, qvalid]))
                else:  # the data's bounds, checked against the box
                    reach = local_span(pos, jnp.sum(valid, dtype=jnp.int32))
                result, flags, zpart = _knn(part, k, box=static_box, query=query, reduce=reduce,
                                            ghost_capacity=ghost_capacity, zorder=zorder, tuning=resolved)
                # Every check in one collective, after the search's last one.
                checks, (total, nonfinite), (reach,) = _flags.across(
                    (result, zpart), maximum=flags, total=[jnp.sum(valid, dtype=jnp.int32),
                                                           jnp.sum(valid & ~finite, dtype=jnp.int32)],
                    minimum=[reach])
                if static_box is None:
                    return result, zpart, _flags.pack(*checks, total, nonfinite, _extent(reach))
                return result, zpart, _flags.pack(*checks, total, nonfinite, jnp.zeros((), pos.dtype),
                                                  *split_span(reach))

            fn = smap(body, in_specs=(ALL, ALL), out_specs=(ALL, ALL, P()), mesh=mesh, jit=jit, name="knn.smap",
                      compiler_options=particle_compiler_options() if jit else None)
            cache[key] = fn
        result, zpart, checks = fn(part_leaves, query_leaves)
        if not _flags.is_traced(checks):
            spans = bounds_layout(pos) if static_box is not None else ()
            words = _flags.unpack(checks, 1, 1, 1, 1, 1, 1, (1, jnp.result_type(pos)), *spans)
            ghost_overflow, ghost_needed, sort_overflow, sort_needed, total, nonfinite = (int(w[0]) for w in words[:6])
            extent, span = words[6][0], words[7:]  # one transfer
            if span:
                check_bounds(span[0], span[1], box, "knn.smap")
            if int(nonfinite):
                raise ValueError(f"knn: part has {int(nonfinite)} row(s) with NaN or infinite coordinates; remove or "
                                 "fix them")
            _check_extent(extent, jnp.result_type(pos), int(jnp.shape(pos)[-1]), "part")
            if k > int(total):
                raise ValueError(f"knn: k={k} is larger than the number of particles ({int(total)}); lower k")
            ndev, rows_per_device = (int(x) for x in jnp.shape(pos)[:2])
            if int(sort_overflow):
                raise CapacityError(f"knn: the z-order sort needed {int(sort_needed)} rows on a device but part has "
                                    f"{rows_per_device} rows per device; build the particles with more room "
                                    f"(shardax.particles.from_numpy(..., capacity_factor=...) or "
                                    f"shardax.particles.pad)", needed=int(sort_needed),
                                    available=rows_per_device)
            if int(ghost_overflow):
                available = ghost_capacity or default_ghost_capacity(rows_per_device, ndev)
                raise CapacityError(f"knn: a device had to send or receive {int(ghost_needed)} neighbour candidate "
                                    f"rows but ghost_capacity is {available}"
                                    f"{'' if ghost_capacity else ' (the default)'}; pass ghost_capacity="
                                    f"{int(ghost_needed)} or more", needed=int(ghost_needed), available=available,
                                    argument="ghost_capacity")
        return (result, zpart) if zorder else result

    return call


attach_global(knn, _knn_smap)

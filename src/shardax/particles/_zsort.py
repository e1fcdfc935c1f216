"""The public distributed z-order sort ``zsort`` (local view) and its global version ``zsort.smap``.

The sort itself is :func:`shardax._zorder.sort_particles`, the keys-first sample sort that the spatial kernels share
(see :mod:`shardax._zorder` for its steps, and for why FoF sorts with the one-exchange ``bucket_sort`` instead):
every device keys its particles, all agree on splitters from gathered samples, only the keys travel to their key
range's device to be ranked, and each particle then moves once, straight to its final device and row. Per device
the sort holds the input, the output and a few int32 words per row. On one device zsort is a single local sort.
This module checks the arguments, adds the :class:`Domain` and, for the global version, turns the devices' flags
into errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .. import _flags, _zorder
from .._bounds import bounds_layout, check_bounds, check_part, local_span, split_span
from .._compile import particle_compiler_options
from .._eager import is_concrete, run_compiled
from .._errors import CapacityError
from .._morton import Box, check_box
from .._pytree import check_global, check_positions, particle_set, row_count, spare_rows
from .._tuning import tuning_backend
from ..core import ALL, attach_global, rank_info, smap
from ._domain import Domain, domain_of
from ._particles import Particles

T = TypeVar("T")


@overload
def zsort(part: jax.Array | np.ndarray, *, box: Box | None = None, equalize: bool = True,
          capacity: int | None = None, return_domain: Literal[False] = False,
          num_cells: int = 64) -> tuple[Particles, jax.Array]: ...


@overload
def zsort(part: jax.Array | np.ndarray, *, box: Box | None = None, equalize: bool = True,
          capacity: int | None = None, return_domain: Literal[True],
          num_cells: int = 64) -> tuple[Particles, jax.Array, Domain]: ...


@overload
def zsort(part: T, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
          return_domain: Literal[False] = False, num_cells: int = 64) -> tuple[T, jax.Array]: ...


@overload
def zsort(part: T, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
          return_domain: Literal[True], num_cells: int = 64) -> tuple[T, jax.Array, Domain]: ...


def zsort(part: Any, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
          return_domain: bool = False, num_cells: int = 64) -> tuple[Any, jax.Array] | tuple[Any, jax.Array, Domain]:
    """Sort particles into global Morton (z-) order across all devices (local view; ``zsort.smap`` for global).

    After the call device ``r`` holds a contiguous piece of the global order: keys ascend within each device and
    from device to device, and particles with equal keys keep their global input order (device, then row). Every
    per-particle field travels with its particle.

    Args:
        part: a particle pytree (``.pos (n, d)``, ``.num``), e.g. :class:`Particles`, or a plain `(n, d)` array of
            positions (every row a particle; the result is then a :class:`Particles` without fields).
        box: periodic box size (scalar or `(d,)`): positions are wrapped into ``[0, box)`` (the returned ``pos``
            is wrapped) and keyed over that box. ``None``: keys over the global bounding box of the particles.
        equalize: rebalance so that device ``r`` holds ``num_total // ndev`` particles, plus one for the first
            ``num_total % ndev`` devices. Without it the counts follow the sample-sort splitters (within a few
            percent of even).
        capacity: rows per device of the result (static); default the input capacity ``n`` (for a plain array
            on several devices ``n + n // 8 + 64``: it has no rows to spare for the sort's uneven pieces).
        return_domain: also return the :class:`Domain` of the result (key ranges and bounding boxes).
        num_cells: top-level cells per device in the domain (static).

    Returns:
        ``(part, overflow)`` or ``(part, overflow, domain)``. ``overflow`` is true on a device that had to hold more
        than ``capacity`` rows at some step (rows were lost: raise ``capacity`` and call again). Rows with a NaN or
        infinite coordinate sort after every finite one (``zsort.smap`` rejects them).

    Example:
        >>> import shardax as sx
        >>> from shardax.particles import uniform, zsort
        >>> part = uniform(1000, seed=1)
        >>> zpart, overflow = zsort(part)
        >>> int(zpart.num), bool(overflow)
        (1000, False)
        >>> zpart, overflow = zsort.smap()(sx.particles.uniform.smap()(1000))   # global: (ndev, cap, 3)
    """
    plain = not hasattr(part, "pos")
    part = particle_set(part, "zsort", global_view="zsort.smap")
    check_part(part, box, "zsort")
    if plain and capacity is None and rank_info().size > 1:
        capacity = row_count(part) + spare_rows(row_count(part))
    options = (box, equalize, capacity, num_cells if return_domain else None)
    # Called outside any trace on arrays: one program, not one dispatch per operation.
    if isinstance(getattr(part, "pos", None), jax.Array | np.ndarray) and is_concrete(part):
        check_positions(part, "zsort")  # (the count is checked on its concrete value, as the program cannot)
        return run_compiled(_sorted, part, options)
    return _sorted(part, options)


def _sorted(part: Any, options: tuple[Box | None, bool, int | None, int | None]) -> Any:
    """The outputs of :func:`zsort` (``num_cells`` None: without the domain), after its checks."""
    box, equalize, capacity, num_cells = options
    result = _zorder.sort_particles(part, box=box, equalize=equalize, capacity=capacity)
    if num_cells is not None:
        return result.part, result.overflow, domain_of(result.part, result.key_box, num_cells)
    return result.part, result.overflow


def _global_zsort(mesh: Mesh | None = None, *, jit: bool = True, donate: bool = False) -> Callable[..., Any]:
    """``zsort.smap(mesh=None, jit=True, donate=False)``: the global zsort over ``(ndev, n, ...)`` particle arrays.

    The returned function takes the same arguments as :func:`zsort` and returns the same outputs in the global view.
    It raises :class:`shardax.CapacityError` when a device would overflow (with the capacity needed) and
    ``ValueError`` for NaN or infinite positions. Called under an outer ``jax.jit`` it cannot raise: check
    ``overflow`` yourself there. The constructor is cached per ``(mesh, jit, donate)``: ``zsort.smap(mesh)(...)``
    in a loop compiles once per set of static arguments.

    ``donate=True`` (needs ``jit=True``) hands the input particles' buffers to the sort: the sorted fields are
    written into them when ``capacity`` is the input's (the default); the compiled peak memory per device drops a
    little (2.82x -> 2.80x the particle buffers on 8 devices, see docs/particles.md). The input cannot be used
    afterwards, even when the call raises (``CapacityError``, a box that does not fit the positions): keep what you
    need to retry (e.g. the host arrays you built it from).
    """
    if not isinstance(donate, bool) or not isinstance(jit, bool):
        raise TypeError(f"zsort.smap: jit and donate must be bool, got jit={jit!r}, donate={donate!r}")
    if donate and not jit:
        raise ValueError("zsort.smap: donate=True needs jit=True (only a jitted call can reuse the input buffers)")
    return _constructed(mesh, jit, donate)


def _constructed(mesh: Mesh | None, jit: bool, donate: bool) -> Callable[..., Any]:
    cache: dict[tuple, Callable[..., Any]] = {}

    def call(part: Any, *, box: Box | None = None, equalize: bool = True, capacity: int | None = None,
             return_domain: bool = False, num_cells: int = 64) -> Any:
        pos = check_global(part, "zsort.smap", "zsort")
        if pos is part and capacity is None and int(jnp.shape(pos)[0]) > 1:  # a plain array: room, as zsort's
            capacity = int(jnp.shape(pos)[1]) + spare_rows(int(jnp.shape(pos)[1]))
        dtype = jnp.result_type(pos)
        if box is not None and not isinstance(box, Tracer) and dtype in (jnp.float32, jnp.float64):
            check_box(box, int(jnp.shape(pos)[-1]), dtype, optional=False)  # clear errors before anything is traced
        static_box = box is None or isinstance(box, int | float | tuple)
        leaves, treedef = jax.tree.flatten(part)
        # The tuning preset is read while tracing (the domain's cell statistics): one program per preset.
        key = (treedef, static_box, box if static_box else None, equalize, capacity, return_domain, num_cells,
               tuning_backend(None if mesh is None else mesh.devices))
        fn = cache.get(key)
        if fn is None:
            def body(leaves: list[jax.Array], box_arg: Any) -> tuple:
                local = particle_set(jax.tree.unflatten(treedef, leaves), "zsort.smap", global_view="zsort.smap")
                result = _zorder.sort_particles(local, box=box if static_box else box_arg, equalize=equalize,
                                                capacity=capacity)
                # Every device knows the largest need: no collective for the flags.
                cap = capacity if capacity is not None else jnp.shape(local.pos)[0]
                checks = (result.worst > cap, result.worst, result.nonfinite)
                dom = domain_of(result.part, result.key_box, num_cells) if return_domain else None
                if box is not None and jnp.issubdtype(local.pos.dtype, jnp.floating):  # checked after the call
                    # (after the sort's and the domain's collectives, as every pair of collectives must be ordered)
                    _, _, (both,) = _flags.across((result.part, dom), minimum=[local_span(local.pos, local.num)])
                    checks += split_span(both)
                return result.part, result.overflow, _flags.pack(*checks), dom

            fn = smap(body, in_specs=(ALL, P() if not static_box else None),
                      out_specs=(ALL, ALL, P(), P()), mesh=mesh, jit=jit, donate_argnums=(0,) if donate else (),
                      name="zsort.smap", compiler_options=particle_compiler_options() if jit else None)
            cache[key] = fn
        out_part, overflow, checks, dom = fn(leaves, None if static_box else box)
        if not _flags.is_traced(checks):
            spans = bounds_layout(pos) if checks.shape[0] > 3 else ()
            words = _flags.unpack(checks, 1, 1, 1, *spans)  # one transfer
            any_overflow, needed, nonfinite = (int(w[0]) for w in words[:3])
            span = words[3:]
            if span:
                check_bounds(span[0], span[1], box, "zsort.smap")
            if int(nonfinite):
                raise ValueError(f"zsort: {int(nonfinite)} particle(s) have a NaN or infinite coordinate in part.pos; "
                                 "remove them or replace the positions before sorting")
            if int(any_overflow):
                available = capacity if capacity is not None else int(jnp.shape(pos)[1])
                raise CapacityError(
                    f"zsort: a device needed {int(needed)} rows but capacity is {available}; pass capacity="
                    f"{int(needed) + int(needed) // 8 + 1} (or a larger capacity_factor to from_numpy)",
                    needed=int(needed), available=available, argument="capacity")
        return (out_part, overflow, dom) if return_domain else (out_part, overflow)

    return call


attach_global(zsort, _global_zsort)

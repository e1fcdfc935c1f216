"""``fof.smap``: :func:`shardax.spatial.fof` over global ``(ndev, n, ...)`` arrays.

One :func:`shardax.smap` of ``fof`` per argument structure and buffer sizes; the host reads back, in one transfer,
the flags of every device (overflow, the rows each buffer needed, positions that are not finite, the data's bounds
in a periodic box), raises for bad data, and reruns with grown buffers those the caller left unset.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .. import _flags
from .._bounds import bounds_layout, check_bounds, local_span, split_span
from .._compile import particle_compiler_options
from .._errors import CapacityError
from .._morton import check_box
from .._pytree import check_global, pad_global, particle_set
from ..core import ALL, attach_global, smap
from ..particles import Particles
from ._fof import Buffers, FofResult, TuningName, device_buffers, fof, requested_buffers
from ._fof_tuning import Tuning, resolve

# The ghost buffer ``fof.smap`` starts from when ``halo_capacity`` is left unset. Boundary rows are a few percent of
# a device's particles at the usual sizes (1e6 uniform points on 8 devices: 3% at b = 0.2, 9% at b = 0.7), and the
# linking and the catalogue hold the own rows plus this buffer: a buffer of n / 16 rows keeps the compiled working
# set well below the one of ``fof``'s default (n / 4), at the same speed. A device that needs more grows it (see
# ``global_fof``).
_AUTO_HALO_FRACTION = 16
_AUTO_HALO_MIN = 1024  # (and never fewer rows)
# Runs of one call while automatic buffers grow (each growth compiles the kernel for the new sizes once).
_AUTO_ROUNDS = 4


class _Static(NamedTuple):
    """The static arguments of a ``fof.smap`` program (a new value compiles a new program)."""

    linking_length: float
    box: float | tuple[float, ...] | None
    min_members: int
    tuning: Tuning
    catalogue: bool


def _global_shape(part: Any) -> tuple[int, int]:
    """``(ndev, n)`` of a global particle pytree or a plain ``(ndev, n, d)`` position array."""
    pos = check_global(part, "fof.smap", "fof")
    ndev, n = (int(k) for k in jnp.shape(pos)[:2])
    return ndev, n


def _smap_body(treedef: Any, static: _Static, sizes: Buffers) -> Callable[..., Any]:
    """The mapped function of ``fof.smap``: :func:`fof` on one device's leaves, and the flags the host checks
    (overflow, the rows each buffer needed, positions that are not finite, the data's bounds in a box)."""

    def body(leaves: list[jax.Array]) -> tuple[FofResult, jax.Array]:
        local = jax.tree.unflatten(treedef, leaves)
        view = particle_set(local, "fof.smap", global_view="fof.smap")
        n = view.pos.shape[0]
        valid = jnp.arange(n) < view.num
        bad = jnp.sum(valid & ~jnp.all(jnp.isfinite(view.pos), axis=1)).astype(jnp.int32)
        res = fof(local, static.linking_length, box=static.box, min_members=static.min_members,
                  tuning=static.tuning, catalogue=static.catalogue, **sizes._asdict())
        # One all-gather for every flag (across processes each collective costs milliseconds), after FoF's last
        # collective: two that do not depend on each other could run in different orders on different devices.
        spans = [local_span(view.pos, view.num)] if static.box is not None else []  # checked after the call
        (worst,), (total_bad,), minima = _flags.across(
            res, maximum=[jnp.concatenate([res.overflow.astype(jnp.int32)[None], res.needed])], total=[bad],
            minimum=spans)
        span = split_span(minima[0]) if minima else ()
        return res, _flags.pack(worst[0], worst[1:], total_bad, *span)

    return body


def _check_data(bad: Any, span: list[Any], box: Any) -> None:
    """Raise ``ValueError`` for data outside the periodic box or not finite (flags of :func:`_smap_body`)."""
    if span:  # before the other checks: counts of data in another box mean nothing
        check_bounds(span[0], span[1], box, "fof.smap")
    if int(bad):
        raise ValueError(f"fof: {int(bad)} particle(s) have NaN or infinite coordinates in part.pos; remove or fix "
                         "them")


def global_fof(mesh: Mesh | None = None, *, jit: bool = True) -> Callable[..., FofResult]:
    """``fof.smap(mesh=None, jit=True)``: :func:`fof` over global ``(ndev, n, ...)`` particle arrays.

    The returned function takes the arguments of :func:`fof` (``linking_length`` and ``box`` as Python numbers: a
    new value recompiles) and returns a :class:`FofResult` in the global view (``labels (ndev, n)``, catalogue
    fields ``(ndev, g, ...)``; None with ``catalogue=False``). ``part`` is a global particle pytree or a plain
    ``(ndev, n, d)`` position array (every row a particle).

    Buffers left unset are sized automatically: ``halo_capacity`` starts at ``max(n // 16, 1024)`` rows and
    ``sort_capacity`` at ``n``, and when a device needs more of any unset buffer (``edge_capacity``,
    ``halo_capacity``, ``max_groups``, ``sort_capacity``) the call runs again with a quarter more than it needed, and
    later calls with the same arguments start from the grown sizes (each new size compiles once). A buffer given
    explicitly is never changed: its overflow raises :class:`shardax.CapacityError` naming it and the size needed.
    ``ValueError`` for NaN or infinite positions. Constructors are cached per ``(mesh, jit)``, so calling
    ``fof.smap(mesh)(...)`` repeatedly compiles once per argument structure.
    """
    cache: dict[tuple, Callable[..., Any]] = {}
    grown: dict[tuple, dict[str, int]] = {}

    def compiled(treedef: Any, static: _Static, sizes: Buffers) -> Callable[..., Any]:
        key = (treedef, *static, *sizes)
        if key not in cache:
            cache[key] = smap(_smap_body(treedef, static, sizes), in_specs=(ALL,), out_specs=(ALL, P()), mesh=mesh,
                              jit=jit, name="fof.smap",
                              compiler_options=particle_compiler_options() if jit else None)
        return cache[key]

    def call(part: Any, linking_length: float, *, box: Any = None, min_members: int = 20,
             max_groups: int | None = None, edge_capacity: int | None = None, halo_capacity: int | None = None,
             sort_capacity: int | None = None, tuning: Tuning | TuningName | None = None,
             catalogue: bool = True) -> FofResult:
        tuning = resolve(tuning, "fof.smap", None if mesh is None else mesh.devices)
        if not isinstance(catalogue, bool):
            raise TypeError(f"fof.smap: catalogue must be True or False (False: labels only), got {catalogue!r}")
        ndev, n = _global_shape(part)
        pos = part if isinstance(part, jax.Array | np.ndarray) else part.pos
        if isinstance(linking_length, bool) or not isinstance(linking_length, int | float | np.floating):
            raise TypeError(f"fof.smap: linking_length must be a Python number, got {type(linking_length).__name__}")
        if jnp.issubdtype(jnp.result_type(pos), jnp.floating):
            check_box(box, int(jnp.shape(pos)[-1]), jnp.result_type(pos))
        requested = requested_buffers(edge_capacity=edge_capacity, halo_capacity=halo_capacity, max_groups=max_groups,
                               sort_capacity=sort_capacity)
        if ndev == 1 and n == 1:  # the one-device pair search needs two rows: add a padding row, drop its label
            if pos is part:
                part = Particles(pos=jnp.asarray(pos), num=jnp.ones((1,), jnp.int32))
            res = call(pad_global(part, 1), linking_length, box=box, min_members=min_members, tuning=tuning,
                       catalogue=catalogue, **requested._asdict())
            return res._replace(labels=res.labels[:, :1])
        static_box = None if box is None else (float(box) if np.ndim(box) == 0 else tuple(np.asarray(box).tolist()))
        static = _Static(float(linking_length), static_box, min_members, tuning, catalogue)
        leaves, treedef = jax.tree.flatten(part)
        auto = grown.setdefault((treedef, n, *static, *requested), {})
        for _ in range(_AUTO_ROUNDS):
            sizes = _start_sizes(requested, auto, n)
            res, checks = compiled(treedef, static, sizes)(leaves)
            if _flags.is_traced(checks):
                return res
            words = _flags.unpack(checks, 1, len(Buffers._fields), 1, *(bounds_layout(pos) if box is not None else ()))
            any_overflow, needed, bad, span = words[0][0], words[1], words[2][0], words[3:]  # one transfer
            _check_data(bad, span, box)
            if not int(any_overflow):
                return res
            short = _short_buffers(np.asarray(needed), sizes, n=n, ndev=ndev, min_members=min_members,
                                   tuning=tuning)
            if not short or any(getattr(requested, name) is not None for name in short):
                break
            auto.update(short)
        _raise_capacity(np.asarray(needed), device_buffers(sizes, n=n, devices=ndev, min_members=min_members,
                                                           tuning=tuning))

    return call


def _start_sizes(requested: Buffers, grown: dict[str, int], n: int) -> Buffers:
    """The buffer sizes of a run of ``fof.smap``: as requested, else as grown by earlier runs, else the default
    (for the ghost rows the automatic start, a fraction of the ``n`` rows per device)."""
    sizes = Buffers(*(given or grown.get(name) for name, given in requested._asdict().items()))
    return sizes._replace(halo_capacity=sizes.halo_capacity or max(n // _AUTO_HALO_FRACTION, _AUTO_HALO_MIN))


def _short_buffers(needed: np.ndarray, sizes: Buffers, *, n: int, ndev: int, min_members: int,
                   tuning: Tuning) -> dict[str, int]:
    """The buffers of ``sizes`` that a call of ``fof.smap`` on ``ndev`` devices of ``n`` rows overflowed, each with
    a quarter more than a device ``needed``; the ghost buffer doubled when an exchange overflowed without a count
    over its buffer."""
    have = device_buffers(sizes, n=n, devices=ndev, min_members=min_members, tuning=tuning)
    short = {name: k + k // 4 + 1 for name, k, h in zip(Buffers._fields, needed.tolist(), have, strict=True)
             if k > h}
    if not short and ndev > 1:
        short = {"halo_capacity": 2 * have.halo_capacity}
    return short


def _raise_capacity(needed: np.ndarray, buffers: Buffers) -> NoReturn:
    """Raise the :class:`CapacityError` of the first buffer (of ``buffers``) a device ``needed`` more of."""
    # The sorted rows first: when a device overflows them, the other counts are of incomplete data.
    for name, need, have in sorted(zip(Buffers._fields, needed.tolist(), buffers, strict=True),
                                   key=lambda item: item[0] != "sort_capacity"):
        if need > have:
            raise CapacityError(f"fof: a device needed {need} rows of {name} but has {have}; pass "
                                f"{name}={need + need // 4 + 1}",
                                needed=need + need // 4 + 1, available=have, argument=name)
    halo = buffers.halo_capacity
    raise CapacityError("fof: an exchange between devices overflowed; raise halo_capacity",
                        needed=2 * max(halo, 1), available=halo, argument="halo_capacity")


attach_global(fof, global_fof)

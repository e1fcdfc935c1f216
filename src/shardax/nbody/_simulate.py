"""The whole run in one program: initial conditions, kick-drift-kick steps and snapshots (``evolve``, ``simulate``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .._errors import CapacityError
from ..core import default_mesh, smap
from ..particles import Particles
from ._api import (
    _REPLICATED,
    _ROWS,
    _lpt_coeffs,
    _particles,
    _power_fn,
    _rows_out,
    _setup_for,
    _source_key,
    _table,
    _unkey,
    white_noise,
)
from ._cosmology import Cosmology, check_cosmology
from ._kdk import ADJOINTS, Adjoint, StepFactors, local_kdk, step_factors
from ._lpt import lagrangian, local_lpt_fields
from ._setup import Setup, make_setup, power_source, scale_factors


class Simulation(NamedTuple):
    """The result of :func:`simulate`.

    Attributes:
        particles: global :class:`shardax.particles.Particles` at ``a_end``: ``pos`` in Mpc/h in ``[0, box)``,
            ``vel`` peculiar velocity in km/s, ``ids`` the Lagrangian grid index ``i n^2 + j n + k``, ``num`` per
            device, ``mass`` ``None``.
        snapshots: one ``(a, particles)`` per requested scale factor, same units.
        a: the scale factors of the step boundaries (``a_start`` ... ``a_end``, snapshots included).
    """

    particles: Particles
    snapshots: tuple[tuple[float, Particles], ...]
    a: np.ndarray


@functools.lru_cache(maxsize=16)
def _evolve_fn(setup: Setup, source_key: Any, snapshots: int, adjoint: Adjoint) -> Callable[..., tuple[Any, ...]]:
    source = _unkey(source_key)

    def body(noise: jax.Array, table: jax.Array | None, coeffs: jax.Array, factors: StepFactors,
             slots: jax.Array) -> tuple[Any, ...]:
        s1, s2 = local_lpt_fields(setup, noise, _power_fn(source, setup, table))
        q, ids = lagrangian(setup, noise.dtype)
        pos, mom = q + coeffs[0] * s1, coeffs[2] * s1
        if s2 is not None:
            pos, mom = pos + coeffs[1] * s2, mom + coeffs[3] * s2
        pos, mom, needed, buffers = local_kdk(setup, pos, mom, factors, slots, snapshots, adjoint)
        snaps = () if buffers is None else tuple(b[None] for b in buffers)
        return (_rows_out(pos), _rows_out(mom), _rows_out(ids), needed, snaps)

    snap_specs = () if not snapshots else (_ROWS, _ROWS)
    return smap(body, in_specs=(setup.spec, _REPLICATED, _REPLICATED, _REPLICATED, _REPLICATED),
                out_specs=(_ROWS, _ROWS, _ROWS, _REPLICATED, snap_specs), mesh=setup.mesh, expand=False)


def _run(setup: Setup, source_key: Any, snapshots: int, adjoint: Adjoint, cosmo: Cosmology, noise: jax.Array,
         table: jax.Array | None, times: jax.Array, slots: jax.Array) -> tuple[Any, ...]:
    """One compiled program: growth and step factors, the power table (from ``cosmo`` unless given) and the run."""
    if table is None and source_key is None:
        table = _table(None, cosmo, setup)
    factors = step_factors(cosmo, times)
    return _program(setup, source_key, snapshots, adjoint)(noise, table, _lpt_coeffs(cosmo, times[0]), factors, slots)


@functools.lru_cache(maxsize=16)
def _program(setup: Setup, source_key: Any, snapshots: int, adjoint: Adjoint) -> Callable[..., tuple[Any, ...]]:
    """The mapped run, compiled apart from the growth and power tables (each compiled once per process)."""
    return jax.jit(_evolve_fn(setup, source_key, snapshots, adjoint))


def _check_adjoint(adjoint: Any, where: str) -> Adjoint:
    if adjoint not in ADJOINTS:
        raise ValueError(f"{where}: adjoint must be 'reverse' (the steps run backwards in the gradient: memory "
                         f"independent of the steps) or 'checkpoint' (one saved state per step), got {adjoint!r}")
    return adjoint


def _user_table(source: Any) -> jax.Array | None:
    return None if source is None or callable(source) else jnp.asarray(source[1], jnp.result_type(float))


def evolve(cosmo: Cosmology, noise: jax.Array, *, box: float, a: Sequence[float], order: int = 2,
           mesh_per_side: int | None = None, power: Any = None, mesh: Mesh | None = None, gradient: str = "fd4",
           deconvolve: bool = False, capacity: int | None = None, adjoint: Adjoint = "reverse"
           ) -> tuple[Particles, jax.Array]:
    """LPT initial conditions at ``a[0]`` and FastPM kick-drift-kick steps through the scale factors ``a``.

    The differentiable core of :func:`simulate`: a function of ``cosmo`` and ``noise`` that can be put under
    ``jax.grad`` / ``jax.jit`` (``box``, ``a`` and the options are static). By default the gradient is the
    reverse-time adjoint of pmwd: the backward pass runs the kick-drift-kick steps backwards from the final state
    (they are time-reversible) and pulls the cotangents through one step at a time, so its memory does not grow
    with the number of steps. The reconstructed trajectory differs from the forward one by round-off (a few ulp of
    the positions per step, amplified where orbits cross); ``adjoint="checkpoint"`` rematerialises each step from a
    saved state instead (``jax.checkpoint``): exact, but it keeps positions, momenta and forces per step, and it
    also supports forward mode (``jax.jvp``, ``jax.jacfwd``), which the reverse adjoint (a ``jax.custom_vjp``) does
    not. The forward values do not depend on ``adjoint``.

    Args:
        cosmo: the cosmology.
        noise: `(n, n, n)` unit white noise (:func:`white_noise`): one particle per grid point.
        box: box side in Mpc/h.
        a: increasing scale factors, the step boundaries (``len(a) - 1`` steps).
        order: LPT order of the initial conditions, 1 or 2.
        mesh_per_side: force mesh side (default ``n``; ``2 n`` with ``deconvolve=True`` makes long waves grow as
            linear theory to 1%, and puts the mesh nodes half a cell off the Lagrangian grid).
        power: a callable ``P(k)`` or ``(k, P)`` table in place of the cosmology's linear power.
        mesh: the mesh (default: the context mesh, else ``sx.flat_mesh()``).
        gradient: ``"fd4"`` or ``"spectral"`` force gradient (see :func:`pm_forces`).
        deconvolve: divide the density by the cloud-in-cell window.
        capacity: particles a device may receive while painting (default 1.5 times its own).
        adjoint: how ``jax.grad`` goes through the steps: ``"reverse"`` (memory independent of the steps) or
            ``"checkpoint"`` (one saved state per step, no reconstruction round-off, forward mode too).

    Returns:
        ``(particles, needed)``: global particles at ``a[-1]`` (as :func:`simulate`) and the most particles a device
        had to receive; above the capacity, some were dropped from a density: retry with a larger ``capacity``.

    Example:
        >>> import shardax as sx
        >>> noise = sx.nbody.white_noise(16)
        >>> part, needed = sx.nbody.evolve(sx.nbody.Cosmology(), noise, box=200.0, a=[0.1, 0.5, 1.0])
        >>> part.pos.shape[-1]
        3
    """
    check_cosmology(cosmo, "evolve")
    adjoint = _check_adjoint(adjoint, "evolve")
    setup, noise = _setup_for(noise, box, mesh, "evolve", mesh_per_side=mesh_per_side, order=order,
                              gradient=gradient, deconvolve=deconvolve, capacity=capacity)
    times_np = np.asarray(a, np.float64)
    if times_np.ndim != 1 or times_np.size < 2:
        raise ValueError(f"evolve: a must be at least two scale factors (the step boundaries), got {a!r}")
    scale_factors(times_np[0], times_np[-1], len(times_np) - 1, list(times_np[1:-1]), "evolve")
    times = jnp.asarray(times_np, noise.dtype)
    source = power_source(power, "evolve")
    slots = jnp.zeros(len(times_np) - 1, jnp.int32)
    pos, mom, ids, needed, _ = _run(setup, _source_key(source), 0, adjoint, cosmo, noise, _user_table(source), times,
                                    slots)
    return _particles(setup, pos, mom, ids, times[-1]), needed


def simulate(cosmo: Cosmology, *, particles_per_side: int, box: float, mesh_per_side: int | None = None,
             a_start: float, a_end: float = 1.0, steps: int, seed: int = 0, order: int = 2,
             snapshots: Sequence[float] = (), mesh: Mesh | None = None, power: Any = None, gradient: str = "fd4",
             deconvolve: bool = False, capacity: int | None = None, adjoint: Adjoint = "reverse") -> Simulation:
    """A particle-mesh N-body simulation: Gaussian initial conditions, 2LPT, FastPM kick-drift-kick steps.

    White noise from ``seed`` (:func:`white_noise`, identical on any layout), LPT particles at ``a_start``
    (:func:`lpt`), then ``steps`` equal steps in ``a`` to ``a_end`` (with the snapshot times inserted as extra step
    boundaries), all in one compiled program over the mesh.

    Args:
        cosmo: the cosmology (:class:`Cosmology`).
        particles_per_side: ``n``: ``n^3`` particles on a grid (a power of two divisible by the mesh axes).
        box: box side in Mpc/h.
        mesh_per_side: force mesh side (default ``n``; a power of two). ``2 n`` with ``deconvolve=True`` makes long
            waves grow as linear theory to 1% (docs/nbody.md); its nodes then sit half a cell off the Lagrangian grid.
        a_start: initial scale factor (``>= 1e-3``).
        a_end: final scale factor (``<= 1``).
        steps: number of kick-drift-kick steps (``>= 1``).
        seed: random seed of the white noise.
        order: LPT order, 1 or 2.
        snapshots: increasing scale factors in ``(a_start, a_end]`` at which to keep the particles.
        mesh: the mesh (default: ``sx.flat_mesh()``, all devices of all processes: slabs; a 2D mesh: pencils).
        power: a callable ``P(k)`` or ``(k, P)`` table in place of the cosmology's linear power.
        gradient: ``"fd4"`` or ``"spectral"`` force gradient.
        deconvolve: divide the density by the cloud-in-cell window.
        capacity: particles a device may receive while painting (default 1.5 times its own; a run that needs more
            is redone once with what it needed, so nothing is dropped).
        adjoint: ``"reverse"`` or ``"checkpoint"``: how a gradient goes through the steps (see :func:`evolve`);
            the results do not depend on it.

    Returns:
        A :class:`Simulation`.

    Example:
        >>> import shardax as sx
        >>> sim = sx.nbody.simulate(sx.nbody.Cosmology(), particles_per_side=16, box=200.0, a_start=0.1, steps=4,
        ...                         snapshots=(0.5,))
        >>> sim.particles.pos.shape[-1], [a for a, _ in sim.snapshots]
        (3, [0.5])
    """
    check_cosmology(cosmo, "simulate")
    adjoint = _check_adjoint(adjoint, "simulate")
    times_np, slots_np = scale_factors(a_start, a_end, steps, snapshots, "simulate")
    the_mesh = default_mesh(mesh)
    setup = make_setup(n=particles_per_side, nm=particles_per_side if mesh_per_side is None else mesh_per_side,
                       box=box, mesh=the_mesh, order=order, gradient=gradient, deconvolve=deconvolve,
                       capacity=capacity, where="simulate")
    source = power_source(power, "simulate")
    noise = white_noise(setup.n, seed=seed, mesh=the_mesh)
    times = jnp.asarray(times_np, noise.dtype)
    slots = jnp.asarray(slots_np)
    key, table = _source_key(source), _user_table(source)
    outputs = _run(setup, key, len(snapshots), adjoint, cosmo, noise, table, times, slots)
    needed = int(outputs[3])
    if needed > setup.capacity:
        if capacity is not None:
            raise CapacityError(f"simulate: a device had to receive {needed} particles but capacity is {capacity}; "
                                f"pass capacity={needed} or more", needed=needed, available=capacity,
                                argument="capacity")
        setup = dataclasses.replace(setup, capacity=needed + needed // 8)
        outputs = _run(setup, key, len(snapshots), adjoint, cosmo, noise, table, times, slots)
    pos, mom, ids, _, snaps = outputs
    final = _particles(setup, pos, mom, ids, times[-1])
    kept = []
    for slot, a_snap in enumerate(snapshots):
        kept.append((float(a_snap), _particles(setup, snaps[0][:, slot], snaps[1][:, slot], ids,
                                               jnp.asarray(a_snap, noise.dtype))))
    return Simulation(particles=final, snapshots=tuple(kept), a=times_np)

"""The global particle-mesh programs: white noise, linear field, LPT, PM forces and the evolution (one ``smap``)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import comm, fft, fields
from .._errors import CapacityError
from ..core import ALL, default_mesh, smap
from ..particles import Particles
from ._cosmology import Cosmology, check_cosmology, growth_tables, interpolate_growth, linear_power
from ._forces import local_pm_forces, wrap
from ._lpt import PowerFn, lagrangian, local_linear_modes, local_lpt_fields, local_white_noise
from ._setup import Setup, check_noise, make_setup, power_source

# Velocities in km/s from momenta p = a^3 E dx/da in Mpc/h: v = a dx/dt = H0 p / a, H0 = 100 km/s/(Mpc/h).
_H0 = 100.0
_REPLICATED = PartitionSpec()
_ROWS = PartitionSpec(ALL)


def _dtype() -> Any:
    return jnp.result_type(float)


def _table_grid(setup: Setup) -> np.ndarray:
    """``log k`` points (h/Mpc) spanning every wavenumber of the particle grid and the force mesh."""
    kmin = 2 * math.pi / setup.box
    kmax = math.sqrt(3) * math.pi * max(setup.n, setup.nm) / setup.box
    return np.linspace(math.log(kmin / 2), math.log(kmax * 2), 512)


def _power_fn(source: Any, setup: Setup, table: jax.Array | None) -> PowerFn:
    """``P(|k|)`` in the local view: the callable itself, or linear interpolation in ``log k`` of a table."""
    if callable(source):
        return lambda k: jnp.asarray(source(k)).astype(k.dtype)
    log_k = jnp.asarray(source[0] if source is not None else _table_grid(setup))
    assert table is not None

    def interpolate(k: jax.Array) -> jax.Array:
        logs = jnp.log(jnp.maximum(k, jnp.asarray(1e-30, k.dtype)))
        return jnp.interp(logs, log_k.astype(k.dtype), table.astype(k.dtype))
    return interpolate


def _table(source: Any, cosmo: Cosmology | None, setup: Setup) -> jax.Array | None:
    if callable(source):
        return None
    if source is not None:
        return jnp.asarray(source[1], _dtype())
    assert cosmo is not None
    return linear_power(cosmo, jnp.exp(jnp.asarray(_table_grid(setup), _dtype())))


def _source_key(source: Any) -> Any:
    """A hashable stand-in for the power source in the program caches (tables travel as arrays)."""
    if source is None or callable(source):
        return source
    return ("table", tuple(source[0].tolist()))


def _unkey(key: Any) -> Any:
    if isinstance(key, tuple):
        return (np.asarray(key[1]), None)
    return key


@functools.lru_cache(maxsize=32)
def _noise_fn(setup: Setup, dtype: Any) -> Callable[[jax.Array], jax.Array]:
    return smap(lambda seed: local_white_noise(setup, seed, dtype), in_specs=(_REPLICATED,), out_specs=setup.spec,
                mesh=setup.mesh, expand=False, jit=True)


def white_noise(particles_per_side: int, *, seed: int = 0, mesh: Mesh | None = None, dtype: Any = None
                ) -> jax.Array:
    """Unit Gaussian white noise on an ``n^3`` grid, split in slabs (1D mesh) or pencils (2D mesh).

    Counter-based (Threefry-2x32 of the global grid index, then Box-Muller), so the same seed gives the same field
    on any number of devices and processes.

    Args:
        particles_per_side: grid side ``n`` (a power of two divisible by the mesh axes).
        seed: the random seed.
        mesh: the mesh (default: the context mesh, else ``sx.flat_mesh()``).
        dtype: float dtype (default: float32, float64 with ``jax_enable_x64``).

    Returns:
        `(n, n, n)` noise sharded ``P(*mesh.axis_names)``.

    Example:
        >>> import shardax as sx
        >>> noise = sx.nbody.white_noise(16, seed=1)
        >>> noise.shape, abs(float(noise.mean())) < 0.1
        ((16, 16, 16), True)
    """
    setup = make_setup(n=particles_per_side, nm=particles_per_side, box=1.0, mesh=default_mesh(mesh),
                       where="white_noise")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"white_noise: seed must be an int, got {type(seed).__name__}")
    the_dtype = _dtype() if dtype is None else jnp.dtype(dtype)
    if the_dtype not in (jnp.float32, jnp.float64):
        raise TypeError(f"white_noise: dtype must be float32 or float64, got {the_dtype}")
    return _noise_fn(setup, the_dtype)(jnp.asarray(np.uint32(int(seed) % 2**32)))


def _setup_for(noise: Any, box: Any, mesh: Mesh | None, where: str, **options: Any) -> tuple[Setup, jax.Array]:
    the_mesh = default_mesh(mesh)
    n = np.shape(noise)[0] if np.ndim(noise) == 3 else -1
    if n < 0:
        raise ValueError(f"{where}: noise must be a 3D array (n, n, n), got shape {np.shape(noise)}")
    setup = make_setup(n=n, nm=options.pop("mesh_per_side", None) or n, box=box, mesh=the_mesh, where=where,
                       **options)
    return setup, check_noise(noise, setup, where)


@functools.lru_cache(maxsize=32)
def _linear_fn(setup: Setup, source_key: Any) -> Callable[..., jax.Array]:
    source = _unkey(source_key)

    def body(noise: jax.Array, table: jax.Array | None) -> jax.Array:
        modes, _ = local_linear_modes(setup, noise, _power_fn(source, setup, table))
        return fft.local_irfftn(modes, spec=setup.spec, layout=setup.fft_layout, s=(setup.n, setup.n, setup.n))
    return smap(body, in_specs=(setup.spec, _REPLICATED), out_specs=setup.spec, mesh=setup.mesh, expand=False,
                jit=True)


def linear_field(noise: jax.Array, *, box: float, cosmo: Cosmology | None = None, power: Any = None,
                 mesh: Mesh | None = None) -> jax.Array:
    """The linear density contrast at ``a = 1`` with power spectrum ``P(k)`` from white ``noise``.

    ``delta = irfftn(rfftn(noise) sqrt(P(|k|) n^3 / V))`` (zero mode removed), so that the field's measured power
    is ``P(k)`` in ``(Mpc/h)^3``.

    Args:
        noise: `(n, n, n)` unit white noise (e.g. :func:`white_noise`), sharded like the mesh's slabs or pencils.
        box: box side in Mpc/h.
        cosmo: the cosmology whose :func:`linear_power` is used when ``power`` is ``None``.
        power: a JAX-traceable callable ``P(k)`` of ``|k|`` in h/Mpc, or a ``(k, P)`` table (interpolated linearly
            in ``log k``); overrides ``cosmo``.
        mesh: the mesh (default: the context mesh, else ``sx.flat_mesh()``).

    Returns:
        `(n, n, n)` field sharded like ``noise``.

    Example:
        >>> import shardax as sx
        >>> noise = sx.nbody.white_noise(16)
        >>> delta = sx.nbody.linear_field(noise, box=200.0, cosmo=sx.nbody.Cosmology())
        >>> delta.shape
        (16, 16, 16)
    """
    setup, noise = _setup_for(noise, box, mesh, "linear_field")
    source = power_source(power, "linear_field")
    if source is None:
        check_cosmology(cosmo, "linear_field")
    return _linear_fn(setup, _source_key(source))(noise, _table(source, cosmo, setup))


def _rows_out(x: jax.Array) -> jax.Array:
    return x[None]


def _particles(setup: Setup, pos: jax.Array, mom: jax.Array, ids: jax.Array, a: jax.Array) -> Particles:
    """Global particles in the contract's units from the mapped program's `(ndev, n_local, ...)` outputs."""
    counts = np.full((pos.shape[0],), pos.shape[1], np.int32)
    rows = None if isinstance(pos, Tracer) else pos.sharding  # traced (under grad or jit): a constant
    if isinstance(rows, NamedSharding):  # num split over the devices like the rows (as from_numpy gives it)
        rows = NamedSharding(rows.mesh, PartitionSpec(rows.spec[0] if len(rows.spec) else None))
        num = jax.make_array_from_callback(counts.shape, rows, lambda index: counts[index])
    else:
        num = jnp.asarray(counts)
    pos, vel = _contract_units(pos, mom, a, setup.box)
    return Particles(pos=pos, num=num, vel=vel, ids=ids)


@functools.partial(jax.jit, static_argnums=3)
def _contract_units(pos: jax.Array, mom: jax.Array, a: jax.Array, box: float) -> tuple[jax.Array, jax.Array]:
    """Positions wrapped into the box and momenta as peculiar velocities in km/s (one program, not one per
    operation on the global arrays)."""
    return wrap(pos, box), mom * (_H0 / a).astype(mom.dtype)


@functools.lru_cache(maxsize=32)
def _lpt_fn(setup: Setup, source_key: Any) -> Callable[..., tuple[jax.Array, ...]]:
    source = _unkey(source_key)

    def body(noise: jax.Array, table: jax.Array | None, coeffs: jax.Array) -> tuple[jax.Array, ...]:
        s1, s2 = local_lpt_fields(setup, noise, _power_fn(source, setup, table))
        q, ids = lagrangian(setup, noise.dtype)
        disp = coeffs[0] * s1
        mom = coeffs[2] * s1
        if s2 is not None:
            disp = disp + coeffs[1] * s2
            mom = mom + coeffs[3] * s2
        return _rows_out(q + disp), _rows_out(mom), _rows_out(ids)
    return smap(body, in_specs=(setup.spec, _REPLICATED, _REPLICATED), out_specs=(_ROWS, _ROWS, _ROWS),
                mesh=setup.mesh, expand=False, jit=True)


def _lpt_coeffs(cosmo: Cosmology, a: jax.Array) -> jax.Array:
    """``(D1, D2, a^2 E f1 D1, a^2 E f2 D2)`` at ``a``: displacement and momentum of the 1LPT and 2LPT fields."""
    return _coeffs(cosmo, *growth_tables(cosmo), a)


@jax.jit
def _coeffs(cosmo: Cosmology, values: jax.Array, derivs: jax.Array, a: jax.Array) -> jax.Array:
    g = interpolate_growth(cosmo, values, derivs, a)
    a2e = a * a * g.e
    return jnp.stack([g.d1, g.d2, a2e * g.f1 * g.d1, a2e * g.f2 * g.d2])


def lpt(cosmo: Cosmology, noise: jax.Array, *, box: float, a: float, order: int = 2, power: Any = None,
        mesh: Mesh | None = None) -> Particles:
    """Lagrangian perturbation theory (Zel'dovich or 2LPT) particles at scale factor ``a`` from white ``noise``.

    One particle per grid point of ``noise``; ``x = q + D1 s1 + D2 s2`` and ``p = a^2 E (f1 D1 s1 + f2 D2 s2)``
    with ``s1 = -grad laplace^-1 delta_L`` and ``s2`` the second-order field (see docs/nbody.md).

    Args:
        cosmo: the cosmology (growth, and the power spectrum unless ``power`` is given).
        noise: `(n, n, n)` unit white noise (:func:`white_noise`).
        box: box side in Mpc/h.
        a: scale factor.
        order: 1 (Zel'dovich) or 2 (2LPT).
        power: a callable ``P(k)`` or a ``(k, P)`` table in place of the cosmology's linear power.
        mesh: the mesh (default: the context mesh, else ``sx.flat_mesh()``).

    Returns:
        Global :class:`shardax.particles.Particles` `(ndev, n^3 / ndev, ...)`: ``pos`` in Mpc/h wrapped into
        ``[0, box)``, ``vel`` peculiar velocities in km/s, ``ids`` the grid index ``i n^2 + j n + k``.
        Differentiable in ``cosmo`` and ``noise`` (call it under ``jax.jit`` with concrete ``box``, ``a``).

    Example:
        >>> import shardax as sx
        >>> noise = sx.nbody.white_noise(16)
        >>> part = sx.nbody.lpt(sx.nbody.Cosmology(), noise, box=200.0, a=0.1)
        >>> part.pos.shape[-1], int(part.num.sum())
        (3, 4096)
    """
    check_cosmology(cosmo, "lpt")
    setup, noise = _setup_for(noise, box, mesh, "lpt", order=order)
    source = power_source(power, "lpt")
    a_arr = jnp.asarray(a, noise.dtype)
    pos, mom, ids = _lpt_fn(setup, _source_key(source))(noise, _table(source, cosmo, setup),
                                                         _lpt_coeffs(cosmo, a_arr))
    return _particles(setup, pos, mom, ids, a_arr)


def _forces_setup(part: Any, box: Any, mesh_per_side: Any, mesh: Mesh | None, gradient: Any, deconvolve: Any,
                  capacity: Any, where: str, all_rows: bool = False) -> Setup:
    """The :class:`Setup` of a force or density mesh for global particles (their mesh unless one is passed)."""
    if getattr(part, "pos", None) is None or np.ndim(part.pos) != 3 or np.shape(part.pos)[2] != 3:
        raise ValueError(f"{where}: part must be global particles with pos (ndev, cap, 3) (e.g. from "
                         "sx.particles.from_numpy)")
    sharding = getattr(part.pos, "sharding", None)
    if mesh is None and isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        the_mesh = sharding.mesh
    else:
        the_mesh = default_mesh(mesh)
    setup = make_setup(n=mesh_per_side, nm=mesh_per_side, box=box, mesh=the_mesh, gradient=gradient,
                       deconvolve=deconvolve, where=where)
    ndev, rows = (int(v) for v in np.shape(part.pos)[:2])
    if ndev != setup.ndev:
        raise ValueError(f"{where}: part has {ndev} device rows but the mesh has {setup.ndev} devices; pass the mesh "
                         "the particles were made on")
    default = ndev * rows if all_rows else rows + max(rows // 2, 64)
    cap = default if capacity is None else capacity
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"{where}: capacity must be a positive int, got {capacity!r}")
    return dataclasses.replace(setup, capacity=cap)


@functools.lru_cache(maxsize=32)
def _forces_fn(setup: Setup) -> Callable[..., tuple[jax.Array, jax.Array]]:
    def body(pos: jax.Array, num: jax.Array) -> tuple[jax.Array, jax.Array]:
        forces, needed = local_pm_forces(setup, pos[0], num[0])
        return forces[None], jnp.max(needed)
    return smap(body, in_specs=(_ROWS, _ROWS), out_specs=(_ROWS, _REPLICATED), mesh=setup.mesh, expand=False,
                jit=True)


def pm_forces(part: Any, *, box: float, mesh_per_side: int, mesh: Mesh | None = None, gradient: str = "fd4",
              deconvolve: bool = False, capacity: int | None = None) -> jax.Array:
    """Particle-mesh force ``F = -grad phi`` with ``laplace phi = delta`` at every particle.

    ``delta`` is the cloud-in-cell overdensity of the particles on an ``nm^3`` mesh (``sx.fields.local_paint``),
    solved with ``sx.fft`` (``rfftn``, the Green's function ``-1/k^2``, one ``irfftn`` per component) and read
    back at the particles (``sx.fields.local_readout``). ``F`` is in Mpc/h: the comoving acceleration is
    ``3/2 Omega_m F / a^2`` in units of ``H0^2``.

    Args:
        part: global particles (``pos (ndev, cap, 3)`` in Mpc/h, ``num (ndev,)``), e.g. from :func:`lpt` or
            ``sx.particles.from_numpy``, on the mesh's devices.
        box: box side in Mpc/h.
        mesh_per_side: force mesh side ``nm`` (a power of two dividing over the mesh axes).
        mesh: the mesh (default: that of ``part.pos``, else the context mesh, else ``sx.flat_mesh()``).
        gradient: ``"fd4"`` (4th-order finite difference, as FastPM and JaxPM) or ``"spectral"`` (``i k``).
        deconvolve: divide the density by the cloud-in-cell window.
        capacity: particles a device may receive while painting (default: 1.5 times the capacity).

    Returns:
        `(ndev, cap, 3)` forces aligned with ``part``'s rows (0 on padding rows).

    Raises:
        CapacityError: a device had to receive more than ``capacity`` particles.

    Example:
        >>> import numpy as np, shardax as sx
        >>> part = sx.particles.from_numpy(np.random.default_rng(0).random((512, 3)) * 100.0)
        >>> sx.nbody.pm_forces(part, box=100.0, mesh_per_side=16).shape[-1]
        3
    """
    setup = _forces_setup(part, box, mesh_per_side, mesh, gradient, deconvolve, capacity, "pm_forces")
    cap = setup.capacity
    forces, needed = _forces_fn(setup)(part.pos, jnp.asarray(part.num, jnp.int32))
    if not isinstance(needed, Tracer) and int(needed) > cap:
        raise CapacityError(f"pm_forces: a device had to receive {int(needed)} particles but capacity is {cap}; "
                            f"pass capacity={int(needed)} or more", needed=int(needed), available=cap,
                            argument="capacity")
    return forces


@functools.lru_cache(maxsize=32)
def _density_fn(setup: Setup) -> Callable[..., jax.Array]:
    def body(pos: jax.Array, num: jax.Array) -> jax.Array:
        part = Particles(pos=wrap(pos[0], setup.box), num=num[0])
        rho, _ = fields.local_paint(part, (setup.nm,) * 3, box=setup.box, spec=setup.spec, capacity=setup.capacity)
        total = comm.allreduce(num[0]).astype(rho.dtype)
        return rho * (setup.nm**3 / total) - 1
    return smap(body, in_specs=(_ROWS, _ROWS), out_specs=setup.spec, mesh=setup.mesh, expand=False, jit=True)


def density(part: Any, *, box: float, mesh_per_side: int, mesh: Mesh | None = None,
            capacity: int | None = None) -> jax.Array:
    """Cloud-in-cell overdensity ``rho / mean(rho) - 1`` of global particles on an ``nm^3`` mesh, differentiable in
    the positions (``sx.fields.paint`` checks its input on the host; this runs under ``jax.grad`` and ``jit``).

    Args:
        part: global particles (``pos (ndev, cap, 3)`` in Mpc/h, ``num (ndev,)``), e.g. from :func:`evolve`.
        box: box side in Mpc/h.
        mesh_per_side: mesh side ``nm`` (a power of two dividing over the mesh axes).
        mesh: the mesh (default: that of ``part.pos``, else the context mesh, else ``sx.flat_mesh()``).
        capacity: particles a device may receive (default: all of them, ``ndev * cap``: nothing can be dropped).

    Returns:
        `(nm, nm, nm)` overdensity sharded as slabs (1D mesh) or pencils (2D mesh).

    Example:
        >>> import shardax as sx
        >>> part = sx.nbody.lpt(sx.nbody.Cosmology(), sx.nbody.white_noise(16), box=200.0, a=0.1)
        >>> abs(float(sx.nbody.density(part, box=200.0, mesh_per_side=16).mean())) < 1e-5
        True
    """
    setup = _forces_setup(part, box, mesh_per_side, mesh, "fd4", False, capacity, "density", all_rows=True)
    return _density_fn(setup)(part.pos, jnp.asarray(part.num, jnp.int32))

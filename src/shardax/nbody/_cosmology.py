"""Cosmological parameters, the linear matter power spectrum and the growth of structure (through jax-cosmo)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Growth tables: ln(a) from 1e-3 to 1 (the growth ODE starts deep in matter domination).
_LN_A = np.linspace(np.log(1e-3), 0.0, 257)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cosmology:
    """Flat (or curved) w0-wa CDM parameters, Planck 2015 by default; a pytree, so every field can be differentiated.

    Attributes:
        omega_c: cold dark matter density today (in units of the critical density).
        omega_b: baryon density today.
        h: Hubble constant in units of 100 km/s/Mpc.
        n_s: primordial spectral index.
        sigma8: rms linear density fluctuation in spheres of 8 Mpc/h today.
        w0, wa: dark energy equation of state ``w(a) = w0 + wa (1 - a)``.
        omega_k: curvature density today.

    Change a parameter with ``dataclasses.replace(cosmo, sigma8=0.9)``.

    Example:
        >>> import shardax as sx
        >>> cosmo = sx.nbody.Cosmology()
        >>> round(cosmo.omega_m, 4)
        0.3075
    """

    omega_c: float = 0.2589
    omega_b: float = 0.0486
    h: float = 0.6774
    n_s: float = 0.9667
    sigma8: float = 0.8159
    w0: float = -1.0
    wa: float = 0.0
    omega_k: float = 0.0

    @property
    def omega_m(self) -> Any:
        """Total matter density today, ``omega_c + omega_b``."""
        return self.omega_c + self.omega_b


def check_cosmology(cosmo: Any, where: str) -> Cosmology:
    if not isinstance(cosmo, Cosmology):
        raise TypeError(f"{where}: cosmo must be a shardax.nbody.Cosmology (e.g. sx.nbody.Cosmology()), got "
                        f"{type(cosmo).__name__}")
    return cosmo


@contextlib.contextmanager
def _jax_cosmo_context() -> Iterator[None]:
    """jax-cosmo 0.1.0 relies on NumPy-style promotion (float32 * int32, rank broadcasting) and asks for int64
    arrays: run it with standard promotion and without that warning, whatever the caller's configuration."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Explicitly requested dtype", UserWarning)
        yield


def _jc(cosmo: Cosmology) -> Any:
    """A fresh jax-cosmo cosmology (fresh: jax-cosmo caches growth tables on the object)."""
    import jax_cosmo

    return jax_cosmo.Cosmology(Omega_c=cosmo.omega_c, Omega_b=cosmo.omega_b, h=cosmo.h, n_s=cosmo.n_s,
                               sigma8=cosmo.sigma8, Omega_k=cosmo.omega_k, w0=cosmo.w0, wa=cosmo.wa)


def hubble_rate(cosmo: Cosmology, a: Any) -> jax.Array:
    """``E(a) = H(a) / H0`` (jax-cosmo's background).

    Example:
        >>> import shardax as sx
        >>> round(float(sx.nbody.hubble_rate(sx.nbody.Cosmology(), 1.0)), 4)
        1.0
    """
    import jax_cosmo

    check_cosmology(cosmo, "hubble_rate")
    with _jax_cosmo_context():
        return jnp.sqrt(jax_cosmo.background.Esqr(_jc(cosmo), jnp.asarray(a, jnp.result_type(float))))


def _ode_rhs(jcosmo: Any, ln_a: jax.Array, y: jax.Array) -> jax.Array:
    """First- and second-order growth in ``ln a``: ``y = (D1, dD1/dlna, D2, dD2/dlna)``, with the second-order
    source ``-3/2 Omega_m(a) D1^2`` (``D2 = -3/7 D1^2`` in Einstein-de Sitter)."""
    import jax_cosmo

    a = jnp.exp(ln_a)
    om = jax_cosmo.background.Omega_m_a(jcosmo, a)
    damping = 1.0 - 0.5 * (om + (1.0 + 3.0 * jax_cosmo.background.w(jcosmo, a))
                           * jax_cosmo.background.Omega_de_a(jcosmo, a))
    d1, v1, d2, v2 = y[0], y[1], y[2], y[3]
    return jnp.stack([v1, -damping * v1 + 1.5 * om * d1, v2, -damping * v2 + 1.5 * om * (d2 - d1 * d1)])


@jax.custom_jvp
def _growth_rule(cosmo: Cosmology) -> tuple[jax.Array, jax.Array]:
    """:func:`_growth_table`, differentiated by :func:`_growth_jvp`."""
    return _integrate_growth(cosmo)


@_growth_rule.defjvp
def _growth_jvp(primals: tuple[Cosmology], tangents: tuple[Any]) -> tuple[Any, Any]:
    """The tables' derivative along ``tangents`` as their Jacobian in the parameters (forward mode, all parameters at
    once) times the tangent.

    Differentiated as it is written, a gradient would run the RK4 scan backwards, and that transposed scan is about
    five times the forward integration in the compiled program: most of a gradient's compile time. Here the scan
    is only differentiated forwards (one scan carrying a tangent per parameter); what reverse mode transposes is
    the final product with the tangent."""
    (cosmo,), (tangent,) = primals, tangents
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.result_type(float)), cosmo)

    def tables_twice(p: Cosmology) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        tables = _integrate_growth(p)
        return tables, tables

    # per table: a Cosmology of (*table.shape, *parameter.shape); the tables themselves from the same integration
    jacobian, out = jax.jacfwd(tables_twice, has_aux=True)(params)

    def along(table_jacobian: Cosmology, like: jax.Array) -> jax.Array:
        total = jnp.zeros_like(like)
        for jac, dx in zip(jax.tree.leaves(table_jacobian), jax.tree.leaves(tangent), strict=True):
            if np.dtype(dx.dtype) != jax.dtypes.float0:  # (integer parameters have no tangent)
                total = total + jnp.tensordot(jac, jnp.asarray(dx, like.dtype), axes=jnp.ndim(dx))
        return total

    return out, tuple(along(j, o) for j, o in zip(jacobian, out, strict=True))


@jax.jit
def _growth_table(cosmo: Cosmology) -> tuple[jax.Array, jax.Array]:
    """Growth values ``(D1, dD1/dlna, D2, dD2/dlna)`` and their ``ln a`` derivatives on :data:`_LN_A`, normalised
    to ``D1(1) = 1`` (RK4 with two substeps per table interval; derivatives in ``cosmo`` by :func:`_growth_jvp`)."""
    return _growth_rule(cosmo)


def _integrate_growth(cosmo: Cosmology) -> tuple[jax.Array, jax.Array]:
    """:func:`_growth_table` without its derivative rule."""
    dtype = jnp.result_type(float)
    with _jax_cosmo_context():
        jcosmo = _jc(cosmo)
        a0 = float(np.exp(_LN_A[0]))
        y0 = jnp.asarray([a0, a0, -3.0 / 7.0 * a0**2, -6.0 / 7.0 * a0**2], dtype)
        h = float(_LN_A[1] - _LN_A[0]) / 2

        def step(y: jax.Array, ln_a: jax.Array) -> tuple[jax.Array, jax.Array]:
            for sub in range(2):
                t = ln_a + sub * h
                k1 = _ode_rhs(jcosmo, t, y)
                k2 = _ode_rhs(jcosmo, t + h / 2, y + h / 2 * k1)
                k3 = _ode_rhs(jcosmo, t + h / 2, y + h / 2 * k2)
                k4 = _ode_rhs(jcosmo, t + h, y + h * k3)
                y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            return y, y

        _, ys = jax.lax.scan(step, y0, jnp.asarray(_LN_A[:-1], dtype))
        ys = jnp.concatenate([y0[None], ys])
        derivs = jax.vmap(lambda t, y: _ode_rhs(jcosmo, t, y))(jnp.asarray(_LN_A, dtype), ys)
    norm = ys[-1, 0]
    scale = jnp.stack([norm, norm, norm * norm, norm * norm])
    return ys / scale[None], derivs / scale[None]


def _hermite(ln_a: jax.Array, values: jax.Array, derivs: jax.Array) -> jax.Array:
    """Cubic Hermite interpolation of tabulated ``values (m, c)`` with ``ln a`` derivatives at ``ln_a (...)``."""
    grid = jnp.asarray(_LN_A, values.dtype)
    i = jnp.clip(jnp.searchsorted(grid, ln_a) - 1, 0, len(_LN_A) - 2)
    h = grid[1] - grid[0]
    t = ((ln_a - grid[i]) / h)[..., None]
    h00 = (1 + 2 * t) * (1 - t) ** 2
    h10 = t * (1 - t) ** 2
    h01 = t * t * (3 - 2 * t)
    h11 = t * t * (t - 1)
    return h00 * values[i] + h10 * h * derivs[i] + h01 * values[i + 1] + h11 * h * derivs[i + 1]


class Growth(NamedTuple):
    """Growth factors at scale factors ``a`` (each array shaped like ``a``).

    Attributes:
        d1: linear growth factor ``D1(a)``, ``D1(1) = 1``.
        d2: second-order growth factor ``D2(a)`` (``-3/7 D1^2`` in Einstein-de Sitter; negative).
        f1: ``dln D1 / dln a``.
        f2: ``dln D2 / dln a``.
        e: ``E(a) = H(a) / H0``.
        gf: ``a^3 E dD1/da``, the momentum growth the kick and drift factors use.
    """

    d1: jax.Array
    d2: jax.Array
    f1: jax.Array
    f2: jax.Array
    e: jax.Array
    gf: jax.Array


def growth(cosmo: Cosmology, a: Any) -> Growth:
    """First- and second-order growth factors and rates at scale factors ``a`` (``1e-3 <= a <= 1``).

    The growth ODEs are integrated in ``ln a`` with jax-cosmo's background (``Omega_m(a)``, ``w(a)``,
    ``Omega_de(a)``, ``E(a)``); jax-cosmo 0.1.0 has no second-order growth. Differentiable in ``cosmo``.

    Example:
        >>> import shardax as sx
        >>> g = sx.nbody.growth(sx.nbody.Cosmology(), 1.0)
        >>> round(float(g.d1), 4), bool(g.d2 < 0)
        (1.0, True)
    """
    check_cosmology(cosmo, "growth")
    return _growth(cosmo, jnp.asarray(a, jnp.result_type(float)))


@jax.jit  # one program (called eagerly, each operation of the interpolation would compile on its own)
def _growth(cosmo: Cosmology, a: jax.Array) -> Growth:
    values, derivs = _growth_table(cosmo)
    return interpolate_growth(cosmo, values, derivs, a)


def growth_tables(cosmo: Cosmology) -> tuple[jax.Array, jax.Array]:
    """The tabulated growth ODE solution (compiled once per process), for :func:`interpolate_growth`."""
    return _growth_table(cosmo)


def interpolate_growth(cosmo: Cosmology, values: jax.Array, derivs: jax.Array, a: jax.Array) -> Growth:
    y = _hermite(jnp.log(a), values, derivs)
    d1, v1, d2, v2 = y[..., 0], y[..., 1], y[..., 2], y[..., 3]
    e = hubble_rate(cosmo, a)
    return Growth(d1=d1, d2=d2, f1=v1 / d1, f2=v2 / d2, e=e, gf=a * a * e * v1)


def growth_factor(cosmo: Cosmology, a: Any) -> jax.Array:
    """Linear growth factor ``D1(a)``, normalised to ``D1(1) = 1``.

    Example:
        >>> import shardax as sx
        >>> d = sx.nbody.growth_factor(sx.nbody.Cosmology(), 0.5)
        >>> 0.6 < float(d) < 0.62
        True
    """
    return growth(cosmo, a).d1


def linear_power(cosmo: Cosmology, k: Any, a: Any = 1.0) -> jax.Array:
    """Linear matter power spectrum ``P(k, a)`` in ``(Mpc/h)^3`` at wavenumbers ``k`` in ``h/Mpc``.

    jax-cosmo's Eisenstein-Hu transfer function normalised to ``sigma8`` at ``a = 1``, times ``D1(a)^2``.
    Differentiable in ``cosmo``.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> pk = sx.nbody.linear_power(sx.nbody.Cosmology(), jnp.array([0.01, 0.1]))
        >>> bool(pk[0] > pk[1] > 0)
        True
    """
    check_cosmology(cosmo, "linear_power")
    k = jnp.asarray(k, jnp.result_type(float))
    pk = _linear_power(cosmo, k.reshape(-1)).reshape(k.shape)
    if isinstance(a, int | float) and a == 1.0:
        return pk
    return pk * growth_factor(cosmo, a) ** 2


@jax.jit
def _linear_power(cosmo: Cosmology, k: jax.Array) -> jax.Array:
    """jax-cosmo's linear power at ``a = 1``: its primordial power and Eisenstein-Hu transfer function, normalised
    by its ``sigma8`` integral (the same integrand and range; Simpson's rule on a fixed grid in place of its
    Romberg scheme, which takes seconds to compile)."""
    import jax_cosmo

    with _jax_cosmo_context():
        jcosmo = _jc(cosmo)

        def shape(q: jax.Array) -> jax.Array:
            return jax_cosmo.power.primordial_matter_power(jcosmo, q) * jax_cosmo.transfer.Eisenstein_Hu(jcosmo, q) ** 2

        # jax-cosmo 0.1.0 integrates over ln k in [log10(1e-4), log10(1e3)] = [-4, 3]; kept for the same sigma8.
        ln_q = jnp.linspace(-4.0, 3.0, 1025, dtype=k.dtype)
        q = jnp.exp(ln_q)
        x = q * 8.0
        window = 3.0 * (jnp.sin(x) - x * jnp.cos(x)) / (x * x * x)
        integrand = q * (q * window) ** 2 * shape(q)
        weights = np.ones(1025)
        weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
        sigma2 = jnp.sum(integrand * jnp.asarray(weights * (7.0 / 1024 / 3), k.dtype)) / (2 * np.pi**2)
        return shape(k) * (cosmo.sigma8**2 / sigma2)

"""FastPM kick-drift-kick stepping in the scale factor with growth-consistent factors (local view)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._cosmology import Cosmology, check_cosmology, growth_tables, interpolate_growth
from ._forces import local_pm_forces
from ._setup import Setup


class StepFactors(NamedTuple):
    """Per step ``a_i -> a_{i+1}`` (arrays `(steps,)`): the first half kick, the drift and the second half kick.

    With the momentum ``p = a^3 E dx/da`` (Mpc/h), ``G(a) = a^3 E dD1/da`` and ``a_h = (a_i + a_{i+1}) / 2``:
    ``kick1 = (G(a_h) - G(a_i)) / D1(a_i)``, ``drift = (D1(a_{i+1}) - D1(a_i)) / G(a_h)``,
    ``kick2 = (G(a_{i+1}) - G(a_h)) / D1(a_{i+1})``, with ``F`` the PM force of :func:`pm_forces`; a step is ``p += kick1 F(x)``,
    ``x += drift p``, ``p += kick2 F(x)``. Linear modes grow exactly as ``D1``.
    """

    kick1: jax.Array
    drift: jax.Array
    kick2: jax.Array


def step_factors(cosmo: Cosmology, times: Any) -> StepFactors:
    """:class:`StepFactors` of the steps between consecutive ``times (steps + 1,)``.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> f = sx.nbody.step_factors(sx.nbody.Cosmology(), jnp.linspace(0.1, 1.0, 11))
        >>> f.drift.shape
        (10,)
    """
    check_cosmology(cosmo, "step_factors")
    return _step_factors(cosmo, *growth_tables(cosmo), jnp.asarray(times, jnp.result_type(float)))


@jax.jit
def _step_factors(cosmo: Cosmology, values: jax.Array, derivs: jax.Array, times: jax.Array) -> StepFactors:
    steps = times.shape[0] - 1
    g = interpolate_growth(cosmo, values, derivs, jnp.concatenate([times, (times[:-1] + times[1:]) / 2]))
    d1, gf, half_gf = g.d1[: steps + 1], g.gf[: steps + 1], g.gf[steps + 1:]
    # dp/da = 3/2 Omega_m F / (a^2 E) and d(a^3 E dD1/da)/da = 3/2 Omega_m D1 / (a^2 E): over a kick the force
    # is taken to grow as D1, so that dp = F(a_i) dG / D1(a_i).
    return StepFactors(kick1=(half_gf - gf[:-1]) / d1[:-1],
                       drift=(d1[1:] - d1[:-1]) / half_gf,
                       kick2=(gf[1:] - half_gf) / d1[1:])


class State(NamedTuple):
    """Positions (unwrapped, Mpc/h), momenta ``a^3 E dx/da`` (Mpc/h) and the force at the positions."""

    pos: jax.Array
    mom: jax.Array
    force: jax.Array


def local_kdk(setup: Setup, state: State, factors: StepFactors, slots: jax.Array, snapshots: int
              ) -> tuple[State, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """All steps in one ``lax.scan`` (each step rematerialised in the backward pass: ``jax.checkpoint``).

    ``state.force`` is not read: a leading step with zero factors computes the force at the initial positions,
    so that the program holds one copy of the force computation.

    Returns the final state, the most particles a device had to receive, and ``(pos, mom)`` stacked
    `(snapshots, n_local, 3)` at the ends of the steps whose ``slots`` entry is a snapshot index.
    """

    @jax.checkpoint
    def step(state: State, factor: tuple[jax.Array, ...]) -> tuple[State, jax.Array]:
        kick1, drift, kick2 = factor
        mom = state.mom + kick1 * state.force
        pos = state.pos + drift * mom
        force, needed = local_pm_forces(setup, pos)
        return State(pos, mom + kick2 * force, force), needed

    def body(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        state, needed, buffers = carry
        *factor, slot = xs
        state, got = step(state, tuple(factor))
        if buffers is not None:
            buffers = tuple(lax.dynamic_update_index_in_dim(b, v, slot, 0)
                            for b, v in zip(buffers, (state.pos, state.mom), strict=True))
        return (state, jnp.maximum(needed, got), buffers), None

    buffers = None
    if snapshots:
        # (from the positions, so that the buffers vary over the mesh axes as they do)
        empty = jnp.broadcast_to(jnp.zeros_like(state.pos)[None], (snapshots + 1, *state.pos.shape))
        buffers = (empty, empty)
    zero = jnp.zeros((1,), factors.kick1.dtype)
    xs = tuple(jnp.concatenate([zero, f]) for f in factors)
    init = (state, jnp.zeros((), jnp.int32), buffers)
    (state, needed, buffers), _ = lax.scan(body, init, (*xs, jnp.concatenate([jnp.full((1,), snapshots), slots])))
    if buffers is not None:
        buffers = (buffers[0][:snapshots], buffers[1][:snapshots])
    return state, needed, buffers

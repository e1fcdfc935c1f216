"""FastPM kick-drift-kick stepping in the scale factor with growth-consistent factors (local view), and the
gradient of the whole stepping loop: a reverse-time adjoint (as in pmwd) or a checkpointed scan."""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import comm
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


Adjoint = Literal["reverse", "checkpoint"]
ADJOINTS = ("reverse", "checkpoint")


class State(NamedTuple):
    """Positions (unwrapped, Mpc/h), momenta ``a^3 E dx/da`` (Mpc/h) and the force at the positions."""

    pos: jax.Array
    mom: jax.Array
    force: jax.Array


Snapshots = tuple[jax.Array, jax.Array] | None


def local_kdk(setup: Setup, pos: jax.Array, mom: jax.Array, factors: StepFactors, slots: jax.Array,
              snapshots: int, adjoint: Adjoint = "reverse") -> tuple[jax.Array, jax.Array, jax.Array, Snapshots]:
    """All steps from `pos, mom (n_local, 3)` in one ``lax.scan``, differentiable in them and in the factors.

    ``adjoint="reverse"``: a ``jax.custom_vjp`` over the loop whose backward pass runs the steps backwards from the
    final state (kick-drift-kick is time-reversible), reconstructing each state and pulling the cotangents through
    that step (:func:`_reverse_adjoint`): nothing is kept per step, but the reconstructed trajectory differs from the
    forward one by round-off (in float32, a few ulp of the positions per step, amplified where orbits diverge).
    ``adjoint="checkpoint"``: each step rematerialised in the backward pass (``jax.checkpoint``): no round-off, but the
    gradient keeps positions, momenta and forces per step. The forward values are the same either way.

    Returns the final positions and momenta, the most particles a device had to receive, and ``(pos, mom)``
    stacked `(snapshots, n_local, 3)` at the ends of the steps whose ``slots`` entry is a snapshot index.
    """
    if adjoint == "checkpoint":
        pos, mom, _, needed, buffers = _forward(setup, snapshots, pos, mom, factors, slots, remat=True)
        return pos, mom, needed, buffers
    return _reversible(setup, snapshots, pos, mom, factors, slots)


def _forward(setup: Setup, snapshots: int, pos: jax.Array, mom: jax.Array, factors: StepFactors, slots: jax.Array,
             *, remat: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, Snapshots]:
    """The steps: a leading step with zero factors computes the force at the initial positions, so that the
    program holds one copy of the force computation."""

    def step(state: State, factor: tuple[jax.Array, ...]) -> tuple[State, jax.Array]:
        kick1, drift, kick2 = factor
        mom = state.mom + kick1 * state.force
        pos = state.pos + drift * mom
        force, needed = local_pm_forces(setup, pos)
        return State(pos, mom + kick2 * force, force), needed

    if remat:
        step = jax.checkpoint(step)

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
        empty = jnp.broadcast_to(jnp.zeros_like(pos)[None], (snapshots + 1, *pos.shape))
        buffers = (empty, empty)
    zero = jnp.zeros((1,), factors.kick1.dtype)
    xs = tuple(jnp.concatenate([zero, f]) for f in factors)
    init = (State(pos, mom, jnp.zeros_like(pos)), jnp.zeros((), jnp.int32), buffers)
    (state, needed, buffers), _ = lax.scan(body, init, (*xs, jnp.concatenate([jnp.full((1,), snapshots), slots])))
    if buffers is not None:
        buffers = (buffers[0][:snapshots], buffers[1][:snapshots])
    return state.pos, state.mom, state.force, needed, buffers


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _reversible(setup: Setup, snapshots: int, pos: jax.Array, mom: jax.Array, factors: StepFactors,
                slots: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, Snapshots]:
    pos, mom, _, needed, buffers = _forward(setup, snapshots, pos, mom, factors, slots, remat=False)
    return pos, mom, needed, buffers


def _reversible_fwd(setup: Setup, snapshots: int, pos: jax.Array, mom: jax.Array, factors: StepFactors,
                    slots: jax.Array) -> tuple[tuple, tuple]:
    pos, mom, force, needed, buffers = _forward(setup, snapshots, pos, mom, factors, slots, remat=False)
    return (pos, mom, needed, buffers), (State(pos, mom, force), factors, slots)


def _reverse_adjoint(setup: Setup, snapshots: int, residuals: tuple, cotangents: tuple) -> tuple:
    """The backward pass: the steps run backwards from the final state, one force linearisation per state.

    Step ``i`` is ``p' = p_i + k1_i F(x_i)``, ``x_{i+1} = x_i + d_i p'``, ``p_{i+1} = p' + k2_i F(x_{i+1})``.
    Reversed: ``p' = p_{i+1} - k2_i F_{i+1}``, ``x_i = x_{i+1} - d_i p'``, ``F_i = F(x_i)``, ``p_i = p' - k1_i F_i``.
    ``F_i`` enters step ``i``'s first kick and step ``i - 1``'s second kick, so its cotangent
    ``k1_i pbar' + k2_{i-1} pbar_i`` is complete once step ``i`` is reversed: ``jax.vjp`` of the force at the
    reconstructed ``x_i`` gives ``F_i`` and pulls that cotangent back to ``x_i`` in one evaluation. A trailing
    step with zero factors linearises the force at the final positions, so the loop holds one copy of it.
    Snapshot cotangents join the state's at the end of their step; the factors' cotangents are summed over the
    devices (they are replicated).
    """
    final, factors, slots = residuals
    pos_bar, mom_bar, _, buffers_bar = cotangents
    zero = jnp.zeros((1,), factors.kick1.dtype)
    kick1, drift, kick2 = (jnp.concatenate([f, zero]) for f in factors)
    kick2_before = jnp.concatenate([zero, factors.kick2])  # of the step that ends where this one starts
    slot_before = jnp.concatenate([jnp.full((1,), snapshots, slots.dtype), slots])  # the state this step starts from
    bars = None
    if buffers_bar is not None:  # a zero row for the steps that fill no snapshot
        bars = tuple(jnp.concatenate([b, jnp.zeros_like(b[:1])]) for b in buffers_bar)

    def at_state(slot: jax.Array) -> tuple[Any, Any]:
        if bars is None:
            return 0, 0
        return tuple(lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in bars)

    def force(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return local_pm_forces(setup, x)

    def body(carry: tuple, xs: tuple) -> tuple[tuple, tuple]:
        (pos, mom, f), pos_bar, mom_bar = carry
        k1, d, k2, k2_before, slot = xs
        half = mom - k2 * f
        k2_bar = jnp.sum(mom_bar * f)
        pos = pos - d * half
        d_bar = jnp.sum(pos_bar * half)
        half_bar = mom_bar + d * pos_bar
        f, pullback, _ = jax.vjp(force, pos, has_aux=True)
        mom = half - k1 * f
        k1_bar = jnp.sum(half_bar * f)
        snap_pos_bar, snap_mom_bar = at_state(slot)
        mom_bar = half_bar + snap_mom_bar
        (f_pos_bar,) = pullback(k1 * half_bar + k2_before * mom_bar)
        pos_bar = pos_bar + f_pos_bar + snap_pos_bar
        return (State(pos, mom, f), pos_bar, mom_bar), (k1_bar, d_bar, k2_bar)

    init = (final, pos_bar, mom_bar)
    (_, pos_bar, mom_bar), factor_bars = lax.scan(body, init, (kick1, drift, kick2, kick2_before, slot_before),
                                                  reverse=True)
    factors_bar = StepFactors(*(comm.allreduce(b[:-1]) for b in factor_bars))
    return pos_bar, mom_bar, factors_bar, None


_reversible.defvjp(_reversible_fwd, _reverse_adjoint)

"""sx.nbody: growth and power against jax-cosmo, layout-independent initial conditions, LPT and PM forces against
NumPy, the same run at 1, 8 and 2 x 4 devices, linear growth, gradients against finite differences, bad input."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx
from conftest import collectives_ordered, compilations, make_mesh
from shardax.nbody._cosmology import _LN_A, _growth_table, _integrate_growth, _jax_cosmo_context, _jc

jax_cosmo = pytest.importorskip("jax_cosmo")

COSMO = sx.nbody.Cosmology()
_BODY = os.path.join(os.path.dirname(__file__), "scripts", "nbody_body.py")


def _body_module():
    spec = importlib.util.spec_from_file_location("nbody_body", _BODY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nbody_body"] = module  # (run_distributed finds the body by module name)
    spec.loader.exec_module(module)
    return module


def test_growth_and_power_match_jax_cosmo() -> None:
    a = jnp.asarray([0.05, 0.1, 0.3, 0.5, 0.8, 1.0])
    g = sx.nbody.growth(COSMO, a)
    k = jnp.logspace(-3, 1, 9)
    with _jax_cosmo_context():
        # One compiled program (eager, each of jax_cosmo's operations compiles on its own).
        d1, f1, e, pk = jax.jit(lambda jc, a, k: (
            jax_cosmo.background.growth_factor(jc, a), jax_cosmo.background.growth_rate(jc, a),
            jnp.sqrt(jax_cosmo.background.Esqr(jc, a)), jax_cosmo.power.linear_matter_power(jc, k)))(_jc(COSMO), a, k)
    np.testing.assert_allclose(g.d1, d1, rtol=1e-3)
    np.testing.assert_allclose(g.f1, f1, rtol=1e-3)
    np.testing.assert_allclose(g.e, e, rtol=1e-5)
    np.testing.assert_allclose(sx.nbody.linear_power(COSMO, k), pk, rtol=1e-3)
    # Second order: -3/7 D1^2 deep in matter domination, and f2 = 2 f1 there.
    np.testing.assert_allclose(g.d2[0] / g.d1[0] ** 2, -3 / 7, rtol=1e-3)
    np.testing.assert_allclose(g.f2[0], 2 * g.f1[0], rtol=1e-3)
    np.testing.assert_allclose(sx.nbody.growth_factor(COSMO, 0.5), g.d1[3], rtol=1e-6)
    np.testing.assert_allclose(sx.nbody.linear_power(COSMO, k, a=0.5), pk * g.d1[3] ** 2, rtol=2e-3)
    # A pytree: differentiable in its parameters (more matter, more growth at a < 1 relative to today: smaller D).
    grad = jax.jit(jax.grad(lambda c: sx.nbody.growth_factor(c, 0.5)))(COSMO)
    assert float(grad.omega_c) < 0 and float(grad.sigma8) == 0
    # The growth tables' derivative rule (their Jacobian by forward mode, times the tangent) is what plain autodiff
    # of the integration gives, forwards and backwards, in float64.
    with jax.enable_x64(True):
        cosmo = jax.tree.map(jnp.float64, dataclasses.replace(COSMO, w0=-0.9, wa=0.1))
        rng = np.random.default_rng(3)
        tangent = jax.tree.map(lambda _: jnp.float64(rng.standard_normal()), cosmo)
        cotangent = tuple(jnp.asarray(rng.standard_normal((len(_LN_A), 4))) for _ in range(2))
        for rule, plain in zip(jax.jit(lambda c, t: jax.jvp(_growth_table, (c,), (t,))[1])(cosmo, tangent),
                               jax.jit(lambda c, t: jax.jvp(_integrate_growth, (c,), (t,))[1])(cosmo, tangent),
                               strict=True):
            np.testing.assert_allclose(rule, plain, rtol=1e-9, atol=1e-12 * float(jnp.max(jnp.abs(plain))))
        (rule,) = jax.jit(lambda c, ct: jax.vjp(_growth_table, c)[1](ct))(cosmo, cotangent)
        (plain,) = jax.jit(lambda c, ct: jax.vjp(_integrate_growth, c)[1](ct))(cosmo, cotangent)
        for name in ("omega_c", "omega_b", "h", "n_s", "sigma8", "w0", "wa", "omega_k"):
            np.testing.assert_allclose(getattr(rule, name), getattr(plain, name), rtol=1e-9, atol=1e-12, err_msg=name)


def _numpy_lpt(noise: np.ndarray, box: float, a: float) -> tuple[np.ndarray, np.ndarray]:
    """1LPT positions and velocities (km/s) of the grid particles, in NumPy (4th-order gradient, as the default)."""
    n = noise.shape[0]
    kf = 2 * np.pi * np.fft.fftfreq(n, box / n)
    kz = 2 * np.pi * np.fft.rfftfreq(n, box / n)
    k = np.meshgrid(kf, kf, kz, indexing="ij")
    k2 = sum(ki**2 for ki in k)
    pk = np.asarray(sx.nbody.linear_power(COSMO, np.sqrt(np.where(k2 > 0, k2, 1.0))), np.float64)
    delta = np.fft.rfftn(noise.astype(np.float64)) * np.sqrt(np.where(k2 > 0, pk, 0) * n**3 / box**3)
    h = box / n
    grad = [(8 * np.sin(ki * h) - np.sin(2 * ki * h)) / (6 * h) for ki in k]
    phi = -delta / np.where(k2 > 0, k2, 1.0)
    s1 = np.stack([np.fft.irfftn(-1j * g * phi, s=noise.shape, axes=(0, 1, 2)).reshape(-1) for g in grad], axis=1)
    g1 = sx.nbody.growth(COSMO, a)
    q = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3) * h
    pos = (q + float(g1.d1) * s1) % box
    vel = 100 * a * float(g1.e) * float(g1.f1) * float(g1.d1) * s1
    return pos, vel


def _periodic_diff(x: np.ndarray, y: np.ndarray, box: float) -> np.ndarray:
    d = np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))
    return np.minimum(d, box - d)


def test_initial_conditions_are_layout_independent_and_match_numpy() -> None:
    n, box = 16, 300.0
    noises = {shape: np.asarray(sx.nbody.white_noise(n, seed=7, mesh=make_mesh(shape))) for shape in
              [(1,), (8,), (2, 4)]}
    for noise in noises.values():
        np.testing.assert_array_equal(noise, noises[(1,)])
    noise = noises[(1,)]
    assert abs(noise.mean()) < 0.05 and abs(noise.std() - 1) < 0.05
    assert not np.array_equal(noise, np.asarray(sx.nbody.white_noise(n, seed=8, mesh=make_mesh((1,)))))
    # The linear field's measured power is P(k) (up to the realisation's scatter: within 15% averaged per bin).
    mesh = make_mesh((2, 4))
    delta = sx.nbody.linear_field(sx.nbody.white_noise(32, seed=1, mesh=mesh), box=box, cosmo=COSMO)
    k, pk, _ = sx.fields.power_spectrum(delta, box=box, bins=8, compensate=False)
    ratio = np.asarray(pk) / np.asarray(sx.nbody.linear_power(COSMO, k))
    assert np.all(np.abs(ratio[2:] - 1) < 0.15), ratio
    # 1LPT against NumPy at 8 devices (slabs): positions, velocities and ids.
    part = sx.nbody.lpt(COSMO, sx.nbody.white_noise(n, seed=7, mesh=make_mesh((8,))), box=box, a=0.2, order=1)
    got = sx.particles.squeeze(part)
    order = np.argsort(got["ids"])
    np.testing.assert_array_equal(got["ids"][order], np.arange(n**3))
    want_pos, want_vel = _numpy_lpt(noise, box, 0.2)
    assert _periodic_diff(got["pos"][order], want_pos, box).max() < 1e-3
    np.testing.assert_allclose(got["vel"][order], want_vel, rtol=1e-3, atol=1e-3 * np.abs(want_vel).max())
    assert got["pos"].min() >= 0 and got["pos"].max() < box


def _numpy_pm_forces(pos: np.ndarray, nm: int, box: float) -> np.ndarray:
    """CIC paint, -1/k^2, 4th-order gradient, CIC readout, in float64 NumPy."""
    h = box / nm
    scaled = pos / h
    lower = np.floor(scaled).astype(int)
    frac = scaled - lower
    rho = np.zeros((nm,) * 3)
    corners = [(c0, c1, c2) for c0 in (0, 1) for c1 in (0, 1) for c2 in (0, 1)]
    weights = []
    for c in corners:
        w = np.prod([frac[:, d] if c[d] else 1 - frac[:, d] for d in range(3)], axis=0)
        idx = tuple((lower[:, d] + c[d]) % nm for d in range(3))
        np.add.at(rho, idx, w)
        weights.append((idx, w))
    delta = rho / rho.mean() - 1
    kf = 2 * np.pi * np.fft.fftfreq(nm, h)
    kz = 2 * np.pi * np.fft.rfftfreq(nm, h)
    k = np.meshgrid(kf, kf, kz, indexing="ij")
    k2 = sum(ki**2 for ki in k)
    phi = -np.fft.rfftn(delta) / np.where(k2 > 0, k2, 1.0)
    phi[0, 0, 0] = 0
    out = np.zeros_like(pos)
    for d, ki in enumerate(k):
        g = (8 * np.sin(ki * h) - np.sin(2 * ki * h)) / (6 * h)
        field = np.fft.irfftn(-1j * g * phi, s=(nm,) * 3, axes=(0, 1, 2))
        out[:, d] = sum(field[idx] * w for idx, w in weights)
    return out


@pytest.mark.parametrize("shape", [(1,), (8,), (2, 4)], ids=["1", "8", "2x4"])
def test_pm_forces_match_numpy(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(2)
    box, nm = 100.0, 16
    pos = np.concatenate([rng.random((600, 3)) * box, 50 + 4 * rng.standard_normal((400, 3))]) % box
    part = sx.particles.from_numpy(pos.astype(np.float32), mesh=make_mesh(shape))
    with collectives_ordered():  # (a program read back from a compilation cache may then run as compiled)
        forces = np.asarray(sx.nbody.pm_forces(part, box=box, mesh_per_side=nm, capacity=len(pos)))
    if shape == (8,):  # the blob's slabs receive more than the default capacity: refused, not dropped
        with pytest.raises(sx.CapacityError, match="capacity="):
            sx.nbody.pm_forces(part, box=box, mesh_per_side=nm)
    got = sx.particles.squeeze(dataclasses.replace(part, vel=jnp.asarray(forces)))
    order = np.argsort(got["ids"])
    want = _numpy_pm_forces(pos, nm, box)
    np.testing.assert_allclose(got["vel"][order], want, atol=2e-4 * np.abs(want).max())


def test_simulate_same_at_every_scale() -> None:
    """1 device, 8 devices (slabs) in one process and 2 processes x 4 devices (slabs over 8 devices, pencils over
    the (2, 4) grid): positions to float32 round-off, ids identical; snapshots and step boundaries as asked. The
    2 x 4 launch also differentiates a float64 run (reverse adjoint): the one-device loss and gradients."""
    body = _body_module()
    runs = {shape: body.run(make_mesh(shape)) for shape in [(1,), (8,)]}
    distributed = sx.testing.run_distributed(body.distributed_body, num_processes=2, cpu_devices=4)[0]
    # The float64 loss and gradients (reverse adjoint) at 2 processes x 4 devices: the one-device values.
    one_value, one_noise, one_cosmo, _ = _snapshot_gradients((1,), "reverse")
    value, noise, cosmo = distributed.pop("gradients")
    np.testing.assert_allclose(value, one_value, rtol=1e-12)
    np.testing.assert_allclose(noise, one_noise, rtol=0, atol=1e-10 * np.abs(one_noise).max())
    for name, want in one_cosmo.items():
        np.testing.assert_allclose(cosmo[name], want, rtol=1e-10, err_msg=name)
    runs.update({f"2x4 processes {name}": res for name, res in distributed.items()})
    ref = runs[(1,)]
    box = body.RUN["box"]
    for res in runs.values():
        np.testing.assert_array_equal(res["noise"], ref["noise"])
        np.testing.assert_allclose(res["a"], ref["a"])
        for name in ("final", "snapshot"):
            np.testing.assert_array_equal(res[name]["ids"], np.arange(body.RUN["particles_per_side"] ** 3))
            assert _periodic_diff(res[name]["pos"], ref[name]["pos"], box).max() < 2e-3
            np.testing.assert_allclose(res[name]["vel"], ref[name]["vel"], atol=1e-3 * np.abs(ref[name]["vel"]).max())
    np.testing.assert_allclose(ref["a"], [0.1, 0.4, 0.5, 0.7, 1.0])
    # The particles moved, and further by the end than at the snapshot.
    q = np.stack(np.meshgrid(*[np.arange(16)] * 3, indexing="ij"), -1).reshape(-1, 3) * (box / 16)
    moved = [_periodic_diff(ref[name]["pos"], q, box).mean() for name in ("snapshot", "final")]
    assert 0.5 < moved[0] < moved[1] < 20, moved


def test_linear_growth_on_large_scales() -> None:
    """2LPT + 10 PM steps in a 1 Gpc/h box: P_final / P_initial over D^2 within 1% at k < 0.05 h/Mpc (the same
    realisation), 64^3 particles on a 128^3 force mesh with the painting window deconvolved.

    The power is scaled by 1e-4 (the linear regime: no mode coupling), so the check is on the force and the steps.
    The densities are measured on a 4x mesh, whose window is the same for both. On the particle grid's own mesh the
    cloud-in-cell windows of painting and readout weaken the force (ratio 0.89 at k = 0.044 h/Mpc)."""
    n, box, mesh = 64, 1000.0, make_mesh((1,))  # (one device: the same run at 8 is checked above)

    def linear(k: jax.Array) -> jax.Array:
        return 1e-4 * sx.nbody.linear_power(COSMO, k)

    edges = (np.arange(0.5, 8.5) * 2 * np.pi / box).tolist()  # k < 0.05 h/Mpc

    def power(part: sx.particles.Particles) -> tuple[np.ndarray, np.ndarray]:
        delta = sx.nbody.density(part, box=box, mesh_per_side=4 * n, mesh=mesh)
        k, pk, _ = sx.fields.power_spectrum(delta, box=box, bins=edges)
        return np.asarray(k), np.asarray(pk)

    d = np.asarray(sx.nbody.growth_factor(COSMO, jnp.asarray([0.1, 1.0])))
    k, start = power(sx.nbody.lpt(COSMO, sx.nbody.white_noise(n, mesh=mesh), box=box, a=0.1, power=linear,
                                  mesh=mesh))
    assert np.all(k < 0.05)
    sim = sx.nbody.simulate(COSMO, particles_per_side=n, box=box, mesh_per_side=2 * n, a_start=0.1, steps=10,
                            power=linear, deconvolve=True, mesh=mesh)
    ratio = power(sim.particles)[1] / start / (d[1] / d[0]) ** 2
    np.testing.assert_allclose(ratio, 1.0, atol=0.01)


def test_gradients_match_finite_differences() -> None:
    """float64: d(sum delta^2)/d(noise) along a random direction and d/d(sigma8, omega_c), on one device
    (tests/test_comm_grad.py checks the exchanges' gradients on several devices)."""
    n, box = 8, 100.0
    mesh = make_mesh((1,))
    # (standard promotion: sx.fields.local_paint compares an int64 arange with the int32 count under x64)
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        noise = sx.nbody.white_noise(n, seed=5, mesh=mesh)
        direction = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((n,) * 3)), noise.sharding)

        def loss(cosmo: sx.nbody.Cosmology, noise: jax.Array) -> jax.Array:
            part, _ = sx.nbody.evolve(cosmo, noise, box=box, a=[0.2, 0.5, 1.0], mesh=mesh)
            delta = sx.nbody.density(part, box=box, mesh_per_side=n, mesh=mesh)
            return jnp.sum(delta * delta)

        cosmo = dataclasses.replace(COSMO, sigma8=jnp.float64(0.8), omega_c=jnp.float64(0.26))
        g_cosmo, g_noise = jax.grad(loss, argnums=(0, 1))(cosmo, noise)
        eps = 1e-5
        fd_noise = (loss(cosmo, noise + eps * direction) - loss(cosmo, noise - eps * direction)) / (2 * eps)
        np.testing.assert_allclose(jnp.vdot(g_noise, direction), fd_noise, rtol=1e-3)
        for name in ("sigma8", "omega_c"):
            value = getattr(cosmo, name)
            up = dataclasses.replace(cosmo, **{name: value + eps})
            down = dataclasses.replace(cosmo, **{name: value - eps})
            fd = (loss(up, noise) - loss(down, noise)) / (2 * eps)
            np.testing.assert_allclose(getattr(g_cosmo, name), fd, rtol=1e-3)


@functools.lru_cache(maxsize=4)
def _snapshot_gradients(shape: tuple[int, ...], adjoint: Literal["reverse", "checkpoint"]) -> tuple[float, np.ndarray, dict, tuple]:
    """``snapshot_gradients`` of tests/scripts/nbody_body.py on a mesh of ``shape`` (cached: several tests compare
    against the one-device values)."""
    return _body_module().snapshot_gradients(make_mesh(shape), adjoint)


def test_reverse_adjoint_matches_checkpointed_scan() -> None:
    """The reverse-time adjoint (the steps run backwards in the backward pass) against the checkpointed scan, with
    two snapshots in the loss: the same forward values bit for bit, the loss to rounding, gradients to 1e-10 (float64, one device)."""
    rev_value, rev_noise, rev_cosmo, rev_forward = _snapshot_gradients((1,), "reverse")
    ck_value, ck_noise, ck_cosmo, ck_forward = _snapshot_gradients((1,), "checkpoint")
    for got, want in zip(rev_forward, ck_forward, strict=True):
        np.testing.assert_array_equal(got, want)
    # The loss sums those values in two different programs, whose reductions XLA may order differently.
    np.testing.assert_allclose(rev_value, ck_value, rtol=1e-14)
    assert np.abs(ck_noise).max() > 0
    np.testing.assert_allclose(rev_noise, ck_noise, rtol=0, atol=1e-10 * np.abs(ck_noise).max())
    for name, want in ck_cosmo.items():
        assert want != 0, name
        np.testing.assert_allclose(rev_cosmo[name], want, rtol=1e-10, err_msg=name)


def test_reverse_adjoint_same_on_eight_devices() -> None:
    """The reverse adjoint inside smap on 8 devices (slabs: the reversed steps' forces exchange particles) gives the
    one-device loss and gradients (float64)."""
    one_value, one_noise, one_cosmo, _ = _snapshot_gradients((1,), "reverse")
    value, noise, cosmo, _ = _snapshot_gradients((8,), "reverse")
    np.testing.assert_allclose(value, one_value, rtol=1e-12)
    np.testing.assert_allclose(noise, one_noise, rtol=0, atol=1e-10 * np.abs(one_noise).max())
    for name, want in one_cosmo.items():
        np.testing.assert_allclose(cosmo[name], want, rtol=1e-10, err_msg=name)


def test_bad_input_is_refused() -> None:
    run = {"particles_per_side": 16, "box": 100.0, "a_start": 0.1, "steps": 2}
    cases = [
        ({"particles_per_side": 24}, ValueError, "power of two"),
        ({"mesh_per_side": 12}, ValueError, "power of two"),
        ({"steps": 0}, ValueError, "steps must be >= 1"),
        ({"a_start": 0.5, "a_end": 0.2}, ValueError, "a_start < a_end"),
        ({"snapshots": (0.6, 0.3)}, ValueError, "strictly increasing"),
        ({"snapshots": (0.05,)}, ValueError, "snapshots must lie"),
        ({"order": 3}, ValueError, "order must be 1"),
        ({"power": (np.array([0.01, 0.1, 1.0]), np.array([1.0, np.nan, 2.0]))}, ValueError, "NaN"),
        ({"box": -1.0}, ValueError, "box must be a positive"),
        ({"steps": 2.5}, TypeError, "steps must be an int"),
        ({"adjoint": "backsolve"}, ValueError, "adjoint must be 'reverse'"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            sx.nbody.simulate(COSMO, **{**run, **change})
    with pytest.raises(TypeError, match="Cosmology"):
        sx.nbody.simulate({"h": 0.7}, **run)  # type: ignore[arg-type]
    # A mesh that does not divide the grid: 8 devices on a 4^3 grid, 3 devices on 16^3.
    with pytest.raises(ValueError, match="does not divide over mesh axis"):
        sx.nbody.simulate(COSMO, **{**run, "particles_per_side": 4}, mesh=make_mesh((8,)))
    with pytest.raises(ValueError, match="does not divide over mesh axis"):
        sx.nbody.white_noise(16, mesh=make_mesh((3,)))
    with pytest.raises(ValueError, match="NaN"):
        sx.nbody.linear_field(sx.nbody.white_noise(16, mesh=make_mesh((1,))), box=100.0,
                              power=(np.array([0.1, 1.0]), np.array([np.nan, 1.0])))


def test_global_functions_run_as_compiled_programs() -> None:
    """Each global function runs its mapped body as one compiled program: a first call compiles a handful of
    programs (the body, growth and power tables), a second compiles none. (``lpt`` once ran its body eagerly, one
    small program per operation: 650 compilations, 22 s per call on 8 devices at 16^3.)"""
    mesh, cosmo, box = make_mesh((8,)), sx.nbody.Cosmology(), 100.0
    made: dict[str, jax.Array | sx.particles.Particles] = {}

    def noise() -> jax.Array:
        made["noise"] = sx.nbody.white_noise(8, seed=5, mesh=mesh)
        return made["noise"]

    def lpt() -> sx.particles.Particles:
        made["part"] = sx.nbody.lpt(cosmo, made["noise"], box=box, a=0.3)
        return made["part"]

    calls = {"white_noise": noise, "lpt": lpt,
             "linear_field": lambda: sx.nbody.linear_field(made["noise"], box=box, cosmo=cosmo),
             "pm_forces": lambda: sx.nbody.pm_forces(made["part"], box=box, mesh_per_side=8),
             "density": lambda: sx.nbody.density(made["part"], box=box, mesh_per_side=8)}
    with compilations() as compiles:
        for name, call in calls.items():
            for attempt, most in (("first", 8), ("second", 0)):
                compiles.clear()
                jax.block_until_ready(call())
                assert len(compiles) <= most, f"{name}, {attempt} call: {len(compiles)} programs compiled"

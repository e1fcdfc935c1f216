"""sx.nbody benchmarks: PM force evaluation against JaxPM, the JaxPM comparison of a whole run, gradient memory.

    python benchmarks/nbody.py                      # all three sections, 8 CPU devices in this process
    python benchmarks/nbody.py --section forces --n 128
    python benchmarks/nbody.py --section jaxpm --n 32 --steps 10
    python benchmarks/nbody.py --section memory
    python benchmarks/nbody.py --section growth --n 64

forces: one PM force evaluation (paint, rfftn, Poisson, gradient, irfftn, readout) of n^3 particles on an n^3 mesh
        by ``sx.nbody.pm_forces`` on 1 device and on 8 CPU devices (slabs), and JaxPM 0.1.6's ``pm_forces`` on one
        device, timed in turns in the same process (medians).
jaxpm:  the same white noise through ``sx.nbody.simulate`` (2LPT + FastPM KDK) and JaxPM (``lpt`` order 2 with a
        fresh jax-cosmo cosmology, then a kick-drift-kick leapfrog of its ``make_ode_fn`` at the same steps): the
        ratio of the final P(k) below k_Nyquist / 2 and the particle displacement differences in cells.
memory: temporary bytes of the compiled ``jax.grad`` of a final-density loss for 10 and 40 steps (XLA's
        ``memory_analysis``), one device, with the reverse-time adjoint and with the checkpointed scan, and the
        relative difference of the two gradients (float32: the round-off of the reversed trajectory).
growth: 2LPT + 10 PM steps from a = 0.1 in 1 Gpc/h, the power scaled by 1e-4 (linear regime; ``--scale``):
        ``P_final / P_initial / D^2`` of the same realisation below k = 0.053 h/Mpc, both densities on a 4x mesh,
        for the force mesh 1x and 2x the particle grid, with and without deconvolution, one device.
JaxPM needs ``pip install jaxpm==0.1.6 jaxdecomp==0.3.1 jaxtyping`` (jax-cosmo comes with ``shardax[nbody]``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Literal

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import shardax as sx  # noqa: E402

COSMO = sx.nbody.Cosmology()
Adjoint = Literal["checkpoint", "reverse"]


def _mesh(ndev: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:ndev]), ("d",))


def _median_ms(cases: dict, rounds: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median ms per call of each case, timed in turns so that every case sees the same load."""
    for fn in cases.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: float(np.median(t)) for name, t in times.items()}


def _jaxpm_cosmo():
    import jax_cosmo

    c = COSMO
    return jax_cosmo.Cosmology(Omega_c=c.omega_c, Omega_b=c.omega_b, h=c.h, n_s=c.n_s, sigma8=c.sigma8,
                               Omega_k=c.omega_k, w0=c.w0, wa=c.wa)


def forces(n: int) -> dict:
    from jaxpm.pm import pm_forces as jaxpm_pm_forces

    box = 2.0 * n
    cases: dict = {}
    result: dict = {"n": n}
    for ndev in (1, 8):
        part = sx.nbody.lpt(COSMO, sx.nbody.white_noise(n, mesh=_mesh(ndev)), box=box, a=0.5, mesh=_mesh(ndev))
        cases[f"shardax_{ndev}dev"] = (lambda p=part: sx.nbody.pm_forces(p, box=box, mesh_per_side=n))
        if ndev == 1:
            grid_pos = jnp.asarray(sx.particles.squeeze(part)["pos"][np.argsort(sx.particles.squeeze(part)["ids"])]
                                   .reshape(n, n, n, 3) * (n / box))
            jaxpm_fn = jax.jit(lambda x: jaxpm_pm_forces(x, mesh_shape=(n, n, n)))
            cases["jaxpm_1dev"] = lambda f=jaxpm_fn, x=grid_pos: f(x)
    result["median_ms"] = _median_ms(cases)
    ms = result["median_ms"]
    result["ratio_1dev"] = ms["shardax_1dev"] / ms["jaxpm_1dev"]
    result["ratio_8dev"] = ms["shardax_8dev"] / ms["jaxpm_1dev"]
    return result


def _jaxpm_run(noise: np.ndarray, box: float, a: np.ndarray, pk_fn) -> np.ndarray:
    """JaxPM 0.1.6: linear field from ``noise`` (its own recipe), 2LPT, leapfrog of its ODE; positions in cells."""
    import jax_cosmo
    from jaxpm.distributed import fft3d, ifft3d
    from jaxpm.kernels import fftk
    from jaxpm.pm import lpt, make_ode_fn

    n = noise.shape[0]
    field = fft3d(jnp.asarray(noise))
    kvec = fftk(field)
    kmesh = sum((kk / box * n) ** 2 for kk in kvec) ** 0.5
    field = ifft3d(field * jnp.sqrt(pk_fn(kmesh) * (n**3 / box**3)))
    grid = jnp.stack(jnp.meshgrid(*[jnp.arange(n, dtype=jnp.float32)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    cosmo = _jaxpm_cosmo()  # fresh: JaxPM's growth cache differs from jax-cosmo's
    dx, p, _ = lpt(cosmo, field, grid, a=float(a[0]), order=2)
    ode = make_ode_fn((n, n, n))
    pos, vel = grid + dx, p
    for a0, a1 in itertools.pairwise(a):
        half = 0.5 * (a0 + a1)
        _, dvel = ode((pos, vel), a0, cosmo)
        vel = vel + 0.5 * (a1 - a0) * dvel
        dpos, _ = ode((pos, vel), half, cosmo)
        pos = pos + (a1 - a0) * dpos
        _, dvel = ode((pos, vel), a1, cosmo)
        vel = vel + 0.5 * (a1 - a0) * dvel
    del jax_cosmo
    return np.asarray(pos)


def jaxpm_comparison(n: int, steps: int) -> dict:
    box = 4.0 * n
    kt = np.logspace(-4, 1, 256)
    pt = np.asarray(sx.nbody.linear_power(COSMO, kt))

    def pk_fn(k: jax.Array) -> jax.Array:
        return jnp.interp(k.reshape(-1), jnp.asarray(kt, k.dtype), jnp.asarray(pt, k.dtype)).reshape(k.shape)

    mesh = _mesh(1)
    sim = sx.nbody.simulate(COSMO, particles_per_side=n, box=box, a_start=0.1, steps=steps, power=pk_fn, mesh=mesh)
    ours = sx.particles.squeeze(sim.particles)
    pos_ours = ours["pos"][np.argsort(ours["ids"])] * (n / box)
    noise = np.asarray(sx.nbody.white_noise(n, mesh=mesh))
    pos_theirs = _jaxpm_run(noise, box, sim.a, pk_fn)
    diff = np.abs(pos_ours - pos_theirs % n)
    diff = np.minimum(diff, n - diff)
    grid = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    moved = np.abs(pos_ours - grid)
    moved = np.minimum(moved, n - moved)

    def power(pos_cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        part = sx.particles.from_numpy((pos_cells % n * (box / n)).astype(np.float32), mesh=mesh)
        delta = sx.nbody.density(part, box=box, mesh_per_side=n)
        k, pk, _ = sx.fields.power_spectrum(delta, box=box, bins=16)
        return np.asarray(k), np.asarray(pk)

    k, p_ours = power(pos_ours)
    _, p_theirs = power(pos_theirs)
    keep = k < 0.5 * np.pi * n / box
    return {"n": n, "box": box, "steps": steps, "k": k[keep].tolist(), "pk_ratio": (p_ours / p_theirs)[keep].tolist(),
            "max_pk_deviation": float(np.abs(p_ours / p_theirs - 1)[keep].max()),
            "displacement_rms_cells": float(np.sqrt((moved**2).sum(1).mean())),
            "difference_rms_cells": float(np.sqrt((diff**2).sum(1).mean())),
            "difference_max_cells": float(diff.max())}


def memory(n: int = 32) -> dict:
    mesh = _mesh(1)
    noise = sx.nbody.white_noise(n, mesh=mesh)
    out: dict = {"n": n}
    grads: dict = {}
    adjoints: tuple[Adjoint, ...] = ("checkpoint", "reverse")
    for adjoint in adjoints:
        for steps in (10, 40):
            a = list(np.linspace(0.1, 1.0, steps + 1))

            def loss(noise: jax.Array, a=a, adjoint: Adjoint = adjoint) -> jax.Array:
                part, _ = sx.nbody.evolve(COSMO, noise, box=4.0 * n, a=a, mesh=mesh, adjoint=adjoint)
                delta = sx.nbody.density(part, box=4.0 * n, mesh_per_side=n, mesh=mesh)
                return jnp.sum(delta * delta)

            compiled = jax.jit(jax.grad(loss)).lower(noise).compile()
            analysis = compiled.memory_analysis()
            assert analysis is not None
            out[f"{adjoint}_{steps}_steps_temp_MiB"] = round(analysis.temp_size_in_bytes / 2**20, 2)
            grads[adjoint, steps] = np.asarray(compiled(noise), np.float64)
    for steps in (10, 40):  # float32 round-off of the reversed trajectory, against the checkpointed gradient
        want = grads["checkpoint", steps]
        diff = np.linalg.norm(grads["reverse", steps] - want) / np.linalg.norm(want)
        out[f"{steps}_steps_gradient_relative_difference"] = float(f"{diff:.3g}")
    out["carry_MiB_per_step"] = 3 * n**3 * 3 * 4 / 2**20
    return out


def growth(n: int, scale: float, factors: tuple[str, ...] = ("1", "2", "2d")) -> dict:
    box, one = 1000.0, _mesh(1)

    def linear(k: jax.Array) -> jax.Array:
        return scale * sx.nbody.linear_power(COSMO, k)

    edges = (np.arange(0.5, 9.5) * 2 * np.pi / box).tolist()

    def power(part: sx.particles.Particles) -> tuple[np.ndarray, np.ndarray]:
        delta = sx.nbody.density(part, box=box, mesh_per_side=4 * n, mesh=one)
        k, pk, _ = sx.fields.power_spectrum(delta, box=box, bins=edges)
        return np.asarray(k), np.asarray(pk)

    d = np.asarray(sx.nbody.growth_factor(COSMO, jnp.asarray([0.1, 1.0])))
    k, start = power(sx.nbody.lpt(COSMO, sx.nbody.white_noise(n, mesh=one), box=box, a=0.1, power=linear, mesh=one))
    out: dict = {"n": n, "scale": scale, "k": [round(float(v), 4) for v in k]}
    for factor in factors:
        sim = sx.nbody.simulate(COSMO, particles_per_side=n, box=box, mesh_per_side=int(factor[0]) * n,
                                a_start=0.1, steps=10, power=linear, deconvolve=factor.endswith("d"), mesh=one)
        ratio = power(sim.particles)[1] / start / (d[1] / d[0]) ** 2
        out[f"mesh {factor[0]}x" + (" deconvolve" if factor.endswith("d") else "")] = [round(float(v), 4) for v in ratio]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=("all", "forces", "jaxpm", "memory", "growth"), default="all")
    parser.add_argument("--n", type=int, default=None, help="particles (and mesh) per side")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1e-4, help="growth: factor on the linear power")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "load": os.getloadavg()}
    if args.section in ("all", "forces"):
        results["forces"] = forces(args.n or 128)
        print(json.dumps(results["forces"]), flush=True)
    if args.section in ("all", "jaxpm"):
        results["jaxpm"] = jaxpm_comparison(args.n or 32, args.steps)
        print(json.dumps(results["jaxpm"]), flush=True)
    if args.section in ("all", "memory"):
        results["memory"] = memory()
        print(json.dumps(results["memory"]), flush=True)
    if args.section in ("all", "growth"):
        results["growth"] = growth(args.n or 64, args.scale)
        print(json.dumps(results["growth"]), flush=True)
    results["load_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

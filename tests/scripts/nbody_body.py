"""The sx.nbody run of tests/test_nbody.py at 2 processes x 4 CPU devices (imported by path in each process).

Module-level code stays free of JAX computations: the backend starts after ``sx.initialize()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import shardax as sx

RUN = {"particles_per_side": 16, "box": 200.0, "a_start": 0.1, "steps": 3, "seed": 3, "snapshots": (0.5,)}


def host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def gathered(part: sx.particles.Particles) -> dict[str, np.ndarray]:
    """Positions, velocities and ids of global particles sorted by id (host arrays), through ``squeeze``: the
    particles' ``num`` is split over the devices like their rows, as ``from_numpy`` gives it."""
    rows = sx.particles.squeeze(part)
    order = np.argsort(rows["ids"])
    return {"ids": rows["ids"][order], "pos": rows["pos"][order], "vel": rows["vel"][order]}


def run(mesh: object = None) -> dict:
    """The reference run and the white noise on ``mesh`` (default: all devices of all processes)."""
    cosmo = sx.nbody.Cosmology()
    sim = sx.nbody.simulate(cosmo, mesh=mesh, **RUN)  # type: ignore[arg-type]
    noise = sx.nbody.white_noise(RUN["particles_per_side"], seed=RUN["seed"], mesh=mesh)  # type: ignore[arg-type]
    return {"final": gathered(sim.particles), "snapshot": gathered(sim.snapshots[0][1]), "noise": host(noise),
            "a": np.asarray(sim.a)}


def distributed_body() -> dict:
    """Slabs over the flat mesh of 8 devices and pencils over the (2, 4) grid mesh; the float64 loss and gradients
    of :func:`snapshot_gradients` over the flat mesh."""
    value, g_noise, g_cosmo, _ = snapshot_gradients(sx.flat_mesh(), "reverse")
    return {"slabs": run(), "pencils": run(sx.grid_mesh(("hosts", "d"))), "gradients": (value, g_noise, g_cosmo)}

ADJOINT_RUN = {"n": 8, "box": 100.0, "a_start": 0.2, "steps": 3, "snapshots": (0.5, 0.7)}


def snapshot_gradients(mesh: Any, adjoint: Literal["reverse", "checkpoint"]) -> tuple[float, np.ndarray, dict, tuple]:
    """float64: a loss of the final and the snapshot positions and momenta (weights carried by the particle ids, so
    independent of the layout), its gradient in the noise and the cosmology, and the forward outputs (host arrays)."""
    from shardax.nbody._setup import make_setup, scale_factors
    from shardax.nbody._simulate import _run

    run = ADJOINT_RUN
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        setup = make_setup(n=run["n"], nm=run["n"], box=run["box"], mesh=mesh, where="test")
        times, slots = scale_factors(run["a_start"], 1.0, run["steps"], run["snapshots"], "test")
        noise = sx.nbody.white_noise(run["n"], seed=5, mesh=mesh)
        cosmo = dataclasses.replace(sx.nbody.Cosmology(), sigma8=jnp.float64(0.8), omega_c=jnp.float64(0.26))
        waves = jnp.asarray([[[1.0, 2.0, 3.0]]]) * (2 * np.pi / run["box"])

        def outputs(cosmo: sx.nbody.Cosmology, noise: jax.Array) -> tuple:
            return _run(setup, None, len(run["snapshots"]), adjoint, cosmo, noise, None, jnp.asarray(times),
                        jnp.asarray(slots))

        def loss(cosmo: sx.nbody.Cosmology, noise: jax.Array) -> jax.Array:
            pos, mom, ids, _, (snap_pos, snap_mom) = outputs(cosmo, noise)
            w = jnp.sin(0.37 * ids.astype(pos.dtype))[..., None]
            terms = [w * jnp.sin(pos * waves), 1e-3 * w * mom]
            for slot in range(len(run["snapshots"])):
                terms += [w * jnp.cos((slot + 1) * snap_pos[:, slot] * waves), 1e-3 * w * snap_mom[:, slot] ** 2]
            return jnp.sum(jnp.stack([jnp.sum(t) for t in terms]))

        value, (g_cosmo, g_noise) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(cosmo, noise)
        fields = {name: float(getattr(g_cosmo, name)) for name in ("sigma8", "omega_c", "omega_b", "h", "n_s")}
        forward = tuple(host(x) for x in jax.tree.leaves(jax.jit(outputs)(cosmo, noise)))
        return float(value), host(g_noise), fields, forward

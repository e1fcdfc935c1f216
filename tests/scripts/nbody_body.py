"""The sx.nbody run of tests/test_nbody.py at 2 processes x 4 CPU devices (imported by path in each process).

Module-level code stays free of JAX computations: the backend starts after ``sx.initialize()``.
"""

from __future__ import annotations

import jax
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
    """Slabs over the flat mesh of 8 devices and pencils over the (2, 4) grid mesh."""
    return {"slabs": run(), "pencils": run(sx.grid_mesh(("hosts", "d")))}

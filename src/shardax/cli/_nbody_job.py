"""The job behind ``shardax nbody``, on every process of the run: simulate, gather, measure, find halos, write.

Every stage is collective except the file writing and plotting, which process 0 does. What is written depends only
on the options (never on the number of processes or devices): particles are ordered by ID, the power spectrum's
modes are binned identically at every scale, and FoF labels are the smallest member ID.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ._nbody_files import (
    HALO_FILE,
    MASS_UNIT,
    POWER_FILE,
    SNAPSHOT_FILE,
    particle_mass,
    write_halos,
    write_power_csv,
    write_snapshot_file,
)
from ._progress import Progress

# The cosmology options of the command, by field of sx.nbody.Cosmology.
COSMOLOGY_FIELDS = ("omega_c", "omega_b", "h", "n_s", "sigma8")


@dataclasses.dataclass(frozen=True)
class NbodyOptions:
    """What ``shardax nbody`` runs (its command-line options).

    Attributes:
        particles: particles per side (a power of two).
        box: box side in Mpc/h.
        steps: kick-drift-kick steps from ``z_start`` to z = 0.
        z_start: redshift of the initial conditions.
        seed: seed of the white noise.
        order: LPT order of the initial conditions (1 or 2).
        mesh_factor: PM mesh cells per particle per side.
        cosmology: ``(field, value)`` overrides of ``sx.nbody.Cosmology()``.
        linking_length: FoF linking length in mean inter-particle spacings.
        min_members: smallest halo.
        out: output directory.
        plots: write the PNG plots.
    """

    particles: int = 64
    box: float = 256.0
    steps: int = 10
    z_start: float = 10.0
    seed: int = 0
    order: int = 2
    mesh_factor: int = 1
    cosmology: tuple[tuple[str, float], ...] = ()
    linking_length: float = 0.2
    min_members: int = 20
    out: str = "nbody_out"
    plots: bool = True


def options_from_namespace(ns: argparse.Namespace) -> NbodyOptions:
    cosmology = tuple((name, float(getattr(ns, name))) for name in COSMOLOGY_FIELDS if getattr(ns, name) is not None)
    return NbodyOptions(particles=ns.particles, box=ns.box, steps=ns.steps, z_start=ns.z_start, seed=ns.seed,
                        order=ns.order, mesh_factor=ns.mesh_factor, cosmology=cosmology,
                        linking_length=ns.linking_length, min_members=ns.min_members, out=ns.out,
                        plots=not ns.no_plots)


class JobResult(NamedTuple):
    """What :func:`run_job` made: the files written (process 0's list; empty on the others) and the stage times."""

    files: list[str]
    times: dict[str, float]
    compile_times: dict[str, float]


def run_job(options: NbodyOptions, *, mesh: Mesh | None = None, show: bool = True, plain: bool = False
            ) -> JobResult:
    """Run the ``shardax nbody`` job on every process of the run (collective) and write its files into
    ``options.out``.

    Args:
        options: what to run.
        mesh: the devices to run on (default: ``sx.flat_mesh()``, every device of every process).
        show: process 0 prints its steps and a summary on standard output.
        plain: plain step lines even on a terminal (else a rich spinner there).

    Returns:
        A :class:`JobResult`.

    Raises:
        ValueError: options that the library refuses (e.g. a mesh that does not divide over the devices).
        OSError: the output directory cannot be written.
    """
    from .. import nbody
    from ..runtime import flat_mesh

    mesh = mesh if mesh is not None else flat_mesh()
    me = jax.process_index()
    steps = Progress(5 if options.plots else 4, show=show and me == 0, plain=plain)
    cosmo = nbody.Cosmology(**dict(options.cosmology))
    n, box, cells = options.particles, options.box, options.particles * options.mesh_factor
    a_start = 1.0 / (1.0 + options.z_start)
    steps.say(f"shardax nbody: {n}^3 particles in a {box:g} Mpc/h box, {cells}^3 PM mesh, {options.steps} "
              f"kick-drift-kick steps from z = {options.z_start:g} to 0 ({_order_name(options.order)}), seed "
              f"{options.seed}; {jax.process_count()} process(es) x {jax.local_device_count()} "
              f"{jax.devices()[0].platform.upper()} device(s), {mesh.devices.size} in the mesh")
    if me == 0:
        os.makedirs(options.out, exist_ok=True)

    def simulate() -> Any:
        sim = nbody.simulate(cosmo, particles_per_side=n, box=box, mesh_per_side=cells, a_start=a_start,
                             a_end=1.0, steps=options.steps, seed=options.seed, order=options.order, mesh=mesh,
                             deconvolve=options.mesh_factor >= 2)
        return jax.block_until_ready(sim)

    sim = steps.run("particle-mesh N-body", simulate,
                    doing=f"particle-mesh N-body: initial conditions and {options.steps} steps on "
                          f"{mesh.devices.size} device(s) (compiles on the first run)")
    a_end = float(np.asarray(sim.a)[-1]) if np.size(sim.a) else 1.0
    mass = particle_mass(cosmo, box, n)
    # FoF's z-order sort needs room: the simulation's particles fill their buffers exactly and the sort's blocks come
    # out a few percent uneven, so FoF would grow its sort buffer and compile a second program (42 s instead of 18 s
    # for 64^3 particles on 8 CPU devices).
    part = _with_room(_with_mass(sim.particles, mass / MASS_UNIT), int(sim.particles.pos.shape[1]) // 4)

    def halos() -> tuple[Any, dict[str, np.ndarray]]:
        from ..spatial import fof

        res = fof.smap(mesh)(part, options.linking_length * box / n, box=box, min_members=options.min_members)
        return res, res.catalogue.to_numpy()

    fof_result, catalogue = steps.run("friends-of-friends", halos,
                                      doing=f"friends-of-friends halos on {mesh.devices.size} device(s)")
    power = steps.run("power spectrum", lambda: _power(nbody, cosmo, sim.particles, options, mesh, a_end),
                      doing="density field and power spectrum")
    files: list[str] = []

    def write() -> dict[str, np.ndarray]:
        rows = gather(part)
        if me == 0:
            files.append(write_snapshot_file(os.path.join(options.out, SNAPSHOT_FILE), rows, options, cosmo, a_end))
            files.append(write_power_csv(os.path.join(options.out, POWER_FILE), *power))
        files.extend(write_halos(os.path.join(options.out, HALO_FILE), fof_result, part, options, a_end))
        return rows

    rows = steps.run("write files", write, doing="gather particles; write snapshot, power spectrum and halos")
    if options.plots:
        from ._nbody_plots import write_plots

        notes: list[str] = []
        halo_mass = catalogue["count"] * mass
        plotted = steps.run("plots", lambda: write_plots(options, cosmo, rows["pos"], power, halo_mass, mass,
                                                           nbody.linear_power, notes) if me == 0 else [])
        files.extend(plotted)
        for note in notes:
            steps.say(note)
    _summary(steps, options, cosmo, mass, power, catalogue, files)
    return JobResult(files if me == 0 else [], steps.times, {k: c.compile_s for k, c in steps.compiles.items()})


def _order_name(order: int) -> str:
    return {1: "Zel'dovich (1LPT) initial conditions", 2: "2LPT initial conditions"}[order]


def _with_room(part: Any, extra: int) -> Any:
    """``part`` with ``extra`` empty rows after every device's rows (fields `(ndev, n, ...)`; a jitted pad, so it
    works on arrays spread over processes)."""
    rows = int(part.pos.shape[1])

    def pad(leaf: jax.Array) -> jax.Array:
        if leaf is part.num or jnp.ndim(leaf) < 2 or jnp.shape(leaf)[1] != rows:
            return leaf
        return jax.jit(lambda a: jnp.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2)),
                       out_shardings=leaf.sharding)(leaf)

    return jax.tree.map(pad, part)


def _with_mass(part: Any, mass: float) -> Any:
    """``part`` with every particle's ``mass`` set, split by rows over the devices as its positions are
    (``sx.io.write_fof_table`` reads every field by device block)."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = part.pos.sharding
    if not isinstance(sharding, NamedSharding):
        return part
    rows = NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0] if len(sharding.spec) else None))

    def by_rows(host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, rows, lambda index: host[index])

    masses = by_rows(np.full(part.pos.shape[:2], mass, np.dtype(part.pos.dtype)))
    return dataclasses.replace(part, mass=masses)


def gather(part: Any) -> dict[str, np.ndarray]:
    """Positions, velocities and IDs of every particle, on every process (collective), sorted by ID."""
    from ..particles import squeeze

    rows = squeeze(part)
    order = np.argsort(rows["ids"], kind="stable")
    return {name: rows[name][order] for name in ("pos", "vel", "ids")}


def _power(nbody: Any, cosmo: Any, part: Any, options: NbodyOptions, mesh: Mesh, a_end: float
           ) -> tuple[np.ndarray, ...]:
    """``(k, P(k), modes, linear P(k), linear P(k) of this realisation)`` at ``a_end``: the final particles' power on
    the PM mesh (CIC-compensated), the theory, and the measured power of the run's own linear field (same white
    noise) grown to ``a_end``, which has the same cosmic variance as the particles; linear bins of width the
    fundamental wavenumber up to the mesh's Nyquist wavenumber."""
    from .._capacity import retry_capacity
    from ..fields import bin_edges, paint, power_spectrum

    n, cells, box = options.particles, options.particles * options.mesh_factor, options.box
    edges = [float(e) for e in bin_edges(cells // 2 - 1, (cells, cells, cells), box)]
    # Clustered particles: a device may receive more than it holds; start with half as many again, grow to what
    # was needed.
    capacity = int(part.pos.shape[1]) * 3 // 2
    rho, _ = retry_capacity(paint, part, (cells, cells, cells), box=box, mesh=mesh, capacity=capacity)
    delta = rho * (cells**3 / n**3) - 1.0
    k, pk, modes = power_spectrum(delta, box=box, bins=edges)
    k = np.asarray(k, np.float64)
    # The theory under one jit: eagerly, jax-cosmo's transfer function and growth integration compile dozens of
    # small programs (7 s on the first run).
    linear = np.asarray(jax.jit(lambda c, k, a: nbody.linear_power(c, k, a=a))(cosmo, k, a_end), np.float64)
    initial = nbody.linear_field(nbody.white_noise(n, seed=options.seed, mesh=mesh), box=box, cosmo=cosmo, mesh=mesh)
    _, pk_initial, modes_initial = power_spectrum(initial, box=box, bins=edges, compensate=False)
    growth = float(np.asarray(jax.jit(nbody.growth_factor)(cosmo, a_end)))
    realisation = np.where(np.asarray(modes_initial) > 0, np.asarray(pk_initial, np.float64) * growth**2, np.nan)
    return k, np.asarray(pk, np.float64), np.asarray(modes, np.int64), linear, realisation


def _summary(steps: Progress, options: NbodyOptions, cosmo: Any, mass: float, power: tuple[np.ndarray, ...],
             catalogue: dict[str, np.ndarray], files: list[str]) -> None:
    k, pk, modes, linear, realisation = power
    large = k < 0.1
    ratio = float(np.sum(modes[large] * pk[large]) / np.sum(modes[large] * linear[large])) if large.any() else math.nan
    first = k < max(0.05, float(k[0]) * 1.01)  # the k < 0.05 h/Mpc, or the first bin of a small box
    growth = float(np.sum(modes[first] * pk[first]) / np.sum(modes[first] * realisation[first]))
    counts = catalogue["count"]
    total = sum(steps.times.values())
    compiling = sum(count.compile_s for count in steps.compiles.values())
    lines = [
        "",
        f"cosmology         {_cosmology_text(cosmo)}",
        f"particle mass     {mass:.4g} Msun/h",
        f"P(k) / linear     {ratio:.3f} at k < 0.1 h/Mpc against the theory (mode-weighted; this box's cosmic "
        "variance included)",
        f"linear growth     {growth:.4f} = P(k) / its own initial P(k) x D(a)^2 at k < {float(k[first].max()) * 1.01:.3g} "
        "h/Mpc (same realisation: no cosmic variance)",
        f"halos (>= {options.min_members:d})     {len(counts)} (FoF b = {options.linking_length:g}), holding "
        f"{int(counts.sum())} particles ({100 * counts.sum() / options.particles**3:.1f}%)"
        + (f"; largest {counts.max() * mass:.3g} Msun/h ({counts.max()} particles)" if len(counts) else ""),
        f"files             {', '.join(files)}",
        f"time              {total:.1f} s, of which XLA compiled for {compiling:.1f} s",
    ]
    steps.say("\n".join(lines))


def _cosmology_text(cosmo: Any) -> str:
    parts = []
    for name in COSMOLOGY_FIELDS:
        value = getattr(cosmo, name, None)
        if value is not None:
            parts.append(f"{name} = {float(value):.4g}")
    return ", ".join(parts)

"""The plots of ``shardax nbody`` (PNG, matplotlib): P(k) against linear theory, a density slice and the halo mass
function against Sheth-Tormen. Process 0 draws them from host arrays; without matplotlib nothing is drawn.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from ._nbody_files import RHO_CRIT, omega_m
from ._plots import log_axis, pyplot

POWER_PLOT = "power_spectrum.png"
SLICE_PLOT = "density_slice.png"
MASS_FUNCTION_PLOT = "halo_mass_function.png"
DPI = 150


def power_plot(path: str, power: tuple[np.ndarray, ...], box: float, particles: int, z: float,
               linear_curve: tuple[np.ndarray, np.ndarray] | None = None) -> str:
    """``P(k)`` of the final particles with the linear theory (``linear_curve``: a finer ``(k, P)`` than the bins)
    and the shot-noise level; below, their ratio with the scatter that cosmic variance gives each bin, and the ratio
    to the linear power of the run's own initial field (free of cosmic variance)."""
    plt = pyplot()
    k, pk, modes, linear, realisation = power
    k_nyq = math.pi * particles / box
    fig, (ax, ratio) = plt.subplots(2, 1, figsize=(5.5, 5.4), sharex=True, gridspec_kw={"height_ratios": (3, 1.4)})
    shown = pk > 0
    curve = linear_curve if linear_curve is not None else (k, linear)
    ax.loglog(*curve, "-", color="black", lw=1.2, label=f"linear theory, z = {z:g}")
    ax.loglog(k[shown], pk[shown], "o", ms=3.5, color="C0", label="N-body (CIC, compensated)")
    ax.axhline(box**3 / particles**3, ls=":", color="gray", lw=1, label="shot noise $V/N$")
    for axis in (ax, ratio):
        axis.axvline(k_nyq / 2, ls="--", color="gray", lw=0.8)
    ax.text(k_nyq / 2, 0.97, " $k_\\mathrm{Nyq}/2$", transform=ax.get_xaxis_transform(), va="top", ha="left",
            fontsize=8, color="gray")
    ax.set_ylabel("$P(k)$  [$(\\mathrm{Mpc}/h)^3$]")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"Matter power spectrum, {particles}$^3$ particles, {box:g} Mpc/$h$ box", fontsize=10)
    scatter = np.sqrt(2.0 / np.maximum(modes, 1))
    ratio.fill_between(k, 1 - scatter, 1 + scatter, color="gray", alpha=0.25, lw=0,
                       label="cosmic variance $\\pm\\sqrt{2/N_\\mathrm{modes}}$")
    ratio.semilogx(k[shown], pk[shown] / linear[shown], "o-", ms=3, color="C0", label="over linear theory")
    own = shown & np.isfinite(realisation) & (realisation > 0)
    ratio.semilogx(k[own], pk[own] / realisation[own], "s", ms=2.5, color="C1",
                   label="over the linear $P(k)$ of its own initial field")
    ratio.legend(fontsize=7, frameon=False, loc="upper left")
    ratio.axhline(1.0, color="black", lw=0.8)
    ratio.set_ylabel("$P / P_\\mathrm{lin}$")
    ratio.set_xlabel("$k$  [$h/\\mathrm{Mpc}$]")
    log_axis(ratio.xaxis, float(k.min()) * 0.9, float(k.max()) * 1.1)
    positive = np.concatenate([pk[shown], linear[linear > 0]])
    log_axis(ax.yaxis, float(positive.min()) * 0.7, float(positive.max()) * 1.4)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def projected_density(pos: np.ndarray, box: float, cells: int, depth: float) -> np.ndarray:
    """``1 + delta`` of the particles with ``0 <= z < depth``, projected along z onto ``cells x cells`` pixels by
    cloud-in-cell (periodic), normalised by the mean of the whole box."""
    inside = pos[:, 2] < depth
    scaled = pos[inside, :2].astype(np.float64) / (box / cells) - 0.5  # pixel centres at (i + 1/2) box / cells
    lower = np.floor(scaled).astype(np.int64)
    frac = scaled - lower
    image = np.zeros((cells, cells))
    for dx in (0, 1):
        for dy in (0, 1):
            weight = (frac[:, 0] if dx else 1 - frac[:, 0]) * (frac[:, 1] if dy else 1 - frac[:, 1])
            np.add.at(image, ((lower[:, 0] + dx) % cells, (lower[:, 1] + dy) % cells), weight)
    return image / (len(pos) * (depth / box) / cells**2)


def slice_plot(path: str, pos: np.ndarray, box: float, cells: int) -> str:
    """Overdensity ``1 + delta`` of the slab ``0 <= z < box/8`` (at least two cells) on the mesh's ``cells x cells``
    pixels (cloud-in-cell), log colour scale."""
    plt = pyplot()
    from matplotlib.colors import LogNorm

    depth = max(box / 8, 2 * box / cells)
    density = projected_density(pos, box, cells, depth)
    positive = density[density > 0]
    floor = max(0.05, float(positive.min())) if positive.size else 0.1  # empty pixels drawn at the floor
    fig, ax = plt.subplots(figsize=(5.4, 4.6))
    image = ax.imshow(np.maximum(density, floor).T, origin="lower", extent=(0, box, 0, box), cmap="magma",
                      norm=LogNorm(vmin=floor, vmax=max(density.max(), 10 * floor)), interpolation="nearest")
    bar = fig.colorbar(image, ax=ax, label="$1 + \\delta$ (projected)")
    log_axis(bar.ax.yaxis, image.norm.vmin, image.norm.vmax)
    ax.set_xlabel("$x$  [Mpc/$h$]")
    ax.set_ylabel("$y$  [Mpc/$h$]")
    ax.set_title(f"Density at z = 0, slab $0 \\leq z < {depth:g}$ Mpc/$h$", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def sheth_tormen(cosmo: Any, mass: np.ndarray, linear_power: Any) -> np.ndarray:
    """Sheth-Tormen ``dn / dlog10 M`` in ``(Mpc/h)^-3`` at z = 0 for masses in Msun/h, from the linear power
    (top-hat ``sigma(M)``, ``delta_c = 1.686``, ``A, a, p = 0.3222, 0.707, 0.3``)."""
    rho_m = omega_m(cosmo) * RHO_CRIT
    k = np.logspace(-4, 2, 4000)
    pk = np.asarray(linear_power(cosmo, k, a=1.0), np.float64)
    radius = (3 * mass / (4 * np.pi * rho_m)) ** (1 / 3)
    x = np.outer(radius, k)
    window = 3 * (np.sin(x) - x * np.cos(x)) / x**3
    integrand = k**2 * pk * window**2
    sigma = np.sqrt(np.sum(0.5 * (integrand[:, 1:] + integrand[:, :-1]) * np.diff(k), axis=1) / (2 * np.pi**2))
    dlninv_sigma = -np.gradient(np.log(sigma), np.log(mass))
    nu2 = (1.686 / sigma) ** 2
    a_st, p_st, big_a = 0.707, 0.3, 0.3222
    f = big_a * np.sqrt(2 * a_st / np.pi) * (1 + (a_st * nu2) ** -p_st) * np.sqrt(nu2) * np.exp(-a_st * nu2 / 2)
    return np.log(10) * rho_m / mass * f * dlninv_sigma


def mass_function_plot(path: str, halo_mass: np.ndarray, particle_mass: float, box: float, min_members: int,
                       b: float, reference: tuple[np.ndarray, np.ndarray] | None) -> str:
    """``dn / dlog10 M`` of the FoF halos with Poisson errors, the Sheth-Tormen curve, and the mass in particles on
    the top axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4.4))
    volume = box**3
    low = min_members * particle_mass
    high = max(float(halo_mass.max()) if len(halo_mass) else low, 10 * low)
    shown: list[np.ndarray] = []
    if len(halo_mass):
        bins = int(np.clip(np.ceil(np.log10(halo_mass.max() / low) / 0.15), 3, 16))
        edges = np.logspace(np.log10(low) - 1e-3, np.log10(halo_mass.max()) + 1e-3, bins + 1)
        counts, _ = np.histogram(halo_mass, edges)
        widths = np.diff(np.log10(edges))
        centres = np.sqrt(edges[1:] * edges[:-1])
        keep = counts > 0
        density = (counts / widths / volume)[keep]
        error = (np.sqrt(counts) / widths / volume)[keep]
        # A bin of one halo has a Poisson error as large as its value: its lower bar stops short of zero.
        ax.errorbar(centres[keep], density, yerr=(np.minimum(error, 0.8 * density), error), fmt="o", ms=4,
                    capsize=2, label=f"FoF b = {b:g}, {len(halo_mass)} halos")
        shown += [0.2 * density, density + error]
    if reference is not None:
        mass_grid, dn = reference
        # The theory curve down to a fraction of a halo per bin of the box, not along its exponential tail.
        floor = 0.3 / (0.15 * volume)
        if shown:
            floor = min(floor, np.concatenate(shown).min())
        inside = dn >= floor
        mass_grid, dn = mass_grid[inside], dn[inside]
        ax.plot(mass_grid, dn, "-", color="black", lw=1.2, label="Sheth-Tormen (linear theory)")
        shown.append(dn)
    if not len(halo_mass):
        ax.text(0.97, 0.8, f"no halos of {min_members} or more particles", ha="right", va="center",
                transform=ax.transAxes)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low / 1.3, high * 1.3)
    if shown:
        values = np.concatenate(shown)
        values = values[values > 0]
        ax.set_ylim(values.min() / 1.5, values.max() * 1.5)
        log_axis(ax.yaxis, values.min() / 1.5, values.max() * 1.5)
    ax.set_xlabel("$M$  [$M_\\odot/h$]")
    ax.set_ylabel("$dn / d\\log_{10} M$  [$(h/\\mathrm{Mpc})^3$]")
    log_axis(ax.xaxis, low / 1.3, high * 1.3)
    top = ax.secondary_xaxis("top", functions=(lambda m: m / particle_mass, lambda n: n * particle_mass))
    top.set_xlabel("particles", fontsize=9)
    log_axis(top.xaxis, low / 1.3 / particle_mass, high * 1.3 / particle_mass)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"Halo mass function at z = 0 (volume {box:g}$^3$ (Mpc/$h$)$^3$)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def write_plots(options: Any, cosmo: Any, pos: np.ndarray, power: tuple[np.ndarray, ...], halo_mass: np.ndarray,
                particle_mass: float, linear_power: Any, notes: list[str]) -> list[str]:
    """The three plots into ``options.out``; returns their paths (none, with a note, without matplotlib)."""
    try:
        pyplot()
    except ImportError:
        notes.append("plots skipped: matplotlib is not installed (pip install 'shardax[plot]')")
        return []
    out, box, n = options.out, options.box, options.particles
    k = power[0]
    k_fine = np.logspace(np.log10(k.min()), np.log10(k.max()), 200)
    linear_curve = (k_fine, np.asarray(linear_power(cosmo, k_fine, a=1.0), np.float64))
    paths = [power_plot(os.path.join(out, POWER_PLOT), power, box, n, 0.0, linear_curve),
             slice_plot(os.path.join(out, SLICE_PLOT), pos, box, n * options.mesh_factor)]
    low = options.min_members * particle_mass
    grid = np.logspace(np.log10(low / 1.5), np.log10(max(float(halo_mass.max()) if len(halo_mass) else low,
                                                             10 * low) * 1.5), 60)
    try:
        reference: tuple[np.ndarray, np.ndarray] | None = (grid, sheth_tormen(cosmo, grid, linear_power))
    except (ValueError, FloatingPointError) as err:
        reference = None
        notes.append(f"mass function plotted without the Sheth-Tormen curve: {err}")
    paths.append(mass_function_plot(os.path.join(out, MASS_FUNCTION_PLOT), halo_mass, particle_mass, box,
                                    options.min_members, options.linking_length, reference))
    return paths

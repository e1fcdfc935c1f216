"""The plots of ``shardax demo`` (PNG, matplotlib): halo mass function, a kNN density slice and the power spectrum.

The demo's particles live in a periodic box of side ``L`` = 1 in box units (the axes say so: ``k`` in ``1/L``, ``P(k)``
in ``L^3``; for a box in Mpc/h these read h/Mpc and (Mpc/h)^3). Each writer returns the path it wrote. Without
matplotlib, :func:`write_plots` writes nothing and says so.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._plots import log_axis, mass_function_plot, pyplot


def density_slice_plot(pos: np.ndarray, density: np.ndarray, box: float, path: str) -> str:
    """Particles of the slab ``0.45 box <= z < 0.55 box`` coloured by ``log10`` of their kNN density."""
    plt = pyplot()
    z = pos[:, 2] / box
    inside = (z >= 0.45) & (z < 0.55)
    order = np.argsort(density[inside])  # densest drawn last, on top
    fig, ax = plt.subplots(figsize=(5.4, 4.6))
    points = ax.scatter(pos[inside, 0][order], pos[inside, 1][order], c=np.log10(density[inside][order]), s=2,
                        cmap="magma", linewidths=0)
    fig.colorbar(points, ax=ax, label="log10 kNN density / mean")
    ax.set_xlim(0, box)
    ax.set_ylim(0, box)
    ax.set_aspect("equal")
    ax.set_xlabel(f"x  [box units, L = {box:g}]")
    ax.set_ylabel("y  [box units]")
    ax.set_title(f"kNN density, {int(inside.sum())} particles at 0.45 <= z/box < 0.55", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def power_spectrum_plot(k: np.ndarray, pk: np.ndarray, reference: np.ndarray, shot_noise: float, path: str, *,
                        box: float = 1.0, grid: int | None = None, unit: str = "box units") -> str:
    """``P(k)`` from ``sx.fields.power_spectrum`` with the NumPy reference, the shot-noise level ``L^3 / N`` and the
    Nyquist wavenumber of the grid.

    Args:
        k: `(bins,)` mean wavenumber per bin, in ``1 / unit``.
        pk: `(bins,)` shardax's power, in ``unit^3``.
        reference: `(bins,)` the NumPy reference power.
        shot_noise: ``box^3 / N``.
        path: the PNG to write.
        box: the box side, in ``unit``.
        grid: cells per side (marks the Nyquist wavenumber ``pi grid / box``).
        unit: the length unit of ``box`` (``"Mpc/h"`` gives k in h/Mpc and P(k) in (Mpc/h)^3).
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 4.2))
    shown = (pk > 0) & (k > 0)
    ax.loglog(k[shown], pk[shown], "o-", ms=4, label="shardax (distributed)")
    ax.loglog(k[shown], reference[shown], "x", color="black", label="NumPy reference")
    ax.axhline(shot_noise, ls="--", color="gray", label=f"shot noise $L^3/N$ = {shot_noise:.2g}")
    if grid is not None:
        nyquist = np.pi * grid / box
        ax.axvline(nyquist, ls=":", color="tab:red", label=f"Nyquist $\\pi N_g / L$ = {nyquist:.3g}")
    if shown.any():
        log_axis(ax.xaxis, float(k[shown].min()) * 0.9, float(k[shown].max()) * 1.1)
        low = min(float(pk[shown].min()), shot_noise)
        log_axis(ax.yaxis, low * 0.5, float(pk[shown].max()) * 2)
    if unit == "Mpc/h":
        ax.set_xlabel("k  [h/Mpc]")
        ax.set_ylabel("P(k)  [(Mpc/h)$^3$]")
    else:
        ax.set_xlabel(f"k  [1/L]   (box side L = {box:g} {unit})")
        ax.set_ylabel("P(k)  [$L^3$]")
    ax.set_title(f"density power spectrum, {grid or '?'}$^3$ CIC grid", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(data: dict[str, Any], pos: np.ndarray, box: float, out_dir: str) -> tuple[list[str], list[str]]:
    """Every plot whose data a stage left in ``data``; returns ``(paths, notes)``."""
    try:
        pyplot()
    except ImportError:
        return [], ["plots skipped: matplotlib is not installed (pip install matplotlib, or shardax[all])"]
    os.makedirs(out_dir, exist_ok=True)
    paths, notes = [], []
    if "halo_mass" in data:
        path = os.path.join(out_dir, "halo_mass_function.png")
        mass_function_plot(data["halo_mass"], box**3, path, f"FoF halo mass function, {len(data['halo_mass'])} "
                           f"halos, box side {box:g} (box units)")
        paths.append(path)
    if "density" in data:
        paths.append(density_slice_plot(pos, data["density"], box, os.path.join(out_dir, "knn_density_slice.png")))
    if "power" in data:
        k, pk, reference, shot, grid = data["power"]
        paths.append(power_spectrum_plot(k, pk, reference, shot, os.path.join(out_dir, "power_spectrum.png"),
                                         box=box, grid=grid))
    missing = [name for name, key in (("halo mass function", "halo_mass"), ("kNN density slice", "density"),
                                      ("P(k)", "power")) if key not in data]
    if missing:
        notes.append(f"not plotted (their stage failed): {', '.join(missing)}")
    return paths, notes

"""The plots of ``shardax demo`` (PNG, matplotlib): halo mass function, a kNN density slice and the power spectrum.

Each writer returns the path it wrote. Without matplotlib, :func:`write_plots` writes nothing and says so.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._plots import mass_function_plot


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def density_slice_plot(pos: np.ndarray, density: np.ndarray, box: float, path: str) -> str:
    """Particles of the slab ``0.45 box <= z < 0.55 box`` coloured by ``log10`` of their kNN density."""
    plt = _pyplot()
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
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(f"kNN density, {int(inside.sum())} particles at 0.45 <= z/box < 0.55", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def power_spectrum_plot(k: np.ndarray, pk: np.ndarray, reference: np.ndarray, shot_noise: float, path: str) -> str:
    """``P(k)`` from ``sx.fields.power_spectrum`` with the NumPy reference and the shot-noise level."""
    plt = _pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(5, 4))
    shown = pk > 0
    ax.loglog(k[shown], pk[shown], "o-", label="shardax (distributed)")
    ax.loglog(k[shown], reference[shown], "x", color="black", label="NumPy reference")
    ax.axhline(shot_noise, ls="--", color="gray", label="shot noise")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("k")
    ax.set_ylabel("P(k)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(data: dict[str, Any], pos: np.ndarray, box: float, out_dir: str) -> tuple[list[str], list[str]]:
    """Every plot whose data a stage left in ``data``; returns ``(paths, notes)``."""
    try:
        _pyplot()
    except ImportError:
        return [], ["plots skipped: matplotlib is not installed (pip install matplotlib, or shardax[all])"]
    os.makedirs(out_dir, exist_ok=True)
    paths, notes = [], []
    if "halo_mass" in data:
        path = os.path.join(out_dir, "halo_mass_function.png")
        mass_function_plot(data["halo_mass"], box**3, path, f"FoF halo mass function, {len(data['halo_mass'])} halos")
        paths.append(path)
    if "density" in data:
        paths.append(density_slice_plot(pos, data["density"], box, os.path.join(out_dir, "knn_density_slice.png")))
    if "power" in data:
        k, pk, reference, shot = data["power"]
        paths.append(power_spectrum_plot(k, pk, reference, shot, os.path.join(out_dir, "power_spectrum.png")))
    missing = [name for name, key in (("halo mass function", "halo_mass"), ("kNN density slice", "density"),
                                      ("P(k)", "power")) if key not in data]
    if missing:
        notes.append(f"not plotted (their stage failed): {', '.join(missing)}")
    return paths, notes

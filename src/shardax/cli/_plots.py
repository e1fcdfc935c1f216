"""Plot helpers shared by the CLI jobs: matplotlib set up for files, readable log axes, the halo mass function."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def warm_up() -> None:
    """Import matplotlib and draw a throwaway figure with math text: fonts, the math text parser and Agg load on
    their first use, about 0.6 s of a job's first plot. For a thread of a process that would otherwise wait (the
    ``halos`` job's last process, while process 0 compiles); without matplotlib, nothing."""
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(1, 1))
    ax.set_xscale("log")
    ax.set_xlabel("$10^{1}$ (Mpc/h)$^{-3}$ log$_{10}$")
    fig.canvas.draw()
    plt.close(fig)


def _plain_number(value: float, _: Any = None) -> str:
    return "0" if value == 0 else f"{value:g}"


def _power_of_ten(value: float, _: Any = None) -> str:
    if value <= 0:
        return f"{value:g}"
    exponent = math.floor(math.log10(value) + 1e-9)
    mantissa = value / 10**exponent
    lead = "" if abs(mantissa - 1) < 1e-6 else f"{mantissa:.0f}\\times"
    return f"${lead}10^{{{exponent}}}$"


def log_axis(axis: Any, lo: float, hi: float) -> None:
    """Major ticks at 1-2-5 of each decade (range under 2.5 decades) or at the decades, labelled alike without
    overlap: plain numbers when the range lies within [0.01, 1e5), else powers of ten; minor ticks unlabelled."""
    import matplotlib.ticker as ticker

    decades = math.log10(max(hi, lo * 1.0001) / lo) if lo > 0 else 3.0
    subs = (1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=12))
    plain = lo >= 0.01 and hi < 1e5
    axis.set_major_formatter(ticker.FuncFormatter(_plain_number if plain else _power_of_ten))
    axis.set_minor_locator(ticker.LogLocator(base=10, subs=tuple(float(m) for m in range(2, 10)), numticks=12))
    axis.set_minor_formatter(ticker.NullFormatter())


def power_law_fit(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> tuple[float, float] | None:
    """``(amplitude, slope)`` of ``y = amplitude x^slope`` by weighted least squares in log space (None with fewer
    than 3 points)."""
    keep = (x > 0) & (y > 0) & (weights > 0)
    if keep.sum() < 3:
        return None
    slope, intercept = np.polyfit(np.log10(x[keep]), np.log10(y[keep]), 1, w=np.sqrt(weights[keep]))
    return float(10**intercept), float(slope)


def mass_function_plot(mass: np.ndarray, volume: float, path: str, title: str, *, mass_unit: str = "particles",
                       length_unit: str = "box units") -> bool:
    """Write ``dn/dlog10 M`` of halo masses to ``path`` (PNG), with Poisson errors and a fitted power law.

    Args:
        mass: `(G,)` halo masses in ``mass_unit`` (member counts when the particle mass is not known).
        volume: the box volume in ``length_unit`` cubed.
        path: the PNG to write.
        title: the plot title.
        mass_unit: the unit of ``mass``, e.g. ``"particles"`` or ``"$M_\\odot/h$"``.
        length_unit: the unit of the box side, e.g. ``"Mpc/h"``.

    Returns:
        False when matplotlib is missing (nothing written).
    """
    try:
        plt = pyplot()
    except ImportError:
        return False
    mass = np.asarray(mass, np.float64)
    fig, ax = plt.subplots(figsize=(5.4, 4.2))
    if len(mass):
        lo, hi = mass.min(), mass.max()
        bins = int(np.clip(np.ceil(np.log10(hi / lo) / 0.15), 4, 20))
        edges = np.logspace(np.log10(lo) - 0.02, np.log10(hi) + 0.02, bins + 1)
        counts, _ = np.histogram(mass, edges)
        widths = np.diff(np.log10(edges))
        centres = np.sqrt(edges[1:] * edges[:-1])
        keep = counts > 0
        density = counts / widths / volume
        ax.errorbar(centres[keep], density[keep], yerr=(np.sqrt(counts) / widths / volume)[keep], fmt="o",
                    ms=4, capsize=2, label=f"FoF halos ({len(mass)})")
        fit = power_law_fit(centres, density, counts.astype(np.float64))
        if fit is not None:
            grid = np.logspace(np.log10(edges[0]), np.log10(edges[-1]), 50)
            ax.plot(grid, fit[0] * grid ** fit[1], "--", color="gray",
                    label=f"power-law fit $\\propto M^{{{fit[1]:.2f}}}$")
        ax.set_xscale("log")
        ax.set_yscale("log")
        log_axis(ax.xaxis, edges[0], edges[-1])
        shown = density[keep]
        log_axis(ax.yaxis, shown.min() * 0.5, shown.max() * 2)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no halos", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(f"halo mass M  [{mass_unit}]")
    inverse_volume = "(box units)$^{-3}$" if length_unit == "box units" else f"({length_unit})$^{{-3}}$"
    ax.set_ylabel(f"dn / dlog$_{{10}}$M  [{inverse_volume}]")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

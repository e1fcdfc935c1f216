"""``shardax halos``: friends-of-friends halo catalogue (HDF5) and mass function plot, from a snapshot or from
generated initial conditions, on one process or many.

Run it as ``shardax halos ...`` or ``python -m shardax.cli halos ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..runtime._env import ENV_NUM_PROCESSES


def halos_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardax halos",
        description="Find friends-of-friends halos in a Gadget-style HDF5 snapshot (PartType1) or, without one, in "
                    "generated clustered initial conditions; write the catalogue (HDF5) and a halo mass function "
                    "plot (PNG), and print a summary.")
    parser.add_argument("snapshot", nargs="?", default=None, help="snapshot file (default: generate particles)")
    parser.add_argument("--linking-length", type=float, default=0.2, metavar="B",
                        help="linking length in units of the mean inter-particle spacing (default 0.2)")
    parser.add_argument("--absolute", action="store_true",
                        help="read --linking-length as an absolute length in box units instead")
    parser.add_argument("--min-members", type=int, default=20, metavar="K", help="smallest halo (default 20)")
    parser.add_argument("--particles", type=int, default=100_000, metavar="N",
                        help="generated particles when no snapshot is given (default 100000)")
    parser.add_argument("--box", type=float, default=1.0, help="box size of generated particles (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of generated particles (default 0)")
    parser.add_argument("--processes", type=int, default=None, metavar="N",
                        help="run under `shardax launch -n N` (rank 0 prints and plots)")
    parser.add_argument("--cpu-devices", type=int, default=None, metavar="M", help="CPU devices per process")
    parser.add_argument("--out", default="halos_out", metavar="DIR", help="output directory (default halos_out)")
    parser.add_argument("--per-rank", action="store_true", help="one catalogue file per process plus an index")
    parser.add_argument("--timeout", type=float, default=1800.0, metavar="S",
                        help="with --processes: stop after S seconds (default 1800)")
    return parser


def run_cli(argv: Sequence[str]) -> int:
    """``shardax halos ...``: returns 0 on success."""
    parser = halos_parser()
    ns = parser.parse_args(list(argv))
    for name in ("processes", "cpu_devices", "min_members", "particles"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if not (ns.linking_length > 0 and math.isfinite(ns.linking_length)):
        parser.error(f"--linking-length must be positive, got {ns.linking_length}")
    if not ns.box > 0:
        parser.error(f"--box must be positive, got {ns.box}")
    if ns.snapshot is not None and not os.path.exists(ns.snapshot):
        parser.error(f"snapshot {ns.snapshot} does not exist")
    if ns.processes is not None and ENV_NUM_PROCESSES not in os.environ:
        from ._launch import launch

        return launch(["-m", "shardax.cli", "halos", *_forward(ns)], num_processes=ns.processes,
                      cpu_devices=ns.cpu_devices, timeout_s=ns.timeout)
    try:
        return halos(ns)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"shardax halos: {err}\n")
        return 1


def _forward(ns: argparse.Namespace) -> list[str]:
    """The arguments each launched process gets (everything but ``--processes``)."""
    args = [] if ns.snapshot is None else [ns.snapshot]
    args += ["--linking-length", repr(ns.linking_length), "--min-members", str(ns.min_members), "--particles",
             str(ns.particles), "--box", repr(ns.box), "--seed", str(ns.seed), "--out", ns.out]
    if ns.cpu_devices is not None:
        args += ["--cpu-devices", str(ns.cpu_devices)]
    return args + [flag for flag, on in (("--absolute", ns.absolute), ("--per-rank", ns.per_rank)) if on]


def generate(n: int, box: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Clustered particles in a periodic box: half in Gaussian halos with a power-law size distribution, half uniform.

    Every process draws the same global set (so runs at any scale see the same particles).

    Returns:
        ``(pos (n, 3), vel (n, 3))`` float32.
    """
    rng = np.random.default_rng(seed)
    in_halos = n // 2
    sizes = np.minimum(np.floor(20 * (1 - rng.random(4 * max(1, in_halos // 40))) ** (-1 / 0.9)), 5000).astype(int)
    sizes = sizes[np.cumsum(sizes) <= in_halos]
    spacing = box / n ** (1 / 3)
    centres = rng.random((len(sizes), 3)) * box
    parts, vels = [], []
    for centre, size in zip(centres, sizes, strict=True):
        sigma = 0.12 * spacing * (size / 20) ** (1 / 3)
        parts.append(centre + sigma * rng.standard_normal((size, 3)))
        vels.append(rng.standard_normal(3) + 0.1 * rng.standard_normal((size, 3)))
    rest = n - int(sum(sizes))
    parts.append(rng.random((rest, 3)) * box)
    vels.append(rng.standard_normal((rest, 3)))
    pos = np.concatenate(parts) % box
    vel = np.concatenate(vels)
    order = rng.permutation(n)
    return pos[order].astype(np.float32), vel[order].astype(np.float32)


class _Stages:
    """Numbered stage lines with timings, printed by process 0."""

    def __init__(self, total: int, show: bool):
        self.total, self.show, self.index = total, show, 0
        self.times: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        self.index += 1
        if self.show:
            sys.stdout.write(f"[{self.index}/{self.total}] {name} ...\n")
            sys.stdout.flush()
        start = time.perf_counter()
        out = fn()
        self.times[name] = time.perf_counter() - start
        if self.show:
            sys.stdout.write(f"      {name}: {self.times[name]:.2f} s\n")
            sys.stdout.flush()
        return out


def _fof_with_retry(part: Any, linking_length: float, box: tuple[float, ...], min_members: int) -> Any:
    from .._errors import CapacityError
    from ..spatial._fof import fof

    options: dict[str, int] = {}
    for _ in range(6):
        try:
            return fof.smap()(part, linking_length, box=box, min_members=min_members, **options)
        except CapacityError as err:
            if err.argument not in ("edge_capacity", "halo_capacity", "max_groups", "sort_capacity") or \
                    err.needed is None:
                raise
            options[err.argument] = max(int(err.needed), 2 * options.get(err.argument, 0))
    return fof.smap()(part, linking_length, box=box, min_members=min_members, **options)


def mass_function_plot(mass: np.ndarray, volume: float, path: str, title: str) -> bool:
    """Write ``dn/dlog10 M`` of the halo masses to ``path`` (PNG); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 4))
    if len(mass):
        edges = np.logspace(np.log10(mass.min()) - 0.05, np.log10(mass.max()) + 0.05, 16)
        counts, _ = np.histogram(mass, edges)
        widths = np.diff(np.log10(edges))
        centres = np.sqrt(edges[1:] * edges[:-1])
        keep = counts > 0
        ax.errorbar(centres[keep], (counts / widths / volume)[keep],
                    yerr=(np.sqrt(counts) / widths / volume)[keep], fmt="o-")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("halo mass M")
    ax.set_ylabel("dn / dlog10 M  [per unit volume]")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def halos(ns: argparse.Namespace) -> int:
    """The job behind ``shardax halos`` on every process of the run."""
    from .. import io as sxio
    from ..particles import from_numpy
    from ..runtime import initialize

    world = initialize(cpu_devices=ns.cpu_devices)
    me = world.process_id
    stages = _Stages(5, me == 0)
    if me == 0:
        sys.stdout.write(f"shardax halos: {world.num_processes} process(es) x {world.local_device_count} "
                         f"{world.platform} device(s)\n")

    def load() -> tuple[Any, np.ndarray, int, str]:
        if ns.snapshot is not None:
            snap = sxio.read_snapshot(ns.snapshot)
            return snap.part, snap.box, snap.total, f"snapshot {ns.snapshot}"
        pos, vel = generate(ns.particles, ns.box, ns.seed)
        rows = np.array_split(np.arange(ns.particles), world.num_processes)[me]
        part = from_numpy(pos[rows], vel=vel[rows], mass=np.ones(len(rows), np.float32))
        return part, np.full(3, ns.box), ns.particles, f"{ns.particles} generated particles (seed {ns.seed})"

    part, box, total, source = stages.run("read particles", load)
    volume = float(np.prod(box))
    spacing = (volume / total) ** (1 / 3)
    ll = ns.linking_length if ns.absolute else ns.linking_length * spacing
    box_t = tuple(float(b) for b in box)
    result = stages.run("friends-of-friends", lambda: _fof_with_retry(part, ll, box_t, ns.min_members))
    cat = stages.run("gather catalogue", result.catalogue.to_numpy)
    os.makedirs(ns.out, exist_ok=True)
    cat_path = os.path.join(ns.out, "halos.h5")
    files = stages.run("write catalogue", lambda: sxio.write(cat_path, result.catalogue, per_rank=ns.per_rank))
    plot_path = os.path.join(ns.out, "mass_function.png")
    plotted = stages.run("mass function plot", lambda: me == 0 and mass_function_plot(
        cat["mass"], volume, plot_path, f"FoF b={ns.linking_length:g}, {len(cat['mass'])} halos"))
    if me == 0:
        _summary(source, total, ll, spacing, ns, cat, files, plot_path if plotted else None, stages.times)
    return 0


def _summary(source: str, total: int, ll: float, spacing: float, ns: argparse.Namespace, cat: dict[str, np.ndarray],
             files: list[str], plot: str | None, times: dict[str, float]) -> None:
    lines = [
        "",
        f"source            {source}",
        f"particles         {total}",
        f"linking length    {ll:.6g} (b = {ll / spacing:.3g} x mean spacing {spacing:.4g})",
        f"halos (>= {ns.min_members:d})     {len(cat['count'])}, holding {int(cat['count'].sum())} particles "
        f"({100 * cat['count'].sum() / max(total, 1):.1f}%)",
        f"catalogue         {', '.join(files)}",
        f"mass function     {plot or 'not plotted (pip install matplotlib)'}",
        f"time              {sum(times.values()):.2f} s",
    ]
    order = np.argsort(-cat["count"], kind="stable")[:5]
    if len(order):
        lines.append("largest halos     label      count        mass   centre of mass")
        for i in order:
            com = " ".join(f"{c:.4f}" for c in cat["com"][i])
            lines.append(f"                  {cat['label'][i]:<10d} {cat['count'][i]:<10d} {cat['mass'][i]:<11.4g} {com}")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


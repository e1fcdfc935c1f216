"""``shardax halos``: friends-of-friends halo catalogue (a Gadget-4 ``fof_tab_000.hdf5``) and mass function plot,
from a snapshot or from generated initial conditions, on one process or many.

Run it as ``shardax halos ...`` or ``python -m shardax.cli halos ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._compile_cache import cache_environment, settle_compilation_cache, use_compilation_cache
from ..runtime import ENV_NUM_PROCESSES
from ._options import add_run_options, add_world_options, computing_here, job_parser
from ._progress import Progress

CATALOGUE = "fof_tab_000.hdf5"
MSUN_G = 1.98847e33  # grams
MPC_CM = 3.0856775814913673e24  # centimetres


def halos_parser() -> argparse.ArgumentParser:
    parser = job_parser(
        "halos",
        "Find friends-of-friends halos in a Gadget-style HDF5 snapshot (PartType1) or, without one, in "
        "generated clustered initial conditions; write the catalogue as Gadget-4 does (DIR/"
        f"{CATALOGUE}: Header, Group/GroupLen, GroupMass, GroupPos, GroupVel, GroupOffsetType, IDs/ID; "
        "the same file at any number of processes and devices) and a halo mass function plot (PNG), "
        "and print a summary. The catalogue replaces the padded per-device halos.h5 of earlier "
        "versions (sx.io.write of the Catalogue).")
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
    add_world_options(parser, processes_help="run under `shardax launch -n N` (rank 0 prints, the last rank plots)")
    parser.add_argument("--per-rank", action="store_true",
                        help=f"one catalogue file per process (fof_tab_000.<rank>.hdf5, Gadget's multi-file layout) "
                             f"instead of one {CATALOGUE}")
    parser.add_argument("--redshift", type=float, default=None, metavar="Z",
                        help="Header/Redshift of the catalogue (default: the snapshot's, else 0)")
    parser.add_argument("--particle-mass", type=float, default=None, metavar="M",
                        help="mass of one particle in Msun/h: the mass function is then in Msun/h (default: from "
                             "the snapshot's MassTable and units if it has them, else in particles)")
    parser.add_argument("--length-unit", default=None, metavar="UNIT",
                        help="unit of the box side for the plot, e.g. Mpc/h (default: from the snapshot's "
                             "UnitLength_in_cm if it has it, else 'box units')")
    add_run_options(parser, out="halos_out", timeout=1800.0, timeout_help="with --processes: stop after S seconds",
                    plain="plain progress lines even on a terminal")
    return parser


def run_cli(argv: Sequence[str]) -> int:
    """``shardax halos ...``: returns 0 on success."""
    parser = halos_parser()
    ns = parser.parse_args(list(argv))
    for name in ("min_members", "particles"):
        value = getattr(ns, name)
        if value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if not (ns.linking_length > 0 and math.isfinite(ns.linking_length)):
        parser.error(f"--linking-length must be positive, got {ns.linking_length}")
    if not ns.box > 0:
        parser.error(f"--box must be positive, got {ns.box}")
    if ns.snapshot is not None and not os.path.exists(ns.snapshot):
        parser.error(f"snapshot {ns.snapshot} does not exist")
    if ns.particle_mass is not None and not (ns.particle_mass > 0 and math.isfinite(ns.particle_mass)):
        parser.error(f"--particle-mass must be positive (Msun/h), got {ns.particle_mass}")
    if ns.processes is not None and ENV_NUM_PROCESSES not in os.environ:
        from ..runtime import launch

        cache_environment(not ns.no_cache)  # this process only launches: no JAX here
        return launch(["-m", "shardax.cli", "halos", *_forward(ns)], num_processes=ns.processes,
                      cpu_devices=ns.cpu_devices, timeout_s=ns.timeout).returncode
    computing_here(parser)
    use_compilation_cache(not ns.no_cache)
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
    for flag, value in (("--redshift", ns.redshift), ("--particle-mass", ns.particle_mass),
                        ("--length-unit", ns.length_unit)):
        if value is not None:
            args += [flag, str(value) if isinstance(value, str) else repr(value)]
    return args + [flag for flag, on in (("--absolute", ns.absolute), ("--per-rank", ns.per_rank),
                                         ("--no-cache", ns.no_cache), ("--plain", ns.plain)) if on]


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


def _units(header: dict[str, Any], ns: argparse.Namespace, particle_mass: float | None) -> tuple[str, float | None]:
    """The box's length unit for the plot and one particle's mass in Msun/h (None: masses stay in particles), from
    the options, else the snapshot's unit attributes (Gadget's ``UnitLength_in_cm``, ``UnitMass_in_g``; Gadget's
    units carry the 1/h)."""
    length = ns.length_unit
    unit_cm = header.get("UnitLength_in_cm")
    if length is None and unit_cm is not None:
        for name, cm in (("Mpc/h", MPC_CM), ("kpc/h", MPC_CM / 1e3)):
            if abs(float(unit_cm) / cm - 1) < 1e-3:
                length = name
    if ns.particle_mass is not None:
        return length or "box units", ns.particle_mass
    unit_g = header.get("UnitMass_in_g")
    if particle_mass is not None and unit_g is not None:
        return length or "box units", particle_mass * float(unit_g) / MSUN_G
    return length or "box units", None


def _snapshot_extras(path: str) -> dict[str, Any]:
    """The whole ``PartType1/ParticleIDs`` (for the catalogue's IDs), the header and the unit attributes (Gadget-4
    keeps them in ``Parameters``), read on every process."""
    import h5py

    with h5py.File(path, "r") as handle:
        f: Any = handle
        attrs: dict[str, Any] = {}
        for group in ("Parameters", "Units", "Header"):
            if group in f:
                attrs.update({k: np.asarray(v)[()] for k, v in f[group].attrs.items()})
        ids = np.asarray(f["PartType1/ParticleIDs"][()]) if "PartType1/ParticleIDs" in f else None
    return {"header": attrs, "particle_ids": ids}


def halos(ns: argparse.Namespace) -> int:
    """The job behind ``shardax halos`` on every process of the run."""
    from .. import io as sxio
    from .._capacity import retry_capacity
    from ..particles import from_numpy
    from ..runtime import initialize
    from ..spatial import fof
    from ._plots import mass_function_plot, warm_up

    world = initialize(cpu_devices=ns.cpu_devices)
    settle_compilation_cache(world)
    me = world.process_id
    steps = Progress(4, show=me == 0, plain=ns.plain)
    steps.say(f"shardax halos: {world.num_processes} process(es) x {world.local_device_count} {world.platform} "
              f"device(s)")

    def load() -> tuple[Any, np.ndarray, int, str, dict[str, Any]]:
        if ns.snapshot is not None:
            snap = sxio.read_snapshot(ns.snapshot)
            return snap.part, snap.box, snap.total, f"snapshot {ns.snapshot}", _snapshot_extras(ns.snapshot)
        pos, vel = generate(ns.particles, ns.box, ns.seed)
        rows = np.array_split(np.arange(ns.particles), world.num_processes)[me]
        part = from_numpy(pos[rows], vel=vel[rows], mass=np.ones(len(rows), np.float32))
        return (part, np.full(3, ns.box), ns.particles, f"{ns.particles} generated particles (seed {ns.seed})",
                {"header": {}, "particle_ids": None})

    part, box, total, source, extras = steps.run("read particles", load)
    header = extras["header"]
    volume = float(np.prod(box))
    spacing = (volume / total) ** (1 / 3)
    ll = ns.linking_length if ns.absolute else ns.linking_length * spacing
    box_t = tuple(float(b) for b in box)
    # Buffers grown to what the data needs. FoF gives labels only: the catalogue file sums the groups on the host
    # (write_fof_table), and a program without the device catalogue compiles and runs faster.
    tuning = _clustered_tuning(world.platform)
    # The last process plots: it loads matplotlib while it waits for process 0 to compile FoF (on CPU, process 0
    # compiles for all of them), where process 0 itself would spend the time after FoF.
    plotter = world.num_processes - 1
    warming = threading.Thread(target=warm_up, name="shardax-plot-warm-up", daemon=True) \
        if me == plotter and plotter > 0 else None
    if warming is not None:
        warming.start()
    result = steps.run("friends-of-friends",
                       lambda: retry_capacity(fof.smap(), part, ll, box=box_t, min_members=ns.min_members,
                                              tuning=tuning, catalogue=False)[0],
                       doing=f"friends-of-friends on {world.device_count} device(s) (compiles on the first run)")
    os.makedirs(ns.out, exist_ok=True)
    cat_path = os.path.join(ns.out, CATALOGUE)
    redshift = ns.redshift if ns.redshift is not None else float(header.get("Redshift", 0.0))
    parameters = {"LinkingLength": ll, "LinkingLengthB": ll / spacing, "MinMembers": ns.min_members,
                  "Source": source}
    files = steps.run("write catalogue", lambda: sxio.write_fof_table(
        cat_path, result, part, box=box_t, redshift=redshift, particle_ids=extras["particle_ids"],
        parameters=parameters, per_rank=ns.per_rank))
    table = sxio.read_fof_table(cat_path)["Group"] if me in (0, plotter) else {}
    mass_table = np.asarray(header.get("MassTable", np.zeros(2))).reshape(-1)
    particle_mass = float(mass_table[1]) if ns.snapshot is not None and len(mass_table) > 1 and mass_table[1] > 0 \
        else None
    length_unit, msun_h = _units(header, ns, particle_mass)
    plot_path = os.path.join(ns.out, "mass_function.png")

    def plot() -> bool:
        plotted = False
        if me == plotter:
            if warming is not None:
                warming.join()
            sizes = table["GroupLen"].astype(np.float64)
            mass, unit = (sizes * msun_h, "$M_\\odot/h$") if msun_h is not None else (sizes, "particles")
            plotted = mass_function_plot(mass, volume, plot_path, f"FoF b={ll / spacing:.3g}, {len(sizes)} halos, "
                                         f"box side {box_t[0]:g} ({length_unit})", mass_unit=unit,
                                         length_unit=length_unit)
        if world.num_processes == 1:
            return plotted
        from jax.experimental import multihost_utils

        # Every process learns whether the plot was written (process 0 prints it); the others wait for it here.
        return bool(np.asarray(multihost_utils.process_allgather(np.int32(plotted))).reshape(-1)[-1])

    plotted = steps.run("mass function plot", plot)
    if me == 0:
        _summary(source, total, ll, spacing, ns, table, files, plot_path if plotted else None, steps.times)
    return 0


def _clustered_tuning(platform: str) -> Any:
    """FoF's tuning for the clustered particles halos are found in: on CPU, link cells of a quarter of the preset's
    volume (a table of 32 cells per point row instead of 8), so that the dense cells of halos hold fewer candidate
    pairs, and the points sorted into them by one comparison sort (``rank_rounds=0``: a smaller program than the
    counting sort's rounds, which compiles sooner and runs as fast with cells this small; figures: docs/fof.md,
    "shardax halos"); other backends, and a preset named by ``SHARDAX_TUNING``, keep the preset. Labels are the
    same with every tuning."""
    if platform != "cpu" or os.environ.get("SHARDAX_TUNING"):
        return None
    from ..spatial import FofTuning

    return FofTuning(per_cell=1 / 32, table=32.0, rank_rounds=0)


def _summary(source: str, total: int, ll: float, spacing: float, ns: argparse.Namespace, table: dict[str, np.ndarray],
             files: list[str], plot: str | None, times: dict[str, float]) -> None:
    sizes = table["GroupLen"]
    lines = [
        "",
        f"source            {source}",
        f"particles         {total}",
        f"linking length    {ll:.6g} (b = {ll / spacing:.3g} x mean spacing {spacing:.4g})",
        f"halos (>= {ns.min_members:d})     {len(sizes)}, holding {int(sizes.sum())} particles "
        f"({100 * sizes.sum() / max(total, 1):.1f}%)",
        f"catalogue         {', '.join(files)} (Gadget-4 layout, read with h5py: f['Group/GroupLen'], f['IDs/ID'])",
        f"mass function     {plot or 'not plotted (pip install matplotlib)'}",
        f"time              {sum(times.values()):.2f} s",
    ]
    order = np.argsort(-sizes, kind="stable")[:5]
    if len(order):
        lines.append("largest halos     group      count        mass   centre of mass")
        for i in order:
            com = " ".join(f"{c:.4f}" for c in table["GroupPos"][i])
            lines.append(f"                  {i:<10d} {sizes[i]:<10d} {table['GroupMass'][i]:<11.4g} {com}")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()

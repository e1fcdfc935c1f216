"""``shardax nbody``: a particle-mesh N-body simulation from Gaussian initial conditions to z = 0, with its snapshot,
power spectrum, halo catalogue and plots, on N local processes of M CPU devices (default 2 x 4).

Run it as ``shardax nbody ...`` or ``python -m shardax.cli nbody ...``. On its own it starts the run through the local
launcher (``shardax launch``) and shows process 0's progress; with ``--processes 1`` it computes in this process;
inside a run that another launcher started (``srun``, ``mpirun``, ``shardax launch``) it joins that run. The job
itself is :func:`shardax.cli._nbody_job.run_job`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from .._compile_cache import cache_environment, settle_compilation_cache, use_compilation_cache
from ..runtime import detect_launch as detect
from ._nbody_progress import ProgressPrinter, ProgressSink
from ._options import add_run_options, add_world_options, computing_here, job_parser

DEFAULT_PROCESSES = 2
DEFAULT_CPU_DEVICES = 4


def nbody_parser() -> argparse.ArgumentParser:
    parser = job_parser(
        "nbody",
        "Run a particle-mesh N-body simulation (Gaussian initial conditions from the linear power "
        "spectrum, 1LPT/2LPT, kick-drift-kick steps in the scale factor) from --z-start to z = 0 on N "
        "local processes of M CPU devices, then write a Gadget-4-style snapshot, the power spectrum "
        "against linear theory (CSV), the friends-of-friends halo catalogue and plots into --out.",
        epilog="Units: lengths in Mpc/h (comoving), k in h/Mpc, P(k) in (Mpc/h)^3, masses in Msun/h.")
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--particles", type=int, default=64, metavar="N",
                     help="particles per side, a power of two (N^3 particles; default 64)")
    sim.add_argument("--box", type=float, default=256.0, metavar="L", help="box side in Mpc/h (default 256)")
    sim.add_argument("--steps", type=int, default=10, metavar="S", help="kick-drift-kick steps (default 10)")
    sim.add_argument("--z-start", type=float, default=10.0, metavar="Z",
                     help="redshift of the initial conditions (default 10); the run ends at z = 0")
    sim.add_argument("--seed", type=int, default=0, help="seed of the white noise (default 0)")
    sim.add_argument("--order", type=int, default=2, choices=(1, 2),
                     help="Lagrangian perturbation theory order of the initial conditions (default 2)")
    sim.add_argument("--mesh-factor", type=int, default=1, metavar="F",
                     help="PM mesh cells per particle per side: an (F N)^3 mesh (default 1; 2 keeps large-scale "
                          "growth within 1%% of linear theory, with paint's window deconvolved, at 8x the mesh cells)")
    cosmo = parser.add_argument_group("cosmology (default: Planck 2015, as sx.nbody.Cosmology())")
    for flag, text in (("--omega-c", "cold dark matter density parameter Omega_c"),
                       ("--omega-b", "baryon density parameter Omega_b"),
                       ("--h", "Hubble parameter h = H0 / (100 km/s/Mpc)"),
                       ("--n-s", "spectral index n_s"),
                       ("--sigma8", "amplitude sigma_8 of the linear power at z = 0")):
        cosmo.add_argument(flag, type=float, default=None, metavar="X", help=text)
    run = parser.add_argument_group("run and output")
    add_world_options(run, processes=DEFAULT_PROCESSES, cpu_devices=DEFAULT_CPU_DEVICES,
                      processes_help="local processes, started by `shardax launch` (1 computes in this process)")
    run.add_argument("--linking-length", type=float, default=0.2, metavar="B",
                     help="FoF linking length in units of the mean inter-particle spacing (default 0.2)")
    run.add_argument("--min-members", type=int, default=20, metavar="K", help="smallest halo (default 20)")
    run.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    add_run_options(run, out="nbody_out", timeout=1800.0, plain="plain progress lines even if `rich` is installed")
    return parser


def check_options(parser: argparse.ArgumentParser, ns: argparse.Namespace, devices: int | None) -> None:
    """Exit with a usage error naming the flag for a value the job cannot take (``devices``: the run's total, when
    known)."""
    for flag, value in (("--steps", ns.steps), ("--mesh-factor", ns.mesh_factor), ("--min-members", ns.min_members)):
        if value < 1:
            parser.error(f"{flag} must be a positive integer, got {value}")
    n = ns.particles
    if n < 4 or n > 1024 or n & (n - 1):
        near = 1 << min(10, max(2, round(math.log2(max(n, 4)))))
        parser.error(f"--particles must be a power of two from 4 to 1024 (particles per side; IDs are int32), got "
                     f"{n}; try --particles {near}")
    if not (math.isfinite(ns.box) and ns.box > 0):
        parser.error(f"--box must be a positive length in Mpc/h, got {ns.box}")
    if not (math.isfinite(ns.z_start) and 0 < ns.z_start <= 999):
        parser.error(f"--z-start must be a redshift in (0, 999] (the run goes from it to z = 0), got {ns.z_start}")
    if not (math.isfinite(ns.linking_length) and 0 < ns.linking_length < 0.5 * n):
        parser.error(f"--linking-length must be positive and below half the box (in mean spacings: < {0.5 * n:g}), "
                     f"got {ns.linking_length}")
    for flag, value, low, high in (("--omega-c", ns.omega_c, 0.0, 1.0), ("--omega-b", ns.omega_b, 0.0, 1.0),
                                   ("--h", ns.h, 0.0, 10.0), ("--n-s", ns.n_s, 0.0, 10.0),
                                   ("--sigma8", ns.sigma8, 0.0, 10.0)):
        if value is not None and not (math.isfinite(value) and low < value < high):
            parser.error(f"{flag} must lie in ({low:g}, {high:g}), got {value}")
    cells = n * ns.mesh_factor
    if devices is not None and cells % devices:
        parser.error(f"the PM mesh ({cells}^3 = --particles x --mesh-factor per side) must divide over the {devices} "
                     f"devices of the run (slabs of the FFT): choose --particles or --mesh-factor so that "
                     f"{devices} divides {cells}, or fewer --processes/--cpu-devices")


def _forward(ns: argparse.Namespace) -> list[str]:
    """The arguments of every launched process (everything but ``--processes`` and ``--timeout``)."""
    args = ["--particles", str(ns.particles), "--box", repr(ns.box), "--steps", str(ns.steps), "--z-start",
            repr(ns.z_start), "--seed", str(ns.seed), "--order", str(ns.order), "--mesh-factor",
            str(ns.mesh_factor), "--linking-length", repr(ns.linking_length), "--min-members",
            str(ns.min_members), "--out", ns.out, "--cpu-devices", str(ns.cpu_devices)]
    for flag in ("omega_c", "omega_b", "h", "n_s", "sigma8"):
        value = getattr(ns, flag)
        if value is not None:
            args += [f"--{flag.replace('_', '-')}", repr(value)]
    return args + [flag for flag, on in (("--no-plots", ns.no_plots), ("--no-cache", ns.no_cache), ("--plain", True))
                   if on]


def run_cli(argv: Sequence[str]) -> int:
    """``shardax nbody ...``: returns 0 on success."""
    parser = nbody_parser()
    ns = parser.parse_args(list(argv))
    launched = detect()
    if launched.source != "single":
        # One process of a run that a launcher started: the world is the launcher's (--processes does not apply).
        check_options(parser, ns, None)
        computing_here(parser)
        use_compilation_cache(not ns.no_cache)
        return _run_here(ns, cpu_devices=None)
    processes = ns.processes or DEFAULT_PROCESSES
    ns.cpu_devices = ns.cpu_devices or DEFAULT_CPU_DEVICES
    check_options(parser, ns, processes * ns.cpu_devices)
    if processes == 1:
        computing_here(parser)
        use_compilation_cache(not ns.no_cache)
        return _run_here(ns, cpu_devices=ns.cpu_devices)
    from ..runtime import launch

    cache_environment(not ns.no_cache)  # this process only launches: no JAX here
    printer = ProgressPrinter(plain=ns.plain)
    printer.line(f"shardax nbody: starting {processes} processes x {ns.cpu_devices} CPU devices")
    sink = ProgressSink(printer)
    result = launch(["-m", "shardax.cli", "nbody", *_forward(ns)], num_processes=processes,
                    cpu_devices=ns.cpu_devices, timeout_s=ns.timeout, sink=sink)
    printer.close()
    return result.returncode


def _run_here(ns: argparse.Namespace, *, cpu_devices: int | None) -> int:
    from ..runtime import initialize
    from ._nbody_job import options_from_namespace, run_job

    try:
        settle_compilation_cache(initialize(cpu_devices=cpu_devices))
        run_job(options_from_namespace(ns), plain=ns.plain)
    except (ValueError, OSError) as err:
        sys.stderr.write(f"shardax nbody: {err}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:]))

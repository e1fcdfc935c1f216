"""One process of ``shardax demo``: join the run, run every stage with a progress line per stage (process 0), keep
the report up to date after each stage, write the plots.

``shardax demo`` starts this module in every process it launches (``python -m shardax.cli._demo_body``); under
another launcher (``srun``, ``mpirun``, ``shardax launch``) ``shardax demo`` runs :func:`run_demo` in place and
process 0 prints the table itself.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from ._demo_table import REPORT_NAME, Report, Row, exit_code, print_report, write_report


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def run_demo(ns: argparse.Namespace, *, print_table: bool) -> int:
    """Run every stage on this process with the sizes of ``ns`` (``particles``, ``matrix``, ``grid``, ``seed``,
    ``cpu_devices``, ``out``, ``plain``, ``no_cache``).

    Returns:
        On process 0: 0 if every check passed, else 1. On the other processes: 0 (process 0 holds the verdict).
    """
    from .._compile_cache import settle_compilation_cache, use_compilation_cache
    from .._errors import DistributedSetupError
    from ..runtime import initialize
    from ._demo_plots import write_plots
    from ._demo_stages import COMPILES, STAGES, Context, Sizes
    from ._progress import watch_compiles

    use_compilation_cache(not getattr(ns, "no_cache", False))
    try:
        world = initialize(cpu_devices=ns.cpu_devices)
        settle_compilation_cache(world)
    except DistributedSetupError as err:
        sys.stderr.write(f"shardax demo: {err}\n")
        return 1
    lead = world.process_id == 0
    where = (f"{world.device_count} {world.platform} device(s) ({world.num_processes} process(es) x "
             f"{world.local_device_count})")
    report_path = os.path.join(ns.out, REPORT_NAME)
    if lead:
        os.makedirs(ns.out, exist_ok=True)
        _say(f"shardax demo: {where}, {ns.particles} particles, matrices N={ns.matrix}, grids {ns.grid}^3")
    sizes = Sizes(particles=ns.particles, matrix=ns.matrix, grid=ns.grid, seed=ns.seed)
    ctx = Context(world, sizes, ns.cpu_devices)
    report = Report(where, ())
    for index, (name, stage) in enumerate(STAGES, 1):
        if lead:
            compiles = COMPILES.get(name)
            doing = f" compiling {compiles} for {world.device_count} device(s) (first run only)" if compiles else ""
            _say(f"[{index}/{len(STAGES)}] {name} ...{doing}")
        try:
            with watch_compiles() as count:
                outcome = stage(ctx)
        except Exception as err:  # a stage that raises is a failed row; the demo goes on to the next one
            row = Row(name, "-", math.nan, math.nan, "-", False, (f"{type(err).__name__}: {err}".splitlines()[0],))
        else:
            row = Row(name, outcome.scale, outcome.first_s, outcome.warm_s, outcome.reference, not outcome.failures,
                      outcome.failures)
        report = Report(where, (*report.rows, row))
        if lead:
            timing = "" if math.isnan(row.first_s) else \
                f": first call {row.first_s:.2f} s ({count.describe()}), warm {row.warm_s:.3f} s"
            _say(f"      {'PASS' if row.ok else 'FAIL'}{timing}" + "".join(f"\n      {f}" for f in row.failures))
            write_report(report_path, report)
    if not lead:
        return 0
    plots, notes = write_plots(ctx.plot_data, ctx.pos, sizes.box, ns.out)
    report = Report(where, report.rows, tuple(plots), tuple(notes))
    write_report(report_path, report)
    if print_table:
        print_report(report, plain=ns.plain)
    return exit_code(report, [name for name, _ in STAGES])


def body_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardax.cli._demo_body",
                                     description="one process of `shardax demo` (started by it)")
    parser.add_argument("--particles", type=int, required=True)
    parser.add_argument("--matrix", type=int, required=True)
    parser.add_argument("--grid", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--cpu-devices", type=int, default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--no-cache", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of each launched process; the launching ``shardax demo`` prints the table from the report."""
    ns = body_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return run_demo(ns, print_table=False)


if __name__ == "__main__":
    sys.exit(main())

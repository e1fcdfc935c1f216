"""``shardax demo``: every capability on an embedded default run (2 processes x 4 CPU devices), each checked against
a NumPy/SciPy reference, with a table, plots and an exit code that says whether every check passed.

Run it as ``shardax demo ...`` or ``python -m shardax.cli demo ...``. On its own it starts the run through the local
launcher (``shardax launch``) and prints process 0's progress, then the table; inside a run that another launcher
started (``srun``, ``mpirun``, ``shardax launch``) it joins that run instead and process 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence

from .._compile_cache import cache_environment, use_compilation_cache
from ..runtime import ConsoleSink, Stream, launch
from ..runtime import detect_launch as detect
from ._demo_table import REPORT_NAME, Report, exit_code, print_report, read_report
from ._options import add_run_options, add_world_options, computing_here, job_parser

DEFAULT_PROCESSES = 2
DEFAULT_CPU_DEVICES = 4


def demo_parser() -> argparse.ArgumentParser:
    parser = job_parser("demo", "Run every shardax capability (runtime and collectives self-test, zsort, kNN density, "
                                "friends-of-friends + catalogue, potrs, syevd, fftn, paint + power spectrum) on N "
                                "local processes of M CPU devices, check each against a NumPy/SciPy reference, print "
                                "a table and write plots. The exit code is non-zero if any check fails.")
    add_world_options(parser, processes=DEFAULT_PROCESSES, cpu_devices=DEFAULT_CPU_DEVICES)
    parser.add_argument("--particles", type=int, default=30_000, metavar="P",
                        help="particles for zsort, kNN, FoF and the power spectrum (default 30000)")
    parser.add_argument("--matrix", type=int, default=256, metavar="N",
                        help="matrix size of potrs and syevd (default 256)")
    parser.add_argument("--grid", type=int, default=64, metavar="G",
                        help="FFT and density grid size G^3; G must be divisible by N x M (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every generated input (default 0)")
    parser.add_argument("--out", default="demo_out", metavar="DIR",
                        help="folder for the plots and demo_report.json (default demo_out)")
    add_run_options(parser, out=None, timeout=900.0)
    return parser


def _check(parser: argparse.ArgumentParser, ns: argparse.Namespace, devices: int | None) -> None:
    """Exit with a usage error naming the flag for a value the run cannot take (``devices``: the run's total, when
    known)."""
    for flag, value, least in (("--particles", ns.particles, 1000), ("--matrix", ns.matrix, 16),
                               ("--grid", ns.grid, 8)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if devices is not None and ns.grid % devices:
        fit = ((ns.grid // devices) + 1) * devices
        parser.error(f"--grid {ns.grid} must be divisible by the {devices} devices of the run (slabs of the FFT); "
                     f"try --grid {fit}")


def _noise(text: str) -> bool:
    """Whether ``text`` is a line of XLA's "Very slow compile?" banner (the kernels take tens of seconds to compile on
    CPU, which XLA logs as an error although nothing is wrong) or a blank line; :func:`shardax.runtime.launch`
    already leaves out gloo's connection reports."""
    stripped = text.strip()
    return (not stripped or set(stripped) == {"*"} or "slow_operation_alarm" in stripped
            or "Very slow compile?" in stripped)


class _ProgressSink:
    """Process 0's standard output as it is (its progress lines), everything else labelled by rank as ``shardax
    launch`` prints it, except the runtime's chatter (:func:`_noise`): slow-compile banners are only counted."""

    def __init__(self) -> None:
        self._labelled = ConsoleSink()
        self._lock = threading.Lock()
        self.slow_compiles = 0

    def line(self, label: str, stream: Stream, text: str) -> None:
        if _noise(text):
            with self._lock:
                self.slow_compiles += "Very slow compile?" in text
        elif label == "0" and stream == "stdout":
            with self._lock:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
        else:
            self._labelled.line(label, stream, text)

    def message(self, text: str) -> None:
        self._labelled.message(text)


def _forward(ns: argparse.Namespace) -> list[str]:
    """The arguments of every launched process."""
    args = ["--particles", str(ns.particles), "--matrix", str(ns.matrix), "--grid", str(ns.grid), "--seed",
            str(ns.seed), "--cpu-devices", str(ns.cpu_devices), "--out", ns.out]
    return args + [flag for flag, on in (("--plain", ns.plain), ("--no-cache", ns.no_cache)) if on]


def run_cli(argv: Sequence[str]) -> int:
    """``shardax demo ...``: returns 0 if every capability ran and passed its check."""
    parser = demo_parser()
    ns = parser.parse_args(list(argv))
    launched = detect()
    if launched.source != "single":
        # Already one process of a run: the world is the launcher's (--processes does not apply).
        _check(parser, ns, None)
        computing_here(parser)
        use_compilation_cache(not ns.no_cache)
        ns.cpu_devices = ns.cpu_devices or launched.cpu_devices
        from ._demo_body import run_demo

        return run_demo(ns, print_table=True)
    ns.processes = ns.processes or DEFAULT_PROCESSES
    ns.cpu_devices = ns.cpu_devices or DEFAULT_CPU_DEVICES
    _check(parser, ns, ns.processes * ns.cpu_devices)
    cache_environment(not ns.no_cache)  # for the launched processes; this one only launches them: no JAX here
    report_path = os.path.join(ns.out, REPORT_NAME)
    os.makedirs(ns.out, exist_ok=True)
    if os.path.exists(report_path):
        os.remove(report_path)
    start = time.perf_counter()
    sink = _ProgressSink()
    result = launch(["-m", "shardax.cli._demo_body", *_forward(ns)], num_processes=ns.processes,
                    cpu_devices=ns.cpu_devices, timeout_s=ns.timeout, sink=sink)
    wall = time.perf_counter() - start
    report = read_report(report_path) or Report(f"{ns.processes} process(es) x {ns.cpu_devices} CPU devices", ())
    report = report.with_missing()
    print_report(report, plain=ns.plain)
    lines = [f"wall time {wall:.1f} s (start-up, compilation and checks included)"]
    if sink.slow_compiles:
        lines.append(f"XLA logged {sink.slow_compiles} 'Very slow compile?' banners (not shown): the kernels are "
                     "large programs that take tens of seconds to compile on CPU")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    return result.returncode or exit_code(report)


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:]))

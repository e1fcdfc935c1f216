"""``shardax launch``: the command line of :func:`shardax.runtime.launch` (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from .. import runtime
from ._options import positive_int, positive_seconds


def launch(target: str | os.PathLike[str] | Sequence[str], /, *args: str, num_processes: int,
           cpu_devices: int | None = None, timeout_s: float | None = None,
           env: Mapping[str, str] | None = None, verbose: bool = False) -> int:
    """``shardax launch`` from Python: :func:`shardax.runtime.launch`, printing, and the exit code returned.

    Example:
        >>> from shardax.cli import launch
        >>> launch(["-m", "shardax.cli", "doctor"], num_processes=2, cpu_devices=4)  # doctest: +SKIP
        0
    """
    return runtime.launch(target, *args, num_processes=num_processes, cpu_devices=cpu_devices,
                          timeout_s=timeout_s, env=env, verbose=verbose).returncode


# Options of `shardax launch` that take a value; the first other token starts the target's command line.
_VALUE_OPTIONS = ("-n", "--num-processes", "--cpu-devices", "--timeout")


def _split_target(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launcher options, target argv)``: the target starts at the first non-option token or at ``-m``."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "-m" or not token.startswith("-") or token == "-":
            return list(argv[:i]), list(argv[i:])
        if token == "--":
            return list(argv[:i]), list(argv[i + 1:])
        i += 2 if token in _VALUE_OPTIONS else 1
    return list(argv), []


def launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardax launch",
        usage="shardax launch -n N [--cpu-devices M] [--timeout S] [--verbose] (script.py | -m module) [args ...]",
        description="Run a Python script or module in N local processes that find each other through "
                    "sx.initialize(). Each rank's stdout and stderr lines are printed whole, on their own stream, "
                    "prefixed with the rank ([1] ...); the first failing rank stops the others, its error is "
                    "repeated at the end, and its exit code is the launcher's.")
    parser.add_argument("-n", "--num-processes", type=positive_int, required=True, metavar="N",
                        help="number of processes (ranks)")
    parser.add_argument("--cpu-devices", type=positive_int, default=None, metavar="M",
                        help="CPU devices per process (sets SHARDAX_CPU_DEVICES and JAX_NUM_CPU_DEVICES)")
    parser.add_argument("--timeout", type=positive_seconds, default=None, metavar="S",
                        help="stop the run after S seconds (exit code 124)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print the libraries' connection chatter ([Gloo] Rank 0 is connected to ...)")
    return parser


def run_cli(argv: Sequence[str]) -> int:
    """``shardax launch ...``: parse ``argv`` (the arguments after ``launch``) and run; returns the exit code."""
    parser = launch_parser()
    options, target = _split_target(argv)
    ns = parser.parse_args(options)
    if not target:
        parser.error("missing the script to run (script.py or -m module)")
    try:
        result = runtime.launch(target, num_processes=ns.num_processes, cpu_devices=ns.cpu_devices,
                                timeout_s=ns.timeout, verbose=ns.verbose)
    except ValueError as err:  # a missing script, a bad '-m' or a bad SHARDAX_MALLOC, raised before anything starts
        parser.error(str(err))
    return result.returncode

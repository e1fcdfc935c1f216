"""The ``shardax`` command: a small registry of subcommands, each parsing its own arguments."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

from .._version import __version__
from ._bench import run_cli as _bench_cli
from ._demo import run_cli as _demo_cli
from ._doctor import run_cli as _doctor_cli
from ._halos import run_cli as _halos_cli
from ._launch import run_cli as _launch_cli
from ._nbody import run_cli as _nbody_cli
from ._options import set_restart


@dataclasses.dataclass(frozen=True)
class Subcommand:
    """A ``shardax NAME ...`` subcommand.

    Attributes:
        name: the word after ``shardax``.
        help: one line for ``shardax --help``.
        run: called with the arguments after ``name``; returns the exit code.
    """

    name: str
    help: str
    run: Callable[[Sequence[str]], int]


SUBCOMMANDS: dict[str, Subcommand] = {
    cmd.name: cmd
    for cmd in (
        Subcommand("launch", "run a script or module in N local processes (rank-tagged output)", _launch_cli),
        Subcommand("doctor", "versions, devices, world and a collective self-test with bandwidth", _doctor_cli),
        Subcommand("demo", "every capability on 2 processes x 4 CPU devices, checked: table and plots", _demo_cli),
        Subcommand("halos", "friends-of-friends halo catalogue (HDF5) and mass function from a snapshot or ICs",
                   _halos_cli),
        Subcommand("nbody", "particle-mesh N-body from Gaussian ICs to z = 0: Gadget snapshot, P(k), halos, plots",
                   _nbody_cli),
        Subcommand("bench", "the benchmark suite: each kernel side by side with its anchor, ratios, JSON, plots",
                   _bench_cli),
    )
}


def _parser() -> argparse.ArgumentParser:
    width = max(len(name) for name in SUBCOMMANDS)
    listing = "\n".join(f"  {c.name:<{width}}  {c.help}" for c in SUBCOMMANDS.values())
    parser = argparse.ArgumentParser(
        prog="shardax", usage="shardax [--version] COMMAND [args ...]",
        description="HPC for JAX: launch and check multi-process runs.",
        epilog=f"commands:\n{listing}\n\n'shardax COMMAND --help' describes a command.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardax {__version__}")
    parser.add_argument("command", metavar="COMMAND", help="one of: " + ", ".join(SUBCOMMANDS))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardax`` console script.

    Run as the console script (``argv`` left ``None``), a job (``halos``, ``demo``, ``nbody``) about to compute in
    this process restarts it once with glibc's allocator set up for XLA:CPU (:func:`shardax.runtime.malloc_env`;
    ``SHARDAX_MALLOC=system`` keeps the defaults); one that starts processes (``--processes``) starts them so.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit code.

    Example:
        >>> from shardax.cli import main
        >>> main(["launch", "-n", "2", "script.py"])  # doctest: +SKIP
        0
    """
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args or args[0].startswith("-"):
        parser.parse_args(args or ["--help"])
        return 2
    name, rest = args[0], args[1:]
    command = SUBCOMMANDS.get(name)
    if command is None:
        parser.error(f"unknown command {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    set_restart(["-m", "shardax.cli", *args] if argv is None else None)
    return command.run(rest)

"""The ``shardax`` command: a small registry of subcommands, each parsing its own arguments."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable, Sequence

from .._version import __version__
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


def _run_cli(module: str) -> Callable[[Sequence[str]], int]:
    """The ``run_cli`` of ``shardax.cli.<module>``, imported when the subcommand runs: ``shardax launch`` and the jobs
    that start processes import no JAX before they start them."""

    def run(argv: Sequence[str]) -> int:
        return importlib.import_module(f"{__package__}.{module}").run_cli(argv)

    run.__name__ = run.__qualname__ = f"{module.lstrip('_')}_cli"
    return run


SUBCOMMANDS: dict[str, Subcommand] = {
    cmd.name: cmd
    for cmd in (
        Subcommand("launch", "run a script or module in N local processes (rank-tagged output)", _run_cli("_launch")),
        Subcommand("doctor", "versions, devices, world and a collective self-test with bandwidth", _run_cli("_doctor")),
        Subcommand("demo", "every capability on 2 processes x 4 CPU devices, checked: table and plots",
                   _run_cli("_demo")),
        Subcommand("halos", "friends-of-friends halo catalogue (HDF5) and mass function from a snapshot or ICs",
                   _run_cli("_halos")),
        Subcommand("nbody", "particle-mesh N-body from Gaussian ICs to z = 0: Gadget snapshot, P(k), halos, plots",
                   _run_cli("_nbody")),
        Subcommand("bench", "the benchmark suite: each kernel side by side with its anchor, ratios, JSON, plots",
                   _run_cli("_bench")),
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
    ``SHARDAX_MALLOC=system`` keeps the defaults); one that starts processes (``--processes``) starts them so. A
    process that ran JAX then ends as soon as its exit handlers have run (:func:`_end_process`).

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
    code = command.run(rest)
    if argv is None:
        _end_process(code)
    return code


def _end_process(code: int) -> None:
    """End this process (the console script, or ``python -m shardax.cli``) with ``code`` once the exit handlers have
    run, where it ran JAX: tearing the interpreter down then frees XLA's client, its device threads and every
    module one by one, about 0.3 s per process that nobody waits for (each process of a launched job spends it, and
    the launcher waits for the last). Output is flushed and the exit handlers run as in a normal exit (JAX's
    distributed shutdown among them); no thread of a job outlives its command."""
    if "jax" not in sys.modules:
        return
    import atexit
    import os

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    flush()
    atexit._run_exitfuncs()
    flush()  # what the exit handlers wrote
    os._exit(code if isinstance(code, int) else 1)

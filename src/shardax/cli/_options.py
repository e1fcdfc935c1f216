"""The command-line options the jobs share (``demo``, ``nbody``, ``halos``, ``bench``, ``doctor``, ``launch``): one
spelling, one help text and one check each for where a job runs (``--processes``, ``--cpu-devices``), how long it may
take (``--timeout``), where it writes (``--out``), the compilation cache (``--no-cache``) and plain output
(``--plain``).

Bad values are refused while the arguments are parsed, with argparse's usage error naming the flag
(``argument --processes: must be a positive integer, got 0``).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from .._compile_cache import cache_help

# Where the job's own processes come from, for the help of --processes.
_LAUNCHED = "local processes, started by `shardax launch`"
# How to start this process again (``python -m shardax.cli ...``), when it was started as the ``shardax`` console
# script; set by ``shardax.cli.main``.
_restart: list[str] | None = None


def set_restart(argv: list[str] | None) -> None:
    """Remember how :func:`computing_here` may restart this process (``None``: it may not)."""
    global _restart
    _restart = argv


def computing_here(parser: argparse.ArgumentParser) -> None:
    """Called by a job right before it computes in this process: when the process is the ``shardax`` console script,
    it restarts once with glibc's allocator set up for XLA:CPU (:func:`shardax.runtime.restart_with_malloc_env`;
    ``SHARDAX_MALLOC=system`` keeps the defaults). A job that only starts processes does not call it: they start
    with those settings, and this process is spared a second start."""
    from ..runtime import restart_with_malloc_env

    if _restart is None:
        return
    try:
        restart_with_malloc_env(_restart)
    except ValueError as err:  # a bad SHARDAX_MALLOC
        parser.error(str(err))


def positive_int(text: str) -> int:
    """An ``argparse`` type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_seconds(text: str) -> float:
    """An ``argparse`` type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def job_parser(command: str, description: str, *, epilog: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``shardax COMMAND``."""
    return argparse.ArgumentParser(prog=f"shardax {command}", description=description, epilog=epilog)


def add_world_options(parser: Any, *, processes: int | None = None, cpu_devices: int | None = None,
                      processes_help: str | None = None) -> None:
    """``--processes N`` and ``--cpu-devices M`` on ``parser`` (or an argument group); both parse to ``None`` when not
    given, and ``processes``/``cpu_devices`` are the defaults the help states (the job applies them)."""
    default = "" if processes is None else f" (default {processes})"
    parser.add_argument("--processes", type=positive_int, default=None, metavar="N",
                        help=(processes_help or _LAUNCHED) + default)
    devices = "" if cpu_devices is None else f" (default {cpu_devices}; inside a run started by another launcher, " \
                                             f"that launcher's setting)"
    parser.add_argument("--cpu-devices", type=positive_int, default=None, metavar="M",
                        help="CPU devices per process" + devices)


def add_run_options(parser: Any, *, out: str | None, timeout: float, timeout_help: str = "stop the run after S seconds",
                    cache: str | bool = True, plain: str = "plain text even if `rich` is installed") -> None:
    """``--out DIR`` (unless ``out`` is None), ``--timeout S``, ``--no-cache`` (``cache``: its help, ``True`` for the
    compilation cache's, ``False`` for no such flag) and ``--plain`` on ``parser`` (or an argument group)."""
    if out is not None:
        parser.add_argument("--out", default=out, metavar="DIR", help=f"output directory (default {out})")
    parser.add_argument("--timeout", type=positive_seconds, default=timeout, metavar="S",
                        help=f"{timeout_help} (default {timeout:g})")
    if cache:
        parser.add_argument("--no-cache", action="store_true", help=cache_help() if cache is True else cache)
    parser.add_argument("--plain", action="store_true", help=plain)

"""``shardax launch``: N local processes of one script or module, wired together for :func:`shardax.initialize`."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Mapping, Sequence

from ..runtime._env import ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from ..runtime._malloc import malloc_env
from ._procs import ConsoleSink, JobResult, ProcessSpec, Sink, run_job

# Variables of an enclosing run that must not leak into the children of a new one.
_INHERITED_RUN_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_CPU_DEVICES, "SHARDAX_INITIALIZED")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(base: Mapping[str, str], *, process_id: int, num_processes: int, coordinator: str,
              cpu_devices: int | None) -> dict[str, str]:
    """The environment of one launched process: ``base`` plus what :func:`shardax.initialize` reads, and glibc's
    allocator set up for XLA:CPU (``shardax.runtime._malloc``; not when ``base`` has ``SHARDAX_MALLOC=system`` or sets
    glibc's ``MALLOC_*`` variables itself)."""
    env = {k: v for k, v in base.items() if k not in _INHERITED_RUN_VARS}
    env.update(malloc_env(env))
    env.update({ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
                ENV_PROCESS_ID: str(process_id), "PYTHONUNBUFFERED": "1"})
    if cpu_devices is not None:
        env[ENV_CPU_DEVICES] = str(cpu_devices)
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
    return env


def target_argv(target: str | os.PathLike[str] | Sequence[str], args: Sequence[str] = ()) -> list[str]:
    """The Python command line after ``sys.executable``: ``[script, *args]`` or ``["-m", module, *args]``.

    ``target`` is a script path, or an argument list that starts with a script path or with ``"-m", module``.
    """
    if isinstance(target, str | os.PathLike):
        parts = [os.fspath(target)]
    elif isinstance(target, Sequence) and all(isinstance(a, str) for a in target):
        parts = list(target)
    else:
        raise TypeError("target must be a script path or a list of str (script and arguments, or '-m', module "
                        f"and arguments), got {target!r}")
    parts += [str(a) for a in args]
    if not parts:
        raise ValueError("target is empty: give a script path, or ['-m', 'module', ...]")
    if parts[0] == "-m":
        if len(parts) < 2 or not parts[1] or parts[1].startswith("-"):
            raise ValueError(f"'-m' must be followed by a module name, got {parts[1:2]}")
        return parts
    if parts[0].startswith("-"):
        raise ValueError(f"target must start with a script path or '-m', got option {parts[0]!r}")
    if not os.path.isfile(parts[0]):
        raise ValueError(f"script {parts[0]!r} does not exist (or is not a file); give a path to a Python script "
                         "or use '-m module'")
    return parts


def check_counts(num_processes: object, cpu_devices: object, timeout_s: object) -> None:
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if cpu_devices is not None and (isinstance(cpu_devices, bool) or not isinstance(cpu_devices, int)
                                    or cpu_devices < 1):
        raise ValueError(f"cpu_devices must be a positive int or None, got {cpu_devices!r}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float)
                                  or not timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")


def launch_specs(argv: Sequence[str], *, num_processes: int, cpu_devices: int | None,
                 env: Mapping[str, str] | None = None) -> list[ProcessSpec]:
    """One :class:`ProcessSpec` per rank for ``python argv...``, with a fresh coordinator port on 127.0.0.1."""
    base = os.environ if env is None else env
    coordinator = f"127.0.0.1:{free_port()}"
    return [ProcessSpec([sys.executable, *argv],
                        child_env(base, process_id=r, num_processes=num_processes, coordinator=coordinator,
                                  cpu_devices=cpu_devices),
                        label=str(r), name=f"rank {r}")
            for r in range(num_processes)]


def launch_job(target: str | os.PathLike[str] | Sequence[str], args: Sequence[str] = (), *, num_processes: int,
               cpu_devices: int | None = None, timeout_s: float | None = None, sink: Sink,
               env: Mapping[str, str] | None = None) -> JobResult:
    """:func:`launch` with the output going to ``sink`` and the full :class:`JobResult` returned."""
    check_counts(num_processes, cpu_devices, timeout_s)
    argv = target_argv(target, args)
    specs = launch_specs(argv, num_processes=num_processes, cpu_devices=cpu_devices, env=env)
    return run_job(specs, sink=sink, timeout_s=timeout_s)


def launch(target: str | os.PathLike[str] | Sequence[str], /, *args: str, num_processes: int,
           cpu_devices: int | None = None, timeout_s: float | None = None,
           env: Mapping[str, str] | None = None) -> int:
    """Run a Python script or module in ``num_processes`` local processes, as ``shardax launch`` does.

    Every process gets the variables :func:`shardax.initialize` reads (``SHARDAX_COORDINATOR_ADDRESS`` on
    127.0.0.1 and a free port, ``SHARDAX_NUM_PROCESSES``, ``SHARDAX_PROCESS_ID``, ``SHARDAX_CPU_DEVICES``) plus
    ``JAX_NUM_CPU_DEVICES`` and ``PYTHONUNBUFFERED=1``, so the script just calls ``sx.initialize()``. Output lines
    go to this process's stdout/stderr prefixed with the rank (``[0] ...``). The first rank to fail ends the run:
    the others get SIGTERM, then SIGKILL after 3 s, and the reason is printed to stderr.

    Args:
        target: a script path, or an argument list: ``["script.py", *args]`` or ``["-m", "module", *args]``.
        *args: more arguments for the script.
        num_processes: number of processes (ranks).
        cpu_devices: CPU devices per process (``None``: JAX's default, or an inherited ``JAX_NUM_CPU_DEVICES``).
        timeout_s: end the run after this many seconds (exit code 124); ``None`` waits forever.
        env: the base environment of the children (default: this process's).

    Returns:
        0 on success; the first failing rank's exit code (``128 + K`` if it was killed by signal ``K``); 124 on
        timeout; ``128 + K`` if this process received signal ``K`` (forwarded to every rank).

    Raises:
        ValueError: a missing script, an empty target or non-positive counts.

    Example:
        >>> from shardax.cli import launch
        >>> launch(["-m", "shardax.cli", "doctor"], num_processes=2, cpu_devices=4)  # doctest: +SKIP
        0
    """
    return launch_job(target, args, num_processes=num_processes, cpu_devices=cpu_devices, timeout_s=timeout_s,
                      sink=ConsoleSink(), env=env).returncode


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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardax launch",
        usage="shardax launch -n N [--cpu-devices M] [--timeout S] (script.py | -m module) [args ...]",
        description="Run a Python script or module in N local processes that find each other through "
                    "sx.initialize(). Output lines are prefixed with the rank; the first failing rank stops the "
                    "others and sets the exit code.")
    parser.add_argument("-n", "--num-processes", type=_positive_int, required=True, metavar="N",
                        help="number of processes (ranks)")
    parser.add_argument("--cpu-devices", type=_positive_int, default=None, metavar="M",
                        help="CPU devices per process (sets SHARDAX_CPU_DEVICES and JAX_NUM_CPU_DEVICES)")
    parser.add_argument("--timeout", type=_positive_float, default=None, metavar="S",
                        help="stop the run after S seconds (exit code 124)")
    return parser


def run_cli(argv: Sequence[str]) -> int:
    """``shardax launch ...``: parse ``argv`` (the arguments after ``launch``) and run; returns the exit code."""
    parser = launch_parser()
    options, target = _split_target(argv)
    ns = parser.parse_args(options)
    if not target:
        parser.error("missing the script to run (script.py or -m module)")
    try:
        argv_ = target_argv(target)
        malloc_env(os.environ)  # a bad SHARDAX_MALLOC, before anything starts
    except ValueError as err:
        parser.error(str(err))
    return launch(argv_, num_processes=ns.num_processes, cpu_devices=ns.cpu_devices, timeout_s=ns.timeout)

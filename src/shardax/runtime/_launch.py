"""Start N local processes of one Python program wired together for :func:`shardax.initialize`: :func:`launch`.

The library API under ``shardax launch`` and :mod:`shardax.testing`: the environment of each process (the contract
of :mod:`._env`, plus glibc's allocator set up for XLA:CPU), the process specs of a launch or of Open MPI's
``mpirun``, and :func:`launch` itself, which runs them through :func:`run_processes`.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import sys
from collections.abc import Mapping, Sequence

from ._env import ENV_CPU_DEVICES, ENV_JAX_CPU_DEVICES, RUN_VARS, cpu_device_vars, launcher_vars
from ._malloc import MALLOC_ENV, malloc_env
from ._procs import JobResult, ProcessSpec, Sink, run_processes


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` and on every address (JAX's coordinator listens on all of
    them, ``[::]``), picked at random below the kernel's ephemeral port range.

    A port the OS hands out for ``bind(0)`` comes from the ephemeral range, where every outgoing connection (gloo
    opens dozens per run) and every other launch's pick also come from: on a busy machine another process took it
    before the coordinator bound it ("Failed to start RPC server"). Below that range only programs that ask for a
    port by number compete, and the pick is checked on the wildcard address. Falls back to ``bind(0)`` if no port
    there is free."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 16384), low)
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's range for ``bind(0)`` and outgoing connections (Linux; IANA's 49152
    elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` and on the wildcard address (IPv6 dual-stack where there is one)."""
    candidates: list[tuple[socket.AddressFamily, str]] = [(socket.AF_INET, host), (socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        candidates.append((socket.AF_INET6, "::"))
    for family, address in candidates:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind((address, port))
        except OSError as err:
            if family == socket.AF_INET6 and err.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue  # no IPv6 on this machine: the IPv4 checks decide
            return False
    return True


def _check_count(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")


def process_env(base: Mapping[str, str] | None = None, *, cpu_devices: int | None = None) -> dict[str, str]:
    """The environment of a process that shardax starts, before its place in a run is added.

    ``base`` (default: this process's environment) without the variables of an enclosing run
    (:data:`shardax.runtime.RUN_VARS`), with ``PYTHONUNBUFFERED=1`` (lines arrive as they are printed), glibc's
    allocator set up for XLA:CPU (unless ``base`` has ``SHARDAX_MALLOC=system`` or sets glibc's ``MALLOC_*``
    variables itself) and, with ``cpu_devices``, ``SHARDAX_CPU_DEVICES`` and ``JAX_NUM_CPU_DEVICES``.

    Raises:
        ValueError: a bad ``SHARDAX_MALLOC`` in ``base``, or ``cpu_devices`` not a positive int.

    Example:
        >>> import shardax as sx
        >>> env = sx.runtime.process_env({"SHARDAX_PROCESS_ID": "3", "HOME": "/root"}, cpu_devices=4)
        >>> env["JAX_NUM_CPU_DEVICES"], "SHARDAX_PROCESS_ID" in env
        ('4', False)
    """
    _check_count("cpu_devices", cpu_devices, optional=True)
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in RUN_VARS}
    env.update(malloc_env(env))
    env["PYTHONUNBUFFERED"] = "1"
    if cpu_devices is not None:
        env.update(cpu_device_vars(cpu_devices))
    return env


def child_env(base: Mapping[str, str] | None = None, *, process_id: int, num_processes: int, coordinator: str,
              cpu_devices: int | None = None) -> dict[str, str]:
    """The environment of process ``process_id`` of a launch: :func:`process_env` plus the variables
    :func:`shardax.initialize` reads (``SHARDAX_COORDINATOR_ADDRESS``, ``SHARDAX_NUM_PROCESSES``,
    ``SHARDAX_PROCESS_ID``).

    Example:
        >>> import shardax as sx
        >>> env = sx.runtime.child_env({}, process_id=1, num_processes=2, coordinator="127.0.0.1:1234")
        >>> env["SHARDAX_PROCESS_ID"], env["SHARDAX_COORDINATOR_ADDRESS"]
        ('1', '127.0.0.1:1234')
    """
    env = process_env(base, cpu_devices=cpu_devices)
    env.update(launcher_vars(process_id=process_id, num_processes=num_processes, coordinator=coordinator))
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


def rank_specs(argv: Sequence[str], *, num_processes: int, cpu_devices: int | None = None,
               env: Mapping[str, str] | None = None) -> list[ProcessSpec]:
    """One :class:`ProcessSpec` per rank for ``python *argv``, with a fresh coordinator port on 127.0.0.1.

    Each process's environment is :func:`child_env` of ``env`` (default: this process's environment); labels are
    the ranks (``"0"``, ``"1"``, ...), names ``"rank 0"``, ...

    Example:
        >>> import shardax as sx
        >>> specs = sx.runtime.rank_specs(["-m", "platform"], num_processes=2, env={})
        >>> [s.label for s in specs], specs[1].env["SHARDAX_NUM_PROCESSES"]
        (['0', '1'], '2')
    """
    _check_count("num_processes", num_processes)
    coordinator = f"127.0.0.1:{free_port()}"
    return [ProcessSpec([sys.executable, *argv],
                        child_env(env, process_id=r, num_processes=num_processes, coordinator=coordinator,
                                  cpu_devices=cpu_devices),
                        label=str(r), name=f"rank {r}")
            for r in range(num_processes)]


def mpirun_spec(argv: Sequence[str], *, num_processes: int, cpu_devices: int | None = None,
                env: Mapping[str, str] | None = None, mpirun: str = "mpirun") -> ProcessSpec:
    """The :class:`ProcessSpec` of ``mpirun -n num_processes python *argv`` (Open MPI).

    The processes get :func:`process_env` of ``env`` (no ``SHARDAX_*`` place: :func:`shardax.initialize` finds
    the run through Open MPI's own variables), exported with ``-x`` so that remote hosts get it too. Their output is
    tagged by ``mpirun --tag-output``, and :func:`run_processes` gives each line under the rank its tag names
    (``mpirun``'s own lines under ``mpirun``).

    Example:
        >>> import shardax as sx
        >>> spec = sx.runtime.mpirun_spec(["job.py"], num_processes=2, cpu_devices=4, env={})
        >>> spec.argv[:2], "JAX_NUM_CPU_DEVICES" in spec.argv
        (['mpirun', '--allow-run-as-root'], True)
    """
    _check_count("num_processes", num_processes)
    env = process_env(env, cpu_devices=cpu_devices)
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "--tag-output", "-n", str(num_processes)]
    exported = (ENV_JAX_CPU_DEVICES, ENV_CPU_DEVICES, "PYTHONPATH", "PYTHONUNBUFFERED", *MALLOC_ENV)
    for var in exported:
        if var in env:
            command += ["-x", var]
    return ProcessSpec([*command, sys.executable, *argv], env, label="mpirun", name="mpirun", tagged=True)


def launch(target: str | os.PathLike[str] | Sequence[str], /, *args: str, num_processes: int,
           cpu_devices: int | None = None, timeout_s: float | None = None, env: Mapping[str, str] | None = None,
           sink: Sink | None = None, verbose: bool = False) -> JobResult:
    """Run a Python script or module in ``num_processes`` local processes that find each other through
    :func:`shardax.initialize` (the library form of ``shardax launch``).

    Every process gets :func:`child_env`: ``SHARDAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port),
    ``SHARDAX_NUM_PROCESSES``, ``SHARDAX_PROCESS_ID``, with ``cpu_devices`` ``SHARDAX_CPU_DEVICES`` and
    ``JAX_NUM_CPU_DEVICES``, and ``PYTHONUNBUFFERED=1``, so the script just calls ``sx.initialize()``. Its stdout and
    stderr lines go to ``sink``, whole and tagged with the rank, each on its own stream (by default printed as
    ``[1] ...`` to this process's stdout or stderr, like ``mpirun --tag-output``); gloo's connection reports are
    left out unless ``verbose``. The first rank to fail ends the run: the others get SIGTERM, then SIGKILL after
    3 s, and the launcher says last which error the run ended on and which rank printed it.

    Args:
        target: a script path, or an argument list: ``["script.py", *args]`` or ``["-m", "module", *args]``.
        *args: more arguments for the script.
        num_processes: number of processes (ranks).
        cpu_devices: CPU devices per process (``None``: JAX's default, or an inherited ``JAX_NUM_CPU_DEVICES``).
        timeout_s: end the run after this many seconds (exit code 124); ``None`` waits forever.
        env: the base environment of the processes (default: this process's).
        sink: where the lines go (default: :class:`ConsoleSink`; :class:`CaptureSink` keeps them).
        verbose: keep gloo's connection reports (``[Gloo] Rank 0 is connected to 7 peer ranks ...``).

    Returns:
        A :class:`JobResult`: ``returncode`` 0 on success; the first failing rank's exit code (``128 + K`` if it
        was killed by signal ``K``); 124 on timeout; ``128 + K`` if this process received signal ``K`` (forwarded
        to every rank). ``error`` holds the rank and line the run failed on.

    Raises:
        ValueError: a missing script, an empty target, non-positive counts or a bad ``SHARDAX_MALLOC``, before
            anything starts.
        TypeError: ``target`` is not a path or a list of str.

    Example:
        >>> import shardax as sx
        >>> result = sx.runtime.launch("train.py", "--lr", "0.1", num_processes=2, cpu_devices=4)  # doctest: +SKIP
        [0] step 0 loss 1.25
        [1] step 0 loss 1.25
        >>> result.returncode  # doctest: +SKIP
        0
    """
    argv = target_argv(target, args)
    specs = rank_specs(argv, num_processes=num_processes, cpu_devices=cpu_devices, env=env)
    return run_processes(specs, sink=sink, timeout_s=timeout_s, verbose=verbose)

"""Run a test body or a script in several local processes: :func:`run_distributed` and :func:`launch_script`."""

from __future__ import annotations

import dataclasses
import inspect
import os
import pickle
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .. import runtime
from ..runtime import CaptureSink, JobResult

Launcher = Literal["shardax", "mpirun"]


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How a launched script ended.

    Attributes:
        returncode: as :func:`shardax.runtime.launch` returns it (0 on success).
        output: every rank's stdout and stderr lines, prefixed ``[rank] ``, in arrival order, followed by the
            launcher's messages (``shardax launch: ...``: the first error and the verdict) if the run failed.
        stdout: the stdout lines alone, prefixed.
        stderr: the stderr lines alone, prefixed, with the launcher's messages.
    """

    returncode: int
    output: str
    stdout: str = ""
    stderr: str = ""


def _importable_env(cpu_devices: int | None) -> dict[str, str]:
    """:func:`shardax.runtime.process_env` of this process's environment, with shardax importable from here."""
    env = runtime.process_env(cpu_devices=cpu_devices)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _interrupted(result: JobResult) -> None:
    if result.signal_received == signal.SIGINT:
        raise KeyboardInterrupt(result.message)


def launch_script(path_or_module: str | os.PathLike[str], *args: str, num_processes: int = 2,
                  cpu_devices: int | None = 4, timeout_s: float | None = 300, verbose: bool = False) -> LaunchResult:
    """Run an example script (or module) in ``num_processes`` local processes and capture its output.

    The same launch as ``shardax launch -n num_processes --cpu-devices cpu_devices``, with the output returned
    instead of printed.

    Args:
        path_or_module: a script path (an existing file or a name ending in ``.py``), else a module name run with
            ``python -m``.
        *args: the script's arguments.
        num_processes: number of processes.
        cpu_devices: CPU devices per process.
        timeout_s: stop the run after this many seconds (``returncode`` 124).
        verbose: keep gloo's connection reports in the output.

    Returns:
        A :class:`LaunchResult`.

    Example:
        >>> import shardax as sx
        >>> r = sx.testing.launch_script("examples/hello.py", num_processes=2)  # doctest: +SKIP
        >>> r.returncode, "[1]" in r.output  # doctest: +SKIP
        (0, True)
    """
    target = os.fspath(path_or_module)
    argv = [target] if target.endswith(".py") or os.path.isfile(target) else ["-m", target]
    sink = CaptureSink()
    result = runtime.launch(argv, *map(str, args), num_processes=num_processes, cpu_devices=cpu_devices,
                            timeout_s=timeout_s, env=_importable_env(cpu_devices), sink=sink, verbose=verbose)
    _interrupted(result)
    return LaunchResult(result.returncode, sink.text(), sink.text("stdout"), sink.text("stderr"))


def _locate(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """``(file, module name, qualname)`` of a module-level function, or a TypeError saying why not."""
    if not callable(fn):
        raise TypeError(f"fn must be a module-level function, got {type(fn).__name__}")
    qualname = getattr(fn, "__qualname__", None)
    module_name = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module_name, str) or "<" in qualname:
        raise TypeError(f"fn must be a function defined at module level (the children import it by name), got "
                        f"{qualname or fn!r}; move it out of the enclosing function or lambda")
    try:
        path = inspect.getsourcefile(fn) or inspect.getfile(fn)
    except TypeError:
        raise TypeError(f"fn {qualname!r} is not defined in a Python file the children can import") from None
    if not os.path.isfile(path):
        raise TypeError(f"fn {qualname!r} comes from {path!r}, which is not a file the children can import")
    module = sys.modules.get(module_name)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not fn:
        raise TypeError(f"fn {qualname!r} is not reachable as {module_name}.{qualname}; pass a module-level function")
    if module_name == "__main__":
        module_name = "__shardax_main__"
    return os.path.abspath(path), module_name, qualname


def _failure(title: str, result: JobResult, sink: CaptureSink, missing: Sequence[int] = ()) -> AssertionError:
    parts = [f"{title} failed: {result.message or 'exit code ' + str(result.returncode)}"]
    if missing:
        parts.append(f"no result from rank(s) {', '.join(map(str, missing))}")
    outputs = sink.by_label()
    for label in sorted(outputs, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0, s)):
        name = f"rank {label}" if label.isdigit() else label
        parts.append(f"----- {name} output -----\n{outputs[label].rstrip()}")
    if not outputs:
        parts.append("(no output)")
    return AssertionError("\n".join(parts))


def run_distributed(fn: Callable[..., Any], *args: Any, num_processes: int = 2, cpu_devices: int | None = 4,
                    timeout_s: float = 300, launcher: Launcher = "shardax") -> list[Any]:
    """Run ``fn(*args)`` in ``num_processes`` local processes of ``cpu_devices`` CPU devices each.

    Each process imports ``fn``'s module by file path (so ``fn`` must be defined at module level in an importable
    file, e.g. a test module; its directory is put first on ``sys.path``), calls ``sx.initialize()``, runs
    ``fn(*args)`` and pickles the result (fully addressable JAX arrays become NumPy arrays). Keep module-level code
    of that file free of JAX computations: the backend must not start before ``sx.initialize()``.

    JAX's persistent compilation cache stays as the environment sets it. With it on, process 0 compiles each
    program and hands it to the others, and on CPU a program of several devices with collectives that no data
    dependency orders is compiled again by each process (read back, it could run them in different orders on
    different devices and hang; see :mod:`shardax._compile_cache`).

    Args:
        fn: a module-level function; its return value must be picklable (use NumPy arrays).
        *args: picklable arguments for ``fn``, the same for every process.
        num_processes: number of processes.
        cpu_devices: CPU devices per process (``None``: JAX's default of one).
        timeout_s: stop the run after this many seconds.
        launcher: ``"shardax"`` (``shardax launch``) or ``"mpirun"`` (Open MPI's ``mpirun``, with only the CPU
            device count set, so that ``sx.initialize()`` finds the run through Open MPI's variables).

    Returns:
        The per-process return values, ordered by process id.

    Raises:
        AssertionError: a process failed, was killed or the run timed out; the message has the launcher's reason
            and every rank's output (tracebacks included).
        TypeError: ``fn`` is not a module-level function, or ``args`` cannot be pickled.
        ValueError: bad counts or launcher, or ``mpirun`` is not installed.

    Example:
        >>> import shardax as sx
        >>> def body():  # at module level in a test file
        ...     return sx.world().process_id
        >>> sx.testing.run_distributed(body, num_processes=2)  # doctest: +SKIP
        [0, 1]
    """
    if launcher not in ("shardax", "mpirun"):
        raise ValueError(f"launcher must be 'shardax' or 'mpirun', got {launcher!r}")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    path, module_name, qualname = _locate(fn)
    mpirun = shutil.which("mpirun") if launcher == "mpirun" else None
    if launcher == "mpirun" and mpirun is None:
        raise ValueError("launcher='mpirun' needs Open MPI's mpirun on PATH (e.g. apt-get install openmpi-bin)")
    title = f"run_distributed({module_name}.{qualname}, num_processes={num_processes}, launcher={launcher!r})"
    with tempfile.TemporaryDirectory(prefix="shardax-run-") as tmp:
        spec_path = os.path.join(tmp, "spec.pkl")
        try:
            payload = pickle.dumps({"file": path, "module": module_name, "qualname": qualname, "args": args})
        except Exception as err:
            raise TypeError(f"the arguments of {qualname} must be picklable (NumPy arrays, numbers, str...): "
                            f"{err}") from err
        with open(spec_path, "wb") as f:
            f.write(payload)
        argv = ["-m", "shardax.testing._child", spec_path]
        sink = CaptureSink()
        env = _importable_env(cpu_devices)
        if mpirun is None:
            result = runtime.launch(argv, num_processes=num_processes, cpu_devices=cpu_devices,
                                    timeout_s=timeout_s, env=env, sink=sink)
        else:
            spec = runtime.mpirun_spec(argv, num_processes=num_processes, env=env, mpirun=mpirun)
            result = runtime.run_processes([spec], sink=sink, timeout_s=timeout_s)
        _interrupted(result)
        files = [os.path.join(tmp, f"result_{r}.pkl") for r in range(num_processes)]
        missing = [r for r, file in enumerate(files) if not os.path.exists(file)]
        if result.returncode != 0 or missing:
            raise _failure(title, result, sink, missing)
        results = []
        for file in files:
            with open(file, "rb") as f:
                results.append(pickle.load(f))
    return results

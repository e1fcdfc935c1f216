"""JAX's persistent compilation cache, for the CLI jobs (``halos``, ``nbody``, ``demo``, ``bench``) and the processes
of :func:`shardax.testing.run_distributed`.

JAX compiles every program of a job on its first run; with the cache on, a second identical run loads them from disk.
The settings go into this process's JAX configuration and into the environment, so the processes a job launches
(``--processes``, ``shardax launch``) see the same cache. Programs that call back into Python (host callbacks) are
never written to the cache by JAX: they compile on every run (with the cache on, the kernels sort on the device
instead of calling NumPy, see :mod:`shardax._hostsort`).

**Same key on every process.** On CPU, JAX (0.10-0.11) hashes a fingerprint of the device topology into each cache
key, and that fingerprint differs between the processes of one run: what process 0 wrote was never found by the
others. The jobs key CPU programs by their devices' kinds and which process drives each device instead (the same on
every process of a run, and different between a run of one process with 4 devices and one of two processes with 2);
the program, its device assignment, the compile options, the backend version and the XLA flags stay in the key.

**One compilation per run.** With the keys the same, a CPU job of several processes on one machine shares its first
compilations (:func:`settle_compilation_cache`): process 0 compiles each program and hands the executable to the
others through the run's coordination service (JAX's ``jax_share_binary_between_hosts``), instead of every process
compiling the same program at once on cores they share; process 0 hands it over before it writes it to the cache
(:func:`_share_before_writing`). Not across machines: a process that finds a program in its
own machine's cache directory does not hand it on, and the others would wait for it.

**Read-back programs must order their collectives by data.** An XLA:CPU executable read back (from the cache, or
handed from another process) gives every collective a communicator resource of its own (jaxlib 0.10-0.11), where the
compiler had given them one shared resource that orders them. Devices may then enter two collectives that do not
depend on each other in different orders and wait for each other for ever (``shardax halos`` at 2 processes x 4 CPU
devices hung so inside FoF, whose final checks did not depend on its last exchange). The library's kernels order
every pair of their collectives by data (:mod:`shardax._order`; the tests check each kernel's compiled program), and
on CPU every program of several devices that this process did not compile itself is checked when it is loaded
(:func:`_checked_load`): one that leaves a pair unordered is compiled here instead, so a user's program never runs
from a read-back executable that could hang.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

# JAX reads these when it is imported; the launched processes inherit them.
_ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
_ENV_ENABLE = "JAX_ENABLE_COMPILATION_CACHE"
_ENV_MIN_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_ENV_MIN_SIZE = "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"
# How long a process waits for process 0's executable of a program before compiling it itself (JAX's default: 20 min).
_SHARE_WAIT_MS = 5 * 60 * 1000


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/shardax/jax``, else ``~/.cache/shardax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardax", "jax")


def cache_help() -> str:
    """The ``--no-cache`` help line of every job."""
    return (f"compile every program anew instead of using the persistent compilation cache (default on, in "
            f"{default_cache_dir()}, or $JAX_COMPILATION_CACHE_DIR if set)")


def _same_key_on_every_process() -> None:
    """Key CPU programs by their devices' kinds, ids and processes instead of the per-process topology fingerprint
    (module docstring). Leaves JAX alone where its cache-key module does not look as expected, and on other
    platforms."""
    try:
        from jax._src import cache_key
    except ImportError:  # pragma: no cover - another JAX layout: keep its keys
        return
    original = getattr(cache_key, "_hash_accelerator_config", None)
    by_kind = getattr(cache_key, "_hash_devices", None)
    if original is None or by_kind is None or getattr(original, "shardax_cpu_key", False):
        return

    def hash_accelerator_config(hash_obj: Any, accelerators: Any) -> None:
        devices = list(getattr(accelerators, "flat", ()))
        if devices and all(getattr(d, "platform", None) == "cpu" for d in devices):
            by_kind(hash_obj, accelerators)
            # Which process drives each device: the same on every process of a run, and different between runs
            # laid out differently (4 devices of one process and 2 of each of two are different programs).
            layout = ",".join(f"{d.id}:{d.process_index}" for d in devices)
            hash_obj.update(f"shardax-cpu-layout:{layout}".encode())
        else:
            original(hash_obj, accelerators)

    hash_accelerator_config.shardax_cpu_key = True  # type: ignore[attr-defined]
    cache_key._hash_accelerator_config = hash_accelerator_config


def _keys_agree() -> bool:
    """Whether :func:`_same_key_on_every_process` is in place (a JAX whose cache-key module it could not patch keeps
    per-process keys, and sharing would make the other processes wait for keys nobody writes)."""
    try:
        from jax._src import cache_key
    except ImportError:  # pragma: no cover - another JAX layout
        return False
    return bool(getattr(getattr(cache_key, "_hash_accelerator_config", None), "shardax_cpu_key", False))


def _checked_load() -> None:
    """Make JAX check every CPU program of several devices that it did not compile in this process (loaded from the
    persistent cache or from another process) for collectives no data dependency orders, and compile such a
    program here instead (module docstring). Installed once; JAX's internals moved: nothing is installed and
    :func:`settle_compilation_cache` keeps the cache off for such programs."""
    try:
        from jax._src import compiler
    except ImportError:  # pragma: no cover - another JAX layout
        return
    original = getattr(compiler, "compile_or_get_cached", None)
    compile_here = getattr(compiler, "backend_compile_and_load", None)
    if original is None or compile_here is None or getattr(original, "shardax_checked", False):
        return

    compiled = threading.local()  # programs this thread compiled itself since it last looked

    def backend_compile_and_load(*args: Any, **kwargs: Any) -> Any:
        compiled.count = getattr(compiled, "count", 0) + 1
        return compile_here(*args, **kwargs)

    def compile_or_get_cached(backend: Any, computation: Any, devices: Any, compile_options: Any,
                              host_callbacks: Any, *args: Any, **kwargs: Any) -> Any:
        before = getattr(compiled, "count", 0)
        try:
            with _unshared_if_keyed_per_process(computation):
                executable = original(backend, computation, devices, compile_options, host_callbacks, *args,
                                      **kwargs)
        except Exception as err:
            if "DEADLINE_EXCEEDED" not in str(err) or not _sharing():
                raise
            # Waited in vain for process 0's executable (its key for this program differs): compile it here.
            from jax._src import config

            with config.share_binary_between_hosts(False):
                executable = original(backend, computation, devices, compile_options, host_callbacks, *args,
                                      **kwargs)
        if getattr(compiled, "count", 0) > before or getattr(backend, "platform", None) != "cpu" or \
                np.size(devices) < 2 or _ordered(executable):
            return executable
        executable_devices = args[0] if args else kwargs["executable_devices"]
        return compiler.backend_compile_and_load(backend, computation, executable_devices, compile_options,
                                                 host_callbacks)

    compile_or_get_cached.shardax_checked = True  # type: ignore[attr-defined]
    compiler.backend_compile_and_load = backend_compile_and_load
    compiler.compile_or_get_cached = compile_or_get_cached


def _share_before_writing() -> None:
    """Make process 0 hand a program it compiled to the others before it writes it to the persistent cache (JAX
    writes it first, and the others wait 0.2 s longer for a large program such as FoF's). JAX's own functions do
    the work: while one of them shares a program, the cache write it asks for is held, and made once the program is
    handed over. Installed once; where JAX's internals moved, nothing is installed (JAX's order stays)."""
    try:
        from jax._src import compiler
    except ImportError:  # pragma: no cover - another JAX layout
        return
    share = getattr(compiler, "_compile_and_share_module", None)
    write = getattr(compiler, "_cache_write", None)
    if share is None or write is None or getattr(share, "shardax_share_first", False) or \
            not hasattr(share, "modules_cache"):
        return
    held = threading.local()  # the cache writes of the program this thread is sharing

    def cache_write(*args: Any, **kwargs: Any) -> None:
        writes = getattr(held, "writes", None)
        if writes is None:
            write(*args, **kwargs)
        else:
            writes.append((args, kwargs))

    def compile_and_share_module(*args: Any, **kwargs: Any) -> Any:
        if getattr(held, "writes", None) is not None:  # re-entered: nothing more to hold
            return share(*args, **kwargs)
        held.writes = []
        try:
            executable = share(*args, **kwargs)
        finally:
            writes, held.writes = held.writes, None
        for write_args, write_kwargs in writes:
            write(*write_args, **write_kwargs)
        return executable

    compile_and_share_module.shardax_share_first = True  # type: ignore[attr-defined]
    compile_and_share_module.modules_cache = share.modules_cache  # type: ignore[attr-defined]
    compiler._cache_write = cache_write
    compiler._compile_and_share_module = compile_and_share_module


def _sharing() -> bool:
    from jax._src import config

    return bool(config.share_binary_between_hosts.value)


@contextlib.contextmanager
def _unshared_if_keyed_per_process(computation: Any) -> Iterator[None]:
    """Inside, a program that gets a different cache key on every process is not shared between processes (it
    compiles on each): a ``custom_partitioning`` call (jaxDecomp's FFTs, for one) carries the address of its Python
    callback in the program, so the others would wait for a key process 0 never writes, until JAX's 20-minute
    timeout. JAX already keeps programs with host callbacks to themselves."""
    from jax._src import config

    share = config.share_binary_between_hosts
    if not share.value:
        yield
        return
    try:
        from jax._src.interpreters import mlir

        per_process = b"CustomSPMDPartitioning" in mlir.module_to_bytecode(computation)
    except Exception:
        per_process = True
    if not per_process:
        yield
        return
    with share(False):
        yield


def _ordered(executable: Any) -> bool:
    """Whether every pair of collectives of a loaded executable is ordered by data (False when its program cannot
    be read)."""
    from ._order import unordered_collectives

    try:
        text = executable.hlo_modules()[0].to_string()
    except Exception:
        return False
    return next(iter(unordered_collectives(text)), None) is None


def _checks_loads() -> bool:
    """Whether :func:`_checked_load` is in place."""
    try:
        from jax._src import compiler
    except ImportError:  # pragma: no cover - another JAX layout
        return False
    return bool(getattr(getattr(compiler, "compile_or_get_cached", None), "shardax_checked", False))


def cache_env(path: str) -> dict[str, str]:
    """The environment that turns the cache on in ``path`` for every program, however quickly it compiled (JAX's
    defaults skip those under 1 s), in this process or the processes it starts."""
    return {_ENV_DIR: path, _ENV_ENABLE: "true", _ENV_MIN_TIME: "0", _ENV_MIN_SIZE: "0"}


def cache_environment(enabled: bool) -> str | None:
    """Turn JAX's persistent compilation cache on (every program, however fast it compiled) or off in the environment
    only: for the processes this one starts, and for this one if it imports JAX later. Imports no JAX (the processes
    that only launch others never do). A ``JAX_COMPILATION_CACHE_DIR`` already set is kept.

    Returns:
        The cache directory, or None when off (asked so, or the directory cannot be made).
    """
    if not enabled:
        os.environ[_ENV_ENABLE] = "false"
        return None
    path = os.environ.get(_ENV_DIR) or default_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        os.environ[_ENV_ENABLE] = "false"
        return None  # an unwritable home: run without the cache rather than fail
    os.environ.update(cache_env(path))
    return path


def use_compilation_cache(enabled: bool) -> str | None:
    """Turn JAX's persistent compilation cache on (every program, however fast it compiled) or off, for this
    process and the processes it starts (:func:`cache_environment`, and this process's JAX configuration), with the
    same key for a program on every process and read-back programs checked (module docstring).

    Returns:
        The cache directory, or None when off.
    """
    import jax

    path = cache_environment(enabled)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _same_key_on_every_process()
    _checked_load()
    _share_before_writing()
    return path


def settle_compilation_cache(world: Any) -> bool:
    """Settle how this run uses the persistent compilation cache; call after :func:`shardax.initialize`, before the
    first program runs.

    The cache stays as configured (:func:`use_compilation_cache`). On a CPU run of several processes on one machine
    with the cache on, process 0 compiles each program and the others load its executable (JAX's
    ``jax_share_binary_between_hosts``, module docstring). Where this JAX's internals could not be adapted (the keys
    the same on every process, loaded programs checked for unordered collectives), CPU runs of several devices
    compile every program instead, with the cache off.

    Returns:
        Whether the cache is on.
    """
    import jax

    cached = bool(getattr(jax.config, "jax_enable_compilation_cache", False)
                  and getattr(jax.config, "jax_compilation_cache_dir", None))
    if cached and world.platform == "cpu" and world.device_count > 1 and not (_keys_agree() and _checks_loads()):
        jax.config.update("jax_enable_compilation_cache", False)
        try:  # JAX decides once per process whether it uses the cache: let it decide again
            from jax._src import compilation_cache
        except ImportError:  # pragma: no cover - another JAX layout
            return False
        compilation_cache.reset_cache()
        return False
    # (On one machine only: with a cache directory per machine, process 0 could load a program from its disk that
    # another machine's processes do not have, and they would wait for it until JAX's timeout.)
    share = cached and world.platform == "cpu" and world.num_processes > 1 and getattr(world, "num_hosts", 2) == 1
    jax.config.update("jax_share_binary_between_hosts", share)
    if share:  # a process whose key for a program differs waits this long, then compiles it itself
        wait = int(getattr(jax.config, "jax_share_binary_between_hosts_timeout_ms", _SHARE_WAIT_MS))
        jax.config.update("jax_share_binary_between_hosts_timeout_ms", min(wait, _SHARE_WAIT_MS))
    return cached

"""JAX's persistent compilation cache, for the CLI jobs (``halos``, ``nbody``, ``demo``, ``bench``) and the processes
of :func:`shardax.testing.run_distributed`.

JAX compiles every program of a job on its first run; with the cache on, a second identical run loads them from disk.
The settings go into this process's JAX configuration and into the environment, so the processes a job launches
(``--processes``, ``shardax launch``) see the same cache. Programs that call back into Python (host callbacks) are
never written to the cache by JAX: they compile on every run.

On CPU the cache is used for one device only (:func:`settle_compilation_cache`). An XLA:CPU executable read back
(from the cache, or handed from one process to another) loses the order of its collectives: XLA (jaxlib 0.10) gives
every collective it reads back a communicator resource of its own, where the compiler had given them one shared
resource that orders them. Devices may then enter two independent collectives in different orders and wait for
each other for ever: ``shardax halos`` on 1.2M particles at 2 processes x 4 CPU devices hung inside FoF, two
devices of one process in an all-to-all and the six others in an all-gather, on every run that loaded its programs
(the first run with executables shared between processes, and every second run); compiled by each process, the
same programs ran. Programs on one device have no collectives.
"""

from __future__ import annotations

import os
from typing import Any

# JAX reads these when it is imported; the launched processes inherit them.
_ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
_ENV_ENABLE = "JAX_ENABLE_COMPILATION_CACHE"
_ENV_MIN_TIME = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_ENV_MIN_SIZE = "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/shardax/jax``, else ``~/.cache/shardax/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardax", "jax")


def cache_help() -> str:
    """The ``--no-cache`` help line of every job."""
    return (f"compile every program anew instead of using the persistent compilation cache (default on for GPUs and "
            f"one CPU device, in {default_cache_dir()}, or $JAX_COMPILATION_CACHE_DIR if set)")


def cache_env(path: str) -> dict[str, str]:
    """The environment that turns the cache on in ``path`` for every program, however quickly it compiled (JAX's
    defaults skip those under 1 s), in this process or the processes it starts."""
    return {_ENV_DIR: path, _ENV_ENABLE: "true", _ENV_MIN_TIME: "0", _ENV_MIN_SIZE: "0"}


def use_compilation_cache(enabled: bool) -> str | None:
    """Turn JAX's persistent compilation cache on (every program, however fast it compiled) or off, for this
    process and the processes it starts. A ``JAX_COMPILATION_CACHE_DIR`` already set is kept.

    Returns:
        The cache directory, or None when off.
    """
    import jax

    if not enabled:
        os.environ[_ENV_ENABLE] = "false"
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = os.environ.get(_ENV_DIR) or default_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None  # an unwritable home: run without the cache rather than fail
    os.environ.update(cache_env(path))
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def settle_compilation_cache(world: Any) -> bool:
    """Keep the persistent compilation cache on only where programs read back from it run as compiled: off on CPU
    runs of more than one device (module docstring), on elsewhere as configured. Call after
    :func:`shardax.initialize`, before the first program runs.

    Returns:
        Whether the cache is on.
    """
    import jax

    if world.platform == "cpu" and world.device_count > 1:
        jax.config.update("jax_enable_compilation_cache", False)
        try:  # JAX decides once per process whether it uses the cache: let it decide again
            from jax._src import compilation_cache
        except ImportError:  # pragma: no cover - another JAX layout
            return False
        compilation_cache.reset_cache()
        return False
    return bool(getattr(jax.config, "jax_enable_compilation_cache", False)
                and getattr(jax.config, "jax_compilation_cache_dir", None))

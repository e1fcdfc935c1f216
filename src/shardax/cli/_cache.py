"""The persistent compilation cache of the CLI jobs (``halos``, ``demo``, ``bench``).

JAX compiles every program of a job on its first run; with the cache on, a second identical run loads them from disk.
The settings go into this process's JAX configuration and into the environment, so the processes a job launches
(``--processes``, ``shardax launch``) use the same cache. Programs that call back into Python (host callbacks) are
never written to the cache by JAX: they compile on every run.
"""

from __future__ import annotations

import os

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
    return (f"compile every program anew instead of using the persistent compilation cache (default on, in "
            f"{default_cache_dir()}, or $JAX_COMPILATION_CACHE_DIR if set)")


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
    settings = {_ENV_DIR: path, _ENV_ENABLE: "true", _ENV_MIN_TIME: "0", _ENV_MIN_SIZE: "0"}
    os.environ.update(settings)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path

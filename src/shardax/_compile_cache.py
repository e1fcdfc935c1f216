"""JAX's persistent compilation cache and shared first compilations, for the CLI jobs (``halos``, ``nbody``,
``demo``, ``bench``) and the processes of :func:`shardax.testing.run_distributed`.

JAX compiles every program of a job on its first run; with the cache on, a second identical run loads them from disk.
The settings go into this process's JAX configuration and into the environment, so the processes a job launches
(``--processes``, ``shardax launch``) use the same cache. Programs that call back into Python (host callbacks) are
never written to the cache by JAX: they compile on every run.

On CPU, JAX (0.10-0.11) hashes a fingerprint of the device topology into each cache key, and that fingerprint
differs between the processes of one run: the entries process 0 writes (JAX writes from process 0 only) were never
found by the others, which compiled everything again on every run. The jobs key CPU programs by their devices' kinds
and count instead (what JAX itself does for backends without a topology fingerprint); the program, its device
assignment, the compile options, the backend version and the XLA flags stay in the key, so the same program on
every process of a run gets the same key and loads the same executable.

Because the keys agree on CPU, a multi-process CPU job also shares its first compilation
(:func:`share_compiled_programs`): process 0 compiles each program and hands the executable to the others through
the run's coordination service (JAX's ``jax_share_binary_between_hosts``), instead of every process compiling the
same program at once on cores they share. It stays off elsewhere: where keys differ (e.g. on GPUs) the other
processes would wait for an executable under a key nobody writes, until a 20-minute timeout.
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
    return (f"compile every program anew instead of using the persistent compilation cache (default on, in "
            f"{default_cache_dir()}, or $JAX_COMPILATION_CACHE_DIR if set)")


def _same_key_on_every_process() -> None:
    """Key CPU programs by device kinds and count instead of the per-process topology fingerprint (module
    docstring). Leaves JAX alone where its cache-key module does not look as expected, and on other platforms."""
    try:
        from jax._src import cache_key
    except ImportError:  # pragma: no cover - another JAX layout: keep its keys
        return
    original = getattr(cache_key, "_hash_accelerator_config", None)
    by_kind = getattr(cache_key, "_hash_devices", None)
    if original is None or by_kind is None or getattr(original, "shardax_cpu_key", False):
        return

    def hash_accelerator_config(hash_obj: Any, accelerators: Any) -> None:
        if all(getattr(d, "platform", None) == "cpu" for d in getattr(accelerators, "flat", ())):
            by_kind(hash_obj, accelerators)
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


def cache_env(path: str) -> dict[str, str]:
    """The environment that turns the cache on in ``path`` for every program, however quickly it compiled (JAX's
    defaults skip those under 1 s), in this process or the processes it starts."""
    return {_ENV_DIR: path, _ENV_ENABLE: "true", _ENV_MIN_TIME: "0", _ENV_MIN_SIZE: "0"}


def cache_env_unless_set(env: dict[str, str], path: str) -> dict[str, str]:
    """``env`` with :func:`cache_env` of ``path``, unless it already names a cache directory or turns the cache
    off."""
    if env.get(_ENV_DIR) or env.get(_ENV_ENABLE, "").lower() in ("0", "false"):
        return env
    return {**env, **cache_env(path)}


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
    _same_key_on_every_process()
    return path


def share_compiled_programs(world: Any) -> bool:
    """On a CPU run of several processes with the cache on (and its keys the same on every process), let process 0
    compile each program and the other processes load its executable (module docstring); call after
    :func:`shardax.initialize`. Programs with host callbacks still compile on every process (JAX does not share
    them).

    Returns:
        Whether sharing is on.
    """
    import jax

    cached = bool(getattr(jax.config, "jax_enable_compilation_cache", False)
                  and getattr(jax.config, "jax_compilation_cache_dir", None))
    share = cached and _keys_agree() and world.platform == "cpu" and world.num_processes > 1
    jax.config.update("jax_share_binary_between_hosts", share)
    return share

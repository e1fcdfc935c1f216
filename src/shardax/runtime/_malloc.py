"""glibc's allocator, set up for XLA:CPU: keep freed memory in the process instead of returning it to the kernel.

XLA:CPU allocates the buffers of a program afresh on each call (with ``malloc``) and frees them afterwards. glibc
serves large blocks by ``mmap`` and returns them by ``munmap``, and threads allocate from arenas of their own, whose
free heaps are returned too. The next call then touches new pages, and the kernel zeroes every one of them. On a
2-core x86 machine FoF over 1e6 points (one device) took 116,000 page faults and 188 ms of kernel time per
call, a third of its CPU time. With one arena, no ``mmap`` for large blocks and no trimming (:data:`MALLOC_ENV`), a
call reuses the previous call's memory: 75 page faults, 4 ms in the kernel, 204 ms per call instead of 317 ms (8
devices in one process: 504 -> 407 ms; 2 processes x 4 devices: 575 -> 470 ms). The price: a process keeps its peak
heap until it ends (as jemalloc and tcmalloc mostly do), which suits a compute job, not a long-lived service.

glibc reads these settings when a process starts. ``mallopt`` later is not enough: a thread that allocated before
(NumPy's BLAS thread does at import) leaves a second arena, and the round-robin hands it to XLA's threads, whose large
blocks are then mapped afresh on every call again. So shardax sets the environment of the processes it starts:
``shardax launch`` and :func:`shardax.testing.launch_script`/``run_distributed`` (also through ``mpirun``),
``shardax bench``'s workers, the ``shardax halos``, ``nbody`` and ``demo`` commands (which restart themselves once
with it when they compute in their own process) and the scripts in ``benchmarks/``. ``SHARDAX_MALLOC=system``, or
any of glibc's ``MALLOC_*`` variables or a ``glibc.malloc`` tunable of your own, keeps your settings. For your own
runs: ``env MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776
GLIBC_TUNABLES=glibc.malloc.tcache_count=32 python script.py`` (``mpirun -x ...`` or ``srun --export=ALL,...``
likewise).

One arena makes every thread take the same lock for every ``malloc`` and ``free``, and XLA's compiler allocates
small objects by the million on several threads: FoF's 8-device program compiled in 6.7-7.2 s with one arena against
4.4-4.6 s with glibc's defaults. Each thread's cache of freed small blocks (glibc's tcache, 7 blocks per size by
default) spares it the lock; 32 per size (at most about 1 MB per thread) brings that compilation to 6.1-6.6 s, with
the same resident memory and run time. (Much larger caches hold blocks that one thread freed and others allocate:
with 8,000 per size the resident memory of a FoF loop on 8 devices grew by 300 MB per call.)
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from collections.abc import Mapping, Sequence

#: The environment that sets glibc's allocator up for XLA:CPU when a process starts.
MALLOC_ENV: dict[str, str] = {
    "MALLOC_ARENA_MAX": "1",  # one arena: XLA's device threads free into (and reuse) one heap
    "MALLOC_MMAP_MAX_": "0",  # large blocks from the heap, not from mmap (no munmap on free)
    "MALLOC_TRIM_THRESHOLD_": str(2**40),  # never give the top of the heap back
    "GLIBC_TUNABLES": "glibc.malloc.tcache_count=32",  # each thread's freed small blocks spare it the arena's lock
}
_TUNABLES = "GLIBC_TUNABLES"
#: ``SHARDAX_MALLOC=system`` keeps glibc's defaults in every process shardax starts.
ENV = "SHARDAX_MALLOC"


@functools.cache
def _glibc() -> bool:  # (libc_ver reads the interpreter's binary)
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def malloc_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to ``env`` (a new process's environment) so that glibc starts set up for XLA:CPU.

    Empty when ``env`` has ``SHARDAX_MALLOC=system`` or sets one of glibc's ``MALLOC_*`` variables or a
    ``glibc.malloc`` tunable itself (the user's choice wins), and off glibc (macOS, musl). Other tunables the
    environment has in ``GLIBC_TUNABLES`` are kept, ahead of the allocator's. ``ValueError`` for another value of
    ``SHARDAX_MALLOC``.

    Example:
        >>> malloc_env({})["MALLOC_ARENA_MAX"]  # on glibc  # doctest: +SKIP
        '1'
        >>> malloc_env({"SHARDAX_MALLOC": "system"})
        {}
    """
    value = env.get(ENV, "").strip().lower()
    if value not in ("", "tuned", "system"):
        raise ValueError(f"{ENV} must be 'tuned' (the default) or 'system' (glibc's defaults), got {env.get(ENV)!r}")
    theirs = env.get(_TUNABLES, "")
    if value == "system" or any(name in env for name in MALLOC_ENV if name != _TUNABLES) or \
            "glibc.malloc." in theirs or not _glibc():
        return {}
    extra = dict(MALLOC_ENV)
    if theirs:
        extra[_TUNABLES] = f"{theirs}:{extra[_TUNABLES]}"
    return extra


def restart_with_malloc_env(argv: Sequence[str]) -> None:
    """Replace this process by ``python *argv`` started with :data:`MALLOC_ENV`, unless its environment already
    has it or opts out (then return). For commands that own their process, before they compute anything.
    """
    extra = malloc_env(os.environ)
    if not extra:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], {**os.environ, **extra})

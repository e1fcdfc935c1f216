"""How many threads XLA:CPU splits one operation over, for programs spanning several CPU devices of a process.

XLA:CPU splits large operations (a loop fusion over 160,000 rows, say) into parts that run on the process's thread
pool. It sizes the split by the CPUs the compiling thread may run on (``sched_getaffinity``), which is right for a
program on one device, but a program on several CPU devices of one process already keeps every core busy with one
thread per device: the split parts then only add synchronisation and cache traffic between cores. On 2 cores with 8
devices, FoF over 1e6 points took 0.37-0.39 s compiled the default way and 0.27-0.28 s compiled with operations
kept whole, while the 1-device program is faster split (0.22 s against 0.27 s).

So ``smap(jit=True)`` (and the global FFTs, which jit an ``smap`` of their own) compiles a program whose mesh has several CPU devices in this process with
:func:`limited_cpus`: while XLA compiles it, each of the process's threads may only run on ``max(1, cpus // local
devices)`` of its CPUs (different threads on different CPUs, so the compilation itself still uses them all), and
then the threads get their CPUs back. The program runs on all of them. ``SHARDAX_CPU_SPLIT`` overrides the rule:
``system`` keeps XLA's own split, a positive integer sets the CPUs the compiler sees.

XLA:CPU generates the machine code of a program in parallel, on threads it starts at its first compilation in the
process; a thread starts with the CPUs of the thread that starts it. Started inside :func:`limited_cpus`, they would
all share one CPU for the rest of the process and every compilation would run on one core. So :func:`limited_cpus`
first has XLA start them unpinned (one trivial compilation, once per process).

The particle kernels' CPU programs also choose XLA's per-op emitters (:func:`particle_compiler_options`,
``SHARDAX_CPU_EMITTERS``), which compile them faster and run them as fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

ENV = "SHARDAX_CPU_SPLIT"
_LOCK = threading.RLock()  # re-entrant: an smap kernel compiled inside a user's limited_cpus


def _allowed_cpus() -> set[int] | None:
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None or not hasattr(os, "sched_setaffinity"):
        return None  # not Linux: nothing to restrict
    return set(getter(0))


def split_cpus(devices: Sequence[Any], env: dict[str, str] | None = None) -> int | None:
    """CPUs the XLA compiler should see for a program over ``devices``, or ``None`` to leave it alone.

    ``None`` unless every device is a CPU device and at least two belong to this process. Then
    ``max(1, cpus // local devices)`` (``cpus``: the CPUs this process may run on), or the value of
    ``SHARDAX_CPU_SPLIT`` (``system``: ``None``; a positive integer: that many, capped at ``cpus``).

    Raises:
        ValueError: ``SHARDAX_CPU_SPLIT`` is neither ``auto``, ``system`` nor a positive integer.
    """
    value = (os.environ if env is None else env).get(ENV, "auto").strip().lower()
    if value not in ("auto", "system") and not (value.isdigit() and int(value) > 0):
        raise ValueError(f"{ENV}={value!r}: use 'auto' (the default), 'system' (XLA's own split) or a positive "
                         "integer (CPUs one operation may be split over)")
    if value == "system" or not devices or any(getattr(d, "platform", None) != "cpu" for d in devices):
        return None
    allowed = _allowed_cpus()
    if allowed is None:
        return None
    me = jax.process_index()
    local = sum(1 for d in devices if d.process_index == me)
    if local < 2:
        return None
    want = int(value) if value.isdigit() else max(1, len(allowed) // local)
    return None if want >= len(allowed) else want


_compiler_threads_started = False


def _start_compiler_threads() -> None:
    """Compile one trivial CPU program now, with this thread's CPUs, unless done before: XLA:CPU starts its code
    generation threads at its first compilation, and a thread inherits the CPUs of the thread that starts it (module
    docstring). The compilation goes straight to XLA, past JAX's persistent cache (a hit there would compile
    nothing)."""
    global _compiler_threads_started
    if _compiler_threads_started:
        return
    _compiler_threads_started = True
    device = jax.devices("cpu")[0]
    arg = jax.ShapeDtypeStruct((), np.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    lowered = jax.jit(lambda x: x + 1).lower(arg)
    try:
        from jax._src import compiler
        from jax._src.lib import xla_client

        compiler.backend_compile_and_load(device.client, lowered.compiler_ir(), xla_client.DeviceList((device,)),
                                          compiler.get_compile_options(num_replicas=1, num_partitions=1), [])
    except Exception:  # JAX's internals moved: the public path (served by the persistent cache if one holds it)
        lowered.compile()


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]


@contextlib.contextmanager
def limited_cpus(count: int) -> Iterator[None]:
    """While inside, each thread of this process may run on only ``count`` of the process's CPUs.

    The threads get different CPUs in turn (thread ``i`` the ``count`` CPUs from position ``i * count`` of the
    allowed set, wrapping around), so that work spread over several threads, like XLA's parallel code generation,
    still runs on every CPU while each thread sees only ``count``; XLA's code generation threads are started first
    if no compilation has started them yet. Each thread's CPUs are restored on exit, and threads started inside
    (which start with their starter's CPUs) get the process's CPUs then. Nothing happens where affinity cannot be
    set (not Linux) or ``count`` covers every allowed CPU.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import shardax as sx
        >>> step = jax.jit(lambda x: jnp.sin(x) * 2)
        >>> x = jnp.ones(1000)
        >>> with sx.runtime.limited_cpus(1):
        ...     _ = step.lower(x).compile()      # XLA splits no operation over several threads
        >>> y = step(x)                          # served by JAX's compilation cache, runs on every CPU
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"limited_cpus: count must be a positive int (CPUs per thread), got {count!r}")
    allowed = _allowed_cpus()
    if allowed is None or count >= len(allowed):
        yield
        return
    cpus = sorted(allowed)
    with _LOCK:
        _start_compiler_threads()
        saved: dict[int, set[int]] = {}
        for i, tid in enumerate(sorted(_threads())):
            subset = {cpus[(i * count + j) % len(cpus)] for j in range(count)}
            with contextlib.suppress(OSError):  # a thread may end while we walk the list
                saved[tid] = set(os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, subset)
        try:
            yield
        finally:
            for tid in _threads():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, saved.get(tid, allowed))


EMITTERS_ENV = "SHARDAX_CPU_EMITTERS"
_EMITTER_OPTION = "xla_cpu_use_fusion_emitters"


def particle_compiler_options(env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """XLA options of the particle kernels' global programs (``zsort.smap``, ``knn.smap``, ``fof.smap``): on CPU,
    XLA's per-op emitters instead of its fusion emitters.

    Those programs are large (10,000-20,000 instructions, dozens of loops) and XLA:CPU's fusion emitters spend most
    of their compilation on them; the per-op emitters compile them in a half to two thirds of the time, and the
    programs run as fast on several devices (figures: docs/benchmarks.md, "First call"). Smaller kernels (paint,
    FFTs, linear algebra) keep XLA's defaults: they compile in seconds either way and some run slower with the
    per-op emitters. The option names only XLA:CPU's compiler, so :func:`shardax.smap` drops it on other backends.

    ``SHARDAX_CPU_EMITTERS=fusion`` keeps XLA's fusion emitters (``per-op``, the default, takes the per-op ones), and
    an ``XLA_FLAGS`` that names ``xla_cpu_use_fusion_emitters`` is left to decide.

    Raises:
        ValueError: ``SHARDAX_CPU_EMITTERS`` is neither ``per-op`` nor ``fusion``.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    value = environ.get(EMITTERS_ENV, "per-op").strip().lower() or "per-op"
    if value not in ("per-op", "fusion"):
        raise ValueError(f"{EMITTERS_ENV}={value!r}: use 'per-op' (the default: XLA:CPU's per-op emitters for the "
                         "particle kernels) or 'fusion' (XLA's default emitters)")
    if value == "fusion" or _EMITTER_OPTION in environ.get("XLA_FLAGS", ""):
        return None
    return {_EMITTER_OPTION: False}


def compile_for_devices(jitted: Any, args: Sequence[Any], devices: Iterable[Any]) -> bool:
    """Compile ``jitted`` for ``args`` ahead of its first call, with :func:`limited_cpus` where :func:`split_cpus`
    says so (JAX's compilation cache then serves the call). Returns whether it compiled."""
    count = split_cpus(list(devices))
    if count is None:
        return False
    # Traced and lowered with every CPU: pinned, the main threads of all processes on a machine would share one.
    lowered = jitted.lower(*args)
    with limited_cpus(count):
        lowered.compile()
    return True


def compile_ahead(jitted: Callable[..., Any], devices: Iterable[Any]) -> Callable[..., Any]:
    """``jitted`` (a ``jax.jit`` function over ``devices``) that, on its first call for each argument structure,
    shapes and dtypes, is compiled by :func:`compile_for_devices` first. Calls under an outer trace pass straight
    through (the outer program is what gets compiled). Where :func:`split_cpus` leaves XLA alone (one device of
    this process, other backends), ``jitted`` itself: nothing to do on its calls."""
    devices = tuple(devices)
    if split_cpus(devices) is None:
        return jitted
    seen: set[Hashable] = set()

    @functools.wraps(jitted)
    def call(*args: Any) -> Any:
        leaves, tree = jax.tree.flatten(args)
        if not any(isinstance(leaf, Tracer) for leaf in leaves):
            key = (tree, tuple((np.shape(leaf), str(getattr(leaf, "dtype", type(leaf).__name__))) for leaf in leaves))
            if key not in seen:
                compile_for_devices(jitted, args, devices)
                seen.add(key)
        return jitted(*args)

    return call

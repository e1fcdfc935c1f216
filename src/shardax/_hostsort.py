"""Sorts of one integer array, run by NumPy on XLA:CPU.

XLA:CPU sorts a single array slowly: 156250 int32 words take ~9 ms, 156250 uint64 ~5 ms per device, where NumPy
(x86-simd-sort on AVX-512/AVX2 machines) takes 0.5 ms and 1.2 ms, and a host callback costs ~0.1 ms. On CPU
devices :func:`sort` therefore hands arrays of at least ``HOST_MIN`` words to ``numpy.sort`` in a host callback;
other backends (GPU radix sorts), small arrays and programs where a callback would gather the data on one device
keep ``lax.sort``. A sort of plain values has exactly one result, so every path returns the same bits.

JAX never writes a program with a host callback to its persistent compilation cache (and ``jax.export`` cannot
serialise one), so the host sort is a trade: faster steady state against a compilation in every new process. The
environment variable ``SHARDAX_HOST_SORT`` decides, read when a program is traced (see :func:`host_sort_enabled`):
``auto`` (the default) uses the host sort unless JAX's persistent compilation cache is on
(``jax_compilation_cache_dir`` set, e.g. by ``JAX_COMPILATION_CACHE_DIR``), so that with the cache on every program
of the library can be cached; ``1`` always uses it, ``0`` never.

The callback is a primitive of its own rather than :func:`jax.pure_callback`: that one first copies its arguments
onto CPU device 0 (``device_put``), which waits for device 0's running program; when device 0 waits in a collective
for the device calling back, the program deadlocks (8 CPU devices, a sort then a ``psum``). 64-bit values cross the
callback as pairs of uint32 words: outside any ``jax.enable_x64`` scope of the caller, JAX would cast a uint64 result
of the callback to uint32.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

try:  # The sharding of a callback in manual (smap) programs: JAX's own rule (jax is pinned below 0.11).
    from jax._src import sharding_impls as _sharding_impls
    from jax._src.callback import _callback_op_sharding
except ImportError:  # pragma: no cover - a JAX without them sorts with lax.sort
    _callback_op_sharding = None

# Below this many values the callback's fixed cost (~0.1 ms) is more than XLA:CPU's sort takes.
HOST_MIN = 4096
ENV = "SHARDAX_HOST_SORT"
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")

_TYPES = frozenset(np.dtype(t) for t in (np.int32, np.uint32, np.int64, np.uint64))

_sort_p = Primitive("shardax_sort_words")


def sort(x: jax.Array) -> jax.Array:
    """``lax.sort(x)`` of a 1D integer array, by NumPy when it runs on CPU devices.

    Args:
        x: `(n,)` int32, uint32, int64 or uint64.

    Returns:
        `(n,)` ``x`` in ascending order, bit-identical to ``lax.sort(x)`` on every backend.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax._hostsort import sort
        >>> sort(jnp.arange(5000, dtype=jnp.int32)[::-1])[:3].tolist()
        [0, 1, 2]
    """
    dtype = np.dtype(x.dtype)
    if (x.ndim != 1 or x.shape[0] < HOST_MIN or dtype not in _TYPES or _callback_op_sharding is None
            or not host_sort_enabled()):
        return lax.sort(x)
    # ``(n, k)`` words per value: k = 2 for 64-bit values, 1 otherwise.
    words = lax.bitcast_convert_type(x, jnp.uint32) if dtype.itemsize == 8 else x[:, None]
    out = _sort_p.bind(words, dtype=dtype)
    return lax.bitcast_convert_type(out, dtype) if dtype.itemsize == 8 else out[:, 0]


def host_sort_enabled() -> bool:
    """Whether :func:`sort` may hand large sorts on CPU devices to NumPy, by ``SHARDAX_HOST_SORT``: ``1`` / ``0``
    force it on / off; ``auto`` (or unset) turns it on unless JAX's persistent compilation cache is on (JAX does
    not cache programs with a host callback). Read at trace time: programs already traced keep their choice.

    Raises:
        ValueError: ``SHARDAX_HOST_SORT`` is none of ``auto``, ``1``, ``0`` (or ``true``/``false``, ``on``/``off``,
            ``yes``/``no``).

    Example:
        >>> import os
        >>> from shardax._hostsort import host_sort_enabled
        >>> os.environ["SHARDAX_HOST_SORT"] = "0"
        >>> host_sort_enabled()
        False
        >>> del os.environ["SHARDAX_HOST_SORT"]
    """
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value != "auto":
        raise ValueError(f"{ENV}={value!r}: use 'auto' (the default: the host sort unless JAX's persistent "
                         "compilation cache is on), '1' (always) or '0' (never, every program cacheable)")
    cache_on = getattr(jax.config, "jax_compilation_cache_dir", None) and getattr(
        jax.config, "jax_enable_compilation_cache", True)
    return not cache_on


def _sort_words(words: Any, dtype: np.dtype) -> Any:
    """``words (..., n, k)`` read as ``(..., n)`` values of ``dtype``, sorted along ``n`` (the reference lowering)."""
    with jax.enable_x64(True):
        values = lax.bitcast_convert_type(words, dtype) if dtype.itemsize == 8 else words[..., 0]
        out = lax.sort(values)
        return lax.bitcast_convert_type(out, words.dtype) if dtype.itemsize == 8 else out[..., None]


def _numpy_sort(words: np.ndarray, *, dtype: np.dtype) -> tuple[np.ndarray]:
    """The callback: ``words (..., n, k)`` read as ``(..., n)`` values of ``dtype``, sorted along ``n``."""
    words = np.ascontiguousarray(words)
    values = words.view(dtype).reshape(words.shape[:-1])
    return (np.sort(values, axis=-1).view(words.dtype).reshape(words.shape),)


def _abstract(words: Any, *, dtype: np.dtype) -> Any:
    del dtype
    return words  # same shape, dtype and (inside smap) varying axes


def _batched(args: tuple[Any, ...], dims: tuple[Any, ...], *, dtype: np.dtype) -> tuple[Any, int]:
    (words,), (dim,) = args, dims
    return _sort_p.bind(jnp.moveaxis(words, dim, 0), dtype=dtype), 0


def _single_callback(ctx: Any) -> tuple[bool, Any]:
    """Whether a callback here runs once per device on that device's own data, and its sharding annotation: in
    manual (``smap``) programs over every mesh axis, and in programs of one device; not where XLA would gather the
    data onto one device for it, nor in a lowering for several platforms (JAX's callbacks do not support it)."""
    axis_context = ctx.module_context.axis_context
    assert _callback_op_sharding is not None  # (``sort`` binds the primitive only then)
    if len(ctx.module_context.platforms) > 1:  # lowered for several platforms at once (``jax.export``)
        return False, None
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        if axis_context.manual_axes != frozenset(axis_context.mesh.axis_names):
            return False, None
        return True, _callback_op_sharding(axis_context, None, ctx.avals_out)
    if isinstance(axis_context, _sharding_impls.ShardingContext):
        return axis_context.num_devices == 1, None
    return False, None


def _cpu_lowering(ctx: Any, words: Any, *, dtype: np.dtype) -> Any:
    ok, sharding = _single_callback(ctx)
    if not ok:
        return _default_lowering(ctx, words, dtype=dtype)
    result, _, _ = mlir.emit_python_callback(
        ctx, functools.partial(_numpy_sort, dtype=dtype), None, [words], ctx.avals_in, ctx.avals_out,
        has_side_effect=False, returns_token=False, sharding=sharding)
    return result


_default_lowering = mlir.lower_fun(_sort_words, multiple_results=False)
_sort_p.def_impl(_sort_words)
_sort_p.def_abstract_eval(_abstract)
batching.primitive_batchers[_sort_p] = _batched
mlir.register_lowering(_sort_p, _default_lowering)
mlir.register_lowering(_sort_p, _cpu_lowering, platform="cpu")

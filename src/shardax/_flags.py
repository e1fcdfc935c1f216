"""A mapped kernel's error flags as one int32 vector, so the host reads them back with one transfer.

A global function returns counts (rows a buffer needed, rows that are not finite) and bounds (the positions' span)
that its wrapper checks on the host after the call. Each separate output is a device-to-host copy of its own, and
on a GPU every copy waits on its own; packed, they are one.

    flags = pack(needed, nonfinite, lower, upper)                      # inside the program
    needed, nonfinite, lower, upper = unpack(flags, 1, 1, (3, dtype), (3, dtype))    # on the host

Counts travel as int32 (bools as 0/1), floats as their bits (a float64 as two words), so nothing is rounded.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer


def pack(*flags: Any) -> jax.Array:
    """Inside a program: ``flags`` (integer, bool or floating arrays of any shape, flattened in order) as one int32
    vector, floats as their bits."""
    words = []
    for flag in flags:
        flag = jnp.ravel(jnp.asarray(flag))
        if jnp.issubdtype(flag.dtype, jnp.floating):
            words.append(jnp.ravel(lax.bitcast_convert_type(flag, jnp.int32)) if flag.dtype.itemsize >= 4 else
                         lax.bitcast_convert_type(flag.astype(jnp.float32), jnp.int32))
        else:
            words.append(flag.astype(jnp.int32))
    return jnp.concatenate(words)


def unpack(words: Any, *layout: int | tuple[int, Any]) -> list[np.ndarray]:
    """On the host: the flags of :func:`pack` from its vector (one transfer), each a 1D array: ``n`` int32 entries
    for an int ``n`` in ``layout``, ``n`` floats of ``dtype`` for ``(n, dtype)`` (float16 and bfloat16 travel as
    float32)."""
    host = np.ascontiguousarray(np.asarray(jax.device_get(words), dtype=np.int32).reshape(-1))
    out, at = [], 0
    for entry in layout:
        size, dtype = (entry, None) if isinstance(entry, int) else (entry[0], np.dtype(entry[1]))
        width = 2 if dtype is not None and dtype.itemsize == 8 else 1
        part = host[at:at + size * width]
        at += size * width
        if dtype is None:
            out.append(part)
        else:
            out.append(part.view(np.float64 if width == 2 else np.float32))
    if at != host.size:
        raise ValueError(f"unpack: {host.size} words for flags of layout {layout}")
    return out


def is_traced(words: Any) -> bool:
    """Whether the flags are traced (the global function was called inside an outer ``jit``: nothing to check)."""
    return isinstance(words, Tracer)


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _to_words(x: jax.Array) -> jax.Array:
    """``x``'s bits as a flat ``uint32`` vector (8-byte elements as two words, narrower ones widened)."""
    if x.dtype == jnp.bool_:
        return jnp.ravel(x).astype(jnp.uint32)
    width = x.dtype.itemsize
    if width == 8:
        return jnp.ravel(lax.bitcast_convert_type(x, jnp.uint32))
    return jnp.ravel(lax.bitcast_convert_type(x, _UNSIGNED[width])).astype(jnp.uint32)


def _from_words(words: jax.Array, like: jax.Array) -> jax.Array:
    """`(size, words)` from :func:`_to_words` of arrays like ``like``, back as `(size, *like.shape)`."""
    size = words.shape[0]
    if like.dtype == jnp.bool_:
        return (words != 0).reshape(size, *like.shape)
    width = like.dtype.itemsize
    if width == 8:
        return lax.bitcast_convert_type(words.reshape(size, *like.shape, 2), like.dtype)
    narrow = words.astype(_UNSIGNED[width]).reshape(size, *like.shape)
    return lax.bitcast_convert_type(narrow, like.dtype)


def gather_together(arrays: Any, deps: Any = ()) -> list[jax.Array]:
    """Inside a mapped kernel: every device's ``arrays`` (any shapes and dtypes), `(size, *shape)` each, from one
    all-gather over the context's axes, whose input is computed after every array of ``deps``.

    One collective instead of one per array: across processes each costs milliseconds, and collectives that do not
    depend on each other may run in different orders on different devices of a program read back from a
    compilation cache, and wait for each other for ever (:mod:`shardax._order`).
    """
    from ._order import after
    from .comm import allgather

    arrays = [jnp.asarray(a) for a in arrays]
    words = [_to_words(a) for a in arrays]
    every = allgather(after(jnp.concatenate(words), deps))  # (size, words)
    out, at = [], 0
    for a, w in zip(arrays, words, strict=True):
        out.append(_from_words(every[:, at:at + w.shape[0]], a))
        at += w.shape[0]
    return out


def across(deps: Any, *, maximum: Any = (), total: Any = (), minimum: Any = ()) -> tuple[list[jax.Array], ...]:
    """Inside a mapped kernel: per-device flags combined over every device of the context in one all-gather
    (:func:`gather_together`), computed after every array of ``deps`` (the kernel's results: the checks' one
    collective then follows the kernel's last one).

    ``maximum`` and ``total`` are integer or bool arrays (their largest value and their sum over the devices, as
    int32), ``minimum`` floating arrays (their smallest value, a NaN winning, in their dtype).

    Returns:
        ``(maxima, totals, minima)``: lists of arrays with the shapes of the inputs, the same on every device.
    """
    ints = [jnp.asarray(x).astype(jnp.int32) for x in (*maximum, *total)]
    floats = [jnp.asarray(x) for x in minimum]
    every = gather_together([*ints, *floats], deps)
    cut = len(maximum)
    maxima = [jnp.max(e, axis=0) for e in every[:cut]]
    totals = [jnp.sum(e, axis=0, dtype=jnp.int32) for e in every[cut:len(ints)]]
    minima = [jnp.min(e, axis=0) for e in every[len(ints):]]
    return maxima, totals, minima

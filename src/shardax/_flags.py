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

"""Start indices for ``lax.dynamic_slice`` and ``dynamic_update_slice`` in the local-view kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def index(*starts: jax.Array | int) -> tuple[jax.Array, ...]:
    """Start indices for ``lax.dynamic_slice`` as int32 (Python ints would be int64 when x64 is enabled)."""
    return tuple(jnp.asarray(s, jnp.int32) for s in starts)

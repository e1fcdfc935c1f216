"""Typing helpers: manual-axis variance of loop carries and ``cond`` branches, and int32 slice indices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _varying(x: jax.Array) -> frozenset[str]:
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(axis_type, "varying", ()))


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` marked as varying over every manual axis that ``like`` varies over (a no-op outside ``smap``)."""
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def index(*starts: jax.Array | int) -> tuple[jax.Array, ...]:
    """Start indices for ``lax.dynamic_slice`` as int32 (Python ints would be int64 when x64 is enabled)."""
    return tuple(jnp.asarray(s, jnp.int32) for s in starts)

"""Manual-axis typing helper: loop carries and ``cond`` branches must agree on which mesh axes a value varies over."""

from __future__ import annotations

import jax
from jax import lax


def _varying(x: jax.Array) -> frozenset[str]:
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(axis_type, "varying", ()))


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` marked as varying over every manual axis that ``like`` varies over (a no-op outside ``smap``)."""
    missing = tuple(sorted(_varying(like) - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x

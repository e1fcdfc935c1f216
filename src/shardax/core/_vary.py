"""Manual-axis variance inside ``smap``: which mesh axes a value varies over, and casting it to vary over more.

Loop carries and ``cond`` branches must keep one type, and a value that starts replicated (a zero, an identity) but
is updated from device-dependent data varies after the first step: it has to be marked varying from the start.
Everything here is a no-op outside ``smap``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import jax
from jax import lax

T = TypeVar("T")


def varying(x: Any) -> frozenset[str]:
    """The manual mesh axes the array ``x`` varies over (empty outside ``smap``)."""
    axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(axis_type, "varying", ()))


def vary_over(tree: T, axes: Iterable[str]) -> T:
    """Every leaf of ``tree`` marked as varying over ``axes`` (on top of what it already varies over)."""
    axes = frozenset(axes)

    def cast(x: jax.Array) -> jax.Array:
        missing = tuple(sorted(axes - varying(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def vary_like(tree: T, like: jax.Array) -> T:
    """Every leaf of ``tree`` marked as varying over every manual axis that ``like`` varies over."""
    return vary_over(tree, varying(like))

"""Positions against their periodic box: data made in another box is an error, not something to wrap silently.

A kernel given a periodic ``box`` wraps positions into ``[0, box)``. Particles that drifted slightly out of the box
(a time step, rounding) are meant to be wrapped; positions far outside it mean the box does not belong to the data
(a catalogue in a 420 box passed ``box=210``), and wrapping them gives wrong answers without a word. So positions
must lie within :data:`BOX_TOLERANCE` box lengths of ``[0, box)`` on every axis: ``-box / 4 <= x < 5 box / 4``.

Checked on concrete arrays only: in the local view eagerly; in the global view the kernel's own program returns the
positions' span (:func:`mapped_bounds`, two tiny all-reduced outputs) and the wrapper checks it on the host after the
call, before its other error checks, so a box that does not fit the data is reported as that and not as an overflow
(:func:`check_global` is the same check as a separate small program, for callers without a kernel of their own).
Inside a user's ``jax.jit`` the positions are traced and nothing can be checked: positions outside the box are then
wrapped as before.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _flags
from .core import ALL, default_mesh, smap

BOX_TOLERANCE = 0.25  # box lengths a position may lie outside [0, box) and still be wrapped


def _box_values(box: Any, dim: int) -> np.ndarray | None:
    """``box`` as ``(dim,)`` float64, or ``None`` for no box or a box the kernel's own checks will refuse."""
    if box is None or isinstance(box, Tracer | bool | str):
        return None
    try:
        given = np.asarray(box, np.float64)
        values = np.broadcast_to(given if given.ndim == 0 else given.reshape(-1), (dim,))
    except (TypeError, ValueError):
        return None
    return values if np.all(np.isfinite(values) & (values > 0)) else None


def check_bounds(lower: np.ndarray, upper: np.ndarray, box: Any, where: str) -> None:
    """Raise ``ValueError`` when positions spanning ``lower``-``upper`` (per axis, finite valid rows) do not fit
    ``box`` with the tolerance; no-op without a usable box or without rows (``lower > upper``)."""
    lower, upper = np.asarray(lower, np.float64), np.asarray(upper, np.float64)
    values = _box_values(box, lower.shape[-1])
    if values is None or not np.all(lower <= upper):
        return
    outside = (lower < -BOX_TOLERANCE * values) | (upper >= (1 + BOX_TOLERANCE) * values)
    if outside.any():
        axis = int(np.argmax(outside))
        shown = box if np.ndim(box) == 0 else tuple(np.asarray(box).tolist())
        raise ValueError(
            f"{where}: the positions do not fit the periodic box {shown}: on axis {axis} they span "
            f"[{lower[axis]:.6g}, {upper[axis]:.6g}] (extent {upper[axis] - lower[axis]:.6g}), but positions must lie "
            f"in [0, {values[axis]:.6g}) (up to {BOX_TOLERANCE:g} box outside, which is wrapped). Pass the box the "
            "data was made in, or wrap the positions into the box first (pos % box)")


def _valid_rows(pos: jax.Array, num: Any) -> jax.Array:
    rows = jnp.arange(pos.shape[-2], dtype=jnp.int32)
    return (rows < jnp.asarray(num, jnp.int32)[..., None]) & jnp.all(jnp.isfinite(pos), axis=-1)


# Rows folded into one line of the per-axis reductions (at most; a power of two dividing the row count).
_FOLD = 64


def _per_axis(x: jax.Array, op: Any) -> jax.Array:
    """``op`` (``jnp.min`` / ``jnp.max``) over the rows of ``x`` (`(..., d)`), per axis.

    The rows are folded ``k`` at a time into lines of ``k * d`` values before the reduction: a GPU reduces the
    columns of a ``(rows, 3)`` array about three times slower than those of a ``(rows / 64, 192)`` one (10 million
    rows, one H100). Min and max are exact, so the result is the same.
    """
    d = x.shape[-1]
    x = x.reshape(-1, d)
    k = 1
    while k < _FOLD and x.shape[0] % (2 * k) == 0:
        k *= 2
    return op(op(x.reshape(x.shape[0] // k, k * d), axis=0).reshape(k, d), axis=0)


def _reduce(pos: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Count of valid finite rows and their per-axis min and max (``inf``/``-inf`` without rows)."""
    mask = valid[..., None]
    lower = _per_axis(jnp.where(mask, pos, jnp.inf), jnp.min)
    upper = _per_axis(jnp.where(mask, pos, -jnp.inf), jnp.max)
    return jnp.sum(valid, dtype=jnp.int32), lower, upper


def check_local(pos: Any, valid: Any, box: Any, where: str) -> None:
    """:func:`check_bounds` for concrete local-view positions ``pos (n, d)`` with a valid-row mask; no-op when
    either is traced or without a box."""
    if box is None or isinstance(pos, Tracer) or isinstance(valid, Tracer):
        return
    pos = jnp.asarray(pos)
    if not jnp.issubdtype(pos.dtype, jnp.floating) or pos.ndim != 2:
        return
    lower, upper = _local_bounds(pos, jnp.asarray(valid))
    check_bounds(np.asarray(lower), np.asarray(upper), box, where)


@jax.jit
def _local_bounds(pos: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-axis min and max of the valid finite rows of ``pos``: one program for the eager checks (operation by
    operation, each of the six would compile and dispatch one of its own)."""
    _, lower, upper = _reduce(pos, valid & jnp.all(jnp.isfinite(pos), axis=-1))
    return lower, upper


def check_part(part: Any, box: Any, where: str) -> None:
    """:func:`check_local` for a local-view particle pytree (``.pos (n, d)``, scalar ``.num``); no-op for anything
    else (the kernel's own checks name what is wrong with it)."""
    pos, num = getattr(part, "pos", None), getattr(part, "num", None)
    if box is None or pos is None or num is None or jnp.ndim(pos) != 2 or jnp.ndim(num) != 0:
        return
    if isinstance(num, Tracer):
        return
    check_local(pos, jnp.arange(jnp.shape(pos)[0]) < jnp.asarray(num), box, where)


def local_span(pos: jax.Array, num: Any) -> jax.Array:
    """Inside a mapped kernel: ``[lower, -upper]`` (`(2 d,)`), the per-axis min and negated max of this device's
    valid finite rows of ``pos (n, d)`` (``num`` valid rows; ``inf`` without rows). Their minimum over the devices
    (:func:`shardax._flags.across`, with the kernel's other checks in one collective) gives :func:`split_span` the
    data's bounds, for :func:`check_bounds` on the host after the call. Not differentiated (a check, not a
    result)."""
    pos = lax.stop_gradient(pos)
    _, lower, upper = _reduce(pos, _valid_rows(pos, num))
    return jnp.concatenate([lower, -upper])


def split_span(both: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(lower, upper)`` from the minimum over the devices of :func:`local_span`."""
    d = both.shape[-1] // 2
    return both[:d], -both[d:]


def bounds_layout(pos: Any) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """The :func:`shardax._flags.unpack` layout of the two bounds a kernel packs (:func:`split_span`) for
    positions like ``pos``."""
    entry = (int(jnp.shape(pos)[-1]), jnp.result_type(pos))
    return entry, entry


def local_checks(pos: jax.Array, num: Any) -> tuple[jax.Array, jax.Array]:
    """Inside a mapped kernel: this device's valid rows of ``pos (n, d)`` with a NaN or infinite coordinate, and
    :func:`local_span`, from one min/max pass over the positions when they are all finite.

    A NaN reaches the min or max and an infinite coordinate is one of them, so finite bounds prove every valid row
    finite; only otherwise does a second pass count the bad rows and take the bounds of the finite ones. Not
    differentiated (a check, not a result).
    """
    pos = lax.stop_gradient(pos)
    rows = jnp.arange(pos.shape[-2], dtype=jnp.int32)
    listed = rows < jnp.asarray(num, jnp.int32)
    lower = _per_axis(jnp.where(listed[:, None], pos, jnp.inf), jnp.min)
    upper = _per_axis(jnp.where(listed[:, None], pos, -jnp.inf), jnp.max)
    clean = ~jnp.any(jnp.isnan(lower) | jnp.isnan(upper) | (lower == -jnp.inf) | (upper == jnp.inf))

    def recount(pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        valid = _valid_rows(pos, num)
        _, low, high = _reduce(pos, valid)
        return jnp.sum(listed & ~valid, dtype=jnp.int32), low, high

    zero = jnp.sum(listed & False, dtype=jnp.int32)  # (varying over the mapped axes, like the count)
    bad, lower, upper = lax.cond(clean, lambda pos: (zero, lower, upper), recount, pos)
    return bad, jnp.concatenate([lower, -upper])


@functools.lru_cache(maxsize=32)
def _global_fn(mesh: Mesh) -> Any:
    def body(pos: jax.Array, num: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        count, lower, upper = _reduce(pos, _valid_rows(pos, num))
        _, (total,), (both,) = _flags.across((), total=[count], minimum=[jnp.concatenate([lower, -upper])])
        return (total, *split_span(both))

    return smap(body, in_specs=(ALL, ALL), out_specs=(P(), P(), P()), mesh=mesh, jit=True,
                name="particle bounds")


def _host(x: jax.Array) -> np.ndarray:
    """A replicated output on the host (every process holds a copy)."""
    return np.asarray(x.addressable_data(0))


def global_summary(part: Any, mesh: Mesh | None = None) -> tuple[int, np.ndarray, np.ndarray] | None:
    """``(count, lower, upper)`` of global particle arrays (``pos (ndev, n, d)``, ``num (ndev,)``): valid finite
    rows over every device, their per-axis min and max. One small distributed call (collective: every process
    must call it); ``None`` when the arrays are traced or not float."""
    pos, num = part.pos, part.num
    if isinstance(pos, Tracer) or isinstance(num, Tracer) or jnp.ndim(pos) != 3 or jnp.ndim(num) != 1:
        return None
    if jnp.result_type(pos) not in (jnp.float32, jnp.float64):
        return None
    if mesh is None:
        sharding = getattr(pos, "sharding", None)
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) else None
    count, lower, upper = _global_fn(default_mesh(mesh))(pos, num)
    return int(_host(count)), _host(lower), _host(upper)


def check_global(part: Any, box: Any, where: str, mesh: Mesh | None = None) -> int | None:
    """:func:`check_bounds` for global particle arrays (collective, see :func:`global_summary`); returns the total
    count of valid finite rows (``None`` when traced). Without a box nothing runs."""
    if box is None:
        return None
    summary = global_summary(part, mesh)
    if summary is None:
        return None
    count, lower, upper = summary
    check_bounds(lower, upper, box, where)
    return count

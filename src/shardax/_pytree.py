"""The duck-typed particle interface every particle kernel accepts (particles, spatial, fields, io).

A particle set is any pytree with a ``.pos`` leaf of shape ``(n, d)`` and a ``.num`` count of valid rows; rows
``>= num`` are padding. Every leaf whose leading length equals ``n`` is a per-particle field and travels with its
particle; other leaves (``num``, a scalar mass, a box size, ...) stay where they are. These helpers read, check and
rebuild such pytrees without knowing their type (``shardax.particles.Particles``, a NamedTuple, any dataclass).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

T = TypeVar("T")


def particle_set(part: Any, where: str, *, name: str = "part", dims: tuple[int, ...] = (2, 3),
                 global_view: str | None = None) -> Any:
    """``part`` when it is a particle pytree (``.pos``, ``.num``); a plain `(n, d)` position array as a
    ``shardax.particles.Particles`` without fields, every row valid (the kernels' plain-array input).

    ``where`` names the kernel in errors (``"fof"``), ``name`` the argument, ``dims`` the dimensions it takes and
    ``global_view`` what takes global ``(ndev, n, d)`` arrays (default ``where + ".smap"``). A pytree is returned
    as is: the kernel checks its fields. Raises ``TypeError`` for anything else and for non-float positions,
    ``ValueError`` for a plain array of the wrong shape.
    """
    if hasattr(part, "pos") and hasattr(part, "num"):
        return part
    if not isinstance(part, jax.Array | np.ndarray):
        raise TypeError(f"{where}: {name} must be a particle pytree with .pos and .num (e.g. shardax.particles."
                        f"Particles) or an (n, d) array of positions, got {type(part).__name__}")
    if part.ndim != 2 or part.shape[1] not in dims:
        shapes = " or ".join(f"(n, {d})" for d in dims)
        raise ValueError(f"{where}: {name} as a plain array must have shape {shapes} (local view; one row per "
                         f"particle), got {part.shape}. Global (ndev, n, d) arrays go through "
                         f"{global_view or where + '.smap'}.")
    if part.dtype not in (np.float32, np.float64):
        raise TypeError(f"{where}: {name} must hold float32 or float64 positions, got dtype {part.dtype}; cast it "
                        f"with {name}.astype(jnp.float32)")
    from .core import vary_like  # (the mapped-body helpers and the particle data model sit above this module)
    from .particles import Particles

    pos = jnp.asarray(part)
    return Particles(pos=pos, num=vary_like(jnp.int32(part.shape[0]), pos))


def spare_rows(n: int) -> int:
    """Rows the distributed kernels add to each device's ``n`` rows of a plain position array (which has none to
    spare) for the uneven pieces of their z-order sort on several devices."""
    return n // 8 + 64


def row_count(part: Any) -> int:
    """Leading length (capacity) of ``part.pos``; raises ``TypeError`` when ``part`` is not a particle pytree."""
    pos = getattr(part, "pos", None)
    if pos is None or not hasattr(part, "num"):
        raise TypeError(f"expected a particle pytree with .pos and .num fields (e.g. shardax.particles.Particles), "
                        f"got {type(part).__name__}")
    if jnp.ndim(pos) < 1:
        raise ValueError(f"part.pos must have a leading row axis, got shape {jnp.shape(pos)}")
    return int(jnp.shape(pos)[0])


def check_positions(part: Any, where: str) -> tuple[int, int]:
    """``(n, d)`` of a local-view particle set, with clear errors for wrong shapes and dtypes."""
    n = row_count(part)
    pos = part.pos
    if jnp.ndim(pos) != 2 or jnp.shape(pos)[1] not in (2, 3):
        raise ValueError(f"{where}: part.pos must have shape (n, 2) or (n, 3) (local view; one row per particle), "
                         f"got {jnp.shape(pos)}. Global (ndev, n, d) arrays go through the .smap version.")
    if jnp.result_type(pos) not in (jnp.float32, jnp.float64):
        raise TypeError(f"{where}: part.pos must be a floating-point array of float32 or float64, got dtype "
                        f"{jnp.result_type(pos)}; cast it with pos.astype(jnp.float32)")
    if jnp.ndim(part.num) != 0:
        raise ValueError(f"{where}: part.num must be a scalar count in the local view, got shape "
                         f"{jnp.shape(part.num)}")
    check_count(part.num, n, where)
    return n, int(jnp.shape(pos)[1])


def check_global(part: Any, where: str, local: str, name: str = "part") -> Any:
    """The positions ``(ndev, n, d)`` of a global-view particle pytree (counts in range) or of a plain
    ``(ndev, n, d)`` float array (every row a particle: the mapped body takes each device's block through
    :func:`particle_set`), with clear errors for anything else; ``local`` names the local-view function to call
    instead."""
    if isinstance(part, jax.Array | np.ndarray):
        if part.ndim != 3:
            raise ValueError(f"{where}: {name} as a plain array must have shape (ndev, n, d) (global view), got "
                             f"{part.shape}; call {local}() for the local view")
        if part.dtype not in (np.float32, np.float64):
            raise TypeError(f"{where}: {name} must hold float32 or float64 positions, got dtype {part.dtype}; cast "
                            f"it with {name}.astype(jnp.float32)")
        return part
    if getattr(part, "pos", None) is None or not hasattr(part, "num"):
        raise TypeError(f"{where}: {name} must be a global particle pytree with .pos and .num or an (ndev, n, d) "
                        f"array of positions, got {type(part).__name__}")
    if jnp.ndim(part.pos) != 3:
        raise ValueError(f"{where}: {name}.pos must have shape (ndev, n, d) (e.g. from shardax.particles."
                         f"from_numpy), got {jnp.shape(part.pos)}; call {local}() for the local view")
    check_count(part.num, int(jnp.shape(part.pos)[1]), where, f"{name}.num")
    return part.pos


def check_count(num: Any, n: int, where: str, name: str = "part.num") -> None:
    """Raise ``ValueError`` when a concrete particle count (a scalar, or one per device in the global view) lies
    outside ``[0, n]``. Traced counts (inside ``jit``) cannot be checked here; kernels clip them to ``[0, n]``.
    Only this process's shards of a multi-process array are read."""
    if isinstance(num, Tracer):
        return
    if isinstance(num, jax.Array) and not num.is_fully_addressable:
        values = np.concatenate([np.ravel(np.asarray(s.data)) for s in num.addressable_shards] + [np.zeros((0,))])
    else:
        values = np.ravel(np.asarray(num))
    bad = values[(values < 0) | (values > n)]
    if bad.size:
        raise ValueError(f"{where}: {name} must count valid rows, between 0 and the capacity {n} (rows of "
                         f"{name.rsplit('.', 1)[0]}.pos), got {bad[0]}; set it to the number of filled rows, or pad "
                         f"the fields to hold that many")


def is_row_leaf(leaf: Any, n: int) -> bool:
    """Whether ``leaf`` is a per-particle field of a set of capacity ``n``."""
    return jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] == n


def map_rows(fn: Callable[[jax.Array], jax.Array], part: T, n: int | None = None) -> T:
    """Apply ``fn`` to every per-particle leaf of ``part`` (leading length ``n``, default ``len(part.pos)``)."""
    n = row_count(part) if n is None else n
    num = part.num  # type: ignore[attr-defined]

    def apply(leaf: Any) -> Any:
        if leaf is num or not is_row_leaf(leaf, n):
            return leaf
        return fn(jnp.asarray(leaf))

    return jax.tree.map(apply, part)


def replace_field(part: T, name: str, value: Any) -> T:
    """``part`` with field ``name`` replaced (dataclasses, namedtuples, or any pytree where that field is a leaf)."""
    if dataclasses.is_dataclass(part) and not isinstance(part, type):
        return dataclasses.replace(part, **{name: value})  # type: ignore[type-var]
    if hasattr(part, "_replace"):
        return part._replace(**{name: value})  # type: ignore[attr-defined]
    old = getattr(part, name)
    leaves, treedef = jax.tree.flatten(part)
    hits = [i for i, leaf in enumerate(leaves) if leaf is old]
    if len(hits) != 1:
        raise TypeError(f"cannot replace .{name} of a {type(part).__name__}: use a dataclass or a NamedTuple")
    leaves[hits[0]] = value
    return jax.tree.unflatten(treedef, leaves)


def with_num(part: T, num: jax.Array) -> T:
    """``part`` with its ``.num`` replaced."""
    return replace_field(part, "num", num)


def pad(part: T, extra: int) -> T:
    """Append ``extra`` padding rows (zeros) to every per-particle field; ``num`` is unchanged.

    Args:
        part: a particle pytree in the local view (``pos (n, d)``).
        extra: number of rows to add (a non-negative Python int).

    Returns:
        The same pytree with per-particle fields of leading length ``n + extra``.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardax.particles import Particles, pad
        >>> pad(Particles(pos=jnp.ones((4, 3)), num=jnp.int32(4)), 2).pos.shape
        (6, 3)
    """
    if not isinstance(extra, int) or isinstance(extra, bool) or extra < 0:
        raise ValueError(f"extra must be a non-negative Python int (rows to add), got {extra!r}")
    n = row_count(part)
    if extra == 0:
        return part
    return map_rows(lambda a: jnp.concatenate([a, jnp.zeros((extra, *a.shape[1:]), a.dtype)]), part, n)


def pad_global(part: T, extra: int) -> T:
    """:func:`pad` for a global set on this process's devices (fields ``(ndev, n, ...)``, fully addressable):
    ``extra`` zero rows appended to every device's block of every per-particle field."""
    rows = int(jnp.shape(part.pos)[1])  # type: ignore[attr-defined]
    num = part.num  # type: ignore[attr-defined]

    def apply(leaf: Any) -> Any:
        if leaf is num or jnp.ndim(leaf) < 2 or jnp.shape(leaf)[1] != rows:
            return leaf
        return jnp.concatenate([leaf, jnp.zeros((leaf.shape[0], extra, *leaf.shape[2:]), leaf.dtype)], axis=1)

    return jax.tree.map(apply, part)


def valid_mask(part: Any) -> jax.Array:
    """`(n,)` bool: which rows of ``part`` hold particles (``row < num``)."""
    n = row_count(part)
    return jnp.arange(n, dtype=jnp.int32) < jnp.asarray(part.num, jnp.int32)

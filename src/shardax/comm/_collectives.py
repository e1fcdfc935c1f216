"""MPI-style collectives for the local view (inside ``smap``/``shard_map``), on any mesh and any backend.

Every function takes ``axis=None`` (every manual mesh axis of the context), a mesh axis name, or a tuple of names;
ranks are linear over those axes in mesh order (row-major), as :func:`shardax.rank_info` numbers them. Outside any
``smap`` every axis has size 1 and each collective reduces to its identity (``allreduce(x) == x``, ...), so local-view
code runs unchanged on one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from .. import _mpi_prim as mpi
from ..core import AxisSpec, axes_index, axes_size, resolve_axes

try:  # Varying -> invariant gather: every rank provably holds the same result (out_specs P() type-checks).
    from jax._src.lax.parallel import all_gather_invariant as _all_gather
except ImportError:  # pragma: no cover - older/newer JAX without it
    _all_gather = lax.all_gather

ReduceOp = Literal["sum", "max", "min", "prod"]
_OPS: tuple[str, ...] = ("sum", "max", "min", "prod")


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")


def _check_root(root: int, size: int) -> None:
    if not isinstance(root, int) or isinstance(root, bool):
        raise TypeError(f"root must be a Python int (a static rank), got {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"root={root} is outside [0, {size}) (the number of ranks along the axis)")


def allreduce(x: jax.Array, op: ReduceOp = "sum", *, axis: AxisSpec = None) -> jax.Array:
    """Reduce ``x`` elementwise over the ranks; every rank gets the result (``MPI_Allreduce``).

    Args:
        x: any shape; the same shape on every rank.
        op: ``"sum"``, ``"max"``, ``"min"`` or ``"prod"``. ``"sum"`` is differentiable.
        axis: the mesh axes to reduce over (default: all manual axes).

    Returns:
        The reduction, shape of ``x``, identical on every rank.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> total = sx.smap(lambda: sx.comm.allreduce(jnp.ones(3)), in_specs=(), out_specs=P())()
        >>> total.tolist() == [float(sx.world().device_count)] * 3
        True
    """
    _check_op(op)
    axes = resolve_axes(axis)
    x = jnp.asarray(x)
    if not axes:
        return x
    if mpi.mpi_active(axes):
        return mpi.allreduce(x, op, axes)
    if op == "sum":
        return lax.psum(x, axes)
    if op == "max":
        return lax.pmax(x, axes)
    if op == "min":
        return lax.pmin(x, axes)
    return jnp.prod(_all_gather(x, axes), axis=0).astype(x.dtype)


def allgather(x: jax.Array, *, tiled: bool = False, axis: AxisSpec = None) -> jax.Array:
    """Every rank's ``x``, stacked by rank (``MPI_Allgather``).

    Args:
        x: shape ``(n, ...)``, the same on every rank.
        tiled: concatenate along axis 0 (``(size * n, ...)``) instead of stacking (``(size, n, ...)``).
        axis: the mesh axes to gather over.

    Returns:
        ``(size, *x.shape)``, or ``(size * n, ...)`` if ``tiled``; row ``r`` holds rank ``r``'s ``x``.

    Example:
        >>> import shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> ranks = sx.smap(lambda: sx.comm.allgather(sx.rank_info().rank), in_specs=(), out_specs=P())()
        >>> ranks.tolist() == list(range(sx.world().device_count))
        True
    """
    axes = resolve_axes(axis)
    x = jnp.asarray(x)
    if tiled and x.ndim == 0:
        raise ValueError("allgather(tiled=True) needs x with at least one dimension; got a scalar")
    if not axes:
        return x if tiled else x[None]
    if mpi.mpi_active(axes):
        return mpi.allgather(x, axes, tiled=tiled)
    return _all_gather(x, axes, tiled=tiled)


def alltoall(x: jax.Array, *, axis: AxisSpec = None) -> jax.Array:
    """Personalised exchange: row ``d`` of ``x`` goes to rank ``d``; row ``s`` of the result came from rank ``s``.

    Args:
        x: shape ``(size, ...)``: the leading dimension must equal the number of ranks.
        axis: the mesh axes to exchange over.

    Returns:
        Shape of ``x``.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> def f():
        ...     rank, size, _ = sx.rank_info()
        ...     return sx.comm.alltoall(rank * 100 + jnp.arange(size))   # row d = 100 * rank + d
        >>> out = sx.smap(f, in_specs=(), out_specs=P(sx.ALL))()
        >>> int(out[1, 0])   # rank 1 received from rank 0 the value 100 * 0 + 1
        1
    """
    axes = resolve_axes(axis)
    size = axes_size(axes)
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(f"alltoall needs x with leading dimension equal to the number of ranks ({size}), got shape "
                         f"{x.shape}; reshape to ({size}, n, ...) with row d destined for rank d")
    if not axes:
        return x
    if mpi.mpi_active(axes):
        return mpi.alltoall(x, axes)
    return lax.all_to_all(x, axes, 0, 0, tiled=True)


def bcast(x: jax.Array, root: int = 0, *, axis: AxisSpec = None) -> jax.Array:
    """Rank ``root``'s ``x`` on every rank (``MPI_Bcast``); differentiable.

    Example:
        >>> import shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> out = sx.smap(lambda: sx.comm.bcast(sx.rank_info().rank + 5, root=0), in_specs=(), out_specs=P(sx.ALL))()
        >>> set(out.tolist())
        {5}
    """
    axes = resolve_axes(axis)
    size = axes_size(axes)
    _check_root(root, size)
    x = jnp.asarray(x)
    if not axes:
        return x
    if x.dtype == jnp.bool_:
        return bcast(x.astype(jnp.int32), root, axis=axes).astype(jnp.bool_)
    mine = axes_index(axes) == root
    return allreduce(jnp.where(mine, x, jnp.zeros_like(x)), axis=axes)


def gather(x: jax.Array, root: int = 0, *, axis: AxisSpec = None) -> jax.Array:
    """Every rank's ``x`` stacked on rank ``root`` (``MPI_Gather``).

    Returns:
        ``(size, *x.shape)``: the stacked values on ``root``, zeros on every other rank (shapes are static in JAX,
        so every rank returns the same shape).
    """
    axes = resolve_axes(axis)
    _check_root(root, axes_size(axes))
    stacked = allgather(x, axis=axes)
    if not axes:
        return stacked
    return jnp.where(axes_index(axes) == root, stacked, jnp.zeros_like(stacked))


def scatter(x: jax.Array, root: int = 0, *, axis: AxisSpec = None) -> jax.Array:
    """Rank ``r`` receives row ``r`` of rank ``root``'s ``x`` (``MPI_Scatter``).

    Args:
        x: shape ``(size, ...)`` (only ``root``'s value matters).

    Returns:
        ``x.shape[1:]``.
    """
    axes = resolve_axes(axis)
    size = axes_size(axes)
    _check_root(root, size)
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(f"scatter needs x with leading dimension equal to the number of ranks ({size}), got shape "
                         f"{x.shape}")
    if not axes:
        return x[0]
    # Each rank sends its rows to their ranks; only the rows that came from root are kept.
    received = alltoall(x, axis=axes)
    return received[root]


def reduce(x: jax.Array, op: ReduceOp = "sum", root: int = 0, *, axis: AxisSpec = None) -> jax.Array:
    """The reduction of ``x`` over ranks on rank ``root``, zeros elsewhere (``MPI_Reduce``)."""
    axes = resolve_axes(axis)
    _check_root(root, axes_size(axes))
    total = allreduce(x, op, axis=axes)
    if not axes:
        return total
    return jnp.where(axes_index(axes) == root, total, jnp.zeros_like(total))


def scan(x: jax.Array, op: ReduceOp = "sum", *, inclusive: bool = True, axis: AxisSpec = None) -> jax.Array:
    """Prefix reduction over ranks (``MPI_Scan``; ``MPI_Exscan`` with ``inclusive=False``).

    Rank ``r`` gets ``op(x_0, ..., x_r)`` (inclusive) or ``op(x_0, ..., x_{r-1})`` (exclusive; rank 0 gets the
    identity of ``op``). Memory is ``size * |x|`` (it gathers ``x``): meant for counts and small arrays.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> offsets = sx.smap(lambda: sx.comm.scan(jnp.int32(2), inclusive=False), in_specs=(), out_specs=P(sx.ALL))()
        >>> offsets.tolist() == [2 * r for r in range(sx.world().device_count)]
        True
    """
    _check_op(op)
    axes = resolve_axes(axis)
    x = jnp.asarray(x)
    stacked = allgather(x, axis=axes)
    size = stacked.shape[0]
    if op == "sum":
        acc = jnp.cumsum(stacked, axis=0, dtype=x.dtype)
        identity = jnp.zeros_like(x)
    elif op == "prod":
        acc = jnp.cumprod(stacked, axis=0, dtype=x.dtype)
        identity = jnp.ones_like(x)
    elif op == "max":
        acc = lax.cummax(stacked, axis=0)
        identity = jnp.full_like(x, _lowest(x.dtype))
    else:
        acc = lax.cummin(stacked, axis=0)
        identity = jnp.full_like(x, _highest(x.dtype))
    rank = axes_index(axes)
    if inclusive:
        return acc[rank]
    return jnp.where(rank == 0, identity, acc[jnp.maximum(rank - 1, 0)]) if size > 1 else identity


def _lowest(dtype: jnp.dtype) -> float | int | bool:
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf
    if dtype == jnp.bool_:
        return False
    return int(jnp.iinfo(dtype).min)


def _highest(dtype: jnp.dtype) -> float | int | bool:
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.inf
    if dtype == jnp.bool_:
        return True
    return int(jnp.iinfo(dtype).max)


def shift(x: jax.Array, offset: int = 1, *, periodic: bool = True, axis: AxisSpec = None) -> jax.Array:
    """Rank ``r`` receives rank ``r - offset``'s ``x``, like ``np.roll`` over ranks; differentiable.

    With ``periodic=False`` the ranks with no source (``r - offset`` outside ``[0, size)``) receive zeros.

    Example:
        >>> import shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> out = sx.smap(lambda: sx.comm.shift(sx.rank_info().rank), in_specs=(), out_specs=P(sx.ALL))()
        >>> n = sx.world().device_count
        >>> out.tolist() == [(r - 1) % n for r in range(n)]
        True
    """
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise TypeError(f"offset must be a Python int, got {type(offset).__name__}")
    axes = resolve_axes(axis)
    size = axes_size(axes)
    x = jnp.asarray(x)
    if periodic:
        pairs = [(s, (s + offset) % size) for s in range(size)]
    else:
        pairs = [(s, s + offset) for s in range(size) if 0 <= s + offset < size]
    if not axes:
        return x if pairs else jnp.zeros_like(x)
    if mpi.mpi_active(axes):
        return mpi.permute(x, axes, pairs)
    return lax.ppermute(x, axes, pairs)


def sendrecv(x: jax.Array, pairs: Sequence[tuple[int, int]], *, axis: AxisSpec = None) -> jax.Array:
    """Point-to-point exchange: for each ``(src, dst)`` in ``pairs``, rank ``dst`` receives rank ``src``'s ``x``.

    Ranks that are no destination receive zeros. Each rank may appear at most once as a source and once as a
    destination (several messages between the same ranks are several calls, or one call on stacked data).

    Example:
        >>> import shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> out = sx.smap(lambda: sx.comm.sendrecv(sx.rank_info().rank + 10, [(0, 1)]), in_specs=(),
        ...               out_specs=P(sx.ALL))()
        >>> out.tolist()[:2] == [0, 10] or sx.world().device_count == 1
        True
    """
    axes = resolve_axes(axis)
    size = axes_size(axes)
    checked: list[tuple[int, int]] = []
    for p in pairs:
        if len(p) != 2 or not all(isinstance(r, int) and 0 <= r < size for r in p):
            raise ValueError(f"sendrecv pairs must be (src, dst) ranks in [0, {size}), got {p!r}")
        checked.append((int(p[0]), int(p[1])))
    pairs = checked
    srcs = [p[0] for p in pairs]
    dsts = [p[1] for p in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"sendrecv: each rank may send once and receive once per call, got pairs {pairs}")
    x = jnp.asarray(x)
    if not axes:
        return x if (0, 0) in pairs else jnp.zeros_like(x)
    if mpi.mpi_active(axes):
        return mpi.permute(x, axes, pairs)
    return lax.ppermute(x, axes, pairs)


def barrier(*, axis: AxisSpec = None) -> jax.Array:
    """Synchronise the ranks; returns an int32 zero that later work can depend on.

    XLA orders work by data dependence, so a barrier only orders what depends on its result (add it to a value
    that must not be computed before every rank arrived).
    """
    axes = resolve_axes(axis)
    token = jnp.zeros((), jnp.int32)
    return allreduce(token, axis=axes) if axes else token

"""Variable-size exchange: ``alltoallv`` and ``exchange`` (rows to destination ranks), on every backend.

Both are thin checks over :func:`shardax._alltoallv.alltoallv_many` (the transport choice, the count exchange and
the chunked rounds or ``ragged_all_to_all``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .._alltoallv import Impl, alltoallv_many, use_ragged
from .._exchange import Chunk, ExchangeTuning, check_capacity, check_chunk, default_chunk
from .._pytree import is_row_leaf, with_num
from ..core import AxisSpec, axes_size, resolve_axes, vary_over
from ._grouping import group_by_rank


def alltoallv(x: jax.Array, send_counts: jax.Array, *, capacity: int, axis: AxisSpec = None,
              impl: Impl = "auto", chunk: Chunk = None, tuning: ExchangeTuning | str | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Variable-size all-to-all (``MPI_Alltoallv``) with a fixed-size receive buffer.

    Args:
        x: ``(n, ...)`` rows grouped by destination: the first ``send_counts[0]`` rows go to rank 0, the next
            ``send_counts[1]`` to rank 1, and so on; rows past ``sum(send_counts)`` are ignored.
        send_counts: ``(size,)`` int rows for each rank.
        capacity: rows of the receive buffer (static).
        axis: the mesh axes to exchange over (default: all manual axes).
        impl: ``"auto"`` (``ragged_all_to_all`` on GPU, chunked ``all_to_all`` elsewhere), ``"chunked"`` or
            ``"ragged"``.
        chunk: rows per rank pair and round of the chunked path (default :func:`default_chunk`:
            ``ceil(1.25 * capacity / (8 size))`` on CPU, ``ceil(1.25 * capacity / size)`` on GPU), or a tuple of
            sizes from which each call picks at run time the smallest that moves the largest count in one round
            (e.g. :func:`chunk_ladder`: one collective for traffic whose size varies; each size compiles a loop of
            its own).
        tuning: the default chunk's preset: ``None`` for the backend's (``SHARDAX_TUNING`` overrides), ``"cpu"``,
            ``"gpu"`` or an :class:`ExchangeTuning`.

    Returns:
        ``(data, recv_counts, overflow)``: ``data (capacity, ...)`` holds the received rows packed and grouped by
        source rank in rank order (zeros after them); ``recv_counts (size,)`` int32 rows received from each rank
        (even when they did not all fit); ``overflow`` is true on a rank that received more than ``capacity`` rows
        (the rows past ``capacity`` were not stored: raise ``capacity`` and call again).

    Differentiable in ``x`` (floating dtypes; reverse mode): the gradient is the reverse exchange, each received
    row's cotangent back to the row it came from; rows that did not fit get zero.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> def f():
        ...     rank, size, _ = sx.rank_info()
        ...     counts = jnp.full((size,), 2, jnp.int32)            # two rows for every rank
        ...     rows = jnp.full((2 * size,), rank, jnp.int32)
        ...     return sx.comm.alltoallv(rows, counts, capacity=2 * size)
        >>> data, recv, overflow = sx.smap(f, in_specs=(), out_specs=P(sx.ALL))()
        >>> bool(overflow.any())
        False
    """
    capacity = check_capacity(capacity)
    check_chunk(chunk)
    axes = resolve_axes(axis)
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("alltoallv needs x with a leading row dimension, got a scalar")
    if chunk is None:
        chunk = default_chunk(capacity, axes_size(axes), tuning)
    outs, recv_counts, overflow = alltoallv_many([x], send_counts, capacity, axes, impl, chunk)
    return outs[0], recv_counts, overflow


def _row_count(tree: Any) -> int:
    """Rows of an exchanged pytree: ``len(tree.pos)``, or the first leaf's leading length (any pytree, not only a
    particle set: :func:`shardax._pytree.row_count` asks for ``.pos`` and ``.num``)."""
    pos = getattr(tree, "pos", None)
    if pos is not None:
        return int(jnp.shape(pos)[0])
    leaves = jax.tree.leaves(tree)
    if not leaves or jnp.ndim(leaves[0]) == 0:
        raise ValueError("exchange needs a pytree with a `.pos` field or whose first leaf has a leading row axis")
    return int(jnp.shape(leaves[0])[0])


def exchange(tree: Any, dest: jax.Array, *, num: jax.Array | int, capacity: int, axis: AxisSpec = None,
             impl: Impl = "auto", tuning: ExchangeTuning | str | None = None) -> tuple[Any, jax.Array, jax.Array]:
    """Send each of the first ``num`` rows of a particle pytree to rank ``dest[i]``.

    Every leaf whose leading length equals the row count (that of ``tree.pos``, or of the first leaf) travels with
    its row; other leaves are returned unchanged. Rows arrive packed, grouped by source rank in rank order, each
    source's rows in their original order (the result is deterministic). A ``.num`` field of ``tree`` (dataclass or
    namedtuple) is replaced by the new count.

    Args:
        tree: a pytree such as :class:`shardax.particles.Particles` (rows ``(n, ...)``).
        dest: ``(n,)`` int destination rank of each row (rows ``>= num`` are ignored).
        num: number of valid rows.
        capacity: rows of every travelling leaf after the exchange (static).
        axis: the mesh axes to exchange over.
        impl: as in :func:`alltoallv`.
        tuning: as in :func:`alltoallv`.

    Returns:
        ``(tree, num, overflow)``: leaves with leading length ``capacity``; ``num`` int32 rows now held (at most
        ``capacity``); ``overflow`` true on a rank that received more than ``capacity`` rows, or that was asked to
        send a valid row to a rank outside ``[0, size)`` (such rows are not sent).

    Differentiable in the floating leaves (reverse mode): the gradient is the reverse exchange, each row's
    cotangent back to the row it came from; rows not sent or not stored get zero, integer leaves none.

    Example:
        >>> import jax.numpy as jnp, shardax as sx
        >>> from jax.sharding import PartitionSpec as P
        >>> def f():
        ...     rank, size, _ = sx.rank_info()
        ...     pos = jnp.full((4, 3), rank, jnp.float32)
        ...     dest = jnp.zeros((4,), jnp.int32)                     # everything to rank 0
        ...     return sx.comm.exchange({"pos": pos}, dest, num=4, capacity=4 * size)
        >>> tree, num, overflow = sx.smap(f, in_specs=(), out_specs=P(sx.ALL))()
        >>> int(num[0]) == 4 * sx.world().device_count
        True
    """
    capacity = check_capacity(capacity)
    axes = resolve_axes(axis)
    size = axes_size(axes)
    n = _row_count(tree)
    dest = jnp.asarray(dest)
    if dest.shape != (n,):
        raise ValueError(f"dest must have shape ({n},) (one rank per row of the tree), got {dest.shape}")
    if not jnp.issubdtype(dest.dtype, jnp.integer):
        raise TypeError(f"dest must be an integer array of ranks, got dtype {dest.dtype}")
    num = jnp.minimum(jnp.asarray(num, jnp.int32), n)
    rows = jnp.arange(n, dtype=jnp.int32)
    valid = rows < num
    dest = dest.astype(jnp.int32)
    bad = valid & ((dest < 0) | (dest >= size))
    leaves, treedef = jax.tree.flatten(tree)
    moving = [i for i, leaf in enumerate(leaves) if is_row_leaf(leaf, n)]
    arrays = [jnp.asarray(leaves[i]) for i in moving]
    if size == 1:  # the rows stay: drop the invalid ones and close the gaps (no sort, no collective)
        if axes:
            use_ragged(impl)  # (checks the argument)
        keep = valid & ~bad
        recv_counts = jnp.sum(keep, dtype=jnp.int32)[None]
        at = jnp.where(keep, jnp.cumsum(keep, dtype=jnp.int32) - 1, capacity)
        outs = vary_over([jnp.zeros((capacity, *a.shape[1:]), a.dtype).at[at].set(a, mode="drop") for a in arrays],
                         axes)
        overflow = recv_counts[0] > capacity
    else:
        order, send_counts = group_by_rank(jnp.where(valid & ~bad, dest, size), size)
        outs, recv_counts, overflow = alltoallv_many(arrays, send_counts, capacity, axes, impl,
                                                     default_chunk(capacity, size, tuning), perm=order)
    new_leaves = list(leaves)
    for i, out in zip(moving, outs, strict=True):
        new_leaves[i] = out
    new_num = jnp.minimum(jnp.sum(recv_counts), capacity).astype(jnp.int32)
    overflow = overflow | jnp.any(bad)
    out_tree = jax.tree.unflatten(treedef, new_leaves)
    if hasattr(out_tree, "num"):
        out_tree = with_num(out_tree, new_num)
    return out_tree, new_num, overflow

"""Variable-size exchange: ``alltoallv`` and ``exchange`` (rows to destination ranks), on every backend.

XLA:CPU has no ``ragged_all_to_all``, so the portable path moves rows in fixed-size chunks: each round is one
``all_to_all`` of a ``(size, chunk, ...)`` buffer, ``chunk = ceil(1.25 * capacity / size)``, and the number of rounds is the
largest per-pair count over all ranks divided by ``chunk`` (agreed with one ``pmax``). Balanced traffic takes one round
and moves the same bytes as a tiled ``all_to_all``; skewed traffic (everything to one rank) takes up to ``size``
rounds. Memory stays O(capacity) per device in every case. On GPUs the same call uses ``lax.ragged_all_to_all``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from ..core._rank import AxisSpec, axes_size, resolve_axes

Impl = Literal["auto", "chunked", "ragged"]


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _check_capacity(capacity: Any) -> int:
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"capacity must be a positive Python int (rows of the receive buffer), got {capacity!r}")
    return capacity


def _exchange_counts(send_counts: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    if not axes:
        return send_counts
    return lax.all_to_all(send_counts.reshape(-1, 1), axes, 0, 0, tiled=True).reshape(-1)


def _use_ragged(impl: Impl) -> bool:
    if impl not in ("auto", "chunked", "ragged"):
        raise ValueError(f"impl must be 'auto', 'chunked' or 'ragged', got {impl!r}")
    backend = jax.default_backend()
    if impl == "ragged":
        if backend == "cpu":
            raise ValueError("impl='ragged' needs a GPU or TPU backend (XLA:CPU does not implement "
                             "ragged_all_to_all): use impl='auto' or impl='chunked'")
        return True
    return impl == "auto" and backend in ("gpu", "cuda", "rocm")


def _chunked(arrays: Sequence[jax.Array], send_counts: jax.Array, recv_counts: jax.Array, capacity: int,
             axes: tuple[str, ...], size: int, chunk: int | None) -> list[jax.Array]:
    # Per-pair chunk: the balanced share of the buffer plus 25% for the random spread of real traffic, so that
    # near-balanced exchanges take one round.
    c = chunk or max(1, -(-5 * capacity // (4 * size)))
    send_offsets = _exclusive_cumsum(send_counts)
    recv_offsets = _exclusive_cumsum(recv_counts)
    total = jnp.sum(recv_counts)
    # Where each output row comes from: source rank and position within that source's block.
    rows = jnp.arange(capacity, dtype=jnp.int32)
    src = jnp.clip(jnp.searchsorted(recv_offsets + recv_counts, rows, side="right"), 0, size - 1).astype(jnp.int32)
    pos = rows - recv_offsets[src]
    row_valid = rows < total
    useful = jnp.minimum(jnp.max(send_counts), capacity)
    rounds = -(-useful // c)
    if axes:
        rounds = lax.pmax(rounds, axes)
    lanes = jnp.arange(c, dtype=jnp.int32)

    def one_round(t: jax.Array | int, outs: list[jax.Array] | None) -> list[jax.Array]:
        start = t * c
        idx = send_offsets[:, None] + start + lanes[None, :]  # (size, c)
        ok = (start + lanes)[None, :] < send_counts[:, None]
        take = row_valid & (pos >= start) & (pos < start + c)
        slot = jnp.clip(pos - start, 0, c - 1)
        new = []
        for k, a in enumerate(arrays):
            trailing = (1,) * (a.ndim - 1)
            safe = jnp.clip(idx, 0, max(a.shape[0] - 1, 0))
            buf = jnp.where(ok.reshape(ok.shape + trailing), a[safe], jnp.zeros((), a.dtype))
            recv = lax.all_to_all(buf, axes, 0, 0, tiled=True) if axes else buf
            vals = recv[src, slot]
            old = jnp.zeros((), a.dtype) if outs is None else outs[k]
            new.append(jnp.where(take.reshape(take.shape + trailing), vals, old))
        return new

    # Round 0 runs unconditionally (it also gives the loop carry its varying-over-ranks type); most calls need no more.
    first = one_round(0, None)
    return lax.fori_loop(1, jnp.maximum(rounds, 1), one_round, first)


def ragged_plan(send_counts: jax.Array, recv_counts: jax.Array, capacity: int,
                axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Arguments of ``lax.ragged_all_to_all`` for a packed, rank-ordered receive buffer of ``capacity`` rows.

    Returns ``(input_offsets, send_sizes, output_offsets, recv_sizes)``, each ``(size,)`` int32: where my block for
    peer ``j`` starts in my rows, how many of its rows fit at ``j``, where it goes in ``j``'s buffer, and how many rows
    I take from ``j``. Rows that would not fit are neither sent nor received (the caller reports overflow).
    """
    recv_offsets = _exclusive_cumsum(recv_counts).astype(jnp.int32)
    recv_sizes = jnp.clip(capacity - recv_offsets, 0, recv_counts).astype(jnp.int32)
    send_sizes = _exchange_counts(recv_sizes, axes)        # each receiver tells each sender how much fits
    output_offsets = _exchange_counts(recv_offsets, axes)  # ... and where in its buffer the block goes
    input_offsets = _exclusive_cumsum(send_counts).astype(jnp.int32)
    return input_offsets, send_sizes, output_offsets, recv_sizes


def _ragged(arrays: Sequence[jax.Array], send_counts: jax.Array, recv_counts: jax.Array, capacity: int,
            axes: tuple[str, ...]) -> list[jax.Array]:
    input_offsets, send_sizes, output_offsets, recv_sizes = ragged_plan(send_counts, recv_counts, capacity, axes)
    outs = []
    for a in arrays:
        out = jnp.zeros((capacity, *a.shape[1:]), a.dtype)
        outs.append(lax.ragged_all_to_all(a, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                          axis_name=axes))
    return outs


def _alltoallv_many(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                    impl: Impl, chunk: int | None) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    size = axes_size(axes)
    send_counts = jnp.maximum(jnp.asarray(send_counts, jnp.int32), 0)
    if send_counts.shape != (size,):
        raise ValueError(f"send_counts must have shape ({size},) (one count per rank), got {send_counts.shape}")
    recv_counts = _exchange_counts(send_counts, axes)
    overflow = jnp.sum(recv_counts) > capacity
    if axes and _use_ragged(impl):
        outs = _ragged(arrays, send_counts, recv_counts, capacity, axes)
    else:
        outs = _chunked(arrays, send_counts, recv_counts, capacity, axes, size, chunk)
    return outs, recv_counts, overflow


def alltoallv(x: jax.Array, send_counts: jax.Array, *, capacity: int, axis: AxisSpec = None,
              impl: Impl = "auto", chunk: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Variable-size all-to-all (``MPI_Alltoallv``) with a fixed-size receive buffer.

    Args:
        x: ``(n, ...)`` rows grouped by destination: the first ``send_counts[0]`` rows go to rank 0, the next
            ``send_counts[1]`` to rank 1, and so on; rows past ``sum(send_counts)`` are ignored.
        send_counts: ``(size,)`` int rows for each rank.
        capacity: rows of the receive buffer (static).
        axis: the mesh axes to exchange over (default: all manual axes).
        impl: ``"auto"`` (``ragged_all_to_all`` on GPU, chunked ``all_to_all`` elsewhere), ``"chunked"`` or
            ``"ragged"``.
        chunk: rows per rank pair and round of the chunked path (default ``ceil(1.25 * capacity / size)``).

    Returns:
        ``(data, recv_counts, overflow)``: ``data (capacity, ...)`` holds the received rows packed and grouped by
        source rank in rank order (zeros after them); ``recv_counts (size,)`` int32 rows received from each rank
        (even when they did not all fit); ``overflow`` is true on a rank that received more than ``capacity`` rows
        (the rows past ``capacity`` were not stored: raise ``capacity`` and call again).

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
    capacity = _check_capacity(capacity)
    axes = resolve_axes(axis)
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("alltoallv needs x with a leading row dimension, got a scalar")
    outs, recv_counts, overflow = _alltoallv_many([x], send_counts, capacity, axes, impl, chunk)
    return outs[0], recv_counts, overflow


def _row_count(tree: Any) -> int:
    pos = getattr(tree, "pos", None)
    if pos is not None:
        return int(jnp.shape(pos)[0])
    leaves = jax.tree.leaves(tree)
    if not leaves or jnp.ndim(leaves[0]) == 0:
        raise ValueError("exchange needs a pytree with a `.pos` field or whose first leaf has a leading row axis")
    return int(jnp.shape(leaves[0])[0])


def _with_num(tree: Any, num: jax.Array) -> Any:
    if not hasattr(tree, "num"):
        return tree
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, num=num)
    replace = getattr(tree, "_replace", None)  # namedtuple
    return replace(num=num) if replace is not None else tree


def exchange(tree: Any, dest: jax.Array, *, num: jax.Array | int, capacity: int, axis: AxisSpec = None,
             impl: Impl = "auto") -> tuple[Any, jax.Array, jax.Array]:
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

    Returns:
        ``(tree, num, overflow)``: leaves with leading length ``capacity``; ``num`` int32 rows now held (at most
        ``capacity``); ``overflow`` true on a rank that received more than ``capacity`` rows, or that was asked to
        send a valid row to a rank outside ``[0, size)`` (such rows are not sent).

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
    capacity = _check_capacity(capacity)
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
    key = jnp.where(valid & ~bad, dest, size)
    order = jnp.argsort(key, stable=True)
    send_counts = jnp.bincount(key, length=size + 1)[:size].astype(jnp.int32)
    leaves, treedef = jax.tree.flatten(tree)
    moving = [i for i, leaf in enumerate(leaves) if jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] == n]
    arrays = [jnp.asarray(leaves[i])[order] for i in moving]
    outs, recv_counts, overflow = _alltoallv_many(arrays, send_counts, capacity, axes, impl, None)
    new_leaves = list(leaves)
    for i, out in zip(moving, outs, strict=True):
        new_leaves[i] = out
    new_num = jnp.minimum(jnp.sum(recv_counts), capacity).astype(jnp.int32)
    overflow = overflow | jnp.any(bad)
    out_tree = _with_num(jax.tree.unflatten(treedef, new_leaves), new_num)
    return out_tree, new_num, overflow

"""The variable-size exchange of several arrays at once, below the public ``sx.comm.alltoallv``/``exchange``.

The chunked rounds, their sizing and the one-device copy are the engine in :mod:`shardax._exchange`; this module
picks the transport that carries them (XLA's ``all_to_all``, or the MPI transport's host call, which moves a whole
exchange in one ``MPI_Alltoallv``) and exchanges the counts. On GPUs ``impl="auto"`` uses
``lax.ragged_all_to_all`` instead of the rounds. :func:`alltoallv_many` is what the public functions and the
kernels that move several columns with one count exchange (the z-order sort, FoF's ghosts) call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from . import _mpi_prim as mpi
from ._exchange import (
    Chunk,
    Placement,
    chunked,
    exclusive_cumsum,
    local_copy,
    plan_route,
)
from .core import axes_index, axes_size, vary_over

Impl = Literal["auto", "chunked", "ragged"]

def _all_to_all(block: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Row ``j`` of a `(size, ...)` block to rank ``j`` over ``axes``, by the transport active there."""
    if not axes:
        return block
    if mpi.mpi_active(axes):
        return mpi.alltoall(block, axes)
    return lax.all_to_all(block, axes, 0, 0, tiled=True)


def _exchange_counts(send_counts: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Row ``j`` of ``send_counts`` (`(size,)` or `(size, k)`: one or ``k`` words per peer) to rank ``j``; returns
    what every rank sent me, in the same shape (one ``all_to_all`` however many words travel)."""
    if not axes:
        return send_counts
    words = send_counts.reshape(send_counts.shape[0], -1)
    return _all_to_all(words, axes).reshape(send_counts.shape)


def exchange_counts_and_max(send_counts: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """``(recv_counts, largest)``: the rows each rank sends me, and the largest count any rank sends another rank.

    One ``all_to_all``: every rank sends each peer its count for that peer and its own largest count to another
    rank, so the global maximum (which fixes the number of chunked rounds; the rows a rank keeps are copied
    locally) costs no separate ``pmax`` (across processes every collective costs milliseconds of latency, whatever
    its size).
    """
    others = jnp.arange(send_counts.shape[0], dtype=jnp.int32) != axes_index(axes)
    largest = jnp.max(jnp.where(others, send_counts, 0), initial=0)
    got = _exchange_counts(jnp.stack([send_counts, jnp.broadcast_to(largest, send_counts.shape)], axis=1), axes)
    return got[:, 0], jnp.max(got[:, 1])


def use_ragged(impl: Impl) -> bool:
    if impl not in ("auto", "chunked", "ragged"):
        raise ValueError(f"impl must be 'auto', 'chunked' or 'ragged', got {impl!r}")
    backend = jax.default_backend()
    if impl == "ragged":
        if backend == "cpu":
            raise ValueError("impl='ragged' needs a GPU or TPU backend (XLA:CPU does not implement "
                             "ragged_all_to_all): use impl='auto' or impl='chunked'")
        return True
    return impl == "auto" and backend in ("gpu", "cuda", "rocm")


def ragged_plan(send_counts: jax.Array, recv_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                recv_at: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Arguments of ``lax.ragged_all_to_all`` for a receive buffer of ``capacity`` rows.

    Returns ``(input_offsets, send_sizes, output_offsets, recv_sizes)``, each ``(size,)`` int32: where my block for
    peer ``j`` starts in my rows, how many of its rows fit at ``j``, where it goes in ``j``'s buffer, and how many rows
    I take from ``j``. Blocks are packed in rank order unless ``recv_at`` (`(size,)`, where each source's block
    starts) says otherwise. Rows that would not fit are neither sent nor received (the caller reports overflow).
    """
    recv_offsets = (exclusive_cumsum(recv_counts) if recv_at is None else recv_at).astype(jnp.int32)
    recv_sizes = jnp.clip(capacity - recv_offsets, 0, recv_counts).astype(jnp.int32)
    # Each receiver tells each sender how much fits and where in its buffer the block goes (one all_to_all).
    told = _exchange_counts(jnp.stack([recv_sizes, recv_offsets], axis=1), axes)
    send_sizes, output_offsets = told[:, 0], told[:, 1]
    input_offsets = exclusive_cumsum(send_counts).astype(jnp.int32)
    return input_offsets, send_sizes, output_offsets, recv_sizes


def _ragged(arrays: Sequence[jax.Array], send_counts: jax.Array, recv_counts: jax.Array, capacity: int,
            axes: tuple[str, ...], perm: jax.Array | None = None, recv_at: jax.Array | None = None,
            init: Sequence[jax.Array] | None = None) -> list[jax.Array]:
    input_offsets, send_sizes, output_offsets, recv_sizes = ragged_plan(send_counts, recv_counts, capacity, axes,
                                                                        recv_at)
    outs = []
    for k, a in enumerate(arrays):
        out = jnp.zeros((capacity, *a.shape[1:]), a.dtype) if init is None else init[k]
        source = a if perm is None else jnp.take(a, perm, axis=0, mode="clip")
        outs.append(lax.ragged_all_to_all(source, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                          axis_name=axes))
    return outs


def alltoallv_many(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                    impl: Impl, chunk: Chunk, *, perm: jax.Array | None = None, recv_at: jax.Array | None = None,
                    init: Sequence[jax.Array] | None = None, target: jax.Array | None = None,
                    row_maps: Sequence[Any] | None = None, plan: tuple[jax.Array, jax.Array] | None = None
                    ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """``alltoallv`` of several arrays with one count exchange; ``perm``, ``recv_at``, ``init``, ``target`` and
    ``row_maps`` as in :class:`shardax._exchange.Placement` (they let callers skip a permuted copy of the rows,
    receive into a prepared buffer, place every row at its own row of the receiver, or transform rows on the way;
    float rows placed so have no gradient rule). ``plan``: the
    ``(recv_counts, largest)`` of :func:`exchange_counts_and_max` when the caller already knows them (a route
    travelled before, either way): no count exchange then."""
    size = axes_size(axes)
    send_counts = jnp.maximum(jnp.asarray(send_counts, jnp.int32), 0)
    if send_counts.shape != (size,):
        raise ValueError(f"send_counts must have shape ({size},) (one count per rank), got {send_counts.shape}")
    if size == 1:  # nothing travels: no count exchange, no rounds
        if axes:
            use_ragged(impl)  # (checks the argument)
        recv_counts = send_counts
        overflow = send_counts[0] + (0 if recv_at is None else recv_at[0]) > capacity
        outs = local_copy(arrays, send_counts[0], capacity, Placement(perm, recv_at, init, target, row_maps))
        return vary_over(outs, axes), recv_counts, overflow
    if any(inexact(a) for a in arrays) or any(inexact(a) for a in init or ()):
        # Float rows get a gradient rule (the chunked rounds move them as uint32 words, which autodiff sees as
        # constants): see :mod:`shardax._alltoallv_ad`.
        from . import _alltoallv_ad as ad

        return ad.differentiable(arrays, send_counts, capacity, axes, impl, chunk, perm=perm, recv_at=recv_at,
                                 init=init, target=target, row_maps=row_maps, plan=plan)
    return alltoallv_raw(arrays, send_counts, capacity, axes, impl, chunk, perm=perm, recv_at=recv_at, init=init,
                         target=target, row_maps=row_maps, plan=plan)


def inexact(a: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def alltoallv_raw(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                  impl: Impl, chunk: Chunk, *, perm: jax.Array | None = None, recv_at: jax.Array | None = None,
                  init: Sequence[jax.Array] | None = None, target: jax.Array | None = None,
                  row_maps: Sequence[Any] | None = None, plan: tuple[jax.Array, jax.Array] | None = None
                  ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """:func:`alltoallv_many` on two or more ranks, without a gradient rule (``send_counts`` checked, int32)."""
    if plan is None and recv_at is None and init is None and target is None and mpi.mpi_active(axes):
        return _mpi_packed(arrays, send_counts, capacity, axes, perm, row_maps)
    recv_counts, largest = exchange_counts_and_max(send_counts, axes) if plan is None else plan
    if recv_at is None:
        overflow = jnp.sum(recv_counts) > capacity
    else:
        overflow = jnp.any(recv_at + recv_counts > capacity)
    if axes and use_ragged(impl) and row_maps is not None:
        arrays = [a if fn is None else fn(a) for a, fn in zip(arrays, row_maps, strict=True)]
        row_maps = None
    if axes and use_ragged(impl) and target is not None:
        # Packed by source first, then every row scattered to its target row.
        packed = _ragged(arrays, send_counts, recv_counts, capacity, axes, perm)
        (at,) = _ragged([target.astype(jnp.int32)], send_counts, recv_counts, capacity, axes)  # in send order
        live = jnp.arange(capacity, dtype=jnp.int32) < jnp.sum(recv_counts)
        at = jnp.where(live & (at >= 0) & (at < capacity), at, capacity)
        outs = [(jnp.zeros((capacity, *a.shape[1:]), a.dtype) if init is None else init[k]).at[at].set(p, mode="drop")
                for k, (a, p) in enumerate(zip(arrays, packed, strict=True))]
    elif axes and use_ragged(impl):
        outs = _ragged(arrays, send_counts, recv_counts, capacity, axes, perm, recv_at, init)
    else:
        outs = chunked(arrays, plan_route(send_counts, recv_counts, largest, recv_at), capacity=capacity, axes=axes,
                       chunk=chunk, all_to_all=functools.partial(_all_to_all, axes=axes),
                       place=Placement(perm, recv_at, init, target, row_maps))
    return outs, recv_counts, overflow


def _to_bytes(a: jax.Array) -> jax.Array:
    if a.dtype == jnp.bool_:
        a = a.astype(jnp.uint8)
    b = lax.bitcast_convert_type(a, jnp.uint8)
    return b.reshape(a.shape[0], -1)


def _from_bytes(b: jax.Array, like: jax.Array) -> jax.Array:
    shape = (b.shape[0], *like.shape[1:])
    if like.dtype == jnp.bool_:
        return b.reshape(shape) != 0
    if like.dtype.itemsize == 1:
        return lax.bitcast_convert_type(b.reshape(shape), like.dtype)
    return lax.bitcast_convert_type(b.reshape(*shape, like.dtype.itemsize), like.dtype)


def _mpi_packed(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                perm: jax.Array | None, row_maps: Sequence[Any] | None
                ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """The MPI transport's ``alltoallv``: every array's rows as bytes side by side, one ``MPI_Alltoallv``."""
    if row_maps is not None:
        arrays = [a if fn is None else fn(a) for a, fn in zip(arrays, row_maps, strict=True)]
    if perm is not None:
        arrays = [jnp.take(a, perm, axis=0, mode="clip") for a in arrays]
    if len(arrays) == 1:  # the host call moves any dtype as bytes itself
        data, recv_counts = mpi.ragged(arrays[0], send_counts, capacity, axes)
        return [data], recv_counts, jnp.sum(recv_counts) > capacity
    columns = [_to_bytes(a) for a in arrays]
    widths = [c.shape[1] for c in columns]
    data, recv_counts = mpi.ragged(jnp.concatenate(columns, axis=1) if len(columns) > 1 else columns[0],
                                   send_counts, capacity, axes)
    outs, col = [], 0
    for a, width in zip(arrays, widths, strict=True):
        outs.append(_from_bytes(data[:, col:col + width], a))
        col += width
    return outs, recv_counts, jnp.sum(recv_counts) > capacity

"""Gradients of the variable-size exchange (``alltoallv``, ``exchange``) on two or more ranks.

The exchange is a permutation of rows: row ``j`` of the block a rank sends to rank ``d`` lands at row
``recv_offsets[s] + j`` of ``d``'s receive buffer (``s`` the sender), unless it falls past ``capacity``. Its
transpose sends the cotangents of the received rows back the same way round: each receiver returns to each source
the rows it got from it, in the order they came, with the counts of the forward exchange (so no count exchange),
and rows that did not fit return zeros. A ``perm`` (the rows sent in the order ``a[perm]``) is transposed by a
scatter-add of the returned rows to ``perm``.

The chunked rounds move 4- and 8-byte rows as ``uint32`` words, and the MPI transport moves bytes through a host
call: autodiff would see constants there, so :func:`differentiable` wraps the whole exchange in a
``jax.custom_vjp`` whose backward pass is the reverse exchange above (on the chunked rounds, or the MPI transport's
``all_to_all``). Integer rows get no cotangent. Exchanges that place rows by ``recv_at``/``target``, write into
``init`` buffers or map rows on the way (internal callers only) have no gradient rule: differentiating a float
result of one raises :class:`NotImplementedError` rather than returning zeros. Forward-mode (``jax.jvp``) is not
supported (``jax.custom_vjp``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from . import _mpi_prim as mpi
from ._alltoallv import Impl, alltoallv_raw, exchange_counts_and_max, inexact
from ._exchange import Chunk
from .core import vary_over, varying


class _Static(NamedTuple):
    """What the backward pass needs that is not an array: the exchange's options and each array's row count,
    dtype and manual-axis type (its cotangent must have the same)."""

    capacity: int
    axes: tuple[str, ...]
    impl: Impl
    chunk: Chunk
    rows: tuple[int, ...]
    dtypes: tuple[Any, ...]
    vmas: tuple[frozenset[str], ...]
    row_maps: tuple[Any, ...] | None = None


def differentiable(arrays: Sequence[jax.Array], send_counts: jax.Array, capacity: int, axes: tuple[str, ...],
                   impl: Impl, chunk: Chunk, *, perm: jax.Array | None, recv_at: jax.Array | None,
                   init: Sequence[jax.Array] | None, target: jax.Array | None, row_maps: Sequence[Any] | None,
                   plan: tuple[jax.Array, jax.Array] | None) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """:func:`shardax._alltoallv.alltoallv_raw` with a gradient rule for its float arrays (see the module)."""
    arrays = tuple(jnp.asarray(a) for a in arrays)
    static = _Static(capacity, axes, impl, chunk, tuple(int(a.shape[0]) for a in arrays),
                     tuple(a.dtype for a in arrays), tuple(varying(a) for a in arrays),
                     None if row_maps is None else tuple(row_maps))
    if recv_at is None and init is None and target is None and row_maps is None:
        result: Any = _moved(static, arrays, send_counts, perm, plan)
    else:
        extra = (perm, recv_at, None if init is None else tuple(init), target, plan)
        result = _placed(static, arrays, send_counts, extra)
    outs, recv_counts, overflow = result
    return list(outs), recv_counts, overflow


# ---------------------------------------------------------------------------------------------- packed exchange


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moved(static: _Static, arrays: tuple[jax.Array, ...], send_counts: jax.Array, perm: jax.Array | None,
           plan: tuple[jax.Array, jax.Array] | None) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
    return _moved_fwd(static, arrays, send_counts, perm, plan)[0]


def _moved_fwd(static: _Static, arrays: tuple[jax.Array, ...], send_counts: jax.Array, perm: jax.Array | None,
               plan: tuple[jax.Array, jax.Array] | None) -> tuple[Any, Any]:
    if plan is None and not mpi.mpi_active(static.axes):  # (the MPI transport learns the counts in its host call)
        plan = exchange_counts_and_max(send_counts, static.axes)
    outs, recv_counts, overflow = alltoallv_raw(list(arrays), send_counts, static.capacity, static.axes, static.impl,
                                                static.chunk, perm=perm, plan=plan)
    largest = None if plan is None else plan[1]
    return (tuple(outs), recv_counts, overflow), (send_counts, perm, recv_counts, largest)


def _moved_bwd(static: _Static, res: Any, cts: Any) -> tuple[Any, ...]:
    send_counts, perm, recv_counts, largest = res
    outs_ct = cts[0]
    axes = static.axes
    floats = [k for k, dtype in enumerate(static.dtypes) if jnp.issubdtype(dtype, jnp.inexact)]
    if largest is None:  # the largest count any rank sent any rank: the largest any rank received
        largest = _reduce(jnp.max(recv_counts, initial=0), "max", axes)
    # One zero row past the buffer: the rows that did not fit (sent from past ``capacity``) return zeros.
    padded = [jnp.concatenate([outs_ct[k], jnp.zeros((1, *outs_ct[k].shape[1:]), outs_ct[k].dtype)])
              for k in floats]
    rows = perm.shape[0] if perm is not None else max(static.rows)
    # The reverse exchange: what I received from each rank goes back to it, into its send order; the counts are
    # those of the forward exchange, the other way round. The chunked rounds also for a forward on
    # ragged_all_to_all (which would read past the padded buffer for rows that did not fit).
    back, _, _ = alltoallv_raw(padded, recv_counts, max(rows, 1), axes, "chunked", static.chunk,
                               plan=(send_counts, largest))
    grads: list[Any] = [None] * len(static.rows)
    for k, g in zip(floats, back, strict=True):
        n = static.rows[k]
        if perm is not None:
            g = jnp.zeros((n, *g.shape[1:]), g.dtype).at[perm].add(g[:perm.shape[0]], mode="drop")
        else:
            g = jnp.pad(g, [(0, max(n - g.shape[0], 0))] + [(0, 0)] * (g.ndim - 1))[:n]
        grads[k] = _like(g.astype(static.dtypes[k]), static.vmas[k])
    return tuple(grads), None, None, None


_moved.defvjp(_moved_fwd, _moved_bwd)


def _reduce(x: jax.Array, op: str, axes: tuple[str, ...]) -> jax.Array:
    if not axes:
        return x
    if mpi.mpi_active(axes):
        return mpi.allreduce(x, op, axes)
    return lax.pmax(x, axes) if op == "max" else lax.psum(x, axes)


def _like(g: jax.Array, vma: frozenset[str]) -> jax.Array:
    """``g`` with the manual-axis type ``vma`` of its primal: summed over the axes only it varies over (the
    transpose of the implicit broadcast), marked varying over those only the primal varies over."""
    extra = tuple(sorted(varying(g) - vma))
    if extra:
        g = _reduce(g, "sum", extra)
    return vary_over(g, vma)


# ---------------------------------------------------------------------------------------------- placed exchange


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _placed(static: _Static, arrays: tuple[jax.Array, ...], send_counts: jax.Array, extra: tuple[Any, ...]
            ) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    perm, recv_at, init, target, plan = extra
    return alltoallv_raw(list(arrays), send_counts, static.capacity, static.axes, static.impl, static.chunk,
                         perm=perm, recv_at=recv_at, init=init, target=target, row_maps=static.row_maps, plan=plan)


def _placed_fwd(static: _Static, arrays: Any, send_counts: Any, extra: Any) -> tuple[Any, None]:
    return _placed(static, arrays, send_counts, extra), None


def _placed_bwd(static: _Static, res: None, cts: Any) -> tuple[Any, ...]:
    del res
    for ct in cts[0]:
        if inexact(ct):  # (integer results have float0 cotangents)
            raise NotImplementedError(
                "shardax: no gradient through an exchange that places rows by recv_at/target, writes into init "
                "buffers or maps rows on the way (an internal option of sx.comm's alltoallv); differentiate "
                "through sx.comm.alltoallv or sx.comm.exchange instead")
    return None, None, None


_placed.defvjp(_placed_fwd, _placed_bwd)
